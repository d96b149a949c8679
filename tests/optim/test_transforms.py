"""Elementary transforms, combinators and the protocol: clipping, purity, properties, no host syncs."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given
from optim_helpers import random_grads, small_params, yolo_recipe

from yolo_func import tree as T
from yolo_func.optim import (
    adamw,
    apply_updates,
    apply_updates_,
    chain,
    clip_by_global_norm,
    ema,
    global_norm,
    identity,
    multi_steps,
    partition,
    scale_by_adam,
    scale_by_learning_rate,
    sgd,
    trace,
)
from yolo_func.testing import assert_trees_all_close, assert_trees_all_equal


# -- clipping -----------------------------------------------------------------------------------


@pytest.mark.parametrize("scale", [1e-3, 1.0, 30.0])
def test_clip_equals_clip_grad_norm(scale):
    """Same numerics as torch.nn.utils.clip_grad_norm_(max_norm=10): bitwise, norm included."""
    params = small_params()
    grads = random_grads(params, torch.Generator().manual_seed(7), scale)
    tps = [torch.nn.Parameter(p.clone()) for p in T.tree_leaves(params)]
    for tp, g in zip(tps, T.tree_leaves(grads), strict=True):
        tp.grad = g.clone()
    total = torch.nn.utils.clip_grad_norm_(tps, max_norm=10.0)
    tx = clip_by_global_norm(10.0)
    clipped, state = tx.update(grads, tx.init(params))
    assert torch.equal(state.norm, total)
    assert torch.equal(global_norm(grads), total)
    assert_trees_all_equal(T.tree_leaves(clipped), [tp.grad for tp in tps], strict=True)
    # Independent check of the rule: new norm = min(norm, 10) (up to the 1e-6 guard).
    assert float(global_norm(clipped)) == pytest.approx(min(float(total), 10.0), rel=1e-5)


# -- trace / adam details -----------------------------------------------------------------------


def test_scheduled_momentum_equals_float_momentum():
    """A momentum schedule giving the constant 0.9 tracks trace(0.9) (nesterov: an unfused mul+add)."""
    params = small_params()
    const = lambda step: torch.full((), 0.9, dtype=torch.float64, device=step.device)  # noqa: E731
    for nesterov in (False, True):
        a, b = trace(0.9, nesterov), trace(const, nesterov)
        sa, sb = a.init(params), b.init(params)
        gen = torch.Generator().manual_seed(1)
        for _ in range(5):
            g = random_grads(params, gen)
            ua, sa = a.update(g, sa)
            ub, sb = b.update(g, sb)
            assert_trees_all_equal(sa.momentum, sb.momentum)  # same ops: x*0.9f + g
            assert_trees_all_close(ua, ub, rtol=1e-6, atol=1e-7)


def test_scale_by_adam_chain_equals_adamw_without_decay():
    """The optax-style chain (direction, then -lr) computes the same step as the fused adamw."""
    params = small_params()
    fused, split = adamw(1e-3, weight_decay=0.0), chain(scale_by_adam(), scale_by_learning_rate(1e-3))
    sf, ss = fused.init(params), split.init(params)
    gen = torch.Generator().manual_seed(2)
    for _ in range(10):
        g = random_grads(params, gen)
        uf, sf = fused.update(g, sf, params)
        us, ss = split.update(g, ss, params)
        assert_trees_all_close(uf, us, rtol=1e-5, atol=1e-10)
    assert_trees_all_equal(sf.mu, ss[0].mu)


# -- purity ---------------------------------------------------------------------------------------


PURE = {
    "identity": identity,
    "sgd": lambda: sgd(0.1, momentum=0.9, nesterov=True, weight_decay=1e-2),
    "adamw": lambda: adamw(1e-3, weight_decay=1e-2),
    "clip": lambda: clip_by_global_norm(0.5),
    "yolo_recipe": yolo_recipe,
}


@pytest.mark.parametrize("name", sorted(PURE))
def test_update_does_not_write_its_inputs(name):
    tx = PURE[name]()
    params = small_params()
    state = tx.init(params)
    gen = torch.Generator().manual_seed(4)
    for _ in range(4):
        grads = random_grads(params, gen)
        snap = T.tree_clone((grads, state, params))
        updates, new_state = tx.update(grads, state, params)
        assert_trees_all_equal((grads, state, params), snap)
        new_params = apply_updates(params, updates)
        assert_trees_all_equal(params, snap[2])  # apply_updates is pure too
        # No returned tensor shares storage with the caller's gradients (identity returns them).
        g_ptrs = set() if name == "identity" else {g.data_ptr() for g in T.tree_leaves(grads)}
        assert not g_ptrs & {x.data_ptr() for x in T.tree_leaves((updates, new_state)) if x.numel()}
        params, state = new_params, new_state


def test_ema_update_does_not_write_its_inputs():
    e = ema()
    model = small_params()
    state = e.init(model)
    moved = T.tree_map(lambda x: x + 1, model)
    snap = T.tree_clone((moved, state))
    e.update(moved, state)
    e.update(moved, state, stepped=torch.tensor(True))
    assert_trees_all_equal((moved, state), snap)


def test_apply_updates_in_place_keeps_storage():
    params = small_params()
    updates = random_grads(params, torch.Generator().manual_seed(5))
    want = apply_updates(params, updates)
    ptrs = [p.data_ptr() for p in T.tree_leaves(params)]
    out = apply_updates_(params, updates)
    assert out is params and [p.data_ptr() for p in T.tree_leaves(params)] == ptrs
    assert_trees_all_equal(params, want)


def test_structure_errors_name_paths():
    params = small_params()
    bad = dict(params, extra={"weight": torch.zeros(1)})
    with pytest.raises(ValueError, match=r"^\[yolo_func\] apply_updates: .*\n.*extra/weight"):
        apply_updates(params, bad)
    with pytest.raises(ValueError, match=r"^\[yolo_func\] partition: labels \['oops'\] have no transform"):
        partition({"a": identity()}, lambda p: T.tree_map(lambda _: "oops", p)).init(params)
    with pytest.raises(ValueError, match=r"^\[yolo_func\] add_decayed_weights needs params"):
        sgd(0.1, weight_decay=0.1).update(params, sgd(0.1, weight_decay=0.1).init(params))
    with pytest.raises(ValueError, match=r"^\[yolo_func\] clip_by_global_norm"):
        clip_by_global_norm(0.0)
    try:
        multi_steps(identity(), every=0)
    except ValueError as err:
        assert isinstance(err.args[0], str) and len(err.args) == 1  # never a tuple message
    else:
        raise AssertionError("multi_steps(every=0) must raise")


# -- no host synchronisation -------------------------------------------------------------------


def test_yolo_recipe_runs_on_meta_tensors():
    """Meta tensors have no data: any .item(), bool(tensor) or data-dependent shape would raise.

    The whole recipe (accumulation with a warmup-varying count, clipping, three SGD groups with
    scheduled lr and momentum) and the gated EMA run on them, so nothing reads a value on the host.
    """
    params = T.tree_to(small_params(), "meta")
    tx, e = yolo_recipe(), ema()
    state, ema_state = tx.init(params), e.init(params)
    for _ in range(3):
        updates, state = tx.update(T.tree_zeros_like(params), state, params)
        params = apply_updates(params, updates)
        ema_state = e.update(params, ema_state, stepped=state.stepped)
    assert state.count.device.type == "meta" and state.stepped.dtype == torch.bool
    assert all(x.device.type == "meta" for x in T.tree_leaves((state, ema_state)))
    # adamw too
    tx = adamw(lambda step: torch.full((), 1e-3, dtype=torch.float64, device=step.device), weight_decay=0.01)
    s = tx.init(params)
    tx.update(T.tree_zeros_like(params), s, params)


# -- properties -----------------------------------------------------------------------------------

TXS = {
    "sgd": lambda: sgd(0.05, momentum=0.9, nesterov=True, weight_decay=1e-3),
    "adamw": lambda: adamw(1e-2, weight_decay=0.05),
    "clip": lambda: clip_by_global_norm(1.0),
}


@given(seed=st.integers(0, 2**31 - 1), name=st.sampled_from(sorted(TXS)), steps=st.integers(1, 4))
def test_chain_with_identity_is_the_transform(seed, name, steps):
    tx, chained = TXS[name](), chain(identity(), TXS[name](), identity())
    params = small_params(seed % 1000)
    s1, s2 = tx.init(params), chained.init(params)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        g = random_grads(params, gen)
        u1, s1 = tx.update(g, s1, params)
        u2, s2 = chained.update(g, s2, params)
        assert_trees_all_equal(u1, u2)
        assert_trees_all_equal(s1, s2[1])


@given(seed=st.integers(0, 2**31 - 1), name=st.sampled_from(sorted(TXS)))
def test_partition_with_one_label_is_the_transform(seed, name):
    tx = TXS[name]()
    part = partition({"all": TXS[name]()}, lambda p: T.tree_map(lambda _: "all", p))
    params = small_params(seed % 1000)
    s1, s2 = tx.init(params), part.init(params)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(3):
        g = random_grads(params, gen)
        u1, s1 = tx.update(g, s1, params)
        u2, s2 = part.update(g, s2, params)
        assert_trees_all_equal(u1, u2)
        params = apply_updates(params, u1)
