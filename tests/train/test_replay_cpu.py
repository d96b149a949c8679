"""Replay levels on the CPU: a clear fallback to the eager step (exactly one warning, no capture),
checked against an independent autograd step; uint8 images; the host-side donation helpers."""

import warnings

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from yolo_func import tree as T
from yolo_func import yolov8
from yolo_func.assign import assign_from_detect, make_anchors
from yolo_func.capture.whole_step import _static_tree
from yolo_func.optim import multi_steps, sgd
from yolo_func.structures import Batch
from yolo_func.testing import assert_max_captures, assert_trees_all_close, assert_trees_all_equal
from yolo_func.testing.synthetic import synthetic_batch
from yolo_func.train import init_train_state, train_step
from yolo_func.train.replay import CaptureFallbackWarning, ReplayTrainStep, _holds

LR, MOMENTUM, SIZE = 0.01, 0.9, 32


def _autograd_sgd_steps(model, params, state, batches):
    """An independent step: one forward of the whole model on leaf tensors, the summed head losses,
    ``loss.backward()`` and ``torch.optim.SGD`` (none of yolo_func's VJPs, explicit gradient sum,
    guard or optimizer)."""
    params = T.tree_map(lambda x: x.clone().requires_grad_(True), params)
    opt = torch.optim.SGD(T.tree_leaves(params), lr=LR, momentum=MOMENTUM)
    s = SIZE
    anchors = make_anchors([(s // 8, s // 8), (s // 16, s // 16), (s // 32, s // 32)], model.strides)
    for b in batches:
        preds, new_state = model.apply(params, state, b.images, train=True)
        assignment = assign_from_detect(preds["detect"], b.targets, anchors)
        loss = sum(head.loss(preds[n], b.targets, assignment)[0] for n, head in model.heads.items())
        opt.zero_grad()
        loss.backward()
        opt.step()
        state = T.tree_map(lambda x: x.detach(), new_state)
    return T.tree_map(lambda x: x.detach(), params), state


@pytest.fixture(scope="module")
def float64_case():
    """A float64 detect model, two batches and the autograd reference after two steps."""
    model = yolov8("n", task="detect", num_classes=3)
    params, state = model.init(torch.Generator().manual_seed(0))
    params, state = T.tree_cast(params, torch.float64), T.tree_cast(state, torch.float64)
    batches = [synthetic_batch("detect", 2, SIZE, num_classes=3, max_boxes=4, seed=s) for s in (1, 2)]
    batches = [Batch(b.images.double(), b.targets) for b in batches]
    return model, params, state, batches, _autograd_sgd_steps(model, params, state, batches)


@pytest.mark.slow
@pytest.mark.parametrize("capture", ["network", "network+heads", "step"])
def test_cpu_falls_back_once_and_steps_like_an_autograd_sgd_step(capture, float64_case):
    """On the CPU every level warns once and runs the eager step; two such steps equal two plain
    autograd + ``torch.optim.SGD`` steps in float64 (to ~1e-8: see tests/train/test_step.py on why
    the summation order leaves last-bit differences), and the params did move."""
    model, params, state, batches, (ref_params, ref_state) = float64_case
    tx = multi_steps(sgd(LR, MOMENTUM), every=1)
    ts = init_train_state(model, tx, torch.Generator(), params=T.tree_clone(params), state=T.tree_clone(state))
    step = ReplayTrainStep(model, tx, capture=capture)
    with assert_max_captures(n=0):
        with pytest.warns(CaptureFallbackWarning, match="not a CUDA device"):
            ts, _ = step(ts, batches[0])
        with warnings.catch_warnings():
            warnings.simplefilter("error", CaptureFallbackWarning)  # once per reason
            ts, m = step(ts, batches[1])
    assert int(ts.step) == 2 and int(ts.skipped) == 0 and bool(m["finite"])
    with pytest.raises(AssertionError, match="not close"):  # the comparison is not between untrained models
        assert_trees_all_close(ts.params, params, rtol=1e-3, atol=1e-4)
    assert_trees_all_close(ts.params, ref_params, rtol=1e-6, atol=1e-7, strict=True)
    assert_trees_all_close(ts.state, ref_state, rtol=1e-6, atol=1e-7, strict=True)


@pytest.mark.parametrize("capture", ["none", "network"])
def test_uint8_images_step_exactly_like_float_images_divided_by_255(capture):
    """A uint8 batch (0..255) gives bitwise the step of the float batch ``images.float() / 255``
    (float32): the step divides by 255 itself, on the device (here the CPU fallback)."""
    model = yolov8("n", task="segment", num_classes=3)
    tx = multi_steps(sgd(LR, MOMENTUM), every=1)
    b = synthetic_batch("segment", 2, SIZE, num_classes=3, max_boxes=4, seed=3)
    u8 = Batch((b.images * 255).round().to(torch.uint8), b.targets)
    f32 = Batch(u8.images.float() / 255, b.targets)
    assert u8.images.dtype == torch.uint8 and int(u8.images.max()) > 200  # really 0..255 pixels
    out = {}
    for name, batch in (("uint8", u8), ("float", f32)):
        ts = init_train_state(model, tx, torch.Generator().manual_seed(0))
        step = ReplayTrainStep(model, tx, capture=capture)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", CaptureFallbackWarning)  # the CPU fallback is the point here
            out[name] = step(ts, batch)
    assert_trees_all_equal(out["uint8"], out["float"], strict=True)


def test_non_uint8_integer_images_are_rejected_with_the_fix():
    model = yolov8("n", task="detect", num_classes=3)
    tx = multi_steps(sgd(LR), every=1)
    ts = init_train_state(model, tx, torch.Generator().manual_seed(0))
    b = synthetic_batch("detect", 2, SIZE, num_classes=3, seed=1)
    bad = Batch((b.images * 255).to(torch.int32), b.targets)
    # the step's boundary check (structures.check_batch) names the field, the dtypes it takes and
    # the one it got, before anything runs
    with pytest.raises(ValueError, match=r"^\[yolo_func\] batch\.images: expected dtype uint8 \(0\.\.255\) or a floating dtype \(0\.\.1\), got torch\.int32"):
        train_step(ts, bad, model=model, tx=tx)


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
    for k, i in zip(tree, picks, strict=True):
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


def test_replay_step_rejects_a_bad_batch_at_the_door():
    """``ReplayTrainStep`` runs the metadata boundary check before any level (and any capture):
    an image size that is not a multiple of 32 is a ValueError naming ``batch.images``."""
    from yolo_func.structures import targets_from_lists

    model = yolov8("n", task="detect", num_classes=2)
    ts = init_train_state(model, sgd(0.01), torch.Generator().manual_seed(0))
    t = targets_from_lists([torch.tensor([[2.0, 2, 20, 20]])], [torch.tensor([0])], image_size=(48, 64))
    for capture in ("none", "network", "step"):
        with pytest.raises(ValueError, match=r"batch\.images"):
            ReplayTrainStep(model, sgd(0.01), capture=capture)(ts, Batch(torch.zeros(1, 3, 48, 64), t))
