"""Task-aligned assignment over padded, static-shape targets (REFERENCE.md §2.3, traps T8, T9).

TOOD's task-aligned assigner (Feng et al., "TOOD: Task-aligned One-stage Object Detection",
ICCV 2021) with the rules of ultralytics 8.4.190 ``TaskAlignedAssigner``: tiny ground truths are
enlarged to 16 px for the in-box test only, the in-box test is strict (``> 1e-9``), overlaps are
CIoU clamped at 0, top-k runs over all levels on a ``[B, M, A]`` layout, conflicts go to the
target of largest overlap among all in-box targets, and the class targets are soft.

Everything is batched over images and targets: no host synchronisation, no data-dependent
shapes, no Python loops over images or boxes. Padding rows (``valid=False``) are inert.
"""

from __future__ import annotations

import torch

from yolo_func._types import Anchors, Assignment, DetectPreds, Targets
from yolo_func.structures.boxes import dfl_expectation, dist2bbox
from yolo_func.structures.ciou import ciou

__all__ = ["assign", "assign_from_detect"]


def _in_box(anchor_px: torch.Tensor, gt_boxes: torch.Tensor, valid: torch.Tensor, enlarge_to: float,
            eps: float) -> torch.Tensor:
    """bool[B, M, A]: anchor centre strictly inside the (tiny-gt enlarged) target box."""
    xy1, xy2 = gt_boxes[..., :2], gt_boxes[..., 2:]  # [B, M, 2]: x and y handled together
    c = (xy1 + xy2) / 2
    wh = xy2 - xy1
    # Width and height below the second stride are enlarged independently, keeping the centre,
    # and only for this test (8.4.190; the v8-era releases had no enlargement).
    wh = torch.where(valid[..., None] & (wh < enlarge_to), enlarge_to, wh)
    half = wh / 2
    lt, rb = (c - half)[:, :, None, :], (c + half)[:, :, None, :]  # [B, M, 1, 2]
    # min over the four margins (left, top, right, bottom), as pairs then over x/y
    margin = torch.minimum(anchor_px - lt, rb - anchor_px).amin(-1)  # [B, M, A]
    return (margin > eps) & valid[:, :, None]


def _metrics(pred_scores, pred_boxes, anchor_px, targets, *, alpha, beta, eps, enlarge_to):
    """(candidates bool[B,M,A], overlaps float[B,M,A], align float[B,M,A])."""
    B, A, _ = pred_scores.shape
    M = targets.boxes.shape[1]
    gt_boxes = targets.boxes.to(pred_boxes.dtype)
    cand = _in_box(anchor_px, gt_boxes, targets.valid, enlarge_to, eps)
    # s[b, j, a] = predicted probability of target j's class at anchor a.
    cls_idx = targets.classes.clamp(min=0)[:, :, None].expand(B, M, A)
    s = pred_scores.transpose(1, 2).gather(1, cls_idx)
    u = ciou(gt_boxes[:, :, None, :], pred_boxes[:, None, :, :]).clamp(min=0)  # no grad: the fused forward
    zero = torch.zeros((), dtype=u.dtype, device=u.device)
    overlaps = torch.where(cand, u, zero)
    align = torch.where(cand, s.pow(alpha) * overlaps.pow(beta), zero)
    return cand, overlaps, align


def _topk_positives(align: torch.Tensor, cand: torch.Tensor, valid: torch.Tensor, topk: int) -> torch.Tensor:
    """bool[B, M, A]: the top-k anchors of every valid target that are also its candidates
    (before conflict resolution, so each target owns at most ``topk`` anchors)."""
    k = min(topk, align.shape[-1])
    idx = torch.topk(align, k, dim=-1, largest=True).indices  # [B, M, k], torch.topk tie order (T9)
    in_topk = torch.zeros_like(align).scatter(-1, idx, 1.0) > 0
    return in_topk & cand & valid[:, :, None]


def _background(pred_scores: torch.Tensor, targets: Targets, anchors: Anchors) -> Assignment:
    B, A, K = pred_scores.shape
    dev = pred_scores.device
    return Assignment(
        torch.zeros(B, A, dtype=torch.bool, device=dev),
        torch.zeros(B, A, dtype=torch.int64, device=dev),
        torch.zeros(B, A, 4, dtype=pred_scores.dtype, device=dev),
        torch.zeros(B, A, K, dtype=pred_scores.dtype, device=dev),
        anchors,
    )


def assign(
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
    """Task-aligned assignment of padded targets to anchors (no gradient).

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
      >>> from yolo_func.assign import assign, make_anchors
      >>> anchors = make_anchors([(4, 4)], (8,))                         # 16 anchors on a 32 x 32 image
      >>> targets = Targets(torch.tensor([[[0.0, 0.0, 16.0, 16.0]]]), torch.tensor([[1]]), torch.tensor([[True]]))
      >>> pred_boxes = torch.tensor([[0.0, 0.0, 16.0, 16.0]]).repeat(1, 16, 1)    # float[B, A, 4] pixels
      >>> pred_scores = torch.full((1, 16, 3), 0.5)                      # float[B, A, K] probabilities
      >>> a = assign(pred_scores, pred_boxes, anchors, targets, topk=4)
      >>> int(a.fg_mask.sum()), a.fg_mask[0].nonzero().flatten().tolist()   # the 4 anchor centres inside the box
      (4, [0, 1, 4, 5])
      >>> a.target_scores[0, 0].argmax().item()
      1
    """
    B, A, K = pred_scores.shape
    if pred_boxes.shape != (B, A, 4) or anchors.points.shape[0] != A:
        raise ValueError(
            f"[yolo_func] assign: expected pred_boxes float[{B}, {A}, 4] and {A} anchors, got "
            f"{tuple(pred_boxes.shape)} and {tuple(anchors.points.shape)}")
    if targets.boxes.shape[0] != B or targets.boxes.shape[-1] != 4:
        raise ValueError(f"[yolo_func] assign: targets.boxes must be float[{B}, M, 4], got {tuple(targets.boxes.shape)}")
    M = targets.boxes.shape[1]
    with torch.no_grad():
        # no detach op for inputs that carry no gradient already (assign_from_detect's)
        pred_scores = pred_scores.detach() if pred_scores.requires_grad else pred_scores
        pred_boxes = pred_boxes.detach() if pred_boxes.requires_grad else pred_boxes
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


def assign_from_detect(
    preds: DetectPreds, targets: Targets, anchors: Anchors, *, reg_max: int = 16, **assigner_kw
) -> Assignment:
    """Decode the detect predictions (detached, in float32) and run :func:`assign`.

    Scores are ``sigmoid(cls_logits)``; boxes are the DFL expectation around the grid-unit anchor
    points, times the stride (pixels), as the reference feeds its assigner (REFERENCE.md §2.2).
    The float32 cast, with autocast disabled for the DFL matmul, keeps the assignment exact under
    BF16 / FP16 autocast (trap T20).

    Args:
      preds: ``DetectPreds(box_dist float[B, A, 4R], cls_logits float[B, A, K])``.
      targets: padded :class:`Targets`.
      anchors: ``Anchors(points float[A, 2], strides float[A, 1])``.
      reg_max: R (16).
      **assigner_kw: forwarded to :func:`assign` (``topk``, ``alpha``, ``beta``, ``eps``, ``enlarge_to``).

    Returns:
      :class:`Assignment`.

    Example:
      >>> import torch
      >>> from yolo_func import DetectPreds, Targets
      >>> from yolo_func.assign import assign_from_detect, make_anchors
      >>> anchors = make_anchors([(4, 4)], (8,))
      >>> preds = DetectPreds(torch.zeros(1, 16, 64), torch.zeros(1, 16, 3))      # raw head outputs
      >>> targets = Targets(torch.tensor([[[0.0, 0.0, 16.0, 16.0]]]), torch.tensor([[1]]), torch.tensor([[True]]))
      >>> a = assign_from_detect(preds, targets, anchors, topk=4)
      >>> a.fg_mask.shape, a.target_scores.shape
      (torch.Size([1, 16]), torch.Size([1, 16, 3]))
    """
    with torch.no_grad(), torch.autocast(preds.box_dist.device.type, enabled=False):
        box_dist, logits = preds.box_dist, preds.cls_logits
        box_dist = box_dist.detach() if box_dist.requires_grad else box_dist  # vjp outputs carry none
        logits = logits.detach() if logits.requires_grad else logits
        dist = dfl_expectation(box_dist.float(), reg_max)
        boxes = dist2bbox(dist, anchors.points.float()) * anchors.strides.float()
        scores = logits.float().sigmoid()
        anchors32 = Anchors(anchors.points.float(), anchors.strides.float())
        return assign(scores, boxes, anchors32, targets, **assigner_kw)
