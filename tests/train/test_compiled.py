"""The compiled step on the CPU (:mod:`yolo_func.train.compiled`): the ``compile=`` values, the
compiled eager step against the plain one, inductor on a conv/BN stack, and the fit's event.

Inductor generates and compiles C++ on the CPU: the whole tiny network takes minutes on a 2-core
machine, so the full step runs through the ``"aot_eager"`` backend (dynamo + AOTAutograd, the
same tracing, functionalisation of the in-place BN statistics and autograd differentiation as
inductor, without its code generation), and inductor itself is checked on a small conv/BN/SiLU
stack through the same pieces (the BN trace hook, :func:`yolo_func.func.autograd_vjp`). The GPU
parity suite (tests/capture/test_replay_compile.py) runs inductor on the whole model.
"""

from __future__ import annotations

import importlib
import json
import warnings

import pytest
import torch

from yolo_func import tree as T
from yolo_func import yolov8
from yolo_func.func import autograd_vjp, flat_vjp
from yolo_func.models.scales import Scale
from yolo_func.nn import conv_bn_act, update_stats_in_place
from yolo_func.optim import sgd
from yolo_func.testing import assert_trees_all_close
from yolo_func.testing.synthetic import synthetic_batch
from yolo_func.train import init_train_state
from yolo_func.train.compiled import COMPILE_MODES, CompiledModel, compile_mode, compiled_for
from yolo_func.train.replay import CaptureFallbackWarning, ReplayTrainStep

#: a YOLOv8 a quarter of nano's width (8 channels at the stem), nano's depth
TINY = Scale("tiny", 0.33, 0.0625, 1024)
SIZE, BATCH, STEPS = 64, 2, 3
#: compiled (aot_eager: the same aten ops, re-ordered by AOTAutograd) vs plain torch.func step, float32
TOL = dict(rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("value, mode", [(False, "none"), (None, "none"), ("none", "none"), (True, "default"),
                                         ("default", "default"), ("max-autotune", "max-autotune"),
                                         ("aot_eager", "aot_eager")])
def test_compile_values_have_one_canonical_name(value, mode):
    assert compile_mode(value) == mode
    assert mode in COMPILE_MODES


@pytest.mark.parametrize("value, match", [
    ("fast", r"compile must be True, False or one of \['none', 'default', 'max-autotune', 'aot_eager'\], got 'fast'"),
    ("reduce-overhead", "inductor's own CUDA graphs cannot run inside the replayed graphs"),
    (1, "got 1"),
])
def test_bad_compile_values_raise_a_clear_error(value, match):
    model = yolov8(TINY, num_classes=2)
    with pytest.raises(ValueError, match=match):
        ReplayTrainStep(model, sgd(0.01), capture="none", compile=value)
    with pytest.raises(ValueError, match=match):
        compile_mode(value)


def test_a_compiled_model_is_for_one_model():
    a, b = yolov8(TINY, num_classes=2), yolov8(TINY, num_classes=2)
    cm = CompiledModel(a, "aot_eager")
    assert compiled_for(a, cm) is cm and compiled_for(a, False) is None
    with pytest.raises(ValueError, match="built for another model"):
        ReplayTrainStep(b, sgd(0.01), compile=cm)
    with pytest.raises(ValueError, match="other than 'none'"):
        CompiledModel(a, False)
    step = ReplayTrainStep(a, sgd(0.01), capture="none")
    assert step.compiled is None and step.compile_seconds == 0.0 and "compile='none'" in repr(step)


def _steps(step, ts, task, num_classes):
    out = []
    for i in range(STEPS):
        b = synthetic_batch(task, BATCH, SIZE, num_classes=num_classes, seed=10 + i)
        ts, m = step(ts, b)
        out.append((T.tree_clone(ts.params), T.tree_clone(ts.state), float(m["loss"])))
    return out


@pytest.mark.slow
def test_compiled_eager_step_tracks_the_plain_step_and_a_fallback_shares_it():
    """Three steps (detect, tiny model, 64 px, batch 2, float32) of the compiled eager step equal
    the plain eager step within ``TOL`` (params, BN statistics, losses); it compiled once per part
    (no recompile on later steps), reported compile seconds per part, and a replay level's CPU
    fallback with the same :class:`CompiledModel` runs the same compiled functions (bitwise)."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = yolov8(TINY, task="detect", num_classes=2)
    tx = sgd(0.01, momentum=0.9)
    ts0 = init_train_state(model, tx, torch.Generator().manual_seed(0))
    cm = CompiledModel(model, "aot_eager")
    plain = _steps(ReplayTrainStep(model, tx, capture="none"), T.tree_clone(ts0), "detect", 2)
    compiled_step = ReplayTrainStep(model, tx, capture="none", compile=cm)
    compiled = _steps(compiled_step, T.tree_clone(ts0), "detect", 2)
    for i, ((p0, s0, l0), (p1, s1, l1)) in enumerate(zip(plain, compiled)):
        assert l1 == pytest.approx(l0, rel=TOL["rtol"]), f"step {i}: loss"
        assert_trees_all_close(p1, p0, **TOL)
        assert_trees_all_close(s1, s0, **TOL)
    assert not torch.equal(plain[-1][0]["network"]["backbone"]["stem"]["conv"]["weight"],
                           ts0.params["network"]["backbone"]["stem"]["conv"]["weight"])  # it trained
    assert set(cm.compile_times) == {"network/forward", "network/backward", "detect/forward", "detect/backward"}
    assert all(t > 0 for t in cm.compile_times.values())
    assert compiled_step.compile_seconds == pytest.approx(sum(cm.compile_times.values()))
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert frames == 2, f"one graph for the network, one for the head, got {frames} (recompiles or graph breaks)"
    seconds = cm.compile_seconds

    fallback = ReplayTrainStep(model, tx, capture="network", compile=cm)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        again = _steps(fallback, T.tree_clone(ts0), "detect", 2)
    assert [w.category for w in caught] == [CaptureFallbackWarning]
    for (p0, s0, l0), (p1, s1, l1) in zip(compiled, again):
        assert l0 == l1
        T.tree_map(lambda a, b: torch.testing.assert_close(a, b, rtol=0, atol=0), (p0, s0), (p1, s1))
    assert cm.compile_seconds == seconds  # same shapes: nothing compiled again
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2


def test_inductor_conv_bn_stack_matches_torch_func():
    """Inductor (C++ on the CPU) of a two-layer conv/BN/SiLU stack, differentiated with
    :func:`autograd_vjp` and BN statistics updated in place inside the compiled graph, equals the
    plain ``torch.func`` path within float32 tolerance: outputs, parameter and input gradients,
    and the new running statistics (written into the state passed in)."""
    importlib.import_module("yolo_func.nn.batchnorm").enable_compile()
    a, b = conv_bn_act(3, 8, 3, 2), conv_bn_act(8, 8, 3, 1)
    gen = torch.Generator().manual_seed(0)
    (pa, sa), (pb, sb) = a.init(gen), b.init(gen)
    params, state = {"a": pa, "b": pb}, {"a": sa, "b": sb}
    x = torch.rand(2, 3, 16, 16, generator=gen)

    def apply(p, s, x):
        y, na = a.apply(p["a"], s["a"], x, train=True)
        y, nb = b.apply(p["b"], s["b"], y, train=True)
        return y, {"a": na, "b": nb}

    compiled = torch.compile(apply, backend="inductor", dynamic=False, fullgraph=True)
    ct = torch.rand(2, 8, 8, 8, generator=gen)
    results = []
    for fn, vjp in ((apply, flat_vjp), (compiled, autograd_vjp)):
        fresh = T.tree_clone(state)
        with update_stats_in_place():
            y, pullback, new_state = vjp(lambda p, xx: fn(p, fresh, xx), params, x)
        g_params, g_x = pullback(ct)
        assert T.tree_leaves(new_state)[0] is T.tree_leaves(fresh)[0] or torch.equal(T.tree_leaves(new_state)[0],
                                                                                       T.tree_leaves(fresh)[0])
        results.append((y, g_params, g_x, fresh))
    assert not torch.equal(results[1][3]["a"]["bn"]["running_mean"], state["a"]["bn"]["running_mean"])  # updated
    assert_trees_all_close(results[1], results[0], rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_fit_reports_compile_seconds_in_events(tmp_path):
    """A one-epoch CPU fit with ``train.compile=aot_eager`` writes one ``compile`` event (mode,
    seconds, parts) after its first step."""
    from yolo_func.configs import build_config
    from yolo_func.data import builtin_dataset
    from yolo_func.train import fit

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    cfg = build_config("yolov8n", flags={"imgsz": 64, "batch": 2, "epochs": 1, "out": str(tmp_path / "run"),
                                         "device": "cpu"},
                       overrides=["data.workers=0", "train.plots=false", "train.compile=aot_eager", "val.coco=off"])
    tr = builtin_dataset("detect", "train", root=tmp_path / "data", num_images=4)
    va = builtin_dataset("detect", "val", root=tmp_path / "data", num_images=2)
    fit(cfg, train_data=tr, val_data=va, progress=False)
    events = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    compiles = [e for e in events if e["event"] == "compile"]
    assert len(compiles) == 1, [e["event"] for e in events]
    ev = compiles[0]
    assert ev["mode"] == "aot_eager" and ev["step"] == 0 and ev["seconds"] > 0
    assert set(ev["parts"]) == {"network/forward", "network/backward", "detect/forward", "detect/backward"}
    assert ev["seconds"] == pytest.approx(sum(ev["parts"].values()), abs=0.01)
