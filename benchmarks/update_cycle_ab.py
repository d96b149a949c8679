"""The eager update (``finish_step``: guard, optimizer, EMA, metrics) of accumulating and stepping
calls, two checkouts side by side: each arm in its own process, the arms alternating round by round.

    git worktree add /tmp/before <commit>
    python benchmarks/update_cycle_ab.py --before /tmp/before --after . --rounds 2

Nano detect on the CPU (one thread, freed host memory kept as the fit keeps it), the YOLO recipe
past its warmup with the nominal batch ``accumulate * batch`` (``benchmarks/eager_ops.py``'s
``build(..., accumulate=N)``: N - 1 accumulating calls, then a step); one set of gradients from a
real backward, then ``--cycles`` timed cycles after one untimed. Each arm uses its own checkout's
``yolo_func`` and ``benchmarks/eager_ops.py`` (the arm's ``eager_ops.py`` must have ``update_inputs``
and ``build(accumulate=)``; copy this checkout's into an older one). Prints the median milliseconds of each kind of
call per arm and round.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _ab import alternate, arms  # noqa: E402

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
from eager_ops import build, update_inputs
from yolo_func.train.step import finish_step
model, tx, e, ts, b = build("detect", batch, size, "cpu", accumulate=acc)
grads, nst, hb = update_inputs(model, ts, b)
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
    roots = arms(args.before, args.after)

    def show(r: int, name: str, line: str) -> None:
        row = json.loads(line)
        print(f"round {r + 1} {name:6s}: accumulating call {row['accumulating']:.1f} ms, "
              f"stepping call {row['stepping']:.1f} ms", flush=True)

    lines = alternate(roots, _ARM, [str(args.size), str(args.batch), str(args.accumulate), str(args.cycles)],
                      args.rounds, show)
    for name, rows in lines.items():
        rows = [json.loads(x) for x in rows]
        print(f"{name:6s} medians over rounds: accumulating {statistics.median(r['accumulating'] for r in rows):.1f} ms, "
              f"stepping {statistics.median(r['stepping'] for r in rows):.1f} ms")

if __name__ == "__main__":
    main()
