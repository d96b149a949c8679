"""Training-step benchmark: our eager step, each replay level, the GPU floor and (when importable)
the reference's own eager step, side by side in one process.

    python benchmarks/step.py --out benchmarks/results            # all tasks x batches 4/16/64
    python benchmarks/step.py --tasks segment --batches 4 --steps 30

For every (task, batch) at 640 px, nano, BF16 autocast: median step time over >= 30 timed steps
after >= 10 warm-up steps (CUDA events around each step; variants alternate step by step so drift
hits them alike) and peak reserved memory (measured per variant in a separate pass: built alone,
3 steps, from an emptied cache, then freed). Variants:

- ``eager``: :func:`yolo_func.train.train_step` (channels_last params and images).
- ``network``, ``network+heads``, ``step``: :class:`yolo_func.train.replay.ReplayTrainStep` levels.
- ``network/eager-update``: ``network`` with ``replay_update=False`` (guard, optimizer and EMA
  eager after the replayed network backward).
- ``floor``: our network + heads forward and backward as captured graphs with a trivial loss
  (sum of every head output): no assignment, no real loss, no optimizer.
- ``ref_nchw``, ``ref_cl``: the reference package's model + criterion + ``torch.optim.SGD`` step
  (forward, loss, ``loss.sum().backward()``, step, zero_grad) under BF16 autocast, NCHW and
  channels_last; skipped when ``ultralytics`` is not importable.

Writes ``step_<date>.json`` and ``step_<date>.md`` (with the command, GPU, torch version, date).
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from yolo_func import tree as T  # noqa: E402
from yolo_func import yolov8  # noqa: E402
from yolo_func.capture import capture_vjp  # noqa: E402
from yolo_func.nn import update_stats_in_place  # noqa: E402
from yolo_func.optim import ema  # noqa: E402
from yolo_func.testing.synthetic import synthetic_batch  # noqa: E402
from yolo_func.train import init_train_state, yolo_sgd  # noqa: E402
from yolo_func.train.replay import ReplayTrainStep  # noqa: E402


def _ours(task, batch, level, **step_kw):
    model = yolov8("n", task=task)
    opt = yolo_sgd(batch_size=batch, batches_per_epoch=1000, epochs=100)
    e = ema()
    ts = init_train_state(model, opt.tx, torch.Generator().manual_seed(0), device="cuda", ema=e)
    step = ReplayTrainStep(model, opt.tx, ema=e, capture=level, **step_kw)
    b = synthetic_batch(task, batch, 640, num_classes=model.num_classes, max_boxes=16, min_boxes=4, seed=1, device="cuda")
    state = {"ts": ts}

    def run():
        state["ts"], m = step(state["ts"], b)
        return m

    return run


def _floor(task, batch):
    model = yolov8("n", task=task)
    params, st = T.tree_to(model.init(torch.Generator().manual_seed(0)), "cuda", channels_last=True)
    b = synthetic_batch(task, batch, 640, num_classes=model.num_classes, seed=1, device="cuda")
    x = b.images.contiguous(memory_format=torch.channels_last)

    def fn(p, s, images):
        preds, new_s = model.apply(p, s, images, train=True)
        return tuple(T.tree_leaves(preds)), new_s

    cap = capture_vjp(fn, params, st, x, autocast_dtype=torch.bfloat16, forward_context=update_stats_in_place)
    ones = None

    def run():
        nonlocal ones
        outs, _ = cap.forward(cap.static.params, cap.static.state, cap.static.x)
        if ones is None:
            ones = T.tree_map(torch.ones_like, outs)  # d(sum of outputs)
        cap.backward(ones)

    return run


def _reference(task, batch, channels_last):
    os.environ.setdefault("YOLO_OFFLINE", "1")
    os.environ.setdefault("YOLO_CONFIG_DIR", "/tmp/ycfg")
    from ultralytics.cfg import get_cfg
    from ultralytics.nn.tasks import DetectionModel, PoseModel, SegmentationModel

    cls, yaml, nc = {"detect": (DetectionModel, "yolov8n.yaml", 80), "segment": (SegmentationModel, "yolov8n-seg.yaml", 80),
                     "pose": (PoseModel, "yolov8n-pose.yaml", 1)}[task]
    torch.manual_seed(0)
    ref = cls(yaml, nc=nc, verbose=False).cuda()
    ref.args = get_cfg()
    if channels_last:
        ref = ref.to(memory_format=torch.channels_last)
    ref.train()
    crit = ref.init_criterion()
    opt = torch.optim.SGD(ref.parameters(), lr=0.01, momentum=0.937, nesterov=True)
    b = synthetic_batch(task, batch, 640, num_classes=nc, max_boxes=16, min_boxes=4, seed=1, device="cuda")
    t = b.targets
    bi, j = t.valid.nonzero(as_tuple=True)
    xyxy = t.boxes[bi, j] / 640
    flat = {
        "batch_idx": bi.float(), "cls": t.classes[bi, j].float()[:, None],
        "bboxes": torch.cat(((xyxy[:, :2] + xyxy[:, 2:]) / 2, xyxy[:, 2:] - xyxy[:, :2]), 1),
        "img": b.images,
    }
    if task == "segment":
        flat["masks"] = t.masks.float()
    if task == "pose":
        kp = t.keypoints[bi, j].clone()
        kp[..., :2] /= 640
        flat["keypoints"] = kp
    images = b.images.contiguous(memory_format=torch.channels_last) if channels_last else b.images

    def run():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            preds = ref(images)
            loss, _ = crit(preds, flat)
        loss.sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return run


def _peak_reserved_mib(build) -> float:
    """Peak reserved memory (MiB) of building a variant and running 3 steps, from an emptied cache
    with nothing else alive: a variant measured after others could place its tensors in their
    cached, partly used segments and look smaller than it is."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_reserved()
    torch.cuda.reset_peak_memory_stats()
    fn = build()
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_reserved() - base
    del fn
    gc.collect()
    torch.cuda.empty_cache()
    return peak / 2**20


def _has_reference() -> bool:
    try:
        import ultralytics  # noqa: F401
    except Exception:
        return False
    return True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tasks", nargs="+", default=["detect", "segment", "pose"])
    ap.add_argument("--batches", nargs="+", type=int, default=[4, 16, 64])
    ap.add_argument("--variants", nargs="+", default=["eager", "network", "network/eager-update", "network+heads", "step",
                                                      "floor", "ref_nchw", "ref_cl"])
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    args = ap.parse_args()
    assert torch.cuda.is_available(), "needs a CUDA GPU"
    torch.backends.cudnn.benchmark = False
    if not _has_reference():
        args.variants = [v for v in args.variants if not v.startswith("ref")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H%M%SZ")
    meta = {
        "command": "python " + " ".join(sys.argv),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "date": stamp,
        "image_size": 640,
        "scale": "n",
        "autocast": "bf16",
        "warmup": args.warmup,
        "timed_steps": args.steps,
    }
    results = []
    builders = {
        "eager": lambda t, b: _ours(t, b, "none"),
        "network": lambda t, b: _ours(t, b, "network"),
        "network/eager-update": lambda t, b: _ours(t, b, "network", replay_update=False),
        "network+heads": lambda t, b: _ours(t, b, "network+heads"),
        "step": lambda t, b: _ours(t, b, "step"),
        "floor": _floor,
        "ref_nchw": lambda t, b: _reference(t, b, False),
        "ref_cl": lambda t, b: _reference(t, b, True),
    }
    for task in args.tasks:
        for batch in args.batches:
            runs, mem = {}, {}
            for v in args.variants:  # pass 1: peak reserved memory, each variant alone
                try:
                    mem[v] = _peak_reserved_mib(lambda: builders[v](task, batch))
                except Exception as e:  # keep going: report what failed
                    traceback.print_exc()
                    results.append({"task": task, "batch": batch, "variant": v, "error": f"{type(e).__name__}: {e}"[:500]})
            for v in mem:  # pass 2: build again for timing, all alive at once
                runs[v] = builders[v](task, batch)
            times = {v: [] for v in runs}
            for i in range(args.warmup + args.steps):  # pass 2: alternate variants step by step
                for v, fn in runs.items():
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    fn()
                    end.record()
                    end.synchronize()
                    if i >= args.warmup:
                        times[v].append(start.elapsed_time(end))
            for v, ts in times.items():
                r = {"task": task, "batch": batch, "variant": v, "median_ms": statistics.median(ts),
                     "p10_ms": sorted(ts)[len(ts) // 10], "p90_ms": sorted(ts)[(9 * len(ts)) // 10],
                     "peak_reserved_mib": mem[v]}
                results.append(r)
                print(json.dumps(r), flush=True)
            del runs
            gc.collect()
            torch.cuda.empty_cache()
            json.dump({"meta": meta, "results": results}, open(out / f"step_{stamp}.json", "w"), indent=1)
    # Markdown table
    rows = {}
    for r in results:
        if "median_ms" in r:
            rows.setdefault((r["task"], r["batch"]), {})[r["variant"]] = r
    lines = [f"# Training step, yolov8n, 640 px, BF16 — {meta['gpu']}, torch {meta['torch']}, {stamp}", "",
             f"Command: `{meta['command']}`", "",
             "median ms per step (peak reserved MiB); speed-up = ref_cl / variant", "",
             "| task | batch | " + " | ".join(args.variants) + " | step vs ref_cl | step vs floor | network vs eager |",
             "|---|---:|" + "---:|" * (len(args.variants) + 3)]
    for (task, batch), vs in rows.items():
        cells = [f"{vs[v]['median_ms']:.2f} ({vs[v]['peak_reserved_mib']:.0f})" if v in vs else "–" for v in args.variants]
        sp = lambda a, b: f"{vs[a]['median_ms'] / vs[b]['median_ms']:.2f}x" if a in vs and b in vs else "–"  # noqa: E731
        red = (f"{100 * (1 - vs['network']['median_ms'] / vs['eager']['median_ms']):.0f}% shorter"
               if "network" in vs and "eager" in vs else "–")
        lines.append(f"| {task} | {batch} | " + " | ".join(cells) + f" | {sp('ref_cl', 'step')} | {sp('step', 'floor')} | {red} |")
    errors = [r for r in results if "error" in r]
    if errors:
        lines += ["", "Errors:"] + [f"- {r['task']} b{r['batch']} {r['variant']}: {r['error']}" for r in errors]
    (out / f"step_{stamp}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    t0 = time.time()
    rc = main()
    print(f"total {time.time() - t0:.0f} s")
    sys.exit(rc)
