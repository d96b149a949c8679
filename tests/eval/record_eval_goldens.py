"""Record the reference package's postprocessing on the inputs of ``eval_cases.py`` (oracle venv).

    YOLO_OFFLINE=1 YOLO_CONFIG_DIR=$(mktemp -d) PYTHONPATH=. /work/oracle-venv/bin/python tests/eval/record_eval_goldens.py

Black-box public calls only (ORACLE.md): ``ultralytics.utils.nms.non_max_suppression``,
``ultralytics.utils.ops.{process_mask, process_mask_native, scale_masks, scale_boxes, scale_coords}``,
``ultralytics.utils.metrics.{ap_per_class, compute_ap}`` and ``DetectionValidator().match_predictions``.
Writes ``tests/eval/goldens/postprocess.npz``, read by ``tests/eval/test_eval_goldens.py``. The inputs
are not stored (they are regenerated from their seeds by ``eval_cases.py``); a fingerprint of each is.
Masks are bit-packed.
"""

from __future__ import annotations

import os
import sys
import tempfile
import types
from pathlib import Path

os.environ.setdefault("YOLO_OFFLINE", "1")
os.environ.setdefault("YOLO_CONFIG_DIR", os.path.join(tempfile.gettempdir(), "yolo_func_ycfg"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import eval_cases as cases  # noqa: E402

OUT = Path(__file__).resolve().parent / "goldens" / "postprocess.npz"


def reference_nms(y, *, multi_label, agnostic, conf, iou, max_det, max_candidates, nc):
    from ultralytics.utils.nms import non_max_suppression

    return non_max_suppression(
        torch.from_numpy(y).clone(), conf, iou, agnostic=agnostic, multi_label=multi_label, max_det=max_det,
        nc=nc, max_nms=max_candidates, max_time_img=1e9,
    )


def match_predictions(pred_classes, gt_classes, iou):
    """``DetectionValidator().match_predictions``. Its constructor imports torchvision, whose compiled
    ops do not load beside the oracle venv's CPU torch: a stand-in module is present only while it
    is built (the reference's NMS must not see it, it would take the torchvision path)."""
    from ultralytics.models.yolo.detect import DetectionValidator

    had = "torchvision" in sys.modules
    sys.modules.setdefault("torchvision", types.ModuleType("torchvision"))
    try:
        v = DetectionValidator()
    finally:
        if not had:
            del sys.modules["torchvision"]
    return v.match_predictions(torch.as_tensor(pred_classes), torch.as_tensor(gt_classes), torch.as_tensor(iou)).numpy()


def fingerprint(x: np.ndarray) -> np.ndarray:
    """Sum and first values of a regenerated input: tells a changed RNG stream from a changed result."""
    return np.concatenate([[x.astype(np.float64).sum()], x.reshape(-1)[:8].astype(np.float64)])


def rows(out):
    return np.concatenate([o.numpy() for o in out]), np.array([len(o) for o in out])


def record() -> dict[str, np.ndarray]:
    from ultralytics.utils import metrics, ops

    g: dict[str, np.ndarray] = {}
    y = cases.raw_output(0)
    g["det/y_fingerprint"] = fingerprint(y)
    for name, ml, ag, conf, iou, max_det, cap in cases.DETECT_CONFIGS:
        g[f"det/{name}/rows"], g[f"det/{name}/counts"] = rows(
            reference_nms(y, multi_label=ml, agnostic=ag, conf=conf, iou=iou, max_det=max_det, max_candidates=cap, nc=5)
        )

    # Segmentation: NMS rows carry the coefficients; masks of image 0 by each method.
    ys, pr = cases.raw_output(1, num_classes=3, extra=32), cases.protos(1)
    g["seg/y_fingerprint"], g["seg/protos_fingerprint"] = fingerprint(ys), fingerprint(pr)
    out = reference_nms(ys, multi_label=False, agnostic=False, conf=0.25, iou=0.7, max_det=30, max_candidates=30000, nc=3)
    g["seg/rows"], g["seg/counts"] = rows(out)
    det0, p0 = out[0], torch.from_numpy(pr[0])
    H, W = cases.INPUT_SHAPE
    val = ops.process_mask(p0, det0[:, 6:], det0[:, :4], (H, W), upsample=False).bool()
    pred = ops.process_mask(p0, det0[:, 6:], det0[:, :4], (H, W), upsample=True).bool()
    g["seg/val"], g["seg/predict"] = np.packbits(val.numpy()), np.packbits(pred.numpy())
    for i, orig in enumerate(cases.ORIG_SHAPES):
        boxes = ops.scale_boxes((H, W), det0[:, :4].clone(), orig)
        g[f"seg/orig{i}/boxes"] = boxes.numpy()
        g[f"seg/orig{i}/native"] = np.packbits(ops.process_mask_native(p0, det0[:, 6:], boxes, orig).bool().numpy())
        g[f"seg/orig{i}/rescaled"] = np.packbits((ops.scale_masks(pred[None].float(), orig)[0] > 0.5).numpy())

    # Pose: keypoints travel with their rows; back to the original image.
    yp = cases.pose_output(2)
    g["pose/y_fingerprint"] = fingerprint(yp)
    out = reference_nms(yp, multi_label=False, agnostic=False, conf=0.25, iou=0.7, max_det=40, max_candidates=30000, nc=1)
    g["pose/rows"], g["pose/counts"] = rows(out)
    for i, orig in enumerate(cases.ORIG_SHAPES):
        kp = out[0][:, 6:].reshape(-1, 17, 3)
        g[f"pose/orig{i}/keypoints"] = ops.scale_coords((H, W), kp.clone(), orig).numpy()
        g[f"pose/orig{i}/boxes"] = ops.scale_boxes((H, W), out[0][:, :4].clone(), orig).numpy()

    # Metrics.
    for s in range(3):
        tp, conf, pcls, tcls = cases.metric_case(s)
        r = metrics.ap_per_class(tp, conf, pcls, tcls)
        g[f"metric{s}/p"], g[f"metric{s}/r"], g[f"metric{s}/ap"], g[f"metric{s}/classes"] = r[2], r[3], r[5], r[6]
    rng = np.random.default_rng(7)
    iou = rng.random((12, 40)) * (rng.random((12, 40)) < 0.4)
    pc, gc = rng.integers(0, 3, 40), rng.integers(0, 3, 12)
    g["match/iou"], g["match/pred"], g["match/gt"] = iou, pc, gc
    g["match/tp"] = match_predictions(pc, gc, iou)
    return g


if __name__ == "__main__":
    import ultralytics

    g = record()
    g["recipe/versions"] = np.array([f"ultralytics=={ultralytics.__version__}", f"torch=={torch.__version__}"])
    OUT.parent.mkdir(exist_ok=True)
    np.savez_compressed(OUT, **g)
    print(f"wrote {OUT} ({OUT.stat().st_size / 1024:.0f} KB, {len(g)} arrays)")
