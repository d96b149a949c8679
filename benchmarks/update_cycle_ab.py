"""The eager update (``finish_step``: guard, optimizer, EMA, metrics) of accumulating and stepping
calls, two checkouts side by side: each arm in its own process, the arms alternating round by round.

    git worktree add /tmp/before <commit>
    python benchmarks/update_cycle_ab.py --before /tmp/before --after . --rounds 2

Nano detect on the CPU (one thread, freed host memory kept as the fit keeps it), the YOLO recipe
past its warmup with the nominal batch ``accumulate * batch`` (``benchmarks/eager_ops.py``'s
``build(..., accumulate=N)``: N - 1 accumulating calls, then a step); one set of gradients from a
real backward, then ``--cycles`` timed cycles after one untimed. Each arm uses its own checkout's
``yolo_func`` and ``benchmarks/eager_ops.py`` (the arm's ``build`` must take ``accumulate``; copy
this checkout's ``eager_ops.py`` into an older one). Prints the median milliseconds of each kind of
call per arm and round.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

_ARM = """
import json, sys, time, statistics
root, size, batch, acc, cycles = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
sys.path.insert(0, root); sys.path.insert(0, root + "/benchmarks")
import torch
torch.set_num_threads(1)
import yolo_func
assert yolo_func.__file__.startswith(root), yolo_func.__file__
from yolo_func.train.host_memory import keep_freed_host_memory
keep_freed_host_memory()
from eager_ops import build
from yolo_func.train.step import finish_step, heads_backward, network_vjp
model, tx, e, ts, b = build("detect", batch, size, "cpu", accumulate=acc)
feats, pull, ns = network_vjp(model, ts.params["network"], ts.state["network"], b.images)
hb = heads_backward(model, ts.params["heads"], ts.state["heads"], feats, b.targets)
(g,) = pull(hb.g_feats)
grads, nst = {"network": g, "heads": hb.head_grads}, {"network": ns, "heads": hb.head_states}
times = {"accumulating": [], "stepping": []}
for c in range(cycles + 1):
    s = ts
    for i in range(acc):
        t0 = time.perf_counter()
        s, m = finish_step(s, grads, nst, hb.losses, hb.parts, hb.feat_norms, tx=tx, ema=e)
        dt = time.perf_counter() - t0
        if c:
            times["stepping" if bool(m["stepped"]) else "accumulating"].append(dt)
print(json.dumps({k: 1000 * statistics.median(v) for k, v in times.items()}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, help="checkout of the baseline (e.g. a git worktree)")
    ap.add_argument("--after", default=str(Path(__file__).resolve().parents[1]))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--accumulate", type=int, default=8)
    ap.add_argument("--cycles", type=int, default=3)
    args = ap.parse_args()
    arms = {"before": str(Path(args.before).resolve()), "after": str(Path(args.after).resolve())}
    got: dict[str, list[dict]] = {k: [] for k in arms}
    for r in range(args.rounds):
        for name, root in arms.items():
            out = subprocess.run([sys.executable, "-c", _ARM, root, str(args.size), str(args.batch),
                                  str(args.accumulate), str(args.cycles)], capture_output=True, text=True, check=True)
            row = json.loads(out.stdout.strip().splitlines()[-1])
            got[name].append(row)
            print(f"round {r + 1} {name:6s}: accumulating call {row['accumulating']:.1f} ms, "
                  f"stepping call {row['stepping']:.1f} ms", flush=True)
    for name, rows in got.items():
        print(f"{name:6s} medians over rounds: accumulating {statistics.median(r['accumulating'] for r in rows):.1f} ms, "
              f"stepping {statistics.median(r['stepping'] for r in rows):.1f} ms")


if __name__ == "__main__":
    main()
