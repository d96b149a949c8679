"""What bounds a whole GPU validation (issue 13): ``evaluate(coco=False)`` on ``coco-tiny`` cycled to
``--images`` with trained weights, under variants that each remove one suspect.

    python benchmarks/diag_eval_host.py --weights detect.pt --images 2048 --runs 2

Variants (best of ``--runs`` each, images/s):
- ``default``: as a user calls it (``workers`` reader threads);
- ``switch=<s>``: the same with ``sys.setswitchinterval(s)`` (how long a thread may hold the GIL
  while another waits for it: the main thread's many short torch calls each release and retake it,
  behind reader threads that run Python between their decodes);
- ``workers=<n>``: fewer or more reader threads;
- ``processes``: the readers as DataLoader worker processes (no GIL shared; a fork per worker);
- ``backend=<b>``: ``evaluate(loader_backend=b)`` (``threads`` / ``processes`` / ``auto``, the default);
- ``ring`` / ``noring``: ``loader_backend="processes"`` with the shared page-locked ring
  (``PROCESS_LOADER_RING = True``) / with the DataLoader's own shared-memory tensors and pinning
  thread (``False``);
- ``loader=<threads|processes|noring>``: the ValLoader alone, each batch's images copied to the
  device and nothing else (the readers' ceiling; the same reporting, no mAP);
- ``preloaded``: the batches built beforehand (no reading at all): the ceiling of the main thread
  and the GPU;
- ``replay``: ``evaluate(replay=True)`` (forward + decode + NMS replayed as CUDA graphs).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eval import repeated_coco  # noqa: E402  (benchmarks/eval.py)

import yolo_func.data.loader as loader_mod  # noqa: E402
import importlib  # noqa: E402

# the module (yolo_func.eval.evaluate is also the function, which `import ... as` would bind)
evaluate_mod = importlib.import_module("yolo_func.eval.evaluate")
from yolo_func.eval import evaluate  # noqa: E402
from yolo_func.io import load_reference_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--weights", required=True, help="a reference-layout .pt (or random: a smoke test)")
    ap.add_argument("--task", default="detect")
    ap.add_argument("--images", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--variants", nargs="+", default=["default", "switch=0.0005", "switch=0.0001", "workers=4",
                                                       "workers=12", "processes", "preloaded", "replay", "default"])
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ds = repeated_coco(args.task, args.images, Path(tempfile.mkdtemp()) / args.task)
    if args.weights == "random":  # a smoke test of this script (random weights: not a measurement)
        from yolo_func import yolov8

        model = yolov8("n", task=args.task, num_classes=len(ds.names))
        params, state = model.init(torch.Generator().manual_seed(0))
    else:
        model, params, state, _ = load_reference_model(args.weights)
    real_loader = loader_mod.ValLoader
    ring_default = evaluate_mod.PROCESS_LOADER_RING
    gpu = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    print(f"{args.task}, {len(ds)} images, batch {args.batch}, torch {torch.__version__}, "
          f"{gpu}, switch interval {sys.getswitchinterval()}", flush=True)
    for v in args.variants:
        name, _, val = v.partition("=")
        kw = dict(workers=args.workers)
        old_switch = sys.getswitchinterval()
        loader_cls = real_loader
        if name == "switch":
            sys.setswitchinterval(float(val))
        elif name == "workers":
            kw["workers"] = int(val)
        elif name == "backend":
            kw["loader_backend"] = val
        elif name == "processes":
            loader_cls = lambda *a, **k: real_loader(*a, **{**k, "backend": "processes"})  # noqa: E731
        elif name in ("ring", "noring"):
            kw["loader_backend"] = "processes"
            evaluate_mod.PROCESS_LOADER_RING = name == "ring"
        elif name == "loader":
            print(f"{v:16s} {loader_only(ds, val, args, dev, sync):8.1f} images/s  (loader alone)", flush=True)
            continue
        elif name == "preloaded":
            batches = list(real_loader(ds, batch_size=args.batch, image_size=640, workers=args.workers, task=args.task))
            loader_cls = lambda *a, **k: batches  # noqa: E731  (evaluate takes len() and iterates)
        elif name == "replay":
            kw["replay"] = True
        loader_mod.ValLoader = loader_cls
        best, fit = 0.0, None
        try:
            for _ in range(args.runs):
                sync()
                t = time.perf_counter()
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    m = evaluate(model, params, state, ds, image_size=640, batch_size=args.batch, device=dev,
                                 progress=False, verbose=False, coco=False, **kw)
                sync()
                best = max(best, len(ds) / (time.perf_counter() - t))
                fit = m["internal"]["box"]["mAP50-95"]
        finally:
            loader_mod.ValLoader = real_loader
            evaluate_mod.PROCESS_LOADER_RING = ring_default
            sys.setswitchinterval(old_switch)
        print(f"{v:16s} {best:8.1f} images/s  box mAP50-95 {fit:.4f}", flush=True)


def loader_only(ds, backend: str, args, dev: torch.device, sync) -> float:
    """Best images/s over ``args.runs`` passes of the ValLoader alone, images copied to ``dev``."""
    ring = backend == "processes" and dev.type == "cuda"
    kw = dict(backend="processes" if backend == "noring" else backend, device=dev if ring else None)
    loader = loader_mod.ValLoader(ds, batch_size=args.batch, image_size=640, workers=args.workers, task=args.task, **kw)
    best = 0.0
    for _ in range(args.runs):
        sync()
        t = time.perf_counter()
        for vb in loader:
            vb.images.to(dev, non_blocking=True)
        sync()
        best = max(best, len(ds) / (time.perf_counter() - t))
    return best


if __name__ == "__main__":
    main()
