"""Instance-mask term, vectorised over images and positive anchors (REFERENCE.md §2.6, trap T13).

The reference loops over images in Python and indexes positives with boolean masks. Here the
positive anchors of every image are gathered into a *static* number of slots
``num_slots = min(A, M * topk)`` (each target owns at most ``topk`` positives, so the slots always
hold all of them), with a slot-valid mask; the predicted logits for all slots of all images come
from one batched matmul ``coeffs @ protos`` of shape ``[B, num_slots, Hm, Wm]`` (never
``[B, A, Hm*Wm]``). The crop is separable (a column mask times a row mask), so the cropped sum is
a matrix-vector product instead of a masked full-size tensor.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from yolo_func.losses.mask_fused import fused_mask_bce_available, overlap_cropped_bce_sum
from yolo_func.losses.precision import at_least_f32, at_least_f32_dtype

__all__ = ["gather_positive_slots", "crop_bounds", "cropped_bce_sum", "mask_loss"]


def gather_positive_slots(fg_mask: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Anchor indices of the positives of every image, packed into ``num_slots`` static slots.

    A stable sort of ``fg_mask`` (descending) puts the positive anchors first in anchor order;
    the remaining slots point at background anchors and are marked invalid.

    Args:
      fg_mask: bool[B, A].
      num_slots: S <= A, at least the largest number of positives per image.

    Returns:
      ``(anchor_idx int64[B, S], slot_valid bool[B, S])``.

    Example:
      >>> import torch
      >>> from yolo_func.losses import gather_positive_slots
      >>> idx, ok = gather_positive_slots(torch.tensor([[False, True, False, True]]), 3)
      >>> idx.tolist(), ok.tolist()
      ([[1, 3, 0]], [[True, True, False]])
    """
    order = torch.sort(fg_mask.to(torch.int32), dim=1, descending=True, stable=True).indices
    idx = order[:, :num_slots]
    return idx, fg_mask.gather(1, idx)


def crop_bounds(boxes: torch.Tensor, size: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Separable crop masks with the integer-index rule: pixel column c survives iff
    ``x1 <= c < x2``, row r iff ``y1 <= r < y2`` (boxes in mask pixels).

    Args:
      boxes: float[..., 4] xyxy at mask resolution.
      size: (Hm, Wm).

    Returns:
      ``(rows float[..., Hm], cols float[..., Wm])`` of 0/1.
    """
    hm, wm = size
    x1, y1, x2, y2 = (v[..., None] for v in boxes.unbind(-1))
    c = torch.arange(wm, device=boxes.device, dtype=boxes.dtype)
    r = torch.arange(hm, device=boxes.device, dtype=boxes.dtype)
    cols = ((c >= x1) & (c < x2)).to(boxes.dtype)
    rows = ((r >= y1) & (r < y2)).to(boxes.dtype)
    return rows, cols


def _bce(x: torch.Tensor, gt: torch.Tensor) -> torch.Tensor:
    if gt.dtype == torch.bool:  # overlap map: BCEWithLogits of a binary target, stable softplus(+-x)
        return F.softplus(torch.where(gt, -x, x))
    return F.binary_cross_entropy_with_logits(x, gt, reduction="none")


class _CroppedBCESum(torch.autograd.Function):
    # Autograd through softplus(where(gt, -x, x)) and the crop's matrix-vector products makes ~14
    # passes over [B, S, Hm, Wm] in the backward (gemv's outer product, softplus_backward, two
    # where's, a neg, casts); the gradient has a closed form, (sigmoid(x) - gt) * rows * cols,
    # which takes 4. At batch 64 / 640 px that tensor holds 0.5 G elements.
    generate_vmap_rule = True

    @staticmethod
    def forward(logits, gt, rows, cols):
        x = at_least_f32(logits)
        bce = _bce(x, gt)
        cropped = torch.matmul(bce, cols[..., None]).squeeze(-1)  # [B, S, Hm]: sum over kept columns
        return (cropped * rows).sum(-1)

    @staticmethod
    def setup_context(ctx, inputs, output):
        logits, gt, rows, cols = inputs
        ctx.save_for_backward(logits, gt, rows, cols)

    @staticmethod
    def backward(ctx, g):
        logits, gt, rows, cols = ctx.saved_tensors
        # d BCEWithLogits(x, t) / dx = sigmoid(x) - t, for binary and soft targets alike
        # sigmoid(x) - gt in one pass; add(alpha=-1) accepts a bool target, the minus operator does not
        d = torch.add(torch.sigmoid(at_least_f32(logits)), gt, alpha=-1)
        w = (rows * g[..., None])[..., None] * cols[..., None, :]  # [B, S, Hm, Wm]: crop times upstream
        grad = torch.empty_like(logits)
        torch.mul(d, w, out=grad)  # cast into the logits' dtype within the product
        return grad, None, None, None


def cropped_bce_sum(logits: torch.Tensor, gt: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """Per slot, the sum of ``BCEWithLogits(logits, gt)`` over the pixels the crop keeps.

    The same value as ``((bce @ cols[..., None]).squeeze(-1) * rows).sum(-1)`` (the same float32
    operations), with a closed-form backward (``(sigmoid(x) - gt) * rows * cols``): gradients flow
    to ``logits`` only.

    Args:
      logits: float[B, S, Hm, Wm] (half precision is upcast to float32).
      gt: bool[B, S, Hm, Wm] (binary targets) or float[B, S, Hm, Wm] (soft targets).
      rows, cols: float[B, S, Hm] and float[B, S, Wm] 0/1 crop masks (:func:`crop_bounds`), float32.

    Returns:
      float[B, S].
    """
    if not (torch.is_grad_enabled() and logits.requires_grad):
        return _CroppedBCESum.forward(logits, gt, rows, cols)
    return _CroppedBCESum.apply(logits, gt, rows.detach(), cols.detach())


def mask_loss(
    coeffs: torch.Tensor,
    protos: torch.Tensor,
    masks: torch.Tensor,
    fg_mask: torch.Tensor,
    gt_idx: torch.Tensor,
    target_boxes: torch.Tensor,
    *,
    image_size: tuple[int, int],
    num_slots: int,
    fused: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum over positive anchors of the cropped, area-normalised mask BCE, and the positive count.

    For a positive anchor with target slot j: logits ``P = coeffs_a @ protos_b`` ([Hm, Wm]),
    ``G = (masks_b == j + 1)`` (overlap map) or ``masks[b, j]`` (per instance), per-pixel
    ``BCEWithLogits(P, G)`` zeroed outside the target box at mask resolution, averaged over all
    ``Hm * Wm`` pixels, divided by the normalised box area ``w * h / (W * H)``.

    The matmul follows the ambient autocast (BF16 logits on GPU training); the BCE and its
    cropped reduction run in float32.

    Args:
      coeffs: float[B, A, NM] mask coefficients.
      protos: float[B, NM, Hm, Wm] prototypes (already at mask resolution).
      masks: int64[B, Hm, Wm] overlap map or float[B, M, Hm, Wm] per-instance masks.
      fg_mask: bool[B, A]; gt_idx: int64[B, A]; target_boxes: float[B, A, 4] xyxy pixels.
      image_size: (H, W) of the network input in pixels.
      num_slots: static slots per image (>= the largest number of positives in an image).
      fused: the cropped BCE of an overlap map through the Triton kernels of
        :mod:`yolo_func.losses.mask_fused` (the target built on the fly, nothing of size
        ``[B, S, Hm, Wm]`` but the gradient allocated). None: on CUDA when triton is available.
        The fused sum agrees with the torch one to float32 rounding (another summation order).

    Returns:
      ``(loss_sum float[], num_pos float[])``; ``loss_sum`` is 0 when there are no positives.

    Example:
      >>> import torch
      >>> from yolo_func import yolov8
      >>> from yolo_func.assign import assign_from_detect
      >>> from yolo_func.testing.synthetic import synthetic_batch
      >>> model = yolov8("n", task="segment", num_classes=5)
      >>> params, state = model.init(torch.Generator().manual_seed(0))
      >>> batch = synthetic_batch("segment", 2, 64, num_classes=5, max_boxes=4)
      >>> feats, _ = model.features(params["network"], state["network"], batch.images.float() / 255, train=True)
      >>> preds, _ = model.apply(params, state, batch.images.float() / 255, train=True)
      >>> a = assign_from_detect(preds["detect"], batch.targets, model.anchors(feats))
      >>> from yolo_func.losses import mask_loss
      >>> loss_sum, num_pos = mask_loss(preds["segment"].coeffs, preds["segment"].protos, batch.targets.masks,
      ...                               a.fg_mask, a.gt_idx, a.target_boxes, image_size=(64, 64), num_slots=84)
      >>> loss_sum.shape, int(num_pos) == int(a.fg_mask.sum())
      (torch.Size([]), True)
    """
    B, A, NM = coeffs.shape
    hm, wm = masks.shape[-2:]
    H, W = image_size
    S = max(1, min(num_slots, A))
    idx, ok = gather_positive_slots(fg_mask, S)  # [B, S]
    slot_gt = gt_idx.gather(1, idx)
    c = coeffs.gather(1, idx[..., None].expand(B, S, NM))
    logits = torch.bmm(c, protos.reshape(B, NM, hm * wm).to(c.dtype)).reshape(B, S, hm, wm)
    dtype = at_least_f32_dtype(logits.dtype)  # the BCE's dtype, without converting the logits
    can_fuse = masks.ndim == 3 and dtype == torch.float32 and fused_mask_bce_available(logits)
    if fused and not can_fuse:
        raise ValueError("[yolo_func] mask_loss(fused=True) needs an overlap map, float32 (or half) logits and "
                         "fused_mask_bce_available(logits)")
    if fused is None:
        fused = logits.is_cuda and can_fuse
    gt = None  # fused: the kernels compare the overlap map with slot_gt + 1 on the fly
    if not fused and masks.ndim == 3:  # overlap map: value j + 1 marks slot j
        gt = masks[:, None] == (slot_gt + 1)[:, :, None, None]
    elif not fused:
        gt = masks.gather(1, slot_gt[:, :, None, None].expand(B, S, hm, wm)).to(dtype)
    boxes = target_boxes.gather(1, idx[..., None].expand(B, S, 4)).to(dtype)
    # Python-scalar arithmetic per coordinate: a torch.tensor([W, H, W, H]) would be a blocking
    # host-to-device copy on every call.
    x1, y1, x2, y2 = boxes.unbind(-1)
    norm = torch.stack((x1 / W, y1 / H, x2 / W, y2 / H), -1)
    nx1, ny1, nx2, ny2 = norm.unbind(-1)
    rows, cols = crop_bounds(torch.stack((nx1 * wm, ny1 * hm, nx2 * wm, ny2 * hm), -1), (hm, wm))
    with torch.autocast(device_type=logits.device.type, enabled=False):
        if fused:
            bce_sum = overlap_cropped_bce_sum(logits, masks, slot_gt, rows, cols)
        else:
            bce_sum = cropped_bce_sum(logits, gt, rows, cols)
        per_slot = bce_sum / (hm * wm)  # mean over the whole mask area
    area = (norm[..., 2] - norm[..., 0]) * (norm[..., 3] - norm[..., 1])
    area = torch.where(ok, area, torch.ones_like(area))  # background slots: a safe denominator
    per_slot = torch.where(ok, per_slot / area, torch.zeros_like(per_slot))
    # Summed over the anchors, not the slots: each positive's value placed at its anchor (the slots'
    # anchors are distinct; a background slot adds an exact 0) in a [B, A] tensor whose shape does not
    # depend on S = M * topk, so the loss is bitwise the same whatever the targets' padding M.
    per_anchor = torch.zeros((B, A), dtype=per_slot.dtype, device=per_slot.device).scatter(1, idx, per_slot)
    return per_anchor.sum(), fg_mask.sum().to(per_slot.dtype)
