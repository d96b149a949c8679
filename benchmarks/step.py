"""Training-step benchmark: our eager step, each replay level, the GPU floor and (when importable)
the reference's own eager step, side by side in one process.

    python benchmarks/step.py --out benchmarks/results            # all tasks x batches 4/16/64
    python benchmarks/step.py --tasks segment --batches 4 --steps 30
    python benchmarks/step.py --compile --variants eager network+heads step floor   # + compiled variants

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
- ``<variant>/compile`` for ``eager``, ``network``, ``network+heads``, ``step`` and ``floor``: the
  same with the network and heads compiled by inductor (``ReplayTrainStep(compile=...)``,
  :mod:`yolo_func.train.compiled`); ``--compile [MODE]`` adds them for every listed variant
  (MODE ``default`` or ``max-autotune``), or name them in ``--variants``. One
  :class:`~yolo_func.train.compiled.CompiledModel` per task is shared by its compiled variants, so
  a shape compiles once: before the memory pass, timed (``compile_s`` of the first compiled
  variant of each (task, batch); the others reuse it and report 0). Inductor's cache lives in
  ``TORCHINDUCTOR_CACHE_DIR``: a second run of the same shapes compiles in seconds.

Writes ``step_<date>.json`` and ``step_<date>.md`` (with the command, GPU, torch version, date).
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import math
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
from yolo_func.train.compiled import CompiledModel  # noqa: E402
from yolo_func.train.replay import ReplayTrainStep  # noqa: E402

_MODELS: dict = {}
_COMPILED: dict = {}
COMPILABLE = ("eager", "network", "network+heads", "step", "floor")


def _model(task):
    """One model per task (pure functions: sharing it lets compiled variants share their graphs)."""
    if task not in _MODELS:
        _MODELS[task] = yolov8("n", task=task)
    return _MODELS[task]


def _compiled(task, mode):
    if (task, mode) not in _COMPILED:
        _COMPILED[task, mode] = CompiledModel(_model(task), mode)
    return _COMPILED[task, mode]


def _ours(task, batch, level, **step_kw):
    model = _model(task)
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


def _floor(task, batch, compiled=None):
    model = _model(task)
    params, st = T.tree_to(model.init(torch.Generator().manual_seed(0)), "cuda", channels_last=True)
    b = synthetic_batch(task, batch, 640, num_classes=model.num_classes, seed=1, device="cuda")
    x = b.images.contiguous(memory_format=torch.channels_last)

    def fn(p, s, images):
        if compiled is None:
            preds, new_s = model.apply(p, s, images, train=True)
        else:  # the compiled network and heads, differentiated through autograd as one graph
            feats, net_s = compiled.network(p["network"], s["network"], images)
            outs = {n: compiled.head(n)(p["heads"][n], s["heads"][n], feats) for n in model.heads}
            preds = {n: o[0] for n, o in outs.items()}
            new_s = {"network": net_s, "heads": {n: o[1] for n, o in outs.items()}}
        return tuple(T.tree_leaves(preds)), new_s

    kw = {} if compiled is None else {"vjp": compiled.vjp("floor")}
    cap = capture_vjp(fn, params, st, x, autocast_dtype=torch.bfloat16, forward_context=update_stats_in_place, **kw)
    ones = None

    def run():
        nonlocal ones
        outs, _ = cap.forward(cap.static.params, cap.static.state, cap.static.x)
        if ones is None:
            ones = T.tree_map(torch.ones_like, outs)  # d(sum of outputs)
        cap.backward(ones)

    return run


def _reference(task, batch, channels_last, *, device="cuda", size=640, autocast_dtype=torch.bfloat16,
               max_boxes=16, min_boxes=4, trainer=False, accumulate=1):
    """The reference's eager step as a ``run()`` closure: its model from the yaml, its criterion on a
    batch dict (public API only), ``loss.sum().backward()``, ``torch.optim.SGD`` (Nesterov) step,
    ``zero_grad``. ``device="cpu"`` and ``autocast_dtype=None`` give the CPU float32 step
    (``benchmarks/eager_ops.py --reference``).

    ``trainer=True`` adds what the reference's trainer does around that step (shared/REFERENCE.md
    §4.3 and §4.4), written here with plain public torch (not the reference's code): after the
    backward ``torch.nn.utils.clip_grad_norm_(params, max_norm=10.0)``, then the SGD step and
    ``zero_grad``, then an EMA update of every floating-point ``state_dict()`` entry (parameters and
    BN running statistics, not ``num_batches_tracked``): ``d = 0.9999 * (1 - exp(-u / 2000))`` with
    ``u`` the updates including this one, ``ema.lerp_(model, 1 - d)`` (= ``ema + (1 - d)(model -
    ema)``), one in-place op per entry. No GradScaler (float32; the benchmark is the CPU step).

    ``accumulate`` > 1: the backward every call (gradients add up in ``.grad``), the clip, step,
    ``zero_grad`` and EMA every ``accumulate``-th call, as the reference's trainer does (§4.3)."""
    os.environ.setdefault("YOLO_OFFLINE", "1")
    os.environ.setdefault("YOLO_CONFIG_DIR", "/tmp/ycfg")
    from ultralytics.cfg import get_cfg
    from ultralytics.nn.tasks import DetectionModel, PoseModel, SegmentationModel

    cls, yaml, nc = {"detect": (DetectionModel, "yolov8n.yaml", 80), "segment": (SegmentationModel, "yolov8n-seg.yaml", 80),
                     "pose": (PoseModel, "yolov8n-pose.yaml", 1)}[task]
    torch.manual_seed(0)
    ref = cls(yaml, nc=nc, verbose=False).to(device)
    ref.args = get_cfg()
    if channels_last:
        ref = ref.to(memory_format=torch.channels_last)
    ref.train()
    crit = ref.init_criterion()
    opt = torch.optim.SGD(ref.parameters(), lr=0.01, momentum=0.937, nesterov=True)
    b = synthetic_batch(task, batch, size, num_classes=nc, max_boxes=max_boxes, min_boxes=min_boxes, seed=1,
                        device=device)
    t = b.targets
    bi, j = t.valid.nonzero(as_tuple=True)
    xyxy = t.boxes[bi, j] / size
    flat = {
        "batch_idx": bi.float(), "cls": t.classes[bi, j].float()[:, None],
        "bboxes": torch.cat(((xyxy[:, :2] + xyxy[:, 2:]) / 2, xyxy[:, 2:] - xyxy[:, :2]), 1),
        "img": b.images,
    }
    if task == "segment":
        flat["masks"] = t.masks.float()
    if task == "pose":
        kp = t.keypoints[bi, j].clone()
        kp[..., :2] /= size
        flat["keypoints"] = kp
    images = b.images.contiguous(memory_format=torch.channels_last) if channels_last else b.images

    params = [p for p in ref.parameters() if p.requires_grad]
    ema_sd = {k: v.detach().clone() for k, v in ref.state_dict().items() if v.dtype.is_floating_point}
    updates = [0]
    calls = [0]

    def run():
        with torch.autocast(torch.device(device).type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            preds = ref(images)
            loss, _ = crit(preds, flat)
        loss.sum().backward()
        calls[0] += 1
        if calls[0] % accumulate:
            return  # accumulating: the gradients stay in .grad
        if trainer:
            torch.nn.utils.clip_grad_norm_(params, max_norm=10.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if trainer:
            with torch.no_grad():
                updates[0] += 1
                d = 0.9999 * (1 - math.exp(-updates[0] / 2000))
                msd = ref.state_dict()
                for k, e in ema_sd.items():
                    e.lerp_(msd[k], 1 - d)

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
    ap.add_argument("--compile", nargs="?", const="default", default=None, choices=["default", "max-autotune"],
                    help="add '<variant>/compile' for each listed variant among " + ", ".join(COMPILABLE)
                    + " (inductor mode; default 'default')")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    args = ap.parse_args()
    assert torch.cuda.is_available(), "needs a CUDA GPU"
    torch.backends.cudnn.benchmark = False
    if not _has_reference():
        args.variants = [v for v in args.variants if not v.startswith("ref")]
    if args.compile is not None:
        args.variants += [f"{v}/compile" for v in args.variants if v in COMPILABLE and f"{v}/compile" not in args.variants]
    known = (*COMPILABLE, "network/eager-update", "ref_nchw", "ref_cl", *(f"{v}/compile" for v in COMPILABLE))
    unknown = [v for v in args.variants if v not in known]
    if unknown:
        ap.error(f"unknown variant(s) {unknown}")
    compile_mode = args.compile or "default"
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
        "compile_mode": compile_mode if any(v.endswith("/compile") for v in args.variants) else None,
        "inductor_cache_dir": os.environ.get("TORCHINDUCTOR_CACHE_DIR"),
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
        "eager/compile": lambda t, b: _ours(t, b, "none", compile=_compiled(t, compile_mode)),
        "network/compile": lambda t, b: _ours(t, b, "network", compile=_compiled(t, compile_mode)),
        "network+heads/compile": lambda t, b: _ours(t, b, "network+heads", compile=_compiled(t, compile_mode)),
        "step/compile": lambda t, b: _ours(t, b, "step", compile=_compiled(t, compile_mode)),
        "floor/compile": lambda t, b: _floor(t, b, _compiled(t, compile_mode)),
    }
    for task in args.tasks:
        for batch in args.batches:
            runs, mem, compile_s, failed = {}, {}, {}, set()
            for v in args.variants:  # pass 0: compile this shape (host seconds), before memory is measured
                if not v.endswith("/compile"):
                    continue
                cm = _compiled(task, compile_mode)
                before = cm.compile_seconds
                try:
                    fn = builders[v](task, batch)
                    for _ in range(2):
                        fn()
                    torch.cuda.synchronize()
                    del fn
                except Exception as e:  # keep going: report what failed
                    traceback.print_exc()
                    failed.add(v)
                    results.append({"task": task, "batch": batch, "variant": v, "error": f"{type(e).__name__}: {e}"[:500]})
                compile_s[v] = cm.compile_seconds - before
            for v in args.variants:  # pass 1: peak reserved memory, each variant alone
                if v in failed:
                    continue
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
                if v in compile_s:
                    r["compile_s"] = round(compile_s[v], 2)
                results.append(r)
                print(json.dumps(r), flush=True)
            del runs
            gc.collect()
            torch.cuda.empty_cache()
            json.dump({"meta": meta, "results": results}, open(out / f"step_{stamp}.json", "w"), indent=1)
    # Markdown table
    compiled_cols = int(meta["compile_mode"] is not None)
    rows = {}
    for r in results:
        if "median_ms" in r:
            rows.setdefault((r["task"], r["batch"]), {})[r["variant"]] = r
    lines = [f"# Training step, yolov8n, 640 px, BF16 — {meta['gpu']}, torch {meta['torch']}, {stamp}", "",
             f"Command: `{meta['command']}`", "",
             "median ms per step (peak reserved MiB); speed-up = ref_cl / variant", "",
             "| task | batch | " + " | ".join(args.variants) + " | step vs ref_cl | step vs floor | network vs eager |"
             + (" step/compile vs floor/compile | compile s |" if compiled_cols else ""),
             "|---|---:|" + "---:|" * (len(args.variants) + 3 + 2 * compiled_cols)]
    for (task, batch), vs in rows.items():
        cells = [f"{vs[v]['median_ms']:.2f} ({vs[v]['peak_reserved_mib']:.0f})" if v in vs else "–" for v in args.variants]
        sp = lambda a, b: f"{vs[a]['median_ms'] / vs[b]['median_ms']:.2f}x" if a in vs and b in vs else "–"  # noqa: E731
        red = (f"{100 * (1 - vs['network']['median_ms'] / vs['eager']['median_ms']):.0f}% shorter"
               if "network" in vs and "eager" in vs else "–")
        extra = ""
        if compiled_cols:
            secs = sum(r.get("compile_s", 0.0) for r in vs.values())
            extra = f" {sp('step/compile', 'floor/compile')} | {secs:.0f} |"
        lines.append(f"| {task} | {batch} | " + " | ".join(cells) + f" | {sp('ref_cl', 'step')} | {sp('step', 'floor')} | {red} |"
                     + extra)
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
