"""Polygons of instances: joining multi-part polygons into one path, outlining raster masks,
resampling and filling them as the reference does.

The Ultralytics label format holds one polygon per instance, and the reference's augmentation
transforms polygons rather than masks; these helpers turn COCO's multi-part polygons and RLE masks
into that single-path form (:meth:`CocoDataset.polygons`, :func:`write_yolo_dataset`), resample
each to a fixed number of points (:func:`resample_polygon`, :func:`resample_polygons`) and fill
them the reference's way (:func:`fill_polygons`: vertices truncated to integers, ``cv2.fillPoly``),
for the training masks (:class:`yolo_func.data.augment.PolygonMasks`) and the validation ground
truth (:mod:`yolo_func.eval.gt_masks`).
"""

from __future__ import annotations

from collections.abc import Sequence

import cv2
import numpy as np
from pycocotools import mask as mask_utils

__all__ = ["RESAMPLE_POINTS", "merge_polygon_parts", "mask_to_polygon", "segmentation_to_polygon", "resample_polygon",
           "resample_polygons", "polygon_extents", "clipped_polygon_boxes", "fill_polygons"]

RESAMPLE_POINTS = 1000  # the reference resamples every segment to this many points (REFERENCE.md §4.6)


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
    if not hooks and len(base):  # one part (most instances): the path is the part itself
        return base.copy()
    # the base's vertices in order; after vertex i, each part hooked there and back to vertex i
    out, start = [], 0
    for i in sorted(hooks):
        out.append(base[start:i + 1])
        for loop in hooks[i]:
            out.append(loop)
            out.append(base[i:i + 1])
        start = i + 1
    out.append(base[start:])
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


def resample_polygon(polygon: np.ndarray, n: int = RESAMPLE_POINTS) -> np.ndarray:
    """``n`` points evenly spaced in vertex index along the closed polygon (its first vertex
    repeated at the end), linearly interpolated, as float32.

    Args:
      polygon: float[K, 2] (x, y) vertices, K >= 1.
      n: points out.

    Returns:
      float32[n, 2]; the first point is ``polygon[0]`` and the last the closing vertex.
    """
    p = np.asarray(polygon, np.float64).reshape(-1, 2)
    closed = np.concatenate((p, p[:1]), 0)
    x = np.linspace(0, len(closed) - 1, n)
    xp = np.arange(len(closed))
    return np.stack([np.interp(x, xp, closed[:, i]) for i in range(2)], 1).astype(np.float32)


def resample_polygons(polygons: Sequence[np.ndarray], n: int = RESAMPLE_POINTS) -> np.ndarray:
    """Every polygon resampled to ``n`` points (:func:`resample_polygon`) in one array.

    Args:
      polygons: N float[K_j, 2] (x, y) vertex arrays; one with fewer than 3 vertices is no area.

    Returns:
      float32[N, n, 2]; the rows of a polygon with fewer than 3 vertices are NaN (no pixels, no box).
    """
    out = np.full((len(polygons), n, 2), np.nan, np.float32)
    for j, p in enumerate(polygons):
        p = np.asarray(p, np.float64).reshape(-1, 2)
        if len(p) >= 3 and np.isfinite(p).all():
            out[j] = resample_polygon(p, n)
    return out


def polygon_extents(points: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-polygon minimum and maximum of ``points[N, P, 2]``: ``(lo[N, 2], hi[N, 2])``.

    Reduces x and y separately along the point axis: numpy's reduction over the middle axis of a
    ``[N, P, 2]`` array runs ~50x slower (its inner loop is the length-2 axis).
    """
    lo = np.stack([points[..., 0].min(1), points[..., 1].min(1)], 1) if len(points) else np.zeros((0, 2), points.dtype)
    hi = np.stack([points[..., 0].max(1), points[..., 1].max(1)], 1) if len(points) else np.zeros((0, 2), points.dtype)
    return lo, hi


def clipped_polygon_boxes(points: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """The box of each polygon's part inside the image: the extent of ``polygon ∩ [0, W] x [0, H]``
    (the reference's box rule for a transformed segment; its public ``segment2box`` gives the same
    boxes, a ``parity`` test checks it). Zeros where nothing of the polygon is inside.

    The clipped polygon's vertices are the polygon's vertices inside the image, the crossings of
    its edges with the image's four border lines that lie on the border, and the image corners
    inside the polygon (even-odd rule); the box is their extent. A polygon entirely inside takes
    its vertices' extent directly. Clamping the coordinates instead would overstate the box of a
    polygon crossing the border (its clamped part runs along the border beyond the object).

    Args:
      points: float[N, P, 2] (x, y) pixel vertices (closed: the last connects to the first); a row
        with a non-finite value gives zeros.
      shape: (H, W) of the image.

    Returns:
      float32[N, 4] xyxy.
    """
    H, W = float(shape[0]), float(shape[1])
    n = len(points)
    out = np.zeros((n, 4), np.float32)
    if n == 0:
        return out
    # x and y as contiguous [N, P] rows (reductions along a row are fast; a [N, P, 2] view's are not).
    # Comparisons are exact in the points' own dtype; only the crossings are solved in float64.
    xs, ys = np.ascontiguousarray(points[..., 0]), np.ascontiguousarray(points[..., 1])
    with np.errstate(invalid="ignore"):
        lx, hx, ly, hy = xs.min(1), xs.max(1), ys.min(1), ys.max(1)  # NaN where a row has one
    valid = np.isfinite(lx) & np.isfinite(hx) & np.isfinite(ly) & np.isfinite(hy)
    whole = valid & (lx >= 0) & (hx <= W) & (ly >= 0) & (hy <= H)
    out[whole] = np.stack([lx, ly, hx, hy], 1)[whole]
    # the rest, less the polygons wholly beyond one border line (nothing inside: zeros; after a
    # mosaic and its affine most of the polygons that are not wholly inside are of this kind)
    beyond = (hx < 0) | (lx > W) | (hy < 0) | (ly > H)
    todo = np.flatnonzero(valid & ~whole & ~beyond)
    if len(todo) == 0:
        return out
    x0, y0 = xs[todo], ys[todo]
    lx, hx, ly, hy = lx[todo], hx[todo], ly[todo], hy[todo]
    # the vertices inside
    inside = (x0 >= 0) & (x0 <= W) & (y0 >= 0) & (y0 <= H)
    lo_x = np.where(inside, x0, np.inf).min(1).astype(np.float64)
    lo_y = np.where(inside, y0, np.inf).min(1).astype(np.float64)
    hi_x = np.where(inside, x0, -np.inf).max(1).astype(np.float64)
    hi_y = np.where(inside, y0, -np.inf).max(1).astype(np.float64)
    x1, y1 = np.roll(x0, -1, 1), np.roll(y0, -1, 1)  # each edge's end
    # the crossings of the edges that straddle a border line: only in the rows whose extent reaches
    # across it (few edges each: found first, then solved)
    for c, vertical in ((0.0, True), (W, True), (0.0, False), (H, False)):
        lo, hi = (lx, hx) if vertical else (ly, hy)
        rows = np.flatnonzero((lo <= c) & (hi >= c))
        if len(rows) == 0:
            continue
        a0, a1, b0, b1, span = (x0, x1, y0, y1, H) if vertical else (y0, y1, x0, x1, W)
        e0, e1 = a0[rows], a1[rows]
        r, col = np.nonzero((np.minimum(e0, e1) <= c) & (np.maximum(e0, e1) >= c) & (e1 != e0))
        if len(r) == 0:
            continue
        row = rows[r]
        e0, e1 = a0[row, col].astype(np.float64), a1[row, col].astype(np.float64)
        f0, f1 = b0[row, col].astype(np.float64), b1[row, col].astype(np.float64)
        cross = f0 + (c - e0) / (e1 - e0) * (f1 - f0)
        keep = (cross >= 0) & (cross <= span)
        row, cross = row[keep], cross[keep]
        xc, yc = (np.full_like(cross, c), cross) if vertical else (cross, np.full_like(cross, c))
        np.minimum.at(lo_x, row, xc)
        np.minimum.at(lo_y, row, yc)
        np.maximum.at(hi_x, row, xc)
        np.maximum.at(hi_y, row, yc)
    # the image corners inside the polygon (even-odd crossing number), for polygons around a corner
    for cx, cy in ((0.0, 0.0), (W, 0.0), (0.0, H), (W, H)):
        rows = np.flatnonzero((lx <= cx) & (hx >= cx) & (ly <= cy) & (hy >= cy))
        if len(rows) == 0:
            continue
        a0, a1 = x0[rows].astype(np.float64), x1[rows].astype(np.float64)
        b0, b1 = y0[rows].astype(np.float64), y1[rows].astype(np.float64)
        straddle = (b0 > cy) != (b1 > cy)
        with np.errstate(divide="ignore", invalid="ignore"):
            crosses = straddle & (cx < a0 + (cy - b0) * (a1 - a0) / (b1 - b0))
        hit = rows[np.count_nonzero(crosses, 1) % 2 == 1]
        lo_x[hit], lo_y[hit] = np.minimum(lo_x[hit], cx), np.minimum(lo_y[hit], cy)
        hi_x[hit], hi_y[hit] = np.maximum(hi_x[hit], cx), np.maximum(hi_y[hit], cy)
    got = np.isfinite(lo_x)
    box = np.clip(np.stack([lo_x, lo_y, hi_x, hi_y], 1), 0, [W, H, W, H])
    out[todo] = np.where(got[:, None], box, 0).astype(np.float32)
    return out


def fill_polygons(points: np.ndarray | Sequence[np.ndarray], shape: tuple[int, int]
                  ) -> tuple[np.ndarray, tuple[np.ndarray, ...]]:
    """Fill each polygon at full size the reference's way: vertices truncated to int32 (toward
    zero), ``cv2.fillPoly`` (its pixel-centre rule: a vertex at an integer is that pixel's centre,
    so the boundary pixels are in), clipped to the image; each result as a tight crop.

    Args:
      points: float[N, P, 2] or N float[K_j, 2] (x, y) pixel vertices; a polygon with a non-finite
        vertex or fewer than 3 vertices fills nothing.
      shape: (H, W) of the image.

    Returns:
      (offsets int64[N, 2] of each crop's top-left pixel, N crops uint8[h_j, w_j] of 0/1; an empty
      fill is a 0x0 crop at (0, 0)): the fields of :class:`yolo_func.data.augment.RoiMasks`.
    """
    H, W = shape
    n = len(points)
    offsets = np.zeros((n, 2), np.int64)
    empty = np.zeros((0, 0), np.uint8)
    if isinstance(points, np.ndarray) and points.ndim == 3:  # [N, P, 2]: the checks and bounds in one pass each
        valid = np.isfinite(points).all((1, 2)) & (points.shape[1] >= 3)
        ints = np.where(valid[:, None, None], points, 0).astype(np.int32)
        lo, hi = polygon_extents(ints)
    else:  # N polygons of their own lengths
        polys = [np.asarray(p).reshape(-1, 2) for p in points]
        valid = np.array([len(p) >= 3 and bool(np.isfinite(p).all()) for p in polys], bool)
        ints = [p.astype(np.int32) if ok else np.zeros((1, 2), np.int32) for p, ok in zip(polys, valid)]
        lo = np.array([p.min(0) for p in ints], np.int64).reshape(n, 2)
        hi = np.array([p.max(0) for p in ints], np.int64).reshape(n, 2)
    x0, y0 = np.maximum(lo[:, 0], 0), np.maximum(lo[:, 1], 0)
    x1, y1 = np.minimum(hi[:, 0] + 1, W), np.minimum(hi[:, 1] + 1, H)
    todo = valid & (x1 > x0) & (y1 > y0)
    crops: list[np.ndarray] = [empty] * n
    for j in np.flatnonzero(todo):
        crop = np.zeros((int(y1[j] - y0[j]), int(x1[j] - x0[j])), np.uint8)
        cv2.fillPoly(crop, [ints[j]], 1, offset=(-int(x0[j]), -int(y0[j])))
        x, y, w, h = cv2.boundingRect(crop)  # tight (a fill can miss the bounding rows of a thin sliver)
        if w:
            offsets[j] = (x0[j] + x, y0[j] + y)
            crops[j] = crop[y:y + h, x:x + w]
    return offsets, tuple(crops)
