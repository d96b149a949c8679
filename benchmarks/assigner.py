"""Time the task-aligned assigner: the dense formulation vs the lean one (eager and inductor).

    python benchmarks/assigner.py --device cuda                      # eager + CUDA-graph replay, B 16 / 64
    python benchmarks/assigner.py --device cpu --batches 16 --iters 5 # the CPU figures

Inputs as in a 640 px training step: A = 8400 anchors, K = 80 classes, 8-20 targets per image
padded to M = 32 (``--m``), float32 predictions (what ``assign_from_detect`` hands the assigner).
Variants (``--variants``):

- ``dense``: ``yolo_func.assign.tal_dense.assign_dense``, the assigner before issue 17;
- ``lean``: ``yolo_func.assign.assign`` (the default), bitwise equal to ``dense``;
- ``dense_select`` / ``lean_select``: the same two with the metrics (in-box test, CIoU,
  alignment; shared and identical) precomputed, i.e. the selection alone (top-k, conflicts,
  targets, soft scores): what the lean formulation changes;
- ``lean_compiled`` / ``dense_compiled``: ``torch.compile(..., backend="inductor")`` of either
  (compile time reported; their floats may differ from eager in the last bits, so they are timed,
  not used by default).

Modes (``--modes``): ``eager`` (op by op from Python) and, on CUDA, ``graph`` (one call recorded as
a CUDA graph and replayed, which is how the assigner runs inside ``capture="step"``). For every
variant the script records the dispatched aten ops of one eager call (the counter of
``tests/train/test_eager_ops.py``), the non-view ops that touch a tensor of >= B*M*A elements
(``bma_ops``: the passes over ``[B, M, A]``, plus a few gathers that read them at A points and
the ``[B, A, K]`` score ops when K > M) and whether its outputs equal ``dense``'s bit for bit.
Timing: CUDA events (CUDA) or ``perf_counter`` (CPU), warm-up, median. Writes
``assigner_<device>_<date>.json`` and ``.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from yolo_func._types import Targets  # noqa: E402
from yolo_func.assign import assign, make_anchors  # noqa: E402
from yolo_func.assign import tal, tal_dense  # noqa: E402
from yolo_func.assign.tal_dense import assign_dense  # noqa: E402
from yolo_func.testing import count_aten_ops  # noqa: E402


def make_inputs(batch: int, m: int, size: int, num_classes: int, device: str, seed: int = 0):
    """``(scores float[B,A,K], boxes float[B,A,4], anchors, targets)`` like a mid-training step."""
    g = torch.Generator().manual_seed(seed)
    anchors = make_anchors([(size // s, size // s) for s in (8, 16, 32)], (8, 16, 32))
    A = anchors.points.shape[0]
    px = anchors.points * anchors.strides
    scores = torch.rand(batch, A, num_classes, generator=g).pow(4)  # mostly small probabilities
    half = torch.rand(batch, A, 2, generator=g) * 60 + 4
    boxes = torch.cat((px - half, px + half), -1) + torch.randn(batch, A, 4, generator=g) * 4
    counts = torch.randint(8, min(20, m) + 1, (batch,), generator=g)
    valid = torch.arange(m)[None] < counts[:, None]
    wh = torch.rand(batch, m, 2, generator=g) * size * 0.4 + 4
    xy = torch.rand(batch, m, 2, generator=g) * (size - wh)
    gt = torch.where(valid[..., None], torch.cat((xy, xy + wh), -1), 0.0)
    classes = torch.where(valid, torch.randint(0, num_classes, (batch, m), generator=g), -1)
    targets = Targets(gt.to(device), classes.to(device), valid.to(device))
    anchors = type(anchors)(anchors.points.to(device), anchors.strides.to(device))
    return scores.to(device), boxes.to(device), anchors, targets


def selection_only(module, fn, inputs):
    """``fn`` with ``module._metrics`` replaced by its precomputed result (the selection alone)."""
    scores, boxes, anchors, targets = inputs
    px = (anchors.points * anchors.strides).to(boxes.dtype)
    with torch.no_grad():
        pre = module._metrics(scores, boxes, px, targets, alpha=0.5, beta=6.0, eps=1e-9, enlarge_to=16.0)

    def run(*args, **kw):
        real = module._metrics
        module._metrics = lambda *a, **k: pre
        try:
            return fn(*args, **kw)
        finally:
            module._metrics = real

    return run


def _bits_equal(a, b) -> bool:
    for x, y in zip(a[:4], b[:4]):
        if x.dtype == torch.float32:
            x, y = x.view(torch.int32), y.view(torch.int32)
        if not torch.equal(x, y):
            return False
    return True


def _discrete_equal(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a[:3], b[:3]))


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def time_fn(fn, device, warmup, iters):
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(iters):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), min(times)


def graphed(fn, warmup=3):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()

    def replay():
        graph.replay()
        return out

    replay.keep = (fn, graph)
    return replay


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cpu", "cuda"))
    p.add_argument("--out", default=os.environ.get("OUT") or str(Path(__file__).resolve().parent / "results"))
    p.add_argument("--batches", default="16,64")
    p.add_argument("--m", type=int, default=32, help="padded targets per image (M)")
    p.add_argument("--size", type=int, default=640)
    p.add_argument("--classes", type=int, default=80)
    p.add_argument("--variants", default="dense,lean,dense_select,lean_select,lean_compiled,dense_compiled")
    p.add_argument("--modes", default=None, help="eager[,graph]; default eager,graph on CUDA, eager on CPU")
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--iters", type=int, default=None)
    args = p.parse_args(argv)
    dev = args.device
    if dev == "cuda" and not torch.cuda.is_available():
        raise SystemExit("[yolo_func] benchmarks/assigner.py: --device cuda but CUDA is not available")
    modes = (args.modes or ("eager,graph" if dev == "cuda" else "eager")).split(",")
    if "graph" in modes and dev != "cuda":
        raise SystemExit("[yolo_func] benchmarks/assigner.py: --modes graph needs --device cuda")
    warmup = args.warmup if args.warmup is not None else (10 if dev == "cuda" else 1)
    iters = args.iters if args.iters is not None else (30 if dev == "cuda" else 5)
    now = datetime.datetime.now(datetime.timezone.utc)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"assigner_{dev}_{now:%Y%m%dT%H%M%S}"
    record = {"command": " ".join(["python", *sys.argv]), "device": torch.cuda.get_device_name() if dev == "cuda"
              else f"cpu ({torch.get_num_threads()} threads)", "torch": torch.__version__,
              "date": now.isoformat(timespec="seconds"), "size": args.size, "M": args.m, "K": args.classes,
              "warmup": warmup, "iters": iters, "results": []}
    compiled = torch.compile(assign, backend="inductor", dynamic=False)
    fns = {"dense": assign_dense, "lean": assign, "lean_compiled": compiled,
           "dense_compiled": torch.compile(assign_dense, backend="inductor", dynamic=False)}
    for batch in (int(b) for b in args.batches.split(",")):
        inputs = make_inputs(batch, args.m, args.size, args.classes, dev)
        ref = assign_dense(*inputs)
        for name in args.variants.split(","):
            if name.endswith("_select"):
                fn = selection_only(tal_dense if name == "dense_select" else tal, fns[name[:-len("_select")]], inputs)
            else:
                fn = fns[name]
            row = {"batch": batch, "variant": name, "A": int(inputs[2].points.shape[0])}
            if name.endswith("_compiled"):
                _sync(dev)
                t0 = time.perf_counter()
                fn(*inputs)
                _sync(dev)
                row["compile_s"] = round(time.perf_counter() - t0, 2)
            else:
                with count_aten_ops() as c:
                    fn(*inputs)
                row["aten_ops"] = c.total
                with count_aten_ops(min_numel=batch * args.m * row["A"]) as big:
                    fn(*inputs)
                row["bma_ops"] = big.total
            res = fn(*inputs)
            row["bitwise_equal_dense"] = _bits_equal(res, ref)
            row["fg_gt_idx_boxes_equal_dense"] = _discrete_equal(res, ref)
            row["max_abs_score_diff"] = float((res.target_scores - ref.target_scores).abs().max())
            for mode in modes:
                call = (lambda fn=fn: fn(*inputs)) if mode == "eager" else graphed(lambda fn=fn: fn(*inputs))
                med, lo = time_fn(call, dev, warmup, iters)
                row[f"{mode}_median_ms"], row[f"{mode}_min_ms"] = round(med, 3), round(lo, 3)
            record["results"].append(row)
            print(json.dumps(row), flush=True)
            stem.with_suffix(".json").write_text(json.dumps(record, indent=2))
        del inputs, ref
        if dev == "cuda":
            torch.cuda.empty_cache()
    lines = [f"# assigner benchmark ({record['device']}, torch {record['torch']}, {record['date']})", "",
             f"`{record['command']}`", "",
             f"{args.size} px (A = {record['results'][0]['A']}), M = {args.m} padded (8-20 valid), K = {args.classes}; "
             f"median of {iters} after {warmup} warm-up.", "",
             "| B | variant | aten ops (eager) | ops on >= B*M*A elements | "
             + " | ".join(f"{m} median / min ms" for m in modes) + " | bitwise = dense | compile s |",
             "| --: | --- | --: | --: | " + " | ".join("--:" for _ in modes) + " | --- | --: |"]
    for r in record["results"]:
        lines.append(f"| {r['batch']} | {r['variant']} | {r.get('aten_ops', '')} | {r.get('bma_ops', '')} | "
                     + " | ".join(f"{r[f'{m}_median_ms']} / {r[f'{m}_min_ms']}" for m in modes)
                     + f" | {r['bitwise_equal_dense']} (fg/idx/boxes {r['fg_gt_idx_boxes_equal_dense']}, "
                       f"max score diff {r['max_abs_score_diff']:.1e}) | {r.get('compile_s', '')} |")
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"wrote {stem}.json and .md")


if __name__ == "__main__":
    main()
