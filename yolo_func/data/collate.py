"""Collation: augmented records in, the static-shape :class:`yolo_func.structures.Batch` out.

Images stay uint8 until the device (the step divides by 255) and are laid out NHWC in memory
(``images`` is a ``[B, 3, H, W]`` view with ``channels_last`` strides): the augmented records are
HWC, the network runs channels_last on CUDA, so no transpose is made on the host or the device
(``images.contiguous()`` gives NCHW memory). In a DataLoader worker the big arrays are allocated in
shared memory, as torch's ``default_collate`` does, so handing a batch to the main process copies
nothing. Targets are padded to a bucketed
``M`` (:func:`yolo_func.structures.targets.bucket_size`) so shapes repeat across steps; segment
masks become the overlap map at ``H/4`` (REFERENCE.md §2.6: each image's instances reordered by
descending mask area, ``j + 1`` = slot ``j``); pose keypoints stay in pixels.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import math

import numpy as np
import torch
from torch.utils.data import get_worker_info

from yolo_func.data.augment import Annotated, overlap_map
from yolo_func.structures.records import Batch, Targets
from yolo_func.structures.targets import bucket_size

__all__ = ["Formatted", "format_record", "batch_images", "collate"]


class Formatted(NamedTuple):
    """One image ready for collation.

    Attributes:
      image: uint8[H, W, 3] RGB.
      boxes: float32[n, 4] xyxy pixels (slot order).
      classes: int64[n].
      masks: overlap map uint8|uint16[H/r, W/r] (value k + 1 = slot k), or None.
      keypoints: float32[n, P, 3] pixels, or None.
    """

    image: np.ndarray
    boxes: np.ndarray
    classes: np.ndarray
    masks: np.ndarray | None
    keypoints: np.ndarray | None


def format_record(rec: Annotated, *, mask_ratio: int = 4) -> Formatted:
    """Rasterise masks into the overlap map and put the labels in slot order.

    Without masks the slot order is the record's order; with masks it is the descending-area order
    of :func:`yolo_func.data.augment.overlap_map` (boxes, classes and keypoints reordered alike).

    Args:
      rec: an augmented :class:`Annotated` record (image uint8[H, W, 3]).
      mask_ratio: mask downsampling (4).

    Returns:
      :class:`Formatted`.
    """
    boxes, classes, kpts, masks = rec.boxes, rec.classes, rec.keypoints, None
    if rec.masks is not None:
        masks, order = overlap_map(rec.masks, rec.image.shape[:2], mask_ratio)
        boxes, classes = boxes[order], classes[order]
        kpts = kpts[order] if kpts is not None else None
    return Formatted(rec.image, boxes.astype(np.float32, copy=False), classes.astype(np.int64, copy=False), masks, kpts)


def _empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Uninitialised ``dtype[shape]``; in a DataLoader worker in shared memory (sending it to the main
    process then copies nothing; ``share_memory_()`` on a finished tensor would copy it)."""
    if get_worker_info() is not None:
        try:  # what torch.utils.data.default_collate does
            storage = torch.empty(0, dtype=dtype)._typed_storage()._new_shared(math.prod(shape))
            return torch.empty(0, dtype=dtype).new(storage).view(shape)
        except (AttributeError, RuntimeError):  # a torch without the private helper: a plain tensor
            pass
    return torch.empty(shape, dtype=dtype)


def batch_images(B: int, H: int, W: int) -> torch.Tensor:
    """An uninitialised ``uint8[B, H, W, 3]`` tensor for a batch's images (in a DataLoader worker, in
    shared memory: sending it to the main process copies nothing). Augmenting each record straight
    into ``batch_images(...)[i].numpy()`` and passing the tensor to :func:`collate` saves a copy.

    Example:
      >>> batch_images(2, 32, 32).shape
      torch.Size([2, 32, 32, 3])
    """
    return _empty((B, H, W, 3), torch.uint8)


def collate(items: Sequence[Formatted], *, max_boxes: int | None = None, images: torch.Tensor | None = None) -> Batch:
    """Stack formatted records into a :class:`Batch` with static shapes.

    Boxes are clipped to the image; a box with zero clipped area keeps its slot but is
    ``valid=False`` (the rule of :mod:`yolo_func.structures.targets`).

    Args:
      items: B :class:`Formatted` of one image size (H, W); all with masks or none, all with
        keypoints (of one P) or none.
      max_boxes: fixed M; default ``bucket_size`` of the largest count.
      images: optional uint8[B, H, W, 3] tensor to collate the images into (from :func:`batch_images`);
        an item whose image already is its slot of it (augmented in place) is not copied.

    Returns:
      ``Batch(images uint8[B, 3, H, W] (channels_last memory), Targets(boxes float32[B, M, 4], classes int64[B, M],
      valid bool[B, M], masks int64[B, H/r, W/r] | None, keypoints float32[B, M, P, 3] | None))``.

    Raises:
      ValueError: mixed image sizes, or more instances in an image than ``max_boxes``.
    """
    B = len(items)
    if B == 0:
        raise ValueError("[yolo_func] collate: items is empty; expected at least one record")
    H, W = items[0].image.shape[:2]
    if images is not None and (tuple(images.shape) != (B, H, W, 3) or images.dtype != torch.uint8):
        raise ValueError(f"[yolo_func] collate: images: expected uint8[{B}, {H}, {W}, 3], got "
                         f"{images.dtype}{list(images.shape)}")
    images_t = batch_images(B, H, W) if images is None else images
    images = images_t.numpy()
    counts = [len(it.boxes) for it in items]
    if max_boxes is None:
        M = bucket_size(max(counts))
    elif max(counts) > max_boxes:
        raise ValueError(f"[yolo_func] max_boxes: an image has {max(counts)} targets but max_boxes={max_boxes}; "
                         "raise max_boxes")
    else:
        M = int(max_boxes)
    boxes = np.zeros((B, M, 4), np.float32)
    classes = np.zeros((B, M), np.int64)
    has_masks = items[0].masks is not None
    has_kpts = items[0].keypoints is not None
    masks_t = _empty((B, *items[0].masks.shape), torch.int64) if has_masks else None
    masks = masks_t.numpy() if has_masks else None
    kpts = np.zeros((B, M, *items[0].keypoints.shape[1:]), np.float32) if has_kpts else None
    for i, it in enumerate(items):
        if it.image.shape[:2] != (H, W):
            raise ValueError(f"[yolo_func] collate: items[{i}].image is {it.image.shape[:2]}, expected {(H, W)}; "
                             "every image of a batch must have the same size")
        if it.image.ctypes.data != images[i].ctypes.data:  # not augmented in its slot already
            images[i] = it.image  # HWC as augmented (NHWC memory; see the module docstring)
        n = counts[i]
        boxes[i, :n] = it.boxes
        classes[i, :n] = it.classes
        if has_masks:
            masks[i] = it.masks
        if has_kpts and n:
            kpts[i, :n] = it.keypoints
    boxes = np.clip(boxes, 0, np.array([W, H, W, H], np.float32))
    valid = (boxes[..., 2] > boxes[..., 0]) & (boxes[..., 3] > boxes[..., 1])
    boxes = np.where(valid[..., None], boxes, 0).astype(np.float32)
    classes = np.where(valid, classes, 0)
    if has_kpts:
        kpts = np.where(valid[..., None, None], kpts, 0).astype(np.float32)
    targets = Targets(torch.from_numpy(boxes), torch.from_numpy(classes), torch.from_numpy(valid),
                      masks_t if has_masks else None,
                      torch.from_numpy(kpts) if has_kpts else None)
    return Batch(images_t.permute(0, 3, 1, 2), targets)
