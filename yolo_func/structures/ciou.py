"""CIoU of predicted boxes against fixed targets, with a hand-derived backward (REFERENCE.md §2.4).

:func:`yolo_func.structures.bbox_iou` is the readable reference of the IoU family; autograd through
its CIoU records about 55 forward and 115 backward ops per call. The detection loss and the
assigner call CIoU every step, and at small batches a step is bound by how many kernels it
launches, not by the bytes they move. :func:`ciou` computes the same forward values (the same
float32 operations in the same order, on x/y pairs at once: ~35 ops) and a backward of ~40 ops
derived by hand, with autograd's own rules at the kinks (``min``/``max`` split the gradient in
half on ties, ``clamp(min=0)`` passes it where the input is ``>= 0``). The trade-off weight
``alpha`` carries no gradient, as in the reference (trap T7).

Gradients flow to ``pred`` only: the target is a constant of the loss (the assigned box).

It lives in ``structures/`` (with the box codecs and the IoU family) because both the assigner
(``assign/``, no gradient) and the box loss (``losses/``) use it; ``yolo_func.losses.ciou``
re-exports it.
"""

from __future__ import annotations

import math

import torch

__all__ = ["ciou"]

_K = 4 / math.pi**2


def _forward(p: torch.Tensor, q: torch.Tensor, eps: float):
    """CIoU of xyxy ``p`` and ``q`` (broadcast) and what the backward needs."""
    # One split / unbind per pair (the same views as two slices / selects; one op instead of two).
    p1, p2 = p.split(2, -1)
    q1, q2 = q.split(2, -1)
    wh1, wh2 = p2 - p1, q2 - q1
    w1, h1 = wh1.unbind(-1)
    w2, h2 = wh2.unbind(-1)
    h1, h2 = h1 + eps, h2 + eps  # eps on heights only (reference convention)
    iwh_raw = torch.minimum(p2, q2) - torch.maximum(p1, q1)
    iwh = iwh_raw.clamp(min=0)
    iw, ih = iwh.unbind(-1)
    inter = iw * ih
    union = w1 * h1 + w2 * h2 - inter + eps
    iou = inter / union
    cwh = torch.maximum(p2, q2) - torch.minimum(p1, q1)  # enclosing box (w, h)
    cw2, ch2 = cwh.pow(2).unbind(-1)
    c2 = cw2 + ch2 + eps
    d = q1 + q2 - p1 - p2  # twice the centre offset (x, y)
    dx2, dy2 = d.pow(2).unbind(-1)
    rho2 = (dx2 + dy2) / 4
    r1 = w1 / h1
    da = torch.atan(w2 / h2) - torch.atan(r1)
    v = _K * da.pow(2)
    alpha = v / (v - iou + (1 + eps))
    out = iou - (rho2 / c2 + v * alpha)
    return out, (p1, p2, q1, q2, w1, h1, iwh_raw, iwh, union, iou, cwh, c2, d, rho2, r1, da, alpha)


class _CIoU(torch.autograd.Function):
    # The forward returns its intermediates as extra (non-differentiable) outputs: the pattern
    # that keeps the function usable under torch.func transforms without recomputing them.
    generate_vmap_rule = True  # forward and backward are plain torch ops
    @staticmethod
    def forward(pred, target, eps):
        out, saved = _forward(pred, target, eps)
        return (out, *saved)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.mark_non_differentiable(*output[1:])
        ctx.set_materialize_grads(False)  # no zero cotangents for the unused extra outputs
        ctx.save_for_backward(*output[1:])
        ctx.pred_shape = inputs[0].shape

    @staticmethod
    def backward(ctx, g, *_):
        p1, p2, q1, q2, w1, h1, iwh_raw, iwh, union, iou, cwh, c2, d, rho2, r1, da, alpha = ctx.saved_tensors
        # out = iou - rho2 / c2 - v * alpha (alpha constant)
        g_inter = g * (1 + iou) / union  # d iou / d inter = (1 + iou) / union
        g_area1 = -g * iou / union  # d iou / d (w1 h1) = -inter / union^2
        g_rho2 = -g / c2
        g_c2 = g * rho2 / c2.pow(2)
        # v = K (a2 - a1)^2, a1 = atan(r1), r1 = w1 / h1: d v / d r1 = -2 K (a2 - a1) / (1 + r1^2)
        g_r1h = (g * alpha) * (2 * _K) * da / ((1 + r1.pow(2)) * h1)  # times d r1 / d w1 = 1 / h1
        # (w1, h1) = p2 - p1 (+ eps): area term and aspect term (d r1 / d h1 = -r1 / h1)
        g_wh1 = torch.stack((g_area1 * h1 + g_r1h, g_area1 * w1 - g_r1h * r1), -1)
        # intersection (w, h) = clamp(min(p2, q2) - max(p1, q1), 0); autograd's tie rules
        s_min = 0.5 * (1 + torch.sign(q2 - p2))  # d min(p2, q2) / d p2: 1, 1/2 on a tie, 0
        s_max = 0.5 * (1 + torch.sign(p1 - q1))  # d max(p1, q1) / d p1
        g_iwh = torch.where(iwh_raw >= 0, g_inter[..., None] * iwh.flip(-1), 0.0)
        # enclosing (w, h) = max(p2, q2) - min(p1, q1); c2 = cw^2 + ch^2 + eps
        g_cwh = (2 * g_c2)[..., None] * cwh
        # rho2 = |d|^2 / 4 with d = q1 + q2 - p1 - p2
        g_d = (g_rho2 / 2)[..., None] * d
        g_p2 = g_iwh * s_min + g_wh1 + g_cwh * (1 - s_min) - g_d
        g_p1 = -(g_iwh * s_max) - g_wh1 - g_cwh * (1 - s_max) - g_d
        grad = torch.cat((g_p1, g_p2), -1)
        if grad.shape != ctx.pred_shape:
            grad = grad.sum_to_size(ctx.pred_shape)
        return grad, None, None


def ciou(pred: torch.Tensor, target: torch.Tensor, *, eps: float = 1e-7) -> torch.Tensor:
    """Complete IoU of predicted against target xyxy boxes (Zheng et al., AAAI 2020), elementwise
    with broadcasting; the same values as ``bbox_iou(pred, target, kind="ciou")``.

    Args:
      pred: float[..., 4] xyxy; receives the gradient.
      target: float[..., 4] xyxy, broadcastable against ``pred``; treated as a constant.
      eps: numerical guard (1e-7), placed as the reference places it.

    Returns:
      float[...] in [-1, 1] (the broadcast shape without the last axis).

    Example:
      >>> p = torch.tensor([[0., 0., 2., 2.]], requires_grad=True)
      >>> ciou(p, torch.tensor([[0., 0., 2., 2.]])).detach()
      tensor([1.])
    """
    if pred.shape[-1] != 4 or target.shape[-1] != 4:
        raise ValueError(f"[yolo_func] ciou: boxes must end in 4, got {tuple(pred.shape)} and {tuple(target.shape)}")
    if target.requires_grad:  # a constant of the loss (no detach op when it already is one)
        target = target.detach()
    if not (torch.is_grad_enabled() and pred.requires_grad):
        return _forward(pred, target, eps)[0]
    return _CIoU.apply(pred, target, eps)[0]
