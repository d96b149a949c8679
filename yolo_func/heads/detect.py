"""The YOLOv8 detect head: per-level box (DFL) and class branches (REFERENCE.md §1.6, §1.9).

Tree keys: ``box/{p3,p4,p5}/{conv1,conv2,pred}`` (reference ``cv2``) and
``cls/{p3,p4,p5}/{conv1,conv2,pred}`` (reference ``cv3``). The reference's frozen DFL projection
(``dfl.conv.weight = [0..15]``) is a constant here, not a parameter.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from yolo_func._types import Anchors, DetectPreds, Feats
from yolo_func.heads.base import LEVELS, Head, flatten_levels, multi_level
from yolo_func.losses.heads import detect_loss  # the head owns its loss (docs/design.md)
from yolo_func.nn import conv_weight
from yolo_func.structures.boxes import dfl_expectation, dist2bbox

__all__ = ["detect_head", "detect_channels", "decode_detect"]


def detect_channels(channels: Sequence[int], num_classes: int, reg_max: int = 16) -> tuple[int, int]:
    """Hidden widths ``(c2, c3)`` of the box and class branches:
    ``c2 = max(16, ch0 // 4, 4 * reg_max)``, ``c3 = max(ch0, min(num_classes, 100))``.

    Example:
      >>> from yolo_func.heads import detect_channels
      >>> detect_channels((64, 128, 256), num_classes=80), detect_channels((64, 128, 256), num_classes=5)
      ((64, 80), (64, 64))
    """
    return max(16, channels[0] // 4, 4 * reg_max), max(channels[0], min(num_classes, 100))


def decode_detect(preds: DetectPreds, anchors: Anchors, *, reg_max: int = 16) -> torch.Tensor:
    """Reference inference output of the detect part.

    Args:
      preds: ``box_dist float[B, A, 4R]``, ``cls_logits float[B, A, K]``.
      anchors: grid-unit points float[A, 2], strides float[A, 1].

    Returns:
      float[B, 4 + K, A]: (cx, cy, w, h) in pixels, then ``sigmoid(cls_logits)``.

    Example:
      >>> import torch
      >>> from yolo_func import DetectPreds
      >>> from yolo_func.assign import make_anchors
      >>> from yolo_func.heads import decode_detect
      >>> anchors = make_anchors([(8, 8), (4, 4), (2, 2)], (8, 16, 32))
      >>> preds = DetectPreds(box_dist=torch.zeros(1, 84, 64), cls_logits=torch.zeros(1, 84, 5))
      >>> y = decode_detect(preds, anchors)
      >>> tuple(y.shape), y[0, :, 0].tolist()     # uniform bins: 7.5 grid units a side; sigmoid(0) = 0.5
      ((1, 9, 84), [4.0, 4.0, 120.0, 120.0, 0.5, 0.5, 0.5, 0.5, 0.5])
    """
    dist = dfl_expectation(preds.box_dist, reg_max)  # [B, A, 4] grid units
    boxes = dist2bbox(dist, anchors.points, xywh=True) * anchors.strides
    return torch.cat((boxes, preds.cls_logits.sigmoid()), -1).transpose(1, 2)


def detect_head(
    *,
    num_classes: int,
    channels: Sequence[int],
    strides: Sequence[int] = (8, 16, 32),
    reg_max: int = 16,
    loss_fn=None,
) -> Head:
    """Build the detect head (``num_classes`` is the reference's ``nc``).

    Args:
      num_classes: K >= 1.
      channels: input channels of (P3, P4, P5).
      strides: pixels per cell of each level; used for the class-bias prior.
      reg_max: DFL bins R.
      loss_fn: the loss ``(preds, targets, assignment) -> (scalar, parts)``; built by
        :func:`yolo_func.losses.detect_loss` with this head's ``num_classes`` and ``reg_max`` by
        default (gains box 7.5, cls 0.5, dfl 1.5).

    Returns:
      ``Head`` whose apply maps ``Feats`` to ``DetectPreds(box_dist float[B, A, 4R], cls_logits float[B, A, K])``.

    Example:
      >>> import torch
      >>> from yolo_func import detect_head
      >>> head = detect_head(num_classes=5, channels=(64, 128, 256))     # yolov8n's neck channels
      >>> params, state = head.init(torch.Generator().manual_seed(0))
      >>> feats = (torch.rand(1, 64, 8, 8), torch.rand(1, 128, 4, 4), torch.rand(1, 256, 2, 2))
      >>> preds, _ = head.apply(params, state, feats, train=True)
      >>> tuple(preds.box_dist.shape), tuple(preds.cls_logits.shape)
      ((1, 84, 64), (1, 84, 5))
    """
    if not isinstance(num_classes, int) or num_classes < 1:
        raise ValueError(f"[yolo_func] detect_head: num_classes must be a positive int, got {num_classes!r}")
    if len(channels) != 3 or len(strides) != 3:
        raise ValueError(f"[yolo_func] detect_head: expected 3 levels, got channels={channels} strides={strides}")
    c2, c3 = detect_channels(channels, num_classes, reg_max)
    box = multi_level(channels, c2, 4 * reg_max)
    cls = multi_level(channels, c3, num_classes)

    def init(gen: torch.Generator):
        box_p, box_s = box.init(gen)
        cls_p, cls_s = cls.init(gen)
        # The reference draws its frozen DFL conv (16 weights) here before overwriting them with
        # 0..15; draw and discard so the generator stays in step with it (REFERENCE.md §1.9).
        conv_weight(gen, (1, reg_max, 1, 1), reg_max)
        for level, s in zip(LEVELS, strides):
            box_p[level]["pred"]["bias"].fill_(2.0)
            cls_p[level]["pred"]["bias"].fill_(math.log(5 / num_classes / (640 / s) ** 2))
        return {"box": box_p, "cls": cls_p}, {"box": box_s, "cls": cls_s}

    def apply(params, state, feats: Feats, *, train: bool):
        box_maps, box_s = box.apply(params["box"], state["box"], feats, train=train)
        cls_maps, cls_s = cls.apply(params["cls"], state["cls"], feats, train=train)
        preds = DetectPreds(flatten_levels(box_maps), flatten_levels(cls_maps))
        return preds, ({"box": box_s, "cls": cls_s} if train else state)

    def decode(preds: DetectPreds, anchors: Anchors) -> torch.Tensor:
        return decode_detect(preds, anchors, reg_max=reg_max)

    if loss_fn is None:
        loss_fn = detect_loss(num_classes=num_classes, reg_max=reg_max)

    def loss(preds, targets, assignment):
        return loss_fn(preds, targets, assignment)

    return Head(init, apply, loss, decode)
