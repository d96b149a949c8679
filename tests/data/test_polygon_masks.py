"""Training masks as polygons (the reference's form): resampled, moved like keypoints through the
augmentation, filled at the end with integer-truncated vertices (yolo_func.data.augment.PolygonMasks)."""

from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from yolo_func.data import TrainLoader, builtin_dataset
from yolo_func.data.augment import (
    Annotated,
    AugmentConfig,
    PolygonMasks,
    augment,
    overlap_map,
    record_rng,
)
from yolo_func.data.loader import _Source
from yolo_func.data.polygons import clipped_polygon_boxes, fill_polygons, resample_polygons

ZERO = dict(mosaic=0.0, translate=0.0, scale=0.0, hsv_h=0.0, hsv_s=0.0, hsv_v=0.0, fliplr=0.0)

polygon = st.integers(3, 10).flatmap(lambda k: st.lists(st.tuples(st.floats(-20, 120), st.floats(-20, 90)),
                                                         min_size=k, max_size=k))


def test_fill_truncates_vertices_and_keeps_the_boundary_pixels():
    # vertices (1.7, 2.2) .. (5.9, 4.8) truncate to (1, 2) .. (5, 4); fillPoly's pixel-centre rule
    # keeps the boundary pixels: columns 1..5, rows 2..4
    rect = np.array([[1.7, 2.2], [5.9, 2.2], [5.9, 4.8], [1.7, 4.8]], np.float32)
    offsets, crops = fill_polygons([rect], (10, 10))
    assert offsets.tolist() == [[1, 2]]
    assert crops[0].shape == (3, 5) and crops[0].all()
    # negative coordinates truncate toward zero: -0.9 -> 0, so column 0 is in
    offsets, crops = fill_polygons([rect - 2.6], (10, 10))
    assert offsets.tolist() == [[0, 0]] and crops[0].shape == (3, 4)


def test_fill_of_degenerate_polygons_is_empty():
    nan = np.full((5, 2), np.nan, np.float32)
    line = np.array([[1, 1], [5, 5]], np.float32)
    outside = np.array([[50, 50], [60, 50], [60, 60]], np.float32)
    offsets, crops = fill_polygons([nan, line, outside], (20, 20))
    assert [c.shape for c in crops] == [(0, 0)] * 3 and not offsets.any()


@settings(max_examples=60, deadline=None)
@given(st.lists(polygon, min_size=1, max_size=4))
def test_fill_crops_equal_the_full_size_fill(polys):
    """Second implementation: one ``cv2.fillPoly`` per polygon on the whole image."""
    H, W = 70, 100
    offsets, crops = fill_polygons([np.array(p, np.float32) for p in polys], (H, W))
    for p, (x0, y0), c in zip(polys, offsets, crops):
        full = np.zeros((H, W), np.uint8)
        cv2.fillPoly(full, [np.array(p, np.float32).astype(np.int32)], 1)
        ours = np.zeros((H, W), np.uint8)
        ours[y0:y0 + c.shape[0], x0:x0 + c.shape[1]] = c
        np.testing.assert_array_equal(ours, full)


def _sutherland_hodgman(poly: list, W: float, H: float) -> list:
    """The polygon clipped to [0, W] x [0, H], one border half-plane at a time (pure Python)."""
    inside = [lambda p: p[0] >= 0, lambda p: p[0] <= W, lambda p: p[1] >= 0, lambda p: p[1] <= H]
    cut = [lambda a, b: (0.0, a[1] + (b[1] - a[1]) * (0 - a[0]) / (b[0] - a[0])),
           lambda a, b: (W, a[1] + (b[1] - a[1]) * (W - a[0]) / (b[0] - a[0])),
           lambda a, b: (a[0] + (b[0] - a[0]) * (0 - a[1]) / (b[1] - a[1]), 0.0),
           lambda a, b: (a[0] + (b[0] - a[0]) * (H - a[1]) / (b[1] - a[1]), H)]
    out = list(poly)
    for ins, meet in zip(inside, cut):
        src, out = out, []
        for k, cur in enumerate(src):
            prev = src[k - 1]
            if ins(cur):
                if not ins(prev):
                    out.append(meet(prev, cur))
                out.append(cur)
            elif ins(prev):
                out.append(meet(prev, cur))
    return out


@settings(max_examples=80, deadline=None)
@given(st.lists(polygon, min_size=1, max_size=4))
def test_clipped_boxes_are_the_extent_of_the_part_inside(polys):
    """Second implementation: Sutherland-Hodgman clipping to the 100 x 70 image, then the extent."""
    pts = np.stack([resample_polygons([np.array(p, np.float64)], 60)[0] for p in polys])
    boxes = clipped_polygon_boxes(pts, (70, 100))
    for q, box in zip(pts.astype(np.float64), boxes):
        clipped = _sutherland_hodgman([tuple(v) for v in q], 100.0, 70.0)
        if not clipped:
            np.testing.assert_array_equal(box, 0)
            continue
        c = np.array(clipped)
        np.testing.assert_allclose(box, [*c.min(0), *c.max(0)], atol=1e-3)


def test_resampled_polygons_mark_unusable_instances_nan():
    out = resample_polygons([np.array([[0, 0], [4, 0], [4, 4]]), np.zeros((0, 2)), np.array([[1, 1], [2, 2]])], 7)
    assert out.shape == (3, 7, 2) and out.dtype == np.float32
    assert np.isfinite(out[0]).all() and np.isnan(out[1:]).all()
    m = PolygonMasks(out)
    np.testing.assert_array_equal(m.boxes((10, 10)), [[0, 0, 4, 4], [0, 0, 0, 0], [0, 0, 0, 0]])


def _record(rng: np.random.Generator, size: int = 160) -> Annotated:
    """A record whose instances are polygons and whose keypoints are those polygons' points."""
    n = int(rng.integers(1, 5))
    polys = []
    for _ in range(n):
        c = rng.uniform(20, size - 20, 2)
        r = rng.uniform(5, 30)
        a = np.sort(rng.uniform(0, 2 * np.pi, 6))
        polys.append(np.stack([c[0] + r * np.cos(a), c[1] + r * np.sin(a)], 1).clip(0, size))
    masks = PolygonMasks.from_polygons(polys, 40)
    kpts = np.concatenate([masks.points, np.full((n, 40, 1), 2.0, np.float32)], -1)
    image = rng.integers(0, 255, (size, size, 3), dtype=np.uint8)
    return Annotated(image, masks.boxes((size, size)), np.zeros(n, np.int64), masks, kpts)


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**31 - 1), st.booleans(), st.booleans())
def test_polygons_move_like_keypoints_through_the_pipeline(seed, use_mosaic, fast):
    """Invariant: every transform moves a polygon point exactly as it moves the same point held
    as a keypoint (wherever the keypoint stays visible), each segment box is the clipped extent of
    its polygon, and the box is tight around the filled pixels (1 px) for a polygon inside the
    image."""
    rng = np.random.default_rng(seed)
    recs = [_record(rng) for _ in range(4)]
    cfg = AugmentConfig(fast_resize=fast)
    out = augment(np.random.default_rng(seed), recs, 128, cfg, use_mosaic=use_mosaic)
    vis = out.keypoints[..., 2] > 0
    np.testing.assert_allclose(out.masks.points[vis], out.keypoints[..., :2][vis], atol=1e-3)
    np.testing.assert_allclose(out.boxes, out.masks.boxes((128, 128)), atol=1e-4)
    assert len(out.masks.points) == len(out.boxes) == len(out.classes)
    # each box is tight around its filled mask's pixels within 1 px (vertices truncate toward zero)
    # for a polygon inside the image (a polygon crossing the border has the box of its part inside,
    # checked in test_clipped_boxes_are_the_extent_of_the_part_inside)
    pixel_boxes = out.masks.rasterise((128, 128)).boxes()
    assert (pixel_boxes[:, 2] > pixel_boxes[:, 0]).all()  # every surviving instance fills pixels
    p = out.masks.points
    inside = ((p >= 0) & (p <= 128)).all((1, 2))
    assert np.abs(pixel_boxes - out.boxes)[inside].max(initial=0) <= 1.0


@pytest.fixture
def coco_tiny(shared_data):
    """``coco-tiny`` read for segmentation (skips when ``../shared/data`` is absent)."""
    from yolo_func.data import CocoDataset

    return CocoDataset(shared_data / "coco-tiny" / "annotations.json", shared_data / "coco-tiny" / "images",
                       task="segment")


def test_polygon_and_bitmap_masks_agree_on_real_data(coco_tiny):
    """Two forms of the same instances (COCO polygons vs the decoded masks) give nearly the same
    training masks; the polygon fill is the slightly larger (boundary pixels in)."""
    ds = coco_tiny
    ious, ratios = [], []
    for i in range(8):
        maps = []
        for src in ("polygons", "bitmaps"):
            rec = augment(record_rng(0, 0, i), [_Source(ds, "segment", 320, src).read(i)], 320,
                          AugmentConfig(**ZERO), use_mosaic=False)
            m, order = overlap_map(rec.masks, (320, 320))
            slot = np.empty(len(order), np.int64)
            slot[order] = np.arange(1, len(order) + 1)
            maps.append([m == v for v in slot])
        for a, b in zip(*maps):
            if b.sum() >= 30:
                ious.append((a & b).sum() / (a | b).sum())
                ratios.append(a.sum() / b.sum())
    assert len(ious) >= 10
    assert np.mean(ious) > 0.85 and 1.0 <= np.median(ratios) < 1.3


def test_auto_mask_source_uses_polygons_when_the_dataset_has_them(coco_tiny):
    ds = coco_tiny
    assert _Source(ds, "segment", 320, "auto").polygons
    assert not _Source(ds, "segment", 320, "bitmaps").polygons
    assert not _Source(ds, "detect", 320, "auto").polygons  # no masks for detect
    assert not _Source(_BitmapsOnly(builtin_dataset("segment", "train", num_images=2)), "segment", 64, "auto").polygons
    loader = TrainLoader(ds, batch_size=4, image_size=128, workers=0, mask_source="polygons")
    batch = next(iter(loader))
    masks, valid = batch.targets.masks, batch.targets.valid
    # every valid slot j of an image has its value j + 1 somewhere in the overlap map, or is hidden
    # entirely by smaller instances; at least most of them are visible
    seen = [(masks[b] == j + 1).any().item() for b in range(4) for j in range(valid.shape[1]) if valid[b, j]]
    assert np.mean(seen) > 0.8


class _BitmapsOnly:
    """A dataset with masks and no ``polygons`` method."""

    def __init__(self, ds):
        self.ds, self.task = ds, ds.task

    def __len__(self):
        return len(self.ds)

    def __getitem__(self, i):
        return self.ds[i]


def test_bad_mask_source_is_refused_with_the_fix():
    built = _BitmapsOnly(builtin_dataset("segment", "train", num_images=2))
    with pytest.raises(ValueError, match="mask_source: expected one of"):
        TrainLoader(built, batch_size=2, image_size=64, workers=0, mask_source="rle")
    with pytest.raises(ValueError, match="mask_source: expected one of"):  # whatever the task
        TrainLoader(builtin_dataset("detect", "train", num_images=2), batch_size=2, image_size=64, workers=0,
                    mask_source="rle")
    with pytest.raises(ValueError, match="has no polygons.*mask_source='bitmaps'"):
        TrainLoader(built, batch_size=2, image_size=64, workers=0, mask_source="polygons")


def test_polygon_count_mismatch_names_the_file(coco_tiny):
    ds = coco_tiny

    class Short:
        task = "segment"

        def __len__(self):
            return len(ds)

        def __getitem__(self, i):
            return ds[i]

        def sample_without_masks(self, i):
            return ds.sample_without_masks(i)

        def polygons(self, i):
            return ds.polygons(i)[:-1]

    with pytest.raises(ValueError, match=r"'.*\.jpg'.*polygons for .* instances"):
        _Source(Short(), "segment", 128, "auto").read(0)


@pytest.mark.parity
def test_training_masks_match_the_references_with_augmentation_off(builtin_segment_yolo):
    """The reference's train dataset (black box, public ``build_yolo_dataset(mode="train")``, every
    augmentation at 0) against ours from polygons: nearly every instance's mask matches (the
    bitmap form measured 0.84 mean IoU here, ``benchmarks/results/train_gt_masks_*``)."""
    from ultralytics.cfg import get_cfg
    from ultralytics.data.build import build_yolo_dataset

    size = 320
    ds, data, names = builtin_segment_yolo(16)
    zero = dict(mosaic=0.0, degrees=0.0, translate=0.0, scale=0.0, shear=0.0, perspective=0.0, hsv_h=0.0, hsv_s=0.0,
                hsv_v=0.0, fliplr=0.0, flipud=0.0)
    ref = build_yolo_dataset(get_cfg(overrides=dict(task="segment", imgsz=size, **zero)), data["val"], 4, data,
                             mode="train", rect=False, stride=32)
    read = _Source(ds, "segment", size, "auto").read
    ious = []
    for k in range(len(ref)):
        r = ref[k]
        ref_map = r["masks"].numpy().reshape(size // 4, size // 4)
        rec = augment(np.random.default_rng(0), [read(names.index(Path(r["im_file"]).name))], size,
                      AugmentConfig(**ZERO), use_mosaic=False)
        ours, _ = overlap_map(rec.masks, (size, size))
        for v in range(1, int(ref_map.max()) + 1):
            a = ref_map == v
            if a.any():
                best = max(((ours == u) & a).sum() / ((ours == u) | a).sum() for u in range(1, int(ours.max()) + 1))
                ious.append(best)
    assert len(ious) > 30 and np.mean(ious) > 0.96


@pytest.mark.parity
@settings(max_examples=40, deadline=None)
@given(st.lists(polygon, min_size=1, max_size=4))
def test_polygon_boxes_equal_the_references_segment2box(polys):
    """The box rule for polygons crossing the border: the reference's public ``segment2box``
    (black box) clips the coordinates, then takes the extent; ours gives the same boxes."""
    from ultralytics.utils.ops import segment2box

    pts = np.stack([resample_polygons([np.array(p, np.float32)], 50)[0] for p in polys])
    ours = PolygonMasks(pts).boxes((70, 100))
    ref = np.stack([segment2box(p, 100, 70) for p in pts])
    np.testing.assert_allclose(ours, ref, atol=1e-4)
