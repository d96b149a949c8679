"""A batch with a NaN pixel at every replay level and for every optimizer (GPU): the skipped step
leaves params, BN statistics, the inner optimizer state and the EMA bitwise unchanged, counts it,
and every step — the skipped one and the one after it included — equals the eager step bitwise.

A silent eager fallback would compare eager with eager: ``CaptureFallbackWarning`` is an error in
this module, and each replayed run asserts that it captured.
"""

import pytest
import torch

from yolo_func import tree as T
from yolo_func import yolov8
from yolo_func.optim import adamw, ema, multi_steps, sgd
from yolo_func.structures.records import Batch
from yolo_func.testing import assert_trees_all_equal
from yolo_func.testing.synthetic import synthetic_batch
from yolo_func.train import init_train_state, yolo_sgd
from yolo_func.train.metrics import fetch_metrics
from yolo_func.train.replay import ReplayTrainStep

pytestmark = [pytest.mark.cuda, pytest.mark.filterwarnings("error::yolo_func.train.replay.CaptureFallbackWarning"),
              pytest.mark.usefixtures("no_cudnn_benchmark")]

TASK, BATCH, SIZE = "segment", 2, 128
NAN_AT = 2  # steps 0, 1 train; step 2 sees the NaN pixel; step 3 trains again

OPTIMIZERS = {
    "sgd": lambda: sgd(0.01, 0.9),
    "adamw": lambda: adamw(1e-3),
    "yolo_sgd": lambda: yolo_sgd(batch_size=BATCH, batches_per_epoch=4, epochs=3, nbs=4).tx,
    "multi_steps1": lambda: multi_steps(sgd(0.01, 0.9, nesterov=True), every=1),
    "multi_steps4": lambda: multi_steps(sgd(0.01, 0.9, nesterov=True), every=4),
}


def _batches(model):
    out = []
    for i in range(4):
        b = synthetic_batch(TASK, BATCH, SIZE, num_classes=model.num_classes, seed=10 + i, device="cuda")
        if i == NAN_AT:
            images = b.images.clone()
            images[1, 0, 17, 33] = float("nan")
            b = Batch(images, b.targets)
        out.append(b)
    return out


def _run(capture: str, name: str):
    """Every state and metrics dict of the 4 steps (cloned: replay levels donate and reuse buffers)."""
    model = yolov8("n", task=TASK, num_classes=3)
    tx, e = OPTIMIZERS[name](), ema()
    ts = init_train_state(model, tx, torch.Generator().manual_seed(0), device="cuda", ema=e)
    step = ReplayTrainStep(model, tx, ema=e, capture=capture)
    states, metrics = [T.tree_clone(ts)], []
    for b in _batches(model):
        ts, m = step(ts, b)
        states.append(T.tree_clone(ts))
        metrics.append({k: v.clone() for k, v in m.items()})
    return states, metrics, step


@pytest.fixture(scope="module")
def eager_runs():
    return {}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("capture", ["none", "network", "network+heads", "step"])
def test_nan_batch_is_skipped_and_replay_equals_eager(capture, name, eager_runs):
    if name not in eager_runs:
        eager_runs[name] = _run("none", name)
    e_states, e_metrics, _ = eager_runs[name]
    states, metrics, step = _run(capture, name)
    if capture != "none":
        assert step.cache.num_captures >= 1, f"{capture}: nothing was captured"

    before, skipped = states[NAN_AT], states[NAN_AT + 1]  # states[i] is the state before step i
    m = fetch_metrics(metrics[NAN_AT], warn=False)
    assert m["finite"] == 0.0 and m["stepped"] == 0.0
    assert int(skipped.skipped) == int(before.skipped) + 1
    for field in ("params", "state", "ema"):
        assert_trees_all_equal(getattr(skipped, field), getattr(before, field), strict=True)
    assert_trees_all_equal(skipped.opt_state.inner_state, before.opt_state.inner_state, strict=True)
    assert int(skipped.opt_state.notfinite_count) == 1 and int(skipped.opt_state.total_notfinite_count) == 1
    assert fetch_metrics(metrics[NAN_AT + 1], warn=False)["finite"] == 1.0

    for i in range(len(metrics)):
        assert_trees_all_equal(states[i + 1], e_states[i + 1], strict=True)
        assert_trees_all_equal(_nan_marked(metrics[i]), _nan_marked(e_metrics[i]), strict=True)


def _nan_marked(metrics: dict) -> dict:
    """NaN never equals NaN: compare where the NaNs are, and the values with NaN set to 0."""
    return {k: (torch.isnan(v), torch.nan_to_num(v, nan=0.0)) if v.is_floating_point() else v
            for k, v in metrics.items()}
