"""How many segment training boxes the border rule changes: the extent of each polygon's part
inside the image (``clipped_polygon_boxes``, the reference's ``segment2box`` rule, in use) against
the clamped extent of the whole polygon (the rule of a32d41c-20cd382), on mosaic-augmented
``coco-tiny`` records at 640 (CPU).

    python benchmarks/diag_polygon_boxes.py --epochs 4 --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

from _fit_common import host_meta, utc_stamp  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default=str(Path(__file__).resolve().parents[2] / "shared" / "data" / "coco-tiny"))
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--imgsz", type=int, default=640)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)
    from yolo_func.data import CocoDataset
    from yolo_func.data.augment import AugmentConfig, augment, record_rng
    from yolo_func.data.loader import _Source
    from yolo_func.data.polygons import polygon_extents

    ds = CocoDataset(Path(args.data) / "annotations.json", Path(args.data) / "images", task="segment")
    src = _Source(ds, "segment", args.imgsz, "polygons")
    recs = [src.read(i) for i in range(len(ds))]
    n, diffs = 0, []
    for ep in range(args.epochs):
        for i in range(len(ds)):
            rng = record_rng(0, ep, i)
            part = [recs[i]] + [recs[j] for j in rng.choice(len(ds), 3)]
            out = augment(rng, part, args.imgsz, AugmentConfig(), use_mosaic=True)
            p = out.masks.points
            valid = np.isfinite(p).all((1, 2))
            lo, hi = polygon_extents(np.where(valid[:, None, None], p, 0))
            clamped = np.clip(np.concatenate([lo, hi], 1), 0, args.imgsz)
            d = np.abs(clamped - out.boxes).max(1)
            n += len(d)
            diffs += d[d > 1].tolist()
    row = {"instances": n, "differ_gt_1px": len(diffs), "share": round(len(diffs) / max(n, 1), 4),
           "median_px": round(float(np.median(diffs)), 2) if diffs else 0.0,
           "max_px": round(float(max(diffs)), 2) if diffs else 0.0}
    print(json.dumps(row))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"diag_polygon_boxes_{utc_stamp()}.json"
    path.write_text(json.dumps({"meta": host_meta(["benchmarks/diag_polygon_boxes.py", *(argv or sys.argv[1:])]),
                                "result": row}, indent=1))
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
