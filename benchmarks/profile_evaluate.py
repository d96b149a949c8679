"""Where the wall time of one ``yolo_func.eval.evaluate`` call goes (issue 13: whole validation images/s).

``coco-tiny`` cycled to ``--images`` val images (``benchmarks/eval.py``'s ``repeated_coco``), a
nano model (random init, or ``--weights`` a reference-layout ``.pt``), ``evaluate(coco=False)``
(the internal metric: the work the reference's ``val`` does). Runs ``--runs`` timed calls and prints
their seconds, then the cProfile of the last call, sorted by cumulative and by internal time (on
CUDA the host waits at synchronisation points, so a wait shows where the GPU or the loader is
behind; ``benchmarks/profile_eval.py`` profiles the CPU work around a stand-in model instead). ``--loader-only`` times iterating the ``ValLoader`` alone, the same batches.

    python benchmarks/profile_evaluate.py --device cuda --task detect --images 512 --runs 3 --top 35
    python benchmarks/profile_evaluate.py --device cpu --task detect --imgsz 128 --runs 2
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eval import repeated_coco  # noqa: E402  (benchmarks/eval.py)

from yolo_func import yolov8  # noqa: E402
from yolo_func.data import ValLoader  # noqa: E402
from yolo_func.eval import evaluate  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--task", default="detect", choices=["detect", "segment", "pose"])
    ap.add_argument("--images", type=int, default=512)
    ap.add_argument("--imgsz", type=int, default=640)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--top", type=int, default=35)
    ap.add_argument("--weights", default=None, help="a reference-layout .pt (default: random init)")
    ap.add_argument("--loader-only", action="store_true", help="also time the ValLoader alone")
    args = ap.parse_args()
    device = torch.device(args.device)
    tmp = Path(tempfile.mkdtemp(prefix="profile_eval_"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ds = repeated_coco(args.task, args.images, tmp / args.task)
    if args.weights:
        from yolo_func.io import load_reference_model

        model, params, state, _ = load_reference_model(args.weights)
    else:
        model = yolov8("n", task=args.task, num_classes=len(ds.names))
        params, state = model.init(torch.Generator().manual_seed(0))
    print(f"{args.task}, {len(ds)} images at {args.imgsz}, batch {args.batch}, workers {args.workers}, "
          f"device {device}, torch {torch.__version__}", flush=True)
    if args.loader_only:
        for r in range(2):
            t = time.perf_counter()
            loader = ValLoader(ds, batch_size=args.batch, image_size=args.imgsz, workers=args.workers, task=args.task)
            t_init = time.perf_counter() - t
            n = sum(int(b.images.shape[0]) for b in loader)
            s = time.perf_counter() - t
            print(f"loader alone run {r + 1}: {s:.3f} s ({t_init:.3f} s construction), {n / s:.1f} images/s", flush=True)
    prof = None
    for r in range(args.runs):
        prof = cProfile.Profile() if r == args.runs - 1 else None
        _sync(device)
        t = time.perf_counter()
        if prof:
            prof.enable()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            m = evaluate(model, params, state, ds, image_size=args.imgsz, batch_size=args.batch, device=device,
                         workers=args.workers, progress=False, verbose=False, coco=False)
        _sync(device)
        if prof:
            prof.disable()
        s = time.perf_counter() - t
        print(f"evaluate run {r + 1}: {s:.3f} s, {len(ds) / s:.1f} images/s, box mAP50-95 "
              f"{m['internal']['box']['mAP50-95']:.4f}", flush=True)
    for key in ("cumulative", "tottime"):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(args.top)
        print(f"--- cProfile of the last call, by {key}\n{buf.getvalue()}", flush=True)


if __name__ == "__main__":
    main()
