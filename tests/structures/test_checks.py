"""The step's boundary check: metadata only (shapes, dtypes, devices), one named error per field."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from yolo_func.structures import Batch, Targets, check_batch, check_targets
from yolo_func.testing import images, padded_targets
from yolo_func.testing.synthetic import synthetic_batch


@pytest.mark.parametrize("task", ["detect", "segment", "pose"])
@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32, torch.float64])
def test_synthetic_batches_pass(task, dtype):
    b = synthetic_batch(task, batch_size=2, image_size=64, max_boxes=4)
    images_ = (b.images * 255).to(dtype) if dtype == torch.uint8 else b.images.to(dtype)
    check_batch(Batch(images_, b.targets), kpt_shape=(17, 3) if task == "pose" else None)


@given(st.integers(1, 3).flatmap(lambda n: st.tuples(
    images(batch=n, dtype=torch.float32), padded_targets(batch=n, max_boxes=st.integers(0, 6), keypoints=17))))
def test_any_consistent_batch_passes(pair):
    imgs, targets = pair
    check_batch(Batch(imgs, targets))
    check_batch(Batch((imgs * 255).to(torch.uint8), targets), kpt_shape=(17, 3))


def test_reads_no_values():
    """Every tensor on the meta device (no storage: reading a value raises), and it passes."""
    b = synthetic_batch("segment", batch_size=2, image_size=64, max_boxes=4)
    meta = Batch(b.images.to("meta"), Targets(*(None if x is None else x.to("meta") for x in b.targets)))
    with pytest.raises((NotImplementedError, RuntimeError)):
        bool(meta.targets.valid.any())  # what a value read would do
    check_batch(meta)


def _batch(**changes):
    b = synthetic_batch("pose", batch_size=2, image_size=64, max_boxes=4)
    images_ = changes.pop("images", b.images)
    return Batch(images_, b.targets._replace(**changes))


@pytest.mark.parametrize(
    ("batch", "kw", "message"),
    [
        (lambda: _batch(images=torch.zeros(2, 3, 64, 64, dtype=torch.int32)), {},
         "batch.images: expected dtype uint8 (0..255) or a floating dtype (0..1), got torch.int32[2, 3, 64, 64]"),
        (lambda: _batch(images=torch.zeros(2, 1, 64, 64)), {},
         "batch.images: expected [B, 3, H, W], got torch.float32[2, 1, 64, 64]; images are NCHW"),
        (lambda: _batch(images=torch.zeros(3, 64, 64)), {},
         "batch.images: expected [B, 3, H, W], got torch.float32[3, 64, 64]"),
        (lambda: _batch(images=torch.zeros(2, 3, 64, 80)), {},
         "batch.images: expected H and W positive multiples of 32, got torch.float32[2, 3, 64, 80]; "
         "letterbox or resize to e.g. 64x96"),
        (lambda: _batch(images=torch.zeros(0, 3, 64, 64)), {},
         "batch.images: expected at least one image (B >= 1), got torch.float32[0, 3, 64, 64]"),
        (lambda: _batch(images=torch.zeros(3, 3, 64, 64)), {},
         "batch.targets.boxes: expected B = 3 rows (one per image), float[3, M, 4], got torch.float32[2, 4, 4]"),
        (lambda: _batch(boxes=torch.zeros(2, 4, 5)), {},
         "batch.targets.boxes: expected float[B, M, 4] (xyxy pixels), got torch.float32[2, 4, 5]"),
        (lambda: _batch(boxes=torch.zeros(2, 4, 4, dtype=torch.int64)), {},
         "batch.targets.boxes: expected float[B, M, 4] (xyxy pixels), got torch.int64[2, 4, 4]"),
        (lambda: _batch(classes=torch.zeros(2, 4, dtype=torch.int32)), {},
         "batch.targets.classes: expected torch.int64[2, 4], got torch.int32[2, 4]"),
        (lambda: _batch(classes=torch.zeros(2, 5, dtype=torch.int64)), {},
         "batch.targets.classes: expected torch.int64[2, 4], got torch.int64[2, 5]"),
        (lambda: _batch(valid=torch.ones(2, 4, dtype=torch.uint8)), {},
         "batch.targets.valid: expected torch.bool[2, 4], got torch.uint8[2, 4]"),
        (lambda: _batch(masks=torch.zeros(2, 16, 16)), {},
         "batch.targets.masks: expected an overlap map int64[2, Hm, Wm] or per-instance float[2, 4, Hm, Wm], "
         "got torch.float32[2, 16, 16]"),
        (lambda: _batch(keypoints=torch.zeros(2, 4, 17, 4)), {},
         "batch.targets.keypoints: expected float[2, 4, P, 2|3], got torch.float32[2, 4, 17, 4]"),
        (lambda: _batch(), {"kpt_shape": (5, 3)},
         "batch.targets.keypoints: expected float[2, 4, 5, 3], got torch.float32[2, 4, 17, 3]; "
         "the model's kpt_shape and the data's keypoints must agree"),
        (lambda: _batch(valid=torch.ones(2, 4, dtype=torch.bool, device="meta")), {},
         "batch.targets.valid: expected a tensor on cpu (the images' device), got torch.bool[2, 4] on meta; move the images and every target tensor to one device"),
    ],
)
def test_each_bad_field_is_named_with_expected_and_actual(batch, kw, message):
    with pytest.raises(ValueError) as e:
        check_batch(batch(), **kw)
    assert str(e.value).startswith("[yolo_func] " + message), str(e.value)


def test_wrong_types_raise_type_errors():
    b = _batch()
    with pytest.raises(TypeError, match=r"^\[yolo_func\] batch: expected a yolo_func.structures.Batch\(images, targets\), got tuple"):
        check_batch((b.images, b.targets))
    with pytest.raises(TypeError, match=r"^\[yolo_func\] batch.images: expected a torch.Tensor .*, got list"):
        check_batch(Batch([[0.0]], b.targets))
    with pytest.raises(TypeError, match=r"^\[yolo_func\] batch.targets: expected a yolo_func.structures.Targets record, got dict"):
        check_batch(Batch(b.images, b.targets._asdict()))
    with pytest.raises(TypeError, match=r"^\[yolo_func\] targets.classes: expected a torch.Tensor int64\[2, 4\], got list"):
        check_targets(b.targets._replace(classes=[0, 1]))


def test_train_step_rejects_a_bad_batch_at_the_door(gen):
    """A batch whose targets belong to another batch size fails with the field's name, before any
    compute (today it would fail inside the assigner)."""
    from yolo_func import optim, yolov8
    from yolo_func.train.step import init_train_state, train_step

    model = yolov8("n", task="detect", num_classes=3)
    tx = optim.sgd(0.01, 0.9)
    ts = init_train_state(model, tx, gen)
    b = synthetic_batch("detect", batch_size=2, image_size=64, max_boxes=4, num_classes=3)
    bad = Batch(torch.cat((b.images, b.images)), b.targets)
    with pytest.raises(ValueError, match=r"^\[yolo_func\] batch.targets.boxes: expected B = 4 rows"):
        train_step(ts, bad, model=model, tx=tx)


@pytest.mark.cuda
def test_check_batch_inside_a_cuda_graph_capture():
    """No host sync: a sync or a value read inside capture raises (cudaErrorStreamCaptureUnsupported)."""
    b = synthetic_batch("segment", batch_size=2, image_size=64, max_boxes=4, device="cuda")
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        out = b.images * 2  # warm up the op outside the capture
        with torch.cuda.graph(g):
            check_batch(b)
            out = b.images * 2
    torch.cuda.current_stream().wait_stream(s)
    g.replay()
    torch.testing.assert_close(out, b.images * 2)
