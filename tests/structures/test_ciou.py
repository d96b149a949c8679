"""The fused CIoU (hand-derived backward) against autograd through the readable ``bbox_iou``."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from yolo_func.structures import bbox_iou, ciou

coord = st.floats(-50, 50, allow_nan=False).map(lambda v: round(v, 1))  # coarse: ties happen
side = st.floats(0.0, 40, allow_nan=False).map(lambda v: round(v, 1))  # zero width/height too


@st.composite
def box_pairs(draw, n=8):
    vals = draw(st.lists(st.tuples(coord, coord, side, side), min_size=2 * n, max_size=2 * n))
    t = torch.tensor(vals, dtype=torch.float64)
    boxes = torch.cat((t[:, :2], t[:, :2] + t[:, 2:]), -1)
    p, q = boxes[:n].clone(), boxes[n:].clone()
    # equal boxes, shared edges, touching boxes: the kinks of min / max / clamp
    k = draw(st.integers(0, 3))
    if k == 1:
        q[:2] = p[:2]
    elif k == 2:
        q[:, 0] = p[:, 2]  # touching: intersection width exactly 0
    elif k == 3:
        q[:, 1], q[:, 3] = p[:, 1], p[:, 3]  # shared top and bottom edges
    return p, q


@settings(max_examples=60, deadline=None)
@given(box_pairs(), st.sampled_from([torch.float32, torch.float64]))
def test_forward_is_bbox_iou_bitwise(pair, dtype):
    p, q = (x.to(dtype) for x in pair)
    assert torch.equal(ciou(p, q), bbox_iou(p, q, kind="ciou"))
    # broadcast as the assigner calls it: [M, 1, 4] targets against [1, N, 4] predictions
    assert torch.equal(ciou(q[:, None], p[None]), bbox_iou(q[:, None], p[None], kind="ciou"))


@settings(max_examples=60, deadline=None)
@given(box_pairs())
def test_gradient_is_autograds(pair):
    """float64, so the comparison tests the derivation, not float32 rounding; same tie rules."""
    p, q = pair
    g = torch.linspace(-1, 1, p.shape[0], dtype=torch.float64)
    p1 = p.clone().requires_grad_(True)
    p2 = p.clone().requires_grad_(True)
    (want,) = torch.autograd.grad(bbox_iou(p1, q, kind="ciou"), p1, g)
    (got,) = torch.autograd.grad(ciou(p2, q), p2, g)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


def test_float32_gradient_close_and_broadcast_reduced():
    gen = torch.Generator().manual_seed(0)
    xy = torch.rand(64, 2, generator=gen) * 100
    p = torch.cat((xy, xy + torch.rand(64, 2, generator=gen) * 50), -1)
    q = p + torch.randn(64, 4, generator=gen) * 5
    a = p.clone().requires_grad_(True)
    b = p.clone().requires_grad_(True)
    (want,) = torch.autograd.grad(bbox_iou(a, q, kind="ciou").sum(), a)
    (got,) = torch.autograd.grad(ciou(b, q).sum(), b)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    # one prediction against many targets: the gradient is summed back to the prediction's shape
    one = p[:1].clone().requires_grad_(True)
    (g1,) = torch.autograd.grad(ciou(one, q).sum(), one)
    ref = p[:1].clone().requires_grad_(True)
    (g2,) = torch.autograd.grad(bbox_iou(ref, q, kind="ciou").sum(), ref)
    assert g1.shape == (1, 4)
    torch.testing.assert_close(g1, g2, rtol=1e-4, atol=1e-6)


def test_target_gets_no_gradient_and_torch_func_works():
    p = torch.tensor([[0.0, 0.0, 4.0, 3.0]], dtype=torch.float64)
    q = torch.tensor([[1.0, 0.5, 5.0, 4.0]], dtype=torch.float64, requires_grad=True)
    out = ciou(p.requires_grad_(True), q)
    (gp, gq) = torch.autograd.grad(out.sum(), (p, q), allow_unused=True)
    assert gq is None and gp is not None
    g_func = torch.func.grad(lambda x: ciou(x, q.detach()).sum())(p.detach())
    torch.testing.assert_close(g_func, gp)


def test_vmap_of_grad_equals_the_batched_gradient():
    gen = torch.Generator().manual_seed(1)
    xy = torch.rand(3, 5, 2, generator=gen, dtype=torch.float64) * 20
    p = torch.cat((xy, xy + 1 + torch.rand(3, 5, 2, generator=gen, dtype=torch.float64) * 9), -1)
    q = p + torch.randn(3, 5, 4, generator=gen, dtype=torch.float64)
    per_row = torch.func.vmap(torch.func.grad(lambda a, b: ciou(a, b).sum()))(p, q)
    x = p.clone().requires_grad_(True)
    (batched,) = torch.autograd.grad(ciou(x, q).sum(), x)
    torch.testing.assert_close(per_row, batched, rtol=1e-12, atol=1e-14)


def test_identical_boxes_give_one_and_bad_shape_raises():
    b = torch.tensor([[2.0, 3.0, 7.0, 9.0]])
    torch.testing.assert_close(ciou(b, b), torch.ones(1))
    with pytest.raises(ValueError, match="end in 4"):
        ciou(torch.zeros(2, 3), torch.zeros(2, 4))
