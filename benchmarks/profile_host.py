"""Host-side (Python) profile of a training step: where the CPU time of one step goes.

    python benchmarks/profile_host.py --task detect --batch 4 --variants eager,network --steps 10

Runs ``cProfile`` over ``--steps`` steps (after warm-up, synchronised only at the end) and prints
the functions with the largest own time. A step that launches its kernels eagerly is host-bound at
small batches; this shows which Python and dispatcher calls to remove.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from step import _ours  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--task", default="detect")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--variants", default="eager,network")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("[yolo_func] benchmarks/profile_host.py needs a CUDA GPU")
    for variant in args.variants.split(","):
        run = _ours(args.task, args.batch, "none" if variant == "eager" else variant)
        for _ in range(5):
            run()
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        for _ in range(args.steps):
            run()
        prof.disable()
        host = (time.perf_counter() - t0) * 1000 / args.steps
        torch.cuda.synchronize()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(args.top)
        print(f"== {args.task} batch {args.batch} {variant}: host {host:.2f} ms per step (under cProfile)")
        print("\n".join(line[:170] for line in out.getvalue().splitlines()[6:]))
        del run
    return 0


if __name__ == "__main__":
    sys.exit(main())
