"""Shared type aliases and fixed-schema records (NamedTuples are built-in optree nodes).

Shape letters (see docs/conventions.md): B batch, C channels, H/W height/width, A anchors,
M padded targets per image, K classes, R reg_max bins, P keypoints, NM mask coefficients.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from yolo_func.structures.records import Batch, Targets  # re-exported: they live in structures/

Tensor = torch.Tensor
#: Nested ``dict[str, ...]`` of tensors that receive gradients.
Params = dict[str, Any]
#: Nested ``dict[str, ...]`` of BatchNorm running statistics (``running_mean``, ``running_var``).
State = dict[str, Any]
#: Same structure as :data:`Params`.
Grads = dict[str, Any]


class Feats(NamedTuple):
    """Neck outputs fed to every head.

    Attributes:
      p3: float[B, C3, H/8, W/8]
      p4: float[B, C4, H/16, W/16]
      p5: float[B, C5, H/32, W/32]

    Example:
      >>> import torch
      >>> from yolo_func import Feats, yolov8
      >>> model = yolov8("n", task="detect", num_classes=5)
      >>> params, state = model.init(torch.Generator().manual_seed(0))
      >>> feats, _ = model.features(params["network"], state["network"], torch.rand(1, 3, 64, 64), train=False)
      >>> [tuple(f.shape) for f in feats]          # p3, p4, p5 at strides 8, 16, 32
      [(1, 64, 8, 8), (1, 128, 4, 4), (1, 256, 2, 2)]
    """

    p3: Tensor
    p4: Tensor
    p5: Tensor


class Anchors(NamedTuple):
    """Anchor points over all levels, level-major then row-major (REFERENCE.md §1.5).

    Attributes:
      points: float[A, 2] cell centres ``(x + 0.5, y + 0.5)`` in grid units of their level.
      strides: float[A, 1] the stride of each anchor's level in pixels.

    Example:
      >>> import torch
      >>> from yolo_func.assign import make_anchors
      >>> a = make_anchors([(8, 8), (4, 4), (2, 2)], (8, 16, 32))     # a 64 x 64 input
      >>> a.points.shape, a.strides.shape, a.points[0].tolist(), a.strides[-1].item()
      (torch.Size([84, 2]), torch.Size([84, 1]), [0.5, 0.5], 32.0)
    """

    points: Tensor
    strides: Tensor


class DetectPreds(NamedTuple):
    """Training-mode outputs of the detect head.

    Attributes:
      box_dist: float[B, A, 4*R] raw DFL logits, side-major (left, top, right, bottom) x R bins.
      cls_logits: float[B, A, K] raw class logits (no sigmoid).

    Example:
      >>> import torch
      >>> from yolo_func import yolov8
      >>> model = yolov8("n", task="detect", num_classes=5)
      >>> params, state = model.init(torch.Generator().manual_seed(0))
      >>> preds, _ = model.apply(params, state, torch.rand(2, 3, 64, 64), train=True)
      >>> d = preds["detect"]                       # DetectPreds
      >>> tuple(d.box_dist.shape), tuple(d.cls_logits.shape)    # (B, A, 4 * R), (B, A, K)
      ((2, 84, 64), (2, 84, 5))
    """

    box_dist: Tensor
    cls_logits: Tensor


class SegmentPreds(NamedTuple):
    """Training-mode outputs of the segment head.

    Attributes:
      coeffs: float[B, A, NM] raw mask coefficients.
      protos: float[B, NM, H/4, W/4] mask prototypes (post-SiLU).

    Example:
      >>> import torch
      >>> from yolo_func import yolov8
      >>> model = yolov8("n", task="segment", num_classes=5)
      >>> params, state = model.init(torch.Generator().manual_seed(0))
      >>> preds, _ = model.apply(params, state, torch.rand(2, 3, 64, 64), train=True)
      >>> tuple(preds["segment"].coeffs.shape), tuple(preds["segment"].protos.shape)   # (B, A, NM), (B, NM, H/4, W/4)
      ((2, 84, 32), (2, 32, 16, 16))
    """

    coeffs: Tensor
    protos: Tensor


class PosePreds(NamedTuple):
    """Training-mode outputs of the pose head.

    Attributes:
      keypoints: float[B, A, P*D] raw keypoint channels, keypoint-major (x, y[, visibility logit]).

    Example:
      >>> import torch
      >>> from yolo_func import yolov8
      >>> model = yolov8("n", task="pose", num_classes=1, kpt_shape=(17, 3))
      >>> params, state = model.init(torch.Generator().manual_seed(0))
      >>> preds, _ = model.apply(params, state, torch.rand(2, 3, 64, 64), train=True)
      >>> tuple(preds["pose"].keypoints.shape)      # (B, A, P * D)
      (2, 84, 51)
    """

    keypoints: Tensor


class Assignment(NamedTuple):
    """Task-aligned assignment of targets to anchors (computed once, without gradient).

    Attributes:
      fg_mask: bool[B, A] anchors positive for exactly one target.
      gt_idx: int64[B, A] the target slot of each positive anchor (0 for background).
      target_boxes: float[B, A, 4] xyxy pixels of the assigned target.
      target_scores: float[B, A, K] soft one-hot class targets (zero for background).
      anchors: the :class:`Anchors` the assignment was computed on.

    Example:
      >>> import torch
      >>> from yolo_func import yolov8
      >>> from yolo_func.assign import assign_from_detect
      >>> from yolo_func.testing.synthetic import synthetic_batch
      >>> model = yolov8("n", task="detect", num_classes=5)
      >>> params, state = model.init(torch.Generator().manual_seed(0))
      >>> batch = synthetic_batch("detect", 2, 64, num_classes=5, max_boxes=4)
      >>> feats, _ = model.features(params["network"], state["network"], batch.images.float() / 255, train=True)
      >>> preds, _ = model.heads["detect"].apply(params["heads"]["detect"], state["heads"]["detect"], feats, train=True)
      >>> a = assign_from_detect(preds, batch.targets, model.anchors(feats))
      >>> a.fg_mask.dtype, tuple(a.gt_idx.shape), tuple(a.target_boxes.shape), tuple(a.target_scores.shape)
      (torch.bool, (2, 84), (2, 84, 4), (2, 84, 5))
    """

    fg_mask: Tensor
    gt_idx: Tensor
    target_boxes: Tensor
    target_scores: Tensor
    anchors: Anchors
