"""Box codecs (distance <-> box) and the IoU family (REFERENCE.md §1.6, §2.4)."""

from __future__ import annotations

import math

import torch

__all__ = ["dist2bbox", "bbox2dist", "bbox_iou"]


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


_IOU_KINDS = ("iou", "giou", "diou", "ciou")


def bbox_iou(box1: torch.Tensor, box2: torch.Tensor, *, kind: str = "iou", eps: float = 1e-7) -> torch.Tensor:
    """IoU family of two sets of xyxy boxes, elementwise with broadcasting (REFERENCE.md §2.4).

    The reference's conventions are kept: ``eps`` is added to both heights (not widths), to the
    union and to the squared enclosing diagonal; CIoU's trade-off weight ``alpha`` carries no
    gradient (Zheng et al., "Distance-IoU Loss", AAAI 2020; ultralytics ``bbox_iou``).

    Args:
      box1: float[..., 4] xyxy.
      box2: float[..., 4] xyxy, broadcastable against ``box1``.
      kind: ``"iou"``, ``"giou"``, ``"diou"`` or ``"ciou"``.
      eps: numerical guard (1e-7).

    Returns:
      float[...] (the broadcast shape without the last axis). IoU lies in [0, 1]; GIoU, DIoU and
      CIoU in [-1, 1].

    Raises:
      ValueError: unknown ``kind`` or a last axis that is not 4.
    """
    if kind not in _IOU_KINDS:
        raise ValueError(f"[yolo_func] bbox_iou: kind must be one of {_IOU_KINDS}, got {kind!r}")
    if box1.shape[-1] != 4 or box2.shape[-1] != 4:
        raise ValueError(f"[yolo_func] bbox_iou: boxes must end in 4, got {tuple(box1.shape)} and {tuple(box2.shape)}")
    b1x1, b1y1, b1x2, b1y2 = box1.unbind(-1)
    b2x1, b2y1, b2x2, b2y2 = box2.unbind(-1)
    w1, h1 = b1x2 - b1x1, b1y2 - b1y1 + eps
    w2, h2 = b2x2 - b2x1, b2y2 - b2y1 + eps
    inter = (torch.minimum(b1x2, b2x2) - torch.maximum(b1x1, b2x1)).clamp(min=0) * (
        torch.minimum(b1y2, b2y2) - torch.maximum(b1y1, b2y1)
    ).clamp(min=0)
    union = w1 * h1 + w2 * h2 - inter + eps
    iou = inter / union
    if kind == "iou":
        return iou
    cw = torch.maximum(b1x2, b2x2) - torch.minimum(b1x1, b2x1)  # enclosing box
    ch = torch.maximum(b1y2, b2y2) - torch.minimum(b1y1, b2y1)
    if kind == "giou":
        c_area = cw * ch + eps
        return iou - (c_area - union) / c_area
    c2 = cw.pow(2) + ch.pow(2) + eps
    rho2 = ((b2x1 + b2x2 - b1x1 - b1x2).pow(2) + (b2y1 + b2y2 - b1y1 - b1y2).pow(2)) / 4
    if kind == "diou":
        return iou - rho2 / c2
    v = (4 / math.pi**2) * (torch.atan(w2 / h2) - torch.atan(w1 / h1)).pow(2)
    alpha = (v / (v - iou + (1 + eps))).detach()  # a stop-gradient weight (trap T7)
    return iou - (rho2 / c2 + v * alpha)
