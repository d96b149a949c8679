"""Task-aligned assignment over padded, static-shape targets (REFERENCE.md §2.3, traps T8, T9).

TOOD's task-aligned assigner (Feng et al., "TOOD: Task-aligned One-stage Object Detection",
ICCV 2021) with the rules of ultralytics 8.4.190 ``TaskAlignedAssigner``: tiny ground truths are
enlarged to 16 px for the in-box test only, the in-box test is strict (``> 1e-9``), overlaps are
CIoU clamped at 0, top-k runs over all levels on a ``[B, M, A]`` layout, conflicts go to the
target of largest overlap among all in-box targets, and the class targets are soft.

The selection after the metrics is "lean" (issue 17): it never materialises ``[B, M, A]`` masks;
the dense transcription it replaced lives on, frozen, in :mod:`yolo_func.assign.tal_dense` as the
second implementation the tests compare against bit for bit.

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


def _select(cand: torch.Tensor, overlaps: torch.Tensor, align: torch.Tensor, topk: int):
    """The positives without ``[B, M, A]`` masks: ``(fg bool[B, A], gt_idx int64[B, A])``.

    ``cand`` (which already includes ``valid``), ``overlaps`` and ``align`` are ``[B, M, A]``;
    besides the top-k itself, the only full passes are one gather of ``cand`` at the top-k
    indices (``[B, M, k]``) and one argmax over targets. Each target's kept anchors are counted
    into ``[B, A]`` with one scatter-add that also sums their slots (so an anchor claimed once
    knows its slot); an anchor claimed more than once goes to ``overlaps.argmax`` over all targets.
    """
    B, M, A = align.shape
    k = min(topk, A)
    # torch.topk on the same [B, M, A] tensor the dense formulation sorts: the same tie order (T9).
    idx = torch.topk(align, k, dim=-1, largest=True).indices  # [B, M, k]
    keep = cand.gather(-1, idx)  # [B, M, k]: in the top-k and a candidate of a valid target
    # One int64 scatter-add carries both the claim count (bits 32+) and the sum of the claiming
    # slots (bits 0-31; a sum of distinct slots < M^2 / 2, far below 2^32). topk indices are
    # distinct within a row, so a target claims an anchor at most once.
    slots = torch.arange(M, device=idx.device, dtype=torch.int64)[None, :, None]
    code = torch.where(keep, slots + (1 << 32), 0)
    acc = torch.zeros(B, A, dtype=torch.int64, device=idx.device).scatter_add_(1, idx.reshape(B, M * k),
                                                                               code.reshape(B, M * k))
    count = acc >> 32  # [B, A]
    # Several claims: the target of largest overlap over all targets (argmax: first maximum,
    # lowest slot on ties), even one that did not claim the anchor; one claim: that slot.
    best = _first_max_index(overlaps)  # [B, A]
    gt_idx = torch.where(count > 1, best, acc & 0xFFFFFFFF)  # 0 for unclaimed anchors
    return count > 0, gt_idx


def _first_max_index(overlaps: torch.Tensor) -> torch.Tensor:
    """``overlaps.argmax(1)`` for ``[B, M, A]``: the first maximum over targets (lowest slot on
    ties; a NaN counts as the maximum). On the CPU ``max(1).indices``, which has the same
    documented tie rule and is ~5x faster there (argmax over a strided middle axis is not
    vectorised: 4.6 vs 0.8 ms at B=8, M=8, A=2100 on one core)."""
    if overlaps.device.type == "cpu":
        return overlaps.max(1).indices
    return overlaps.argmax(1)


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

    Tie rules (the same as the dense formulation, :func:`yolo_func.assign.tal_dense.assign_dense`,
    which this function equals bit for bit on finite inputs; ``tests/assign/test_tal_lean.py``):

    - **top-k ties** (equal ``t``, e.g. the zero-metric anchors that fill the top-k of a target with
      fewer than ``topk`` candidates of ``t > 0``, trap T9): whichever anchors ``torch.topk``
      returns for the ``float[B, M, A]`` metric on this device — the call and its input are the
      dense formulation's, so ties fall identically. The order is not "lowest index first" (torch
      2.13, CPU: ten of 100 zero metrics come back as anchors 69, 63, 64, ...) and differs between
      devices; the reference makes the same call on the same layout.
    - **multi-match ties** (an anchor claimed by several targets whose overlaps are equal): the
      lowest target slot (``argmax`` over the slot axis returns the first maximum).

    How (issue 17): after the ``[B, M, A]`` metrics, the selection touches ``[B, M, A]`` only in the
    top-k, one argmax over slots and three gathers of ``A`` points; the positives are kept as
    ``[B, M, k]`` top-k indices, counted per anchor with one int64 scatter-add (claim count and
    slot sum), and the soft-score maxima per target come from one scatter over ``[B, M, 2]`` — no
    ``[B, M, A]`` masks or one-hots. Every tensor keeps a static shape and nothing syncs with the
    host, so the call can be captured in a CUDA graph; ``torch.compile`` (inductor) fuses the
    metrics into one kernel (it then agrees with eager to float32 rounding, not bit for bit).

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
        fg, gt_idx = _select(cand, overlaps, align, topk)  # [B, A] each

        labels = targets.classes.gather(1, gt_idx).clamp(min=0)  # [B, A]
        target_boxes = targets.boxes.to(pred_boxes.dtype).gather(1, gt_idx[..., None].expand(B, A, 4))

        # Soft scores. A positive anchor has exactly one target g = gt_idx, so the dense
        # max_j (t * u_max / (t_max + eps)) over masked [B, M, A] metrics is that one term: read t
        # and u at (g, a), reduce the per-target maxima with one scatter (max is exact in any
        # order) and read them back at g. Background anchors carry 0 into slot 0, a no-op.
        zero = torch.zeros((), dtype=align.dtype, device=align.device)
        g = gt_idx[:, None, :]  # [B, 1, A]
        tu = torch.where(fg[..., None], torch.stack((align.gather(1, g)[:, 0], overlaps.gather(1, g)[:, 0]), -1),
                         zero)  # [B, A, 2]: (t, u) at the assigned target
        g2 = gt_idx[..., None].expand(B, A, 2)
        tu_max = torch.zeros(B, M, 2, dtype=tu.dtype, device=tu.device).scatter_reduce(1, g2, tu, "amax")
        tu_max = tu_max.gather(1, g2)  # [B, A, 2]: (t_max, u_max) of the assigned target
        norm = tu[..., 0] * tu_max[..., 1] / (tu_max[..., 0] + eps)  # [B, A], 0 for background
        # norm at each anchor's class, +0 elsewhere: one scatter into zeros (not F.one_hot, which
        # validates its input with a host sync on CUDA; and not a [B, A, K] comparison + where,
        # two full passes for the same values).
        target_scores = torch.zeros(B, A, K, dtype=norm.dtype, device=norm.device).scatter_(
            2, labels[..., None], norm[..., None])
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
