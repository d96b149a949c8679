"""Boxes: layouts, clipping and areas; the distance and DFL codecs; the IoU family.

* Layouts: corners (xyxy) <-> centre form (xywh), :func:`clip_boxes`, :func:`box_area`.
* Codecs (REFERENCE.md §1.6, §2.2): :func:`dist2bbox` / :func:`bbox2dist` turn (left, top,
  right, bottom) distances around anchor points into boxes and back; :func:`dfl_expectation`
  decodes the detect head's per-side bin logits into distances. They are codecs, not losses:
  the head's decode, the assigner and the box loss all use them.
* The IoU family (REFERENCE.md §2.4): :func:`bbox_iou` (IoU, GIoU, DIoU, CIoU), the readable
  reference; the fused CIoU with a hand-derived backward is :func:`yolo_func.structures.ciou`.

``assign/`` and ``heads/`` import these from here; ``yolo_func.losses`` re-exports them for the
code that imported them from there.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "xyxy_to_xywh",
    "xywh_to_xyxy",
    "clip_boxes",
    "box_area",
    "dist2bbox",
    "bbox2dist",
    "dfl_expectation",
    "bbox_iou",
]


def _check_last4(name: str, boxes: torch.Tensor) -> None:
    if boxes.ndim == 0 or boxes.shape[-1] != 4:
        raise ValueError(f"[yolo_func] {name}: expected float[..., 4], got shape {tuple(boxes.shape)}")


def xyxy_to_xywh(boxes: torch.Tensor) -> torch.Tensor:
    """Corners to centre form.

    Args:
      boxes: float[..., 4] (x1, y1, x2, y2).

    Returns:
      float[..., 4] (cx, cy, w, h).

    Example:
      >>> import torch
      >>> from yolo_func.structures import xyxy_to_xywh
      >>> xyxy_to_xywh(torch.tensor([[8.0, 17.0, 12.0, 23.0]]))
      tensor([[10., 20.,  4.,  6.]])
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

    Example:
      >>> import torch
      >>> from yolo_func.structures import xywh_to_xyxy
      >>> xywh_to_xyxy(torch.tensor([[10.0, 20.0, 4.0, 6.0]]))
      tensor([[ 8., 17., 12., 23.]])
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

    Example:
      >>> import torch
      >>> from yolo_func.structures import clip_boxes
      >>> clip_boxes(torch.tensor([[-5.0, 10.0, 70.0, 40.0]]), (32, 64))       # image (H, W) = (32, 64)
      tensor([[ 0., 10., 64., 32.]])
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

    Example:
      >>> import torch
      >>> from yolo_func.structures import box_area
      >>> box_area(torch.tensor([[0.0, 0.0, 4.0, 2.0], [5.0, 5.0, 1.0, 1.0]]))   # the second is inverted
      tensor([8., 0.])
    """
    _check_last4("box_area", boxes)
    x1, y1, x2, y2 = boxes.unbind(-1)
    return (x2 - x1).clamp(min=0) * (y2 - y1).clamp(min=0)


def dist2bbox(distance: torch.Tensor, anchor_points: torch.Tensor, *, xywh: bool = False) -> torch.Tensor:
    """Decode (left, top, right, bottom) distances around anchor points into boxes.

    Args:
      distance: float[..., 4] ltrb distances (same units as ``anchor_points``).
      anchor_points: float[..., 2] (x, y), broadcastable against ``distance[..., :2]``.
      xywh: return centre form (cx, cy, w, h) instead of corners (x1, y1, x2, y2).

    Returns:
      float[..., 4].

    Example:
      >>> import torch
      >>> from yolo_func.losses import dist2bbox
      >>> dist2bbox(torch.tensor([[1.0, 2.0, 3.0, 4.0]]), torch.tensor([[5.0, 5.0]]))           # ltrb -> xyxy
      tensor([[4., 3., 8., 9.]])
      >>> dist2bbox(torch.tensor([[1.0, 2.0, 3.0, 4.0]]), torch.tensor([[5.0, 5.0]]), xywh=True)
      tensor([[6., 6., 4., 6.]])
    """
    _check_last4("dist2bbox: distance", distance)
    if anchor_points.shape[-1] != 2:
        raise ValueError(f"[yolo_func] dist2bbox: anchor_points must be float[..., 2], got shape {tuple(anchor_points.shape)}")
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

    Example:
      >>> import torch
      >>> from yolo_func.losses import bbox2dist
      >>> bbox2dist(torch.tensor([[4.0, 4.0]]), torch.tensor([[1.0, 2.0, 30.0, 5.0]]), reg_max=16)   # grid units; clamped to 15.99
      tensor([[ 3.0000,  2.0000, 15.9900,  1.0000]])
    """
    _check_last4("bbox2dist: bbox", bbox)
    if anchor_points.shape[-1] != 2:
        raise ValueError(f"[yolo_func] bbox2dist: anchor_points must be float[..., 2], got shape {tuple(anchor_points.shape)}")
    x1y1, x2y2 = bbox.chunk(2, -1)
    return torch.cat((anchor_points - x1y1, x2y2 - anchor_points), -1).clamp(0, reg_max - 0.01)


def dfl_expectation(box_dist: torch.Tensor, reg_max: int = 16) -> torch.Tensor:
    """Expected distance per side: softmax over the ``R`` bins of each side, then ``sum_j j * p_j``.

    Args:
      box_dist: float[..., 4*R] raw logits, side-major (left, top, right, bottom) x R bins.
      reg_max: R (16).

    Returns:
      float[..., 4] distances in grid units.

    Example:
      >>> import torch
      >>> from yolo_func.losses import dfl_expectation
      >>> dfl_expectation(torch.zeros(1, 2, 4 * 16)).shape   # float[B, A, 4R] -> float[B, A, 4]; uniform bins -> 7.5
      torch.Size([1, 2, 4])
      >>> dfl_expectation(torch.zeros(1, 1, 64))[0, 0, 0].item()
      7.5
    """
    shape = box_dist.shape[:-1]
    if box_dist.shape[-1] != 4 * reg_max:
        raise ValueError(f"[yolo_func] dfl_expectation: box_dist must be float[..., 4*reg_max={4 * reg_max}], got shape "
                         f"{tuple(box_dist.shape)}; pass the head's reg_max")
    p = box_dist.reshape(*shape, 4, reg_max).softmax(-1)
    proj = torch.arange(reg_max, device=box_dist.device, dtype=p.dtype)
    return p.matmul(proj)  # a matmul, as the reference's loss decode does (same rounding)


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

    Example:
      >>> import torch
      >>> from yolo_func.losses import bbox_iou
      >>> a, b = torch.tensor([[0.0, 0.0, 2.0, 2.0]]), torch.tensor([[1.0, 0.0, 3.0, 2.0]])
      >>> bbox_iou(a, b), bbox_iou(a, a, kind="ciou")        # float[...]
      (tensor([0.3333]), tensor([1.]))
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
