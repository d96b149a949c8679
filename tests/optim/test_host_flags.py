"""The CPU fast path of the optimizer and EMA (issue 17 item 4, CPU): device flags read on the host.

On a plain CPU tensor in eager mode, ``host_flag`` reads a select's flag on the host, so
``where(flag, new, old)`` returns ``new`` or ``old`` whole, ``multi_steps`` skips its exact ``x * 1``
passes, its inner-state select is one fused ``new + 0 * old`` and the EMA is one ``_foreach_lerp``.
Every test compares with the device form (``set_host_flags(False)``, the code as it was) bit for
bit: float32 values compared as int32, so ``-0.0`` and ``+0.0`` differ.
"""

from __future__ import annotations

import pytest
import torch

from optim_helpers import random_grads, small_params, yolo_recipe
from yolo_func import tree as T
from yolo_func.optim import apply_if_finite, apply_updates, ema, flat
from yolo_func.optim.base import _select, host_flag, host_readable, set_host_flags


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


def test_select_true_is_the_device_select_for_every_special_value_pair():
    """``new + 0 * old`` (one fused add) against ``new * 1 + old * (1 - 1)``: the same bits wherever
    the result is not NaN (signed zeros included); NaN exactly where the device form gives NaN."""
    v = torch.tensor(SPECIAL)
    new, old = v.repeat_interleave(len(SPECIAL)), v.repeat(len(SPECIAL))
    big_new = torch.randn(100_003, generator=torch.Generator().manual_seed(0))
    big_new[::5] = 0.0
    big_new[::7] = -0.0
    big_old = torch.randn(100_003, generator=torch.Generator().manual_seed(1))
    for n, o in ((new, old), (big_new, big_old), (new.view(12, 12), old.view(12, 12))):
        flag = torch.tensor(True)
        fast = _select(flag, [n, torch.tensor(3)], [o, torch.tensor(4)])
        with _device_form():
            slow = _select(flag, [n, torch.tensor(3)], [o, torch.tensor(4)])
        nan = slow[0].isnan()
        assert torch.equal(fast[0].isnan(), nan)
        assert torch.equal(_bits(fast[0])[~nan], _bits(slow[0])[~nan])
        assert torch.equal(fast[1], slow[1])


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
def test_recipe_with_host_flags_is_bitwise_the_device_form(nonfinite_at):
    """8 calls cover accumulating and stepping calls (the accumulation ramps 1 -> 2) and, with
    ``nonfinite_at``, a call the guard skips."""
    fast = _run_recipe(8, nonfinite_at)
    with _device_form():
        slow = _run_recipe(8, nonfinite_at)
    stepped = [bool(s.stepped) for _, s, _ in slow]
    assert True in stepped and False in stepped
    _assert_bitwise(fast, slow)


@pytest.mark.parametrize("task", ["detect", "segment", "pose"])
def test_train_step_with_host_flags_is_bitwise_the_device_form(task):
    """Whole eager steps (yolo_sgd with its warmup accumulation ramp, EMA, BN statistics, metrics):
    the CPU fast path against the device-side selects, bit for bit."""
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
    _assert_bitwise(runs[0], runs[1])
