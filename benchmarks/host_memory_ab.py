"""CPU eager step with and without :func:`yolo_func.train.host_memory.keep_freed_host_memory`,
each in its own process, alternating (issue 17: the CPU eager step).

    python benchmarks/host_memory_ab.py --rounds 3 --size 320 --batch 8 --steps 8 --threads 1

Prints per process the median and minimum step time and the minor page faults per step, then the
medians over the rounds; writes ``host_memory_ab_<stamp>.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

_CHILD = r"""
import json, resource, statistics, sys, time
import torch
sys.path.insert(0, "benchmarks"); sys.path.insert(0, ".")
from yolo_func.train.host_memory import keep_freed_host_memory
applied = keep_freed_host_memory()
size, batch, steps, threads = (int(v) for v in sys.argv[1:5])
torch.set_num_threads(threads)
from eager_ops import build
from yolo_func.train import train_step
model, tx, e, ts, b = build("detect", batch, size, "cpu")
for _ in range(3):
    ts, _ = train_step(ts, b, model=model, tx=tx, ema=e)
t, f0 = [], resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(steps):
    t0 = time.perf_counter()
    ts, _ = train_step(ts, b, model=model, tx=tx, ema=e)
    t.append(1000 * (time.perf_counter() - t0))
print(json.dumps({"applied": applied, "median_ms": statistics.median(t), "min_ms": min(t),
                  "faults_per_step": (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / steps}))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--size", type=int, default=320)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _fit_common import host_meta, utc_stamp

    rows = []
    for r in range(args.rounds):
        for on in (False, True):
            env = dict(os.environ, YOLO_FUNC_KEEP_HOST_MEMORY="1" if on else "0")
            out = subprocess.run([sys.executable, "-c", _CHILD, str(args.size), str(args.batch), str(args.steps),
                                  str(args.threads)], capture_output=True, text=True, env=env, check=True,
                                 cwd=Path(__file__).resolve().parents[1])
            row = {"round": r, "keep_freed": on, **json.loads(out.stdout.strip().splitlines()[-1])}
            rows.append(row)
            print(json.dumps(row), flush=True)
    summary = {str(on): {k: statistics.median(x[k] for x in rows if x["keep_freed"] == on)
                         for k in ("median_ms", "min_ms", "faults_per_step")} for on in (False, True)}
    print("summary (median over rounds):", json.dumps(summary))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    path = Path(args.out) / f"host_memory_ab_{utc_stamp()}.json"
    path.write_text(json.dumps({"meta": host_meta(["benchmarks/host_memory_ab.py", *sys.argv[1:]]), "rows": rows,
                                "summary": summary}, indent=1))
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
