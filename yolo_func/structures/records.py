"""The static-shape records the data pipeline produces and the training step consumes.

``Targets`` (padded ground truth) and ``Batch`` (images + targets) live here, next to their
builders (:mod:`yolo_func.structures.targets`), so that ``data/``, ``testing/`` and ``train/`` can
all use them without importing each other. Both are re-exported where users imported them before
(``yolo_func.Targets``, ``yolo_func._types.Targets``, ``yolo_func.train.Batch``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

Tensor = torch.Tensor

__all__ = ["Targets", "Batch"]


class Targets(NamedTuple):
    """Ground truth with static shapes: ``M`` is padded (bucketed) so shapes repeat across steps.

    Attributes:
      boxes: float[B, M, 4] xyxy in input pixels; padding rows are zeros.
      classes: int64[B, M] class ids; padding rows are 0.
      valid: bool[B, M] True for real targets.
      masks: optional. Overlap-indexed int64[B, H/4, W/4] (0 background, j+1 = slot j), or
        per-instance float[B, M, H/4, W/4].
      keypoints: optional float[B, M, P, 3] (x, y in input pixels, visibility 0/1/2).

    Example:
      >>> import torch
      >>> from yolo_func import Targets
      >>> t = Targets(boxes=torch.tensor([[[4.0, 4.0, 20.0, 30.0], [0.0, 0.0, 0.0, 0.0]]]),   # B=1, M=2
      ...             classes=torch.tensor([[3, 0]]), valid=torch.tensor([[True, False]]))
      >>> t.boxes.shape, t.classes.dtype, int(t.valid.sum()), t.masks is None
      (torch.Size([1, 2, 4]), torch.int64, 1, True)
    """

    boxes: Tensor
    classes: Tensor
    valid: Tensor
    masks: Tensor | None = None
    keypoints: Tensor | None = None


class Batch(NamedTuple):
    """One training batch with static shapes.

    Attributes:
      images: uint8[B, 3, H, W] (0..255; the step divides by 255 on the device) or float[B, 3, H, W]
        in [0, 1]; H and W multiples of 32.
      targets: :class:`Targets` padded to a bucketed ``M``.

    Example:
      >>> import torch
      >>> from yolo_func.structures import Batch, Targets
      >>> t = Targets(torch.zeros(2, 8, 4), torch.zeros(2, 8, dtype=torch.int64), torch.zeros(2, 8, dtype=torch.bool))
      >>> b = Batch(images=torch.zeros(2, 3, 64, 64, dtype=torch.uint8), targets=t)
      >>> b.images.dtype, b.targets.boxes.shape
      (torch.uint8, torch.Size([2, 8, 4]))
    """

    images: Tensor
    targets: Targets
