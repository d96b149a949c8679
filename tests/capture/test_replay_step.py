"""Replay levels of the training step are bitwise equal to the eager step (GPU).

Deterministic settings (tests/conftest.py): TF32 off, ``torch.use_deterministic_algorithms(True,
warn_only=True)``; cuDNN benchmark off here. The eager step is first checked against itself, so a
non-deterministic kernel shows up as that, not as a replay bug.
"""

import warnings

import pytest
import torch

from yolo_func import tree as T
from yolo_func import yolov8
from yolo_func.io import load_checkpoint, save_checkpoint
from yolo_func.optim import chain, clip_by_global_norm, ema, multi_steps, partition, sgd, yolo_param_labels
from yolo_func.testing.synthetic import synthetic_batch
from yolo_func.train import init_train_state
from yolo_func.train.replay import CaptureFallbackWarning, ReplayTrainStep

pytestmark = pytest.mark.cuda

STEPS = 20
SIZE = 256


def _tx(every):
    groups = {n: sgd(0.01, 0.9, nesterov=True, weight_decay=5e-4 if n == "decay" else 0.0)
              for n in ("decay", "no_decay", "bias")}
    return multi_steps(chain(clip_by_global_norm(10.0), partition(groups, yolo_param_labels)), every=every)


def _assert_equal(a, b, what):
    bad = [p for (p, x), y in zip(T.tree_items(a), T.tree_leaves(b)) if not torch.equal(x, y)]
    assert T.tree_structure(a) == T.tree_structure(b), what
    assert not bad, f"{what}: {len(bad)} leaves differ, e.g. {bad[:5]}"


def _run(task, batch, every, capture, steps, model, e, tx, *, size=SIZE, seed=100, **step_kw):
    ts = init_train_state(model, tx, torch.Generator().manual_seed(0), device="cuda", ema=e)
    step = ReplayTrainStep(model, tx, ema=e, capture=capture, **step_kw)
    for i in range(steps):
        b = synthetic_batch(task, batch, size, num_classes=model.num_classes, seed=seed + i, device="cuda")
        ts, m = step(ts, b)
        yield i, T.tree_clone(ts), {k: v.clone() for k, v in m.items()}


@pytest.fixture(autouse=True)
def _deterministic():
    old = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = False
    yield
    torch.backends.cudnn.benchmark = old


@pytest.mark.parametrize("task", ["detect", "segment", "pose"])
@pytest.mark.parametrize("batch", [4, 16])
@pytest.mark.parametrize("every", [1, 4])
@pytest.mark.parametrize("capture", ["network", "network+heads", "step"])
def test_replay_level_equals_eager(task, batch, every, capture):
    model = yolov8("n", task=task)
    e, tx = ema(), _tx(every)
    eager = _run(task, batch, every, "none", STEPS, model, e, tx)
    replay = _run(task, batch, every, capture, STEPS, model, e, tx)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CaptureFallbackWarning)  # no silent eager fallback
        for (i, ts_e, m_e), (_, ts_r, m_r) in zip(eager, replay):
            _assert_equal(ts_r, ts_e, f"{task} b{batch} acc{every} {capture}: TrainState after step {i}")
            _assert_equal(m_r, m_e, f"{task} b{batch} acc{every} {capture}: metrics of step {i}")


@pytest.mark.parametrize("capture", ["network", "network+heads"])
def test_network_levels_with_an_eager_update_equal_eager(capture):
    """``replay_update=False``: the guard, optimizer and EMA run eagerly after the replayed graphs."""
    model = yolov8("n", task="segment")
    e, tx = ema(), _tx(2)
    eager = _run("segment", 4, 2, "none", 6, model, e, tx)
    replay = _run("segment", 4, 2, capture, 6, model, e, tx, replay_update=False)
    for (i, ts_e, m_e), (_, ts_r, m_r) in zip(eager, replay):
        _assert_equal(ts_r, ts_e, f"{capture} eager update: TrainState after step {i}")
        _assert_equal(m_r, m_e, f"{capture} eager update: metrics of step {i}")


@pytest.mark.parametrize("task", ["detect", "segment"])
def test_step_level_equals_eager_at_640_px(task):
    """The training size: 8,400 anchors, so ``torch.topk`` over ``[B, M, A]`` takes its multi-block
    path and the losses run at full size inside the captured step (256 px stays single-block)."""
    model = yolov8("n", task=task)
    e, tx = ema(), _tx(1)
    eager = _run(task, 4, 1, "none", 4, model, e, tx, size=640, seed=200)
    replay = _run(task, 4, 1, "step", 4, model, e, tx, size=640, seed=200)
    for (i, ts_e, m_e), (_, ts_r, m_r) in zip(eager, replay):
        _assert_equal(m_r, m_e, f"{task} 640 px step: metrics of step {i}")
        _assert_equal(ts_r, ts_e, f"{task} 640 px step: TrainState after step {i}")


def test_eager_is_deterministic():
    model = yolov8("n", task="segment")
    e, tx = ema(), _tx(1)
    for (_, a, ma), (_, b, mb) in zip(_run("segment", 4, 1, "none", 3, model, e, tx), _run("segment", 4, 1, "none", 3, model, e, tx)):
        _assert_equal(a, b, "eager vs eager")


@pytest.mark.parametrize("capture", ["network", "network+heads", "step"])
def test_replay_after_checkpoint_resume(tmp_path, capture):
    model = yolov8("n", task="detect")
    e, tx = ema(), _tx(2)
    straight = list(_run("detect", 4, 2, capture, 6, model, e, tx))[-1][1]
    ts = init_train_state(model, tx, torch.Generator().manual_seed(0), device="cuda", ema=e)
    step = ReplayTrainStep(model, tx, ema=e, capture=capture)
    for i in range(3):
        ts, _ = step(ts, synthetic_batch("detect", 4, SIZE, seed=100 + i, device="cuda"))
    save_checkpoint(tmp_path / "ck.pt", ts)
    template = init_train_state(model, tx, torch.Generator().manual_seed(1), device="cuda", ema=e)
    ts, _, _ = load_checkpoint(tmp_path / "ck.pt", template)
    step = ReplayTrainStep(model, tx, ema=e, capture=capture)  # a fresh capture over the resumed state
    for i in range(3, 6):
        ts, _ = step(ts, synthetic_batch("detect", 4, SIZE, seed=100 + i, device="cuda"))
    _assert_equal(ts, straight, f"{capture}: resumed vs straight")


def test_head_swapped_between_captures():
    base = yolov8("n", task="detect")
    e, tx = ema(), _tx(1)
    step = ReplayTrainStep(base, tx, ema=e, capture="network")
    ts = init_train_state(base, tx, torch.Generator().manual_seed(0), device="cuda", ema=e)
    for i in range(2):
        ts, _ = step(ts, synthetic_batch("detect", 4, SIZE, seed=i, device="cuda"))
    # a notebook swaps in a pose head: a new model, a new step object, same network weights
    pose = yolov8("n", task="pose", num_classes=80)
    tx2 = _tx(1)
    p, s = pose.init(torch.Generator().manual_seed(5))
    p = {"network": T.tree_clone(ts.params["network"]), "heads": {"detect": T.tree_clone(ts.params["heads"]["detect"]), "pose": p["heads"]["pose"]}}
    s = {"network": T.tree_clone(ts.state["network"]), "heads": {"detect": T.tree_clone(ts.state["heads"]["detect"]), "pose": s["heads"]["pose"]}}
    ts_e = init_train_state(pose, tx2, torch.Generator(), device="cuda", params=T.tree_clone(p), state=T.tree_clone(s))
    ts_r = init_train_state(pose, tx2, torch.Generator(), device="cuda", params=T.tree_clone(p), state=T.tree_clone(s))
    eager, replay = ReplayTrainStep(pose, tx2, capture="none"), ReplayTrainStep(pose, tx2, capture="network")
    for i in range(3):
        b = synthetic_batch("pose", 4, SIZE, seed=50 + i, device="cuda")
        ts_e, _ = eager(ts_e, b)
        ts_r, _ = replay(ts_r, b)
        _assert_equal(ts_r, ts_e, f"pose head swapped in, step {i}")


def test_cache_overflow_falls_back_with_one_warning():
    model = yolov8("n", task="detect")
    tx = _tx(1)
    ts = init_train_state(model, tx, torch.Generator().manual_seed(0), device="cuda")
    step = ReplayTrainStep(model, tx, capture="step", max_captures=1)
    ts, _ = step(ts, synthetic_batch("detect", 2, 128, seed=0, device="cuda"))
    ts = T.tree_clone(ts)
    with pytest.warns(CaptureFallbackWarning, match="full"):
        ts, _ = step(ts, synthetic_batch("detect", 2, 160, seed=1, device="cuda"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", CaptureFallbackWarning)  # once per reason
        ts, _ = step(ts, synthetic_batch("detect", 2, 160, seed=2, device="cuda"))


@pytest.mark.parametrize("task", ["detect", "segment", "pose"])
def test_eager_train_step_has_no_host_sync(task):
    """The whole eager step — network and head VJPs, assignment, losses, the non-finite guard,
    optimizer with accumulation, EMA — never waits for the device."""
    model = yolov8("n", task=task)
    e, tx = ema(), _tx(2)
    ts = init_train_state(model, tx, torch.Generator().manual_seed(0), device="cuda", ema=e)
    step = ReplayTrainStep(model, tx, ema=e, capture="none")
    b = synthetic_batch(task, 4, SIZE, num_classes=model.num_classes, seed=3, device="cuda")
    ts, _ = step(ts, b)  # warm-up: lazy initialisation may sync
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(2):
            ts, m = step(ts, b)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert bool(m["finite"])
