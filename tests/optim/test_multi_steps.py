"""Gradient accumulation: summed micro-batch gradients, device-side stepping, the YOLO recipe."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from optim_helpers import as_tree, random_grads, ref_lf, small_params, torch_params

from yolo_func import tree as T
from yolo_func.optim import (
    adamw,
    apply_updates,
    chain,
    clip_by_global_norm,
    multi_steps,
    nominal_accumulate,
    partition,
    scaled_weight_decay,
    sgd,
    yolo_param_labels,
    yolo_schedules,
)
from yolo_func.testing import assert_trees_all_close, assert_trees_all_equal


def _summed(grads_list):
    """Sum in the order the reference's .grad accumulates (first assigned, then +=)."""
    total = T.tree_clone(grads_list[0])
    for g in grads_list[1:]:
        total = T.tree_add(total, g)
    return total


@pytest.mark.parametrize("make", [
    lambda: sgd(0.01, momentum=0.937, nesterov=True, weight_decay=5e-4),
    lambda: adamw(1e-3, weight_decay=0.01),
], ids=["sgd", "adamw"])
@pytest.mark.parametrize("k", [1, 3])
def test_k_micro_steps_equal_one_step_on_the_sum(make, k):
    """Bitwise: accumulation adds in the same order, and the inner update sees the same sum."""
    params_a = params_b = small_params()
    acc_tx, plain = multi_steps(make(), every=k), make()
    sa, sb = acc_tx.init(params_a), plain.init(params_b)
    gen = torch.Generator().manual_seed(11)
    for cycle in range(4):
        micro = [random_grads(params_a, gen) for _ in range(k)]
        for i, g in enumerate(micro):
            u, sa = acc_tx.update(g, sa, params_a)
            last = i == k - 1
            assert bool(sa.stepped) == last and sa.stepped.dtype == torch.bool
            if not last:
                assert not any(x.any() for x in T.tree_leaves(u))  # zeros until the step
            params_a = apply_updates(params_a, u)
        ub, sb = plain.update(_summed(micro), sb, params_b)
        params_b = apply_updates(params_b, ub)
        assert_trees_all_equal(params_a, params_b)
        assert_trees_all_equal(sa.inner_state, sb)
        assert not any(x.any() for x in T.tree_leaves(sa.acc_grads))  # reset after the step
        assert int(sa.count) == k * (cycle + 1) and int(sa.last_step) == k * (cycle + 1) - 1


def reference_step_flags(every_table, n):
    """The reference's rule: step at ni when ni - last_step >= accumulate(ni)."""
    last, flags = -1, []
    for ni in range(n):
        step = ni - last >= every_table[ni]
        flags.append(step)
        if step:
            last = ni
    return flags


def test_every_changes_over_time():
    """A callable count (as during warmup): steps where the reference steps, sums in between."""
    table = [1, 1, 2, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4, 4, 4, 4, 1, 2]
    flags = reference_step_flags(table, len(table))
    assert flags.count(True) >= 6 and flags.count(False) >= 6
    lookup = torch.tensor(table)
    tx = multi_steps(sgd(0.1, momentum=0.9), every=lambda ni: lookup[ni])
    plain = sgd(0.1, momentum=0.9)
    params, ref_params = small_params(), small_params()
    s, sp = tx.init(params), plain.init(ref_params)
    gen, pending = torch.Generator().manual_seed(5), []
    for ni, want in enumerate(flags):
        g = random_grads(params, gen)
        pending.append(g)
        u, s = tx.update(g, s, params)
        params = apply_updates(params, u)
        assert bool(s.stepped) == want, ni
        if want:
            ur, sp = plain.update(_summed(pending), sp, ref_params)
            ref_params, pending = apply_updates(ref_params, ur), []
        assert_trees_all_equal(params, ref_params)


def test_every_as_a_device_tensor():
    tx = multi_steps(sgd(1.0), every=torch.tensor(2))
    p = {"w": torch.zeros(3)}
    s = tx.init(p)
    got = []
    for _ in range(6):
        u, s = tx.update({"w": torch.ones(3)}, s, p)
        got.append((bool(s.stepped), float(u["w"][0])))
    assert got == [(False, 0.0), (True, -2.0)] * 3


def test_accumulators_are_own_buffers():
    params = small_params()
    tx = multi_steps(sgd(0.1), every=3)
    s = tx.init(params)
    g = random_grads(params, torch.Generator().manual_seed(0))
    _, s = tx.update(g, s, params)
    assert_trees_all_equal(s.acc_grads, g)  # 0 + g == g
    assert not {x.data_ptr() for x in T.tree_leaves(s.acc_grads)} & {x.data_ptr() for x in T.tree_leaves(g)}


def test_weight_decay_scaling():
    """REFERENCE.md §4.3: wd * batch * accumulate / 64, accumulate = max(round(64 / batch), 1)."""
    assert nominal_accumulate(16) == 4 and nominal_accumulate(8) == 8 and nominal_accumulate(48) == 1
    assert nominal_accumulate(128) == 1 and nominal_accumulate(24) == 3  # round(2.67)
    assert scaled_weight_decay(5e-4, 16, 4) == 5e-4 * 16 * 4 / 64
    assert scaled_weight_decay(5e-4, 48, nominal_accumulate(48)) == pytest.approx(3.75e-4)


def test_yolo_recipe_tracks_the_reference_loop():
    """The whole recipe against the reference's loop written from REFERENCE.md §4.3 with
    torch.optim.SGD: host-set group lr / momentum per iteration during warmup, lr0*lf(epoch) after,
    gradients summed in .grad, step when ni - last_step >= accumulate, clip to 10 before the step.

    Tolerance 1e-6 (torch's fused p + (-lr)*d and, with a tensor momentum, g + mu*buf round once).
    """
    lr0, lrf, epochs, nb, we, nominal = 0.01, 0.01, 3, 5, 1.6, 3
    s = yolo_schedules(lr0, lrf, epochs, nb, warmup_epochs=we, nominal_accumulate=nominal)
    wd = scaled_weight_decay(5e-4, 16, nominal)
    inner = partition({
        "decay": sgd(s.lr["decay"], momentum=s.momentum, nesterov=True, weight_decay=wd),
        "no_decay": sgd(s.lr["no_decay"], momentum=s.momentum, nesterov=True),
        "bias": sgd(s.lr["bias"], momentum=s.momentum, nesterov=True),
    }, yolo_param_labels)
    tx = multi_steps(chain(clip_by_global_norm(10.0), inner), every=s.accumulate)

    params = small_params()
    labels = T.tree_leaves(yolo_param_labels(params))
    _, tps = torch_params(params)
    group = lambda name: [p for p, lab in zip(tps, labels, strict=True) if lab == name]  # noqa: E731
    opt = torch.optim.SGD([{"params": group("bias")}, {"params": group("decay"), "weight_decay": wd},
                           {"params": group("no_decay")}], lr=lr0, momentum=0.937, nesterov=True, foreach=True)
    for gr in opt.param_groups:
        gr["initial_lr"] = lr0

    nw = round(min(we, epochs - 1) * nb)
    assert s.warmup_iters == nw == 8
    state, gen, last, accumulate, n_steps = tx.init(params), torch.Generator().manual_seed(9), -1, nominal, 0
    for ni in range(epochs * nb):
        epoch = ni // nb
        if ni <= nw:
            accumulate = max(1, round(np.interp(ni, [0, nw], [1, nominal])))
            for j, gr in enumerate(opt.param_groups):
                gr["lr"] = np.interp(ni, [0, nw], [0.1 if j == 0 else 0.0, gr["initial_lr"] * ref_lf(epoch, lrf, epochs, False)])
                gr["momentum"] = np.interp(ni, [0, nw], [0.8, 0.937])
        else:
            for gr in opt.param_groups:
                gr["lr"] = gr["initial_lr"] * ref_lf(epoch, lrf, epochs, False)
        scale = 20.0 if ni % 4 == 0 else 0.5  # some sums exceed the clip norm, some do not
        grads = random_grads(params, gen, scale)
        for tp, g in zip(tps, T.tree_leaves(grads), strict=True):
            tp.grad = g.clone() if tp.grad is None else tp.grad + g
        stepped_ref = ni - last >= accumulate
        if stepped_ref:
            torch.nn.utils.clip_grad_norm_(tps, max_norm=10.0)
            opt.step()
            opt.zero_grad()
            last, n_steps = ni, n_steps + 1

        updates, state = tx.update(grads, state, params)
        params = apply_updates(params, updates)
        assert bool(state.stepped) == stepped_ref, ni
        assert_trees_all_close(params, as_tree(params, tps), rtol=1e-6, atol=1e-6)
    assert n_steps >= 6
