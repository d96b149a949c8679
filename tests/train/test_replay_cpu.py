"""Replay levels on the CPU: a clear fallback to the eager step, with exactly one warning; the
host-side donation helpers."""

import warnings

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from yolo_func import tree as T
from yolo_func import yolov8
from yolo_func.capture.whole_step import _static_tree
from yolo_func.optim import multi_steps, sgd
from yolo_func.testing.synthetic import synthetic_batch
from yolo_func.train import init_train_state, train_step
from yolo_func.train.replay import CaptureFallbackWarning, ReplayTrainStep, _holds


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


# -- donation helpers (pure host logic, no GPU needed) -------------------------------------------


@given(st.lists(st.integers(0, 4), min_size=1, max_size=8), st.sets(st.integers(0, 4)))
def test_static_tree_keeps_each_donated_tensor_once_and_clones_the_rest(picks, donated):
    """A carry built from a pool of tensors, some repeated: donated tensors are kept (the first
    time they appear), everything else — and a donated tensor's repeats — is cloned, so no two
    static leaves share memory and values are unchanged."""
    pool = [torch.full((2,), float(i)) for i in range(5)]
    tree = {f"k{j}": pool[i] for j, i in enumerate(picks)}
    keep, used = {id(pool[i]) for i in donated}, set()
    out = _static_tree(tree, keep, used)
    seen = set()
    for k, i in zip(tree, picks):
        leaf = out[k]
        assert torch.equal(leaf, pool[i])
        kept = leaf is pool[i]
        assert kept == (i in donated and i not in seen)
        if kept:
            seen.add(i)
    ptrs = [x.data_ptr() for x in out.values()]
    assert len(set(ptrs)) == len(ptrs)
    assert used == {id(pool[i]) for i in seen}


def test_holds_compares_leaves_not_containers():
    a, b = torch.zeros(1), torch.ones(1)
    static = {"x": a, "y": {"z": b}}
    assert _holds(static, static)
    assert _holds({"x": a, "y": {"z": b}}, static)  # other dicts, the same tensors
    assert not _holds({"x": a.clone(), "y": {"z": b}}, static)  # equal values, another tensor
    assert not _holds({"x": a}, static)
