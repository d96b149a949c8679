"""Seconds per call of the fit's per-epoch ``validate`` fed COCO records, and of ``yolo_func.eval.evaluate``
(issue 14: validation as a fixed cost of a short fit; issue 13: validation images/s).

A segmentation nano model (random init, class biases raised so that many detections survive
conf 0.001, as in early training: class 0 at ``--bias0``, the others at ``--bias``) on the first
``--images`` images of ``coco-tiny`` at ``--imgsz``. For each val batch size in ``--val-batch``:

- ``validate``: ``yolo_func.train.fit.validate`` with a ``CocoEvaluator`` (the fit's ``val.coco``
  path: COCO records with masks at the original size; pycocotools itself runs later, in the fit's
  background thread, so it is not in this time). The first call (which rasterises the
  ground-truth masks into the fit's ``gt_cache``) is reported apart from the median of the rest.
- ``evaluate``: ``yolo_func.eval.evaluate`` (the ``yolo-func val`` path), COCO records and
  pycocotools (serially in this process, ``coco_workers=0``), loader in-process.

Prints one line per (function, batch): seconds per call (median, min, max over ``--runs``), and
the number of COCO records the last call made. ``--cprofile N`` prints the top N functions by
cumulative time of one ``validate`` call (and one ``evaluate`` call) per batch size.

GPU check (one command, from the repository root)::

    python benchmarks/profile_validate.py --device cuda --val-batch 8 32

CPU (small images), after and before (the base commit unpacked with ``git archive``)::

    python benchmarks/profile_validate.py --device cpu --imgsz 320 --val-batch 8 --runs 2 --cprofile 25
    mkdir /tmp/base && git archive 2fd1cf7 | tar -x -C /tmp/base
    python benchmarks/profile_validate.py --code /tmp/base --device cpu --imgsz 320 --val-batch 8 --runs 2 --cprofile 25
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

_REPO = Path(__file__).resolve().parents[1]
# --code DIR: import yolo_func from another checkout (e.g. `git archive` of the base commit), for before / after
_CODE = Path(sys.argv[sys.argv.index("--code") + 1]).resolve() if "--code" in sys.argv else _REPO
sys.path.insert(0, str(_CODE))

import torch  # noqa: E402

from yolo_func import tree as T  # noqa: E402
from yolo_func import yolov8  # noqa: E402
from yolo_func.configs import build_config  # noqa: E402
from yolo_func.data import CocoDataset, ValLoader  # noqa: E402
from yolo_func.eval import CocoEvaluator  # noqa: E402
from yolo_func.eval.coco_eval import load_coco  # noqa: E402
from yolo_func.eval.evaluate import dataset_categories, evaluate_with_records  # noqa: E402
from yolo_func.train.fit import validate  # noqa: E402

SHARED = next((p for p in (Path(os.environ.get("YOLO_FUNC_SHARED_DATA", "/nonexistent")), _REPO.parent / "shared" / "data",
                            _REPO / "shared" / "data") if p.is_dir()), _REPO.parent / "shared" / "data")


def _subset(n: int, tmp: Path) -> CocoDataset:
    """The first ``n`` images of coco-tiny (their annotations, every category kept)."""
    root = SHARED / "coco-tiny"
    data = json.loads((root / "annotations.json").read_text())
    images = data["images"][:n]
    ids = {im["id"] for im in images}
    data = {**data, "images": images, "annotations": [a for a in data["annotations"] if a["image_id"] in ids]}
    path = tmp / "annotations.json"
    path.write_text(json.dumps(data))
    return CocoDataset(path, root / "images", task="segment")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _top(prof: cProfile.Profile, n: int) -> str:
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(n)
    return s.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--imgsz", type=int, default=640)
    ap.add_argument("--images", type=int, default=16)
    ap.add_argument("--val-batch", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--bias0", type=float, default=-1.0, help="class 0's logit bias (many class-0 detections)")
    ap.add_argument("--bias", type=float, default=-5.0, help="the other classes' logit bias")
    ap.add_argument("--cprofile", type=int, default=0, help="print the top N functions of one call")
    ap.add_argument("--skip-evaluate", action="store_true")
    ap.add_argument("--code", default=str(_REPO), help="checkout whose yolo_func is timed (default: this one)")
    args = ap.parse_args()
    device = torch.device(args.device)
    tmp = Path(tempfile.mkdtemp(prefix="profile_validate_"))
    dataset = _subset(args.images, tmp)
    model = yolov8("n", task="segment", num_classes=len(dataset.names))
    params, state = model.init(torch.Generator().manual_seed(0))
    for path, leaf in T.tree_items(params):
        if path.startswith("heads/detect/cls/") and path.endswith("pred/bias"):
            leaf.fill_(args.bias)
            leaf[0] = args.bias0
    params, state = T.tree_to(params, device), T.tree_to(state, device)
    gt, category_ids = dataset_categories(dataset)
    gt = load_coco(gt)
    dtype = torch.bfloat16 if device.type == "cuda" else None
    import yolo_func

    print(f"yolo_func from {Path(yolo_func.__file__).parent}")
    print(f"device {device}, {len(dataset)} images at {args.imgsz}, segment nano, torch {torch.__version__}")
    for vb in args.val_batch:
        config = build_config("yolov8n-seg", flags={"imgsz": args.imgsz, "device": str(device)},
                              overrides=[f"val.batch_size={vb}"])
        loader = ValLoader(dataset, batch_size=vb, image_size=args.imgsz, workers=0, task="segment")
        cache: dict = {}
        times, n_records = [], 0
        with torch.no_grad():
            for r in range(args.runs + 1):
                ev = CocoEvaluator(gt, category_ids=category_ids, verbose=False)
                prof = cProfile.Profile() if args.cprofile and r == 1 else None
                _sync(device)
                t0 = time.perf_counter()
                if prof:
                    prof.enable()
                validate(model, params, state, loader, dataset, config=config, device=device, autocast_dtype=dtype,
                         progress=False, coco=ev, gt_cache=cache)
                _sync(device)
                if prof:
                    prof.disable()
                times.append(time.perf_counter() - t0)
                n_records = len(ev.results)
                if prof:
                    print(f"--- cProfile of validate, val batch {vb}\n{_top(prof, args.cprofile)}")
        rest = times[1:]
        print(f"validate  val batch {vb:3d}: first {times[0]:.3f} s, then median {statistics.median(rest):.3f} s "
              f"(min {min(rest):.3f}, max {max(rest):.3f}) per call, {n_records} COCO records")
        if args.skip_evaluate:
            continue
        times = []
        for r in range(args.runs):
            prof = cProfile.Profile() if args.cprofile and r == 0 else None
            _sync(device)
            t0 = time.perf_counter()
            if prof:
                prof.enable()
            _, records = evaluate_with_records(model, params, state, dataset, image_size=args.imgsz, batch_size=vb,
                                               device=device, workers=0, progress=False, verbose=False, coco_workers=0)
            _sync(device)
            if prof:
                prof.disable()
                print(f"--- cProfile of evaluate, batch {vb}\n{_top(prof, args.cprofile)}")
            times.append(time.perf_counter() - t0)
        print(f"evaluate  batch     {vb:3d}: median {statistics.median(times):.3f} s (min {min(times):.3f}, "
              f"max {max(times):.3f}) per call, {len(records)} COCO records")


if __name__ == "__main__":
    main()
