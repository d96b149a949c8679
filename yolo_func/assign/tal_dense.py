"""The dense task-aligned assigner: today's formulation before issue 17, kept frozen.

This is the assigner as it stood before the lean selection of :mod:`yolo_func.assign.tal`: it
materialises the top-k membership, the positives before and after conflict resolution and the
masked metrics as ``[B, M, A]`` tensors (about 60 passes over ``[B, M, A]`` per call). It stays
in the package as the second implementation that the lean :func:`~yolo_func.assign.assign` is
tested against bit for bit (``tests/assign/test_tal_lean.py``) and as the baseline of
``benchmarks/assigner.py``. Do not optimise it: its value is being the readable, literal
transcription of REFERENCE.md §2.3.
"""

from __future__ import annotations

import torch

from yolo_func._types import Anchors, Assignment, Targets
# The candidates and metrics (and the empty result) are shared with the lean assigner: what the two
# formulations differ in, and what tests/assign/test_tal_lean.py compares, is the selection.
from yolo_func.assign.tal import _background, _metrics

__all__ = ["assign_dense"]


def _topk_positives(align: torch.Tensor, cand: torch.Tensor, valid: torch.Tensor, topk: int) -> torch.Tensor:
    """bool[B, M, A]: the top-k anchors of every valid target that are also its candidates
    (before conflict resolution, so each target owns at most ``topk`` anchors)."""
    k = min(topk, align.shape[-1])
    idx = torch.topk(align, k, dim=-1, largest=True).indices  # [B, M, k], torch.topk tie order (T9)
    in_topk = torch.zeros_like(align).scatter(-1, idx, 1.0) > 0
    return in_topk & cand & valid[:, :, None]


def assign_dense(
    pred_scores: torch.Tensor,
    pred_boxes: torch.Tensor,
    anchors: Anchors,
    targets: Targets,
    *,
    topk: int = 10,
    alpha: float = 0.5,
    beta: float = 6.0,
    eps: float = 1e-9,
    enlarge_to: float = 16.0,
) -> Assignment:
    """Task-aligned assignment of padded targets to anchors (no gradient), dense formulation.

    Steps (REFERENCE.md §2.3): candidates = anchors strictly inside a valid target (sides below
    ``enlarge_to`` px enlarged to it for this test only); overlap ``u`` = CIoU(target, prediction)
    clamped at 0; alignment ``t = s**alpha * u**beta`` with ``s`` the predicted probability of the
    target's class; each valid target takes its ``topk`` anchors by ``t`` over all levels, keeping
    those that are candidates; an anchor claimed by several targets goes to the target with the
    largest overlap among *all* targets (ties -> lowest slot); the class target is the one-hot
    label times ``max_j t * u_max_j / (t_max_j + eps)`` over the final positives.

    Shapes are static: with M = 0 every anchor is background. Padded rows (``valid=False``) never
    produce positives and never change the result.

    Args:
      pred_scores: float[B, A, K] class probabilities (``sigmoid`` of the logits), detached.
      pred_boxes: float[B, A, 4] predicted xyxy boxes in pixels, detached.
      anchors: ``Anchors(points float[A, 2] grid units, strides float[A, 1])``.
      targets: ``Targets(boxes float[B, M, 4] xyxy px, classes int64[B, M], valid bool[B, M])``.
      topk: anchors per target (10).
      alpha, beta: exponents of the alignment metric (0.5, 6.0).
      eps: in-box margin and soft-score guard (1e-9).
      enlarge_to: minimum side in px for the in-box test (the second stride, 16).

    Returns:
      ``Assignment(fg_mask bool[B, A], gt_idx int64[B, A] (0 for background), target_boxes
      float[B, A, 4] px (slot ``gt_idx``'s box; background rows hold slot 0's box, as the
      reference), target_scores float[B, A, K] (zero for background), anchors)``.

    Raises:
      ValueError: shapes that do not line up.

    Example:
      >>> import torch
      >>> from yolo_func import Targets
      >>> from yolo_func.assign import make_anchors
      >>> from yolo_func.assign.tal_dense import assign_dense
      >>> anchors = make_anchors([(4, 4)], (8,))                         # 16 anchors on a 32 x 32 image
      >>> targets = Targets(torch.tensor([[[0.0, 0.0, 16.0, 16.0]]]), torch.tensor([[1]]), torch.tensor([[True]]))
      >>> pred_boxes = torch.tensor([[0.0, 0.0, 16.0, 16.0]]).repeat(1, 16, 1)    # float[B, A, 4] pixels
      >>> pred_scores = torch.full((1, 16, 3), 0.5)                      # float[B, A, K] probabilities
      >>> a = assign_dense(pred_scores, pred_boxes, anchors, targets, topk=4)
      >>> int(a.fg_mask.sum()), a.fg_mask[0].nonzero().flatten().tolist()   # the 4 anchor centres inside the box
      (4, [0, 1, 4, 5])
      >>> a.target_scores[0, 0].argmax().item()
      1
    """
    B, A, K = pred_scores.shape
    if pred_boxes.shape != (B, A, 4) or anchors.points.shape[0] != A:
        raise ValueError(
            f"[yolo_func] assign_dense: expected pred_boxes float[{B}, {A}, 4] and {A} anchors, got "
            f"{tuple(pred_boxes.shape)} and {tuple(anchors.points.shape)}")
    if targets.boxes.shape[0] != B or targets.boxes.shape[-1] != 4:
        raise ValueError(f"[yolo_func] assign_dense: targets.boxes must be float[{B}, M, 4], got {tuple(targets.boxes.shape)}")
    M = targets.boxes.shape[1]
    with torch.no_grad():
        pred_scores = pred_scores.detach()
        pred_boxes = pred_boxes.detach()
        if M == 0:  # a static shape, not a tensor value: no sync
            return _background(pred_scores, targets, anchors)
        anchor_px = (anchors.points * anchors.strides).to(pred_boxes.dtype)  # [A, 2]
        cand, overlaps, align = _metrics(pred_scores, pred_boxes, anchor_px, targets, alpha=alpha, beta=beta,
                                         eps=eps, enlarge_to=enlarge_to)
        pos = _topk_positives(align, cand, targets.valid, topk)  # [B, M, A]
        # Conflicts: an anchor positive for several targets keeps the one of largest overlap over
        # all targets (argmax returns the first maximum: lowest slot on ties).
        multi = pos.sum(1, keepdim=True) > 1  # [B, 1, A]
        best = overlaps.argmax(1, keepdim=True)  # [B, 1, A]
        slots = torch.arange(M, device=pos.device)[None, :, None]
        pos = torch.where(multi, slots == best, pos)
        fg = pos.any(1)  # [B, A]
        gt_idx = pos.to(torch.uint8).argmax(1)  # the single positive slot (0 for background)

        labels = targets.classes.gather(1, gt_idx).clamp(min=0)  # [B, A]
        target_boxes = targets.boxes.to(pred_boxes.dtype).gather(1, gt_idx[..., None].expand(B, A, 4))
        # A comparison, not F.one_hot (which validates its input with a host sync on CUDA).
        one_hot = (labels[..., None] == torch.arange(K, device=labels.device)).to(pred_scores.dtype)

        zero = torch.zeros((), dtype=align.dtype, device=align.device)
        align = torch.where(pos, align, zero)
        t_max = align.amax(-1, keepdim=True)  # [B, M, 1]
        u_max = torch.where(pos, overlaps, zero).amax(-1, keepdim=True)
        norm = (align * u_max / (t_max + eps)).amax(1)  # [B, A]
        target_scores = torch.where(fg[..., None], one_hot * norm[..., None], zero)
    return Assignment(fg, gt_idx, target_boxes, target_scores, anchors)
