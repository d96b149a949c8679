"""Flat buffers (yolo_func.optim.flat): recognition of flat-backed leaves, and bitwise equality of
the optimizer / guard / EMA with and without it over several steps."""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from yolo_func import tree as T
from yolo_func.optim import (adamw, apply_if_finite, apply_updates, chain, clip_by_global_norm, ema, flat,
                             multi_steps, partition, sgd, yolo_param_labels)
from yolo_func.optim.base import set_host_flags
from yolo_func.testing import assert_trees_all_equal

from optim_helpers import random_grads, small_params


@contextlib.contextmanager
def recognition(on: bool):
    old = flat.set_enabled(on)
    try:
        yield
    finally:
        flat.set_enabled(old)


def test_flat_base_recognises_exact_tilings_only():
    buf = torch.arange(10.0)
    a, b = buf[:6].view(2, 3), buf[6:]
    assert flat.flat_base([a, b]) is buf
    assert flat.flat_base([b, a]) is None                    # out of order
    assert flat.flat_base([a]) is None                       # does not cover the buffer
    assert flat.flat_base([a.t(), b]) is None                # not in memory order
    assert flat.flat_base([torch.ones(2, 3), b]) is None     # a fresh tensor
    assert flat.flat_base([]) is None
    nhwc = torch.arange(24.0)
    cl = nhwc.view(1, 2, 3, 4).permute(0, 3, 1, 2)           # channels_last (1, 4, 2, 3) view
    assert cl.is_contiguous(memory_format=torch.channels_last)
    assert flat.flat_base([cl]) is nhwc


def test_leafwise_output_is_flat_backed_and_then_not_copied():
    leaves = [torch.randn(2, 3), torch.randn(4), torch.randn(()), torch.randn(3, dtype=torch.float64)]
    out = flat.leafwise(lambda x: x * 2, leaves)
    assert [x.shape for x in out] == [x.shape for x in leaves]
    f32 = [out[0], out[1]]
    base = flat.flat_base(f32)
    assert base is not None and base.numel() == 10
    cats = []

    class Spy(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            cats.append(str(func))
            return func(*args, **(kwargs or {}))

    with Spy():
        again = flat.leafwise(lambda x, y: torch.where(x > 0, x, y), f32, f32)
    assert "aten.cat.default" not in cats and "aten.view.default" in cats   # views out, no copy in
    assert torch.equal(again[0], torch.where(out[0] > 0, out[0], out[0]))


def _leaf(shape, dtype, layout, gen):
    x = torch.randn(shape, generator=gen).to(dtype)
    if layout == "cl" and x.dim() == 4:
        x = x.contiguous(memory_format=torch.channels_last)
    if layout == "t" and x.dim() == 2:
        x = x.t()
    return x


shapes = st.lists(st.sampled_from([(), (3,), (2, 5), (4, 3, 2, 2), (1, 1), (7,)]), min_size=1, max_size=6)


@settings(max_examples=25)
@given(shapes=shapes, dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
       layout=st.sampled_from(["c", "cl", "t"]), seed=st.integers(0, 2**31 - 1), w=st.floats(0.0, 1.0))
def test_leafwise_equals_the_per_leaf_op_bitwise(shapes, dtype, layout, seed, w):
    gen = torch.Generator().manual_seed(seed)
    a = [_leaf(s, dtype, layout, gen) for s in shapes]
    b = [_leaf(s, dtype, layout, gen) for s in shapes]
    a[0] = a[0].clone().fill_(float("nan")) if a[0].numel() else a[0]
    flag = torch.tensor(seed % 2 == 0)
    for fn in (lambda x, y: torch.where(flag, x, y), lambda x, y: torch.lerp(x, y, torch.tensor(w, dtype=x.dtype))):
        first = flat.leafwise(fn, a, b)
        second = flat.leafwise(fn, first, first)                       # recognised input
        with recognition(False):
            ref_first = T.flat_leafwise(fn, a, b)
            ref_second = T.flat_leafwise(fn, ref_first, ref_first)
        for x, y in zip(first + second, ref_first + ref_second):
            assert x.shape == y.shape and x.stride() == y.stride() and x.dtype == y.dtype
            assert torch.equal(x.nan_to_num(7.0), y.nan_to_num(7.0))
    per_leaf = [torch.where(flag, x, y) for x, y in zip(a, b)]
    for x, y in zip(flat.leafwise(lambda x, y: torch.where(flag, x, y), a, b), per_leaf):
        assert torch.equal(x.nan_to_num(7.0), y.nan_to_num(7.0))


@settings(max_examples=25)
@given(shapes=shapes, dtype=st.sampled_from([torch.float32, torch.float64, torch.int64]),
       layout=st.sampled_from(["c", "cl", "t"]), seed=st.integers(0, 2**31 - 1), fresh=st.sampled_from(["a", "b", "ab"]))
def test_leafwise_written_into_its_own_buffer_equals_the_per_leaf_op_and_leaves_inputs_alone(shapes, dtype, layout,
                                                                                            seed, fresh):
    """fn_out (the out= form): results equal the per-leaf op bitwise (NaN in the unchosen side
    included), are flat-backed, and neither input list is written (the buffer written is one this
    call allocated), whichever of the lists is recognised."""
    gen = torch.Generator().manual_seed(seed)
    mk = (lambda s: _leaf(s, dtype, layout, gen)) if dtype.is_floating_point else (
        lambda s: torch.randint(-9, 9, s, generator=gen))
    a, b = [mk(s) for s in shapes], [mk(s) for s in shapes]
    if dtype.is_floating_point and b[0].numel():
        b[0] = b[0].clone().fill_(float("nan"))
    if "a" not in fresh:
        a = flat.leafwise(lambda x: x.clone(), a)        # recognised (flat-backed) on the way in
    if "b" not in fresh:
        b = flat.leafwise(lambda x: x.clone(), b)
    a0, b0 = [x.clone() for x in a], [x.clone() for x in b]
    flag = torch.tensor(True)
    cats = []

    class Spy(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            cats.append(str(func))
            return func(*args, **(kwargs or {}))

    with Spy():
        got = flat.leafwise(lambda x, y: torch.where(flag, x, y), a, b,
                            fn_out=lambda x, y, out: torch.where(flag, x, y, out=out))
    for x, y, x0, y0, r in zip(a, b, a0, b0, got):
        assert torch.equal(x, x0) and torch.equal(y.nan_to_num(7.0), y0.nan_to_num(7.0))   # inputs untouched
        assert r.shape == x.shape and r.stride() == x.stride() and r.dtype == x.dtype
        assert torch.equal(r, torch.where(flag, x0, y0))
    dense = [r for r, x in zip(got, a) if r.dim() and flat._has_flat_view(x)]
    if dense and dtype.is_floating_point and len({r.dtype for r in dense}) == 1:
        assert flat.flat_base(dense) is not None
        # the owned-buffer path: no concatenation of the fresh list, no second set of views
        assert "aten.cat.default" not in cats or fresh == "ab"


def _yolo_like(lr, momentum, wd, every):
    groups = {"decay": sgd(lr, momentum, nesterov=True, weight_decay=wd),
              "no_decay": sgd(lr, momentum, nesterov=True), "bias": sgd(lr, momentum, nesterov=False)}
    return multi_steps(chain(clip_by_global_norm(10.0), partition(groups, yolo_param_labels)), every=every)


def _adamw_groups(lr, wd):
    return partition({"decay": adamw(lr, weight_decay=wd), "no_decay": adamw(lr, weight_decay=0.0),
                      "bias": adamw(lr, weight_decay=0.0)}, yolo_param_labels)


def _run(tx, params, n, seed, channels_last):
    """n guarded steps + EMA (one non-finite step in the middle); returns every state along the way."""
    if channels_last:
        params = T.tree_map(lambda p: p.contiguous(memory_format=torch.channels_last) if p.dim() == 4 else p, params)
    guard, e = apply_if_finite(tx), ema()
    state = guard.init(params)
    es = e.init({"params": params})
    gen = torch.Generator().manual_seed(seed)
    seen = []
    for i in range(n):
        grads = random_grads(params, gen, scale=3.0)
        if i == n // 2:
            grads["head"]["pred"]["bias"][0] = float("nan")
        u, state = guard.update(grads, state, params, finite=torch.tensor(i != 1))
        params = apply_updates(params, u)
        es = e.update({"params": params}, es, stepped=state.stepped)
        seen.append((u, params, state, es))
    return seen


@pytest.mark.parametrize("kind", ["sgd", "adamw"])
@settings(max_examples=6, deadline=None)
@given(lr=st.floats(1e-4, 0.1), momentum=st.floats(0.5, 0.99), wd=st.sampled_from([0.0, 5e-4, 0.05]),
       every=st.integers(1, 3), dtype=st.sampled_from([torch.float32, torch.float64]),
       channels_last=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_guarded_optimizer_and_ema_are_bitwise_equal_with_flat_buffers(kind, lr, momentum, wd, every, dtype,
                                                                       channels_last, seed):
    tx = _yolo_like(lr, momentum, wd, every) if kind == "sgd" else _adamw_groups(lr, wd)
    params = small_params(seed % 1000, dtype)
    host = _run(tx, params, 7, seed, channels_last)  # CPU fast path: flags read on the host
    old_flags = set_host_flags(False)  # the device form (as on a GPU): selects over flat buffers
    try:
        new = _run(tx, params, 7, seed, channels_last)
        with recognition(False):
            old = _run(tx, params, 7, seed, channels_last)
    finally:
        set_host_flags(old_flags)
    for a, b, c in zip(new, old, host):
        assert_trees_all_equal(a, b, strict=True)
        assert_trees_all_equal(c, b, strict=True)
    # The device form's carried state lives in flat buffers after a step (what the next step reads
    # without a copy).
    _, _, state, es = new[-1]
    floats = [x for x in T.tree_leaves(state.inner_state) if x.is_floating_point() and x.dim() > 0]
    assert flat.flat_base(floats) is not None
    assert flat.flat_base([x for x in T.tree_leaves(es.ema) if x.is_floating_point()]) is not None


def test_in_place_copies_into_flat_backed_state_keep_the_buffer():
    """A captured step writes its new carry into the static carry with tree_copy_: the leaves stay
    views of the same buffer (no reallocation), and the buffer holds the new values."""
    params = small_params(0)
    guard = apply_if_finite(_yolo_like(0.01, 0.9, 5e-4, 1))
    state = guard.init(params)
    floats = [x for x in T.tree_leaves(state.inner_state) if x.is_floating_point() and x.dim() > 0]
    base = flat.flat_base(floats)
    assert base is not None
    ptr = base.data_ptr()
    old_flags = set_host_flags(False)  # a captured step runs the device form
    try:
        _, new_state = guard.update(random_grads(params, torch.Generator().manual_seed(1)), state, params)
    finally:
        set_host_flags(old_flags)
    T.tree_copy_(state, new_state)
    assert flat.flat_base(floats) is base and base.data_ptr() == ptr
    assert_trees_all_equal(state.inner_state, new_state.inner_state)
