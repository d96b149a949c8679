"""Training augmentations of REFERENCE.md §4.6: letterbox, mosaic, random affine, HSV, flips.

Every augmentation is split in two (detectron2's ``Augmentation`` / ``Transform``):

* a **sampler** draws the parameters from an explicit ``np.random.Generator``
  (:func:`record_rng` derives it from ``(seed, epoch, index)``; the global RNG is never used):
  :func:`sample_affine`, :func:`sample_hsv`, :func:`sample_flips`, :func:`sample_mosaic_center`;
* a **transform** applies those parameters deterministically to every annotation kind at once:
  :class:`AffineTransform` (image, boxes, points, keypoints, masks), :class:`FlipTransform`,
  :class:`HSVTransform`, :func:`mosaic` (a fixed centre and four records).

so a test can build a transform from chosen numbers and check boxes, masks and keypoints against
each other.

Records flowing through the pipeline are :class:`Annotated` (an image with its labels). Instance
masks travel in one of two forms:

* :class:`PolygonMasks` (the reference's form, used whenever the dataset has ``polygons(i)``: COCO,
  YOLO-format and the built-in data): each instance's polygon resampled to 1000 points, moved with every transform
  exactly like keypoints, every segment box recomputed as the (clipped) extent of its transformed
  polygon, and filled only at the end, at full size, with the reference's rule (vertices truncated
  to integers, ``cv2.fillPoly``; :func:`yolo_func.data.polygons.fill_polygons`);
* :class:`RoiMasks` (datasets with bitmaps only, or ``mask_source="bitmaps"``): each instance's tight
  crop (uint8 0/1) and its offset in the image, warped with the same matrix as the image
  (``cv2.warpAffine`` on the crop's region of interest only, so the cost follows the instances'
  areas, not the canvas); every segment box is the tight box of its warped mask pixels.

Either way the masks are rasterised into the overlap map at ``H/4`` by :func:`overlap_map` exactly
as a linear ``cv2.resize`` of the full-size mask would (REFERENCE.md §2.6: instances sorted by
descending mask area, smaller ones win overlaps).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import cv2
import numpy as np

from yolo_func.data.polygons import RESAMPLE_POINTS, clipped_polygon_boxes, fill_polygons, resample_polygons

__all__ = [
    "PAD_VALUE",
    "COCO_FLIP_INDEX",
    "AugmentConfig",
    "RoiMasks",
    "PolygonMasks",
    "Annotated",
    "LetterboxParams",
    "AffineTransform",
    "FlipTransform",
    "HSVTransform",
    "record_rng",
    "annotated_from_sample",
    "load_resized",
    "letterbox_params",
    "letterbox",
    "letterbox_boxes",
    "unletterbox_boxes",
    "sample_mosaic_center",
    "mosaic",
    "mosaic_partners",
    "sample_affine",
    "ResizePlan",
    "resize_plan",
    "apply_affine",
    "box_candidates",
    "sample_hsv",
    "sample_flips",
    "apply_flips",
    "overlap_map",
    "mosaic_enabled",
    "augment",
]

#: Border / letterbox fill value (REFERENCE.md §4.6).
PAD_VALUE = 114

#: COCO person keypoints: nose, then (left, right) pairs (REFERENCE.md §4.6).
COCO_FLIP_INDEX = (0, 2, 1, 4, 3, 6, 5, 8, 7, 10, 9, 12, 11, 14, 13, 16, 15)

_EPS = 1e-16

_SCRATCH = threading.local()


def _scratch(name: str, shape: tuple[int, ...]) -> np.ndarray:
    """A per-thread C-contiguous uint8 work array of ``shape``, reused across calls.

    One flat buffer per name grows to the largest size asked for and is never shrunk, so a stream
    of same-sized or smaller requests allocates (and page-faults) nothing. The array is overwritten
    by the next request of the same name on the same thread: never return it to a caller.
    """
    bufs = getattr(_SCRATCH, "buffers", None)
    if bufs is None:
        bufs = _SCRATCH.buffers = {}
    n = math.prod(shape)
    b = bufs.get(name)
    if b is None or b.size < n:
        b = bufs[name] = np.empty(n, np.uint8)
    return b[:n].reshape(shape)


@dataclass(frozen=True)
class AugmentConfig:
    """Augmentation hyper-parameters; the defaults are the reference's (REFERENCE.md §4.6).

    Attributes:
      mosaic: probability of a 2x2 mosaic (1.0).
      degrees, translate, scale, shear, perspective: random affine ranges (0, 0.1, 0.5, 0, 0).
      hsv_h, hsv_s, hsv_v: HSV gains (0.015, 0.7, 0.4).
      flipud, fliplr: flip probabilities (0.0, 0.5).
      close_mosaic: mosaic is off for the last ``close_mosaic`` epochs (10).
      flip_index: keypoint permutation applied with a horizontal flip (pose); None when the task
        has no keypoints (or keypoints without left/right pairs).
      fast_resize: carry out an axis-aligned affine (degrees = shear = perspective = 0) as a crop +
        ``cv2.resize`` with labels moved by the effective matrix (:func:`resize_plan`; a
        statistically equivalent affine, not the reference's pixels bit for bit). False: always
        ``cv2.warpAffine`` of the sampled matrix (True).
    """

    mosaic: float = 1.0
    degrees: float = 0.0
    translate: float = 0.1
    scale: float = 0.5
    shear: float = 0.0
    perspective: float = 0.0
    hsv_h: float = 0.015
    hsv_s: float = 0.7
    hsv_v: float = 0.4
    flipud: float = 0.0
    fliplr: float = 0.5
    close_mosaic: int = 10
    flip_index: tuple[int, ...] | None = None
    fast_resize: bool = True


def record_rng(seed: int, epoch: int, index: int) -> np.random.Generator:
    """The generator of one record in one epoch (grain's per-record rng; STYLE.md §11).

    Args:
      seed: the run's seed (int >= 0).
      epoch: the epoch (int >= 0).
      index: the record's position in the epoch (int >= 0).

    Returns:
      ``np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch, index])))``.
    """
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([int(seed), int(epoch), int(index)])))


# ----------------------------------------------------------------------------------------- records
class RoiMasks(NamedTuple):
    """Instance masks as tight crops: instance ``i`` covers pixels ``crops[i]`` placed at ``offsets[i]``.

    Attributes:
      offsets: int64[N, 2] (x0, y0) of each crop's top-left pixel in the image.
      crops: N arrays uint8[h_i, w_i] (0/1); an empty mask is a 0x0 crop.
    """

    offsets: np.ndarray
    crops: tuple[np.ndarray, ...]

    @staticmethod
    def from_dense(masks: np.ndarray) -> RoiMasks:
        """Crop dense masks ``uint8[N, H, W]`` (0/1) to their tight boxes."""
        if masks.ndim != 3:
            raise ValueError(f"[yolo_func] masks: expected uint8[N, H, W], got shape {masks.shape}; "
                             "pass one 0/1 mask per instance")
        offsets, crops = np.zeros((len(masks), 2), np.int64), []
        for i, m in enumerate(masks):
            m = np.ascontiguousarray(m, dtype=np.uint8)
            x, y, w, h = cv2.boundingRect(m)
            offsets[i] = (x, y)
            crops.append(m[y:y + h, x:x + w])
        return RoiMasks(offsets, tuple(crops))

    def to_dense(self, shape_hw: tuple[int, int]) -> np.ndarray:
        """Paste the crops into ``uint8[N, H, W]`` (parts outside the image are dropped)."""
        H, W = shape_hw
        out = np.zeros((len(self.crops), H, W), np.uint8)
        for i, (c, (x0, y0)) in enumerate(zip(self.crops, self.offsets)):
            _paste(out[i], c, int(x0), int(y0), np.maximum)
        return out

    def boxes(self) -> np.ndarray:
        """Tight xyxy boxes ``float32[N, 4]`` of the mask pixels (pixel edges; zeros when empty)."""
        out = np.zeros((len(self.crops), 4), np.float32)
        for i, (c, (x0, y0)) in enumerate(zip(self.crops, self.offsets)):
            if c.size:
                x, y, w, h = cv2.boundingRect(c)
                if w:
                    out[i] = (x0 + x, y0 + y, x0 + x + w, y0 + y + h)
        return out

    def select(self, keep: np.ndarray) -> RoiMasks:
        """The masks of the instances where ``keep`` (bool[N] or int indices) selects."""
        idx = np.flatnonzero(keep) if keep.dtype == bool else keep
        return RoiMasks(self.offsets[idx], tuple(self.crops[i] for i in idx))


class PolygonMasks(NamedTuple):
    """Instance masks as polygons, the reference's form (REFERENCE.md §4.6): every instance's
    polygon resampled to the same number of points, transformed like keypoints and filled at the
    end (:meth:`rasterise`).

    Attributes:
      points: float32[N, P, 2] (x, y) pixel coordinates (pixel-edge frame, like boxes); the rows
        of an instance without a usable polygon are NaN (no pixels, a zero box).
    """

    points: np.ndarray

    @staticmethod
    def from_polygons(polygons: Sequence[np.ndarray], n: int = RESAMPLE_POINTS) -> PolygonMasks:
        """N polygons (float[K_j, 2] pixel vertices) resampled to ``n`` points each."""
        return PolygonMasks(resample_polygons(polygons, n))

    def select(self, keep: np.ndarray) -> PolygonMasks:
        """The polygons of the instances ``keep`` (bool[N] or int indices) selects."""
        return PolygonMasks(self.points[keep])

    def moved(self, sx, tx, sy, ty) -> PolygonMasks:
        """Every point mapped by ``x * sx + tx``, ``y * sy + ty`` (scalars or float[N, 1] per instance)."""
        # computed in float64 (the coefficients are float64 arrays), rounded once into float32;
        # per axis on the [N, P] views (broadcasting over the length-2 axis is many times slower)
        f = np.float64
        sx, tx, sy, ty = np.asarray(sx, f), np.asarray(tx, f), np.asarray(sy, f), np.asarray(ty, f)
        out = np.empty(self.points.shape, np.float32)
        out[..., 0] = self.points[..., 0] * sx + tx
        out[..., 1] = self.points[..., 1] * sy + ty
        return PolygonMasks(out)

    def boxes(self, shape: tuple[int, int]) -> np.ndarray:
        """The box of each polygon's part inside the image of ``shape`` (H, W): xyxy
        ``float32[N, 4]``, zeros for an instance without a polygon or with nothing inside
        (:func:`yolo_func.data.polygons.clipped_polygon_boxes`, the reference's rule)."""
        return clipped_polygon_boxes(self.points, shape)

    def rasterise(self, shape: tuple[int, int]) -> RoiMasks:
        """Fill every polygon at full size (:func:`yolo_func.data.polygons.fill_polygons`)."""
        return RoiMasks(*fill_polygons(self.points, shape))


def _concat_masks(parts: Sequence) -> RoiMasks | PolygonMasks | None:
    """The masks of several records, one after another (None unless every record has masks)."""
    masks = [p.masks for p in parts]
    if any(m is None for m in masks):
        return None
    if all(isinstance(m, PolygonMasks) for m in masks):
        return PolygonMasks(np.concatenate([m.points for m in masks]))
    if any(isinstance(m, PolygonMasks) for m in masks):
        raise ValueError("[yolo_func] mosaic: records mix polygon and bitmap masks; load every record of a dataset "
                         "the same way")
    return RoiMasks(np.concatenate([m.offsets for m in masks]).reshape(-1, 2), tuple(c for m in masks for c in m.crops))


def _mask_boxes(masks: RoiMasks | PolygonMasks, shape: tuple[int, int]) -> np.ndarray:
    """Segment boxes from the masks: polygon extents (clipped) or tight boxes of the mask pixels."""
    return masks.boxes(shape) if isinstance(masks, PolygonMasks) else masks.boxes()


class Annotated(NamedTuple):
    """An image with its labels inside the augmentation pipeline.

    Attributes:
      image: uint8[H, W, 3] RGB.
      boxes: float32[N, 4] xyxy pixels.
      classes: int64[N].
      masks: :class:`RoiMasks` or :class:`PolygonMasks` with N instances, or None.
      keypoints: float32[N, P, 3] (x, y pixels, visibility 0/1/2), or None.
    """

    image: np.ndarray
    boxes: np.ndarray
    classes: np.ndarray
    masks: RoiMasks | PolygonMasks | None = None
    keypoints: np.ndarray | None = None

    def select(self, keep: np.ndarray) -> Annotated:
        """The record restricted to the instances ``keep`` selects (bool[N])."""
        return Annotated(self.image, self.boxes[keep], self.classes[keep],
                         self.masks.select(keep) if self.masks is not None else None,
                         self.keypoints[keep] if self.keypoints is not None else None)


def _paste(dst: np.ndarray, crop: np.ndarray, x0: int, y0: int, op) -> None:
    """dst[y0:y0+h, x0:x0+w] = op(dst, crop) on the overlap with dst (numpy, host side)."""
    h, w = crop.shape[:2]
    H, W = dst.shape[:2]
    xa, ya, xb, yb = max(x0, 0), max(y0, 0), min(x0 + w, W), min(y0 + h, H)
    if xb <= xa or yb <= ya:
        return
    region = dst[ya:yb, xa:xb]
    region[...] = op(region, crop[ya - y0:yb - y0, xa - x0:xb - x0])


def annotated_from_sample(sample) -> Annotated:
    """A dataset :class:`yolo_func.data.Sample` as an :class:`Annotated` record (masks cropped).

    Args:
      sample: ``Sample(image uint8[H, W, 3], boxes float32[N, 4], classes int64[N],
        masks uint8[N, H, W] | None, keypoints float32[N, P, 3] | None, ...)``.

    Returns:
      :class:`Annotated` sharing the arrays (masks as :class:`RoiMasks`).
    """
    img = sample.image
    if not (isinstance(img, np.ndarray) and img.dtype == np.uint8 and img.ndim == 3 and img.shape[2] == 3):
        raise ValueError(f"[yolo_func] sample.image ({sample.file_name!r}): expected uint8[H, W, 3] RGB, got "
                         f"{getattr(img, 'dtype', type(img))}{list(getattr(img, 'shape', []))}")
    boxes = np.asarray(sample.boxes, np.float32).reshape(-1, 4)
    masks = RoiMasks.from_dense(sample.masks) if sample.masks is not None else None
    kpts = np.asarray(sample.keypoints, np.float32) if sample.keypoints is not None else None
    return Annotated(img, boxes, np.asarray(sample.classes, np.int64).reshape(-1), masks, kpts)


def load_resized(rec: Annotated, image_size: int) -> Annotated:
    """Resize so the long side is ``image_size`` (linear, ceil rounding; REFERENCE.md §4.6 load).

    Args:
      rec: the record at its original size.
      image_size: target long side in pixels.

    Returns:
      :class:`Annotated` with the image uint8[h, w, 3], ``max(h, w) == image_size`` and labels scaled
      (bitmap masks resized crop by crop with the same linear interpolation, polygons scaled).
    """
    h0, w0 = rec.image.shape[:2]
    r = image_size / max(h0, w0)
    if r == 1:
        return rec
    w, h = min(math.ceil(w0 * r), image_size), min(math.ceil(h0 * r), image_size)
    sx, sy = w / w0, h / h0
    image = cv2.resize(rec.image, (w, h), interpolation=cv2.INTER_LINEAR)
    boxes = rec.boxes * np.array([sx, sy, sx, sy], np.float32)
    kpts = None
    if rec.keypoints is not None:
        kpts = rec.keypoints.copy()
        kpts[..., 0] *= sx
        kpts[..., 1] *= sy
    masks = None
    if isinstance(rec.masks, PolygonMasks):
        masks = rec.masks.moved(sx, 0.0, sy, 0.0)  # points scale like boxes
    elif rec.masks is not None:
        M = np.array([[sx, 0, (sx - 1) / 2], [0, sy, (sy - 1) / 2], [0, 0, 1]])  # pixel-centre resize
        masks = _warp_masks(rec.masks, M, (h, w))
    return Annotated(image, boxes, rec.classes, masks, kpts)


# ---------------------------------------------------------------------------------------- letterbox
class LetterboxParams(NamedTuple):
    """How an image of ``shape`` was letterboxed into ``new_shape``.

    Attributes:
      shape: (h, w) before.
      new_shape: (H, W) after.
      resized: (h', w') of the resized image inside the canvas.
      gain: (gx, gy) = (w'/w, h'/h).
      pad: (left, top) in pixels.
    """

    shape: tuple[int, int]
    new_shape: tuple[int, int]
    resized: tuple[int, int]
    gain: tuple[float, float]
    pad: tuple[int, int]


def letterbox_params(shape: tuple[int, int], new_shape: tuple[int, int], *, scaleup: bool = True,
                     center: bool = True) -> LetterboxParams:
    """The letterbox geometry: keep the aspect ratio, fit inside ``new_shape``, pad the rest.

    Args:
      shape: (h, w) of the image.
      new_shape: (H, W) of the output.
      scaleup: allow enlarging (False for validation, REFERENCE.md §3.1).
      center: split the padding in two (True) or pad right/bottom only.

    Returns:
      :class:`LetterboxParams`; ``resized = round(shape * min(H/h, W/w))``, padding
      ``left = round(dw - 0.1)``, ``top = round(dh - 0.1)`` with ``dw, dh`` half the slack when centred.
    """
    h, w = shape
    H, W = new_shape
    r = min(H / h, W / w)
    if not scaleup:
        r = min(r, 1.0)
    nw, nh = int(round(w * r)), int(round(h * r))
    dw, dh = (W - nw) / 2 if center else 0, (H - nh) / 2 if center else 0
    left, top = (int(round(dw - 0.1)), int(round(dh - 0.1))) if center else (0, 0)
    return LetterboxParams((h, w), (H, W), (nh, nw), (nw / w, nh / h), (left, top))


def letterbox(image: np.ndarray, new_shape: tuple[int, int], *, scaleup: bool = True, center: bool = True,
              pad_value: int = PAD_VALUE, out: np.ndarray | None = None) -> tuple[np.ndarray, LetterboxParams]:
    """Resize (linear) keeping the aspect ratio and pad to ``new_shape`` with ``pad_value``.

    Args:
      image: uint8[h, w, 3].
      new_shape: (H, W).
      scaleup, center: see :func:`letterbox_params`.
      pad_value: fill of the padding (114).
      out: optional uint8[H, W, 3] to write the result into (e.g. a slot of a page-locked batch
        buffer, which saves stacking and pinning copies); default a new array.

    Returns:
      (uint8[H, W, 3] -- ``out`` when given --, :class:`LetterboxParams`).
    """
    p = letterbox_params(image.shape[:2], new_shape, scaleup=scaleup, center=center)
    if p.resized != p.shape:
        image = cv2.resize(image, (p.resized[1], p.resized[0]), interpolation=cv2.INTER_LINEAR)
    left, top = p.pad
    (nh, nw), (H, W) = p.resized, p.new_shape
    if out is None:
        out = np.full((H, W, 3), pad_value, np.uint8)
    else:
        if out.shape != (H, W, 3) or out.dtype != np.uint8:
            raise ValueError(f"[yolo_func] letterbox: out must be uint8[{H}, {W}, 3], got {out.dtype}{list(out.shape)}")
        # only the padding strips are filled: the image covers the rest
        out[:top] = pad_value
        out[top + nh:] = pad_value
        out[top:top + nh, :left] = pad_value
        out[top:top + nh, left + nw:] = pad_value
    out[top:top + nh, left:left + nw] = image
    return out, p


def letterbox_boxes(boxes: np.ndarray, p: LetterboxParams) -> np.ndarray:
    """Map xyxy boxes ``float[N, 4]`` from the original image into the letterboxed one."""
    g = np.array([p.gain[0], p.gain[1]] * 2, np.float32)
    return boxes * g + np.array([p.pad[0], p.pad[1]] * 2, np.float32)


def unletterbox_boxes(boxes: np.ndarray, p: LetterboxParams, *, clip: bool = True) -> np.ndarray:
    """The inverse of :func:`letterbox_boxes` (predictions back to original pixels), clipped to it."""
    g = np.array([p.gain[0], p.gain[1]] * 2, np.float32)
    out = (boxes - np.array([p.pad[0], p.pad[1]] * 2, np.float32)) / g
    if clip:
        h, w = p.shape
        out = np.clip(out, 0, np.array([w, h, w, h], np.float32))
    return out


# ------------------------------------------------------------------------------------------- mosaic
def sample_mosaic_center(rng: np.random.Generator, size: int) -> tuple[int, int]:
    """Mosaic centre ``(xc, yc) = int(U(size/2, 3 size/2))`` each (REFERENCE.md §4.6)."""
    xc, yc = rng.uniform(size / 2, 3 * size / 2, 2)
    return int(xc), int(yc)


def mosaic_partners(rng: np.random.Generator, position: int, window: Sequence[int]) -> list[int]:
    """Three mosaic partners drawn uniformly (with replacement) from ``window`` (dataset indices).

    The reference draws the partners from a buffer of the images its worker loaded most recently.
    The loader emulates that rule deterministically: ``window`` is the list of dataset indices of
    the current batch (the images this batch loads anyway), so every image is decoded once per
    epoch and the draw depends only on (seed, epoch, position), never on the number of workers.

    Args:
      rng: the record's generator (:func:`record_rng`).
      position: the record's own position in ``window`` (unused by the draw; documents the call).
      window: candidate dataset indices.

    Returns:
      three dataset indices.
    """
    del position
    return [int(window[j]) for j in rng.integers(0, len(window), 3)]


def mosaic(records: Sequence[Annotated], center: tuple[int, int], size: int,
           region: tuple[int, int, int, int] | None = None, *, out: np.ndarray | None = None) -> Annotated:
    """Place four records on a ``2size x 2size`` canvas filled with 114 around ``center``.

    Record 0 goes top-left of the centre, then top-right, bottom-left, bottom-right (REFERENCE.md
    §4.6); labels are shifted, clipped to each record's visible region (= the canvas), zero-area
    boxes removed; keypoints outside the visible region get visibility 0.

    Args:
      records: four :class:`Annotated` with images uint8[h_i, w_i, 3] (long side ``size``).
      center: (xc, yc) from :func:`sample_mosaic_center`.
      size: the training image size s.
      region: optional (x0, y0, x1, y1) inside the canvas: only that part of the canvas is built
        and the labels are given relative to (x0, y0) (clipped as on the whole canvas). The
        pipeline builds only the part its affine reads (:meth:`AffineTransform.source_region`).
      out: optional uint8 array of the canvas's shape to build it in (the pipeline passes a reused
        work buffer: the canvas is read once by the affine and dropped).

    Returns:
      :class:`Annotated` with image uint8[2s, 2s, 3] (or uint8[y1 - y0, x1 - x0, 3] with ``region``).
    """
    if len(records) != 4:
        raise ValueError(f"[yolo_func] mosaic: records: expected 4 records, got {len(records)}")
    s2 = 2 * size
    xc, yc = center
    rx0, ry0, rx1, ry1 = region if region is not None else (0, 0, s2, s2)
    if not (0 <= rx0 < rx1 <= s2 and 0 <= ry0 < ry1 <= s2):
        raise ValueError(f"[yolo_func] mosaic: region: expected 0 <= x0 < x1 <= {s2} and 0 <= y0 < y1 <= {s2}, "
                         f"got {region}")
    shape = (ry1 - ry0, rx1 - rx0, 3)
    if out is not None and (out.shape != shape or out.dtype != np.uint8):
        raise ValueError(f"[yolo_func] mosaic: out: expected uint8{list(shape)}, got {out.dtype}{list(out.shape)}")
    canvas = np.empty(shape, np.uint8) if out is None else out  # only the uncovered parts are filled
    parts = []
    for i, rec in enumerate(records):
        x1a, y1a, x2a, y2a, x1b, y1b = _mosaic_place(i, rec.image.shape[:2], center, s2)
        # the placement and its quadrant, intersected with the region, in region coordinates
        px0, py0, px1, py1 = max(x1a, rx0), max(y1a, ry0), min(x2a, rx1), min(y2a, ry1)
        if px1 > px0 and py1 > py0:
            canvas[py0 - ry0:py1 - ry0, px0 - rx0:px1 - rx0] = rec.image[
                y1b + py0 - y1a:y1b + py1 - y1a, x1b + px0 - x1a:x1b + px1 - x1a]
        else:
            px0 = px1 = min(max(x1a, rx0), rx1)
            py0 = py1 = min(max(y1a, ry0), ry1)
        qx0, qy0 = (0 if i in (0, 2) else xc), (0 if i in (0, 1) else yc)
        qx1, qy1 = (xc if i in (0, 2) else s2), (yc if i in (0, 1) else s2)
        qx0, qy0, qx1, qy1 = max(qx0, rx0), max(qy0, ry0), min(qx1, rx1), min(qy1, ry1)
        if qx1 > qx0 and qy1 > qy0:
            px0, py0 = min(max(px0, qx0), qx1), min(max(py0, qy0), qy1)
            px1, py1 = min(max(px1, px0), qx1), min(max(py1, py0), qy1)
            _fill_outside(canvas, (qx0 - rx0, qy0 - ry0, qx1 - rx0, qy1 - ry0),
                          (px0 - rx0, py0 - ry0, px1 - rx0, py1 - ry0))
        parts.append(_shift_clip(rec, x1a - x1b - rx0, y1a - y1b - ry0, (x1a - rx0, y1a - ry0, x2a - rx0, y2a - ry0)))
    boxes = np.concatenate([p.boxes for p in parts])
    classes = np.concatenate([p.classes for p in parts])
    masks, kpts = _concat_masks(parts), None
    if all(p.keypoints is not None for p in parts):
        kpts = np.concatenate([p.keypoints for p in parts])
    out = Annotated(canvas, boxes, classes, masks, kpts)
    keep = (boxes[:, 2] > boxes[:, 0]) & (boxes[:, 3] > boxes[:, 1])
    return out.select(keep)


def _mosaic_place(i: int, hw: tuple[int, int], center: tuple[int, int], s2: int) -> tuple[int, int, int, int, int, int]:
    """Where tile ``i`` (an image of ``hw``) lands on the ``s2 x s2`` mosaic canvas (REFERENCE.md §4.6).

    Returns (x1a, y1a, x2a, y2a, x1b, y1b): the canvas rectangle it covers (inside its quadrant) and
    the image pixel at its top-left corner.
    """
    h, w = hw
    xc, yc = center
    if i == 0:
        x1a, y1a, x2a, y2a = max(xc - w, 0), max(yc - h, 0), xc, yc
        return x1a, y1a, x2a, y2a, w - (x2a - x1a), h - (y2a - y1a)
    if i == 1:
        x1a, y1a, x2a, y2a = xc, max(yc - h, 0), min(xc + w, s2), yc
        return x1a, y1a, x2a, y2a, 0, h - (y2a - y1a)
    if i == 2:
        x1a, y1a, x2a, y2a = max(xc - w, 0), yc, xc, min(s2, yc + h)
        return x1a, y1a, x2a, y2a, w - (x2a - x1a), 0
    return xc, yc, min(xc + w, s2), min(s2, yc + h), 0, 0


def _fill_outside(canvas: np.ndarray, quadrant: tuple[int, int, int, int], rect: tuple[int, int, int, int],
                  value=PAD_VALUE) -> None:
    """Fill ``quadrant`` minus ``rect`` (both x1, y1, x2, y2; rect inside quadrant) with ``value``."""
    qx0, qy0, qx1, qy1 = quadrant
    x1, y1, x2, y2 = rect
    canvas[qy0:y1, qx0:qx1] = value
    canvas[y2:qy1, qx0:qx1] = value
    canvas[y1:y2, qx0:x1] = value
    canvas[y1:y2, x2:qx1] = value


def _shift_clip(rec: Annotated, dx: int, dy: int, region: tuple[int, int, int, int]) -> Annotated:
    """Shift labels by (dx, dy) and clip them to ``region`` (x1, y1, x2, y2)."""
    x1, y1, x2, y2 = region
    boxes = rec.boxes + np.array([dx, dy, dx, dy], np.float32)
    boxes = np.clip(boxes, np.array([x1, y1, x1, y1], np.float32), np.array([x2, y2, x2, y2], np.float32))
    masks = kpts = None
    if isinstance(rec.masks, PolygonMasks):  # shifted, then clipped to the region like the boxes
        pts, p = rec.masks.points, np.empty(rec.masks.points.shape, np.float32)
        # per axis with scalar bounds (a clip broadcast over the length-2 axis is many times slower)
        np.clip(pts[..., 0] + np.float32(dx), np.float32(x1), np.float32(x2), out=p[..., 0])
        np.clip(pts[..., 1] + np.float32(dy), np.float32(y1), np.float32(y2), out=p[..., 1])
        masks = PolygonMasks(p)
    elif rec.masks is not None:
        offs, crops = [], []
        for c, (x0, y0) in zip(rec.masks.crops, rec.masks.offsets):
            x0, y0 = int(x0) + dx, int(y0) + dy
            h, w = c.shape
            xa, ya, xb, yb = max(x0, x1), max(y0, y1), min(x0 + w, x2), min(y0 + h, y2)
            if xb > xa and yb > ya:
                offs.append((xa, ya))
                crops.append(c[ya - y0:yb - y0, xa - x0:xb - x0])
            else:
                offs.append((0, 0))
                crops.append(np.zeros((0, 0), np.uint8))
        masks = RoiMasks(np.asarray(offs, np.int64).reshape(-1, 2), tuple(crops))
    if rec.keypoints is not None:
        kpts = rec.keypoints.copy()
        kpts[..., 0] += dx
        kpts[..., 1] += dy
        out = (kpts[..., 0] < x1) | (kpts[..., 0] > x2) | (kpts[..., 1] < y1) | (kpts[..., 1] > y2)
        kpts[..., 2] = np.where(out, 0.0, kpts[..., 2])
    return Annotated(rec.image, boxes, rec.classes, masks, kpts)


# ------------------------------------------------------- mosaic + axis-aligned affine, built directly
def _is_axis_aligned(M: np.ndarray) -> bool:
    """``[[sx, 0, tx], [0, sy, ty], [0, 0, 1]]`` with sx, sy > 0 (what :func:`resize_plan` carries out)."""
    return bool(M[0, 1] == 0 and M[1, 0] == 0 and M[2, 0] == 0 and M[2, 1] == 0 and M[2, 2] == 1
                and M[0, 0] > 0 and M[1, 1] > 0)


def _edge(a: float, beta: float, X: int, n_out: int) -> int:
    """Output pixel edge of input pixel edge ``X`` (``U = a X + beta``), rounded, clipped to [0, n_out]."""
    return min(max(math.floor(a * X + beta + 0.5), 0), n_out)


def _tile_axis(a: float, beta: float, X0: int, X1: int, n_out: int) -> tuple[int, int, int, int]:
    """One axis of a mosaic tile covering canvas pixels ``[X0, X1)``: (x0, x1, u0, u1).

    As :func:`_axis_plan`, in canvas coordinates: where the tile's edge lands inside the output the
    output edge is rounded (:func:`_edge`: a shared edge of two tiles rounds the same for both, so
    the tiles' rectangles neither overlap nor leave a gap), where the output's edge cuts the tile
    the canvas edge is rounded.
    """
    lo, hi = a * X0 + beta, a * X1 + beta
    if lo >= 0:
        u0, x0 = _edge(a, beta, X0, n_out), X0
    else:
        u0, x0 = 0, min(max(math.floor(-beta / a + 0.5), X0), X1)
    if hi <= n_out:
        u1, x1 = _edge(a, beta, X1, n_out), X1
    else:
        u1, x1 = n_out, min(max(math.floor((n_out - beta) / a + 0.5), X0), X1)
    return x0, x1, u0, u1


def _mosaic_resized(records: Sequence[Annotated], center: tuple[int, int], size: int, t: AffineTransform,
                    out: np.ndarray, fill: int = PAD_VALUE) -> tuple[Annotated, list[tuple[int, int, int, int]]]:
    """Mosaic followed by an axis-aligned affine, built straight into ``out`` (the fast path).

    Equivalent to ``apply_affine(mosaic(records, center, size), t)`` on the fast path, without the
    canvas: each tile's visible part is resized directly into its own rectangle of the output
    (:func:`_tile_axis` rounds each tile as :func:`resize_plan` rounds the whole canvas, so each
    tile has its own effective matrix, within half a pixel of ``t.matrix``, and its labels are
    moved with it); everything outside the tiles' rectangles is ``fill``. The pixels differ from
    the canvas resize only where that resize blends across a seam (one output pixel along each
    tile edge) and by each tile's sub-pixel rounding.

    Args:
      records: four :class:`Annotated` (long side ``size``).
      center: (xc, yc) from :func:`sample_mosaic_center`.
      size: s; the canvas is 2s x 2s.
      t: an axis-aligned :class:`AffineTransform` from the canvas to the ``(s, s)`` output.
      out: uint8[s, s, 3] written in place.
      fill: the grey level of the output outside every tile (114).

    Returns:
      (:class:`Annotated` with image ``out`` and the surviving instances, the tiles' output
      rectangles (u0, v0, u1, v1), disjoint, non-empty).
    """
    s2 = 2 * size
    H, W = t.out_shape
    M = t.matrix
    ax, ay = float(M[0, 0]), float(M[1, 1])
    bx, by = float(M[0, 2]) + 0.5 * (1.0 - ax), float(M[1, 2]) + 0.5 * (1.0 - ay)  # pixel-edge offsets
    cx, cy = _edge(ax, bx, center[0], W), _edge(ay, by, center[1], H)  # the output's quadrant split
    quads = [(0, 0, cx, cy), (cx, 0, W, cy), (0, cy, cx, H), (cx, cy, W, H)]
    fill = int(fill)
    rects, parts, mats = [], [], []
    for i, rec in enumerate(records):
        x1a, y1a, x2a, y2a, x1b, y1b = _mosaic_place(i, rec.image.shape[:2], center, s2)
        x0, x1, u0, u1 = _tile_axis(ax, bx, x1a, x2a, W)
        y0, y1, v0, v1 = _tile_axis(ay, by, y1a, y2a, H)
        qx0, qy0, qx1, qy1 = quads[i]
        if u1 > u0 and v1 > v0 and x1 > x0 and y1 > y0:
            ex, ey = (u1 - u0) / (x1 - x0), (v1 - v0) / (y1 - y0)
            mats.append((ex, ex * (0.5 - x0) + u0 - 0.5, ey, ey * (0.5 - y0) + v0 - 0.5))
            roi = out[v0:v1, u0:u1]
            dx, dy = x1b - x1a, y1b - y1a  # canvas -> tile image
            got = cv2.resize(rec.image[y0 + dy:y1 + dy, x0 + dx:x1 + dx], (u1 - u0, v1 - v0), dst=roi,
                             interpolation=cv2.INTER_LINEAR)
            if got is not roi and not np.shares_memory(got, out):  # an OpenCV that did not write in place
                roi[...] = got.reshape(roi.shape)
            rects.append((u0, v0, u1, v1))
        else:  # nothing of this tile is visible: its labels leave with the sampled matrix
            mats.append((ax, float(M[0, 2]), ay, float(M[1, 2])))
            u0 = u1 = min(max(u0, qx0), qx1)
            v0 = v1 = min(max(v0, qy0), qy1)
        if qx1 > qx0 and qy1 > qy0:
            _fill_outside(out, (qx0, qy0, qx1, qy1), (u0, v0, u1, v1), fill)
        parts.append(_shift_clip(rec, x1a - x1b, y1a - y1b, (x1a, y1a, x2a, y2a)))
    counts = [len(p.boxes) for p in parts]
    before = np.concatenate([p.boxes for p in parts])
    classes = np.concatenate([p.classes for p in parts])
    e = np.repeat(np.array(mats, np.float64).reshape(4, 4), counts, axis=0)  # per instance (ax, tx, ay, ty)
    masks, kpts = _concat_masks(parts), None
    if isinstance(masks, PolygonMasks):  # each tile's matrix, as for its boxes
        masks = masks.moved(e[:, :1], e[:, 1:2], e[:, 2:3], e[:, 3:4])
        after = masks.boxes((H, W))
    elif masks is not None:
        masks = _warp_masks(masks, t.matrix, (H, W), axis=e)
        after = masks.boxes()
    else:
        after = np.empty_like(before)
        after[:, 0::2] = (before[:, 0::2] * e[:, :1] + e[:, 1:2]).astype(np.float32)
        after[:, 1::2] = (before[:, 1::2] * e[:, 2:3] + e[:, 3:4]).astype(np.float32)
        after = np.clip(after, 0, np.array([W, H, W, H], np.float32))
    if all(p.keypoints is not None for p in parts):
        kpts = np.concatenate([p.keypoints for p in parts])
        x = (kpts[..., 0] * e[:, None, 0] + e[:, None, 1]).astype(np.float32)
        y = (kpts[..., 1] * e[:, None, 2] + e[:, None, 3]).astype(np.float32)
        outside = (x < 0) | (x > W) | (y < 0) | (y > H)
        kpts = np.stack([x, y, np.where(outside, 0.0, kpts[..., 2]).astype(np.float32)], -1)
    keep = (before[:, 2] > before[:, 0]) & (before[:, 3] > before[:, 1])
    keep &= box_candidates(before, after, scale=t.scale, area_thr=0.01 if masks is not None else 0.1)
    return Annotated(out, after, classes, masks, kpts).select(keep), rects


# ------------------------------------------------------------------------------------------- affine
class AffineTransform(NamedTuple):
    """One 3x3 matrix applied to everything (REFERENCE.md §4.6's ``M = T·S·R·P·C``).

    Attributes:
      matrix: float64[3, 3] mapping input pixel coordinates to output ones.
      out_shape: (H, W) of the output.
      scale: the sampled isotropic scale ``s`` (the box filter compares areas with ``s**2``).
    """

    matrix: np.ndarray
    out_shape: tuple[int, int]
    scale: float = 1.0

    @property
    def is_affine(self) -> bool:
        """True when the last row is (0, 0, 1) (no perspective)."""
        return bool(np.all(self.matrix[2] == (0.0, 0.0, 1.0)))

    def source_region(self, in_shape: tuple[int, int], margin: int = 2) -> tuple[int, int, int, int]:
        """The part (x0, y0, x1, y1) of an input of ``in_shape`` (h, w) that the warp can read.

        The output corners mapped back through the inverse matrix, widened by ``margin`` pixels for
        the interpolation and clipped to the input; the whole input with perspective.
        """
        h, w = in_shape
        if not self.is_affine:
            return 0, 0, w, h
        H, W = self.out_shape
        inv = np.linalg.inv(self.matrix)
        c = np.array([[-1, -1], [W, -1], [W, H], [-1, H]], np.float64) @ inv[:2, :2].T + inv[:2, 2]
        x0, y0 = max(int(math.floor(c[:, 0].min())) - margin, 0), max(int(math.floor(c[:, 1].min())) - margin, 0)
        x1, y1 = min(int(math.ceil(c[:, 0].max())) + margin + 1, w), min(int(math.ceil(c[:, 1].max())) + margin + 1, h)
        if x1 <= x0 or y1 <= y0:  # nothing of the input is visible: keep one pixel
            x0, y0 = min(max(x0, 0), w - 1), min(max(y0, 0), h - 1)
            x1, y1 = x0 + 1, y0 + 1
        return x0, y0, x1, y1

    def shifted(self, x0: int, y0: int) -> AffineTransform:
        """The same transform for an input cropped at (x0, y0): ``M @ translate(x0, y0)``."""
        return AffineTransform(self.matrix @ np.array([[1, 0, x0], [0, 1, y0], [0, 0, 1]], np.float64),
                               self.out_shape, self.scale)

    def apply_image(self, image: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Warp ``uint8[h, w, 3]`` to ``uint8[H, W, 3]`` (linear, border 114; into ``out`` when given)."""
        H, W = self.out_shape
        border = (PAD_VALUE, PAD_VALUE, PAD_VALUE)
        warp = cv2.warpAffine if self.is_affine else cv2.warpPerspective
        M = self.matrix[:2] if self.is_affine else self.matrix
        if out is None:
            return warp(image, M, (W, H), flags=cv2.INTER_LINEAR, borderValue=border)
        got = warp(image, M, (W, H), dst=out, flags=cv2.INTER_LINEAR, borderValue=border)
        if got is not out:  # an OpenCV that did not write in place
            out[...] = got
        return out

    def apply_coords(self, xy: np.ndarray) -> np.ndarray:
        """Map points ``float[..., 2]`` (perspective divide when needed)."""
        pts = xy.reshape(-1, 2).astype(np.float64)
        out = pts @ self.matrix[:2, :2].T + self.matrix[:2, 2]
        if not self.is_affine:
            w = pts @ self.matrix[2, :2] + self.matrix[2, 2]
            out = out / w[:, None]
        return out.reshape(xy.shape).astype(np.float32)

    def apply_boxes(self, boxes: np.ndarray) -> np.ndarray:
        """Transform the 4 corners of each xyxy box ``float[N, 4]``; min/max, clipped to the output."""
        corners = boxes[:, [0, 1, 2, 1, 2, 3, 0, 3]].reshape(-1, 4, 2)
        pts = self.apply_coords(corners)
        H, W = self.out_shape
        out = np.concatenate([pts.min(1), pts.max(1)], 1)
        return np.clip(out, 0, np.array([W, H, W, H], np.float32)).astype(np.float32)

    def apply_keypoints(self, kpts: np.ndarray) -> np.ndarray:
        """Transform ``float[N, P, 3]`` keypoints; those outside ``[0, W] x [0, H]`` get visibility 0."""
        out = kpts.copy()
        out[..., :2] = self.apply_coords(kpts[..., :2])
        H, W = self.out_shape
        x, y = out[..., 0], out[..., 1]
        outside = (x < 0) | (x > W) | (y < 0) | (y > H)
        out[..., 2] = np.where(outside, 0.0, out[..., 2])
        return out

    def apply_masks(self, masks: RoiMasks | PolygonMasks) -> RoiMasks | PolygonMasks:
        """Warp every mask crop (linear, 0 outside) into the output, crops re-tightened; or map
        every polygon point (:meth:`apply_coords`)."""
        if isinstance(masks, PolygonMasks):
            return PolygonMasks(self.apply_coords(masks.points))
        return _warp_masks(masks, self.matrix, self.out_shape)


def _warp_masks(masks: RoiMasks, M: np.ndarray, out_shape: tuple[int, int], axis: np.ndarray | None = None) -> RoiMasks:
    """Warp each crop with M on its own region of interest of the output, then re-tighten it.

    The regions are computed for all instances at once; each crop covers pixel centres
    ``x0 .. x0 + w - 1``, so its image lies inside its transformed rectangle widened by one pixel.
    ``axis``: optional float64[N, 4] per-instance axis-aligned matrices (sx, tx, sy, ty) used instead
    of ``M`` (the direct mosaic build: one matrix per tile).
    """
    H, W = out_shape
    n = len(masks.crops)
    offs = np.zeros((n, 2), np.int64)
    empty = np.zeros((0, 0), np.uint8)
    crops = [empty] * n
    if n == 0:
        return RoiMasks(offs, ())
    affine = bool(np.all(M[2] == (0.0, 0.0, 1.0)))
    hw = np.array([c.shape for c in masks.crops], np.int64).reshape(n, 2)
    x0, y0 = masks.offsets[:, 0].astype(np.float64), masks.offsets[:, 1].astype(np.float64)
    xa, ya, xb, yb = x0 - 1, y0 - 1, x0 + hw[:, 1], y0 + hw[:, 0]
    rect = np.stack([np.stack([xa, ya], 1), np.stack([xb, ya], 1), np.stack([xb, yb], 1), np.stack([xa, yb], 1)], 1)
    if axis is not None:
        M = np.eye(3)
        sx, tx0, sy, ty0 = (axis[:, k:k + 1] for k in range(4))
        pts = np.stack([rect[..., 0] * sx + tx0, rect[..., 1] * sy + ty0], -1)
    else:
        pts = rect @ M[:2, :2].T + M[:2, 2]  # [n, 4, 2]
    whole = np.zeros(n, bool)
    if not affine:
        den = rect @ M[2, :2] + M[2, 2]
        whole = ~(den > 0).all(1)  # straddles the perspective horizon: warp onto the whole output
        pts = pts / np.where(den > 0, den, 1.0)[..., None]
    u0 = np.where(whole, 0, np.maximum(np.floor(pts[..., 0].min(1)), 0)).astype(np.int64)
    v0 = np.where(whole, 0, np.maximum(np.floor(pts[..., 1].min(1)), 0)).astype(np.int64)
    u1 = np.where(whole, W, np.minimum(np.ceil(pts[..., 0].max(1)) + 1, W)).astype(np.int64)
    v1 = np.where(whole, H, np.minimum(np.ceil(pts[..., 1].max(1)) + 1, H)).astype(np.int64)
    todo = np.flatnonzero((hw.min(1) > 0) & (u1 > u0) & (v1 > v0))
    if axis is not None:
        a00, a01, a10, a11 = axis[:, 0], np.zeros(n), np.zeros(n), axis[:, 2]
        tx, ty = axis[:, 0] * x0 + axis[:, 1] - u0, axis[:, 2] * y0 + axis[:, 3] - v0
    elif affine:  # M_roi = T(-u0, -v0) · M · T(x0, y0), row by row
        a00, a01, a10, a11 = (np.full(n, M[r, c]) for r, c in ((0, 0), (0, 1), (1, 0), (1, 1)))
        tx = M[0, 0] * x0 + M[0, 1] * y0 + M[0, 2] - u0
        ty = M[1, 0] * x0 + M[1, 1] * y0 + M[1, 2] - v0
    for i in todo:
        c, size = masks.crops[i], (int(u1[i] - u0[i]), int(v1[i] - v0[i]))
        if affine:
            Mr = np.array([[a00[i], a01[i], tx[i]], [a10[i], a11[i], ty[i]]])
            roi = cv2.warpAffine(c, Mr, size, flags=cv2.INTER_LINEAR, borderValue=0)
        else:
            Mr = np.array([[1, 0, -u0[i]], [0, 1, -v0[i]], [0, 0, 1]], np.float64) @ M @ np.array(
                [[1, 0, x0[i]], [0, 1, y0[i]], [0, 0, 1]], np.float64)
            roi = cv2.warpPerspective(c, Mr, size, flags=cv2.INTER_LINEAR, borderValue=0)
        x, y, bw, bh = cv2.boundingRect(roi)
        if bw:
            offs[i] = (u0[i] + x, v0[i] + y)
            crops[i] = roi[y:y + bh, x:x + bw]
    return RoiMasks(offs, tuple(crops))


# --------------------------------------------------------------------------- axis-aligned fast path
class ResizePlan(NamedTuple):
    """An axis-aligned affine carried out as one ``cv2.resize`` of an input crop (the fast path).

    ``cv2.resize`` (linear) of the crop ``src`` to the output rectangle ``dst`` maps output pixel
    centre ``u`` to input ``x = (u - u0 + 0.5) * (x1 - x0) / (u1 - u0) - 0.5 + x0``: an affine map
    whose scale and offset are the sampled ones rounded so that the crop and the rectangle are whole
    pixels. ``matrix`` is that map (input -> output pixel centres, as ``cv2.warpAffine`` reads a
    matrix); labels transformed with it stay consistent with the resized pixels. It differs from
    the sampled matrix by at most half an input pixel anywhere inside the output.

    Attributes:
      src: (x0, y0, x1, y1) integer crop of the input (x1 > x0, y1 > y0 unless ``dst`` is empty).
      dst: (u0, v0, u1, v1) integer rectangle of the output that the crop fills; the rest of the
        output is the border (114). Empty (u1 <= u0 or v1 <= v0) when no input pixel is visible.
      matrix: float64[3, 3] the effective input -> output matrix.
      out_shape: (H, W) of the output.
    """

    src: tuple[int, int, int, int]
    dst: tuple[int, int, int, int]
    matrix: np.ndarray
    out_shape: tuple[int, int]

    @property
    def empty(self) -> bool:
        """True when no input pixel lands in the output (the output is all border)."""
        u0, v0, u1, v1 = self.dst
        return u1 <= u0 or v1 <= v0

    def apply_image(self, image: np.ndarray, out: np.ndarray | None = None,
                    pad_value: int = PAD_VALUE) -> np.ndarray:
        """Resize the crop of ``image`` (uint8[h, w, C]) into ``dst`` of a ``uint8[H, W, C]`` output.

        Args:
          image: the input the plan was made for (uint8, or float32: the output has its dtype).
          out: optional output buffer [H, W, C] of that dtype (written in place and returned).
          pad_value: fill of the output outside ``dst`` (114).

        Returns:
          uint8[H, W, C].
        """
        H, W = self.out_shape
        if out is None:
            out = np.empty((H, W, *image.shape[2:]), image.dtype)
        if self.empty:
            out[...] = pad_value
            return out
        x0, y0, x1, y1 = self.src
        u0, v0, u1, v1 = self.dst
        out[:v0] = pad_value
        out[v1:] = pad_value
        out[v0:v1, :u0] = pad_value
        out[v0:v1, u1:] = pad_value
        roi = out[v0:v1, u0:u1]
        got = cv2.resize(image[y0:y1, x0:x1], (u1 - u0, v1 - v0), dst=roi, interpolation=cv2.INTER_LINEAR)
        if got is not roi and not np.shares_memory(got, out):  # an OpenCV that did not write in place
            roi[...] = got.reshape(roi.shape)
        return out


def _axis_plan(a: float, b: float, n_in: int, n_out: int) -> tuple[int, int, int, int]:
    """One axis of :func:`resize_plan`: (x0, x1, u0, u1) for ``u = a x + b`` (pixel centres, a > 0).

    In pixel-edge coordinates (``X = x + 1/2``) the map is ``U = a X + beta``, ``beta = b + (1 - a) / 2``;
    the input's edges ``[0, n_in]`` land on ``[beta, a n_in + beta]``. Where an input edge is
    inside the output, the output edge is rounded (error <= 1/2 output pixel); where the output's
    edge cuts the input, the input edge is rounded (error <= 1/2 input pixel).
    """
    beta = b + 0.5 * (1.0 - a)
    lo, hi = beta, a * n_in + beta
    if lo >= 0:
        u0, x0 = min(math.floor(lo + 0.5), n_out), 0
    else:
        u0, x0 = 0, min(math.floor(-beta / a + 0.5), n_in)
    if hi <= n_out:
        u1, x1 = max(math.floor(hi + 0.5), 0), n_in
    else:
        u1, x1 = n_out, max(math.floor((n_out - beta) / a + 0.5), 0)
    return x0, x1, u0, u1


def resize_plan(matrix: np.ndarray, in_shape: tuple[int, int], out_shape: tuple[int, int]) -> ResizePlan | None:
    """The crop + ``cv2.resize`` that carries out an axis-aligned affine, or None when it is not one.

    Axis-aligned: ``matrix = [[sx, 0, tx], [0, sy, ty], [0, 0, 1]]`` with ``sx, sy > 0`` (the
    default recipe: degrees = shear = perspective = 0, only scale and translation). ``cv2.resize``
    of a whole-pixel crop cannot reproduce an arbitrary fractional scale and offset, so the plan
    rounds the crop and the output rectangle to whole pixels and returns the **effective** matrix
    the resize implements (:class:`ResizePlan`); transform the labels with ``plan.matrix``, not the
    sampled one, and boxes, masks and keypoints stay consistent with the pixels.

    Args:
      matrix: float[3, 3] input -> output pixel centres (``AffineTransform.matrix``).
      in_shape: (h, w) of the input image.
      out_shape: (H, W) of the output.

    Returns:
      :class:`ResizePlan`, or None for a rotation, shear, flip or perspective matrix.

    Example:
      >>> import numpy as np
      >>> p = resize_plan(np.array([[0.5, 0, 10.6], [0, 0.5, -0.25], [0, 0, 1]]), (100, 200), (64, 128))
      >>> p.src, p.dst, p.matrix[:2].tolist()    # x offset 10.6 rounded so the image starts at column 11
      ((0, 0, 200, 100), (11, 0, 111, 50), [[0.5, 0.0, 10.75], [0.0, 0.5, -0.25]])
    """
    M = np.asarray(matrix, np.float64)
    if M[0, 1] != 0 or M[1, 0] != 0 or M[2, 0] != 0 or M[2, 1] != 0 or M[2, 2] != 1 or M[0, 0] <= 0 or M[1, 1] <= 0:
        return None
    h, w = in_shape
    H, W = out_shape
    x0, x1, u0, u1 = _axis_plan(float(M[0, 0]), float(M[0, 2]), int(w), int(W))
    y0, y1, v0, v1 = _axis_plan(float(M[1, 1]), float(M[1, 2]), int(h), int(H))
    if u1 <= u0 or v1 <= v0 or x1 <= x0 or y1 <= y0:
        return ResizePlan((0, 0, 0, 0), (0, 0, 0, 0), M.copy(), (int(H), int(W)))
    ax, ay = (u1 - u0) / (x1 - x0), (v1 - v0) / (y1 - y0)
    eff = np.array([[ax, 0.0, ax * (0.5 - x0) + u0 - 0.5], [0.0, ay, ay * (0.5 - y0) + v0 - 0.5], [0, 0, 1]])
    return ResizePlan((x0, y0, x1, y1), (u0, v0, u1, v1), eff, (int(H), int(W)))


def sample_affine(rng: np.random.Generator, in_shape: tuple[int, int], out_shape: tuple[int, int], *,
                  degrees: float = 0.0, translate: float = 0.1, scale: float = 0.5, shear: float = 0.0,
                  perspective: float = 0.0) -> AffineTransform:
    """Draw ``M = T·S·R·P·C`` (REFERENCE.md §4.6).

    C moves the input centre to the origin; P holds perspective terms ``U(-p, p)``; R rotates by
    ``U(-degrees, degrees)`` with scale ``s ~ U(1 - scale, 1 + scale)``; S shears by
    ``tan(U(-shear, shear) deg)``; T translates by ``U(0.5 - translate, 0.5 + translate)`` times the
    output width / height.

    Args:
      rng: the record's generator.
      in_shape: (h, w) of the input (2s x 2s for a mosaic).
      out_shape: (H, W) of the output.
      degrees, translate, scale, shear, perspective: the ranges.

    Returns:
      :class:`AffineTransform`.
    """
    h, w = in_shape
    H, W = out_shape
    C = np.eye(3)
    C[0, 2], C[1, 2] = -w / 2, -h / 2
    P = np.eye(3)
    P[2, 0], P[2, 1] = rng.uniform(-perspective, perspective, 2) if perspective else (0.0, 0.0)
    a = rng.uniform(-degrees, degrees) if degrees else 0.0
    s = rng.uniform(1 - scale, 1 + scale)
    R = np.eye(3)
    R[:2] = cv2.getRotationMatrix2D(center=(0, 0), angle=a, scale=s)
    S = np.eye(3)
    if shear:
        S[0, 1], S[1, 0] = np.tan(rng.uniform(-shear, shear, 2) * math.pi / 180)
    T = np.eye(3)
    T[0, 2] = rng.uniform(0.5 - translate, 0.5 + translate) * W
    T[1, 2] = rng.uniform(0.5 - translate, 0.5 + translate) * H
    return AffineTransform(T @ S @ R @ P @ C, (H, W), float(s))


def box_candidates(before: np.ndarray, after: np.ndarray, *, scale: float = 1.0, wh_thr: float = 2.0,
                   ar_thr: float = 100.0, area_thr: float = 0.1, eps: float = _EPS) -> np.ndarray:
    """The reference's box filter: keep ``w > 2``, ``h > 2``, ``area / (old area·s²) > area_thr``,
    aspect ratio ``< 100``.

    Args:
      before: float[N, 4] xyxy boxes before the transform.
      after: float[N, 4] xyxy boxes after it.
      scale: the affine's isotropic scale s.
      wh_thr, ar_thr, area_thr: thresholds (2 px, 100, 0.1; use 0.01 with masks).

    Returns:
      bool[N].
    """
    w1, h1 = before[:, 2] - before[:, 0], before[:, 3] - before[:, 1]
    w2, h2 = after[:, 2] - after[:, 0], after[:, 3] - after[:, 1]
    ar = np.maximum(w2 / (h2 + eps), h2 / (w2 + eps))
    return (w2 > wh_thr) & (h2 > wh_thr) & (w2 * h2 / (w1 * h1 * scale * scale + eps) > area_thr) & (ar < ar_thr)


def apply_affine(rec: Annotated, t: AffineTransform, *, fast_resize: bool = True,
                 out: np.ndarray | None = None) -> Annotated:
    """Apply ``t`` to the image and every label, then the box filter.

    Boxes: the 4 transformed corners (min/max, clipped); with masks, each box becomes the box of
    its transformed polygon's part inside the image (the reference's rule) or the tight box of its
    warped mask pixels, and the area threshold is 0.01.
    Keypoints outside the output get visibility 0.

    Fast path (``fast_resize``, the default): when ``t`` is axis-aligned (scale and translation
    only: the default recipe), the image is a crop + ``cv2.resize`` (:func:`resize_plan`) instead of
    ``cv2.warpAffine``, and every label is transformed with the plan's effective matrix (the sampled
    one rounded to whole-pixel crops, within half an input pixel of it), so labels match pixels.
    Pixels equal a ``warpAffine`` with that matrix up to OpenCV's fixed-point rounding, except the
    one-pixel rim where ``warpAffine`` blends the image with the border.

    Args:
      rec: :class:`Annotated` (any size).
      t: the transform.
      fast_resize: allow the axis-aligned fast path (False: always ``warpAffine``).
      out: optional uint8[H, W, 3] array the output image is written into (e.g. a batch slot).

    Returns:
      :class:`Annotated` of shape ``t.out_shape`` with only the surviving instances.
    """
    plan = resize_plan(t.matrix, rec.image.shape[:2], t.out_shape) if fast_resize else None
    if plan is not None:
        image = plan.apply_image(rec.image, out=out)
        t = t._replace(matrix=plan.matrix)
    else:
        image = t.apply_image(rec.image, out=out)
    return _affine_labels(rec, t, image)


def _affine_labels(rec: Annotated, t: AffineTransform, image: np.ndarray) -> Annotated:
    """``image`` (already transformed) with ``rec``'s labels moved by ``t``, then the box filter."""
    masks = t.apply_masks(rec.masks) if rec.masks is not None else None
    boxes = _mask_boxes(masks, t.out_shape) if masks is not None else t.apply_boxes(rec.boxes)
    kpts = t.apply_keypoints(rec.keypoints) if rec.keypoints is not None else None
    keep = box_candidates(rec.boxes, boxes, scale=t.scale, area_thr=0.01 if masks is not None else 0.1)
    return Annotated(image, boxes, rec.classes, masks, kpts).select(keep)


# ---------------------------------------------------------------------------------------------- HSV
class HSVTransform(NamedTuple):
    """Multiply / shift the OpenCV 8-bit HSV channels through lookup tables (REFERENCE.md §4.6).

    Attributes:
      r: float64[3] = ``U(-1, 1)^3 * (hsv_h, hsv_s, hsv_v)``.
    """

    r: np.ndarray

    def tables(self) -> np.ndarray:
        """uint8[3, 256]: ``H' = (H + 180 r_h) mod 180``, ``S' = clip(S (1 + r_s))``, ``V' = clip(V (1 + r_v))``,
        each truncated to uint8."""
        x = np.arange(256, dtype=np.float64)
        lut_h = ((x + 180 * self.r[0]) % 180).astype(np.uint8)
        lut_s = np.clip(x * (1 + self.r[1]), 0, 255).astype(np.uint8)
        lut_v = np.clip(x * (1 + self.r[2]), 0, 255).astype(np.uint8)
        return np.stack([lut_h, lut_s, lut_v])

    def apply_image(self, image: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """uint8[H, W, 3] RGB -> uint8[H, W, 3] RGB; all-zero gains return the image unchanged.

        Args:
          image: uint8[H, W, 3] RGB (not modified unless it is ``out``).
          out: optional uint8[H, W, 3] destination (may be ``image`` itself: in place).

        Returns:
          ``out`` (or a new array), the image with its HSV channels mapped through :meth:`tables`.
        """
        if not np.any(self.r):
            if out is None or out is image:
                return image
            np.copyto(out, image)
            return out
        # RGB -> HSV, one single-channel LUT per plane, merge, HSV -> RGB, all through per-thread
        # scratch buffers: the same calls on fresh arrays cost twice as much (page faults of ~1 MB
        # allocations at 640x640; benchmarks/results/loader_percore_vm_20261204.md).
        H, W = image.shape[:2]
        hsv = _scratch("hsv", (H, W, 3))
        cv2.cvtColor(image, cv2.COLOR_RGB2HSV, dst=hsv)
        planes = cv2.split(hsv, [_scratch(f"hsv{k}", (H, W)) for k in range(3)])
        for plane, table in zip(planes, self.tables()):
            cv2.LUT(plane, table, dst=plane)
        hsv = cv2.merge(planes, dst=hsv)
        if out is None:
            out = np.empty_like(image)
        return cv2.cvtColor(hsv, cv2.COLOR_HSV2RGB, dst=out)


def sample_hsv(rng: np.random.Generator, hgain: float = 0.015, sgain: float = 0.7, vgain: float = 0.4) -> HSVTransform:
    """Draw ``r = U(-1, 1)^3 * (hgain, sgain, vgain)``; zero gains draw nothing and give r = 0."""
    if not (hgain or sgain or vgain):
        return HSVTransform(np.zeros(3))
    return HSVTransform(rng.uniform(-1, 1, 3) * np.array([hgain, sgain, vgain]))


# -------------------------------------------------------------------------------------------- flips
class FlipTransform(NamedTuple):
    """Horizontal and / or vertical flip of an image of ``shape``.

    Attributes:
      shape: (H, W) of the image.
      horizontal: x -> W - x (pixel column c -> W - 1 - c).
      vertical: y -> H - y.
      flip_index: keypoint permutation applied with a horizontal flip, or None.
    """

    shape: tuple[int, int]
    horizontal: bool
    vertical: bool
    flip_index: tuple[int, ...] | None = None

    def apply_image(self, image: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Flip ``uint8[H, W, C]`` (into ``out`` when given; ``out`` may be ``image``: in place)."""
        code = -1 if self.horizontal and self.vertical else 1 if self.horizontal else 0 if self.vertical else None
        if code is None:
            if out is None or out is image:
                return image
            np.copyto(out, image)
            return out
        return cv2.flip(image, code) if out is None else cv2.flip(image, code, dst=out)

    def apply_boxes(self, boxes: np.ndarray) -> np.ndarray:
        """Flip xyxy boxes ``float[N, 4]``."""
        H, W = self.shape
        out = boxes.copy()
        if self.horizontal:
            out[:, 0], out[:, 2] = W - boxes[:, 2], W - boxes[:, 0]
        if self.vertical:
            out[:, 1], out[:, 3] = H - boxes[:, 3], H - boxes[:, 1]
        return out

    def apply_keypoints(self, kpts: np.ndarray) -> np.ndarray:
        """Flip ``float[N, P, 3]`` keypoints; a horizontal flip also permutes them by ``flip_index``."""
        H, W = self.shape
        out = kpts.copy()
        if self.horizontal:
            out[..., 0] = W - out[..., 0]
            if self.flip_index is not None:
                out = out[:, list(self.flip_index)]
        if self.vertical:
            out[..., 1] = H - out[..., 1]
        return out

    def apply_masks(self, masks: RoiMasks | PolygonMasks) -> RoiMasks | PolygonMasks:
        """Flip each crop and mirror its offset; or flip every polygon point (x -> W - x)."""
        H, W = self.shape
        if isinstance(masks, PolygonMasks):
            return masks.moved(-1.0 if self.horizontal else 1.0, W if self.horizontal else 0.0,
                               -1.0 if self.vertical else 1.0, H if self.vertical else 0.0)
        offs = masks.offsets.copy()
        crops = []
        for i, c in enumerate(masks.crops):
            h, w = c.shape
            if self.horizontal:
                offs[i, 0] = W - masks.offsets[i, 0] - w
            if self.vertical:
                offs[i, 1] = H - masks.offsets[i, 1] - h
            crops.append(self.apply_image(c) if c.size else c)
        return RoiMasks(offs, tuple(crops))


def sample_flips(rng: np.random.Generator, shape: tuple[int, int], *, flipud: float = 0.0, fliplr: float = 0.5,
                 flip_index: Sequence[int] | None = None) -> FlipTransform:
    """Draw the vertical flip (p = ``flipud``) then the horizontal one (p = ``fliplr``)."""
    v = bool(rng.random() < flipud) if flipud else False
    h = bool(rng.random() < fliplr) if fliplr else False
    return FlipTransform(tuple(shape), h, v, tuple(flip_index) if flip_index is not None else None)


def apply_flips(rec: Annotated, t: FlipTransform, *, inplace: bool = False) -> Annotated:
    """Apply a :class:`FlipTransform` to the image and every label (``inplace``: flip ``rec.image``
    itself instead of a copy; the labels are always new arrays)."""
    if not (t.horizontal or t.vertical):
        return rec
    return Annotated(t.apply_image(rec.image, out=rec.image if inplace else None), t.apply_boxes(rec.boxes), rec.classes,
                     t.apply_masks(rec.masks) if rec.masks is not None else None,
                     t.apply_keypoints(rec.keypoints) if rec.keypoints is not None else None)


# ---------------------------------------------------------------------------------------- rasterise
def overlap_map(masks: RoiMasks | PolygonMasks, shape: tuple[int, int], ratio: int = 4) -> tuple[np.ndarray, np.ndarray]:
    """The overlap-form mask of REFERENCE.md §2.6 at ``(H/ratio, W/ratio)``.

    Polygons are first filled at full size (:meth:`PolygonMasks.rasterise`).

    Each instance mask is downsampled as ``cv2.resize(full_mask, (W/ratio, H/ratio), INTER_LINEAR)``
    would (computed on its crop, aligned to the ``ratio`` grid); instances are sorted by descending
    area at that resolution (stable sort), and instance ``k`` of that order paints ``k + 1`` with a
    running maximum so smaller instances win overlaps.

    Args:
      masks: :class:`RoiMasks` or :class:`PolygonMasks` of N instances in an image of ``shape``.
      shape: (H, W), multiples of ``ratio``.
      ratio: the downsampling factor (4).

    Returns:
      (the map uint8[H/ratio, W/ratio] (uint16 when N >= 255), order int64[N]: the instance sorted
      into slot k is ``order[k]``).
    """
    H, W = shape
    Hm, Wm = H // ratio, W // ratio
    if isinstance(masks, PolygonMasks):
        masks = masks.rasterise(shape)
    small = []
    for c, (x0, y0) in zip(masks.crops, masks.offsets):
        if c.size == 0:
            small.append((0, 0, np.zeros((0, 0), np.uint8)))
            continue
        h, w = c.shape
        qx0, qy0 = int(x0) // ratio, int(y0) // ratio
        qx1, qy1 = -(-(int(x0) + w) // ratio), -(-(int(y0) + h) // ratio)
        padded = np.zeros(((qy1 - qy0) * ratio, (qx1 - qx0) * ratio), np.uint8)
        ox, oy = int(x0) - qx0 * ratio, int(y0) - qy0 * ratio
        padded[oy:oy + h, ox:ox + w] = c
        q = cv2.resize(padded, (qx1 - qx0, qy1 - qy0), interpolation=cv2.INTER_LINEAR)
        small.append((qx0, qy0, q))
    areas = np.array([int(np.count_nonzero(q)) for _, _, q in small], np.int64)
    order = np.argsort(-areas, kind="stable")
    out = np.zeros((Hm, Wm), np.uint8 if len(small) < 255 else np.uint16)
    for k, i in enumerate(order):
        qx0, qy0, q = small[i]
        if q.size:
            _paste(out, (q > 0).astype(out.dtype) * (k + 1), qx0, qy0, np.maximum)
    return out, order


# ------------------------------------------------------------------------------------------ pipeline
def mosaic_enabled(epoch: int, epochs: int | None, cfg: AugmentConfig) -> bool:
    """False for the last ``cfg.close_mosaic`` epochs of ``epochs`` (the reference's close_mosaic), else
    ``cfg.mosaic > 0``. With ``epochs=None`` the run length is unknown and mosaic stays on."""
    if cfg.mosaic <= 0:
        return False
    return epochs is None or epoch < epochs - cfg.close_mosaic


def augment(rng: np.random.Generator, records: Sequence[Annotated], image_size: int, cfg: AugmentConfig, *,
            use_mosaic: bool, out: np.ndarray | None = None) -> Annotated:
    """The training pipeline on one record: mosaic -> random affine -> HSV -> flip-ud -> flip-lr.

    Args:
      rng: the record's generator (:func:`record_rng`).
      records: the record (loaded with :func:`load_resized`) followed by its three mosaic partners
        (ignored without mosaic).
      image_size: output side s (multiple of 32).
      cfg: :class:`AugmentConfig`.
      use_mosaic: from :func:`mosaic_enabled` (the mosaic probability is drawn here).
      out: optional uint8[s, s, 3] array to build the image in (the loader passes the record's
        slot of the batch, so collation copies nothing); the result's image is then ``out``.

    Returns:
      :class:`Annotated` with image uint8[s, s, 3].
    """
    s = image_size
    kw = dict(degrees=cfg.degrees, translate=cfg.translate, scale=cfg.scale, shear=cfg.shear,
              perspective=cfg.perspective)
    if use_mosaic and rng.random() < cfg.mosaic:
        center = sample_mosaic_center(rng, s)
        t = sample_affine(rng, (2 * s, 2 * s), (s, s), **kw)
        if cfg.fast_resize and _is_axis_aligned(t.matrix):
            # no canvas: each tile's visible part is resized straight into the output
            rec, _ = _mosaic_resized(records[:4], center, s, t, np.empty((s, s, 3), np.uint8) if out is None else out)
        else:
            # Build only the part of the 2s x 2s canvas the warp reads (a third of it on average).
            x0, y0, x1, y1 = t.source_region((2 * s, 2 * s))
            rec = mosaic(records[:4], center, s, region=(x0, y0, x1, y1),
                         out=_scratch("mosaic", (y1 - y0, x1 - x0, 3)))  # read once by the affine below
            rec = apply_affine(rec, t.shifted(x0, y0), fast_resize=cfg.fast_resize, out=out)
    else:
        rec = records[0]
        t = sample_affine(rng, rec.image.shape[:2], (s, s), **kw)
        rec = apply_affine(rec, t, fast_resize=cfg.fast_resize, out=out)
    # the image is a fresh array (or ``out``) this call owns: HSV and the flips work in place on it
    # (HSV on the whole image: on the tiles' rectangles only it cost more, 4 strided calls, than the
    # ~12% of grey pixels it would skip)
    hsv = sample_hsv(rng, cfg.hsv_h, cfg.hsv_s, cfg.hsv_v)
    hsv.apply_image(rec.image, out=rec.image)
    flips = sample_flips(rng, (s, s), flipud=cfg.flipud, fliplr=cfg.fliplr, flip_index=cfg.flip_index)
    return apply_flips(rec, flips, inplace=True)
