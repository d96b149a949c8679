"""Inputs shared by the eval goldens recorder, the goldens test and the live parity test.

Raw inference outputs in the reference layout with the structure NMS cares about: clusters of
near-duplicate boxes (jittered copies of the first third of the anchors), exact duplicate boxes,
boxes extending past the image, and continuous scores (no ties: the reference's tie order is not
specified; ties are covered against the brute-force NMS instead).
"""

from __future__ import annotations

import numpy as np

#: (name, multi_label, agnostic, conf, iou, max_det, max_candidates)
DETECT_CONFIGS = (
    ("predict", False, False, 0.25, 0.7, 300, 30000),
    ("val", True, False, 0.001, 0.7, 300, 30000),
    ("val_agnostic", True, True, 0.001, 0.5, 50, 30000),
    ("best_agnostic", False, True, 0.25, 0.45, 300, 30000),
    ("capped", True, False, 0.001, 0.7, 300, 500),
)

INPUT_SHAPE = (96, 128)  # (H, W) of the network input the boxes live in
ORIG_SHAPES = ((70, 128), (75, 101), (50, 60), (96, 128))


def raw_output(seed: int, *, batch: int = 2, num_classes: int = 5, anchors: int = 600, extra: int = 0) -> np.ndarray:
    """float32[B, 4 + K + E, A]: (cx, cy, w, h) pixels in INPUT_SHAPE, class probabilities, E extra."""
    rng = np.random.default_rng(seed)
    H, W = INPUT_SHAPE
    third = anchors // 3
    xy = rng.random((batch, 2, anchors)) * np.array([W, H])[None, :, None]
    wh = rng.random((batch, 2, anchors)) * 50 + 2
    # Jittered copies of the first third (clusters), an exact copy of a few boxes (duplicates).
    xy[:, :, third : 2 * third] = xy[:, :, :third] + rng.normal(0, 2.0, (batch, 2, third))
    wh[:, :, third : 2 * third] = wh[:, :, :third] * (1 + 0.08 * rng.normal(size=(batch, 2, third)))
    xy[:, :, 2 * third : 2 * third + 10] = xy[:, :, :10]
    wh[:, :, 2 * third : 2 * third + 10] = wh[:, :, :10]
    scores = rng.random((batch, num_classes, anchors)) ** 4
    ex = rng.normal(size=(batch, extra, anchors))
    return np.concatenate([xy, np.abs(wh), scores, ex], 1).astype(np.float32)


def pose_output(seed: int, *, batch: int = 2, anchors: int = 600, kpt_shape=(17, 3)) -> np.ndarray:
    """float32[B, 4 + 1 + P*D, A]: one class, keypoints decoded (x, y pixels, confidence in (0, 1))."""
    y = raw_output(seed, batch=batch, num_classes=1, anchors=anchors)
    rng = np.random.default_rng(seed + 1000)
    P, D = kpt_shape
    k = rng.random((batch, P, D, anchors))
    k[:, :, 0] = k[:, :, 0] * (INPUT_SHAPE[1] + 20) - 10
    k[:, :, 1] = k[:, :, 1] * (INPUT_SHAPE[0] + 20) - 10
    return np.concatenate([y, k.reshape(batch, P * D, anchors)], 1).astype(np.float32)


def protos(seed: int, *, batch: int = 2, num_masks: int = 32) -> np.ndarray:
    """float32[B, NM, H/4, W/4] prototypes."""
    rng = np.random.default_rng(seed + 2000)
    H, W = INPUT_SHAPE
    return rng.normal(size=(batch, num_masks, H // 4, W // 4)).astype(np.float32)


def letterbox_of(orig_shape: tuple[int, int]) -> tuple[tuple[float, float], tuple[int, int]]:
    """The reference's letterbox of ``orig_shape`` into INPUT_SHAPE: per-axis gains from the
    rounded resized size and integer (left, top) pads, as its ``scale_boxes`` computes them."""
    H, W = INPUT_SHAPE
    g = min(H / orig_shape[0], W / orig_shape[1])
    nh, nw = round(orig_shape[0] * g), round(orig_shape[1] * g)
    pad = (round((W - nw) / 2 - 0.1), round((H - nh) / 2 - 0.1))
    return (nh / orig_shape[0], nw / orig_shape[1]), pad


def metric_case(seed: int):
    """Random TP flags, confidences and classes for the per-class AP."""
    rng = np.random.default_rng(seed + 3000)
    n = 300
    tp = rng.random((n, 10)) < np.linspace(0.7, 0.2, 10)[None]
    return tp, rng.random(n), rng.integers(0, 6, n), rng.integers(0, 7, 80)
