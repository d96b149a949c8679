"""The YOLOv8 pose head: a per-level keypoint branch (REFERENCE.md §1.8).

It owns only the reference's ``cv4``; boxes and classes come from the detect head beside it.
Tree keys: ``kpt/{p3,p4,p5}/{conv1,conv2,pred}``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from yolo_func._types import Anchors, Feats, PosePreds
from yolo_func.heads.base import Head, flatten_levels, multi_level
from yolo_func.losses.heads import pose_loss

__all__ = ["pose_head", "decode_keypoints"]


def decode_keypoints(raw: torch.Tensor, anchors: Anchors, kpt_shape: tuple[int, int]) -> torch.Tensor:
    """Inference decode of raw keypoints to pixels.

    Args:
      raw: float[B, A, P*D] raw channels, keypoint-major (x, y[, visibility logit]).
      anchors: grid-unit points float[A, 2], strides float[A, 1].
      kpt_shape: (P, D) with D in {2, 3}.

    Returns:
      float[B, P*D, A]: ``x = (2 raw_x + ax - 0.5) * s``, same for y, ``v = sigmoid(raw_v)``.

    Example:
      >>> import torch
      >>> from yolo_func.assign import make_anchors
      >>> from yolo_func.heads import decode_keypoints
      >>> anchors = make_anchors([(8, 8), (4, 4), (2, 2)], (8, 16, 32))
      >>> k = decode_keypoints(torch.zeros(1, 84, 15), anchors, (5, 3))
      >>> tuple(k.shape), k[0, :3, 0].tolist()    # x = (0 + 0.5 - 0.5) * 8, y likewise, v = sigmoid(0)
      ((1, 15, 84), [0.0, 0.0, 0.5])
    """
    P, D = kpt_shape
    B, A, _ = raw.shape
    k = raw.reshape(B, A, P, D)
    xy = (k[..., :2] * 2.0 + (anchors.points[:, None, :] - 0.5)) * anchors.strides[:, None, :]
    out = torch.cat((xy, k[..., 2:].sigmoid()), -1) if D == 3 else xy
    return out.reshape(B, A, P * D).transpose(1, 2)


def pose_head(*, channels: Sequence[int], kpt_shape: tuple[int, int] = (17, 3), loss_fn=None) -> Head:
    """Build the pose head.

    Args:
      channels: input channels of (P3, P4, P5).
      kpt_shape: (P keypoints, D) with D = 2 (x, y) or 3 (x, y, visibility).
      loss_fn: the keypoint loss ``(preds, targets, assignment) -> (scalar, parts)``; default
        :func:`yolo_func.losses.pose_loss` with this ``kpt_shape`` (gains pose 12.0, kobj 1.0).

    Returns:
      ``Head`` whose apply maps ``Feats`` to ``PosePreds(keypoints float[B, A, P*D])``.

    Example:
      >>> import torch
      >>> from yolo_func import pose_head
      >>> head = pose_head(channels=(64, 128, 256), kpt_shape=(5, 3))
      >>> params, state = head.init(torch.Generator().manual_seed(0))
      >>> feats = (torch.rand(1, 64, 8, 8), torch.rand(1, 128, 4, 4), torch.rand(1, 256, 2, 2))
      >>> preds, _ = head.apply(params, state, feats, train=True)
      >>> tuple(preds.keypoints.shape)
      (1, 84, 15)
    """
    if len(kpt_shape) != 2 or kpt_shape[0] < 1 or kpt_shape[1] not in (2, 3):
        raise ValueError(f"[yolo_func] pose_head: kpt_shape must be (P >= 1, 2 or 3), got {tuple(kpt_shape)}")
    kpt_shape = (int(kpt_shape[0]), int(kpt_shape[1]))
    nk = kpt_shape[0] * kpt_shape[1]
    c4 = max(channels[0] // 4, nk)
    kpt = multi_level(channels, c4, nk)

    def init(gen: torch.Generator):
        p, s = kpt.init(gen)
        return {"kpt": p}, {"kpt": s}

    def apply(params, state, feats: Feats, *, train: bool):
        maps, s = kpt.apply(params["kpt"], state["kpt"], feats, train=train)
        return PosePreds(flatten_levels(maps)), ({"kpt": s} if train else state)

    def decode(preds: PosePreds, anchors: Anchors) -> torch.Tensor:
        return decode_keypoints(preds.keypoints, anchors, kpt_shape)

    if loss_fn is None:
        loss_fn = pose_loss(kpt_shape=kpt_shape)

    def loss(preds, targets, assignment):
        return loss_fn(preds, targets, assignment)

    return Head(init, apply, loss, decode)
