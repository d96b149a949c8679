"""Training-loader CPU cost, two checkouts side by side: images per CPU-second of one process
loading coco-tiny training batches (``workers=0``, OpenCV on one thread, batch 16 at 640, no RAM
cache), each arm in its own process, the arms alternating round by round (a noisy machine slows
both alike).

    git worktree add /tmp/before <commit>
    python benchmarks/loader_ab.py --before /tmp/before --after . --tasks segment detect --rounds 5

Each arm imports ``yolo_func`` and ``benchmarks/loader.py``'s dataset from its own checkout (the
shared data is read from ``<checkout>/../shared/data``). Writes ``loader_ab_<stamp>.json`` with every
round and the medians.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _ab import alternate, arms  # noqa: E402

# one arm: the checkout's own package and dataset, ``warm`` batches untimed, then ``batches`` timed
_ARM = """
import sys, time, cv2
root = sys.argv[1]
sys.path.insert(0, root); sys.path.insert(0, root + "/benchmarks")
cv2.setNumThreads(0)
from loader import make_dataset
import yolo_func
assert yolo_func.__file__.startswith(root), yolo_func.__file__
from yolo_func.data import TrainLoader
task, warm, batches = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
it = iter(TrainLoader(make_dataset("coco-tiny", task, 512)[0], batch_size=16, image_size=640, workers=0, seed=0))
for _ in range(warm):
    next(it)
t = time.process_time()
for _ in range(batches):
    next(it)
print(16 * batches / (time.process_time() - t))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, help="checkout of the baseline (e.g. a git worktree)")
    ap.add_argument("--after", default=str(Path(__file__).resolve().parents[1]))
    ap.add_argument("--tasks", nargs="+", default=["segment", "detect"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warm", type=int, default=2)
    ap.add_argument("--batches", type=int, default=20)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    roots = arms(args.before, args.after)
    rows: dict = {}
    for task in args.tasks:
        lines = alternate(roots, _ARM, [task, str(args.warm), str(args.batches)], args.rounds,
                          show=lambda r, name, line: print(f"{task} round {r} {name}: {float(line):.1f} images per "
                                                           "CPU-second", flush=True))
        got = {k: [float(x) for x in v] for k, v in lines.items()}
        med = {k: statistics.median(v) for k, v in got.items()}
        rows[task] = {"rounds": got, "median": med, "after_over_before": med["after"] / med["before"]}
        print(f"{task}: median {med['before']:.1f} -> {med['after']:.1f} ({rows[task]['after_over_before']:.3f}x)")
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    path = Path(args.out) / f"loader_ab_{stamp}.json"
    path.write_text(json.dumps({"command": " ".join(sys.argv), "arms": roots, "tasks": rows}, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
