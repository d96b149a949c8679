"""Median CPU time of the eager step's update phase alone (guard + optimizer + EMA + metrics:
``finish_step``) on fixed gradients, in this checkout.

    python benchmarks/eager_update_time.py --size 320 --batch 8 --repeats 20 --threads 1

Run it in two checkouts alternately to compare them (the numbers in
benchmarks/results/eager_ops_2026-12-04b.md were taken that way).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eager_ops import build  # noqa: E402
from yolo_func.train import train_step  # noqa: E402
from yolo_func.train.step import finish_step, heads_backward, network_vjp  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", type=int, default=320)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (0: leave)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tx, e, ts, b = build("detect", args.batch, args.size, "cpu")
    for _ in range(2):  # flat-backed carried state, memo tables
        ts, _ = train_step(ts, b, model=model, tx=tx, ema=e)
    feats, pull, net_state = network_vjp(model, ts.params["network"], ts.state["network"], b.images)
    hb = heads_backward(model, ts.params["heads"], ts.state["heads"], feats, b.targets)
    (g_net,) = pull(hb.g_feats)
    grads = {"network": g_net, "heads": hb.head_grads}
    new_state = {"network": net_state, "heads": hb.head_states}
    times = []
    for _ in range(args.repeats + 1):
        t0 = time.perf_counter()
        finish_step(ts, grads, new_state, hb.losses, hb.parts, hb.feat_norms, tx=tx, ema=e)
        times.append(1000 * (time.perf_counter() - t0))
    times = times[1:]
    print(f"update phase, {args.size} px, batch {args.batch}, {torch.get_num_threads()} threads: "
          f"median {statistics.median(times):.1f} ms, min {min(times):.1f} ms over {args.repeats}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
