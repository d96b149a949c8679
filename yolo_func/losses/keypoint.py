"""Keypoint terms: OKS-style location loss and keypoint-objectness BCE (REFERENCE.md §2.7, trap T14)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["COCO_SIGMAS", "keypoint_sigmas", "keypoint_losses"]

#: COCO keypoint OKS sigmas (nose, eyes, ears, shoulders, elbows, wrists, hips, knees, ankles).
COCO_SIGMAS = (0.26, 0.25, 0.25, 0.35, 0.35, 0.79, 0.79, 0.72, 0.72, 0.62, 0.62, 1.07, 1.07, 0.87, 0.87, 0.89, 0.89)


def keypoint_sigmas(kpt_shape: tuple[int, int]) -> torch.Tensor:
    """float[P]: COCO sigmas / 10 for ``kpt_shape == (17, 3)`` (the reference's rule), else ``1 / P``.

    Example:
      >>> from yolo_func.losses import keypoint_sigmas
      >>> keypoint_sigmas((17, 3)).shape, keypoint_sigmas((4, 3)).tolist()
      (torch.Size([17]), [0.25, 0.25, 0.25, 0.25])
    """
    P = int(kpt_shape[0])
    if tuple(kpt_shape) == (17, 3):
        return torch.tensor(COCO_SIGMAS, dtype=torch.float32) / 10
    return torch.full((P,), 1.0 / P)


def keypoint_losses(
    pred_kpts: torch.Tensor,
    gt_kpts: torch.Tensor,
    target_boxes: torch.Tensor,
    fg_mask: torch.Tensor,
    anchor_points: torch.Tensor,
    strides: torch.Tensor,
    sigmas: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """OKS-style keypoint loss and keypoint-objectness loss over the positive anchors.

    Per positive anchor (stride s) and keypoint k, in grid units: predicted
    ``x = 2 raw_x + ax - 0.5`` (same for y); target ``x / s``; ``area = w * h`` of the target box
    / s; ``e = d / ((2 sigma_k)^2 (area + 1e-9) 2)``; ``factor = P / (n_visible + 1e-9)``;
    ``L_pose = mean over (positives x P) of factor (1 - exp(-e)) visible``;
    ``L_kobj = mean over (positives x P) of BCEWithLogits(raw_v, visible)`` (0 when D = 2).
    Visible means visibility != 0 (v = 1 and v = 2 count); 2-column targets are all visible.

    Args:
      pred_kpts: float[B, A, P, D] raw keypoint channels (D = 2 or 3).
      gt_kpts: float[B, A, P, 2|3] assigned target keypoints in pixels (x, y[, v]).
      target_boxes: float[B, A, 4] assigned boxes, xyxy pixels.
      fg_mask: bool[B, A].
      anchor_points: float[A, 2] grid units; strides: float[A, 1].
      sigmas: float[P].

    Returns:
      ``(L_pose float[], L_kobj float[])``, both 0 without positives.

    Example:
      >>> import torch
      >>> from yolo_func.losses import keypoint_losses
      >>> B, A, P = 1, 2, 2
      >>> pred = torch.zeros(B, A, P, 3)                     # raw (x, y, v) channels
      >>> pred[..., :2] = 0.25                               # x = 2 * 0.25 + 0.5 - 0.5 = 0.5 grid units = 4 px
      >>> gt = torch.tensor([[[[4.0, 4.0, 2.0], [4.0, 4.0, 2.0]]] * A])  # at the first anchor's centre, stride 8
      >>> boxes = torch.tensor([[[0.0, 0.0, 8.0, 8.0]] * A])
      >>> fg = torch.tensor([[True, False]])
      >>> l_pose, l_kobj = keypoint_losses(pred, gt, boxes, fg, torch.tensor([[0.5, 0.5], [1.5, 0.5]]),
      ...                                  torch.full((A, 1), 8.0), torch.full((P,), 0.5))
      >>> round(l_pose.item(), 6), round(l_kobj.item(), 4)  # exact keypoints: no pose loss; BCE(0, 1) = log 2
      (0.0, 0.6931)
    """
    B, A, P, D = pred_kpts.shape
    s = strides.to(pred_kpts.dtype)
    pred_xy = pred_kpts[..., :2] * 2.0 + (anchor_points[:, None, :].to(pred_kpts.dtype) - 0.5)
    gt_xy = gt_kpts[..., :2] / s[:, None, :]
    if gt_kpts.shape[-1] == 3:
        vis = gt_kpts[..., 2] != 0
    else:
        vis = torch.ones(gt_kpts.shape[:-1], dtype=torch.bool, device=gt_kpts.device)
    boxes = target_boxes / s
    area = (boxes[..., 2] - boxes[..., 0]) * (boxes[..., 3] - boxes[..., 1])  # [B, A] grid units^2
    area = torch.where(fg_mask, area, torch.ones_like(area))  # background: a safe denominator
    d = (pred_xy - gt_xy).pow(2).sum(-1)  # [B, A, P]
    sig = sigmas.to(device=pred_kpts.device, dtype=pred_kpts.dtype)
    e = d / ((2 * sig).pow(2) * (area[..., None] + 1e-9) * 2)
    visf = vis.to(pred_kpts.dtype)
    factor = P / (visf.sum(-1, keepdim=True) + 1e-9)
    fg = fg_mask[..., None]
    zero = torch.zeros((), dtype=pred_kpts.dtype, device=pred_kpts.device)
    denom = (fg_mask.sum() * P).clamp(min=1).to(pred_kpts.dtype)
    l_pose = torch.where(fg, factor * (1 - torch.exp(-e)) * visf, zero).sum() / denom
    if D == 3:
        bce = F.binary_cross_entropy_with_logits(pred_kpts[..., 2], visf, reduction="none")
        l_kobj = torch.where(fg, bce, zero).sum() / denom
    else:
        l_kobj = zero * pred_kpts.sum()  # keeps the graph connected, value 0
    return l_pose, l_kobj
