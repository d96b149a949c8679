"""Validation ground-truth masks, ours against the reference's val batches (black box: its public
``build_yolo_dataset(mode="val", rect=True)``), instance by instance, on the same letterbox.

    YOLO_OFFLINE=1 YOLO_CONFIG_DIR=$(mktemp -d) /work/oracle-venv/bin/python benchmarks/val_gt_masks.py \\
        --images 64 --imgsz 320 --out benchmarks/results

The data: the built-in segmentation val split (``--images`` images) written in the Ultralytics
format. For each instance of the reference's overlap map (value v: ``map == v``), the best IoU
among our instances under three rules: ``val_gt_masks`` (the fit's validation now), the same
polygon raster without the overlap form, and the rule before 2026-12-06 (each instance's dense
mask warped straight to a quarter, bilinear > 0.5). Writes ``val_gt_masks_<stamp>.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path

import cv2
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

from _fit_common import host_meta, utc_stamp  # noqa: E402


def builtin_segment_as_yolo(images: int, prefix: str) -> tuple:
    """``images`` built-in segmentation val images written in the Ultralytics format (a temp folder):
    ``(our YoloDataset of them, the reference's parsed data dict, file name of each of our images)``."""
    from ultralytics.data.utils import check_det_dataset

    from yolo_func.data import YoloDataset, builtin_dataset
    from yolo_func.data.yolo import write_yolo_dataset

    work = Path(tempfile.mkdtemp(prefix=prefix))
    coco = builtin_dataset("segment", "val", root=work / "b", num_images=images)
    yaml_path = write_yolo_dataset({"train": coco, "val": coco}, work / "yolo")
    ds = YoloDataset(yaml_path, "val", task="segment")
    return ds, check_det_dataset(str(yaml_path)), [Path(f).name for f in ds.file_names]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--images", type=int, default=64)
    ap.add_argument("--imgsz", type=int, default=320)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)
    from ultralytics.cfg import get_cfg
    from ultralytics.data.build import build_yolo_dataset

    from yolo_func.data.augment import RoiMasks, letterbox_params
    from yolo_func.eval.gt_masks import letterboxed_polygon_masks, overlap_split, val_gt_masks

    ds, data, names = builtin_segment_as_yolo(args.images, "yolo_func_gtmasks_")
    ref = build_yolo_dataset(get_cfg(overrides={"task": "segment", "imgsz": args.imgsz}), data["val"], 4, data,
                             mode="val", rect=True, stride=32)
    rules = {"val_gt_masks": [], "polygons, no overlap form": [], "before (dense warp, no overlap form)": []}

    def best(ours, a):
        return float(((ours & a).sum((1, 2)) / np.maximum((ours | a).sum((1, 2)), 1)).max()) if len(ours) else 0.0

    for k in range(len(ref)):
        r = ref[k]
        i = names.index(Path(r["im_file"]).name)
        ref_map = r["masks"][0].numpy()
        H, W = (int(v) for v in r["img"].shape[1:])
        h0, w0 = (int(v) for v in ds.image_sizes[i])
        s = args.imgsz / max(h0, w0)
        w, h = (min(math.ceil(w0 * s), args.imgsz), min(math.ceil(h0 * s), args.imgsz)) if s != 1 else (w0, h0)
        p = letterbox_params((h, w), (H, W), scaleup=False)
        gain = (p.gain[0] * w / w0, p.gain[1] * h / h0)
        now = val_gt_masks(ds, i, orig_shape=(h0, w0), gain=gain, pad=p.pad, shape=(H, W)).numpy()
        dense = letterboxed_polygon_masks(ds.polygons(i), gain, p.pad, (H, W)).to_dense((H, W))
        alone = np.stack([overlap_split(RoiMasks.from_dense(m[None]), (H, W)).numpy()[0] for m in dense]) \
            if len(dense) else np.zeros((0, H // 4, W // 4), bool)
        quarter = np.array([[gain[0] / 4, 0, p.pad[0] / 4], [0, gain[1] / 4, p.pad[1] / 4]], np.float64)
        masks = ds[i].masks
        before = np.stack([cv2.warpAffine(m.astype(np.float32), quarter, (W // 4, H // 4), flags=cv2.INTER_LINEAR) > 0.5
                           for m in masks]) if masks is not None and len(masks) else np.zeros((0, H // 4, W // 4), bool)
        for v in range(1, int(ref_map.max()) + 1):
            a = ref_map == v
            if a.any():
                for rule, got in zip(rules, (now, alone, before)):
                    rules[rule].append(best(got, a))
    stamp = utc_stamp()
    meta = host_meta(sys.argv if argv is None else ["benchmarks/val_gt_masks.py", *argv])
    rows = {rule: {"instances": len(v), "mean_iou": round(float(np.mean(v)), 4), "min_iou": round(float(np.min(v)), 4),
                   "exact_share": round(float(np.mean(np.array(v) == 1.0)), 4)} for rule, v in rules.items()}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"val_gt_masks_{stamp}.json").write_text(json.dumps({"meta": meta, "images": len(ref), "imgsz": args.imgsz,
                                                                "rows": rows}, indent=1))
    md = [f"# Validation ground-truth masks vs the reference's val batches ({stamp})", "", f"`{meta['command']}`", "",
          f"{len(ref)} built-in segmentation val images at {args.imgsz} (rect batches of 4); per instance of the "
          "reference's overlap map, the best IoU among ours.", "",
          "| rule | instances | mean IoU | min IoU | share exactly equal |", "|---|--:|--:|--:|--:|"]
    md += [f"| {rule} | {r['instances']} | {r['mean_iou']:.4f} | {r['min_iou']:.4f} | {r['exact_share']:.3f} |"
           for rule, r in rows.items()]
    (out / f"val_gt_masks_{stamp}.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
