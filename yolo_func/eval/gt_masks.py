"""The ground-truth masks a segmentation validation scores against (REFERENCE.md §3.3 val, §4.6 Format).

The reference's val batches carry each image's masks in the overlap form of §2.6: every instance's
polygon (resampled to 1000 points, moved into the letterboxed input, vertices truncated to
integers) filled at full size, resized linearly to a quarter, then painted into one map by
descending area so that smaller instances win overlaps; an instance's ground truth is ``map ==
its value``. Where a smaller instance overlaps a larger one, those pixels are the smaller one's
only. Checked against the reference's public ``build_yolo_dataset(mode="val")`` on the built-in
segmentation data at 320 (``benchmarks/results/val_gt_masks_*.md``).

:func:`val_gt_masks` builds exactly that from a dataset's polygons
(:meth:`~yolo_func.data.CocoDataset.polygons` / :meth:`~yolo_func.data.YoloDataset.polygons`;
COCO RLE masks are outlined there, as a conversion to the YOLO format does), and falls back to the
dataset's dense masks warped into the letterbox for a dataset without polygons.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from yolo_func.data.augment import RoiMasks, _warp_masks, overlap_map
from yolo_func.data.polygons import RESAMPLE_POINTS, fill_polygons, resample_polygon

__all__ = ["RESAMPLE_POINTS", "resample_polygon", "letterboxed_polygon_masks", "overlap_split", "val_gt_masks"]


def letterboxed_polygon_masks(polygons: Sequence[np.ndarray], gain: tuple[float, float], pad: tuple[float, float],
                              shape: tuple[int, int], *, resample: int | None = RESAMPLE_POINTS) -> RoiMasks:
    """Fill each polygon, moved into the letterboxed input, at full size (the reference's raster).

    Args:
      polygons: N float[K_j, 2] (x, y) vertex arrays in original-image pixels.
      gain: (gx, gy) original -> input scale.
      pad: (left, top) letterbox padding in input pixels.
      shape: (H, W) of the input.
      resample: points per polygon before filling (None: the vertices as given).

    Returns:
      :class:`~yolo_func.data.augment.RoiMasks`: each instance's filled pixels (value 1) as a tight
      crop; vertices ``x * gx + left`` truncated to int32 and filled with ``cv2.fillPoly``.
    """
    g = np.array(gain, np.float32)
    t = np.array(pad, np.float32)
    moved = []
    for poly in polygons:
        p = np.asarray(poly, np.float32).reshape(-1, 2)
        if resample and len(p) >= 3:
            p = resample_polygon(p, resample)
        moved.append(p * g + t)
    return RoiMasks(*fill_polygons(moved, shape))


def overlap_split(masks: RoiMasks, shape: tuple[int, int], ratio: int = 4) -> torch.Tensor:
    """Each instance's ground truth in the overlap form: ``bool[N, H/ratio, W/ratio]``, instance
    ``i`` true where :func:`~yolo_func.data.augment.overlap_map` holds its value (its own pixels
    less those a smaller instance covers), in the instances' order."""
    H, W = shape
    if len(masks.crops) == 0:
        return torch.zeros(0, H // ratio, W // ratio, dtype=torch.bool)
    m, order = overlap_map(masks, (H, W), ratio)
    slot = np.empty(len(order), np.int64)
    slot[order] = np.arange(1, len(order) + 1)
    return torch.from_numpy(m[None] == slot[:, None, None].astype(m.dtype))


def val_gt_masks(dataset: Any, index: int, *, orig_shape: tuple[int, int], gain: tuple[float, float],
                 pad: tuple[float, float], shape: tuple[int, int]) -> torch.Tensor:
    """The validation ground-truth masks of image ``index``, ``bool[N, H/4, W/4]`` in the dataset's
    instance order (module docstring).

    Args:
      dataset: a segmentation dataset; with ``polygons(index)`` (CocoDataset, YoloDataset) the
        reference's polygon raster, else ``dataset[index].masks`` (uint8[N, h0, w0]) warped into
        the letterbox (linear, pixel centres) before the same overlap form.
      index: the image.
      orig_shape: (h0, w0) of the original image.
      gain: (gx, gy) original -> input (a :class:`~yolo_func.data.ValBatch`'s ``gains`` row).
      pad: (left, top) (its ``pads`` row).
      shape: (H, W) of the letterboxed input (multiples of 4).

    Returns:
      bool[N, H/4, W/4] on the CPU.
    """
    H, W = shape
    polygons = getattr(dataset, "polygons", None)
    if callable(polygons):
        roi = letterboxed_polygon_masks(polygons(index), gain, pad, (H, W))
    else:
        dense = np.asarray(dataset[index].masks, np.uint8)
        if dense.shape[1:] != tuple(orig_shape):
            raise ValueError(f"[yolo_func] val_gt_masks: image {index}'s masks are {list(dense.shape[1:])}, "
                             f"expected the original size {list(orig_shape)}")
        gx, gy = gain
        px, py = pad
        M = np.array([[gx, 0, (gx - 1) / 2 + px], [0, gy, (gy - 1) / 2 + py], [0, 0, 1]], np.float64)  # pixel-centre
        roi = _warp_masks(RoiMasks.from_dense(dense), M, (H, W))
    return overlap_split(roi, (H, W))
