"""Where the memory of a two-graph (forward / backward) network capture goes.

    python benchmarks/diag_capture_memory.py --task detect --batch 64

The network levels hold ~1.3x the eager step's peak reserved memory while the whole-step graph
holds ~1.05x. This measures, for the network's forward + backward alone (640 px, BF16,
channels_last), each from an emptied cache:

- ``eager``: ``torch.func.vjp`` + first-order pullback, peak reserved / allocated;
- ``capture_vjp``: our two graphs (backward recorded with ``retain_graph=False``): peak reserved
  over warm-up + capture, and what stays reserved / allocated afterwards (the pool);
- ``autograd_two_graphs``: the same two graphs recorded with plain autograd
  (``torch.autograd.grad(..., retain_graph=False)``) instead of torch.func, one pool;
- ``one_graph``: forward and backward recorded as one graph (what ``capture_step`` does).

Prints one JSON line per variant (MiB).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from yolo_func import tree as T  # noqa: E402
from yolo_func import yolov8  # noqa: E402
from yolo_func.capture import capture_vjp  # noqa: E402
from yolo_func.nn import update_stats_in_place  # noqa: E402
from yolo_func.testing.synthetic import synthetic_batch  # noqa: E402

MIB = 2**20


def _fresh():
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_reserved(), torch.cuda.memory_allocated()


def _report(name, base, **extra):
    torch.cuda.synchronize()
    r0, a0 = base
    row = {"variant": name,
           "peak_reserved_mib": round((torch.cuda.max_memory_reserved() - r0) / MIB),
           "peak_allocated_mib": round((torch.cuda.max_memory_allocated() - a0) / MIB), **extra}
    gc.collect()
    torch.cuda.empty_cache()
    row["held_reserved_mib"] = round((torch.cuda.memory_reserved() - r0) / MIB)
    row["held_allocated_mib"] = round((torch.cuda.memory_allocated() - a0) / MIB)
    print(json.dumps(row), flush=True)
    return row


def _leaf_copies(params, state):
    """Static copies for a plain-autograd capture: params as fresh leaves requiring grad, the BN
    state, and the params' leaf list."""
    sp = T.tree_map(lambda t: t.detach().clone().requires_grad_(True), params)
    return sp, T.tree_clone(state), T.tree_leaves(sp)


def _on_side_stream(run, times: int) -> None:
    """Warm-up: ``run()`` ``times`` times on a side stream (nothing kept between runs)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(times):
            run()
    torch.cuda.current_stream().wait_stream(side)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--task", default="detect")
    ap.add_argument("--batch", type=int, default=64)
    args = ap.parse_args()
    torch.backends.cudnn.benchmark = False
    model = yolov8("n", task=args.task)
    params, state = T.tree_to(model.init(torch.Generator().manual_seed(0)), "cuda", channels_last=True)
    p, s = params["network"], state["network"]
    x = synthetic_batch(args.task, args.batch, 640, num_classes=model.num_classes, seed=1,
                        device="cuda").images.contiguous(memory_format=torch.channels_last)

    def fn(pp, ss, xx):
        return model.network.apply(pp, ss, xx, train=True)

    def ac():
        return torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False)

    # eager
    base = _fresh()
    for _ in range(2):
        with ac():
            out, vjp_fn, _ = torch.func.vjp(lambda q: fn(q, T.tree_clone(s), x), p, has_aux=True)
        with torch.no_grad():
            vjp_fn(T.tree_map(torch.ones_like, out))
        del out, vjp_fn
    _report("eager", base)

    # capture_vjp (ours)
    base = _fresh()
    cap = capture_vjp(fn, p, s, x, autocast_dtype=torch.bfloat16, forward_context=update_stats_in_place)
    feats, _ = cap.forward(cap.static.params, cap.static.state, x)
    cap.backward(T.tree_map(torch.ones_like, feats))
    _report("capture_vjp", base)
    del cap, feats

    # plain autograd, two graphs, one pool
    base = _fresh()
    sp, ss, leaves = _leaf_copies(p, s)

    def warm():
        with ac(), update_stats_in_place():
            o, _ = fn(sp, T.tree_clone(ss), x)
        torch.autograd.grad(T.tree_leaves(o), leaves, [torch.ones_like(t) for t in T.tree_leaves(o)])

    _on_side_stream(warm, 2)
    pool = torch.cuda.graph_pool_handle()
    g1, g2 = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(g1, pool=pool):
        with ac(), update_stats_in_place():
            o, _ = fn(sp, ss, x)
    outs = T.tree_leaves(o)
    cot = [torch.ones_like(t) for t in outs]
    with torch.cuda.graph(g2, pool=pool):
        grads = torch.autograd.grad(outs, leaves, cot)
    g1.replay()
    g2.replay()
    _report("autograd_two_graphs", base)
    del g1, g2, o, outs, cot, grads, sp, ss, leaves

    # one graph (forward + backward together)
    base = _fresh()
    sp, ss, leaves = _leaf_copies(p, s)

    def both():
        with ac(), update_stats_in_place():
            o, _ = fn(sp, ss, x)
        outs = T.tree_leaves(o)
        return torch.autograd.grad(outs, leaves, [torch.ones_like(t) for t in outs])

    _on_side_stream(both, 2)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        grads = both()
    g.replay()
    _report("one_graph", base)
    return 0


if __name__ == "__main__":
    sys.exit(main())
