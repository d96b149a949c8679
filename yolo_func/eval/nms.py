"""Greedy non-maximum suppression, batched over images, in plain torch (REFERENCE.md §3.2).

Semantics (torchvision's ``nms``): candidates are visited in descending score order; a candidate
is kept unless a *kept* higher-ranked candidate overlaps it with IoU > ``iou`` (strictly greater),
IoU = inter / (area1 + area2 - inter) with no epsilon; the first ``max_det`` kept candidates are
the output, in that order.

Tie rule: candidates with equal scores are ranked by their index (lower index first), i.e. a
*stable* sort by score, descending. The callers here pass candidates already in that order.

Greedy keep is the unique fixed point of ``keep[i] = valid[i] and not any(keep[j] and S[j, i] for
j < i)`` with ``S[j, i] = IoU(j, i) > iou`` (unique because S is strictly upper triangular: rank i
depends only on ranks < i). Two forms compute it:

**Eager** (``iters=None``): blocks of ``block`` ranks. Each block is first suppressed by the boxes
already kept (at most ``max_det`` matter: a later kept box is past ``max_det`` anyway), a
``[B, max_det, block]`` IoU, then iterated to its fixed point inside the block (one host check per
iteration), only on the images that can still keep a box; it stops once every image has
``max_det`` boxes. Exact.

**Static** (``iters`` an int; no host sync, no data-dependent shape, CUDA-graph capturable): the
suppression matrix S of all N candidates once (``[B, N, N]`` zeros and ones, built ``block`` rows at a
time against the columns after them, so ~N^2/2 IoUs), then ``iters`` Jacobi passes of the rule
above over every candidate at once, starting from ``keep = valid`` (Cluster-NMS, Zheng et al.,
"Enhancing Geometric Factors in Model Learning and Inference for Object Detection and Instance
Segmentation", 2021), each pass one batched vector-matrix product ``keep @ S``. After t passes
ranks 0..t-1 are exact (rank i depends only on ranks < i), so ``iters >= N`` is always exact;
clustered detections settle in a handful of passes. One more pass is the certificate: where it
agrees with the result on every rank up to r, ranks 0..r are the greedy answer (by induction on
the rank). ``converged[b]`` is True iff the output of image b is provably the greedy answer: its
first ``max_det`` kept boxes all lie in that agreeing prefix, or the whole result is a fixed point
and the N candidates given hold every valid candidate of the image (``total``). Kernels:
``ceil(N / block)`` IoU groups (~22 each), 5 per pass (``iters + 1`` passes) and a ~30-kernel
tail, independent of the data.
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
      converged: bool[B], True where the result is provably the greedy answer (always True in the
        eager form); where False the static form may keep a box that greedy NMS drops, or miss one
        it keeps (see the module docstring).
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


def _settle_block(alive: torch.Tensor, sup: torch.Tensor) -> torch.Tensor:
    """Greedy keep inside one block: fixed point of ``keep = alive & ~any_j(keep[j] & sup[j, i])``,
    iterated until it holds (one host check per iteration; at most T + 1 iterations).

    Args:
      alive: bool[B, T] candidates not suppressed by earlier blocks.
      sup: bool[B, T, T], ``sup[b, j, i]`` True iff j < i and IoU(j, i) > threshold.

    Returns:
      keep bool[B, T].
    """
    keep = alive
    for _ in range(alive.shape[1] + 1):
        new = alive & ~(sup & keep[:, :, None]).any(1)
        if torch.equal(new, keep):
            break
        keep = new
    return keep


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
    keep_active = _settle_block(alive, sup)
    keep = torch.zeros(B, T, dtype=torch.bool, device=bb.device)
    keep[active, :t] = keep_active
    return keep


def _suppression_matrix(boxes: torch.Tensor, *, iou: float, block: int, dtype: torch.dtype) -> torch.Tensor:
    """``S[b, j, i]`` = 1 if j < i and IoU(boxes[b, j], boxes[b, i]) > iou else 0, as dtype[B, N, N].

    Built ``block`` rows at a time, each row block only against the columns at or after its first
    row (the upper triangle plus a sliver), so the IoU work is about ``N^2 / 2 + N * block / 2``
    elements per image in ``ceil(N / block)`` groups of ops. The IoU values are :func:`pairwise_iou`'s,
    elementwise the eager form's numbers.
    """
    B, N, _ = boxes.shape
    S = torch.zeros(B, N, N, dtype=dtype, device=boxes.device)
    idx = torch.arange(N, device=boxes.device)
    for r0 in range(0, N, block):
        r1 = min(r0 + block, N)
        later = idx[None, r0:] > idx[r0:r1, None]  # [T, N - r0]: column after row
        S[:, r0:r1, r0:] = (pairwise_iou(boxes[:, r0:r1], boxes[:, r0:]) > iou) & later
    return S


def _nms_static(boxes: torch.Tensor, valid: torch.Tensor, *, iou: float, max_det: int, block: int, iters: int,
                total: torch.Tensor | None) -> NmsResult:
    """The static form: the suppression matrix once, then ``iters`` Jacobi passes of the greedy rule
    over every candidate at once (Cluster-NMS), one more pass as the exactness check."""
    B, N, _ = boxes.shape
    dev = boxes.device
    if N == 0:
        z = torch.zeros(B, max_det, dtype=torch.int64, device=dev)
        cov = torch.ones(B, dtype=torch.bool, device=dev) if total is None else total <= 0
        return NmsResult(z, z.bool(), z[:, 0], cov)
    # 0/1 matrix: one pass is a batched vector-matrix product (counts of kept suppressors; exact
    # in float32 and, as "> 0", in float16 whatever the accumulation), one read of S per pass
    S = _suppression_matrix(boxes, iou=iou, block=block, dtype=torch.float16 if dev.type == "cuda" else torch.float32)

    def suppressed(keep):
        return torch.bmm(keep.to(S.dtype)[:, None, :], S)[:, 0] > 0

    keep = valid
    for _ in range(iters):
        keep = valid & ~suppressed(keep)
    check = valid & ~suppressed(keep)
    # keep equals greedy on every rank before the first disagreement with its own next pass
    exact_prefix = (keep != check).cumsum(1) == 0
    exact_kept = (keep & exact_prefix).sum(1)
    fixed_point = exact_prefix[:, -1]
    covered = torch.ones_like(fixed_point) if total is None else total <= valid.sum(1)
    converged = (exact_kept >= max_det) | (fixed_point & covered)
    pos = keep.long().cumsum(1) - 1
    pos = torch.where(keep & (pos < max_det), pos, torch.full_like(pos, max_det))  # slot max_det: a sink
    ranks = torch.arange(N, device=dev).expand(B, N)
    kept_index = torch.zeros(B, max_det + 1, dtype=torch.int64, device=dev).scatter(1, pos, ranks)[:, :max_det]
    count = keep.sum(1).clamp(max=max_det)
    out_valid = torch.arange(max_det, device=dev)[None] < count[:, None]
    index = torch.where(out_valid, kept_index, torch.zeros_like(kept_index))
    return NmsResult(index, out_valid, count, converged)


def nms_sorted(
    boxes: torch.Tensor,
    valid: torch.Tensor,
    *,
    iou: float,
    max_det: int,
    block: int = 256,
    iters: int | None = None,
    total: torch.Tensor | None = None,
) -> NmsResult:
    """Greedy NMS over candidates already ranked by score (descending, ties by index).

    Args:
      boxes: float[B, N, 4] xyxy, class offsets already applied for class-aware NMS.
      valid: bool[B, N]; invalid candidates are neither kept nor suppress anything.
      iou: suppress when IoU > iou.
      max_det: keep at most this many per image.
      block: eager: candidates settled together (memory ``B * block^2`` booleans); static: rows of
        the suppression matrix per IoU step (memory ``B * block * N`` floats). Results do not
        depend on it.
      iters: None = eager (each block iterated to its fixed point, early stop when every image is
        full; host syncs); an int = static (this many Jacobi passes over all N candidates, no host
        sync, capturable in a CUDA graph; ``converged`` says where the result is exact).
      total: static form only: int64[B], the number of valid candidates each image has in all
        (when ``boxes`` holds only the highest-ranked ones); None = ``boxes`` holds them all.

    Returns:
      :class:`NmsResult`.

    Raises:
      ValueError: mismatched shapes or a non-positive ``max_det`` / ``block`` / ``iters``.

    Example:
      >>> import torch
      >>> from yolo_func.eval.nms import nms_sorted
      >>> boxes = torch.tensor([[[0.0, 0, 10, 10], [1, 0, 11, 10], [2, 0, 12, 10], [20, 20, 30, 30]]])
      >>> valid = torch.ones(1, 4, dtype=torch.bool)      # ranked; IoU(0,1) = IoU(1,2) = 0.82, IoU(0,2) = 0.67
      >>> nms_sorted(boxes, valid, iou=0.7, max_det=3).index.tolist()
      [[0, 2, 3]]
      >>> r = nms_sorted(boxes, valid, iou=0.7, max_det=3, iters=4)   # static form: same boxes, exact
      >>> r.index.tolist(), r.converged.tolist()
      ([[0, 2, 3]], [True])
    """
    if boxes.dim() != 3 or boxes.shape[-1] != 4 or valid.shape != boxes.shape[:2]:
        raise ValueError(
            f"[yolo_func] nms_sorted: expected boxes float[B, N, 4] and valid bool[B, N], got "
            f"{tuple(boxes.shape)} and {tuple(valid.shape)}"
        )
    if max_det < 1 or block < 1:
        raise ValueError(f"[yolo_func] nms_sorted: max_det and block must be >= 1, got {max_det} and {block}")
    if iters is not None:
        if not isinstance(iters, int) or iters < 1:
            raise ValueError(f"[yolo_func] nms_sorted: iters must be a positive int (or None for the eager form), got {iters!r}")
        return _nms_static(boxes, valid, iou=iou, max_det=max_det, block=block, iters=iters, total=total)
    B, N, _ = boxes.shape
    dev = boxes.device
    # Slot max_det is a sink for kept boxes past max_det (static-shape scatter target).
    kept_boxes = boxes.new_zeros(B, max_det + 1, 4)
    kept_valid = torch.zeros(B, max_det + 1, dtype=torch.bool, device=dev)
    kept_index = torch.zeros(B, max_det + 1, dtype=torch.int64, device=dev)
    count = torch.zeros(B, dtype=torch.int64, device=dev)
    # Blocks up to the last valid candidate of any image only (one host read).
    n_blocks = int((valid * torch.arange(1, N + 1, device=dev)).max()) if N else 0
    for start in range(0, n_blocks, block):
        bb, vv = boxes[:, start : start + block], valid[:, start : start + block]
        keep = _eager_block(bb, vv, kept_boxes, kept_valid, count, iou=iou, max_det=max_det)
        if keep is None:  # no image can keep a box in this block
            continue
        T = bb.shape[1]
        pos = count[:, None] + keep.long().cumsum(1) - 1
        pos = torch.where(keep & (pos < max_det), pos, torch.full_like(pos, max_det))
        kept_boxes = kept_boxes.scatter(1, pos[..., None].expand(B, T, 4), bb)
        kept_valid = kept_valid.scatter(1, pos, keep)
        ranks = torch.arange(start, start + T, device=dev).expand(B, T)
        kept_index = kept_index.scatter(1, pos, ranks)
        count = count + keep.sum(1)
        if bool((count >= max_det).all()):
            break
    count = count.clamp(max=max_det)
    slots = torch.arange(max_det, device=dev)
    out_valid = slots[None] < count[:, None]
    index = torch.where(out_valid, kept_index[:, :max_det], torch.zeros_like(kept_index[:, :max_det]))
    return NmsResult(index, out_valid, count, torch.ones(B, dtype=torch.bool, device=dev))
