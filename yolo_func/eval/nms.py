"""Greedy non-maximum suppression, batched over images, in plain torch (REFERENCE.md §3.2).

Semantics (torchvision's ``nms``): candidates are visited in descending score order; a candidate
is kept unless a *kept* higher-ranked candidate overlaps it with IoU > ``iou`` (strictly greater),
IoU = inter / (area1 + area2 - inter) with no epsilon; the first ``max_det`` kept candidates are
the output, in that order.

Tie rule: candidates with equal scores are ranked by their index (lower index first), i.e. a
*stable* sort by score, descending. The callers here pass candidates already in that order.

Algorithm (no per-box Python loop, no host sync in the static form). Candidates are processed in
blocks of ``block`` ranks:

1. the block is first suppressed by the boxes already kept. At most ``max_det`` kept boxes matter
   (a later kept box would be past ``max_det`` anyway), so this is a ``[B, max_det, block]`` IoU;
2. inside the block the greedy rule is a fixed point: ``keep[i] = alive[i] and not any(keep[j]
   and S[j, i] for j < i)`` with ``S[j, i] = IoU(j, i) > iou``. Starting from ``keep = alive`` and
   iterating reaches the greedy answer exactly; after ``t`` iterations every candidate whose chain
   of suppression dependencies is shorter than ``t`` is settled, so ``block`` iterations always
   suffice and real detections settle in a handful;
3. the newly kept boxes are appended to the kept buffer (a static-shape scatter).

Work is ``O(N * (max_det + block) * t)`` per image for N candidates and t fixed-point iterations,
in ``ceil(N / block) * t`` sequential device steps. The eager form iterates each block to its
fixed point (one host check per iteration) and stops once every image has ``max_det`` boxes; the
static form runs a fixed number of iterations per block and reports, per image, whether every
block had settled (``converged``); it is exact whenever ``converged`` is true.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["NmsResult", "pairwise_iou", "nms_sorted", "CLASS_OFFSET"]

#: The reference's class-aware trick: every box is shifted by ``class * CLASS_OFFSET`` on all four
#: coordinates, so boxes of different classes never overlap (``max_wh`` in the reference).
CLASS_OFFSET = 7680.0


class NmsResult(NamedTuple):
    """Kept candidates per image, padded to ``max_det``.

    Attributes:
      index: int64[B, max_det], candidate ranks of the kept boxes in output order (0 where padded).
      valid: bool[B, max_det], True for real rows (a prefix of each row).
      count: int64[B], number of kept boxes (``valid.sum(1)``).
      converged: bool[B], True where every block reached its fixed point (always True in the eager
        form); where False the result may keep a box that greedy NMS would drop.
    """

    index: torch.Tensor
    valid: torch.Tensor
    count: torch.Tensor
    converged: torch.Tensor


def pairwise_iou(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """IoU of every pair, torchvision's formula (no epsilon).

    Args:
      a: float[..., N, 4] xyxy.
      b: float[..., M, 4] xyxy.

    Returns:
      float[..., N, M]: ``inter / (area_a + area_b - inter)`` (NaN only for two empty boxes).
    """
    area_a = (a[..., 2] - a[..., 0]) * (a[..., 3] - a[..., 1])
    area_b = (b[..., 2] - b[..., 0]) * (b[..., 3] - b[..., 1])
    # x and y separately on contiguous [..., N, M] planes (the same operations, value for value, as
    # max / min of the stacked corners, without the strided [..., 2] intermediates)
    ax1, ay1, ax2, ay2 = (a[..., i, None] for i in range(4))
    bx1, by1, bx2, by2 = (b[..., None, :, i] for i in range(4))
    w = (torch.minimum(ax2, bx2) - torch.maximum(ax1, bx1)).clamp_(min=0)
    h = (torch.minimum(ay2, by2) - torch.maximum(ay1, by1)).clamp_(min=0)
    inter = w * h
    return inter / (area_a[..., :, None] + area_b[..., None, :] - inter)


def _settle_block(alive: torch.Tensor, sup: torch.Tensor, iters: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy keep inside one block: fixed point of ``keep = alive & ~any_j(keep[j] & sup[j, i])``.

    Args:
      alive: bool[B, T] candidates not suppressed by earlier blocks.
      sup: bool[B, T, T], ``sup[b, j, i]`` True iff j < i and IoU(j, i) > threshold.
      iters: None = iterate to the fixed point (host check per iteration); else this many.

    Returns:
      ``(keep bool[B, T], settled bool[B])``.
    """
    keep = alive
    if iters is None:
        for _ in range(alive.shape[1] + 1):
            new = alive & ~(sup & keep[:, :, None]).any(1)
            if torch.equal(new, keep):
                break
            keep = new
        return keep, torch.ones(alive.shape[0], dtype=torch.bool, device=alive.device)
    for _ in range(iters):
        keep = alive & ~(sup & keep[:, :, None]).any(1)
    settled = (keep == (alive & ~(sup & keep[:, :, None]).any(1))).all(1)
    return keep, settled


def _eager_block(bb, vv, kept_boxes, kept_valid, count, *, iou: float, max_det: int) -> torch.Tensor | None:
    """The eager form's keep mask bool[B, T] of one block, computed only for the images that can
    still keep a box (a valid candidate in the block and fewer than ``max_det`` kept), on the
    block's rows up to the last valid one among them, against their kept boxes so far: the other
    images keep nothing here either way, so the result is the full computation's. None when no
    image can keep anything in this block."""
    B, T = vv.shape
    active = (vv.any(1) & (count < max_det)).nonzero().squeeze(1)
    if active.numel() == 0:
        return None
    v = vv[active]
    # rows past the last valid one of every active image can neither be kept nor suppress
    t = int((v * torch.arange(1, T + 1, device=v.device)).max())
    b, v = bb[active, :t], v[:, :t]
    k = max(1, min(max_det, int(count[active].max())))
    by_kept = ((pairwise_iou(kept_boxes[active, :k], b) > iou) & kept_valid[active, :k, None]).any(1)
    alive = v & ~by_kept
    upper = torch.ones(t, t, dtype=torch.bool, device=bb.device).triu(1)
    sup = (pairwise_iou(b, b) > iou) & upper
    keep_active, _ = _settle_block(alive, sup, None)
    keep = torch.zeros(B, T, dtype=torch.bool, device=bb.device)
    keep[active, :t] = keep_active
    return keep


def nms_sorted(
    boxes: torch.Tensor,
    valid: torch.Tensor,
    *,
    iou: float,
    max_det: int,
    block: int = 256,
    iters: int | None = None,
) -> NmsResult:
    """Greedy NMS over candidates already ranked by score (descending, ties by index).

    Args:
      boxes: float[B, N, 4] xyxy, class offsets already applied for class-aware NMS.
      valid: bool[B, N]; invalid candidates are neither kept nor suppress anything.
      iou: suppress when IoU > iou.
      max_det: keep at most this many per image.
      block: candidates settled together (memory ``B * block^2`` booleans).
      iters: None = eager (each block iterated to its fixed point, early stop when every image is
        full; host syncs); an int = static (this many iterations per block, no host sync, capturable
        in a CUDA graph).

    Returns:
      :class:`NmsResult`.

    Raises:
      ValueError: mismatched shapes or a non-positive ``max_det`` / ``block``.
    """
    if boxes.dim() != 3 or boxes.shape[-1] != 4 or valid.shape != boxes.shape[:2]:
        raise ValueError(
            f"[yolo_func] nms_sorted: expected boxes float[B, N, 4] and valid bool[B, N], got "
            f"{tuple(boxes.shape)} and {tuple(valid.shape)}"
        )
    if max_det < 1 or block < 1:
        raise ValueError(f"[yolo_func] nms_sorted: max_det and block must be >= 1, got {max_det} and {block}")
    B, N, _ = boxes.shape
    dev = boxes.device
    # Slot max_det is a sink for kept boxes past max_det (static-shape scatter target).
    kept_boxes = boxes.new_zeros(B, max_det + 1, 4)
    kept_valid = torch.zeros(B, max_det + 1, dtype=torch.bool, device=dev)
    kept_index = torch.zeros(B, max_det + 1, dtype=torch.int64, device=dev)
    count = torch.zeros(B, dtype=torch.int64, device=dev)
    converged = torch.ones(B, dtype=torch.bool, device=dev)
    # Eager: blocks up to the last valid candidate of any image only (one host read).
    n_blocks = N if iters is not None else int((valid * torch.arange(1, N + 1, device=dev)).max()) if N else 0
    for start in range(0, n_blocks, block):
        bb, vv = boxes[:, start : start + block], valid[:, start : start + block]
        if iters is None:
            keep = _eager_block(bb, vv, kept_boxes, kept_valid, count, iou=iou, max_det=max_det)
            if keep is None:  # no image can keep a box in this block
                continue
        else:
            T = bb.shape[1]
            by_kept = ((pairwise_iou(kept_boxes[:, :max_det], bb) > iou) & kept_valid[:, :max_det, None]).any(1)
            alive = vv & ~by_kept
            upper = torch.ones(T, T, dtype=torch.bool, device=dev).triu(1)
            sup = (pairwise_iou(bb, bb) > iou) & upper
            keep, settled = _settle_block(alive, sup, iters)
            converged = converged & settled
        T = bb.shape[1]
        pos = count[:, None] + keep.long().cumsum(1) - 1
        pos = torch.where(keep & (pos < max_det), pos, torch.full_like(pos, max_det))
        kept_boxes = kept_boxes.scatter(1, pos[..., None].expand(B, T, 4), bb)
        kept_valid = kept_valid.scatter(1, pos, keep)
        ranks = torch.arange(start, start + T, device=dev).expand(B, T)
        kept_index = kept_index.scatter(1, pos, ranks)
        count = count + keep.sum(1)
        if iters is None and bool((count >= max_det).all()):
            break
    count = count.clamp(max=max_det)
    slots = torch.arange(max_det, device=dev)
    out_valid = slots[None] < count[:, None]
    index = torch.where(out_valid, kept_index[:, :max_det], torch.zeros_like(kept_index[:, :max_det]))
    return NmsResult(index, out_valid, count, converged)
