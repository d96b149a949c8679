"""The training step does not depend on the target bucket M, so the ``"step"`` replay level can
pad a batch to an already-captured larger bucket instead of capturing a new graph mid-epoch
(``ReplayTrainStep(reuse_buckets=True)``).

Independent expectation: the eager step on the unpadded batch (bitwise), on the CPU and the GPU.
"""

import warnings
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from yolo_func import yolov8
from yolo_func.optim import sgd
from yolo_func.structures import Batch, pad_targets
from yolo_func.testing import assert_trees_all_equal
from yolo_func.testing.synthetic import synthetic_batch
from yolo_func.train import init_train_state, train_step
from yolo_func.train.replay import CaptureFallbackWarning, ReplayTrainStep, _batch_key, _without_m


def _setup(task, device="cpu"):
    model = yolov8("n", task=task, num_classes=5)
    tx = sgd(0.01, momentum=0.9)
    ts = init_train_state(model, tx, torch.Generator().manual_seed(0), device=device)
    return model, tx, ts


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(task=st.sampled_from(["detect", "segment", "pose"]), seed=st.integers(0, 2**16), extra=st.sampled_from([1, 8, 24]),
       min_boxes=st.sampled_from([0, 1, 8]))
def test_step_is_bitwise_independent_of_padding_rows(task, seed, extra, min_boxes):
    model, tx, ts = _setup(task)
    batch = synthetic_batch(task, 2, 64, num_classes=5, max_boxes=8, min_boxes=min_boxes, seed=seed)
    padded = Batch(batch.images, pad_targets(batch.targets, 8 + extra))
    a = train_step(ts, batch, model=model, tx=tx)
    b = train_step(ts, padded, model=model, tx=tx)
    assert_trees_all_equal(a, b, strict=True)


def test_without_m_drops_only_the_slot_count():
    key = ((2, 3, 64, 64), torch.uint8, (2, 16, 4), (2, 16, 16), (2, 16, 17, 3))
    assert _without_m(key) == ((2, 3, 64, 64), torch.uint8, (2, 4), (2, 16, 16), (2, 17, 3))
    per_instance = ((2, 3, 64, 64), torch.uint8, (2, 16, 4), (2, 16, 8, 8), None)
    assert _without_m(per_instance) == ((2, 3, 64, 64), torch.uint8, (2, 4), (2, 8, 8), None)


def test_reuse_picks_the_smallest_larger_captured_bucket_of_the_same_shapes():
    # the cache's bookkeeping only (no capture): entries stand in for captured step graphs
    model, tx, _ = _setup("pose")
    step = ReplayTrainStep(model, tx, capture="step", max_captures=8)
    level = step._level

    def batch(M, size=64):
        return synthetic_batch("pose", 2, size, num_classes=5, max_boxes=M, seed=M)

    for M in (16, 64):
        step.cache.get_or_capture(_batch_key(batch(M)), lambda: SimpleNamespace(signature=None), part="step")
    step.cache.get_or_capture(_batch_key(batch(32, size=96)), lambda: SimpleNamespace(signature=None), part="step")  # other images
    assert level._reuse_bucket(batch(8)).targets.boxes.shape[1] == 16
    assert level._reuse_bucket(batch(32)).targets.boxes.shape[1] == 64  # 32 exists only at 96 px
    assert level._reuse_bucket(batch(16)).targets.boxes.shape[1] == 16  # its own bucket: unchanged
    assert level._reuse_bucket(batch(128)).targets.boxes.shape[1] == 128  # none larger: a new capture
    off = ReplayTrainStep(model, tx, capture="step", max_captures=8, reuse_buckets=False)
    off.cache.get_or_capture(_batch_key(batch(16)), lambda: SimpleNamespace(signature=None), part="step")
    assert off._level._reuse_bucket(batch(8)).targets.boxes.shape[1] == 8
    padded = level._reuse_bucket(batch(8))
    assert padded.targets.valid[:, 8:].sum() == 0 and torch.equal(padded.targets.boxes[:, :8], batch(8).targets.boxes)


@pytest.mark.cuda
@pytest.mark.usefixtures("no_cudnn_benchmark")
@pytest.mark.parametrize("task", ["detect", "segment", "pose"])
def test_step_level_reuses_a_larger_bucket_and_equals_eager(task):
    dev = torch.device("cuda")
    model, tx, ts = _setup(task, dev)
    batches = [synthetic_batch(task, 2, 128, num_classes=5, max_boxes=M, seed=i, device=dev)
               for i, M in enumerate((32, 8, 16, 32, 8))]
    eager = ReplayTrainStep(model, tx, capture="none")  # the same layout and autocast as the replay
    ref = ts
    expected = []
    for b in batches:  # eager, each batch at its own bucket
        ref, m = eager(ref, b)
        expected.append((ref, m))
    _, _, ts = _setup(task, dev)
    step = ReplayTrainStep(model, tx, capture="step", max_captures=8, warmup=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CaptureFallbackWarning)
        for i, (b, (want_ts, want_m)) in enumerate(zip(batches, expected)):
            ts, m = step(ts, b)
            try:
                assert_trees_all_equal(ts, want_ts, strict=True)
                assert_trees_all_equal({k: v.clone() for k, v in m.items()}, want_m, strict=True)
            except AssertionError as e:
                raise AssertionError(f"step {i} (M={b.targets.boxes.shape[1]}): {e}") from None
    assert len(step.cache) == 1  # every later batch replayed the M=32 graph
