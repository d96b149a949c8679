"""Box layout helpers: corners (xyxy) <-> centre form (xywh), clipping and areas."""

from __future__ import annotations

import torch

__all__ = ["xyxy_to_xywh", "xywh_to_xyxy", "clip_boxes", "box_area"]


def _check_last4(name: str, boxes: torch.Tensor) -> None:
    if boxes.shape[-1] != 4:
        raise ValueError(f"[yolo_func] {name}: expected boxes float[..., 4], got shape {tuple(boxes.shape)}")


def xyxy_to_xywh(boxes: torch.Tensor) -> torch.Tensor:
    """Corners to centre form.

    Args:
      boxes: float[..., 4] (x1, y1, x2, y2).

    Returns:
      float[..., 4] (cx, cy, w, h).
    """
    _check_last4("xyxy_to_xywh", boxes)
    x1y1, x2y2 = boxes.chunk(2, -1)
    return torch.cat(((x1y1 + x2y2) / 2, x2y2 - x1y1), -1)


def xywh_to_xyxy(boxes: torch.Tensor) -> torch.Tensor:
    """Centre form to corners.

    Args:
      boxes: float[..., 4] (cx, cy, w, h).

    Returns:
      float[..., 4] (x1, y1, x2, y2).
    """
    _check_last4("xywh_to_xyxy", boxes)
    xy, wh = boxes.chunk(2, -1)
    return torch.cat((xy - wh / 2, xy + wh / 2), -1)


def clip_boxes(boxes: torch.Tensor, image_size: tuple[int, int]) -> torch.Tensor:
    """Clip xyxy boxes to the image ``[0, W] x [0, H]`` (out of place).

    Args:
      boxes: float[..., 4] xyxy pixels.
      image_size: (H, W) in pixels.

    Returns:
      float[..., 4].
    """
    _check_last4("clip_boxes", boxes)
    h, w = image_size
    x1, y1, x2, y2 = boxes.unbind(-1)
    return torch.stack((x1.clamp(0, w), y1.clamp(0, h), x2.clamp(0, w), y2.clamp(0, h)), -1)


def box_area(boxes: torch.Tensor) -> torch.Tensor:
    """Area of xyxy boxes; inverted boxes count as 0.

    Args:
      boxes: float[..., 4] xyxy.

    Returns:
      float[...].
    """
    _check_last4("box_area", boxes)
    x1, y1, x2, y2 = boxes.unbind(-1)
    return (x2 - x1).clamp(min=0) * (y2 - y1).clamp(min=0)
