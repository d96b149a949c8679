"""Training mask targets, ours against the reference's training batches with every augmentation off
(black box: its public ``build_yolo_dataset(mode="train")`` with mosaic, affine, HSV and flips at 0).

    YOLO_OFFLINE=1 YOLO_CONFIG_DIR=$(mktemp -d) /work/oracle-venv/bin/python benchmarks/train_gt_masks.py \\
        --images 64 --imgsz 640 --out benchmarks/results

Ours: the train loader's read (``--mask-source``: ``polygons``, the reference's form and the
default for this YOLO-format data, and ``bitmaps``, the dataset's masks warped as crops) ->
``augment(use_mosaic=False)`` with the same zero settings -> ``overlap_map`` (the training
pipeline's masks). Per instance of the reference's overlap map, the
best IoU among ours and the area ratio (ours / the reference's) of that instance: a diagnosis of the
segment recipe-parity gap (issue 14), not a fix. Writes ``train_gt_masks_<stamp>.{json,md}``.
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

ZERO = dict(mosaic=0.0, degrees=0.0, translate=0.0, scale=0.0, shear=0.0, perspective=0.0, hsv_h=0.0, hsv_s=0.0,
            hsv_v=0.0, fliplr=0.0, flipud=0.0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--images", type=int, default=64)
    ap.add_argument("--imgsz", type=int, nargs="+", default=[320, 640])
    ap.add_argument("--mask-source", nargs="+", default=["polygons", "bitmaps"], choices=["polygons", "bitmaps"])
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)
    from ultralytics.cfg import get_cfg
    from ultralytics.data.build import build_yolo_dataset
    from val_gt_masks import builtin_segment_as_yolo

    from yolo_func.data.augment import AugmentConfig, augment, overlap_map
    from yolo_func.data.loader import _Source

    ds, data, names = builtin_segment_as_yolo(args.images, "yolo_func_trainmasks_")
    rows = {}
    for size, source in [(z, m) for z in args.imgsz for m in args.mask_source]:
        read = _Source(ds, "segment", size, source).read
        ref = build_yolo_dataset(get_cfg(overrides=dict(task="segment", imgsz=size, **ZERO)), data["val"], 4, data,
                                 mode="train", rect=False, stride=32)
        ious, ratios = [], []
        for k in range(len(ref)):
            r = ref[k]
            i = names.index(Path(r["im_file"]).name)
            ref_map = r["masks"].numpy().reshape(size // 4, size // 4)
            rec = augment(np.random.default_rng(0), [read(i)], size, AugmentConfig(**ZERO), use_mosaic=False)
            if rec.masks is None or not len(rec.boxes):
                continue
            ours, _ = overlap_map(rec.masks, (size, size), 4)
            values = range(1, int(ours.max()) + 1)
            for v in range(1, int(ref_map.max()) + 1):
                a = ref_map == v
                if a.any():
                    u = max(values, key=lambda u: int(((ours == u) & a).sum()))
                    ious.append(float(((ours == u) & a).sum() / ((ours == u) | a).sum()))
                    ratios.append(float((ours == u).sum() / a.sum()))
        rows[f"{size} {source}"] = {"size": size, "mask_source": source, "instances": len(ious), "mean_iou": round(float(np.mean(ious)), 4),
                      "exact_share": round(float(np.mean(np.array(ious) == 1.0)), 4),
                      "area_ratio_median": round(float(np.median(ratios)), 4),
                      "area_ratio_mean": round(float(np.mean(ratios)), 4)}
    stamp = utc_stamp()
    meta = host_meta(sys.argv if argv is None else ["benchmarks/train_gt_masks.py", *argv])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"train_gt_masks_{stamp}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    md = [f"# Training mask targets vs the reference's (augmentation off) ({stamp})", "", f"`{meta['command']}`", "",
          f"{args.images} built-in segmentation images; per instance of the reference's overlap map, the best IoU "
          "among ours and that instance's area ratio ours / reference.", "",
          "| size | our masks | instances | mean IoU | share exactly equal | area ratio median | area ratio mean |",
          "|--:|---|--:|--:|--:|--:|--:|"]
    md += [f"| {r['size']} | {r['mask_source']} | {r['instances']} | {r['mean_iou']:.4f} | {r['exact_share']:.3f} | {r['area_ratio_median']:.3f} | "
           f"{r['area_ratio_mean']:.3f} |" for r in rows.values()]
    (out / f"train_gt_masks_{stamp}.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
