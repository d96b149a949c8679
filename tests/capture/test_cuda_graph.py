"""capture_vjp on a GPU: the captured YOLOv8n network forward+pullback is bitwise equal to the eager
``torch.func.vjp`` step by step (outputs, gradients, SGD-updated parameters, BN statistics), in fp32,
bf16 autocast and channels_last; signature mismatches raise; warm-up leaves no trace; RNG replays.

Numerics settings (set by the fixture for eager and capture alike; they are frozen into the graphs at
capture time, so they must match for bitwise parity): cudnn.benchmark False, cudnn.deterministic
True, TF32 off and deterministic algorithms (tests/conftest.py).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from yolo_func import tree as T
from yolo_func import yolov8
from yolo_func.capture import CaptureMismatch, capture_vjp, num_captures
from yolo_func.func import first_order
from yolo_func.nn import update_stats_in_place
from yolo_func.testing import assert_trees_all_equal

pytestmark = [pytest.mark.cuda, pytest.mark.filterwarnings("error::yolo_func.train.replay.CaptureFallbackWarning")]

CL = torch.channels_last
B, H, W = 2, 128, 128
LR = 1e-3


@pytest.fixture(autouse=True)
def deterministic_cudnn():
    saved = (torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic)
    torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = False, True
    yield
    torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = saved


def _network(channels_last: bool):
    model = yolov8("n", task="detect")
    params, state = model.init(torch.Generator().manual_seed(0))
    params = T.tree_to(params["network"], "cuda", channels_last=channels_last)
    state = T.tree_to(state["network"], "cuda")

    def fn(p, s, x):
        return model.network.apply(p, s, x, train=True)

    return fn, params, state


def _layout(x: torch.Tensor, channels_last: bool) -> torch.Tensor:
    return x.contiguous(memory_format=CL) if channels_last else x


def _image(gen: torch.Generator, channels_last: bool) -> torch.Tensor:
    return _layout(torch.rand(B, 3, H, W, generator=gen).to("cuda"), channels_last)


def _cotangents(outs, gen: torch.Generator):
    # drawn on the CPU (device independent), laid out and typed like the outputs
    return T.tree_map(lambda o: torch.empty_like(o).copy_(torch.randn(o.shape, generator=gen)), outs)


def _eager(fn, params, state, x, autocast_dtype):
    ctx = torch.autocast("cuda", dtype=autocast_dtype) if autocast_dtype is not None else contextlib.nullcontext()
    with ctx:
        outs, vjp_fn, new_state = torch.func.vjp(lambda p: fn(p, state, x), params, has_aux=True)
    # capture_vjp records a first-order backward (native kernels); its eager counterpart is the
    # pullback under no_grad. (With grad enabled autograd picks differentiable decompositions —
    # e.g. SiLU's backward in five BF16 ops — whose roundings differ.)
    return outs, first_order(vjp_fn), new_state


def _assert_equal(a, b, what: str, step: int):
    try:
        assert_trees_all_equal(a, b, strict=True)
    except AssertionError as err:
        raise AssertionError(f"step {step}: {what}: {err}") from None


def _ids(tree) -> list[int]:
    """The leaves' identities, in order (a list: compared whole, never truncated)."""
    return [id(x) for x in T.tree_leaves(tree)]


def _sgd_(params, grads):
    torch._foreach_add_(T.tree_leaves(params), T.tree_leaves(grads), alpha=-LR)


@pytest.mark.parametrize(
    "autocast_dtype, channels_last",
    [(torch.bfloat16, False), (None, False), (torch.bfloat16, True)],
    ids=["bf16", "fp32", "bf16-channels_last"],
)
def test_captured_yolov8n_equals_eager_vjp_over_sgd_steps(autocast_dtype, channels_last):
    fn, params, state = _network(channels_last)
    data = torch.Generator().manual_seed(1)
    xs = [_image(data, channels_last) for _ in range(5)]
    given_params, given_state = T.tree_clone(params), T.tree_clone(state)

    # eager must be reproducible on its own, or no replay can be bitwise equal to it
    o1, f1, _ = _eager(fn, params, state, xs[0], autocast_dtype)
    o2, f2, _ = _eager(fn, params, state, xs[0], autocast_dtype)
    ct = _cotangents(o1, torch.Generator().manual_seed(2))
    _assert_equal(o1, o2, "eager outputs (two identical runs)", -1)
    _assert_equal(f1(ct)[0], f2(ct)[0], "eager gradients (two identical runs)", -1)
    del o1, o2, f1, f2

    n0 = num_captures()
    cap = capture_vjp(fn, params, state, xs[0], autocast_dtype=autocast_dtype, forward_context=update_stats_in_place)
    assert num_captures() == n0 + 1
    # capture works on copies and leaves no trace: the given trees and the static state are as given
    _assert_equal(params, given_params, "params given to capture_vjp", -1)
    _assert_equal(state, given_state, "state given to capture_vjp", -1)
    _assert_equal(cap.static.state, given_state, "static state after warm-up", -1)
    sig = dict(cap.signature.entries)
    assert sig["x"].shape == (B, 3, H, W) and sig["x"].memory_format == ("channels_last" if channels_last else "contiguous")
    assert sig["params/backbone/stem/conv/weight"].memory_format == ("channels_last" if channels_last else "contiguous")
    assert cap.signature.autocast_dtype == autocast_dtype

    p_eager, s_eager = T.tree_clone(params), T.tree_clone(state)
    cot_gen = torch.Generator().manual_seed(3)
    first_outs = None
    for step, x in enumerate(xs):
        outs_e, vjp_fn, s_new = _eager(fn, p_eager, s_eager, x, autocast_dtype)
        d_outs = _cotangents(outs_e, cot_gen)
        (g_eager,) = vjp_fn(d_outs)

        # step 0 passes fresh trees (copied in); later steps the static trees (nothing but x copied)
        p_in, s_in = (params, state) if step == 0 else (cap.static.params, cap.static.state)
        outs_c, s_c = cap.forward(p_in, s_in, x)
        n_leaves = len(T.tree_leaves(params)) + len(T.tree_leaves(state)) + 1
        assert cap.stats.leaves_copied == (n_leaves if step == 0 else 1)  # later: only the image
        if first_outs is None:
            first_outs = outs_c
        assert _ids(outs_c) == _ids(first_outs)  # static, aliased
        assert _ids(s_c) == _ids(cap.static.state)  # BN in place
        _assert_equal(outs_c, outs_e, "outputs", step)
        _assert_equal(cap.static.state, s_new, "BN statistics", step)

        g_c = cap.backward(d_outs)
        assert g_c is cap.static.grads
        _assert_equal(g_c, g_eager, "gradients", step)

        _sgd_(p_eager, g_eager)
        _sgd_(cap.static.params, g_c)
        s_eager = s_new
        _assert_equal(cap.static.params, p_eager, "parameters after SGD", step)

    assert num_captures() == n0 + 1  # five steps, one capture
    assert (cap.stats.forward_replays, cap.stats.backward_replays) == (5, 5)
    # the given trees were copied in at step 0, never written
    _assert_equal(params, given_params, "params given to forward()", 5)

    # another image size, dtype or layout is refused, not re-captured
    with pytest.raises(CaptureMismatch, match=r"x: \(2, 3, 160, 128\) != captured \(2, 3, 128, 128\)"):
        cap.forward(cap.static.params, cap.static.state, _layout(torch.zeros(B, 3, 160, W, device="cuda"), channels_last))
    other = torch.zeros(B, 3, H, W, device="cuda").contiguous(memory_format=torch.contiguous_format if channels_last else CL)
    with pytest.raises(CaptureMismatch, match="x: (channels_last|contiguous) != captured"):
        cap.forward(cap.static.params, cap.static.state, other)
    assert num_captures() == n0 + 1 and cap.stats.forward_replays == 5


# ---- small functions: ordering, pools, RNG ------------------------------------------------------
def _tiny(p, s, x):
    return (torch.sin(F.conv2d(x, p["w"])),), s


def _tiny_inputs():
    gen = torch.Generator().manual_seed(0)
    return {"w": torch.randn(4, 3, 3, 3, generator=gen).cuda()}, {}, torch.randn(2, 3, 8, 8, generator=gen).cuda()


def test_backward_before_forward_and_interleaved_pool_replays_raise():
    p, s, x = _tiny_inputs()
    pool = torch.cuda.graph_pool_handle()
    n0 = num_captures()
    a = capture_vjp(_tiny, p, s, x, pool=pool)
    b = capture_vjp(_tiny, p, s, x, pool=pool)
    assert num_captures() == n0 + 2
    ct = (torch.ones(2, 4, 6, 6, device="cuda"),)
    with pytest.raises(RuntimeError, match="before any forward"):
        a.backward(ct)
    a.forward(p, s, x)
    b.forward(p, s, x)
    with pytest.raises(RuntimeError, match="another capture sharing this memory pool"):
        a.backward(ct)
    g_b = b.backward(ct)
    # reference: the eager pullback of the same function
    _, vjp_fn, _ = torch.func.vjp(lambda q: _tiny(q, s, x), p, has_aux=True)
    torch.testing.assert_close(g_b["w"], vjp_fn(ct)[0]["w"], rtol=0, atol=0)
    with pytest.raises(CaptureMismatch, match=r"d_outputs/0: \(2, 4, 5, 6\) != captured \(2, 4, 6, 6\)"):
        b.backward((torch.ones(2, 4, 5, 6, device="cuda"),))


def test_registered_generator_replays_fresh_draws_like_eager_and_warmup_leaves_it_untouched():
    def dropout_fn(gen):
        def fn(p, s, x):
            keep = torch.rand(x.shape, device=x.device, generator=gen) > 0.5
            return (x * p["w"] * keep,), s
        return fn

    p = {"w": torch.full((16,), 2.0, device="cuda")}
    x = torch.arange(64.0, device="cuda").reshape(4, 16)
    g_cap = torch.Generator(device="cuda").manual_seed(7)
    g_eager = torch.Generator(device="cuda").manual_seed(7)
    before = g_cap.get_state()
    n0 = num_captures()
    cap = capture_vjp(dropout_fn(g_cap), p, {}, x, generators=(g_cap,))
    assert torch.equal(g_cap.get_state(), before)  # warm-up draws were rolled back
    masks = []
    for _ in range(3):
        (y_c,), _ = cap.forward(p, {}, x)
        (y_e,), vjp_fn, _ = torch.func.vjp(lambda q: dropout_fn(g_eager)(q, {}, x), p, has_aux=True)
        torch.testing.assert_close(y_c, y_e, rtol=0, atol=0)
        g_c = cap.backward((torch.ones_like(y_c),))
        torch.testing.assert_close(g_c["w"], vjp_fn((torch.ones_like(y_e),))[0]["w"], rtol=0, atol=0)
        masks.append(y_c != 0)
    assert num_captures() == n0 + 1  # three replays of one capture
    assert not torch.equal(masks[0], masks[1])  # each replay draws anew
    assert torch.equal(g_cap.get_state(), g_eager.get_state())  # and advances the stream like eager
