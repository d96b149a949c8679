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
    """

    p3: Tensor
    p4: Tensor
    p5: Tensor


class Anchors(NamedTuple):
    """Anchor points over all levels, level-major then row-major (REFERENCE.md §1.5).

    Attributes:
      points: float[A, 2] cell centres ``(x + 0.5, y + 0.5)`` in grid units of their level.
      strides: float[A, 1] the stride of each anchor's level in pixels.
    """

    points: Tensor
    strides: Tensor


class DetectPreds(NamedTuple):
    """Training-mode outputs of the detect head.

    Attributes:
      box_dist: float[B, A, 4*R] raw DFL logits, side-major (left, top, right, bottom) x R bins.
      cls_logits: float[B, A, K] raw class logits (no sigmoid).
    """

    box_dist: Tensor
    cls_logits: Tensor


class SegmentPreds(NamedTuple):
    """Training-mode outputs of the segment head.

    Attributes:
      coeffs: float[B, A, NM] raw mask coefficients.
      protos: float[B, NM, H/4, W/4] mask prototypes (post-SiLU).
    """

    coeffs: Tensor
    protos: Tensor


class PosePreds(NamedTuple):
    """Training-mode outputs of the pose head.

    Attributes:
      keypoints: float[B, A, P*D] raw keypoint channels, keypoint-major (x, y[, visibility logit]).
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
    """

    fg_mask: Tensor
    gt_idx: Tensor
    target_boxes: Tensor
    target_scores: Tensor
    anchors: Anchors
