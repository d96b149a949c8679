"""Schedules against the reference formulas of REFERENCE.md §4.3, written here in plain Python/numpy."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from optim_helpers import ref_lf

from yolo_func.optim import cosine_lf, interp_warmup, linear_lf, memoized, schedule_memo, warmup_iterations, yolo_schedules


def ref_table(lr0, lrf, epochs, nb, warmup_epochs, wbl, wm, momentum, cos, nominal):
    """The reference's loop: warmup per iteration while ni <= nw, else lr0*lf(epoch)."""
    nw = round(min(warmup_epochs, max(epochs - 1, 0)) * nb) if warmup_epochs > 0 else 0
    accumulate, mom = nominal, momentum  # values before warmup touches them
    rows = []
    for ni in range(epochs * nb):
        epoch = ni // nb
        lr = {k: lr0 * ref_lf(epoch, lrf, epochs, cos) for k in ("decay", "no_decay", "bias")}
        if ni <= nw:
            xi = [0, nw]
            accumulate = max(1, round(np.interp(ni, xi, [1, nominal])))
            tgt = lr0 * ref_lf(epoch, lrf, epochs, cos)
            lr = {"bias": float(np.interp(ni, xi, [wbl, tgt])),
                  "decay": float(np.interp(ni, xi, [0.0, tgt])),
                  "no_decay": float(np.interp(ni, xi, [0.0, tgt]))}
            mom = float(np.interp(ni, xi, [wm, momentum]))
        rows.append((ni, lr, mom, accumulate))
    return nw, rows


CONFIGS = [
    # (lr0, lrf, epochs, nb, warmup_epochs, warmup_bias_lr, warmup_momentum, momentum, cos, nominal)
    (0.01, 0.01, 5, 4, 3.0, 0.1, 0.8, 0.937, False, 4),   # nw = 12: warmup ends on an epoch boundary
    (0.01, 0.01, 4, 3, 1.5, 0.1, 0.8, 0.937, False, 4),   # nw = round(4.5) = 4 (half to even), mid-epoch
    (0.02, 0.1, 6, 7, 0.5, 0.05, 0.7, 0.9, True, 2),      # nw = round(3.5) = 4, cosine
    (0.01, 0.01, 3, 5, 3.0, 0.1, 0.8, 0.937, True, 3),    # warmup capped at E - 1 epochs: nw = 10
    (0.01, 0.01, 1, 6, 3.0, 0.1, 0.8, 0.937, False, 4),   # E = 1: nw = 0
    (0.01, 0.01, 3, 4, 0.0, 0.1, 0.8, 0.937, False, 4),   # warmup off
    (0.001, 0.2, 4, 9, 2.0, 0.0, 0.8, 0.937, False, 5),   # optimizer=auto style: warmup_bias_lr 0
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"E{c[2]}-nb{c[3]}-w{c[4]}-cos{c[8]}")
def test_yolo_schedules_equal_reference_at_every_iteration(cfg):
    lr0, lrf, epochs, nb, we, wbl, wm, mom, cos, nominal = cfg
    nw, rows = ref_table(*cfg)
    s = yolo_schedules(lr0, lrf, epochs, nb, warmup_epochs=we, warmup_bias_lr=wbl, warmup_momentum=wm,
                       momentum=mom, cos_lr=cos, nominal_accumulate=nominal)
    assert s.warmup_iters == nw == warmup_iterations(we, epochs, nb)
    # The table crosses the warmup boundary (and epoch boundaries when E > 1).
    assert len(rows) > nw + 1
    for ni, lr, m, acc in rows:
        t = torch.tensor(ni, dtype=torch.int64)
        for group, want in lr.items():
            got = s.lr[group](t)
            assert got.dtype == torch.float64 and got.shape == ()
            # Same float64 operations in the same order: equal, up to an ulp of cos/exp.
            assert float(got) == pytest.approx(want, rel=1e-12, abs=1e-18), (ni, group)
            if not cos:
                assert float(got) == want, (ni, group)
        assert float(s.momentum(t)) == pytest.approx(m, rel=1e-12), ni
        got_acc = s.accumulate(t)
        assert got_acc.dtype == torch.int64 and int(got_acc) == acc, ni


def test_warmup_details():
    """T15: bias lr falls from 0.1 while the others rise from 0; accumulate ramps from 1."""
    s = yolo_schedules(0.01, 0.01, epochs=10, batches_per_epoch=100, nominal_accumulate=4)
    nw = s.warmup_iters
    assert nw == 300
    at = lambda f, ni: float(f(torch.tensor(ni)))  # noqa: E731
    assert at(s.lr["bias"], 0) == 0.1 and at(s.lr["decay"], 0) == 0.0 and at(s.momentum, 0) == 0.8
    assert at(s.accumulate, 0) == 1 and at(s.accumulate, nw) == 4 and at(s.accumulate, nw + 1) == 4
    lf3 = 1 - 3 / 10 * (1 - 0.01)
    assert at(s.lr["bias"], nw) == pytest.approx(0.01 * lf3) and at(s.lr["decay"], nw) == pytest.approx(0.01 * lf3)
    assert at(s.momentum, nw) == 0.937 and at(s.momentum, 10**6) == 0.937
    # Within an epoch of warmup: bias lr down, weight lr up; at an epoch boundary the target
    # lr0*lf(epoch) drops, so the ramp drops with it (the reference's behaviour).
    b = [at(s.lr["bias"], i) for i in range(0, 100, 10)]
    w = [at(s.lr["decay"], i) for i in range(0, 100, 10)]
    assert all(x > y for x, y in zip(b, b[1:])) and all(x < y for x, y in zip(w, w[1:]))
    assert at(s.lr["decay"], 200) < at(s.lr["decay"], 199)
    # accumulate = round-half-even of interp: interp(ni) = 1 + 3*ni/300 hits 1.5 at ni = 50 -> 2.
    assert at(s.accumulate, 49) == 1 and at(s.accumulate, 50) == 2 and at(s.accumulate, 150) == 2
    assert at(s.accumulate, 151) == 3  # interp = 2.51


def test_lf_reference_values():
    """REFERENCE.md §4.3, E = 100."""
    lin, cos = linear_lf(0.01, 100), cosine_lf(0.01, 100)
    for e, want in [(0, 1.0), (1, 0.9901), (50, 0.505), (99, 0.0199), (100, 0.01), (150, 0.01)]:
        assert float(lin(torch.tensor(e))) == pytest.approx(want, rel=1e-12), e
    assert float(cos(torch.tensor(50))) == pytest.approx(0.505, rel=1e-12)
    assert float(cos(torch.tensor(99))) == pytest.approx(0.010244, abs=5e-7)
    assert float(cos(torch.tensor(0))) == 1.0


def test_interp_matches_numpy():
    for end in (0, 1, 7, 300):
        for x in sorted({0, end // 3, end // 2, end}):
            got = float(interp_warmup(torch.tensor(x), end, 0.1, torch.tensor(0.0123, dtype=torch.float64)))
            assert got == float(np.interp(x, [0, end], [0.1, 0.0123])), (end, x)


def test_schedules_are_device_functions():
    """The step stays a tensor; outputs live on its device (no Python number in between)."""
    s = yolo_schedules(0.01, 0.01, epochs=3, batches_per_epoch=4)
    ni = torch.tensor(5, device="meta")  # any host read (.item(), bool()) would raise on meta
    for f in (*s.lr.values(), s.momentum, s.accumulate):
        out = f(ni)
        assert out.device.type == "meta" and out.shape == ()


def test_bad_arguments():
    with pytest.raises(ValueError, match=r"^\[yolo_func\] epochs"):
        yolo_schedules(0.01, 0.01, epochs=0, batches_per_epoch=4)
    with pytest.raises(ValueError, match=r"^\[yolo_func\] batches_per_epoch"):
        yolo_schedules(0.01, 0.01, epochs=3, batches_per_epoch=0)
    with pytest.raises(ValueError, match=r"^\[yolo_func\] nominal_accumulate"):
        yolo_schedules(0.01, 0.01, epochs=3, batches_per_epoch=4, nominal_accumulate=0)


# -- shared evaluation (memoized / schedule_memo / share_schedules) ------------------------------


def _counting(fn):
    calls = []

    def schedule(step):
        calls.append(int(step))
        return fn(step)

    return schedule, calls


def test_memoized_evaluates_once_per_step_tensor_inside_the_block_only():
    sched, calls = _counting(lambda s: s.to(torch.float64) * 0.5)
    m = memoized(sched)
    a, b = torch.tensor(3), torch.tensor(3)
    assert float(m(a)) == 1.5 and float(m(a)) == 1.5 and calls == [3, 3]  # outside: every call evaluates
    calls.clear()
    with schedule_memo():
        x, y = m(a), m(a)
        z = m(b)  # an equal value in another tensor: evaluated again (identity, not value)
    assert x is y and z is not x and calls == [3, 3]
    calls.clear()
    with schedule_memo():  # a new block forgets the last one (a counter updated in place is safe)
        a.fill_(7)
        assert float(m(a)) == 3.5 and calls == [7]


def _yolo_inner_tx(batch):
    """yolo_sgd's transform built by hand, without share_schedules."""
    from yolo_func.optim import (chain, clip_by_global_norm, multi_steps, nominal_accumulate, partition,
                                 scaled_weight_decay, sgd, yolo_param_labels)
    acc = nominal_accumulate(batch, 64)
    sched = yolo_schedules(0.01, 0.01, 100, 1000, nominal_accumulate=acc)
    groups = {"decay": sgd(sched.lr["decay"], sched.momentum, nesterov=True,
                           weight_decay=scaled_weight_decay(5e-4, batch, acc, 64)),
              "no_decay": sgd(sched.lr["no_decay"], sched.momentum, nesterov=True),
              "bias": sgd(sched.lr["bias"], sched.momentum, nesterov=True)}
    return multi_steps(chain(clip_by_global_norm(10.0), partition(groups, yolo_param_labels)), every=sched.accumulate)


def test_yolo_sgd_shares_schedule_values_with_the_same_results_and_fewer_ops():
    from torch.utils._python_dispatch import TorchDispatchMode

    from yolo_func import tree as T
    from yolo_func.testing import assert_trees_all_equal
    from yolo_func.train import yolo_sgd

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += 1
            return func(*args, **(kwargs or {}))

    gen = torch.Generator().manual_seed(0)
    params = {"network": {"conv": {"weight": torch.randn(4, 3, 3, 3, generator=gen)},
                          "bn": {"weight": torch.randn(4, generator=gen), "bias": torch.randn(4, generator=gen)}}}
    shared, plain = yolo_sgd(batch_size=16, batches_per_epoch=1000, epochs=100).tx, _yolo_inner_tx(16)
    s1, s2 = shared.init(params), plain.init(params)
    counts = []
    for i in range(6):  # warmup iterations: every schedule is live
        grads = T.tree_map(lambda p: torch.randn(p.shape, generator=gen), params)
        with Count() as c1:
            u1, s1 = shared.update(grads, s1, params)
        with Count() as c2:
            u2, s2 = plain.update(grads, s2, params)
        counts.append((c1.n, c2.n))
        assert_trees_all_equal((u1, s1), (u2, s2), strict=True)
    assert all(n1 <= n2 - 30 for n1, n2 in counts), counts  # lr x3 -> x2, momentum x3 -> x1, one target
