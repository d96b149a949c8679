"""The mask loss's cropped BCE sum (closed-form backward) against autograd through its plain ops."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from yolo_func.losses.mask import cropped_bce_sum


def _plain(logits, gt, rows, cols):
    """The same function written with autograd-differentiated ops (the previous implementation)."""
    x = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    if gt.dtype == torch.bool:
        bce = torch.nn.functional.softplus(torch.where(gt, -x, x))
    else:
        bce = torch.nn.functional.binary_cross_entropy_with_logits(x, gt, reduction="none")
    return ((bce @ cols[..., None]).squeeze(-1) * rows).sum(-1)


def _case(seed, dtype, soft, shape=(2, 3, 7, 5)):
    g = torch.Generator().manual_seed(seed)
    B, S, H, W = shape
    ft = torch.promote_types(dtype, torch.float32)
    logits = (torch.randn(B, S, H, W, generator=g) * 4).to(dtype)
    gt = torch.rand(B, S, H, W, generator=g).to(ft) if soft else torch.rand(B, S, H, W, generator=g) > 0.5
    rows = (torch.rand(B, S, H, generator=g) > 0.3).to(ft)
    cols = (torch.rand(B, S, W, generator=g) > 0.3).to(ft)
    up = torch.randn(B, S, generator=g).to(ft)
    return logits, gt, rows, cols, up


def _grads(fn, logits, gt, rows, cols, up):
    x = logits.clone().requires_grad_(True)
    y = fn(x, gt, rows, cols)
    (g,) = torch.autograd.grad(y, x, up)
    return y.detach(), g


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**16), st.booleans())
def test_float64_gradient_is_autograds(seed, soft):
    case = _case(seed, torch.float64, soft)
    y1, g1 = _grads(_plain, *case)
    y2, g2 = _grads(cropped_bce_sum, *case)
    assert torch.equal(y1, y2)  # the same forward operations
    torch.testing.assert_close(g2, g1, rtol=1e-12, atol=1e-14)


def test_half_precision_logits_get_a_gradient_of_their_dtype():
    case = _case(3, torch.bfloat16, False)
    y1, g1 = _grads(_plain, *case)
    y2, g2 = _grads(cropped_bce_sum, *case)
    assert g2.dtype == torch.bfloat16 and y2.dtype == torch.float32
    assert torch.equal(y1, y2)
    torch.testing.assert_close(g2.float(), g1.float(), rtol=1e-2, atol=1e-2)  # one bf16 rounding apart at most


def test_cropped_out_pixels_get_no_gradient_and_no_grad_path_matches():
    logits, gt, rows, cols, up = _case(5, torch.float32, False)
    rows[..., 0] = 0.0
    cols[..., -1] = 0.0
    _, g = _grads(cropped_bce_sum, logits, gt, rows, cols, up)
    assert (g[..., 0, :] == 0).all() and (g[..., :, -1] == 0).all()
    with torch.no_grad():
        assert torch.equal(cropped_bce_sum(logits, gt, rows, cols), _plain(logits, gt, rows, cols))
