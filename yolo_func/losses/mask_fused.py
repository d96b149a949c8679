"""Fused Triton kernels for the overlap-map mask loss's cropped BCE sum (forward and backward).

Why: :func:`yolo_func.losses.mask.cropped_bce_sum` takes the materialised bool target
``masks[:, None] == slot_gt + 1`` and makes about 12 passes over float32 ``[B, S, Hm, Wm]``
intermediates (the bool target, the upcast logits, ``where``, ``softplus``, the crop's products,
and in the backward ``sigmoid``, the subtraction, the crop weight ``rows * g * cols`` and the
product). At batch 64 / 640 px (``S = 160`` slots, ``Hm = Wm = 160``) that tensor holds 0.5 G
elements (2 GB in float32). The kernels here read the bf16 logits once in the forward and once in
the backward, write the bf16 gradient once, and build the target on the fly from the
``[B, Hm, Wm]`` overlap map (shared by the ``S`` slots of an image, so it stays in L2; each
program handles a few slots of one image so one load of the map serves all of them). Nothing of
size ``[B, S, Hm, Wm]`` is allocated except the gradient.

Math (per slot ``(b, s)``, pixel ``(r, c)``): ``x = float32(logits[b, s, r, c])``,
``gt = masks[b, r, c] == slot_gt[b, s] + 1``, ``z = -x if gt else x``,
``bce = softplus(z) = max(z, 0) + log1p(exp(-|z|))``;
``out[b, s] = sum_{r, c} rows[b, s, r] * cols[b, s, c] * bce`` and
``grad_logits = (sigmoid(x) - gt) * rows * cols * g`` (computed as ``+-sigmoid(z)``, float32,
stored in the logits' dtype).

Numerics: the per-pixel terms are float32 like the torch version's, but the summation order
differs (per-lane partial sums over fixed pixel blocks, then a tree reduction), so the two agree
to float32 rounding, not bitwise. ``log1p`` is a short series (below) written with plain
arithmetic, because libdevice does not run under Triton's interpreter (``TRITON_INTERPRET=1``,
used by the CPU tests); it is accurate to about 1e-7 relative. The kernels are deterministic:
no atomics, a fixed grid and a fixed reduction order per output element, so two calls on the
same inputs give identical bits (CUDA-graph replays included).

The kernels are built lazily on the first call (``@triton.jit`` reads ``TRITON_INTERPRET`` when it
runs); importing this module works without triton installed.
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch

__all__ = ["fused_mask_bce_available", "overlap_cropped_bce_sum"]

#: Slots of one image per program: one load of the overlap map serves all of them.
_SLOTS = 4
#: Pixels per program iteration (forward) and per program (backward); powers of two.
_FWD_PIXELS = 512
_BWD_PIXELS = 512
_FWD_WARPS = 8
_BWD_WARPS = 8

_LOGIT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# Bound to ``triton`` / ``triton.language`` by ``_kernels`` (the jit'd functions look ``tl`` up in
# this module's globals); None until then.
triton = None
tl = None


@functools.lru_cache(maxsize=None)
def _triton_importable() -> bool:
    try:
        import triton as _triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # ImportError, or a broken install
        return False
    return True


def _interpret() -> bool:
    """Whether ``triton.jit`` would build interpreted kernels now (``TRITON_INTERPRET``)."""
    if _triton_importable():
        import triton as _triton

        knobs = getattr(_triton, "knobs", None)
        if knobs is not None:
            return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on")


def _functorch_active(x: torch.Tensor) -> bool:
    fc = getattr(torch._C, "_functorch", None)
    wrapped = getattr(fc, "is_functorch_wrapped_tensor", None)
    if wrapped is not None and wrapped(x):
        return True
    active = getattr(torch._C, "_are_functorch_transforms_active", None)
    return bool(active is not None and active())


def fused_mask_bce_available(logits: torch.Tensor) -> bool:
    """Whether :func:`overlap_cropped_bce_sum` can run on ``logits``.

    True when triton is importable, and ``logits`` is on CUDA (or on the CPU with
    ``TRITON_INTERPRET=1`` set in the environment), and no torch.func transform (vmap, grad, ...)
    is active: Triton kernels cannot see through functorch's wrapped tensors.

    Args:
      logits: float[B, S, Hm, Wm] (any device and dtype; only the device is looked at).

    Returns:
      bool.
    """
    return _unavailable_reason(logits) is None


def _unavailable_reason(logits: torch.Tensor) -> str | None:
    """Why the kernels cannot run on ``logits`` (None when they can)."""
    if not _triton_importable():
        return "overlap_cropped_bce_sum needs triton, which is not importable"
    if not (logits.is_cuda or (logits.device.type == "cpu" and _interpret())):
        return (f"overlap_cropped_bce_sum: logits on {logits.device} need CUDA "
                "(or the CPU with TRITON_INTERPRET=1 set before the first call)")
    if _functorch_active(logits):
        return "overlap_cropped_bce_sum does not support torch.func transforms"
    return None


# The kernels' Python source, jit'd lazily by ``_kernels`` (``tl`` is bound in this module's
# globals there; the annotations stay strings thanks to ``from __future__ import annotations``).
# They call only triton.language builtins (no tl.cdiv / tl.zeros / tl.sum / tl.sigmoid, which are
# themselves @triton.jit functions of triton.language.standard, built when triton is first
# imported): the interpreter cannot call those when triton was imported before TRITON_INTERPRET
# was set (torch._dynamo imports triton, so that happens in a test session).


def _fwd_kernel(
    logits_ptr, masks_ptr, slot_gt_ptr, rows_ptr, cols_ptr, out_ptr,
    S, Hm: tl.constexpr, Wm: tl.constexpr, N: tl.constexpr,  # N = Hm * Wm
    SLOTS: tl.constexpr, BLOCK: tl.constexpr,
):
    # One program per (image b, group of SLOTS slots of b). It loops over the N = Hm*Wm pixels in
    # blocks of BLOCK, keeping a float32 [SLOTS, BLOCK] partial sum (lane k of a slot adds pixels
    # k, k + BLOCK, k + 2 BLOCK, ... in that order), reduced once at the end by tl.sum's tree
    # reduction: a fixed order for every output element, no atomics.
    groups = (S + SLOTS - 1) // SLOTS
    pid = tl.program_id(0).to(tl.int64)
    b = pid // groups
    s0 = (pid % groups) * SLOTS
    slot0 = b * S + s0  # int64 flat index of the group's first slot
    sl = tl.arange(0, SLOTS)
    sl_ok = (s0 + sl) < S
    tgt = tl.load(slot_gt_ptr + slot0 + sl, mask=sl_ok, other=-2) + 1  # int64[SLOTS]
    lp = logits_ptr + slot0 * N  # int64 base offsets, int32 offsets within the group
    mp = masks_ptr + b * N
    rp = rows_ptr + slot0 * Hm
    cp = cols_ptr + slot0 * Wm
    px = tl.arange(0, BLOCK)
    acc = tl.full((SLOTS, BLOCK), 0.0, tl.float32)
    for start in range(0, N, BLOCK):
        offs = start + px
        ok = offs < N
        r = offs // Wm
        c = offs - r * Wm
        m = tl.load(mp + offs, mask=ok, other=0)  # one overlap-map load for the SLOTS slots
        ok2 = sl_ok[:, None] & ok[None, :]
        x = tl.load(lp + (sl[:, None] * N + offs[None, :]), mask=ok2, other=0.0).to(tl.float32)
        w = tl.load(rp + (sl[:, None] * Hm + r[None, :]), mask=ok2, other=0.0)
        w = w * tl.load(cp + (sl[:, None] * Wm + c[None, :]), mask=ok2, other=0.0)
        z = tl.where(m[None, :] == tgt[:, None], -x, x)
        # softplus(z) = max(z, 0) + log1p(t), t = exp(-|z|) in (0, 1]. log1p(t) = 2 atanh(q) with
        # q = t / (2 + t) in [0, 1/3]: the odd series q + q^3/3 + ... + q^15/15 (truncation
        # < (1/9)^8 / 17 ~ 1e-9 relative); plain arithmetic, so the interpreter runs the same code.
        t = tl.exp(-tl.abs(z))
        q = tl.div_rn(t, t + 2.0)
        q2 = q * q
        p = q2 * (1.0 / 15.0) + (1.0 / 13.0)
        p = p * q2 + (1.0 / 11.0)
        p = p * q2 + (1.0 / 9.0)
        p = p * q2 + (1.0 / 7.0)
        p = p * q2 + (1.0 / 5.0)
        p = p * q2 + (1.0 / 3.0)
        p = p * q2 + 1.0
        bce = tl.maximum(z, 0.0) + 2.0 * q * p
        acc += w * bce  # masked lanes: w = 0 and bce = log(2) (finite), so they add 0
    # tl.sum's own reduction (a tree in registers, then across warps), spelled with tl.reduce:
    # tl.sum itself is a triton.jit function built when triton was imported (see _kernels).
    tl.store(out_ptr + slot0 + sl, tl.reduce(acc, 1, tl.standard._sum_combine), mask=sl_ok)


def _bwd_kernel(
    logits_ptr, masks_ptr, slot_gt_ptr, rows_ptr, cols_ptr, g_ptr, grad_ptr,
    S, Hm: tl.constexpr, Wm: tl.constexpr, N: tl.constexpr,  # N = Hm * Wm
    SLOTS: tl.constexpr, BLOCK: tl.constexpr,
):
    # Elementwise: program (i, j) writes pixels [j * BLOCK, (j + 1) * BLOCK) of the SLOTS slots of
    # group i (one overlap-map load for all of them).
    groups = (S + SLOTS - 1) // SLOTS
    pid = tl.program_id(0).to(tl.int64)
    b = pid // groups
    s0 = (pid % groups) * SLOTS
    slot0 = b * S + s0
    sl = tl.arange(0, SLOTS)
    sl_ok = (s0 + sl) < S
    tgt = tl.load(slot_gt_ptr + slot0 + sl, mask=sl_ok, other=-2) + 1
    up = tl.load(g_ptr + slot0 + sl, mask=sl_ok, other=0.0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    r = offs // Wm
    c = offs - r * Wm
    m = tl.load(masks_ptr + b * N + offs, mask=ok, other=0)
    ok2 = sl_ok[:, None] & ok[None, :]
    rel = sl[:, None] * N + offs[None, :]
    x = tl.load(logits_ptr + slot0 * N + rel, mask=ok2, other=0.0).to(tl.float32)
    w = tl.load(rows_ptr + slot0 * Hm + (sl[:, None] * Hm + r[None, :]), mask=ok2, other=0.0)
    w = w * up[:, None]  # rows * g * cols: exact for 0/1 crops (0 or g)
    w = w * tl.load(cols_ptr + slot0 * Wm + (sl[:, None] * Wm + c[None, :]), mask=ok2, other=0.0)
    gt = m[None, :] == tgt[:, None]
    # sigmoid(x) - gt = +-sigmoid(z) with z = (gt ? -x : x): no cancellation near gt. sigmoid(z)
    # from t = exp(-|z|) in (0, 1] (no overflow): 1 / (1 + t) for z >= 0, t / (1 + t) below.
    z = tl.where(gt, -x, x)
    t = tl.exp(-tl.abs(z))
    sz = tl.div_rn(tl.where(z >= 0, 1.0, t), 1.0 + t)
    d = tl.where(gt, -sz, sz)
    gx = d * w
    if grad_ptr.dtype.element_ty == tl.bfloat16:
        # float32 -> bfloat16 rounded to nearest even by hand (the bit trick torch's CPU cast
        # uses; the same bits as the hardware's cvt.rn.bf16.f32): the interpreter's own cast
        # truncates. NaNs stay NaN.
        bits = gx.to(tl.uint32, bitcast=True)
        bits = bits + (0x7FFF + ((bits >> 16) & 1))
        hi = tl.where(gx != gx, 0x7FC0, bits >> 16).to(tl.uint16)
        tl.store(grad_ptr + slot0 * N + rel, hi.to(tl.bfloat16, bitcast=True), mask=ok2)
    else:
        tl.store(grad_ptr + slot0 * N + rel, gx.to(grad_ptr.dtype.element_ty), mask=ok2)


@functools.lru_cache(maxsize=None)
def _kernels(interpret: bool):
    """``(forward, backward)`` jit'd kernels, built on first use, once per interpreter setting
    (``triton.jit`` reads ``TRITON_INTERPRET`` when it runs)."""
    global triton, tl
    import triton as _triton
    import triton.language as _tl

    triton, tl = _triton, _tl
    return _triton.jit(_fwd_kernel), _triton.jit(_bwd_kernel)


def _check(logits, masks, slot_gt, rows, cols) -> None:
    def bad(msg):
        raise ValueError(f"[yolo_func] overlap_cropped_bce_sum: {msg}")

    for name, t in (("logits", logits), ("masks", masks), ("slot_gt", slot_gt), ("rows", rows), ("cols", cols)):
        if not isinstance(t, torch.Tensor):
            bad(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if logits.ndim != 4:
        bad(f"logits must be [B, S, Hm, Wm], got shape {tuple(logits.shape)}")
    B, S, Hm, Wm = logits.shape
    if logits.dtype not in _LOGIT_DTYPES:
        bad(f"logits must be bfloat16, float16 or float32, got {logits.dtype}")
    if not logits.is_contiguous():
        bad("logits must be contiguous")
    if masks.dtype != torch.int64:
        bad(f"masks must be an int64 overlap map, got {masks.dtype}")
    if tuple(masks.shape) != (B, Hm, Wm):
        bad(f"masks must be [B, Hm, Wm] = {(B, Hm, Wm)}, got {tuple(masks.shape)}")
    if slot_gt.dtype != torch.int64:
        bad(f"slot_gt must be int64, got {slot_gt.dtype}")
    if tuple(slot_gt.shape) != (B, S):
        bad(f"slot_gt must be [B, S] = {(B, S)}, got {tuple(slot_gt.shape)}")
    for name, t, n in (("rows", rows, Hm), ("cols", cols, Wm)):
        if t.dtype != torch.float32:
            bad(f"{name} must be float32, got {t.dtype}")
        if tuple(t.shape) != (B, S, n):
            bad(f"{name} must be [B, S, {'Hm' if name == 'rows' else 'Wm'}] = {(B, S, n)}, got {tuple(t.shape)}")
    for name, t in (("masks", masks), ("slot_gt", slot_gt), ("rows", rows), ("cols", cols)):
        if t.device != logits.device:
            bad(f"{name} is on {t.device}, logits on {logits.device}: all inputs must be on one device")
    if Hm * Wm > 2**25:  # int32 offsets within a group of slots; at most 65535 pixel blocks in grid axis 1
        bad(f"Hm * Wm = {Hm * Wm} is too large (at most 2**25 pixels per mask)")


def _launch_fwd(logits, masks, slot_gt, rows, cols) -> torch.Tensor:
    B, S, Hm, Wm = logits.shape
    out = torch.empty(B, S, device=logits.device, dtype=torch.float32)
    if out.numel() == 0:
        return out
    if Hm * Wm == 0:
        return out.zero_()
    fwd, _ = _kernels(_interpret())
    grid = (B * -(-S // _SLOTS),)
    with torch.cuda.device(logits.device) if logits.is_cuda else contextlib.nullcontext():
        fwd[grid](
            logits, masks, slot_gt, rows, cols, out, S, Hm, Wm, Hm * Wm,
            SLOTS=_SLOTS, BLOCK=_FWD_PIXELS, num_warps=_FWD_WARPS,
        )
    return out


def _launch_bwd(logits, masks, slot_gt, rows, cols, g) -> torch.Tensor:
    B, S, Hm, Wm = logits.shape
    grad = torch.empty_like(logits, memory_format=torch.contiguous_format)
    if grad.numel() == 0:
        return grad
    _, bwd = _kernels(_interpret())
    grid = (B * -(-S // _SLOTS), -(-(Hm * Wm) // _BWD_PIXELS))
    with torch.cuda.device(logits.device) if logits.is_cuda else contextlib.nullcontext():
        bwd[grid](
            logits, masks, slot_gt, rows, cols, g, grad, S, Hm, Wm, Hm * Wm,
            SLOTS=_SLOTS, BLOCK=_BWD_PIXELS, num_warps=_BWD_WARPS,
        )
    return grad


class _OverlapCroppedBCESum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, masks, slot_gt, rows, cols):
        ctx.save_for_backward(logits, masks, slot_gt, rows, cols)
        return _launch_fwd(logits, masks, slot_gt, rows, cols)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        logits, masks, slot_gt, rows, cols = ctx.saved_tensors
        grad = None
        if ctx.needs_input_grad[0]:
            # g may be expanded (stride 0, e.g. from .sum()) or of another dtype.
            grad = _launch_bwd(logits, masks, slot_gt, rows, cols, g.to(torch.float32).contiguous())
        return grad, None, None, None, None


def overlap_cropped_bce_sum(
    logits: torch.Tensor,
    masks: torch.Tensor,
    slot_gt: torch.Tensor,
    rows: torch.Tensor,
    cols: torch.Tensor,
) -> torch.Tensor:
    """Per slot, the cropped sum of ``BCEWithLogits(logits, masks == slot_gt + 1)`` (fused, Triton).

    ``out[b, s] = sum_{r, c} rows[b, s, r] * cols[b, s, c] * BCEWithLogits(x, gt)`` with
    ``x = float32(logits[b, s, r, c])`` and ``gt = masks[b, r, c] == slot_gt[b, s] + 1``: the value
    of ``cropped_bce_sum(logits, masks[:, None] == (slot_gt + 1)[..., None, None], rows, cols)``
    (:mod:`yolo_func.losses.mask`) up to float32 rounding (another summation order), without
    materialising the ``[B, S, Hm, Wm]`` target or intermediates. Differentiable in ``logits``
    only: ``d out[b, s] / d logits[b, s, r, c] = (sigmoid(x) - gt) * rows * cols``, computed in
    float32 and returned in the logits' dtype. Deterministic (bitwise repeatable).

    Needs :func:`fused_mask_bce_available` (CUDA tensors, or CPU tensors under
    ``TRITON_INTERPRET=1``).

    Args:
      logits: bfloat16 / float16 / float32 [B, S, Hm, Wm], contiguous.
      masks: int64[B, Hm, Wm] overlap map (pixel value j + 1 marks target j, 0 background).
      slot_gt: int64[B, S] target index of each slot.
      rows: float32[B, S, Hm] 0/1 row crop mask; cols: float32[B, S, Wm] 0/1 column crop mask
        (:func:`yolo_func.losses.mask.crop_bounds`). Not differentiated.

    Returns:
      float32[B, S].

    Raises:
      ValueError: on inconsistent shapes, wrong dtypes, mixed devices or non-contiguous logits.
      RuntimeError: when triton is not installed or the device cannot run it.
    """
    _check(logits, masks, slot_gt, rows, cols)
    reason = _unavailable_reason(logits)
    if reason is not None:
        raise RuntimeError(f"[yolo_func] {reason}")
    masks, slot_gt = masks.contiguous(), slot_gt.contiguous()
    rows, cols = rows.detach().contiguous(), cols.detach().contiguous()
    if not (torch.is_grad_enabled() and logits.requires_grad):
        return _launch_fwd(logits, masks, slot_gt, rows, cols)
    return _OverlapCroppedBCESum.apply(logits, masks, slot_gt, rows, cols)
