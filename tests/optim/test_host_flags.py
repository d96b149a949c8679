"""The CPU fast path of the optimizer and EMA (issue 17 item 4, CPU): device flags read on the host.

On a plain CPU tensor in eager mode, ``host_flag`` reads a select's flag on the host, so
``where(flag, new, old)`` returns ``new`` or ``old`` whole (``torch.where``'s exact selection),
``multi_steps`` skips its ``x * 1`` passes and, on an accumulating call, its inner transform
altogether, the params and the EMA stay as they are on a call that does not step, and the EMA is
one ``_foreach_lerp``.

The device form (``set_host_flags(False)``: the GPU's arithmetic selects ``new * f + old * (1 -
f)``) can differ from an exact select only in the sign of a zero and in a NaN or infinity of the
discarded branch. The tests check the host path against ``torch.where`` bit for bit (float32
compared as int32, so ``-0.0`` and ``+0.0`` differ) and against the device form value for value.
"""

from __future__ import annotations

import pytest
import torch

from optim_helpers import random_grads, small_params, yolo_recipe, yolo_recipe_inner
from yolo_func import tree as T
from yolo_func.optim import apply_if_finite, apply_updates, ema, flat
from yolo_func.optim.base import _select, host_flag, host_readable, set_host_flags
from yolo_func.testing import assert_trees_all_close


def _bits(x: torch.Tensor) -> torch.Tensor:
    if x.is_floating_point():
        return x.contiguous().view({torch.float64: torch.int64, torch.float32: torch.int32,
                                    torch.float16: torch.int16, torch.bfloat16: torch.int16}[x.dtype])
    return x


def _assert_bitwise(a, b):
    la, da = T.tree_flatten(a)
    lb, db = T.tree_flatten(b)
    assert da == db
    for i, (x, y) in enumerate(zip(la, lb)):
        assert x.dtype == y.dtype and x.shape == y.shape, i
        assert torch.equal(_bits(x), _bits(y)), (i, x.shape)


class _device_form:
    """``with _device_form():`` runs the code with the host reads off (the GPU-shaped path)."""

    def __enter__(self):
        self.old = set_host_flags(False)

    def __exit__(self, *exc):
        set_host_flags(self.old)


def test_host_flag_reads_only_plain_eager_cpu_bools():
    assert host_flag(torch.tensor(True)) is True and host_flag(torch.tensor(False)) is False
    assert host_flag(torch.tensor(True, device="meta")) is None
    assert host_flag(torch.tensor(1)) is None                       # not a bool
    assert host_flag(torch.tensor([True])) is None                  # not 0-dim
    assert host_readable(torch.tensor(0.5, dtype=torch.float64))
    with _device_form():
        assert host_flag(torch.tensor(True)) is None
    seen = []
    torch.func.vmap(lambda x: seen.append(host_readable(x)) or x)(torch.ones(3))
    assert seen == [False]                                          # inside torch.func: never read


SPECIAL = [0.0, -0.0, 1.0, -1.0, 3.0e38, -3.0e38, 1e-45, -1e-45, 0.5, float("inf"), float("-inf"), float("nan")]


def _assert_same_values(a, b):
    """The same structure, dtypes and shapes; equal values with NaN in the same places (``-0.0``
    equals ``+0.0`` here)."""
    assert_trees_all_close(a, b, rtol=0.0, atol=0.0, strict=True, equal_nan=True)


@pytest.mark.parametrize("value", [True, False])
def test_host_select_is_torch_where_for_every_special_value_pair(value):
    """The host path is ``torch.where`` bit for bit (the very tensors, no copy); the device form
    has its values wherever the discarded branch is finite, and gives NaN where it is not."""
    v = torch.tensor(SPECIAL)
    new, old = v.repeat_interleave(len(SPECIAL)), v.repeat(len(SPECIAL))
    big_new = torch.randn(100_003, generator=torch.Generator().manual_seed(0))
    big_new[::5] = 0.0
    big_new[::7] = -0.0
    big_old = torch.randn(100_003, generator=torch.Generator().manual_seed(1))
    flag = torch.tensor(value)
    for n, o in ((new, old), (big_new, big_old), (new.view(12, 12), old.view(12, 12))):
        fast = _select(flag, [n, torch.tensor(3)], [o, torch.tensor(4)])
        assert fast[0] is (n if value else o)
        assert torch.equal(_bits(fast[0]), _bits(torch.where(flag, n, o)))
        assert int(fast[1]) == (3 if value else 4)
        with _device_form():
            slow = _select(flag, [n, torch.tensor(3)], [o, torch.tensor(4)])
        discarded = o if value else n
        ok = discarded.isfinite()
        assert slow[0][~ok].isnan().all()  # inf * 0 or NaN * 0 in the device form's arithmetic
        _assert_same_values(fast[0][ok], slow[0][ok])
        assert torch.equal(fast[1], slow[1])
    # The device form's arithmetic gives +0 for a kept -0 (-0 * 1 + 0 * 1.0); the host path keeps -0.
    fast = _select(torch.tensor(True), [torch.tensor([-0.0])], [torch.tensor([1.0])])[0]
    with _device_form():
        slow = _select(torch.tensor(True), [torch.tensor([-0.0])], [torch.tensor([1.0])])[0]
    assert fast.signbit().item() and not slow.signbit().item()


@pytest.mark.parametrize("value", [True, False])
def test_flat_tree_where_host_path_is_the_device_select(value):
    g = torch.Generator().manual_seed(3)
    new = {"a": torch.randn(4, 3, 3, 3, generator=g), "b": {"c": torch.randn(5, generator=g), "n": torch.tensor(7)}}
    old = T.tree_map(lambda x: x + 1 if x.is_floating_point() else x - 1, new)
    new["b"]["c"][0] = -0.0
    flag = torch.tensor(value)
    fast_tree, fast_num = flat.tree_where(flag, new, old), flat.tree_where(flag, new, 0.0)
    with _device_form():
        slow_tree, slow_num = flat.tree_where(flag, new, old), flat.tree_where(flag, new, 0.0)
    _assert_bitwise(fast_tree, slow_tree)
    _assert_bitwise(fast_num, slow_num)
    with pytest.raises(ValueError, match="structures differ"):
        flat.tree_where(torch.tensor(False), new, {"a": old["a"]})


def _run_recipe(steps: int, nonfinite_at: int | None = None):
    """The YOLO recipe (accumulation ramp, clip, three groups) under the guard, with the EMA."""
    params = small_params(0)
    tx, e = apply_if_finite(yolo_recipe()), ema()
    state, es = tx.init(params), e.init(params)
    gen = torch.Generator().manual_seed(5)
    out = []
    for i in range(steps):
        grads = random_grads(params, gen)
        if i == nonfinite_at:
            grads["stem"]["conv"]["weight"][0, 0, 0, 0] = float("nan")
        updates, state = tx.update(grads, state, params)
        params = apply_updates(params, updates)
        es = e.update(params, es, stepped=state.stepped)
        out.append((params, state, es))
    return out


@pytest.mark.parametrize("nonfinite_at", [None, 2])
def test_recipe_with_host_flags_has_the_device_forms_values(nonfinite_at):
    """8 calls cover accumulating and stepping calls (the accumulation ramps 1 -> 2) and, with
    ``nonfinite_at``, a call the guard skips."""
    fast = _run_recipe(8, nonfinite_at)
    with _device_form():
        slow = _run_recipe(8, nonfinite_at)
    stepped = [bool(s.stepped) for _, s, _ in slow]
    assert True in stepped and False in stepped
    _assert_same_values(fast, slow)
    # A call that does not step leaves the EMA as it was: the same tensors.
    for (_, _, e0), (_, s1, e1) in zip(fast, fast[1:]):
        if not bool(s1.stepped):
            assert all(a is b for a, b in zip(T.tree_leaves(e0.ema), T.tree_leaves(e1.ema)))


def test_an_accumulating_call_runs_no_inner_transform_on_the_host_path():
    """On the CPU an accumulating call costs the accumulation add (one fused op) and small
    bookkeeping; the device form runs the whole inner transform and selects its results away."""
    from yolo_func.optim import multi_steps
    from yolo_func.testing import count_aten_ops

    params = small_params(0)
    tx = multi_steps(yolo_recipe_inner(), every=4)
    state = tx.init(params)
    grads = random_grads(params, torch.Generator().manual_seed(1))
    updates, state = tx.update(grads, state, params)  # the first call steps (every 4 from -1)
    with count_aten_ops() as fast:
        u_fast, s_fast = tx.update(grads, state, params)
    with _device_form(), count_aten_ops() as slow:
        u_slow, s_slow = tx.update(grads, state, params)
    assert not bool(s_fast.stepped) and not bool(s_slow.stepped)
    _assert_same_values((u_fast, s_fast), (u_slow, s_slow))
    assert s_fast.inner_state is state.inner_state
    assert fast.by_op["aten._foreach_add.List"] == 1 and "aten._foreach_norm.Scalar" not in fast.by_op
    assert fast.total * 3 < slow.total, (fast.total, slow.total)


@pytest.mark.parametrize("task", ["detect", "segment", "pose"])
def test_train_step_with_host_flags_has_the_device_forms_values(task):
    """Whole eager steps (yolo_sgd with its warmup accumulation ramp, EMA, BN statistics, metrics):
    the CPU fast path against the device-side selects, value for value."""
    from yolo_func import yolov8
    from yolo_func.testing.synthetic import synthetic_batch
    from yolo_func.train import init_train_state, train_step, yolo_sgd

    model = yolov8("n", task=task, num_classes=3)
    opt = yolo_sgd(batch_size=8, batches_per_epoch=4, epochs=3)  # accumulate 1, 2, 3, 4, 4: steps at 0 and 4
    e = ema()
    runs = []
    for host in (True, False):
        old = set_host_flags(host)
        try:
            ts = init_train_state(model, opt.tx, torch.Generator().manual_seed(0), ema=e)
            seen = []
            for i in range(5):
                b = synthetic_batch(task, 2, 64, num_classes=3, max_boxes=4, min_boxes=1, seed=i)
                ts, m = train_step(ts, b, model=model, tx=opt.tx, ema=e)
                seen.append((ts, m))
        finally:
            set_host_flags(old)
        runs.append(seen)
    assert [bool(m["stepped"]) for _, m in runs[1]] == [True, False, False, False, True]
    _assert_same_values(runs[0], runs[1])
    # The host path's calls that do not step keep the params and the EMA: the very tensors.
    for (ts0, _), (ts1, m1) in zip(runs[0], runs[0][1:]):
        if not bool(m1["stepped"]):
            assert all(a is b for a, b in zip(T.tree_leaves(ts0.params), T.tree_leaves(ts1.params)))
            assert all(a is b for a, b in zip(T.tree_leaves(ts0.ema.ema), T.tree_leaves(ts1.ema.ema)))
