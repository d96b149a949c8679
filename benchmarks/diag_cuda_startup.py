"""What a CUDA training process pays before its first fast step (issue 14: a fit's start-up).

Each measurement runs in a fresh interpreter (``--child``) so that nothing is warm:

- ``context``: ``torch.zeros(1, device="cuda")`` right after ``import torch`` (the CUDA context);
- ``context+dynamo``: the same while another thread imports ``torch._dynamo`` (what
  ``yolo_func.train.fit`` does to hide that import: does it slow the context down?);
- ``first_steps``: our eager training step (``ReplayTrainStep(capture="none")``: BF16 autocast,
  NHWC) on a synthetic batch, called ``--calls`` times: the first call's extra cost is the lazy
  CUDA set-up (kernel modules, cuDNN plans, cuBLAS handles); with ``--cudnn-off`` the same with
  cuDNN disabled, to see its share.

Prints one JSON line per child and writes ``cuda_startup_<stamp>.json`` under ``--out``.

    python benchmarks/diag_cuda_startup.py --task segment --batch 16 --out /tmp/diag
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

T0 = time.perf_counter()


def child(kind: str, args: argparse.Namespace) -> dict:
    import threading

    import torch

    dev = args.device
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    out: dict = {"kind": kind, "import_torch_s": round(time.perf_counter() - T0, 3)}
    if kind in ("context", "context+dynamo"):
        th = None
        if kind == "context+dynamo":
            def imp():
                t = time.perf_counter()
                import torch._dynamo  # noqa: F401
                out["dynamo_import_s"] = round(time.perf_counter() - t, 3)
            th = threading.Thread(target=imp)
            th.start()
        t = time.perf_counter()
        torch.zeros(1, device=dev)
        sync()
        out["context_s"] = round(time.perf_counter() - t, 3)
        if th is not None:
            th.join()
        return out
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from yolo_func import yolov8
    from yolo_func.optim import sgd
    from yolo_func.testing.synthetic import synthetic_batch
    from yolo_func.train import init_train_state
    from yolo_func.train.replay import ReplayTrainStep

    if kind == "first_steps_cudnn_off":
        torch.backends.cudnn.enabled = False
    t = time.perf_counter()
    torch.zeros(1, device=dev)
    sync()
    out["context_s"] = round(time.perf_counter() - t, 3)
    import torch._dynamo  # noqa: F401  (the step imports it; timed apart)
    model = yolov8("n", task=args.task, num_classes=80)
    tx = sgd(0.01, momentum=0.9)
    ts = init_train_state(model, tx, torch.Generator().manual_seed(0), device=dev)
    batch = synthetic_batch(args.task, args.batch, args.imgsz, num_classes=80, max_boxes=32, device=dev)
    batch = batch._replace(images=(batch.images * 255).to(torch.uint8))
    step = ReplayTrainStep(model, tx, capture="none")
    calls = []
    for _ in range(args.calls):
        sync()
        t = time.perf_counter()
        ts, m = step(ts, batch)
        sync()
        calls.append(round(time.perf_counter() - t, 4))
    out["calls_s"] = calls
    out["first_extra_s"] = round(calls[0] - min(calls[1:]), 3) if len(calls) > 1 else None
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run")
    ap.add_argument("--task", default="segment")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--imgsz", type=int, default=640)
    ap.add_argument("--calls", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--kinds", nargs="+", default=["context", "context+dynamo", "first_steps", "first_steps_cudnn_off"])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.child:
        print("DIAG " + json.dumps(child(args.child, args)), flush=True)
        return
    rows = []
    for r in range(args.repeats):
        for kind in args.kinds:
            cmd = [sys.executable, __file__, "--child", kind, "--task", args.task, "--batch", str(args.batch),
                   "--imgsz", str(args.imgsz), "--calls", str(args.calls), "--device", args.device]
            t = time.perf_counter()
            p = subprocess.run(cmd, capture_output=True, text=True)
            row = {"repeat": r, "kind": kind, "process_s": round(time.perf_counter() - t, 3), "rc": p.returncode}
            for line in p.stdout.splitlines():
                if line.startswith("DIAG "):
                    row.update(json.loads(line[5:]))
            if p.returncode:
                row["stderr_tail"] = p.stderr[-1500:]
            print(json.dumps(row), flush=True)
            rows.append(row)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        (Path(args.out) / f"cuda_startup_{stamp}.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
