"""capture/signature.py, binder.py and vjp.py on the CPU: signatures, mismatch messages, the copy-in
of static buffers, forward/backward ordering (with stand-in graphs), CaptureUnavailable."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from yolo_func import tree as T
from yolo_func._types import Feats
from yolo_func.capture import (
    Captured,
    CaptureMismatch,
    CaptureStats,
    CaptureUnavailable,
    StaticBuffers,
    TensorSpec,
    capture_vjp,
    memory_format_of,
    num_captures,
    signature_of,
)
from yolo_func.capture import binder as cg_binder
from yolo_func.capture import vjp as cg_vjp
from yolo_func.testing import assert_trees_all_equal

CL = torch.channels_last


def _trees(x_shape=(2, 3, 8, 8), dtype=torch.float32, device="cpu"):
    params = {"conv": {"weight": torch.zeros(4, 3, 3, 3, dtype=dtype, device=device)},
              "bn": {"weight": torch.ones(4, device=device), "bias": torch.zeros(4, device=device)}}
    state = {"bn": {"running_mean": torch.zeros(4, device=device), "running_var": torch.ones(4, device=device)}}
    return params, state, torch.zeros(x_shape, device=device)


# ---- memory formats ---------------------------------------------------------------------------
def test_memory_format_names_follow_the_layout():
    x = torch.zeros(2, 3, 4, 5)
    assert memory_format_of(x) == "contiguous"
    assert memory_format_of(x.contiguous(memory_format=CL)) == "channels_last"
    assert memory_format_of(x.transpose(2, 3)) == "strided"
    assert memory_format_of(torch.zeros(7)) == "contiguous"
    # a 1x1 kernel is both contiguous and channels_last by torch's test; its strides tell the layout apart
    k = torch.zeros(8, 4, 1, 1)
    assert k.is_contiguous() and k.contiguous(memory_format=CL).is_contiguous()
    assert memory_format_of(k) == "contiguous"
    assert memory_format_of(k.contiguous(memory_format=CL)) == "contiguous"  # a no-op: strides (4, 1, 1, 1)
    assert memory_format_of(k.to(memory_format=CL)) == "channels_last"  # strides (4, 1, 4, 4)
    # with one channel both layouts are the same memory: called contiguous either way
    assert memory_format_of(torch.zeros(2, 1, 4, 4).contiguous(memory_format=CL)) == "contiguous"


# ---- signatures -------------------------------------------------------------------------------
def test_equal_inputs_give_equal_hashable_signatures():
    a = signature_of(*_trees())
    b = signature_of(*_trees())  # other tensors, same specs
    assert a == b and hash(a) == hash(b)
    assert a.differences(b) == []
    assert {a: 1}[b] == 1  # usable as a cache key
    paths = [p for p, _ in a.entries]
    assert paths == ["params/bn/bias", "params/bn/weight", "params/conv/weight",
                     "state/bn/running_mean", "state/bn/running_var", "x"]
    assert dict(a.entries)["x"] == TensorSpec((2, 3, 8, 8), torch.float32, "cpu", "contiguous")


@pytest.mark.parametrize(
    "change, line",
    [
        (lambda p, s, x: (p, s, torch.zeros(2, 3, 16, 8)), "x: (2, 3, 16, 8) != captured (2, 3, 8, 8)"),
        (lambda p, s, x: (p, s, x.double()), "x: float64 != captured float32"),
        (lambda p, s, x: (p, s, x.contiguous(memory_format=CL)), "x: channels_last != captured contiguous"),
        (lambda p, s, x: (p, s, x.to("meta")), "x: meta != captured cpu"),
        (lambda p, s, x: ({**p, "extra": torch.zeros(1)}, s, x), "params/extra: not in the captured inputs"),
        (lambda p, s, x: (p, {"bn": {"running_mean": s["bn"]["running_mean"]}}, x),
         "state/bn/running_var: missing (the capture has it)"),
        (lambda p, s, x: (p, s, (x,)), "x/0: not in the captured inputs"),
    ],
    ids=["shape", "dtype", "memory_format", "device", "extra_leaf", "missing_leaf", "container"],
)
def test_signatures_differ_and_name_the_entry(change, line):
    base = signature_of(*_trees())
    other = signature_of(*change(*_trees()))
    assert other != base
    assert line in other.differences(base)


def test_same_leaves_in_other_containers_still_differ():
    p, s, x = _trees()
    a = signature_of(p, s, (x, x))
    b = signature_of(p, s, [x, x])  # same paths "x/0", "x/1"; list vs tuple
    assert a != b
    (line,) = b.differences(a)
    assert line.startswith("x: tree structure")


def test_autocast_dtype_is_part_of_the_signature():
    a = signature_of(*_trees())
    b = signature_of(*_trees(), autocast_dtype=torch.bfloat16)
    assert a != b and b.differences(a) == ["autocast: bfloat16 != captured None"]
    with pytest.raises(ValueError, match="autocast_dtype"):
        signature_of(*_trees(), autocast_dtype=torch.float32)


def test_non_tensor_leaves_are_rejected():
    p, s, x = _trees()
    with pytest.raises(TypeError, match=r"\[yolo_func\] params/lr: expected a torch.Tensor leaf, got float"):
        signature_of({**p, "lr": 0.1}, s, x)


@settings(max_examples=30)
@given(a=st.tuples(st.integers(1, 4), st.integers(1, 4)), b=st.tuples(st.integers(1, 4), st.integers(1, 4)),
       da=st.sampled_from([torch.float32, torch.bfloat16]), db=st.sampled_from([torch.float32, torch.bfloat16]))
def test_signature_equality_is_spec_equality(a, b, da, db):
    p, s, _ = _trees()
    sa = signature_of(p, s, torch.zeros(a, dtype=da))
    sb = signature_of(p, s, torch.zeros(b, dtype=db))
    same = a == b and da == db
    assert (sa == sb) == same
    assert (sb.differences(sa) == []) == same


# ---- mismatch errors and the copy-in ----------------------------------------------------------
def _binder(p, s, x):
    return cg_binder.Binder({"params": p, "state": s, "x": x}, None, what="inputs")


def test_mismatch_message_shows_the_differing_entry_first_and_both_signatures():
    # meta tensors: the shapes of the example without allocating them
    p, s, _ = _trees(device="meta")
    binder = _binder(p, s, torch.empty(16, 3, 640, 640, device="meta"))
    with pytest.raises(CaptureMismatch) as info:
        binder.load(p, s, torch.empty(16, 3, 672, 672, device="meta"))
    err = info.value
    assert isinstance(err, ValueError)
    msg = str(err)
    assert msg.startswith("[yolo_func] ")
    line = "x: (16, 3, 672, 672) != captured (16, 3, 640, 640)"
    assert err.differences == [line]
    assert msg.index(line) < msg.index("\ncall signature") < msg.index("\ncaptured signature")
    assert "  x: (16, 3, 672, 672) float32 meta contiguous" in msg
    assert "  x: (16, 3, 640, 640) float32 meta contiguous" in msg
    assert err.expected == binder.signature
    assert err.got == signature_of(p, s, torch.empty(16, 3, 672, 672, device="meta"))


def test_load_copies_only_what_is_not_already_static():
    p, s, x = _trees()
    binder = _binder(T.tree_clone(p), T.tree_clone(s), T.tree_clone(x))
    static_p, static_s, static_x = (binder.static[k] for k in ("params", "state", "x"))
    gen = torch.Generator().manual_seed(0)
    new_x = torch.randn(2, 3, 8, 8, generator=gen)
    new_w = torch.randn(4, 3, 3, 3, generator=gen)
    p2 = {"conv": {"weight": new_w}, "bn": static_p["bn"]}  # one new leaf, the others static
    assert binder.load(p2, static_s, new_x) == 2
    assert torch.equal(static_x, new_x) and torch.equal(static_p["conv"]["weight"], new_w)
    assert static_x is binder.static["x"]  # written in place, never rebound
    # the static trees themselves, or aliases of their leaves, copy nothing
    assert binder.load(static_p, static_s, static_x) == 0
    aliases = T.tree_map(lambda t: t.detach(), static_p)
    assert binder.load(aliases, static_s, static_x.detach()) == 0
    # a channels_last static buffer accepts channels_last inputs only, and keeps its layout
    cl = _binder(p, s, x.contiguous(memory_format=CL))
    assert cl.load(p, s, new_x.contiguous(memory_format=CL)) == 1
    assert torch.equal(cl.static["x"], new_x) and memory_format_of(cl.static["x"]) == "channels_last"


def test_a_mismatch_copies_nothing():
    p, s, x = _trees()
    binder = _binder(T.tree_clone(p), T.tree_clone(s), T.tree_clone(x))
    before = T.tree_clone(binder.static)
    with pytest.raises(CaptureMismatch):
        binder.load(T.tree_map(torch.ones_like, p), s, torch.ones(2, 3, 8, 9))  # params fine, x not
    assert_trees_all_equal(before, binder.static, strict=True)


def test_cotangents_check_shape_and_device_and_cast_dtype():
    outs = Feats(torch.zeros(2, 4, 8, 8, dtype=torch.bfloat16), torch.zeros(2, 4, 4, 4, dtype=torch.bfloat16),
                 torch.zeros(2, 4, 2, 2, dtype=torch.bfloat16))
    binder = cg_binder.Binder({"d_outputs": outs}, None, what="output cotangents", fields=("shape", "device"))
    d = Feats(*(torch.full(o.shape, 1.5) for o in outs))  # float32 cotangents: cast like autograd casts
    assert binder.load(d) == 3
    assert all(o.dtype == torch.bfloat16 and bool((o == 1.5).all()) for o in outs)
    with pytest.raises(CaptureMismatch, match=r"d_outputs/p4: \(2, 4, 5, 4\) != captured \(2, 4, 4, 4\)"):
        binder.load(Feats(d.p3, torch.zeros(2, 4, 5, 4), d.p5))
    with pytest.raises(CaptureMismatch, match="d_outputs/p5: missing"):
        binder.load((d.p3, d.p4))


# ---- forward / backward protocol (stand-in graphs on the CPU) ----------------------------------
class _FakeGraph:
    def __init__(self, work):
        self.work, self.replays = work, 0

    def replay(self):
        self.replays += 1
        self.work()


def _fake_captured(pool_token, index):
    """A Captured whose 'graphs' compute y = w * x and dL/dw = sum(dy * x) on static buffers."""
    p, s, x = {"w": torch.zeros(3)}, {}, torch.zeros(3)
    inputs = cg_binder.Binder({"params": p, "state": s, "x": x}, None, what="inputs")
    y, dy, gw = torch.zeros(3), torch.zeros(3), torch.zeros(3)
    g1 = _FakeGraph(lambda: y.copy_(p["w"] * x))
    g2 = _FakeGraph(lambda: gw.copy_(dy * x))
    static = StaticBuffers(p, s, x, (y,), s, (dy,), {"w": gw})
    stats = CaptureStats(capture_index=index)
    cot = cg_binder.Binder({"d_outputs": (dy,)}, None, what="output cotangents", fields=("shape", "device"))
    r = cg_vjp._Replay(index=index, g_fwd=g1, g_bwd=g2, inputs=inputs, cotangents=cot,
                   static=static, stats=stats, token=pool_token)
    return Captured(r.forward, r.backward, inputs.signature, static, stats, None), (g1, g2)


def test_forward_backward_replay_static_buffers_and_alias_them():
    cap, (g1, g2) = _fake_captured(cg_vjp._PoolToken(), index=1)
    with pytest.raises(RuntimeError, match=r"backward\(\) called before any forward\(\)"):
        cap.backward((torch.ones(3),))
    assert g2.replays == 0
    w, x = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([4.0, 5.0, 6.0])
    (y,), _ = cap.forward({"w": w}, {}, x)
    assert y is cap.static.outputs[0] and torch.equal(y, w * x)  # hand-computed: elementwise product
    assert cap.stats.leaves_copied == 2
    grads = cap.backward((torch.tensor([1.0, 0.0, 2.0]),))
    assert grads is cap.static.grads and torch.equal(grads["w"], torch.tensor([4.0, 0.0, 12.0]))
    # an in-place update of the static params needs no copy; the outputs are overwritten in place
    torch._foreach_add_([cap.static.params["w"]], [grads["w"]], alpha=-0.5)
    (y2,), _ = cap.forward(cap.static.params, cap.static.state, x)
    assert cap.stats.leaves_copied == 1  # only x
    assert y2 is y and torch.equal(y, torch.tensor([-1.0, 2.0, -3.0]) * x)  # w - 0.5 * g
    assert (cap.stats.forward_replays, cap.stats.backward_replays) == (2, 1) == (g1.replays, g2.replays)
    with pytest.raises(CaptureMismatch):
        cap.forward({"w": w}, {}, torch.zeros(4))
    assert g1.replays == 2  # nothing replayed for a mismatch


def test_backward_refuses_after_another_capture_of_the_pool_replayed():
    token = cg_vjp._PoolToken()
    a, _ = _fake_captured(token, index=101)
    b, _ = _fake_captured(token, index=102)
    x = torch.ones(3)
    a.forward(a.static.params, {}, x)
    b.forward(b.static.params, {}, x)
    with pytest.raises(RuntimeError, match="another capture sharing this memory pool"):
        a.backward((x,))
    b.backward((x,))  # the last forward's capture may run its backward
    a.forward(a.static.params, {}, x)
    a.backward((x,))


# ---- capture_vjp preconditions ----------------------------------------------------------------
def _fn(p, s, x):
    return (x * p["conv"]["weight"].sum(),), s


def test_capture_on_cpu_tensors_is_unavailable_with_a_reason():
    before = num_captures()
    with pytest.raises(CaptureUnavailable) as info:
        capture_vjp(_fn, *_trees())
    assert isinstance(info.value, RuntimeError)
    assert info.value.reason == "inputs are on cpu, not a CUDA device (first: params/bn/bias)"
    assert str(info.value).startswith("[yolo_func] CUDA-graph capture unavailable: inputs are on cpu")
    assert num_captures() == before


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(warmup=0), ValueError, "warmup must be an int >= 1"),
        (dict(warmup=True), ValueError, "warmup must be an int >= 1"),
        (dict(autocast_dtype=torch.float32), ValueError, "autocast_dtype"),
        (dict(generators=(torch.Generator(),)), ValueError, "generators must be CUDA generators"),
        (dict(generators=(3,)), TypeError, "generators must be torch.Generator"),
    ],
)
def test_capture_rejects_bad_arguments_before_looking_at_devices(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        capture_vjp(_fn, *_trees(), **kwargs)


def test_capture_rejects_non_callables_and_non_tensor_leaves():
    with pytest.raises(TypeError, match="fn must be callable"):
        capture_vjp(None, *_trees())
    p, s, x = _trees()
    with pytest.raises(TypeError, match="params/lr must be a torch.Tensor"):
        capture_vjp(_fn, {"lr": 0.1, **p}, s, x)
