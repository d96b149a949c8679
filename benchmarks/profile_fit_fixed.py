"""The fixed costs of a fit, phase by phase, outside the training steps (issue 14, item 7).

What ``benchmarks/fit.py`` times as a whole (start-up, between-epoch work) split into the parts
``yolo_func.train.fit`` runs, each timed on its own with the fit's own code:

- ``import_s``: a fresh interpreter's ``import yolo_func.train`` (median of 3 processes);
- ``datasets_s``: :func:`yolo_func.train.load_datasets` (the scan of the annotations);
- ``train_loader_s`` / ``first_batch_s``: ``TrainLoader`` construction, then its first batch (workers started);
- ``val_loader_s``: ``ValLoader`` construction;
- ``validate_s``: :func:`yolo_func.train.validate` with COCO records (as the fit does when
  ``val.coco`` is on), run ``--repeats`` times: the first includes the val workers' start;
- ``checkpoint_copy_s``: what ``RunDir.save(background=True)`` blocks the loop for (the
  device-to-host copy), ``--repeats`` times; ``checkpoint_write_s``: the background write.

Data: ``coco-tiny`` repeated to ``--images`` (benchmarks/_fit_common.py, as fit.py builds it).

CPU example (numbers are the CPU's; on a GPU use ``--device cuda``)::

    python benchmarks/profile_fit_fixed.py --device cpu --imgsz 160 --batch 4 --out /tmp/fixed
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _fit_common as C  # noqa: E402


def _median_import() -> float:
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import yolo_func.train"], check=True, cwd=C.REPO)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--task", default="segment")
    ap.add_argument("--images", type=int, default=512)
    ap.add_argument("--val-images", type=int, default=16)
    ap.add_argument("--imgsz", type=int, default=160)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None, help="folder for fixed.json (default: print only)")
    args = ap.parse_args()
    res: dict = {"args": vars(args), "import_s": round(_median_import(), 3)}

    import torch

    from yolo_func.configs import build_config
    from yolo_func.data import TrainLoader, ValLoader
    from yolo_func.eval.coco_eval import CocoEvaluator
    from yolo_func.optim import ema as make_ema
    F = importlib.import_module("yolo_func.train.fit")
    from yolo_func.train.checkpoint import DataPosition, capture_rng
    from yolo_func.train.run_dir import RunDir
    from yolo_func.train.step import init_train_state

    tmp = Path(tempfile.mkdtemp(prefix="fitfixed-"))
    data = C.make_data("coco-tiny", args.task, args.images, args.val_images, tmp / "data")
    recipe = {"detect": "yolov8n", "segment": "yolov8n-seg", "pose": "yolov8n-pose"}[args.task]
    config = build_config(recipe, flags={"data": data["coco"], "imgsz": args.imgsz, "batch": args.batch,
                                         "device": args.device, "epochs": 5, "out": str(tmp / "run")},
                          overrides=[f"data.workers={args.workers}", "data.cache=none", "train.plots=false"])
    device = torch.device(args.device)
    t0 = time.perf_counter()
    train_ds, val_ds = F.load_datasets(config)
    res["datasets_s"] = round(time.perf_counter() - t0, 3)
    config = F._resolve_model_config(config, train_ds)
    gen = torch.Generator().manual_seed(0)
    model, params, state = F.build_model(config, gen, log=lambda *_: None)

    t0 = time.perf_counter()
    loader = TrainLoader(train_ds, batch_size=args.batch, image_size=args.imgsz, workers=args.workers, cache=None,
                         seed=0, task=args.task, epochs=5)
    res["train_loader_s"] = round(time.perf_counter() - t0, 3)
    t0 = time.perf_counter()
    next(iter(loader))
    res["first_batch_s"] = round(time.perf_counter() - t0, 3)
    loader.close()
    t0 = time.perf_counter()
    val_loader = ValLoader(val_ds, batch_size=2 * args.batch, image_size=args.imgsz, workers=min(args.workers, 4),
                           task=args.task, shapes=getattr(val_ds, "image_sizes", None))
    res["val_loader_s"] = round(time.perf_counter() - t0, 3)

    opt = F._optimizer(config, len(loader))
    ema = make_ema(config.optim.ema_decay, config.optim.ema_tau)
    ts = init_train_state(model, opt.tx, gen, device=device, ema=ema, params=params, state=state)
    dtype = F.autocast_dtype(config.train.autocast, device)
    coco = F._coco_setup(config, val_ds, RunDir(tmp / "coco_run", task=args.task))
    res["validate_s"] = []
    for _ in range(args.repeats):
        records = CocoEvaluator(coco[0], category_ids=coco[1], verbose=False) if coco else None
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        F.validate(model, ts.ema.ema["params"], ts.ema.ema["state"], val_loader, val_ds, config=config,
                   device=device, autocast_dtype=dtype, progress=False, coco=records)
        res["validate_s"].append(round(time.perf_counter() - t0, 3))
    if coco:
        coco[2].abandon()
    rd = RunDir(tmp / "run", task=args.task)
    rd.begin(config)
    res["checkpoint_copy_s"], res["checkpoint_write_s"] = [], []
    for k in range(args.repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        rd.save(ts, config=config, position=DataPosition(k + 1, 0, 0), rng=capture_rng({"init": gen}),
                meta={"elapsed": 0.0}, background=True)
        t1 = time.perf_counter()
        rd.wait()
        res["checkpoint_copy_s"].append(round(t1 - t0, 3))
        res["checkpoint_write_s"].append(round(time.perf_counter() - t1, 3))
    print(json.dumps(res, indent=1))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "fixed.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
