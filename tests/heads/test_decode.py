"""Anchors and inference decoding against hand-computed values (REFERENCE.md §1.5-1.8)."""

import pytest
import torch

from yolo_func._types import DetectPreds
from yolo_func.assign import make_anchors
from yolo_func.heads import decode_detect, decode_keypoints
from yolo_func.losses import bbox2dist, dfl_expectation, dist2bbox


def test_anchor_layout():
    a = make_anchors([(2, 3), (1, 2)], (8, 16))
    assert a.points.shape == (8, 2) and a.strides.shape == (8, 1)
    # level-major, then row-major (y outer, x inner), cell centres
    assert a.points[:6].tolist() == [[0.5, 0.5], [1.5, 0.5], [2.5, 0.5], [0.5, 1.5], [1.5, 1.5], [2.5, 1.5]]
    assert a.points[6:].tolist() == [[0.5, 0.5], [1.5, 0.5]]
    assert a.strides.flatten().tolist() == [8.0] * 6 + [16.0] * 2
    assert make_anchors([(80, 80), (40, 40), (20, 20)], (8, 16, 32)).points.shape[0] == 8400


def test_dfl_expectation_of_one_hot_bins_is_the_bin_index():
    logits = torch.full((1, 1, 64), -1e4)
    for side, b in enumerate((0, 3, 15, 7)):
        logits[0, 0, side * 16 + b] = 1e4
    assert dfl_expectation(logits).tolist() == [[[0.0, 3.0, 15.0, 7.0]]]


def test_codecs_round_trip_inside_the_clamp():
    pts = torch.tensor([[4.5, 6.5]])
    box = torch.tensor([[1.0, 2.0, 10.0, 9.0]])
    d = bbox2dist(pts, box, 15)
    assert d.tolist() == [[3.5, 4.5, 5.5, 2.5]]
    assert torch.equal(dist2bbox(d, pts), box)
    assert dist2bbox(d, pts, xywh=True).tolist() == [[5.5, 5.5, 9.0, 7.0]]
    assert torch.equal(bbox2dist(pts, torch.tensor([[-30.0, 2.0, 10.0, 40.0]]), 15), torch.tensor([[14.99, 4.5, 5.5, 14.99]]))


def test_decode_detect_by_hand():
    anchors = make_anchors([(1, 2)], (8,))
    box = torch.full((1, 2, 64), -1e4)
    for side, b in enumerate((1, 2, 3, 4)):  # ltrb = 1, 2, 3, 4 grid units
        box[0, :, side * 16 + b] = 1e4
    cls = torch.tensor([[[0.0], [2.0]]])
    y = decode_detect(DetectPreds(box, cls), anchors)
    # anchor (0.5, 0.5): x1 = -0.5, y1 = -1.5, x2 = 3.5, y2 = 4.5 -> cx 1.5, cy 1.5, w 4, h 6, x stride 8
    assert y.shape == (1, 5, 2)
    assert y[0, :4, 0].tolist() == [12.0, 12.0, 32.0, 48.0]
    assert y[0, :4, 1].tolist() == [20.0, 12.0, 32.0, 48.0]
    torch.testing.assert_close(y[0, 4], torch.sigmoid(cls[0, :, 0]))


def test_decode_keypoints_by_hand():
    anchors = make_anchors([(1, 2)], (16,))
    raw = torch.tensor([[[0.25, -0.5, 0.0], [1.0, 0.0, 2.0]]])  # one keypoint per anchor
    out = decode_keypoints(raw, anchors, (1, 3))
    # x = (2 raw_x + ax - 0.5) * s
    assert out[0, :2, 0].tolist() == [(0.5 + 0.0) * 16, (-1.0 + 0.0) * 16]
    assert out[0, :2, 1].tolist() == [(2.0 + 1.0) * 16, (0.0 + 0.0) * 16]
    torch.testing.assert_close(out[0, 2], torch.sigmoid(torch.tensor([0.0, 2.0])))
    assert decode_keypoints(raw[..., :2], anchors, (1, 2)).shape == (1, 2, 2)


def _meshgrid_anchors(sizes, strides, dtype, offset=0.5):
    """Second implementation: a meshgrid of ``arange(W) + offset`` and ``arange(H) + offset`` per level."""
    points, st = [], []
    for (h, w), s in zip(sizes, strides):
        sx = torch.arange(w, dtype=dtype) + offset
        sy = torch.arange(h, dtype=dtype) + offset
        gy, gx = torch.meshgrid(sy, sx, indexing="ij")
        points.append(torch.stack((gx, gy), -1).view(-1, 2))
        st.append(torch.full((h * w, 1), float(s), dtype=dtype))
    return torch.cat(points), torch.cat(st)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("sizes", [[(1, 1)], [(2, 3), (1, 2)], [(80, 80), (40, 40), (20, 20)], [(3, 400), (300, 2)]])
def test_make_anchors_equals_a_meshgrid_bitwise(dtype, sizes):
    """Bitwise the per-level meshgrid values (also where a half type rounds the larger indices)."""
    strides = tuple(8 * 2 ** k for k in range(len(sizes)))
    for offset in (0.5, 0.0):
        a = make_anchors(sizes, strides, dtype=dtype, offset=offset)
        points, st = _meshgrid_anchors(sizes, strides, dtype, offset)
        assert a.points.dtype == dtype and a.strides.dtype == dtype
        assert torch.equal(a.points, points) and torch.equal(a.strides, st)
