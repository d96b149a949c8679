"""Augmentations: each transform checked against an independent computation or an invariant."""

from __future__ import annotations

import math

import cv2
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loader_fixtures import ellipse_sample
from yolo_func.data import augment as A

SEEDS = st.integers(0, 2**31 - 1)


def _rec(seed: int, h: int = 96, w: int = 128, n: int = 4, keypoints: int = 0) -> A.Annotated:
    return A.annotated_from_sample(ellipse_sample(np.random.default_rng(seed), h, w, n, keypoints=keypoints))


def _dense_box(m: np.ndarray) -> np.ndarray:
    ys, xs = np.nonzero(m)
    return np.array([xs.min(), ys.min(), xs.max() + 1, ys.max() + 1], np.float32)


# ------------------------------------------------------------------------------------------ rng
def test_record_rng_depends_on_every_key_and_nothing_else():
    draw = lambda *k: A.record_rng(*k).integers(0, 2**62, 4)  # noqa: E731
    assert np.array_equal(draw(0, 1, 2), draw(0, 1, 2))
    assert len({tuple(draw(*k)) for k in [(0, 1, 2), (1, 1, 2), (0, 2, 2), (0, 1, 3), (0, 2, 1)]}) == 5
    state = np.random.get_state()[1].copy()
    A.augment(A.record_rng(0, 0, 0), [_rec(1)] * 4, 128, A.AugmentConfig(), use_mosaic=True)
    assert np.array_equal(state, np.random.get_state()[1]), "the global numpy RNG was used"


# ------------------------------------------------------------------------------------ letterbox
@given(h=st.integers(20, 300), w=st.integers(20, 300), H=st.sampled_from([64, 96, 160]),
       W=st.sampled_from([64, 128, 160]), scaleup=st.booleans(), seed=SEEDS)
def test_letterbox_boxes_follow_the_pixels_and_invert_within_1px(h, w, H, W, scaleup, seed):
    rng = np.random.default_rng(seed)
    x1, y1 = int(rng.integers(0, w - 8)), int(rng.integers(0, h - 8))
    x2, y2 = int(rng.integers(x1 + 8, w + 1)), int(rng.integers(y1 + 8, h + 1))
    img = np.zeros((h, w, 3), np.uint8)
    img[y1:y2, x1:x2] = 255
    out, p = A.letterbox(img, (H, W), scaleup=scaleup)
    assert out.shape == (H, W, 3)
    r = min(H / h, W / w) if scaleup else min(H / h, W / w, 1.0)
    assert p.resized == (round(h * r), round(w * r))
    # the padding is 114 everywhere outside the resized image, and centred within 1 px
    left, top = p.pad
    assert abs(left - (W - p.resized[1]) / 2) <= 0.6 and abs(top - (H - p.resized[0]) / 2) <= 0.6
    inside = np.zeros((H, W), bool)
    inside[top:top + p.resized[0], left:left + p.resized[1]] = True
    assert (out[~inside] == 114).all()
    box = np.array([[x1, y1, x2, y2]], np.float32)
    lb = A.letterbox_boxes(box, p)[0]
    bright = out[..., 0] > 127
    if bright.any():
        np.testing.assert_allclose(_dense_box(bright), lb, atol=1.0)
    np.testing.assert_allclose(A.unletterbox_boxes(A.letterbox_boxes(box, p), p), box, atol=1e-3)


# ---------------------------------------------------------------------------------------- affine
def _random_transform(rng: np.random.Generator, in_shape, out_shape, perspective: bool) -> A.AffineTransform:
    return A.sample_affine(rng, in_shape, out_shape, degrees=30, translate=0.1, scale=0.5, shear=10,
                           perspective=5e-4 if perspective else 0.0)


@given(seed=SEEDS, perspective=st.booleans())
def test_affine_masks_equal_a_full_image_warp_and_boxes_are_tight(seed, perspective):
    rec = _rec(seed)
    t = _random_transform(np.random.default_rng(seed), rec.image.shape[:2], (96, 96), perspective)
    warped = t.apply_masks(rec.masks).to_dense((96, 96))
    dense = rec.masks.to_dense(rec.image.shape[:2])
    flags = cv2.INTER_LINEAR
    full = np.stack([cv2.warpPerspective(m, t.matrix, (96, 96), flags=flags) if perspective else
                     cv2.warpAffine(m, t.matrix[:2], (96, 96), flags=flags) for m in dense])
    # Region-of-interest warps vs whole-image warps: the same pixels up to fixed-point rounding ties.
    assert np.count_nonzero(warped != full) <= max(2, full.sum() // 200)
    out = A.apply_affine(rec, t)
    for box, m in zip(out.boxes, out.masks.to_dense((96, 96))):
        np.testing.assert_allclose(box, _dense_box(m), atol=0)  # tight around its own pixels
    for box, m in zip(out.boxes, out.masks.crops):
        assert m.size and (box[2] - box[0]) > 2 and (box[3] - box[1]) > 2


@given(seed=SEEDS, dx=st.integers(-40, 40), dy=st.integers(-40, 40), s=st.sampled_from([0.5, 1.0, 2.0]))
def test_scale_translate_matrix_moves_boxes_masks_keypoints_as_computed_by_hand(seed, dx, dy, s):
    rec = _rec(seed, keypoints=3)
    M = np.array([[s, 0, dx], [0, s, dy], [0, 0, 1]], np.float64)
    t = A.AffineTransform(M, (96, 128), s)
    x = rec.keypoints[..., :2] * s + np.array([dx, dy], np.float32)
    np.testing.assert_allclose(t.apply_keypoints(rec.keypoints)[..., :2], x, rtol=1e-6, atol=1e-4)
    expect = np.clip(rec.boxes * s + np.array([dx, dy, dx, dy], np.float32), 0, [128, 96, 128, 96])
    np.testing.assert_allclose(t.apply_boxes(rec.boxes), expect, atol=1e-4)
    vis = t.apply_keypoints(rec.keypoints)[..., 2]
    out = (x[..., 0] < 0) | (x[..., 0] > 128) | (x[..., 1] < 0) | (x[..., 1] > 96)
    assert (vis[out] == 0).all() and (vis[~out] == rec.keypoints[..., 2][~out]).all()
    # masks: with s <= 1 every output pixel samples one input pixel exactly: dst(x, y) = src((x-dx)/s, (y-dy)/s)
    dense = rec.masks.to_dense((96, 128))
    warped = t.apply_masks(rec.masks).to_dense((96, 128))
    if s <= 1:
        ys, xs = np.mgrid[0:96, 0:128]
        sx, sy = (xs - dx) / s, (ys - dy) / s
        ok = (sx >= 0) & (sx <= 127) & (sy >= 0) & (sy <= 95)
        want = np.zeros_like(warped)
        want[:, ok] = dense[:, sy[ok].astype(int), sx[ok].astype(int)]
        np.testing.assert_array_equal(warped, want)
    else:  # enlarging interpolates: a mask wholly inside keeps its scaled box within the pixel grid
        for b0, m in zip(rec.boxes, warped):
            e = b0 * s + np.array([dx, dy, dx, dy])
            if e[0] >= 0 and e[1] >= 0 and e[2] <= 128 and e[3] <= 96:
                np.testing.assert_allclose(_dense_box(m), e, atol=1.5)


def test_sample_affine_composes_T_S_R_P_C():
    rng = np.random.default_rng(0)
    t = A.sample_affine(rng, (200, 100), (64, 64), degrees=0, translate=0.1, scale=0.5, shear=0, perspective=0)
    assert 0.5 <= t.scale <= 1.5 and t.is_affine
    centre = t.apply_coords(np.array([[50.0, 100.0]]))[0]  # C sends the input centre to the origin
    assert 0.4 * 64 <= centre[0] <= 0.6 * 64 and 0.4 * 64 <= centre[1] <= 0.6 * 64
    np.testing.assert_allclose(t.matrix[:2, :2], np.eye(2) * t.scale)  # degrees = shear = 0
    rng2 = np.random.default_rng(0)
    s = rng2.uniform(0.5, 1.5)
    tx, ty = rng2.uniform(0.4, 0.6, 1)[0] * 64, rng2.uniform(0.4, 0.6, 1)[0] * 64
    np.testing.assert_allclose(t.matrix, [[s, 0, tx - 50 * s], [0, s, ty - 100 * s], [0, 0, 1]], rtol=1e-12)


def test_box_candidates_hand_computed():
    before = np.array([[0, 0, 10, 10]] * 5, np.float32)
    after = np.array([[0, 0, 10, 10], [0, 0, 2, 10], [0, 0, 3, 3], [0, 0, 300, 2.5], [0, 0, 5, 5]], np.float32)
    keep = A.box_candidates(before, after, scale=1.0)
    # w<=2 fails; 3x3=9/100 < 0.1 fails; aspect 120 fails; 25/100 passes
    assert keep.tolist() == [True, False, False, False, True]
    assert A.box_candidates(before, after, scale=1.0, area_thr=0.01).tolist() == [True, False, True, False, True]
    assert A.box_candidates(before[:1], after[4:], scale=2.0).tolist() == [False]  # 25 / (100 * 4) < 0.1


# ---------------------------------------------------------------------------------------- mosaic
def test_mosaic_places_four_images_and_shifts_labels_by_hand():
    recs = []
    for i in range(4):
        img = np.full((64, 64, 3), 10 * (i + 1), np.uint8)
        recs.append(A.Annotated(img, np.array([[8, 8, 24, 40]], np.float32), np.array([i], np.int64)))
    out = A.mosaic(recs, (64, 64), 64)
    assert out.image.shape == (128, 128, 3)
    for i, (x, y) in enumerate([(0, 0), (64, 0), (0, 64), (64, 64)]):
        assert (out.image[y:y + 64, x:x + 64] == 10 * (i + 1)).all()
    np.testing.assert_array_equal(out.boxes, [[8, 8, 24, 40], [72, 8, 88, 40], [8, 72, 24, 104], [72, 72, 88, 104]])
    assert out.classes.tolist() == [0, 1, 2, 3]


@given(seed=SEEDS, xc=st.integers(64, 192), yc=st.integers(64, 192))
def test_mosaic_canvas_and_masks_match_a_direct_paste(seed, xc, yc):
    recs = [_rec(seed + i, h=int(80 + 16 * (i % 2)), w=int(128 - 24 * (i // 2)), keypoints=3) for i in range(4)]
    s = 128
    out = A.mosaic(recs, (xc, yc), s)
    canvas = np.full((2 * s, 2 * s, 3), 114, np.uint8)  # the plain way: fill, then paste each placement
    dense_all = []
    for i, r in enumerate(recs):
        h, w = r.image.shape[:2]
        x0 = xc - w if i in (0, 2) else xc
        y0 = yc - h if i in (0, 1) else yc
        big = np.full((2 * s + 2 * h, 2 * s + 2 * w, 3), 114, np.uint8)
        big[y0 + h:y0 + 2 * h, x0 + w:x0 + 2 * w] = r.image
        region = np.zeros((2 * s, 2 * s), bool)
        region[max(y0, 0):y0 + h, max(x0, 0):x0 + w] = True
        canvas[region] = big[h:h + 2 * s, w:w + 2 * s][region]
        for m in r.masks.to_dense((h, w)):
            d = np.zeros((2 * s, 2 * s), np.uint8)
            A._paste(d, m, x0, y0, np.maximum)
            dense_all.append(d)
    np.testing.assert_array_equal(out.image, canvas)
    dense_all = np.array(dense_all)
    keep = dense_all.reshape(len(dense_all), -1).any(1)
    got = out.masks.to_dense((2 * s, 2 * s))
    # every instance with canvas pixels survives with exactly those pixels; each box covers its mask
    assert len(got) == keep.sum()
    np.testing.assert_array_equal(got, dense_all[keep])
    for b, m in zip(out.boxes, got):
        mb = _dense_box(m)
        assert (mb[:2] >= b[:2] - 1).all() and (mb[2:] <= b[2:] + 1).all()
    assert out.keypoints.shape[0] == len(out.boxes)


# ----------------------------------------------------------------------------------------- flips
@given(seed=SEEDS, horizontal=st.booleans(), vertical=st.booleans())
def test_double_flip_is_the_identity(seed, horizontal, vertical):
    rec = _rec(seed, keypoints=5)
    t = A.FlipTransform(rec.image.shape[:2], horizontal, vertical, (0, 2, 1, 4, 3))
    twice = A.apply_flips(A.apply_flips(rec, t), t)
    np.testing.assert_array_equal(twice.image, rec.image)
    np.testing.assert_allclose(twice.boxes, rec.boxes, atol=1e-4)
    np.testing.assert_allclose(twice.keypoints, rec.keypoints, atol=1e-4)
    np.testing.assert_array_equal(twice.masks.to_dense(rec.image.shape[:2]), rec.masks.to_dense(rec.image.shape[:2]))


@given(seed=SEEDS)
def test_horizontal_flip_mirrors_pixels_and_swaps_left_right_keypoints(seed):
    rec = _rec(seed, keypoints=5)
    h, w = rec.image.shape[:2]
    flip = (0, 2, 1, 4, 3)
    out = A.apply_flips(rec, A.FlipTransform((h, w), True, False, flip))
    np.testing.assert_array_equal(out.image, rec.image[:, ::-1])
    np.testing.assert_array_equal(out.masks.to_dense((h, w)), rec.masks.to_dense((h, w))[:, :, ::-1])
    for b, m in zip(out.boxes, out.masks.to_dense((h, w))):
        if m.any():
            np.testing.assert_allclose(b, _dense_box(m), atol=1)
    # fixture: keypoint 2k-1 lies right of keypoint 0 (visibility 2), 2k its mirror on the left (v 1).
    # After the flip with the index, 2k-1 is again the right one, and the visibilities swapped.
    k0, k = rec.keypoints, out.keypoints
    for j in (1, 3):
        assert (k[:, j, 0] >= k[:, 0, 0] - 1e-4).all() and (k0[:, j, 0] >= k0[:, 0, 0] - 1e-4).all()
        np.testing.assert_array_equal(k[:, j, 2], k0[:, j + 1, 2])
        np.testing.assert_allclose(k[:, j, 0], w - k0[:, j + 1, 0], atol=1e-4)
    no_index = A.apply_flips(rec, A.FlipTransform((h, w), True, False, None)).keypoints
    assert (no_index[:, 1, 0] <= no_index[:, 0, 0] + 1e-4).all()  # without the index: sides swap


# ------------------------------------------------------------------------------------------- HSV
def test_hsv_zero_gains_is_the_identity_and_draws_nothing():
    img = np.random.default_rng(0).integers(0, 256, (32, 48, 3), dtype=np.uint8)
    rng = np.random.default_rng(1)
    t = A.sample_hsv(rng, 0, 0, 0)
    assert np.array_equal(t.apply_image(img), img)
    assert rng.random() == np.random.default_rng(1).random()


@given(seed=SEEDS, gains=st.tuples(st.floats(0, 0.5), st.floats(0, 1), st.floats(0, 1)))
def test_hsv_matches_a_direct_cvtcolor_implementation(seed, gains):
    rng = np.random.default_rng(seed)
    img = rng.integers(0, 256, (24, 40, 3), dtype=np.uint8)
    t = A.sample_hsv(rng, *gains)
    got = t.apply_image(img)
    if not any(gains):
        np.testing.assert_array_equal(got, img)
        return
    hsv = cv2.cvtColor(img, cv2.COLOR_RGB2HSV).astype(np.float64)
    r = t.r
    h = ((hsv[..., 0] + 180 * r[0]) % 180).astype(np.uint8)
    s = np.clip(hsv[..., 1] * (1 + r[1]), 0, 255).astype(np.uint8)
    v = np.clip(hsv[..., 2] * (1 + r[2]), 0, 255).astype(np.uint8)
    want = cv2.cvtColor(np.stack([h, s, v], -1), cv2.COLOR_HSV2RGB)
    np.testing.assert_array_equal(got, want)
    assert (np.abs(r) <= np.array(gains) + 1e-12).all()


# ------------------------------------------------------------------------------------ overlap map
@given(seed=SEEDS)
def test_overlap_map_equals_resized_full_masks_sorted_by_area(seed):
    rec = _rec(seed, h=96, w=128, n=5)
    dense = rec.masks.to_dense((96, 128))
    got, order = A.overlap_map(rec.masks, (96, 128), 4)
    small = np.array([cv2.resize(m, (32, 24), interpolation=cv2.INTER_LINEAR) for m in dense])
    areas = small.reshape(5, -1).astype(np.int64).sum(1)
    assert (np.diff(areas[order]) <= 0).all()
    want = np.zeros((24, 32), np.int64)
    for k, i in enumerate(order):  # smaller instances (later) win overlaps
        want = np.where(small[i] > 0, k + 1, want)
    np.testing.assert_array_equal(got, want)


# -------------------------------------------------------------------------------------- pipeline
@settings(max_examples=15)
@given(seed=SEEDS, use_mosaic=st.booleans())
def test_pipeline_output_lies_inside_the_image_and_boxes_fit_masks(seed, use_mosaic):
    recs = [A.load_resized(_rec(seed + i, keypoints=3), 128) for i in range(4)]
    cfg = A.AugmentConfig(degrees=10, shear=5, flip_index=(0, 2, 1))
    out = A.augment(A.record_rng(seed, 0, 0), recs, 128, cfg, use_mosaic=use_mosaic)
    assert out.image.shape == (128, 128, 3) and out.image.dtype == np.uint8
    b = out.boxes
    assert ((b >= 0) & (b <= 128)).all()
    assert ((b[:, 2] - b[:, 0]) > 2).all() and ((b[:, 3] - b[:, 1]) > 2).all()
    for box, m in zip(b, out.masks.to_dense((128, 128))):
        np.testing.assert_allclose(box, _dense_box(m), atol=1)
    vis = out.keypoints[..., 2] > 0
    kx, ky = out.keypoints[..., 0][vis], out.keypoints[..., 1][vis]
    assert ((kx >= 0) & (kx <= 128) & (ky >= 0) & (ky <= 128)).all()
    again = A.augment(A.record_rng(seed, 0, 0), recs, 128, cfg, use_mosaic=use_mosaic)
    np.testing.assert_array_equal(again.image, out.image)
    np.testing.assert_array_equal(again.boxes, out.boxes)


def test_load_resized_keeps_long_side_and_ceil_rounding():
    rec = _rec(0, h=50, w=101)
    out = A.load_resized(rec, 64)
    assert out.image.shape[:2] == (math.ceil(50 * 64 / 101), 64)
    for b, m in zip(out.boxes, out.masks.to_dense(out.image.shape[:2])):
        if m.any():
            np.testing.assert_allclose(_dense_box(m), b, atol=1.5)


def test_close_mosaic_rule():
    cfg = A.AugmentConfig(close_mosaic=2)
    assert [A.mosaic_enabled(e, 5, cfg) for e in range(5)] == [True, True, True, False, False]
    assert A.mosaic_enabled(100, None, cfg)
    assert not A.mosaic_enabled(0, 5, A.AugmentConfig(mosaic=0.0))


def test_mosaic_partners_come_from_the_window():
    window = [7, 3, 9, 11]
    got = A.mosaic_partners(A.record_rng(0, 0, 5), 0, window)
    assert len(got) == 3 and set(got) <= set(window)
    assert got == A.mosaic_partners(A.record_rng(0, 0, 5), 0, window)


def test_roi_masks_reject_wrong_rank():
    with pytest.raises(ValueError, match=r"\[yolo_func\] masks"):
        A.RoiMasks.from_dense(np.zeros((4, 4), np.uint8))


@given(seed=SEEDS, xc=st.integers(64, 192), yc=st.integers(64, 192), x0=st.integers(0, 200), y0=st.integers(0, 200),
       w=st.integers(1, 256), h=st.integers(1, 256))
def test_mosaic_region_is_the_crop_of_the_whole_mosaic(seed, xc, yc, x0, y0, w, h):
    recs = [_rec(seed + i, h=int(80 + 16 * (i % 2)), w=int(128 - 24 * (i // 2)), keypoints=3) for i in range(4)]
    x1, y1 = min(x0 + w, 256), min(y0 + h, 256)
    full = A.mosaic(recs, (xc, yc), 128)
    part = A.mosaic(recs, (xc, yc), 128, region=(x0, y0, x1, y1))
    np.testing.assert_array_equal(part.image, full.image[y0:y1, x0:x1])
    off = np.array([x0, y0, x0, y0], np.float32)
    np.testing.assert_array_equal(part.boxes, full.boxes - off)  # same instances, same clipping
    np.testing.assert_array_equal(part.classes, full.classes)
    np.testing.assert_array_equal(part.masks.offsets, full.masks.offsets - [x0, y0])
    np.testing.assert_array_equal(part.keypoints[..., 2], full.keypoints[..., 2])


@given(seed=SEEDS)
def test_affine_on_the_source_region_equals_the_affine_on_the_whole_input(seed):
    rng = np.random.default_rng(seed)
    recs = [_rec(seed + i, h=96, w=128) for i in range(4)]
    t = _random_transform(rng, (256, 256), (128, 128), perspective=False)
    full = A.apply_affine(A.mosaic(recs, (128, 128), 128), t)
    x0, y0, x1, y1 = t.source_region((256, 256))
    part = A.apply_affine(A.mosaic(recs, (128, 128), 128, region=(x0, y0, x1, y1)), t.shifted(x0, y0))
    # the same pixels up to fixed-point rounding ties of the shifted matrix
    assert np.count_nonzero(np.abs(part.image.astype(int) - full.image) > 1) == 0
    assert np.count_nonzero(part.image != full.image) <= part.image.size // 500
    np.testing.assert_array_equal(part.classes, full.classes)
    np.testing.assert_allclose(part.boxes, full.boxes, atol=1)


# ------------------------------------------------------------------- axis-aligned fast path (resize)
@given(sx=st.floats(0.3, 2.0), sy=st.floats(0.3, 2.0), tx=st.floats(-150, 150), ty=st.floats(-150, 150),
       h=st.integers(8, 200), w=st.integers(8, 200), H=st.sampled_from([32, 64, 96]), W=st.sampled_from([32, 64, 128]))
def test_resize_plan_is_whole_pixel_and_within_half_a_pixel_of_the_sampled_matrix(sx, sy, tx, ty, h, w, H, W):
    M = np.array([[sx, 0, tx], [0, sy, ty], [0, 0, 1]], np.float64)
    p = A.resize_plan(M, (h, w), (H, W))
    assert p is not None and p.out_shape == (H, W)
    if p.empty:  # nothing visible: the sampled input rectangle misses the output by less than half a pixel
        X0, X1 = tx + 0.5 * (1 - sx), sx * w + tx + 0.5 * (1 - sx)
        Y0, Y1 = ty + 0.5 * (1 - sy), sy * h + ty + 0.5 * (1 - sy)
        assert min(X1, W) - max(X0, 0) < 1 or min(Y1, H) - max(Y0, 0) < 1
        return
    x0, y0, x1, y1 = p.src
    u0, v0, u1, v1 = p.dst
    assert 0 <= x0 < x1 <= w and 0 <= y0 < y1 <= h and 0 <= u0 < u1 <= W and 0 <= v0 < v1 <= H
    E = p.matrix
    assert E[0, 1] == E[1, 0] == 0 and (E[2] == (0, 0, 1)).all()
    # the effective matrix is exactly what cv2.resize implements: crop edges -> rectangle edges (pixel-edge coords)
    edge = lambda m, X, axis: m[axis, axis] * (X - 0.5) + m[axis, 2] + 0.5  # noqa: E731
    np.testing.assert_allclose([edge(E, x0, 0), edge(E, x1, 0), edge(E, y0, 1), edge(E, y1, 1)], [u0, u1, v0, v1],
                               atol=1e-9)
    # and within max(1/2 output px, 1/2 input px) of the sampled one over the visible crop (both are linear)
    for axis, (a0, a1) in ((0, (x0, x1)), (1, (y0, y1))):
        err = max(abs(edge(E, X, axis) - edge(M, X, axis)) for X in (a0, a1))
        assert err <= max(0.5, 0.5 * M[axis, axis]) + 1e-9
    assert A.resize_plan(np.array([[sx, 0.01, tx], [0, sy, ty], [0, 0, 1]]), (h, w), (H, W)) is None
    assert A.resize_plan(np.array([[-sx, 0, tx], [0, sy, ty], [0, 0, 1]]), (h, w), (H, W)) is None
    assert A.resize_plan(np.array([[sx, 0, tx], [0, sy, ty], [1e-4, 0, 1]]), (h, w), (H, W)) is None


@given(seed=SEEDS, s=st.floats(0.5, 1.5), tx=st.floats(-60, 60), ty=st.floats(-60, 60))
def test_resize_plan_pixels_equal_a_warp_with_the_effective_matrix(seed, s, tx, ty):
    rng = np.random.default_rng(seed)
    img = cv2.GaussianBlur(rng.integers(0, 256, (90, 120, 3), dtype=np.uint8), (9, 9), 0)  # smooth: rounding only
    M = np.array([[s, 0, tx], [0, s, ty], [0, 0, 1]], np.float64)
    p = A.resize_plan(M, img.shape[:2], (96, 128))
    got = p.apply_image(img)
    assert got.shape == (96, 128, 3) and got.dtype == np.uint8
    if p.empty:
        assert (got == A.PAD_VALUE).all()
        return
    u0, v0, u1, v1 = p.dst
    outside = np.ones((96, 128), bool)
    outside[v0:v1, u0:u1] = False
    assert (got[outside] == A.PAD_VALUE).all()  # border fill, exactly 114
    want = cv2.warpAffine(img, p.matrix[:2], (128, 96), flags=cv2.INTER_LINEAR, borderMode=cv2.BORDER_REPLICATE)
    inner = (slice(v0, v1), slice(u0, u1))  # warpAffine's 1/32-px coordinates vs resize's 11-bit weights
    assert np.abs(got[inner].astype(int) - want[inner]).max() <= 3
    buf = np.zeros_like(got)
    assert p.apply_image(img, out=buf) is buf and np.array_equal(buf, got)
    # exact geometry, in float: bilinear sampling at E^-1 (u, v) (edge-clamped, as cv2.resize reads its crop)
    imf = rng.uniform(0, 100, img.shape).astype(np.float32)
    x0, y0, x1, y1 = p.src
    vv, uu = np.mgrid[v0:v1, u0:u1].astype(np.float64)
    sx = np.clip((uu - p.matrix[0, 2]) / p.matrix[0, 0], x0, x1 - 1)
    sy = np.clip((vv - p.matrix[1, 2]) / p.matrix[1, 1], y0, y1 - 1)
    ix, iy = np.minimum(np.floor(sx).astype(int), x1 - 2 if x1 - x0 > 1 else x0), np.minimum(np.floor(sy).astype(int), y1 - 2 if y1 - y0 > 1 else y0)
    fx, fy = (sx - ix)[..., None], (sy - iy)[..., None]
    jx, jy = np.minimum(ix + 1, x1 - 1), np.minimum(iy + 1, y1 - 1)
    bil = (imf[iy, ix] * (1 - fx) * (1 - fy) + imf[iy, jx] * fx * (1 - fy) + imf[jy, ix] * (1 - fx) * fy
           + imf[jy, jx] * fx * fy)
    np.testing.assert_allclose(p.apply_image(imf)[inner], bil, atol=1e-3)


@settings(max_examples=30)
@given(seed=SEEDS, use_mosaic=st.booleans())
def test_fast_resize_matches_the_warpaffine_path_within_1px(seed, use_mosaic):
    """The default recipe (axis-aligned): fast path vs cv2.warpAffine of the sampled matrix."""
    recs = [A.load_resized(_rec(seed + i, keypoints=3), 128) for i in range(4)]
    recs = [r._replace(classes=np.arange(len(r.boxes)) + 10 * i) for i, r in enumerate(recs)]  # instance ids
    outs = [A.augment(A.record_rng(seed, 0, 0), recs, 128, A.AugmentConfig(fast_resize=f, hsv_h=0, hsv_s=0, hsv_v=0),
                      use_mosaic=use_mosaic) for f in (True, False)]
    fast, slow = outs
    assert fast.image.shape == slow.image.shape == (128, 128, 3)
    d = np.abs(fast.image.astype(int) - slow.image)
    assert d.mean() < 6 and np.mean(d > 64) < 0.03  # sub-pixel shifts move sharp edges only
    common = np.intersect1d(fast.classes, slow.classes)
    # the box filter may differ only for instances at its thresholds
    assert len(common) >= max(len(fast.classes), len(slow.classes)) - 1
    for c in common:
        i, j = int(np.flatnonzero(fast.classes == c)[0]), int(np.flatnonzero(slow.classes == c)[0])
        np.testing.assert_allclose(fast.boxes[i], slow.boxes[j], atol=1.0 + 1e-4)
        vis = (fast.keypoints[i, :, 2] > 0) & (slow.keypoints[j, :, 2] > 0)
        np.testing.assert_allclose(fast.keypoints[i, vis, :2], slow.keypoints[j, vis, :2], atol=0.75 + 1e-4)
    for box, m in zip(fast.boxes, fast.masks.to_dense((128, 128))):  # still tight around its own mask
        np.testing.assert_allclose(box, _dense_box(m), atol=0)


def test_hsv_in_place_and_scratch_reuse_across_shapes_are_bitwise_the_same():
    rng = np.random.default_rng(3)
    t = A.sample_hsv(rng)
    imgs = [rng.integers(0, 256, shape, dtype=np.uint8) for shape in [(24, 40, 3), (64, 32, 3), (24, 40, 3)]]
    want = [t.apply_image(im.copy()) for im in imgs]
    for im, w in zip(imgs, want):
        keep = im.copy()
        assert np.array_equal(t.apply_image(im), w) and np.array_equal(im, keep)  # input untouched
        buf = im.copy()
        assert t.apply_image(buf, out=buf) is buf and np.array_equal(buf, w)


@pytest.mark.parametrize("horizontal, vertical", [(True, False), (False, True), (True, True), (False, False)])
def test_flip_in_place_equals_the_flipped_copy(horizontal, vertical):
    img = np.random.default_rng(0).integers(0, 256, (17, 23, 3), dtype=np.uint8)
    t = A.FlipTransform((17, 23), horizontal, vertical)
    want = img[::-1 if vertical else 1, ::-1 if horizontal else 1]
    buf = img.copy()
    assert np.array_equal(t.apply_image(img), want)
    assert t.apply_image(buf, out=buf) is buf and np.array_equal(buf, want)


@settings(max_examples=10)
@given(seed=SEEDS, use_mosaic=st.booleans(), rotate=st.booleans())
def test_augment_into_a_given_array_is_bitwise_the_same_and_reuses_no_caller_data(seed, use_mosaic, rotate):
    recs = [A.load_resized(_rec(seed + i, keypoints=3), 128) for i in range(4)]
    before = [r.image.copy() for r in recs]
    cfg = A.AugmentConfig(degrees=10 if rotate else 0, flipud=0.5)
    want = A.augment(A.record_rng(seed, 0, 1), recs, 128, cfg, use_mosaic=use_mosaic)
    slot = np.zeros((2, 128, 128, 3), np.uint8)
    got = A.augment(A.record_rng(seed, 0, 1), recs, 128, cfg, use_mosaic=use_mosaic, out=slot[1])
    assert np.shares_memory(got.image, slot[1]) and not slot[0].any()
    np.testing.assert_array_equal(got.image, want.image)
    np.testing.assert_array_equal(got.boxes, want.boxes)
    for r, b in zip(recs, before):  # the loaded (or cached) records are never written
        np.testing.assert_array_equal(r.image, b)
    again = A.augment(A.record_rng(seed, 0, 1), recs, 128, cfg, use_mosaic=use_mosaic)  # scratch reuse
    np.testing.assert_array_equal(again.image, want.image)


@settings(max_examples=30)
@given(seed=SEEDS, xc=st.integers(64, 192), yc=st.integers(64, 192), s=st.floats(0.5, 1.5),
       tx=st.floats(-20, 20), ty=st.floats(-20, 20))
def test_mosaic_resized_matches_the_canvas_resize(seed, xc, yc, s, tx, ty):
    """The mosaic built straight into the output (each tile resized on its own) against the canvas
    built first and resized as a whole: tiles disjoint, grey elsewhere, pixels differ only along
    seams, the same instances with boxes within 1 px, boxes tight around masks."""
    recs = [A.load_resized(_rec(seed + i, keypoints=3), 128) for i in range(4)]
    recs = [r._replace(classes=np.arange(len(r.boxes)) + 10 * i) for i, r in enumerate(recs)]  # instance ids
    M = np.array([[s, 0, 64 - 128 * s + tx], [0, s, 64 - 128 * s + ty], [0, 0, 1]])
    t = A.AffineTransform(M, (128, 128), s)
    out = np.zeros((128, 128, 3), np.uint8)
    got, rects = A._mosaic_resized(recs, (xc, yc), 128, t, out)
    want = A.apply_affine(A.mosaic(recs, (xc, yc), 128), t)
    covered = np.zeros((128, 128), int)
    for u0, v0, u1, v1 in rects:
        assert 0 <= u0 < u1 <= 128 and 0 <= v0 < v1 <= 128
        covered[v0:v1, u0:u1] += 1
    assert covered.max() <= 1 and (got.image[covered == 0] == A.PAD_VALUE).all()
    d = np.abs(got.image.astype(int) - want.image)
    # each path is within half a pixel of the sampled matrix (each tile rounded on its own here), so up
    # to a pixel from each other: sharp edges of these synthetic textures move, flat areas do not
    assert d.mean() < 8 and np.mean(d > 64) < 0.05
    common = np.intersect1d(got.classes, want.classes)
    assert len(common) >= max(len(got.classes), len(want.classes)) - 1  # box-filter threshold cases only
    for c in common:
        i, j = int(np.flatnonzero(got.classes == c)[0]), int(np.flatnonzero(want.classes == c)[0])
        np.testing.assert_allclose(got.boxes[i], want.boxes[j], atol=1.0 + 1e-4)
        vis = (got.keypoints[i, :, 2] > 0) & (want.keypoints[j, :, 2] > 0)
        np.testing.assert_allclose(got.keypoints[i, vis, :2], want.keypoints[j, vis, :2], atol=1.0 + 1e-4)
    for box, m in zip(got.boxes, got.masks.to_dense((128, 128))):
        np.testing.assert_allclose(box, _dense_box(m), atol=0)


@given(seed=SEEDS, xc=st.integers(64, 192), yc=st.integers(64, 192), tx=st.integers(-128, 0),
       ty=st.integers(-128, 0))
@settings(max_examples=20)
def test_mosaic_resized_at_scale_1_is_the_canvas_crop_bitwise(seed, xc, yc, tx, ty):
    # whole-pixel translation, scale 1: both paths copy pixels, so images and labels are equal
    recs = [A.load_resized(_rec(seed + i, keypoints=3), 128) for i in range(4)]
    t = A.AffineTransform(np.array([[1.0, 0, tx], [0, 1.0, ty], [0, 0, 1]]), (128, 128), 1.0)
    got, _ = A._mosaic_resized(recs, (xc, yc), 128, t, np.zeros((128, 128, 3), np.uint8))
    canvas = A.mosaic(recs, (xc, yc), 128)
    np.testing.assert_array_equal(got.image, canvas.image[-ty:-ty + 128, -tx:-tx + 128])
    want = A.apply_affine(canvas, t)
    np.testing.assert_array_equal(got.image, want.image)
    np.testing.assert_array_equal(got.classes, want.classes)
    np.testing.assert_allclose(got.boxes, want.boxes, atol=1e-4)
    np.testing.assert_allclose(got.keypoints, want.keypoints, atol=1e-4)
    for a, b in zip(got.masks.to_dense((128, 128)), want.masks.to_dense((128, 128))):
        np.testing.assert_array_equal(a, b)
