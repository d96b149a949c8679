"""The raw record every dataset returns: one image and its annotations, unaugmented.

Datasets (:class:`yolo_func.data.CocoDataset`, :class:`yolo_func.data.YoloDataset`, the built-in
data) are random-access sources of :class:`Sample`; augmentation and collation wrap them and never
subclass them (DESIGN.md §7).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

__all__ = ["Sample", "dataset_index"]


class Sample(NamedTuple):
    """One image with its annotations, in original pixels.

    Attributes:
      image: uint8[H, W, 3] RGB (EXIF orientation applied; grayscale / RGBA / CMYK converted).
      boxes: float32[N, 4] xyxy in pixels of ``image``.
      classes: int64[N] contiguous class indices in ``[0, K)``.
      masks: uint8[N, H, W] instance masks (0/1), or None when the task has none.
      keypoints: float32[N, P, 3] (x, y in pixels, visibility 0/1/2), or None.
      image_id: the dataset's image id (COCO ``image_id``; the index for YOLO-format data).
      file_name: the image's path relative to the dataset's image folder.

    Example:
      >>> from yolo_func.data import builtin_dataset
      >>> s = builtin_dataset("segment", "val", num_images=2)[0]    # a Sample
      >>> s.image.dtype, s.image.ndim, s.boxes.dtype, s.classes.dtype, s.masks.dtype, s.keypoints is None
      (dtype('uint8'), 3, dtype('float32'), dtype('int64'), dtype('uint8'), True)
    """

    image: np.ndarray
    boxes: np.ndarray
    classes: np.ndarray
    masks: np.ndarray | None
    keypoints: np.ndarray | None
    image_id: int
    file_name: str


def dataset_index(index: int, size: int) -> int:
    """``index`` as a position in ``[0, size)``, Python-style negatives allowed (every dataset's
    ``__getitem__`` rule).

    Raises:
      IndexError: ``index`` outside ``[-size, size)``.
    """
    if not -size <= index < size:
        raise IndexError(f"[yolo_func] index {index} out of range for a dataset of {size} images")
    return index % size
