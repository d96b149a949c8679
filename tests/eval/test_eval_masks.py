"""Mask assembly, cropping and the letterbox undo against hand-computed values."""

from __future__ import annotations

import pytest
import torch

from yolo_func.eval import Detections, Letterbox, clip_detections, masks as M, postprocess, scale_to_original
from yolo_func.models import Inference


def test_crop_rule_is_integer_index_half_open():
    m = torch.ones(1, 4, 5, dtype=torch.bool)
    out = M.crop_masks(m, torch.tensor([[1.5, 0.0, 3.0, 2.0]]))
    want = torch.zeros(1, 4, 5, dtype=torch.bool)
    want[0, 0:2, 2] = True  # columns c with 1.5 <= c < 3 -> {2}; rows r with 0 <= r < 2 -> {0, 1}
    assert torch.equal(out, want)


@pytest.mark.parametrize("batched", [False, True])
def test_crop_of_bool_masks_equals_a_per_pixel_rule(batched):
    """The bool path (two broadcast ANDs) against the rule written per pixel, and against the
    float path (``torch.where``) thresholded; boxes partly outside, empty and fractional; the
    input is not modified."""
    g = torch.Generator().manual_seed(0)
    m = torch.rand(2, 5, 9, 11, generator=g) > 0.3
    b = torch.rand(2, 5, 4, generator=g) * 14 - 2
    b[..., 2:] = b[..., :2] + torch.rand(2, 5, 2, generator=g) * 9
    b[0, 0] = torch.tensor([4.0, 4.0, 4.0, 8.0])  # empty (x1 == x2)
    if not batched:
        m, b = m[0], b[0]
    before = m.clone()
    got = M.crop_masks(m, b)
    assert torch.equal(m, before) and got.dtype == torch.bool
    r = torch.arange(9.0)[:, None]
    c = torch.arange(11.0)[None, :]
    want = torch.zeros_like(m)
    for idx in torch.cartesian_prod(*(torch.arange(n) for n in m.shape[:-2])).reshape(-1, m.dim() - 2):
        i = tuple(idx.tolist())
        x1, y1, x2, y2 = b[i].tolist()
        want[i] = m[i] & (c >= x1) & (c < x2) & (r >= y1) & (r < y2)
    assert torch.equal(got, want)
    assert torch.equal(M.crop_masks(m.float(), b) > 0.5, want)


def test_mask_logits_and_val_masks_hand_computed():
    # Two prototypes: +1 on the left half, +1 on the top half (16x16 input -> 4x4 prototypes).
    p = torch.zeros(2, 4, 4)
    p[0, :, :2] = 1.0
    p[1, :2, :] = 1.0
    coeffs = torch.tensor([[1.0, 0.0], [-1.0, 1.0]])
    logits = M.mask_logits(p, coeffs)
    assert torch.equal(logits[1], p[1] - p[0])
    boxes = torch.tensor([[0.0, 0.0, 16.0, 16.0], [0.0, 0.0, 12.0, 16.0]])  # second: columns < 3 at 4x4
    got = M.masks_val(p, coeffs, boxes, (16, 16))
    want0 = p[0] > 0
    want1 = (p[1] - p[0]) > 0
    want1[:, 3:] = False
    assert torch.equal(got, torch.stack([want0, want1]))
    # Batched form = per-image form.
    assert torch.equal(M.masks_val(p[None], coeffs[None], boxes[None], (16, 16))[0], got)


def test_predict_masks_upsample_then_crop():
    p = torch.ones(1, 2, 2)
    out = M.masks_predict(p, torch.tensor([[1.0]]), torch.tensor([[1.0, 2.0, 5.0, 7.0]]), (8, 8))
    want = torch.zeros(1, 8, 8, dtype=torch.bool)
    want[0, 2:7, 1:5] = True
    assert torch.equal(out, want)


def test_scale_to_original_boxes_keypoints_hand_computed():
    det = Detections(
        torch.tensor([[10.0, 20.0, 30.0, 40.0], [-4.0, 0.0, 300.0, 8.0]]),
        torch.tensor([0.9, 0.5]),
        torch.tensor([1, 0]),
        keypoints=torch.tensor([[[10.0, 20.0, 0.7]], [[0.0, 500.0, 0.1]]]),
    )
    out = scale_to_original(det, orig_shape=(50, 60), gain=2.0, pad=(2.0, 4.0))
    assert out.boxes.tolist() == [[4.0, 8.0, 14.0, 18.0], [0.0, 0.0, 60.0, 2.0]]  # second clipped
    assert out.keypoints.tolist() == [[[4.0, 8.0, pytest.approx(0.7)]], [[0.0, 50.0, pytest.approx(0.1)]]]
    assert torch.equal(out.scores, det.scores) and torch.equal(out.classes, det.classes)
    # Per-axis gains (gain_y, gain_x), as the reference's ratio_pad[0].
    out2 = scale_to_original(det, orig_shape=(50, 60), gain=(2.0, 4.0), pad=(2.0, 4.0))
    assert out2.boxes[0].tolist() == [2.0, 8.0, 7.0, 18.0]
    # clip=False (the validation metric's form): the same affine map, nothing clipped
    raw = scale_to_original(det, orig_shape=(50, 60), gain=2.0, pad=(2.0, 4.0), clip=False)
    assert raw.boxes.tolist() == [[4.0, 8.0, 14.0, 18.0], [-3.0, -2.0, 149.0, 2.0]]
    assert raw.keypoints[..., :2].tolist() == [[[4.0, 8.0]], [[-1.0, 248.0]]]
    # and clipping it afterwards gives the clipped form bit for bit
    again = clip_detections(raw, (50, 60))
    for f in ("boxes", "keypoints", "scores", "classes"):
        assert torch.equal(getattr(again, f), getattr(out, f)), f


def test_rescale_masks_removes_padding():
    # Input 8x8 holding a 4x8 image at gain 1 with 2 rows of padding above and below.
    m = torch.zeros(1, 8, 8, dtype=torch.bool)
    m[0, 2:6, :] = True  # the whole content
    m[0, 0, :] = True  # padding rows must be dropped
    back = M.rescale_masks(m, input_shape=(8, 8), orig_shape=(4, 8), gain=1.0, pad=(0.0, 2.0))
    assert back.shape == (1, 4, 8) and bool(back.all())
    # Same at quarter resolution, original twice as large (gain 0.5): still all of it.
    small = torch.zeros(1, 2, 2, dtype=torch.bool)
    small[0, :, :] = True
    up = M.rescale_masks(small, input_shape=(8, 8), orig_shape=(16, 16), gain=0.5, pad=(0.0, 0.0))
    assert up.shape == (1, 16, 16) and bool(up.all())
    assert M.unpad_region((8, 8), (8, 8), (4, 8), 1.0, (0.0, 2.0)) == (2, 6, 0, 8)


def test_postprocess_with_letterbox_maps_everything_to_the_original():
    # One anchor, one class, segment layout: box (8, 8)-(24, 24) in a 32x32 input that holds a 16x32 image.
    nm = 2
    y = torch.tensor([16.0, 16.0, 16.0, 16.0, 0.9, 1.0, 0.0]).reshape(1, 7, 1)
    protos = torch.ones(1, nm, 8, 8)
    lb = [Letterbox((16, 32), 1.0, (0.0, 8.0))]
    for method in ("predict", "native", "val"):
        (d,) = postprocess(Inference(y, protos), conf=0.5, mask_method=method, letterbox=lb)
        assert d.boxes.tolist() == [[8.0, 0.0, 24.0, 16.0]]
        assert d.masks.shape == (1, 16, 32)
        want = torch.zeros(16, 32, dtype=torch.bool)
        want[0:16, 8:24] = True
        assert torch.equal(d.masks[0], want), method


def test_errors():
    det = Detections(torch.zeros(0, 4), torch.zeros(0), torch.zeros(0, dtype=torch.long))
    with pytest.raises(ValueError, match=r"^\[yolo_func\] gain"):
        scale_to_original(det, orig_shape=(4, 4), gain=0.0, pad=(0, 0))
    with pytest.raises(TypeError, match="Detections"):
        scale_to_original((1, 2), orig_shape=(4, 4), gain=1.0, pad=(0, 0))
    with pytest.raises(ValueError, match="mask_logits"):
        M.mask_logits(torch.zeros(3, 4, 4), torch.zeros(2, 5))


def test_static_val_masks_equal_eager_and_padded_rows_are_empty():
    """``postprocess_static`` masks (batched, ``"val"`` method): the eager batched masks on the real
    rows, nothing on the padded rows (their boxes are zeros, so the crop removes every pixel)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import eval_cases as cases

    from yolo_func.eval import postprocess_static

    y = torch.from_numpy(cases.raw_output(5, batch=3, num_classes=3, extra=32))
    p = torch.from_numpy(cases.protos(5, batch=3))
    kw = dict(conf=0.8, iou=0.6, max_det=200)
    eager = postprocess(Inference(y, p), mask_method="val", **kw)
    static = postprocess_static(Inference(y, p), iters=64, **kw)
    assert bool(static.converged.all()) and static.masks.shape[:2] == (3, 200)
    assert (~static.valid).any() and not static.masks[~static.valid].any()
    for e, s in zip(eager, static.unpad()):
        assert len(e.masks) > 0 and torch.equal(e.masks, s.masks)
