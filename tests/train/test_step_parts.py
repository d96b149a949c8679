"""The building blocks of the eager step: flat_vjp, first_order, loss_grad (CPU)."""

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from yolo_func import tree as T
from yolo_func import yolov8
from yolo_func.assign import assign_from_detect
from yolo_func.testing.synthetic import synthetic_batch
from yolo_func.func import first_order, flat_vjp
from yolo_func.testing import assert_trees_all_close, assert_trees_all_equal
from yolo_func.train.step import head_vjp, loss_grad, network_vjp


def _fn(p, q):
    """Nested-dict primals, a NamedTuple-free tuple output, and an aux that is a dict."""
    y = torch.tanh(p["a"]["w"] @ q["x"]) * p["b"]
    z = (p["a"]["w"] ** 2).sum() + q["x"].sin().sum()
    return (y, {"z": z}), {"count": torch.ones(())}


@settings(deadline=None, max_examples=20)
@given(st.integers(1, 4), st.integers(1, 4), st.integers(0, 10_000))
def test_flat_vjp_equals_torch_func_vjp(n, m, seed):
    g = torch.Generator().manual_seed(seed)
    p = {"a": {"w": torch.randn(n, m, generator=g, dtype=torch.float64)}, "b": torch.randn(n, 1, generator=g, dtype=torch.float64)}
    q = {"x": torch.randn(m, 3, generator=g, dtype=torch.float64)}
    ct = (torch.randn(n, 3, generator=g, dtype=torch.float64), {"z": torch.randn((), generator=g, dtype=torch.float64)})
    out, pb, aux = flat_vjp(_fn, p, q)
    out_ref, pb_ref, aux_ref = torch.func.vjp(_fn, p, q, has_aux=True)
    T.tree_map(lambda a, b: torch.testing.assert_close(a, b, rtol=0, atol=0), out, out_ref)
    T.tree_map(lambda a, b: torch.testing.assert_close(a, b, rtol=0, atol=0), aux, aux_ref)
    assert_trees_all_close(pb(ct), pb_ref(ct), rtol=1e-12, atol=1e-12, strict=True)


def test_first_order_equals_the_pullback_and_records_no_graph():
    x = torch.randn(5, dtype=torch.float64)
    y, pb = torch.func.vjp(torch.nn.functional.silu, x)
    ct = torch.randn(5, dtype=torch.float64)
    (g1,) = first_order(pb)(ct)
    (g0,) = pb(ct)
    torch.testing.assert_close(g1, g0, rtol=1e-12, atol=1e-12)
    assert g1.grad_fn is None and not g1.requires_grad


def test_network_and_head_vjp_leave_the_callers_state_untouched():
    model = yolov8("n", task="detect", num_classes=3)
    params, state = model.init(torch.Generator().manual_seed(0))
    before = T.tree_clone(state)
    images = torch.rand(2, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    feats, _, net_state = network_vjp(model, params["network"], state["network"], images)
    _, _, head_state = head_vjp(model.heads["detect"], params["heads"]["detect"], state["heads"]["detect"], feats)
    T.tree_map(lambda a, b: torch.testing.assert_close(a, b, rtol=0, atol=0), state, before)
    # ... while the returned statistics moved (momentum 0.03 towards the batch statistics)
    moved = T.tree_leaves(T.tree_map(lambda a, b: not torch.equal(a, b), net_state, before["network"]))
    assert moved and all(moved)
    with pytest.raises(AssertionError, match="not equal"):
        assert_trees_all_equal(head_state, before["heads"]["detect"])


def test_loss_grad_returns_gradients_in_the_predictions_layout():
    """The mask loss's gradient w.r.t. NHWC prototypes comes back NHWC (a captured head replays its
    backward on cotangent buffers laid out like its outputs; eager must see the same layout)."""
    model = yolov8("n", task="segment", num_classes=3)
    params, state = model.init(torch.Generator().manual_seed(0))
    batch = synthetic_batch("segment", 2, 64, num_classes=3, seed=2)
    feats, _, _ = network_vjp(model, params["network"], state["network"], batch.images)
    preds = {name: head_vjp(h, params["heads"][name], state["heads"][name], feats)[0] for name, h in model.heads.items()}
    seg = preds["segment"]
    seg = type(seg)(seg.coeffs, seg.protos.contiguous(memory_format=torch.channels_last))
    assignment = assign_from_detect(preds["detect"], batch.targets, model.anchors(feats), reg_max=model.reg_max)
    g, loss, parts = loss_grad(model.heads["segment"], seg, batch.targets, assignment)
    assert g.protos.stride() == seg.protos.stride() and g.coeffs.stride() == seg.coeffs.stride()
    assert torch.isfinite(loss) and loss.grad_fn is None and set(parts) == {"seg"}
    # same values as the plain (NCHW) prediction's gradient
    g_plain, _, _ = loss_grad(model.heads["segment"], preds["segment"], batch.targets, assignment)
    torch.testing.assert_close(g.protos, g_plain.protos, rtol=0, atol=0)
