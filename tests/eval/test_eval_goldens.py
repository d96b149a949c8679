"""Postprocessing against the reference package's recorded outputs (``record_eval_goldens.py``), on the CPU.

Exact equality for NMS rows (boxes, scores, classes, coefficients, keypoints), masks of the
``val`` / ``predict`` methods and the mask rescaling; boxes and keypoints mapped back to the
original image to float32 rounding.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from yolo_func.eval import Detections, Letterbox, masks as M, metrics, postprocess, scale_to_original
from yolo_func.models import Inference

sys.path.insert(0, str(Path(__file__).resolve().parent))
import eval_cases as cases  # noqa: E402

GOLDENS = Path(__file__).resolve().parent / "goldens" / "postprocess.npz"
H, W = cases.INPUT_SHAPE


@pytest.fixture(scope="module")
def g():
    return dict(np.load(GOLDENS))


def regenerated(g, key: str, x: np.ndarray) -> torch.Tensor:
    fp = np.concatenate([[x.astype(np.float64).sum()], x.reshape(-1)[:8].astype(np.float64)])
    np.testing.assert_allclose(fp, g[key], rtol=1e-12, err_msg=f"{key}: numpy's RNG stream changed; re-record the goldens")
    return torch.from_numpy(x)


def as_rows(dets: list) -> tuple[np.ndarray, np.ndarray]:
    parts = []
    for d in dets:
        extra = [] if d.keypoints is None else [d.keypoints.reshape(len(d.scores), -1)]
        parts.append(torch.cat([d.boxes, d.scores[:, None], d.classes[:, None].float(), *extra], 1))
    return torch.cat(parts).numpy(), np.array([len(d.scores) for d in dets])


@pytest.mark.parametrize("cfg", cases.DETECT_CONFIGS, ids=[c[0] for c in cases.DETECT_CONFIGS])
def test_detect_nms_equals_reference(g, cfg):
    name, ml, ag, conf, iou, max_det, cap = cfg
    y = regenerated(g, "det/y_fingerprint", cases.raw_output(0))
    dets = postprocess(Inference(y), conf=conf, iou=iou, max_det=max_det, multi_label=ml, agnostic=ag, max_candidates=cap, block=128)
    got, counts = as_rows(dets)
    np.testing.assert_array_equal(counts, g[f"det/{name}/counts"])
    np.testing.assert_array_equal(got, g[f"det/{name}/rows"])
    assert counts.min() > 0


def seg_case(g):
    y = regenerated(g, "seg/y_fingerprint", cases.raw_output(1, num_classes=3, extra=32))
    p = regenerated(g, "seg/protos_fingerprint", cases.protos(1))
    return y, p


def unpack(bits: np.ndarray, shape) -> np.ndarray:
    n = int(np.prod(shape))
    return np.unpackbits(bits)[:n].reshape(shape).astype(bool)


@pytest.mark.parametrize("method", ["val", "predict"])
def test_segment_rows_and_masks_equal_reference(g, method):
    y, p = seg_case(g)
    dets = postprocess(Inference(y, p), conf=0.25, iou=0.7, max_det=30, mask_method=method)
    rows, counts = g["seg/rows"], g["seg/counts"]
    np.testing.assert_array_equal([len(d.scores) for d in dets], counts)
    d0 = dets[0]
    np.testing.assert_array_equal(d0.boxes.numpy(), rows[: counts[0], :4])
    np.testing.assert_array_equal(d0.scores.numpy(), rows[: counts[0], 4])
    shape = (counts[0], H // 4, W // 4) if method == "val" else (counts[0], H, W)
    assert d0.masks.dtype == torch.bool and tuple(d0.masks.shape) == shape
    np.testing.assert_array_equal(d0.masks.numpy(), unpack(g[f"seg/{method}"], shape))
    assert d0.masks.any()


@pytest.mark.parametrize("i", range(len(cases.ORIG_SHAPES)))
def test_segment_to_original_equals_reference(g, i):
    y, p = seg_case(g)
    orig = cases.ORIG_SHAPES[i]
    gain, pad = cases.letterbox_of(orig)
    lb = [Letterbox(orig, gain, pad)] * 2
    native = postprocess(Inference(y, p), conf=0.25, iou=0.7, max_det=30, mask_method="native", letterbox=lb)[0]
    n = int(g["seg/counts"][0])
    torch.testing.assert_close(native.boxes, torch.from_numpy(g[f"seg/orig{i}/boxes"]), rtol=0, atol=1e-4)
    np.testing.assert_array_equal(native.masks.numpy(), unpack(g[f"seg/orig{i}/native"], (n, *orig)))
    # Predict-size masks rescaled by scale_to_original = the reference's scale_masks.
    pred = postprocess(Inference(y, p), conf=0.25, iou=0.7, max_det=30, mask_method="predict")[0]
    back = scale_to_original(pred, orig_shape=orig, gain=gain, pad=pad, input_shape=(H, W))
    np.testing.assert_array_equal(back.masks.numpy(), unpack(g[f"seg/orig{i}/rescaled"], (n, *orig)))


def test_pose_rows_and_keypoints_equal_reference(g):
    y = regenerated(g, "pose/y_fingerprint", cases.pose_output(2))
    dets = postprocess(Inference(y), conf=0.25, iou=0.7, max_det=40, kpt_shape=(17, 3))
    got, counts = as_rows(dets)
    np.testing.assert_array_equal(counts, g["pose/counts"])
    np.testing.assert_array_equal(got, g["pose/rows"])
    for i, orig in enumerate(cases.ORIG_SHAPES):
        gain, pad = cases.letterbox_of(orig)
        back = scale_to_original(dets[0], orig_shape=orig, gain=gain, pad=pad)
        torch.testing.assert_close(back.keypoints, torch.from_numpy(g[f"pose/orig{i}/keypoints"]), rtol=0, atol=1e-4)
        torch.testing.assert_close(back.boxes, torch.from_numpy(g[f"pose/orig{i}/boxes"]), rtol=0, atol=1e-4)


@pytest.mark.parametrize("s", range(3))
def test_ap_per_class_equals_reference(g, s):
    tp, conf, pcls, tcls = cases.metric_case(s)
    r = metrics.ap_per_class(tp, conf, pcls, tcls)
    np.testing.assert_array_equal(r["classes"], g[f"metric{s}/classes"])
    np.testing.assert_allclose(r["ap"], g[f"metric{s}/ap"], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(r["p"], g[f"metric{s}/p"], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(r["r"], g[f"metric{s}/r"], rtol=1e-12, atol=1e-12)


def test_match_predictions_equals_reference(g):
    tp = metrics.match_predictions(g["match/pred"], g["match/gt"], g["match/iou"])
    np.testing.assert_array_equal(tp, g["match/tp"])
    assert tp.any() and not tp.all()
