"""The fused Triton cropped mask BCE (overlap map) against float64 references and the torch path.

On a CPU-only machine the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``, set
here at import, before any kernel is built); with a GPU the same tests run the compiled kernels.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are jit'd (their first call)

import yolo_func.losses.mask_fused as mask_fused  # noqa: E402
from yolo_func.losses.mask import cropped_bce_sum, crop_bounds  # noqa: E402
from yolo_func.losses.mask_fused import fused_mask_bce_available, overlap_cropped_bce_sum  # noqa: E402
from yolo_func.testing import assert_trees_all_close  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
#: bf16 gradients: a correctly rounded bf16 value is within half an ulp (2^-8 relative) of its
#: float32 source, plus the float32 error of that source.
BF16_GRAD = dict(rtol=2.0**-8 + 1e-5, atol=1e-6)


def _ref(logits, masks, slot_gt, rows, cols):
    """Float64 reference with plain torch ops: materialised target, BCE, crop, sum."""
    gt = (masks[:, None] == (slot_gt + 1)[:, :, None, None]).double()
    bce = F.binary_cross_entropy_with_logits(logits.double(), gt, reduction="none")
    return (bce * rows.double()[..., :, None] * cols.double()[..., None, :]).sum((-2, -1))


def _case(seed, B, S, H, W, dtype, num_targets=3, device=DEV):
    """Random logits (some large), an overlap map, slot targets (some matching no pixel, one the
    background), and per-slot crops that are random, empty, full or boxes."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, S, H, W, generator=g) * 4
    big = torch.rand(B, S, H, W, generator=g) < 0.05
    logits = torch.where(big, logits * 10, logits).to(dtype)  # |x| up to ~100: stable softplus
    masks = torch.randint(0, num_targets + 1, (B, H, W), generator=g)
    slot_gt = torch.randint(-1, num_targets + 2, (B, S), generator=g)  # -1: background; >= M: none
    rows = (torch.rand(B, S, H, generator=g) > 0.3).float()
    cols = (torch.rand(B, S, W, generator=g) > 0.3).float()
    mode = torch.randint(0, 4, (B, S), generator=g)
    rows[mode == 1] = 0.0  # empty crop
    rows[mode == 2], cols[mode == 2] = 1.0, 1.0  # full crop
    x1 = torch.rand(B, S, generator=g) * W
    y1 = torch.rand(B, S, generator=g) * H
    box = torch.stack((x1, y1, x1 + torch.rand(B, S, generator=g) * W, y1 + torch.rand(B, S, generator=g) * H), -1)
    box_rows, box_cols = crop_bounds(box, (H, W))
    rows[mode == 3], cols[mode == 3] = box_rows[mode == 3], box_cols[mode == 3]
    up = torch.randn(B, S, generator=g)
    return tuple(t.to(device) for t in (logits, masks, slot_gt, rows, cols, up))


def _fused_grads(logits, masks, slot_gt, rows, cols, up):
    x = logits.clone().requires_grad_(True)
    y = overlap_cropped_bce_sum(x, masks, slot_gt, rows, cols)
    (gx,) = torch.autograd.grad(y, x, up)
    return y.detach(), gx


def _ref_grads(logits, masks, slot_gt, rows, cols, up):
    x = logits.double().requires_grad_(True)
    y = _ref(x, masks, slot_gt, rows, cols)
    (gx,) = torch.autograd.grad(y, x, up.double())
    return y.detach(), gx


_shapes = st.tuples(st.integers(1, 2), st.integers(1, 6), st.integers(1, 37), st.integers(1, 37))


def test_available_here():
    assert fused_mask_bce_available(torch.zeros(1, 1, 2, 2, device=DEV))


@settings(max_examples=15, deadline=None)
@given(st.integers(0, 2**16), _shapes, st.sampled_from([torch.float32, torch.bfloat16]))
def test_forward_matches_float64_reference(seed, shape, dtype):
    logits, masks, slot_gt, rows, cols, _ = _case(seed, *shape, dtype)
    out = overlap_cropped_bce_sum(logits, masks, slot_gt, rows, cols)
    assert out.dtype == torch.float32 and out.shape == shape[:2]
    torch.testing.assert_close(out.double(), _ref(logits, masks, slot_gt, rows, cols), rtol=1e-5, atol=1e-5)


@settings(max_examples=15, deadline=None)
@given(st.integers(0, 2**16), _shapes, st.sampled_from([torch.float32, torch.bfloat16]))
def test_backward_matches_float64_autograd(seed, shape, dtype):
    case = _case(seed, *shape, dtype)
    y, gx = _fused_grads(*case)
    y_ref, gx_ref = _ref_grads(*case)
    assert gx.dtype == dtype and gx.shape == case[0].shape
    torch.testing.assert_close(y.double(), y_ref, rtol=1e-5, atol=1e-5)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else BF16_GRAD
    torch.testing.assert_close(gx.double(), gx_ref, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_the_torch_path(dtype):
    logits, masks, slot_gt, rows, cols, up = _case(7, 2, 5, 23, 31, dtype)
    gt = masks[:, None] == (slot_gt + 1)[:, :, None, None]
    y, gx = _fused_grads(logits, masks, slot_gt, rows, cols, up)
    x = logits.clone().requires_grad_(True)
    y_t = cropped_bce_sum(x, gt, rows, cols)
    (gx_t,) = torch.autograd.grad(y_t, x, up)
    torch.testing.assert_close(y, y_t, rtol=1e-5, atol=1e-5)  # another float32 summation order
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2.0**-7, atol=1e-6)
    torch.testing.assert_close(gx.float(), gx_t.float(), **tol)
    with torch.no_grad():  # the no-grad path launches the same forward kernel
        assert torch.equal(overlap_cropped_bce_sum(logits, masks, slot_gt, rows, cols), y)


def test_bf16_gradient_is_the_float32_gradient_rounded_to_nearest_even():
    """bf16 logits are exact in float32, so the float32 kernel computes the same float32 gradient;
    the bf16 kernel must store exactly its round-to-nearest-even bf16 value (torch's cast)."""
    logits, masks, slot_gt, rows, cols, up = _case(5, 2, 5, 19, 23, torch.bfloat16)
    _, g16 = _fused_grads(logits, masks, slot_gt, rows, cols, up)
    _, g32 = _fused_grads(logits.float(), masks, slot_gt, rows, cols, up)
    assert torch.equal(g16, g32.to(torch.bfloat16))
    assert not torch.equal(g16.float(), g32)  # the case does round


def test_deterministic():
    case = _case(11, 2, 6, 37, 35, torch.bfloat16)
    y1, g1 = _fused_grads(*case)
    y2, g2 = _fused_grads(*case)
    assert torch.equal(y1, y2) and torch.equal(g1, g2)


def test_expanded_upstream_gradient_and_cropped_out_pixels():
    logits, masks, slot_gt, rows, cols, _ = _case(3, 1, 3, 9, 6, torch.float32)
    rows[..., 0] = 0.0
    cols[..., -1] = 0.0
    x = logits.clone().requires_grad_(True)
    overlap_cropped_bce_sum(x, masks, slot_gt, rows, cols).sum().backward()  # g has stride 0
    _, g_ref = _ref_grads(logits, masks, slot_gt, rows, cols, torch.ones(1, 3, device=DEV))
    torch.testing.assert_close(x.grad.double(), g_ref, rtol=1e-5, atol=1e-6)
    assert (x.grad[..., 0, :] == 0).all() and (x.grad[..., :, -1] == 0).all()


def test_bad_input_raises():
    logits, masks, slot_gt, rows, cols, _ = _case(0, 2, 3, 5, 4, torch.float32)
    ok = dict(logits=logits, masks=masks, slot_gt=slot_gt, rows=rows, cols=cols)
    bad = [
        dict(masks=masks.int()),  # wrong dtype of masks
        dict(masks=masks[:, :4]),  # mismatched Hm
        dict(slot_gt=slot_gt[:, :2]),  # mismatched S
        dict(slot_gt=slot_gt.int()),
        dict(rows=rows[..., :4]),
        dict(cols=cols.double()),
        dict(logits=logits.transpose(-1, -2).contiguous().transpose(-1, -2)),  # non-contiguous
        dict(logits=logits.double()),
        dict(logits=logits[0]),
    ]
    for change in bad:
        with pytest.raises(ValueError, match=r"^\[yolo_func\]"):
            overlap_cropped_bce_sum(**{**ok, **change})


def test_not_available_under_torch_func():
    seen = []

    def f(t):
        seen.append(fused_mask_bce_available(t))
        return t.sum()

    x = torch.zeros(3, 1, 1, 2, 2, device=DEV)
    torch.func.vmap(f)(x)
    torch.func.grad(f)(x[0])
    assert seen == [False, False]
    assert fused_mask_bce_available(x[0])


def test_import_without_triton(monkeypatch):
    """A fresh copy of the module, with ``import triton`` failing: importable, not available,
    and a clear RuntimeError when called."""
    monkeypatch.setitem(sys.modules, "triton", None)
    spec = importlib.util.spec_from_file_location("_mask_fused_no_triton", mask_fused.__file__)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    logits, masks, slot_gt, rows, cols, _ = _case(0, 1, 2, 3, 3, torch.float32)
    assert not mod.fused_mask_bce_available(logits)
    with pytest.raises(RuntimeError, match="triton"):
        mod.overlap_cropped_bce_sum(logits, masks, slot_gt, rows, cols)


@pytest.mark.cuda
def test_cuda_realistic_size_matches_torch_path_and_is_deterministic():
    B, S, H, W = 2, 160, 160, 160
    logits, masks, slot_gt, rows, cols, up = _case(0, B, S, H, W, torch.bfloat16, num_targets=20, device="cuda")
    gt = masks[:, None] == (slot_gt + 1)[:, :, None, None]
    y, gx = _fused_grads(logits, masks, slot_gt, rows, cols, up)
    x = logits.clone().requires_grad_(True)
    y_t = cropped_bce_sum(x, gt, rows, cols)
    (gx_t,) = torch.autograd.grad(y_t, x, up)
    # Sums of 25600 float32 terms in different orders; the float64 reference decides.
    torch.testing.assert_close(y, y_t, rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(y.double(), _ref(logits, masks, slot_gt, rows, cols), rtol=2e-5, atol=1e-4)
    assert gx.dtype == torch.bfloat16
    torch.testing.assert_close(gx.float(), gx_t.float(), rtol=2.0**-7, atol=1e-6)  # one bf16 rounding apart
    y2, gx2 = _fused_grads(logits, masks, slot_gt, rows, cols, up)
    assert torch.equal(y, y2) and torch.equal(gx, gx2)


@pytest.mark.cuda
def test_cuda_graph_replay_is_bitwise_eager():
    logits, masks, slot_gt, rows, cols, up = _case(1, 2, 40, 160, 160, torch.bfloat16, num_targets=10, device="cuda")
    x = logits.clone().requires_grad_(True)

    def run():
        y = overlap_cropped_bce_sum(x, masks, slot_gt, rows, cols)
        (gx,) = torch.autograd.grad(y, x, up)
        return y.detach(), gx

    y_eager, g_eager = run()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_g, g_g = run()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y_g, y_eager) and torch.equal(g_g, g_eager)


def test_mask_loss_fused_equals_the_torch_path():
    """``mask_loss(fused=True)`` (Triton, target built on the fly) against ``fused=False`` (the
    materialised bool target and ``cropped_bce_sum``): value and gradients to float32 rounding."""
    from yolo_func.losses.mask import mask_loss

    gen = torch.Generator().manual_seed(3)
    B, A, NM, hm, wm, M = 2, 24, 4, 12, 10, 3
    coeffs = torch.randn(B, A, NM, generator=gen)
    protos = torch.randn(B, NM, hm, wm, generator=gen)
    masks = torch.randint(0, M + 1, (B, hm, wm), generator=gen)
    fg = torch.rand(B, A, generator=gen) < 0.4
    gt_idx = torch.randint(0, M, (B, A), generator=gen)
    xy = torch.rand(B, A, 2, generator=gen) * 30
    boxes = torch.cat([xy, xy + 4 + torch.rand(B, A, 2, generator=gen) * 14], -1)
    out = {}
    for fused in (False, True):
        c, p = coeffs.clone().to(DEV).requires_grad_(), protos.clone().to(DEV).requires_grad_()
        loss, npos = mask_loss(c, p, masks.to(DEV), fg.to(DEV), gt_idx.to(DEV), boxes.to(DEV),
                               image_size=(4 * hm, 4 * wm), num_slots=M * 10, fused=fused)
        out[fused] = (loss.detach(), npos, *torch.autograd.grad(loss, (c, p)))
    assert float(out[False][0]) > 0 and torch.equal(out[False][1], out[True][1])
    assert_trees_all_close(out[True], out[False], rtol=1e-5, atol=1e-6)


def test_mask_loss_fused_true_rejects_per_instance_masks():
    from yolo_func.losses.mask import mask_loss

    B, A = 1, 4
    with pytest.raises(ValueError, match="overlap map"):
        mask_loss(torch.randn(B, A, 2, device=DEV), torch.randn(B, 2, 8, 8, device=DEV), torch.rand(B, 2, 8, 8, device=DEV),
                  torch.ones(B, A, dtype=torch.bool, device=DEV), torch.zeros(B, A, dtype=torch.int64, device=DEV),
                  torch.tensor([[[0.0, 0.0, 16.0, 16.0]] * A], device=DEV), image_size=(32, 32), num_slots=4, fused=True)
