"""Time loss forward + backward (assignment included) for detect / segment / pose.

    python benchmarks/loss.py --out DIR          # default DIR: $OUT or benchmarks/results/

640 px (A = 8400, masks 160x160), batch 4 / 16 / 64, 8-20 targets per image (M bucketed), head
outputs produced under BF16 autocast as in a training step (the losses compute in float32),
CUDA events, >= 10 warm-up iterations, median of >= 30. Writes ``loss_<date>.json`` with the
command, GPU, torch version, date and per-(task, batch, mode) medians. Targets (issue 3): segment
<= 8 / 15 / 35 ms at batch 4 / 16 / 64 (it includes the detect loss, as the segmentation
criterion does), detect and pose <= 6 ms at batch 4.

Two modes (``--modes eager,graph``):

- ``eager``: the loss called from Python as a training script would, op by op;
- ``graph``: the same function recorded once as a CUDA graph and replayed, which is how the loss
  runs inside ``capture="step"`` (static shapes, no host sync, so it can be captured). At small
  batches the eager figure is the cost of launching ~400 kernels from Python, not GPU work.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from yolo_func._types import DetectPreds, PosePreds, SegmentPreds  # noqa: E402
from yolo_func.assign import assign_from_detect, make_anchors  # noqa: E402
from yolo_func.losses import detect_loss, pose_loss, segment_loss  # noqa: E402
from yolo_func.structures import targets_from_flat  # noqa: E402


def make_batch(task, batch, size, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(8, 21, (batch,), generator=g)
    n = int(counts.sum())
    wh = torch.rand(n, 2, generator=g) * 0.3 + 0.02
    xy = wh / 2 + torch.rand(n, 2, generator=g) * (1 - wh)
    bi = torch.arange(batch).repeat_interleave(counts).float()
    nc = 1 if task == "pose" else 80
    hm = size // 4
    kw = {}
    if task == "segment":
        masks = torch.zeros(batch, hm, hm)
        start = 0
        for b, c in enumerate(counts.tolist()):  # data-pipeline side: rasterise boxes as masks
            for j in range(c):
                cx, cy, w, h = (torch.cat((xy, wh), -1)[start + j] * hm).tolist()
                masks[b, int(cy - h / 2):int(cy + h / 2), int(cx - w / 2):int(cx + w / 2)] = j + 1
            start += c
        kw["masks"] = masks
    if task == "pose":
        kw["keypoints"] = torch.cat((torch.rand(n, 17, 2, generator=g), torch.randint(0, 3, (n, 17, 1), generator=g).float()), -1)
    t = targets_from_flat(bi, torch.randint(0, nc, (n,), generator=g).float(), torch.cat((xy, wh), -1),
                          batch_size=batch, image_size=(size, size), **kw)
    t = type(t)(*(x.to(device) if x is not None else None for x in t))
    anchors = make_anchors([(size // s, size // s) for s in (8, 16, 32)], (8, 16, 32), device=device)
    A = anchors.points.shape[0]
    # Head outputs as BF16 leaves (what the heads emit under autocast).
    def leaf(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=torch.bfloat16).requires_grad_(True)

    dp = DetectPreds(leaf(batch, A, 64), leaf(batch, A, nc))
    head = None
    if task == "segment":
        head = SegmentPreds(leaf(batch, A, 32), leaf(batch, 32, hm, hm))
    elif task == "pose":
        head = PosePreds(leaf(batch, A, 51))
    return dp, head, t, anchors, nc


def loss_step(task, batch, size, device):
    """``(run, M)``: ``run()`` is one loss forward + backward (assignment included) on a fixed batch."""
    dp, head, t, anchors, nc = make_batch(task, batch, size, device)
    det = detect_loss(num_classes=nc)
    extra = segment_loss() if task == "segment" else pose_loss(kpt_shape=(17, 3)) if task == "pose" else None
    leaves = [*dp] + ([*head] if head is not None else [])

    def run():
        with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
            a = assign_from_detect(dp, t, anchors)
            total = det(dp, t, a)[0]
            if extra is not None:
                total = total + extra(head, t, a)[0]
        return torch.autograd.grad(total, leaves)

    return run, int(t.boxes.shape[1])


def capture(run, warmup: int = 3):
    """``(graph, outputs)``: ``run`` recorded as one CUDA graph after a side-stream warm-up."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture stream (allocator, lazy inits)
        for _ in range(warmup):
            run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    return graph, out


def graphed(run, warmup: int = 3):
    """Record ``run`` (static inputs inside it) as one CUDA graph; return its replay."""
    graph, out = capture(run, warmup)

    def replay():
        graph.replay()
        return out

    # ``run``'s closure owns the graph's static inputs (predictions, targets, anchors): keep it
    # alive with the replay, or the graph would read freed, reused memory.
    replay.run = run
    return replay


def time_task(task, batch, size, device, warmup, iters, mode="eager"):
    step, M = loss_step(task, batch, size, device)
    eager_grads = step()
    if mode == "graph":
        step = graphed(step)

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    torch.cuda.reset_peak_memory_stats()
    grads = step()
    torch.cuda.synchronize()
    # recorded, not asserted: the last call's gradients equal the first eager call's (the replay
    # runs the same kernels on the same static inputs; False would flag a broken capture)
    same = all(torch.equal(a, b) for a, b in zip(eager_grads, grads))
    return {"task": task, "batch": batch, "mode": mode, "M": M, "median_ms": statistics.median(times),
            "min_ms": min(times), "max_ms": max(times), "iters": iters, "warmup": warmup,
            "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30, "grads_equal_eager": same}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT") or str(Path(__file__).resolve().parent / "results"))
    p.add_argument("--batches", default="4,16,64")
    p.add_argument("--tasks", default="detect,segment,pose")
    p.add_argument("--size", type=int, default=640)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--modes", default="eager,graph")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("[yolo_func] benchmarks/loss.py needs a CUDA GPU")
    torch.backends.cuda.matmul.allow_tf32 = False
    now = datetime.datetime.now(datetime.timezone.utc)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"loss_{now:%Y%m%dT%H%M%S}.json"
    record = {"command": " ".join([sys.executable.split("/")[-1], *sys.argv]), "gpu": torch.cuda.get_device_name(),
              "torch": torch.__version__, "date": now.isoformat(timespec="seconds"), "size": args.size,
              "autocast": "bfloat16 (head outputs), losses in float32", "results": []}
    for task in args.tasks.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            for mode in args.modes.split(","):
                r = time_task(task, batch, args.size, "cuda", max(args.warmup, 10), max(args.iters, 30), mode)
                print(f"{task:8s} batch {batch:3d}  {mode:5s}  M {r['M']:3d}  median {r['median_ms']:7.2f} ms  "
                      f"peak {r['peak_mem_gib']:.2f} GiB  grads equal eager: {r['grads_equal_eager']}", flush=True)
                record["results"].append(r)
                path.write_text(json.dumps(record, indent=2))  # after every row: nothing lost on a cut-off run
                torch.cuda.empty_cache()
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
