"""What a CUDA training process pays before its first fast step (issue 14: a fit's start-up).

Each measurement runs in a fresh interpreter (``--child``) so that nothing is warm:

- ``context``: ``torch.zeros(1, device="cuda")`` right after ``import torch`` (the CUDA context);
- ``context+dynamo``: the same while another thread imports ``torch._dynamo`` (what
  ``yolo_func.train.fit`` does to hide that import: does it slow the context down?);
- ``first_steps``: our eager training step (``ReplayTrainStep(capture="none")``: BF16 autocast,
  NHWC) on a synthetic batch, called ``--calls`` times: the first call's extra cost is the lazy
  CUDA set-up (kernel modules, cuDNN plans, cuBLAS handles); with ``--cudnn-off`` the same with
  cuDNN disabled, to see its share;
- ``init_parts`` / ``init_parts+dynamo``: ``init_train_state``'s parts one by one after the
  context (``model.init`` on the host, params and state to the device, the EMA and optimizer
  states), alone or while another thread imports ``torch._dynamo`` as ``fit`` does;
- ``first_steps_prewarmed``: a BF16 matmul (cuBLAS/cuBLASLt) and an NHWC BF16 convolution's
  forward and backward (cuDNN) timed first, then the step calls: how much of the first step's
  extra cost a library warm-up on another thread could take off the critical path.

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
    model = yolov8("n", task=args.task, num_classes=80)
    tx = sgd(0.01, momentum=0.9)
    if kind.startswith("init_parts"):
        return {**out, **init_parts(kind, model, tx, dev, sync)}
    import torch._dynamo  # noqa: F401  (the step imports it; timed apart)
    if kind == "first_steps_prewarmed":
        out.update(library_warmup(dev, sync))
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


def init_parts(kind: str, model, tx, dev: str, sync) -> dict:
    """``init_train_state``'s work split into its parts, each timed after a sync, twice (the
    second round shows the parts' cost with every kernel already loaded)."""
    import threading

    import torch

    from yolo_func import tree as T
    from yolo_func.optim import apply_if_finite
    from yolo_func.optim.ema import ema as make_ema

    out: dict = {}
    th = None
    if kind.endswith("+dynamo"):
        interval = sys.getswitchinterval()
        from yolo_func.train.fit import _IMPORT_SWITCH_INTERVAL_S

        sys.setswitchinterval(_IMPORT_SWITCH_INTERVAL_S)  # what fit's _warm_imports sets while it imports

        def imp():
            t = time.perf_counter()
            import torch._dynamo  # noqa: F401
            out["dynamo_import_s"] = round(time.perf_counter() - t, 3)
            sys.setswitchinterval(interval)

        th = threading.Thread(target=imp)
        th.start()
    ema = make_ema(0.9999, 2000.0)
    for r in range(2):
        parts = {}

        def timed(name, fn):
            sync()
            t = time.perf_counter()
            v = fn()
            sync()
            parts[name] = round(time.perf_counter() - t, 4)
            return v

        params, state = timed("model_init_host", lambda: model.init(torch.Generator().manual_seed(0)))
        params = timed("params_to_device", lambda: T.tree_to(params, dev, channels_last=dev == "cuda"))
        state = timed("state_to_device", lambda: T.tree_to(state, dev))
        timed("ema_init", lambda: ema.init({"params": params, "state": state}))
        timed("opt_init", lambda: apply_if_finite(tx).init(params))
        parts["total"] = round(sum(parts.values()), 4)
        out[f"round{r}"] = parts
    if th is not None:
        th.join()
    return out


def library_warmup(dev: str, sync) -> dict:
    """A BF16 matmul and an NHWC BF16 convolution forward + backward, timed apart."""
    import torch

    out = {}
    sync()
    t = time.perf_counter()
    a = torch.randn(64, 64, device=dev, dtype=torch.bfloat16)
    (a @ a).sum()
    sync()
    out["cublas_s"] = round(time.perf_counter() - t, 3)
    t = time.perf_counter()
    x = torch.randn(2, 16, 32, 32, device=dev, dtype=torch.bfloat16).to(memory_format=torch.channels_last).requires_grad_()
    w = torch.randn(16, 16, 3, 3, device=dev, dtype=torch.bfloat16).to(memory_format=torch.channels_last).requires_grad_()
    torch.nn.functional.conv2d(x, w, padding=1).sum().backward()
    sync()
    out["cudnn_s"] = round(time.perf_counter() - t, 3)
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
    ap.add_argument("--kinds", nargs="+", default=["context", "context+dynamo", "first_steps", "first_steps_cudnn_off"],
                    help="any of context, context+dynamo, first_steps, first_steps_cudnn_off, first_steps_prewarmed, "
                         "init_parts, init_parts+dynamo")
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
