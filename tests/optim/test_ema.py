"""Model EMA (REFERENCE.md §4.4, trap T16): decay ramp, the update rule, the stepped gate."""

from __future__ import annotations

import math

import pytest
import torch
from optim_helpers import random_grads, small_params

from yolo_func import tree as T
from yolo_func.optim import ema, ema_decay
from yolo_func.testing import assert_trees_all_close, assert_trees_all_equal


def test_decay_reference_values():
    assert float(ema_decay(torch.tensor(1))) == pytest.approx(4.998e-4, rel=1e-4)
    assert float(ema_decay(torch.tensor(2000))) == pytest.approx(0.632057, abs=5e-7)
    assert float(ema_decay(torch.tensor(10000))) == pytest.approx(0.993163, abs=5e-7)
    for u in (1, 7, 2000, 12345):  # the formula, in Python doubles
        assert float(ema_decay(torch.tensor(u))) == pytest.approx(0.9999 * (1 - math.exp(-u / 2000)), rel=1e-15)


def _model(seed):
    """Params and BN statistics, as the EMA averages both."""
    p = small_params(seed)
    state = {"stem": {"bn": {"running_mean": torch.randn(8, generator=torch.Generator().manual_seed(seed)),
                             "running_var": torch.rand(8, generator=torch.Generator().manual_seed(seed + 1))}}}
    return {"params": p, "state": state}


def test_equals_plain_python_loop():
    """Against a loop over leaves with Python-float d and the update ema + (1-d)(m - ema) as
    torch.lerp (bitwise: the op the reference's EMA matches), and the algebraic form (1e-6)."""
    e = ema()
    model = _model(0)
    s = e.init(model)
    assert_trees_all_equal(s.ema, model) and int(s.count) == 0
    plain = {k: v.clone() for k, v in T.tree_flat_dict(model).items()}
    gen = torch.Generator().manual_seed(3)
    for u in range(1, 31):
        model = T.tree_map(lambda x, g: x + g, model, random_grads(model, gen))
        s = e.update(model, s)
        d = 0.9999 * (1 - math.exp(-u / 2000))
        flat_m = T.tree_flat_dict(model)
        algebraic = {k: v + (1 - d) * (flat_m[k] - v) for k, v in plain.items()}
        plain = {k: v.lerp(flat_m[k], 1 - d) for k, v in plain.items()}
        assert int(s.count) == u
        assert_trees_all_equal(T.tree_flat_dict(s.ema), plain)
        assert_trees_all_close(T.tree_flat_dict(s.ema), algebraic, rtol=1e-6, atol=1e-6)


def test_first_update_is_nearly_the_model():
    """u counts the current update: d(1) ~ 5e-4, so the first EMA is ~99.95% the new model."""
    e = ema()
    s = e.init({"w": torch.zeros(4)})
    s = e.update({"w": torch.ones(4)}, s)
    assert torch.allclose(s.ema["w"], torch.full((4,), 1 - 0.9999 * (1 - math.exp(-1 / 2000))))


def test_stepped_gate():
    """With stepped=False nothing moves (count and average); with True it is the plain update."""
    e = ema()
    model0, model1 = _model(0), _model(1)
    s0 = e.init(model0)
    s_no = e.update(model1, s0, stepped=torch.tensor(False))
    assert_trees_all_equal(s_no, s0)
    s_yes = e.update(model1, s0, stepped=torch.tensor(True))
    assert_trees_all_equal(s_yes, e.update(model1, s0))
    # interleaved: only the stepping calls count
    s, ref = s0, s0
    for i, flag in enumerate([True, False, False, True, False, True]):
        m = _model(10 + i)
        s = e.update(m, s, stepped=torch.tensor(flag))
        if flag:
            ref = e.update(m, ref)
        assert_trees_all_equal(s, ref)


def test_structure_mismatch_names_paths():
    e = ema()
    s = e.init({"a": torch.zeros(1)})
    with pytest.raises(ValueError, match=r"(?s)^\[yolo_func\] ema.update: .*\+ b \(only in model\)"):
        e.update({"b": torch.zeros(1)}, s)


@pytest.mark.parity
def test_matches_reference_model_ema(steps=3):
    """Black-box: the reference's ModelEMA on a Conv+BN module, updated after random changes."""
    import os

    os.environ.setdefault("YOLO_OFFLINE", "1")
    from ultralytics.utils.torch_utils import ModelEMA

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8))
    ref = ModelEMA(net)
    float_sd = lambda m: {k: v.detach().clone() for k, v in m.state_dict().items() if v.dtype.is_floating_point}  # noqa: E731
    e = ema()
    s = e.init(float_sd(net))
    for _ in range(steps):
        with torch.no_grad():
            for p in net.parameters():
                p.add_(torch.randn_like(p))
            net[1].running_mean.add_(torch.randn(8))
            net[1].running_var.add_(torch.rand(8))
        ref.update(net)
        s = e.update(float_sd(net), s)
        assert_trees_all_equal(s.ema, float_sd(ref.ema))
    assert int(s.count) == ref.updates == steps


def test_matches_recorded_reference_ema():
    """The golden recorded by record_ema_golden.py from the reference's ModelEMA (bitwise)."""
    from pathlib import Path

    rec = torch.load(Path(__file__).with_name("goldens") / "ema_reference.pt", weights_only=True)
    e = ema()
    s = e.init(rec["init"])
    for model, want, updates in zip(rec["models"], rec["emas"], rec["updates"], strict=True):
        s = e.update(model, s)
        assert int(s.count) == updates
        assert_trees_all_equal(s.ema, want)
