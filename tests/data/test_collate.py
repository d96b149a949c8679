"""Collation into the static-shape Batch: shapes, dtypes, slot order and padding."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from loader_fixtures import ellipse_sample
from yolo_func.data import augment as A
from yolo_func.data.collate import collate, format_record
from yolo_func.structures.targets import bucket_size, validate_targets
from yolo_func.testing import Dimensions, assert_shape


def _formatted(seed: int, n: int, task: str, size: int = 64):
    rng = np.random.default_rng(seed)
    rec = A.annotated_from_sample(ellipse_sample(rng, size, size, n, keypoints=5 if task == "pose" else 0))
    if task != "segment":
        rec = rec._replace(masks=None)
    return rec, format_record(rec)


@given(counts=st.lists(st.integers(0, 12), min_size=1, max_size=4), task=st.sampled_from(["detect", "segment", "pose"]))
def test_collate_shapes_dtypes_and_padding(counts, task):
    pairs = [_formatted(i, n, task) for i, n in enumerate(counts)]
    batch = collate([f for _, f in pairs])
    dims = Dimensions(B=len(counts), M=bucket_size(max(counts)), H=64, Q=16, P=5)
    assert_shape(batch.images, dims["B3HH"])
    assert batch.images.dtype == torch.uint8
    t = batch.targets
    assert_shape([t.boxes, t.classes, t.valid], [dims["BM4"], dims["BM"], dims["BM"]])
    assert (t.boxes.dtype, t.classes.dtype, t.valid.dtype) == (torch.float32, torch.int64, torch.bool)
    validate_targets(t, (64, 64))
    for i, ((rec, f), n) in enumerate(zip(pairs, counts)):
        np.testing.assert_array_equal(batch.images[i].numpy(), rec.image.transpose(2, 0, 1))
        assert t.valid[i].tolist() == [True] * n + [False] * (dims.M - n)
        np.testing.assert_array_equal(t.boxes[i, :n].numpy(), f.boxes)
        np.testing.assert_array_equal(t.classes[i, :n].numpy(), f.classes)
        assert (t.boxes[i, n:] == 0).all() and (t.classes[i, n:] == 0).all()
    if task == "segment":
        assert_shape(t.masks, dims["BQQ"])
        assert t.masks.dtype == torch.int64
        for i, (_, f) in enumerate(pairs):
            np.testing.assert_array_equal(t.masks[i].numpy(), f.masks)
            assert int(t.masks[i].max()) <= counts[i]
    else:
        assert t.masks is None
    if task == "pose":
        assert_shape(t.keypoints, (dims.B, dims.M, dims.P, 3))
        assert t.keypoints.dtype == torch.float32
    else:
        assert t.keypoints is None


def test_segment_slots_follow_descending_mask_area():
    rec, f = _formatted(3, 6, "segment", size=96)
    dense = rec.masks.to_dense((96, 96))
    areas = [(f.masks == k + 1).sum() for k in range(len(f.boxes))]
    # slot k's box is the box of the instance whose mask was sorted into k (area at H/4, descending)
    full_area = [int(np.count_nonzero(A.overlap_map(A.RoiMasks.from_dense(dense[i:i + 1]), (96, 96))[0]))
                 for i in range(len(dense))]
    slot_area = []
    for k in range(len(f.boxes)):
        i = int(np.flatnonzero((rec.boxes == f.boxes[k]).all(1))[0])
        slot_area.append(full_area[i])
    assert slot_area == sorted(slot_area, reverse=True)
    assert sum(areas) == int(np.count_nonzero(f.masks))


def test_collate_errors():
    _, a = _formatted(0, 2, "detect", size=64)
    _, b = _formatted(1, 2, "detect", size=96)
    with pytest.raises(ValueError, match=r"\[yolo_func\] collate: items\[1\]"):
        collate([a, b])
    with pytest.raises(ValueError, match=r"\[yolo_func\] max_boxes"):
        collate([a], max_boxes=1)
    with pytest.raises(ValueError, match=r"\[yolo_func\] collate: items is empty"):
        collate([])
    assert collate([a], max_boxes=5).targets.boxes.shape == (1, 5, 4)
