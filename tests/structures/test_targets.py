"""Padded targets: bucketing, builders, clipping / validity rules, padding, validation."""

from __future__ import annotations

import pytest
import torch

from yolo_func._types import DetectPreds, Targets
from yolo_func.structures import (
    box_area, bucket_size, check_finite, clip_boxes, pad_targets, targets_from_flat, targets_from_lists,
    validate_preds, validate_targets, xywh_to_xyxy, xyxy_to_xywh,
)


def test_bucket_size():
    assert [bucket_size(n) for n in (0, 1, 8, 9, 16, 17, 100)] == [8, 8, 8, 16, 16, 32, 128]
    assert bucket_size(3, minimum=1) == 4 and bucket_size(0, minimum=1) == 1


def test_box_helpers():
    b = torch.tensor([[10.0, 20, 50, 80]])
    torch.testing.assert_close(xyxy_to_xywh(b), torch.tensor([[30.0, 50, 40, 60]]))
    torch.testing.assert_close(xywh_to_xyxy(xyxy_to_xywh(b)), b)
    torch.testing.assert_close(clip_boxes(torch.tensor([[-5.0, 3, 70, 90]]), (64, 64)), torch.tensor([[0.0, 3, 64, 64]]))
    torch.testing.assert_close(box_area(torch.tensor([[0.0, 0, 2, 3], [5, 5, 4, 9]])), torch.tensor([6.0, 0]))


def test_flat_builder_slots_and_order():
    # Rows of image 1 come before image 0's second row: slots follow input order within an image.
    bi = torch.tensor([0.0, 1, 0])
    cls = torch.tensor([[3.0], [4], [5]])
    xywh = torch.tensor([[0.5, 0.5, 0.5, 0.25], [0.25, 0.25, 0.25, 0.25], [0.75, 0.75, 0.25, 0.25]])
    t = targets_from_flat(bi, cls, xywh, batch_size=3, image_size=(64, 128))
    assert t.boxes.shape == (3, 8, 4)
    torch.testing.assert_close(t.boxes[0, 0], torch.tensor([32.0, 24, 96, 40]))
    torch.testing.assert_close(t.boxes[0, 1], torch.tensor([80.0, 40, 112, 56]))
    assert t.classes[0, :2].tolist() == [3, 5] and t.classes[1, 0] == 4
    assert t.valid.sum(1).tolist() == [2, 1, 0]


def test_clip_and_zero_area_rules():
    bi = torch.tensor([0.0, 0, 0])
    # outside on the left (clipped), zero width (ignored), wholly outside (ignored)
    xywh = torch.tensor([[0.0, 0.5, 0.5, 0.5], [0.5, 0.5, 0.0, 0.2], [1.5, 0.5, 0.2, 0.2]])
    kp = torch.rand(3, 17, 3)
    t = targets_from_flat(bi, torch.tensor([1.0, 2, 3]), xywh, batch_size=1, image_size=(100, 100), keypoints=kp)
    torch.testing.assert_close(t.boxes[0, 0], torch.tensor([0.0, 25, 25, 75]))
    assert t.valid[0, :3].tolist() == [True, False, False]
    assert t.boxes[0, 1:].abs().sum() == 0 and t.classes[0, 1:].abs().sum() == 0
    assert t.keypoints[0, 1:].abs().sum() == 0
    torch.testing.assert_close(t.keypoints[0, 0, :, :2], kp[0, :, :2] * 100)
    validate_targets(t, (100, 100))


def test_masks_and_max_boxes():
    bi, cls = torch.tensor([0.0, 1]), torch.tensor([0.0, 1])
    xywh = torch.tensor([[0.5, 0.5, 0.5, 0.5], [0.5, 0.5, 0.2, 0.2]])
    overlap = torch.zeros(2, 16, 16)
    overlap[0, 4:12, 4:12] = 1
    t = targets_from_flat(bi, cls, xywh, batch_size=2, image_size=(64, 64), masks=overlap, max_boxes=4)
    assert t.masks.dtype == torch.int64 and t.masks.shape == (2, 16, 16) and t.boxes.shape[1] == 4
    per = torch.rand(2, 16, 16)
    t2 = targets_from_flat(bi, cls, xywh, batch_size=2, image_size=(64, 64), masks=per, overlap_masks=False)
    torch.testing.assert_close(t2.masks[1, 0], per[1])
    with pytest.raises(ValueError, match="max_boxes"):
        targets_from_flat(torch.zeros(3), torch.zeros(3), torch.full((3, 4), 0.5), batch_size=1, image_size=(8, 8), max_boxes=2)


def test_lists_builder_matches_flat():
    boxes = [torch.tensor([[8.0, 8, 40, 24]]), torch.zeros(0, 4), torch.tensor([[0.0, 0, 16, 16], [60, 2, 70, 9]])]
    classes = [torch.tensor([2]), torch.zeros(0), torch.tensor([0, 1])]
    t = targets_from_lists(boxes, classes, image_size=(64, 64))
    assert t.boxes.shape == (3, 8, 4)
    torch.testing.assert_close(t.boxes[0, 0], boxes[0][0])
    torch.testing.assert_close(t.boxes[2, 1], torch.tensor([60.0, 2, 64, 9]))  # clipped at W = 64
    assert t.valid.sum(1).tolist() == [1, 0, 2] and t.classes[2, :2].tolist() == [0, 1]


def test_pad_targets():
    t = targets_from_flat(torch.tensor([0.0]), torch.tensor([1.0]), torch.tensor([[0.5, 0.5, 0.5, 0.5]]), batch_size=2,
                          image_size=(32, 32), keypoints=torch.rand(1, 5, 3))
    p = pad_targets(t, 16)
    assert p.boxes.shape == (2, 16, 4) and p.keypoints.shape == (2, 16, 5, 3) and p.valid.sum() == 1
    torch.testing.assert_close(p.boxes[:, :8], t.boxes)
    with pytest.raises(ValueError, match="smaller"):
        pad_targets(t, 4)


@pytest.mark.parametrize("field", ["bboxes", "keypoints"])
def test_nan_in_builder_inputs_names_tensor(field):
    xywh, kp = torch.full((1, 4), 0.5), torch.rand(1, 17, 3)
    (xywh if field == "bboxes" else kp)[0, 0] = float("nan")
    with pytest.raises(ValueError, match=field):
        targets_from_flat(torch.zeros(1), torch.zeros(1), xywh, batch_size=1, image_size=(8, 8), keypoints=kp)


def test_validation_helpers_name_the_tensor():
    t = targets_from_flat(torch.zeros(1), torch.zeros(1), torch.full((1, 4), 0.5), batch_size=1, image_size=(8, 8))
    bad = Targets(t.boxes.clone().index_put_((torch.tensor([0]), torch.tensor([0])), torch.tensor([float("inf")] * 4)), t.classes, t.valid)
    with pytest.raises(ValueError, match=r"\[yolo_func\] targets.boxes contains"):
        validate_targets(bad)
    with pytest.raises(ValueError, match="targets.classes"):
        validate_targets(Targets(t.boxes, t.classes.int(), t.valid))
    preds = DetectPreds(torch.zeros(1, 4, 64), torch.tensor([[[0.0], [float("nan")], [0], [0]]]))
    with pytest.raises(ValueError, match=r"preds.cls_logits contains 1 non-finite"):
        validate_preds(preds)
    check_finite(ok=torch.ones(3), skipped=None)
