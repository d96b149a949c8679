"""Box codecs (distance <-> box) and the IoU family (REFERENCE.md §1.6, §2.4)."""

from __future__ import annotations

import torch

__all__ = ["dist2bbox", "bbox2dist"]


def dist2bbox(distance: torch.Tensor, anchor_points: torch.Tensor, *, xywh: bool = False) -> torch.Tensor:
    """Decode (left, top, right, bottom) distances around anchor points into boxes.

    Args:
      distance: float[..., 4] ltrb distances (same units as ``anchor_points``).
      anchor_points: float[..., 2] (x, y), broadcastable against ``distance[..., :2]``.
      xywh: return centre form (cx, cy, w, h) instead of corners (x1, y1, x2, y2).

    Returns:
      float[..., 4].
    """
    lt, rb = distance.chunk(2, -1)
    x1y1 = anchor_points - lt
    x2y2 = anchor_points + rb
    if xywh:
        return torch.cat(((x1y1 + x2y2) / 2, x2y2 - x1y1), -1)
    return torch.cat((x1y1, x2y2), -1)


def bbox2dist(anchor_points: torch.Tensor, bbox: torch.Tensor, reg_max: float) -> torch.Tensor:
    """Encode xyxy boxes as ltrb distances from anchor points, clamped to ``[0, reg_max - 0.01]``.

    Args:
      anchor_points: float[..., 2].
      bbox: float[..., 4] xyxy in the same units.
      reg_max: the largest bin index (``R - 1`` = 15 for YOLOv8), so the clamp is 14.99.

    Returns:
      float[..., 4].
    """
    x1y1, x2y2 = bbox.chunk(2, -1)
    return torch.cat((anchor_points - x1y1, x2y2 - anchor_points), -1).clamp(0, reg_max - 0.01)
