"""apply_if_finite: hand-computed values, the skip leaves the inner state bitwise as it was, the
iteration it passes down, and equality with the inner transform run on the applied calls only."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from yolo_func import tree as T
from yolo_func.optim import (
    ApplyIfFiniteState,
    adamw,
    apply_if_finite,
    chain,
    clip_by_global_norm,
    multi_steps,
    sgd,
)
from yolo_func.testing import assert_trees_all_equal

from optim_helpers import random_grads, small_params

NAN, INF = float("nan"), float("inf")


def _w(*xs):
    return {"w": torch.tensor(xs, dtype=torch.float32)}


def test_sgd_momentum_by_hand():
    """g=[1,2] applied, g=[nan,1] skipped, g=[1,1] applied: buf 0 -> [1,2] -> [1,2] -> [1.9,2.8]."""
    tx = apply_if_finite(sgd(0.1, momentum=0.9))
    p = _w(1.0, 1.0)
    s0 = tx.init(p)
    assert isinstance(s0, ApplyIfFiniteState)
    assert (int(s0.count), int(s0.notfinite_count), int(s0.total_notfinite_count)) == (0, 0, 0)
    assert int(s0.notfinite_count) == 0 and bool(s0.stepped)

    u1, s1 = tx.update(_w(1.0, 2.0), s0, p)
    assert torch.equal(u1["w"], -0.1 * torch.tensor([1.0, 2.0]))
    assert torch.equal(s1.inner_state[0].momentum["w"], torch.tensor([1.0, 2.0]))

    u2, s2 = tx.update(_w(NAN, 1.0), s1, p)
    assert torch.equal(u2["w"], torch.zeros(2))
    assert_trees_all_equal(s2.inner_state, s1.inner_state)  # momentum and the trace's count kept
    assert (int(s2.count), int(s2.notfinite_count), int(s2.total_notfinite_count)) == (2, 1, 1)
    assert not bool(s2.stepped)

    u3, s3 = tx.update(_w(1.0, 1.0), s2, p)
    buf = 0.9 * torch.tensor([1.0, 2.0]) + 1.0
    assert torch.equal(s3.inner_state[0].momentum["w"], buf)
    assert torch.equal(u3["w"], -0.1 * buf)
    assert int(s3.inner_state[0].count) == 2  # applied updates only
    assert (int(s3.count), int(s3.notfinite_count), int(s3.total_notfinite_count)) == (3, 0, 1)
    assert bool(s3.stepped)


@pytest.mark.parametrize("bad", [NAN, INF, -INF, 3e38])
def test_each_kind_of_non_finite_gradient_is_skipped(bad):
    """NaN, +-inf, and finite values whose squared sum overflows float32 (the norm is inf)."""
    tx = apply_if_finite(sgd(0.1, momentum=0.9))
    p = _w(1.0, 1.0)
    _, s = tx.update(_w(1.0, 1.0), tx.init(p), p)
    u, s2 = tx.update(_w(bad, bad), s, p)
    assert torch.equal(u["w"], torch.zeros(2))
    assert_trees_all_equal(s2.inner_state, s.inner_state)
    assert not bool(s2.stepped) and int(s2.total_notfinite_count) == 1


def test_caller_veto_skips_a_finite_call_and_counts_consecutive_skips():
    tx = apply_if_finite(sgd(0.5))
    p = _w(2.0)
    s = tx.init(p)
    for i in range(3):
        u, s = tx.update(_w(1.0), s, p, finite=torch.tensor(False))
        assert torch.equal(u["w"], torch.zeros(1)) and int(s.notfinite_count) == i + 1
    u, s = tx.update(_w(1.0), s, p, finite=torch.tensor(True))
    assert torch.equal(u["w"], torch.tensor([-0.5]))
    assert (int(s.notfinite_count), int(s.total_notfinite_count), int(s.count)) == (0, 3, 4)


def test_iteration_counts_skipped_calls():
    """Schedules see the call index (skipped calls included): lr(ni) = 0.1 * (ni + 1)."""
    tx = apply_if_finite(sgd(lambda ni: 0.1 * (ni + 1).double()))
    p = _w(0.0)
    s = tx.init(p)
    got = []
    for g in (1.0, NAN, 1.0, 1.0):
        u, s = tx.update(_w(g), s, p)
        got.append(float(u["w"][0]))
    assert got == pytest.approx([-0.1, 0.0, -0.3, -0.4], abs=1e-7)
    # an explicit iteration from the caller wins over the count
    u, _ = tx.update(_w(1.0), s, p, iteration=torch.tensor(9))
    assert float(u["w"][0]) == pytest.approx(-1.0)


def test_multi_steps_inside_keeps_its_window_and_stepped_flag():
    """every=2, grads 1, nan, 1, 1: ni=0 accumulates; ni=1 is skipped (it would have stepped: the
    whole multi_steps state stays); ni=2 steps with 1+1; ni=3 accumulates."""
    tx = apply_if_finite(multi_steps(sgd(1.0), every=2))
    p = _w(0.0)
    s = tx.init(p)
    rows = []
    for g in (1.0, NAN, 1.0, 1.0):
        before = s.inner_state
        u, s = tx.update(_w(g), s, p)
        rows.append((float(u["w"][0]), bool(s.stepped), int(s.notfinite_count) == 0))
        if math.isnan(g):
            assert_trees_all_equal(s.inner_state, before)
    assert rows == [(0.0, False, True), (0.0, False, False), (-2.0, True, True), (0.0, False, True)]
    assert int(s.inner_state.last_step) == 2 and int(s.inner_state.count) == 3 and int(s.count) == 4


def test_disabled_guard_passes_everything_through_and_records_the_veto():
    tx = apply_if_finite(sgd(0.1), enabled=False)
    p = _w(1.0)
    u, s = tx.update(_w(NAN), tx.init(p), p)
    assert math.isnan(float(u["w"][0])) and int(s.notfinite_count) == 0 and bool(s.stepped)
    u, s = tx.update(_w(1.0), s, p, finite=torch.tensor(False))
    assert torch.equal(u["w"], torch.tensor([-0.1]))  # not skipped, only counted
    assert int(s.notfinite_count) == 1 and int(s.total_notfinite_count) == 1 and bool(s.stepped)
    assert T.tree_structure(s) == T.tree_structure(apply_if_finite(sgd(0.1)).init(p))


def test_bad_arguments_raise():
    tx = apply_if_finite(sgd(0.1))
    p = _w(1.0)
    s = tx.init(p)
    with pytest.raises(TypeError, match=r"\[yolo_func\] apply_if_finite\.update\(finite=\) must be a bool\[\]"):
        tx.update(_w(1.0), s, p, finite=True)
    with pytest.raises(TypeError, match=r"\[yolo_func\] apply_if_finite\.update\(finite=\) must be a bool\[\]"):
        tx.update(_w(1.0), s, p, finite=torch.tensor([True, False]))
    with pytest.raises(TypeError, match=r"needs the ApplyIfFiniteState made by its init"):
        tx.update(_w(1.0), sgd(0.1).init(p), p)
    with pytest.raises(TypeError, match=r"\[yolo_func\] apply_if_finite\(inner\) must be a GradientTransformation"):
        apply_if_finite(0.1)
    with pytest.raises(TypeError, match=r"apply_if_finite\.update got an unexpected keyword 'skip'"):
        tx.update(_w(1.0), s, p, skip=torch.tensor(True))


def _inner_factories():
    return {
        "sgd": lambda: sgd(0.05, momentum=0.9, nesterov=True, weight_decay=1e-3),
        "adamw": lambda: adamw(1e-2),
        "clip+sgd": lambda: chain(clip_by_global_norm(1.0), sgd(0.1, momentum=0.5)),
    }


@pytest.mark.parametrize("name", sorted(_inner_factories()))
@given(mask=st.lists(st.booleans(), min_size=1, max_size=6), seed=st.integers(0, 2**16))
def test_equals_the_inner_transform_on_the_applied_calls(name, mask, seed):
    """Second implementation: the inner transform alone, fed only the calls the mask keeps, gives
    bitwise the same updates and state (constant hyper-parameters: no schedule reads the count)."""
    make = _inner_factories()[name]
    tx, ref = apply_if_finite(make()), make()
    p = small_params(seed)
    s, rs = tx.init(p), ref.init(p)
    gen = torch.Generator().manual_seed(seed)
    for keep in mask:
        g = random_grads(p, gen)
        if not keep:
            g["head"]["pred"]["bias"][0] = NAN
        u, s = tx.update(g, s, p)
        if keep:
            ru, rs = ref.update(g, rs, p)
            assert_trees_all_equal(u, ru, strict=True)
        else:
            assert_trees_all_equal(u, T.tree_zeros_like(p), strict=True)
        assert_trees_all_equal(s.inner_state, rs, strict=True)
        p = T.tree_map(lambda a, b: a + b, p, u)
    assert int(s.total_notfinite_count) == mask.count(False) and int(s.count) == len(mask)


@pytest.mark.parametrize("name", ["sgd", "adamw"])
@given(mask=st.lists(st.booleans(), min_size=1, max_size=4), seed=st.integers(0, 2**16))
def test_a_passed_grad_norm_gives_bitwise_the_same_as_the_guards_own(name, mask, seed):
    """``grad_norm=global_norm(grads)`` (what the training step passes) changes nothing: updates
    and every state leaf equal the guard computing the norm itself, on applied and skipped calls."""
    from yolo_func.optim import global_norm
    make = {"sgd": lambda: sgd(0.1, momentum=0.9, nesterov=True, weight_decay=1e-3),
            "adamw": lambda: adamw(0.01, weight_decay=0.05)}[name]
    tx = apply_if_finite(make())
    p = small_params(seed)
    s_own = s_passed = tx.init(p)
    gen = torch.Generator().manual_seed(seed)
    for keep in mask:
        g = random_grads(p, gen)
        if not keep:
            g["head"]["pred"]["bias"][0] = INF
        u_own, s_own = tx.update(g, s_own, p)
        u_passed, s_passed = tx.update(g, s_passed, p, grad_norm=global_norm(g))
        assert_trees_all_equal((u_passed, s_passed), (u_own, s_own), strict=True)
        p = T.tree_map(lambda a, b: a + b, p, u_own)
    assert int(s_passed.total_notfinite_count) == mask.count(False)


def test_a_passed_grad_norm_is_the_check():
    """The guard reads a passed norm instead of recomputing it: a NaN norm skips finite gradients."""
    tx = apply_if_finite(sgd(0.1, momentum=0.9))
    p = _w(1.0, 1.0)
    u, s = tx.update(_w(1.0, 2.0), tx.init(p), p, grad_norm=torch.tensor(NAN))
    assert torch.equal(u["w"], torch.zeros(2)) and int(s.notfinite_count) == 1 and not bool(s.stepped)
    u, s = tx.update(_w(1.0, 2.0), s, p, grad_norm=torch.tensor(3.0))
    assert torch.equal(u["w"], torch.tensor([-0.1, -0.2])) and int(s.notfinite_count) == 0


def test_the_training_step_without_the_guard_still_counts_non_finite_gradients():
    """finish_step(skip_nonfinite=False): a finite loss with a NaN gradient is applied (nothing is
    skipped) but reported as not finite, as before the norm was shared with the guard."""
    from yolo_func.train.state import TrainState
    from yolo_func.train.step import finish_step
    tx = sgd(0.1)
    params = {"network": {"w": torch.ones(2)}, "heads": {}}
    zero = torch.zeros((), dtype=torch.int64)
    ts = TrainState(params, {"network": {}, "heads": {}}, apply_if_finite(tx, enabled=False).init(params), None,
                    zero, zero.clone())
    grads = {"network": {"w": torch.tensor([NAN, 1.0])}, "heads": {}}
    new_ts, m = finish_step(ts, grads, ts.state, {"detect": torch.tensor(1.0)}, {}, {}, tx=tx, skip_nonfinite=False)
    assert not bool(m["finite"]) and int(new_ts.skipped) == 1 and int(new_ts.opt_state.notfinite_count) == 1
    assert math.isnan(float(new_ts.params["network"]["w"][0]))          # applied: the guard is off
    good = {"network": {"w": torch.tensor([2.0, 1.0])}, "heads": {}}
    new_ts, m = finish_step(new_ts, good, ts.state, {"detect": torch.tensor(1.0)}, {}, {}, tx=tx, skip_nonfinite=False)
    assert bool(m["finite"]) and int(new_ts.opt_state.notfinite_count) == 0
