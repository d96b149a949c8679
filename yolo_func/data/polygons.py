"""Polygons of instances: joining multi-part polygons into one path, outlining raster masks.

The Ultralytics label format holds one polygon per instance, and the reference's augmentation
transforms polygons rather than masks; these helpers turn COCO's multi-part polygons and RLE masks
into that single-path form (:meth:`CocoDataset.polygons`, :func:`write_yolo_dataset`).
"""

from __future__ import annotations

from collections.abc import Sequence

import cv2
import numpy as np
from pycocotools import mask as mask_utils

__all__ = ["merge_polygon_parts", "mask_to_polygon", "segmentation_to_polygon"]


def merge_polygon_parts(parts: Sequence[np.ndarray]) -> np.ndarray:
    """Joins the parts of a multi-part polygon into one closed path (one YOLO label line).

    Each further part hangs off the vertex of the first part nearest to it by a zero-width
    connector walked out and back, so the even-odd fill of the single path covers the union of the
    parts (overlapping parts excepted) and nothing more.

    Args:
      parts: float[K_i, 2] vertices of each part, pixels or normalised.

    Returns:
      float[K, 2] vertices of the single path.
    """
    base = np.asarray(parts[0], np.float64)
    hooks: dict[int, list[np.ndarray]] = {}
    for part in parts[1:]:
        part = np.asarray(part, np.float64)
        d = ((base[:, None, :] - part[None, :, :]) ** 2).sum(-1)
        i, j = np.unravel_index(int(np.argmin(d)), d.shape)
        loop = np.concatenate([np.roll(part, -j, axis=0), part[j:j + 1]])
        hooks.setdefault(int(i), []).append(loop)
    out = []
    for i, v in enumerate(base):
        out.append(v[None])
        for loop in hooks.get(i, []):
            out.append(loop)
            out.append(v[None])
    return np.concatenate(out)


def _pixel_outline(contour: np.ndarray, hole: bool) -> np.ndarray:
    """The outline of a contour's pixels (pixel-corner frame) from OpenCV's pixel-centre contour.

    ``cv2.findContours`` returns the centres of the boundary pixels; the pixels themselves reach
    half a pixel further. Each edge (axis-aligned or diagonal with ``CHAIN_APPROX_SIMPLE``) is moved
    away from the object by ``0.5 * max(|n_x|, |n_y|)`` (half a pixel for an axis-aligned edge, the
    area-preserving line of a 45-degree staircase for a diagonal one) and adjacent edges are
    re-intersected. Rasterised back with pycocotools, the outline gives the mask's pixels (exactly
    on rectangles, circles and triangles in the tests; IoU >= 0.95 on the built-in shapes).

    Args:
      contour: float[K, 2] pixel-centre contour (x, y) from ``cv2.findContours``.
      hole: True for a hole's contour (then the object is outside it).

    Returns:
      float[K', 2] outline vertices.
    """
    v = contour + 0.5
    if len(v) < 3 or abs(cv2.contourArea(v.astype(np.float32))) < 1e-9:  # a pixel or a 1-pixel line
        (x1, y1), (x2, y2) = contour.min(0), contour.max(0) + 1
        return np.array([[x1, y1], [x2, y1], [x2, y2], [x1, y2]], np.float64)
    e = np.roll(v, -1, axis=0) - v
    twice_area = float((v[:, 0] * np.roll(v[:, 1], -1) - np.roll(v[:, 0], -1) * v[:, 1]).sum())
    left = np.stack([-e[:, 1], e[:, 0]], 1) / np.linalg.norm(e, axis=1, keepdims=True)
    out = -left if (twice_area > 0) != hole else left  # away from the object
    d = 0.5 * np.maximum(np.abs(out[:, 0]), np.abs(out[:, 1]))
    n1, d1 = np.roll(out, 1, axis=0), np.roll(d, 1)  # the edge into each vertex
    det = n1[:, 0] * out[:, 1] - n1[:, 1] * out[:, 0]
    ok = np.abs(det) > 1e-6
    safe = np.where(ok, det, 1.0)
    corner = np.stack([(d1 * out[:, 1] - d * n1[:, 1]) / safe, (n1[:, 0] * d - out[:, 0] * d1) / safe], 1)
    return v + np.where(ok[:, None], corner, d1[:, None] * n1)


def mask_to_polygon(mask: np.ndarray) -> np.ndarray | None:
    """One closed path outlining a binary mask's parts and holes (pixel-corner frame).

    Args:
      mask: uint8/bool[H, W] binary mask.

    Returns:
      float64[K, 2] (x, y) vertices whose even-odd fill (pycocotools) gives the mask's pixels, or
      None for an empty mask.
    """
    contours, hierarchy = cv2.findContours(mask.astype(np.uint8), cv2.RETR_CCOMP, cv2.CHAIN_APPROX_SIMPLE)
    if not contours:
        return None
    parts = [_pixel_outline(c.reshape(-1, 2).astype(np.float64), hole=bool(row[3] >= 0))
             for c, row in zip(contours, hierarchy[0])]
    parts.sort(key=lambda c: -abs(cv2.contourArea(c.astype(np.float32))))
    return merge_polygon_parts(parts)


def segmentation_to_polygon(segmentation, height: int, width: int) -> np.ndarray | None:
    """One path for a COCO segmentation: polygon parts joined, RLE outlined.

    Args:
      segmentation: a list of flat polygon parts (pixels) or an RLE dict of size ``[height, width]``.
      height: image height H.
      width: image width W.

    Returns:
      float64[K, 2] (x, y) pixel vertices, or None when the segmentation is empty.
    """
    if isinstance(segmentation, dict):
        rle = mask_utils.frPyObjects(segmentation, height, width) if isinstance(segmentation["counts"], list) \
            else segmentation
        return mask_to_polygon(mask_utils.decode(rle))
    parts = [np.asarray(p, np.float64).reshape(-1, 2) for p in segmentation]
    return merge_polygon_parts(parts) if parts else None
