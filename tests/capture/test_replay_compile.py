"""Compiled replay levels (``ReplayTrainStep(compile=...)``) on the GPU.

Every level with ``compile=True`` is bitwise equal to the compiled eager step (``capture="none"``
with the same :class:`yolo_func.train.compiled.CompiledModel`) over 20 steps; the compiled step
tracks the plain one within a stated tolerance; a shape compiles once (no recompiles, no graph
breaks) and the compile seconds are reported.

Honest replays, as tests/capture/test_replay_step.py: ``CaptureFallbackWarning`` is an error here
(a silent eager fallback would compare the compiled eager step with itself) and the captures are
counted exactly (:func:`yolo_func.testing.assert_max_captures`). Deterministic settings:
tests/conftest.py (TF32 off, deterministic algorithms, warn only) and cuDNN benchmark off.

One command (about 5-10 minutes on an H200, most of it inductor compiling one shape per task;
set ``TORCHINDUCTOR_CACHE_DIR`` to keep the cache between runs)::

    python3 -m pytest -q -m cuda tests/capture/test_replay_compile.py
"""

from __future__ import annotations

import pytest
import torch

from yolo_func import tree as T
from yolo_func import yolov8
from yolo_func.optim import chain, clip_by_global_norm, ema, multi_steps, partition, sgd, yolo_param_labels
from yolo_func.structures import Batch
from yolo_func.testing import assert_max_captures, assert_trees_all_equal
from yolo_func.testing.synthetic import synthetic_batch
from yolo_func.train import init_train_state
from yolo_func.train.compiled import CompiledModel
from yolo_func.train.replay import ReplayTrainStep

pytestmark = [pytest.mark.cuda, pytest.mark.filterwarnings("error::yolo_func.train.replay.CaptureFallbackWarning"),
              pytest.mark.usefixtures("no_cudnn_benchmark")]

STEPS = 20
SIZE, BATCH = 256, 4
_MODELS: dict = {}


def _compiled(task: str) -> CompiledModel:
    """One model and one CompiledModel per task for the module: every test of a task reuses the
    compiled graphs (one inductor compile per task and shape)."""
    if task not in _MODELS:
        model = yolov8("n", task=task)
        _MODELS[task] = CompiledModel(model, True)
    return _MODELS[task]


def _tx(every):
    groups = {n: sgd(0.01, 0.9, nesterov=True, weight_decay=5e-4 if n == "decay" else 0.0)
              for n in ("decay", "no_decay", "bias")}
    return multi_steps(chain(clip_by_global_norm(10.0), partition(groups, yolo_param_labels)), every=every)


def _uint8(b):
    return Batch((b.images * 255).round().to(torch.uint8), b.targets)


def _captures(capture, model):
    if capture == "none":
        return 0
    if capture == "step":
        return 1
    return 1 + (len(model.heads) if capture == "network+heads" else 0) + 1  # network, heads, update


def _run(task, capture, steps, model, tx, e, *, compile, seed=100, **kw):
    """Yields ``(i, TrainState, metrics)`` (clones) after each step; uint8 images, as a fit feeds."""
    ts = init_train_state(model, tx, torch.Generator().manual_seed(0), device="cuda", ema=e)
    step = ReplayTrainStep(model, tx, ema=e, capture=capture, compile=compile, **kw)
    for i in range(steps):
        b = _uint8(synthetic_batch(task, BATCH, SIZE, num_classes=model.num_classes, seed=seed + i, device="cuda"))
        ts, m = step(ts, b)
        yield i, T.tree_clone(ts), {k: v.clone() for k, v in m.items()}


def _compare(eager, replay, what, *, captures):
    with assert_max_captures(n=captures) as made:
        for (i, ts_e, m_e), (_, ts_r, m_r) in zip(eager, replay, strict=True):
            try:
                assert_trees_all_equal(ts_r, ts_e, strict=True)
                assert_trees_all_equal(m_r, m_e, strict=True)
            except AssertionError as err:
                raise AssertionError(f"{what}, step {i}: {err}") from None
    assert made.count == captures, f"{what}: {made.count} captures, expected {captures}"


def test_compiled_eager_is_deterministic():
    """The compiled eager step against itself first: a non-deterministic compiled kernel shows up
    here, not as a replay bug."""
    cm = _compiled("segment")
    e, tx = ema(), _tx(1)
    _compare(_run("segment", "none", 3, cm.model, tx, e, compile=cm), _run("segment", "none", 3, cm.model, tx, e, compile=cm),
             "compiled eager vs compiled eager", captures=0)


@pytest.mark.parametrize("task", ["detect", "segment", "pose"])
@pytest.mark.parametrize("capture", ["network", "network+heads", "step"])
def test_compiled_level_equals_the_compiled_eager_step(task, capture):
    """20 steps (gradient accumulation every 2), uint8 images: bitwise equal to the compiled eager
    step, the exact number of captures, nothing compiled again after the first step's shapes."""
    cm = _compiled(task)
    model = cm.model
    e, tx = ema(), _tx(2)
    eager = _run(task, "none", STEPS, model, tx, e, compile=cm)
    replay = _run(task, capture, STEPS, model, tx, e, compile=cm)
    _compare(eager, replay, f"compiled {task} {capture}", captures=_captures(capture, model))
    assert set(cm.compile_times) >= {"network/forward", "network/backward"} | {f"{h}/{d}" for h in model.heads
                                                                               for d in ("forward", "backward")}


def test_a_shape_compiles_once_and_reports_its_seconds():
    """A fresh CompiledModel at the ``step`` level: one graph for the network and one per head (no
    graph break, no recompile over 5 steps), compile seconds per part, all on the first step."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = yolov8("n", task="segment")
    e, tx = ema(), _tx(1)
    ts = init_train_state(model, tx, torch.Generator().manual_seed(0), device="cuda", ema=e)
    step = ReplayTrainStep(model, tx, ema=e, capture="step", compile=True)
    seconds = []
    with assert_max_captures(n=1) as made:
        for i in range(5):
            ts, _ = step(ts, _uint8(synthetic_batch("segment", BATCH, SIZE, seed=i, device="cuda")))
            seconds.append(step.compile_seconds)
    assert made.count == 1
    assert seconds[0] > 0 and seconds == [seconds[0]] * 5, seconds
    assert set(step.compiled.compile_times) == {f"{p}/{d}" for p in ("network", "detect", "segment")
                                                for d in ("forward", "backward")}
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert graphs == 3, f"network, detect, segment: one graph each; got {graphs} (graph breaks or recompiles)"
    _MODELS.pop("segment", None)  # the module's shared one was compiled before the reset


def test_compiled_step_tracks_the_plain_step():
    """The compiled step against the plain one, float32 (no autocast; TF32 off), detect: the same
    first-step loss and gradient norm to 1e-4 relative (inductor's fused kernels re-associate
    float32 sums), and after 10 steps the parameters differ by at most 2% of how far the plain
    run moved them (an error in a compiled gradient moves them elsewhere)."""
    model = yolov8("n", task="detect")
    e, tx = ema(), _tx(1)
    cm = CompiledModel(model, True)
    plain = list(_run("detect", "step", 10, model, tx, e, compile=False, autocast_dtype=None))
    compiled = list(_run("detect", "step", 10, model, tx, e, compile=cm, autocast_dtype=None))
    m_p, m_c = plain[0][2], compiled[0][2]
    for k in ("loss", "grad_norm"):
        torch.testing.assert_close(m_c[k], m_p[k], rtol=1e-4, atol=0, msg=f"first step {k}")
    p0 = init_train_state(model, tx, torch.Generator().manual_seed(0), device="cuda", ema=e).params
    flat = lambda t: torch.cat([x.float().flatten() for x in T.tree_leaves(t)])  # noqa: E731
    moved = (flat(plain[-1][1].params) - flat(p0)).norm()
    apart = (flat(compiled[-1][1].params) - flat(plain[-1][1].params)).norm()
    assert moved > 0 and apart <= 0.02 * moved, f"compiled vs plain after 10 steps: {apart:.3g}, plain moved {moved:.3g}"
