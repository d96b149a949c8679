"""The validation ground-truth masks: the reference's overlap form from polygons (yolo_func.eval.gt_masks)."""

from __future__ import annotations

import math
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from yolo_func.data import builtin_dataset
from yolo_func.data.augment import RoiMasks, letterbox_params
from yolo_func.eval.gt_masks import letterboxed_polygon_masks, overlap_split, resample_polygon, val_gt_masks

polygon = st.integers(3, 12).flatmap(lambda k: st.lists(st.tuples(st.floats(0, 200), st.floats(0, 150)),
                                                         min_size=k, max_size=k))


@given(polygon, st.integers(2, 300))
def test_resample_walks_the_closed_polygon(poly, n):
    p = np.array(poly, np.float64)
    q = resample_polygon(p, n)
    assert q.shape == (n, 2) and q.dtype == np.float32
    np.testing.assert_allclose(q[0], p[0], atol=1e-3)
    np.testing.assert_allclose(q[-1], p[0], atol=1e-3)  # closed: back to the first vertex
    # every point lies on an edge of the closed polygon: the distance to the nearest edge is ~0
    a, b = p, np.roll(p, -1, 0)
    ab = b - a
    t = np.clip(((q[:, None] - a[None]) * ab[None]).sum(-1) / np.maximum((ab * ab).sum(-1), 1e-12)[None], 0, 1)
    d = np.linalg.norm(q[:, None] - (a[None] + t[..., None] * ab[None]), axis=-1).min(1)
    assert d.max() < 1e-2


@settings(max_examples=40, deadline=None)
@given(st.lists(polygon, min_size=0, max_size=5), st.floats(0.3, 1.5), st.floats(0.3, 1.5),
       st.integers(0, 40), st.integers(0, 40))
def test_polygon_crops_equal_the_full_size_fill(polys, gx, gy, px, py):
    # a second implementation: fill the same truncated vertices on the whole canvas
    H, W = 192, 256
    roi = letterboxed_polygon_masks([np.array(p, np.float32) for p in polys], (gx, gy), (px, py), (H, W))
    dense = roi.to_dense((H, W))
    for p, got in zip(polys, dense):
        want = np.zeros((H, W), np.uint8)
        pts = (resample_polygon(np.array(p, np.float32)) * np.array([gx, gy], np.float32)
               + np.array([px, py], np.float32)).astype(np.int32)
        cv2.fillPoly(want, [pts], 1)
        np.testing.assert_array_equal(got, want)


def test_overlap_split_gives_the_overlap_to_the_smaller_instance():
    H, W = 64, 64
    big = np.zeros((H, W), np.uint8)
    big[8:56, 8:56] = 1
    small = np.zeros((H, W), np.uint8)
    small[24:40, 24:40] = 1
    apart = np.zeros((H, W), np.uint8)
    apart[0:4, 60:64] = 1
    gt = overlap_split(RoiMasks.from_dense(np.stack([small, big, apart])), (H, W)).numpy()
    q = lambda m: cv2.resize(m, (W // 4, H // 4), interpolation=cv2.INTER_LINEAR) > 0  # noqa: E731
    np.testing.assert_array_equal(gt[0], q(small))  # the smaller one keeps all of its pixels
    np.testing.assert_array_equal(gt[1], q(big) & ~q(small))  # the larger one loses the overlap
    np.testing.assert_array_equal(gt[2], q(apart))
    assert gt.sum(0).max() == 1  # a partition: no pixel in two instances
    assert overlap_split(RoiMasks(np.zeros((0, 2), np.int64), ()), (H, W)).shape == (0, 16, 16)


class _DenseOnly:
    """A dataset without ``polygons``: the dense-mask fallback."""

    def __init__(self, ds):
        self.ds = ds

    def __getitem__(self, i):
        return self.ds[i]


def test_polygon_and_dense_paths_agree_on_the_builtin_data(tmp_path):
    ds = builtin_dataset("segment", "val", root=tmp_path, num_images=6)
    dense = _DenseOnly(ds)
    ious = []
    for i in range(len(ds)):
        h0, w0 = (int(v) for v in ds.image_sizes[i])
        r = 160 / max(h0, w0)
        w, h = min(math.ceil(w0 * r), 160), min(math.ceil(h0 * r), 160)
        H, W = (math.ceil(v / 32 + 0.5) * 32 for v in (h, w))
        p = letterbox_params((h, w), (H, W), scaleup=False)
        gain = (w / w0, h / h0)
        a = val_gt_masks(ds, i, orig_shape=(h0, w0), gain=gain, pad=p.pad, shape=(H, W))
        b = val_gt_masks(dense, i, orig_shape=(h0, w0), gain=gain, pad=p.pad, shape=(H, W))
        assert a.shape == b.shape == (len(ds[i].classes), H // 4, W // 4) and a.dtype == torch.bool
        assert int(a.sum(0).max()) <= 1 and int(b.sum(0).max()) <= 1
        for x, y in zip(a, b):
            if int(y.sum()) >= 20:
                ious.append(float((x & y).sum() / (x | y).sum()))
    assert ious and np.mean(ious) > 0.8  # two rasterisations of the same instance (polygon vs mask warp)


@pytest.mark.parity
def test_val_gt_masks_equal_the_references_val_batches(builtin_segment_yolo):
    """The reference's val dataset (black box, public ``build_yolo_dataset(mode="val")``) carries
    the overlap-form masks; ours, built for the same letterbox, match them instance by instance
    (the rule the fit used before -- each instance's dense mask warped straight to a quarter, no
    overlap form -- does not)."""
    from ultralytics.cfg import get_cfg
    from ultralytics.data.build import build_yolo_dataset

    imgsz = 320
    ds, data, names = builtin_segment_yolo(24)
    ref = build_yolo_dataset(get_cfg(overrides={"task": "segment", "imgsz": imgsz}), data["val"], 4, data,
                             mode="val", rect=True, stride=32)
    ious, per_instance, old = [], [], []
    for k in range(len(ref)):
        r = ref[k]
        i = names.index(Path(r["im_file"]).name)
        ref_map = r["masks"][0].numpy()
        H, W = r["img"].shape[1:]
        h0, w0 = (int(v) for v in ds.image_sizes[i])
        s = imgsz / max(h0, w0)
        w, h = (min(math.ceil(w0 * s), imgsz), min(math.ceil(h0 * s), imgsz)) if s != 1 else (w0, h0)
        p = letterbox_params((h, w), (H, W), scaleup=False)
        gain = (p.gain[0] * w / w0, p.gain[1] * h / h0)
        ours = val_gt_masks(ds, i, orig_shape=(h0, w0), gain=gain, pad=p.pad, shape=(H, W)).numpy()
        alone = np.stack([overlap_split(RoiMasks.from_dense(m[None]), (H, W)).numpy()[0]
                          for m in letterboxed_polygon_masks(ds.polygons(i), gain, p.pad, (H, W)).to_dense((H, W))])
        quarter = np.array([[gain[0] / 4, 0, p.pad[0] / 4], [0, gain[1] / 4, p.pad[1] / 4]], np.float64)
        before = np.stack([cv2.warpAffine(m.astype(np.float32), quarter, (W // 4, H // 4), flags=cv2.INTER_LINEAR) > 0.5
                           for m in ds[i].masks])
        for v in range(1, int(ref_map.max()) + 1):
            a = ref_map == v
            if a.any():
                ious.append(((ours & a).sum((1, 2)) / np.maximum((ours | a).sum((1, 2)), 1)).max())
                per_instance.append(((alone & a).sum((1, 2)) / np.maximum((alone | a).sum((1, 2)), 1)).max())
                old.append(((before & a).sum((1, 2)) / np.maximum((before | a).sum((1, 2)), 1)).max())
    assert len(ious) > 50
    assert np.mean(ious) > 0.99 and np.mean(np.array(ious) == 1.0) > 0.7
    assert np.mean(per_instance) < np.mean(ious)  # without the overlap form: further
    assert np.mean(old) < 0.9  # the rule before: far
