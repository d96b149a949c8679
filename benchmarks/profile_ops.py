"""Which aten ops of the loss (forward + backward, assignment included) cost GPU time, by input shape.

    python benchmarks/profile_ops.py --task detect --batch 64 --rows 40 > ops.txt

``torch.profiler`` table of the heaviest ops grouped by input shape, sorted by total CUDA time,
over ``--steps`` eager calls after warm-up. The per-kernel view is ``profile_step.py``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from loss import loss_step  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--task", default="detect")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rows", type=int, default=40)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("[yolo_func] benchmarks/profile_ops.py needs a CUDA GPU")
    run = loss_step(args.task, args.batch, 640, "cuda")[0]
    for _ in range(5):
        run()
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts, record_shapes=True) as prof:
        for _ in range(args.steps):
            run()
        torch.cuda.synchronize()
    print(f"# {args.task} batch {args.batch}, {args.steps} steps, torch {torch.__version__}, {torch.cuda.get_device_name()}")
    print(prof.key_averages(group_by_input_shape=True).table(sort_by="cuda_time_total", row_limit=args.rows,
                                                             max_name_column_width=40, max_shapes_column_width=70))
    return 0


if __name__ == "__main__":
    sys.exit(main())
