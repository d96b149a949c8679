"""Replay levels of the training step are bitwise equal to the eager step (GPU).

Deterministic settings (tests/conftest.py): TF32 off, ``torch.use_deterministic_algorithms(True,
warn_only=True)``; cuDNN benchmark off here. The eager step is first checked against itself, so a
non-deterministic kernel shows up as that, not as a replay bug.

Honest replays: every test here turns ``CaptureFallbackWarning`` into an error (a silent eager
fallback would compare eager with eager) and counts the captures it makes
(:func:`yolo_func.testing.assert_max_captures`, then the exact count).
"""

import warnings

import pytest
import torch

from yolo_func import tree as T
from yolo_func import yolov8
from yolo_func.io import load_checkpoint, save_checkpoint
from yolo_func.optim import chain, clip_by_global_norm, ema, multi_steps, partition, sgd, yolo_param_labels
from yolo_func.structures import Batch
from yolo_func.testing import assert_max_captures, assert_trees_all_equal
from yolo_func.testing.synthetic import synthetic_batch
from yolo_func.train import init_train_state
from yolo_func.train.replay import CaptureFallbackWarning, ReplayTrainStep

pytestmark = [pytest.mark.cuda, pytest.mark.filterwarnings("error::yolo_func.train.replay.CaptureFallbackWarning"),
              pytest.mark.usefixtures("no_cudnn_benchmark")]

STEPS = 20
SIZE = 256


def _tx(every):
    groups = {n: sgd(0.01, 0.9, nesterov=True, weight_decay=5e-4 if n == "decay" else 0.0)
              for n in ("decay", "no_decay", "bias")}
    return multi_steps(chain(clip_by_global_norm(10.0), partition(groups, yolo_param_labels)), every=every)


def _assert_equal(a, b, what):
    """Bitwise: same structure, dtypes, devices and values (NaN equals nothing, as torch.equal)."""
    try:
        assert_trees_all_equal(a, b, strict=True)
    except AssertionError as err:
        raise AssertionError(f"{what}: {err}") from None


def _captures(capture, model, *, replay_update=True):
    """Captures one input shape needs at a level: the network pair, one pair per replayed head and
    the update graph, or the one whole-step graph."""
    if capture == "none":
        return 0
    if capture == "step":
        return 1
    heads = len(model.heads) if capture == "network+heads" else 0
    return 1 + heads + int(replay_update)


def _uint8(b):
    """The batch with its images as uint8 pixels (0..255)."""
    return Batch((b.images * 255).round().to(torch.uint8), b.targets)


def _as_float(b):
    """A uint8 batch's images as the float batch ``images.float() / 255``."""
    return Batch(b.images.float() / 255, b.targets)


def _run(task, batch, every, capture, steps, model, e, tx, *, size=SIZE, seed=100, images=None, **step_kw):
    """Yields ``(i, TrainState, metrics)`` after each step; ``size`` an int or a list (one per step);
    ``images`` maps the synthetic batch (e.g. to uint8 pixels)."""
    ts = init_train_state(model, tx, torch.Generator().manual_seed(0), device="cuda", ema=e)
    step = ReplayTrainStep(model, tx, ema=e, capture=capture, **step_kw)
    for i in range(steps):
        sz = size[i] if isinstance(size, list) else size
        b = synthetic_batch(task, batch, sz, num_classes=model.num_classes, seed=seed + i, device="cuda")
        ts, m = step(ts, b if images is None else images(b))
        yield i, T.tree_clone(ts), {k: v.clone() for k, v in m.items()}


def _compare(eager, replay, what, *, captures):
    """Step by step, bitwise; exactly ``captures`` captures (the eager run makes none)."""
    with assert_max_captures(n=captures) as made:
        for (i, ts_e, m_e), (_, ts_r, m_r) in zip(eager, replay, strict=True):
            _assert_equal(ts_r, ts_e, f"{what}: TrainState after step {i}")
            _assert_equal(m_r, m_e, f"{what}: metrics of step {i}")
    assert made.count == captures, f"{what}: {made.count} captures, expected {captures}"


@pytest.mark.parametrize("task", ["detect", "segment", "pose"])
@pytest.mark.parametrize("batch", [4, 16])
@pytest.mark.parametrize("every", [1, 4])
@pytest.mark.parametrize("capture", ["network", "network+heads", "step"])
def test_replay_level_equals_eager(task, batch, every, capture):
    model = yolov8("n", task=task)
    e, tx = ema(), _tx(every)
    eager = _run(task, batch, every, "none", STEPS, model, e, tx)
    replay = _run(task, batch, every, capture, STEPS, model, e, tx)
    _compare(eager, replay, f"{task} b{batch} acc{every} {capture}", captures=_captures(capture, model))


@pytest.mark.parametrize("task", ["detect", "segment"])
@pytest.mark.parametrize("capture", ["network", "network+heads", "step"])
def test_replay_level_equals_eager_with_the_autograd_backend(task, capture, monkeypatch):
    """``vjp="autograd"``: every level equals the eager step with the same backend, bitwise, and
    ``torch.func.vjp`` is never called (it raises here)."""
    import yolo_func.func as F

    def no_functorch(*args, **kwargs):
        raise AssertionError("torch.func.vjp called under vjp='autograd'")

    monkeypatch.setattr(torch.func, "vjp", no_functorch)
    monkeypatch.setattr(F, "vjp", no_functorch)
    model = yolov8("n", task=task)
    e, tx = ema(), _tx(1)
    eager = _run(task, 4, 1, "none", 8, model, e, tx, vjp="autograd")
    replay = _run(task, 4, 1, capture, 8, model, e, tx, vjp="autograd")
    _compare(eager, replay, f"{task} autograd {capture}", captures=_captures(capture, model))


def test_a_fresh_process_replaying_with_the_autograd_backend_never_imports_dynamo():
    import json
    import subprocess
    import sys
    import textwrap
    from pathlib import Path

    code = textwrap.dedent("""
        import json, sys, torch
        from yolo_func import yolov8
        from yolo_func.optim import sgd
        from yolo_func.testing.synthetic import synthetic_batch
        from yolo_func.train import init_train_state
        from yolo_func.train.replay import ReplayTrainStep
        model = yolov8("n", task="segment", num_classes=5)
        tx = sgd(0.01, momentum=0.9)
        ts = init_train_state(model, tx, torch.Generator().manual_seed(0), device="cuda")
        step = ReplayTrainStep(model, tx, capture="step", warmup=1, vjp="autograd")
        for i in range(3):
            ts, m = step(ts, synthetic_batch("segment", 4, 128, num_classes=5, max_boxes=8, seed=i, device="cuda"))
        torch.cuda.synchronize()
        print(json.dumps({"captures": step.cache.num_captures, "dynamo": "torch._dynamo" in sys.modules,
                          "finite": bool(m["finite"])}))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"captures": 1, "dynamo": False, "finite": True}


@pytest.mark.parametrize("capture", ["network", "network+heads"])
def test_network_levels_with_an_eager_update_equal_eager(capture):
    """``replay_update=False``: the guard, optimizer and EMA run eagerly after the replayed graphs."""
    model = yolov8("n", task="segment")
    e, tx = ema(), _tx(2)
    eager = _run("segment", 4, 2, "none", 6, model, e, tx)
    replay = _run("segment", 4, 2, capture, 6, model, e, tx, replay_update=False)
    _compare(eager, replay, f"{capture} eager update", captures=_captures(capture, model, replay_update=False))


@pytest.mark.parametrize("task", ["detect", "segment"])
def test_step_level_equals_eager_at_640_px(task):
    """The training size: 8,400 anchors, so ``torch.topk`` over ``[B, M, A]`` takes its multi-block
    path and the losses run at full size inside the captured step (256 px stays single-block)."""
    model = yolov8("n", task=task)
    e, tx = ema(), _tx(1)
    eager = _run(task, 4, 1, "none", 4, model, e, tx, size=640, seed=200)
    replay = _run(task, 4, 1, "step", 4, model, e, tx, size=640, seed=200)
    _compare(eager, replay, f"{task} 640 px step", captures=1)


def test_network_heads_replays_two_image_sizes_within_two_captures_budget():
    """Issue 11's budget case: a segment model at ``network+heads`` needs four captures per image
    size (network, two heads, update); ``max_captures`` counts image sizes, so two sizes replay
    with ``max_captures=2`` — no fallback (an error here), eight captures, bitwise equal to eager
    while the sizes alternate."""
    model = yolov8("n", task="segment")
    e, tx = ema(), _tx(2)
    sizes = [256, 320, 256, 320, 256, 320]
    eager = _run("segment", 4, 2, "none", len(sizes), model, e, tx, size=sizes)
    replay = _run("segment", 4, 2, "network+heads", len(sizes), model, e, tx, size=sizes, max_captures=2)
    _compare(eager, replay, "segment network+heads, two sizes", captures=2 * _captures("network+heads", model))


@pytest.mark.parametrize("capture", ["none", "network", "network+heads", "step"])
def test_uint8_images_equal_float_images_at_every_level(capture):
    """uint8 pixels are divided by 255 on the device inside the graphs (the captured network
    forward, or the captured step): the same steps, bit for bit, as the float batch
    ``images.float() / 255`` at the same level, with no fallback."""
    model = yolov8("n", task="segment")
    e, tx = ema(), _tx(1)
    as_float = _run("segment", 4, 1, capture, 4, model, e, tx, images=lambda b: _as_float(_uint8(b)))
    as_uint8 = _run("segment", 4, 1, capture, 4, model, e, tx, images=_uint8)
    _compare(as_float, as_uint8, f"{capture} uint8 vs float", captures=2 * _captures(capture, model))


def test_eager_is_deterministic():
    model = yolov8("n", task="segment")
    e, tx = ema(), _tx(1)
    _compare(_run("segment", 4, 1, "none", 3, model, e, tx), _run("segment", 4, 1, "none", 3, model, e, tx),
             "eager vs eager", captures=0)


@pytest.mark.parametrize("capture", ["network", "network+heads", "step"])
def test_replay_after_checkpoint_resume(tmp_path, capture):
    model = yolov8("n", task="detect")
    e, tx = ema(), _tx(2)
    per_step_object = _captures(capture, model)
    with assert_max_captures(n=3 * per_step_object) as made:
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
    assert made.count == 3 * per_step_object  # the straight run, before and after the resume
    _assert_equal(ts, straight, f"{capture}: resumed vs straight")


def test_head_swapped_between_captures():
    base = yolov8("n", task="detect")
    e, tx = ema(), _tx(1)
    step = ReplayTrainStep(base, tx, ema=e, capture="network")
    ts = init_train_state(base, tx, torch.Generator().manual_seed(0), device="cuda", ema=e)
    with assert_max_captures(n=2) as made:  # the network pair and the update
        for i in range(2):
            ts, _ = step(ts, synthetic_batch("detect", 4, SIZE, seed=i, device="cuda"))
    assert made.count == 2
    # a notebook swaps in a pose head: a new model, a new step object, same network weights
    pose = yolov8("n", task="pose", num_classes=80)
    tx2 = _tx(1)
    p, s = pose.init(torch.Generator().manual_seed(5))
    p = {"network": T.tree_clone(ts.params["network"]), "heads": {"detect": T.tree_clone(ts.params["heads"]["detect"]), "pose": p["heads"]["pose"]}}
    s = {"network": T.tree_clone(ts.state["network"]), "heads": {"detect": T.tree_clone(ts.state["heads"]["detect"]), "pose": s["heads"]["pose"]}}
    ts_e = init_train_state(pose, tx2, torch.Generator(), device="cuda", params=T.tree_clone(p), state=T.tree_clone(s))
    ts_r = init_train_state(pose, tx2, torch.Generator(), device="cuda", params=T.tree_clone(p), state=T.tree_clone(s))
    eager, replay = ReplayTrainStep(pose, tx2, capture="none"), ReplayTrainStep(pose, tx2, capture="network")
    with assert_max_captures(n=2) as made:  # a new network pair and update for the new step object
        for i in range(3):
            b = synthetic_batch("pose", 4, SIZE, seed=50 + i, device="cuda")
            ts_e, _ = eager(ts_e, b)
            ts_r, _ = replay(ts_r, b)
            _assert_equal(ts_r, ts_e, f"pose head swapped in, step {i}")
    assert made.count == 2


def test_cache_overflow_falls_back_with_one_warning():
    model = yolov8("n", task="detect")
    tx = _tx(1)
    ts = init_train_state(model, tx, torch.Generator().manual_seed(0), device="cuda")
    step = ReplayTrainStep(model, tx, capture="step", max_captures=1)
    with assert_max_captures(n=1) as made:
        ts, _ = step(ts, synthetic_batch("detect", 2, 128, seed=0, device="cuda"))
        ts = T.tree_clone(ts)
        with pytest.warns(CaptureFallbackWarning, match="full"):
            ts, _ = step(ts, synthetic_batch("detect", 2, 160, seed=1, device="cuda"))
        with warnings.catch_warnings():
            warnings.simplefilter("error", CaptureFallbackWarning)  # once per reason
            ts, _ = step(ts, synthetic_batch("detect", 2, 160, seed=2, device="cuda"))
    assert made.count == 1  # the refused size captured nothing


@pytest.mark.parametrize("task", ["detect", "segment", "pose"])
def test_eager_train_step_has_no_host_sync(task):
    """The whole eager step — network and head VJPs, assignment, losses, the non-finite guard,
    optimizer with accumulation, EMA — never waits for the device."""
    model = yolov8("n", task=task)
    e, tx = ema(), _tx(2)
    ts = init_train_state(model, tx, torch.Generator().manual_seed(0), device="cuda", ema=e)
    step = ReplayTrainStep(model, tx, ema=e, capture="none")
    b = synthetic_batch(task, 4, SIZE, num_classes=model.num_classes, seed=3, device="cuda")
    u8 = _uint8(b)
    ts, _ = step(ts, b)  # warm-up: lazy initialisation may sync
    ts, _ = step(ts, u8)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with assert_max_captures(n=0):
            for _ in range(2):
                ts, m = step(ts, u8)  # uint8 images too: the division by 255 needs no sync
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert bool(m["finite"])
