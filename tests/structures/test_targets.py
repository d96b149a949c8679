"""Padded targets: bucketing, builders, clipping / validity rules, padding, validation."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

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


# -- input errors of the builders: the argument, the image index and the bad value ------------------

def _lists(**kw):
    boxes = kw.pop("boxes", [torch.tensor([[8.0, 8, 40, 24]]), torch.tensor([[0.0, 0, 16, 16], [20, 2, 30, 9]])])
    classes = kw.pop("classes", [torch.tensor([2]), torch.tensor([0, 1])])
    return targets_from_lists(boxes, classes, image_size=(64, 64), **kw)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        (dict(classes=[torch.tensor([0]), torch.tensor([1, 7])], num_classes=3),
         "classes_list[1]: image 1 row 1 has class id 7; expected ids in [0, 3) (num_classes=3); "
         "fix the label or pass the model's num_classes"),
        (dict(classes=[torch.tensor([-1]), torch.tensor([1, 0])]),
         "classes_list[0]: image 0 row 0 has class id -1; expected ids >= 0; fix the label"),
        (dict(classes=[torch.tensor([0.0]), torch.tensor([1.0, 2.5])]),
         "classes_list[1]: image 1 row 1 has class id 2.5; expected whole numbers (class indices)"),
        (dict(boxes=[torch.zeros(1, 4), torch.zeros(2, 5)]),
         "boxes_list[1]: image 1: expected float[n, 4] (x1, y1, x2, y2 pixels, one row per box), got shape (2, 5)"),
        (dict(boxes=[torch.tensor([[8.0, 8, 40, 24]]), torch.tensor([[0.0, 0, 16, 16], [50, 10, 40, 20]])]),
         "boxes_list[1]: image 1 row 1 is reversed, (x1, y1, x2, y2) = (50, 10, 40, 20); expected x1 <= x2 and y1 <= y2"),
        (dict(boxes=[torch.tensor([[8.0, 30, 40, 24]]), torch.zeros(2, 4)]),
         "boxes_list[0]: image 0 row 0 is reversed, (x1, y1, x2, y2) = (8, 30, 40, 24)"),
        (dict(classes=[torch.tensor([2, 2, 2]), torch.tensor([0, 1])]),
         "classes_list[0]: image 0: expected int[1] (one id per box of boxes_list[0]), got shape (3,)"),
        (dict(keypoints_list=[torch.zeros(1, 17, 3), torch.zeros(2, 17, 4)]),
         "keypoints_list[1]: image 1: expected float[2, 17, 3] (one row per box, the same (P, D) in every image), "
         "got shape (2, 17, 4)"),
        (dict(masks_list=[torch.zeros(1, 16, 16), torch.zeros(1, 16, 16)]),
         "masks_list[1]: image 1: expected float[2, 16, 16] (one mask per box, the same size in every image), "
         "got shape (1, 16, 16)"),
        # two bad images: the first one's error, in the per-image order (value checks run batched)
        (dict(boxes=[torch.tensor([[8.0, 30, 40, 24]]), torch.zeros(2, 5)]),
         "boxes_list[0]: image 0 row 0 is reversed, (x1, y1, x2, y2) = (8, 30, 40, 24)"),
        (dict(classes=[torch.tensor([5]), torch.tensor([1, 0])], boxes=[torch.zeros(1, 4), torch.full((2, 4), float("inf"))],
              num_classes=3),
         "classes_list[0]: image 0 row 0 has class id 5; expected ids in [0, 3)"),
        (dict(masks_list=[torch.zeros(1, 16, 16)]), "masks_list: expected 2 tensors (one per image, like boxes_list), got 1"),
        (dict(num_classes=0), "num_classes: expected an int >= 1 (K, the model's class count) or None, got 0"),
        (dict(num_classes=3.0), "num_classes: expected an int >= 1 (K, the model's class count) or None, got 3.0"),
    ],
)
def test_lists_builder_input_errors(kw, message):
    with pytest.raises(ValueError) as e:
        _lists(**kw)
    assert str(e.value).startswith("[yolo_func] " + message), str(e.value)


def test_lists_builder_nan_names_the_image():
    with pytest.raises(ValueError, match=r"^\[yolo_func\] boxes_list\[1\] contains 1 non-finite"):
        _lists(boxes=[torch.zeros(1, 4), torch.tensor([[0.0, 0, 16, 16], [20, 2, float("nan"), 9]])])


def test_lists_builder_batched_checks_build_what_the_per_image_checks_build():
    from yolo_func.structures.targets import _lists_checked, _lists_fast

    g = torch.Generator().manual_seed(0)
    for trial in range(20):
        n = [int(v) for v in torch.randint(0, 4, (3,), generator=g)]
        boxes = [torch.rand(k, 4, generator=g) * 40 for k in n]
        boxes = [torch.cat([b[:, :2], b[:, :2] + b[:, 2:]], 1) for b in boxes]
        classes = [torch.randint(0, 3, (k,), generator=g).to(torch.float32 if trial % 2 else torch.int64) for k in n]
        kpts = [torch.rand(k, 2, 3, generator=g) for k in n]
        masks = [torch.rand(k, 4, 4, generator=g) for k in n]
        args = (boxes, classes, masks, kpts, 3)
        want, got = _lists_checked(*args), _lists_fast(*args)
        for a, b in zip(want, got):
            assert len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b))
        # any bad value: the fast path declines (and the per-image checks then name it)
        bad = [c.clone() for c in classes]
        if sum(n):
            i = next(k for k in range(3) if n[k])
            bad[i][0] = 3
            assert _lists_fast(boxes, bad, None, None, 3) is None
            assert _lists_fast(boxes, bad, None, None, None) is not None


def _flat(**kw):
    args = dict(batch_idx=torch.tensor([0.0, 0, 1]), cls=torch.tensor([[0.0], [2], [1]]),
                bboxes_xywh_norm=torch.tensor([[0.5, 0.5, 0.5, 0.25], [0.25, 0.25, 0.1, 0.2], [0.5, 0.5, 0.2, 0.2]]))
    args.update({k: kw.pop(k) for k in list(kw) if k in args})
    return targets_from_flat(args["batch_idx"], args["cls"], args["bboxes_xywh_norm"], batch_size=2,
                             image_size=(64, 64), **kw)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        (dict(cls=torch.tensor([0.0, 2, 7]), num_classes=3),
         "cls: row 2 (image 1) has class id 7; expected ids in [0, 3) (num_classes=3)"),
        (dict(cls=torch.tensor([0, -2, 1])), "cls: row 1 (image 0) has class id -2; expected ids >= 0"),
        (dict(cls=torch.tensor([0.0, 0.5, 1])), "cls: row 1 (image 0) has class id 0.5; expected whole numbers"),
        (dict(cls=torch.zeros(3, 2)), "cls: expected [N=3] or [N=3, 1] class ids (one per row of bboxes_xywh_norm), "
                                      "got shape (3, 2)"),
        (dict(bboxes_xywh_norm=torch.full((3, 5), 0.5)),
         "bboxes_xywh_norm: expected float[N, 4] (normalised cx, cy, w, h), got shape (3, 5)"),
        (dict(bboxes_xywh_norm=torch.tensor([[0.5, 0.5, 0.5, 0.25], [0.5, 0.5, -0.1, 0.2], [0.5, 0.5, 0.2, 0.2]])),
         "bboxes_xywh_norm: row 1 (image 0) is reversed, (cx, cy, w, h) = (0.5, 0.5, -0.1, 0.2) has a negative "
         "width or height; expected w >= 0 and h >= 0"),
        (dict(batch_idx=torch.tensor([0.0, 0.5, 1])), "batch_idx: row 1 has image index 0.5; expected whole numbers in [0, 2)"),
        (dict(batch_idx=torch.tensor([0, 5, 1])), "batch_idx: row 1 has image index 5; expected values in [0, 2) (batch_size=2)"),
        (dict(batch_idx=torch.tensor([0, -1, 1])), "batch_idx: row 1 has image index -1; expected values in [0, 2)"),
        (dict(batch_idx=torch.zeros(2)), "batch_idx: expected [N=3] image indices (one per row of bboxes_xywh_norm), got shape (2,)"),
    ],
)
def test_flat_builder_input_errors(kw, message):
    with pytest.raises(ValueError) as e:
        _flat(**kw)
    assert str(e.value).startswith("[yolo_func] " + message), str(e.value)


def test_valid_class_ids_at_the_edges_pass():
    t = _flat(cls=torch.tensor([0.0, 2, 2]), num_classes=3)
    assert t.classes[0, :2].tolist() == [0, 2] and t.classes[1, 0] == 2
    t = _lists(classes=[torch.tensor([[2.0]]), torch.tensor([0, 2])], num_classes=3)  # [n, 1] floats are fine
    assert t.classes[0, 0] == 2 and t.classes.dtype == torch.int64


def test_zero_width_is_dropped_not_reversed():
    t, r = _lists(boxes=[torch.tensor([[8.0, 8, 8, 24]]), torch.zeros(2, 4)], return_report=True)
    assert t.valid.sum() == 0 and r.given.tolist() == [1, 2] and r.dropped.tolist() == [1, 2]


# -- dropped boxes are counted -------------------------------------------------------------------

def _kept_by_hand(box: list[float], h: int, w: int) -> bool:
    """Independent rule: the box overlaps the open image rectangle in both axes."""
    x1, y1, x2, y2 = box
    return min(x2, w) - max(x1, 0) > 0 and min(y2, h) - max(y1, 0) > 0


@given(st.lists(st.lists(st.tuples(st.integers(-40, 100), st.integers(-40, 100), st.integers(0, 50), st.integers(0, 50)),
                         max_size=5), min_size=1, max_size=3))
def test_report_counts_boxes_dropped_after_clipping(images):
    H, W = 48, 64
    boxes = [torch.tensor([[x, y, x + bw, y + bh] for x, y, bw, bh in rows], dtype=torch.float32).reshape(-1, 4)
             for rows in images]
    classes = [torch.zeros(len(rows), dtype=torch.int64) for rows in images]
    t, report = targets_from_lists(boxes, classes, image_size=(H, W), num_classes=1, return_report=True)
    kept = [[_kept_by_hand(b.tolist(), H, W) for b in bx] for bx in boxes]
    assert report.given.tolist() == [len(rows) for rows in images]
    assert report.dropped.tolist() == [k.count(False) for k in kept]
    assert (report.given - report.dropped).tolist() == t.valid.sum(1).tolist()
    for i, k in enumerate(kept):  # dropped slots keep their position, valid=False, zero rows
        assert t.valid[i, : len(k)].tolist() == k
        assert t.boxes[i, : len(k)][~t.valid[i, : len(k)]].abs().sum() == 0


def test_flat_report_and_default_return():
    xywh = torch.tensor([[0.5, 0.5, 0.5, 0.25], [1.5, 0.5, 0.2, 0.2], [0.5, 0.5, 0.2, 0.2]])  # row 1 wholly outside
    t, r = _flat(bboxes_xywh_norm=xywh, return_report=True)
    assert r.given.tolist() == [2, 1] and r.dropped.tolist() == [1, 0]
    assert t.valid[0, :2].tolist() == [True, False]
    assert isinstance(_flat(bboxes_xywh_norm=xywh), Targets)  # without return_report: just the record


# -- validate_targets and pad_targets -----------------------------------------------------------

def test_validate_targets_checks_class_ids_of_valid_slots_only():
    t = _lists()
    validate_targets(t, (64, 64), num_classes=3)
    bad = t._replace(classes=t.classes.clone().index_put_((torch.tensor([1]), torch.tensor([1])), torch.tensor(5)))
    with pytest.raises(ValueError, match=r"^\[yolo_func\] targets.classes: image 1 slot 1 has class id 5; "
                                         r"expected ids in \[0, 3\) \(num_classes=3\)"):
        validate_targets(bad, num_classes=3)
    padding = t._replace(classes=t.classes.clone().index_put_((torch.tensor([1]), torch.tensor([5])), torch.tensor(-4)))
    validate_targets(padding, num_classes=3)  # slot 5 of image 1 is padding: not a target


def test_pad_targets_checks_its_inputs():
    t = _lists()
    with pytest.raises(TypeError, match=r"^\[yolo_func\] pad_targets: M must be an int \(the new slot count\), got float 16.0"):
        pad_targets(t, 16.0)
    with pytest.raises(ValueError, match=r"^\[yolo_func\] t.classes: expected torch.int64\[2, 8\], got torch.int32\[2, 8\]"):
        pad_targets(t._replace(classes=t.classes.int()), 16)
    with pytest.raises(ValueError, match=r"pass M >= 8"):
        pad_targets(t, 4)
