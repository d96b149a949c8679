"""Replay levels on the CPU: a clear fallback to the eager step, with exactly one warning."""

import warnings

import pytest
import torch

from yolo_func import tree as T
from yolo_func import yolov8
from yolo_func.optim import multi_steps, sgd
from yolo_func.testing.synthetic import synthetic_batch
from yolo_func.train import init_train_state, train_step
from yolo_func.train.replay import CaptureFallbackWarning, ReplayTrainStep


@pytest.mark.parametrize("capture", ["network", "network+heads", "step"])
def test_cpu_falls_back_to_eager_once_and_matches_it(capture):
    model = yolov8("n", task="detect", num_classes=3)
    tx = multi_steps(sgd(0.01, 0.9), every=1)
    ts0 = init_train_state(model, tx, torch.Generator().manual_seed(0))
    step = ReplayTrainStep(model, tx, capture=capture)
    b = synthetic_batch("detect", 2, 64, num_classes=3, seed=1)
    with pytest.warns(CaptureFallbackWarning, match="not a CUDA device"):
        ts1, _ = step(ts0, b)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CaptureFallbackWarning)
        ts2, _ = step(ts1, b)
    ref1, _ = train_step(ts0, b, model=model, tx=tx)
    ref2, _ = train_step(ref1, b, model=model, tx=tx)
    assert all(torch.equal(a, c) for a, c in zip(T.tree_leaves(ts2), T.tree_leaves(ref2)))


def test_unknown_level_is_rejected():
    with pytest.raises(ValueError, match=r"capture must be one of \['none', 'network', 'network\+heads', 'step'\]"):
        ReplayTrainStep(yolov8("n"), multi_steps(sgd(0.1), every=1), capture="heads")
