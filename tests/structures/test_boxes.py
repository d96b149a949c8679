"""Properties of the box layouts, the box <-> distance and DFL codecs, and the IoU family."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from yolo_func.structures import (
    bbox2dist, bbox_iou, box_area, clip_boxes, dfl_expectation, dist2bbox, xywh_to_xyxy, xyxy_to_xywh,
)
from yolo_func.testing import boxes_xyxy

coord = st.floats(-100, 100, allow_nan=False)
side = st.floats(0.5, 80, allow_nan=False)


@st.composite
def box_pairs(draw, n=6):
    vals = draw(st.lists(st.tuples(coord, coord, side, side), min_size=2 * n, max_size=2 * n))
    t = torch.tensor(vals, dtype=torch.float64)
    boxes = torch.cat((t[:, :2], t[:, :2] + t[:, 2:]), -1)
    return boxes[:n], boxes[n:]


@settings(max_examples=30)
@given(box_pairs(), st.floats(-50, 50), st.floats(-50, 50), st.floats(0.25, 4.0))
def test_iou_invariants(pair, dx, dy, scale):
    a, b = pair
    iou = bbox_iou(a, b, kind="iou", eps=0.0)
    assert ((iou >= 0) & (iou <= 1)).all()
    torch.testing.assert_close(iou, bbox_iou(b, a, kind="iou", eps=0.0))
    torch.testing.assert_close(bbox_iou(a, a, kind="iou", eps=0.0), torch.ones(len(a), dtype=a.dtype))
    shift = torch.tensor([dx, dy, dx, dy], dtype=a.dtype)
    torch.testing.assert_close(bbox_iou(a + shift, b + shift, kind="iou", eps=0.0), iou, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(bbox_iou(a * scale, b * scale, kind="iou", eps=0.0), iou, rtol=1e-9, atol=1e-9)
    for kind in ("giou", "diou", "ciou"):  # default eps: CIoU's alpha is 0/0 for identical boxes at eps=0
        other = bbox_iou(a, b, kind=kind)
        lower = -1.5 if kind == "ciou" else -1.0  # CIoU adds alpha * v <= 0.5 to DIoU's penalty
        # eps sits on the heights of the union but not on the enclosing area: allow 1e-6.
        assert (other <= bbox_iou(a, b, kind="iou") + 1e-6).all() and (other >= lower).all(), kind
        torch.testing.assert_close(bbox_iou(a, a, kind=kind), torch.ones(len(a), dtype=a.dtype), rtol=0, atol=1e-6)


def test_known_values():
    a, b = torch.tensor([0.0, 0, 2, 2]), torch.tensor([1.0, 1, 3, 3])
    # inter 1, union 7, enclosing 3x3 (area 9, diagonal^2 18), centre distance^2 2.
    torch.testing.assert_close(bbox_iou(a, b, kind="iou", eps=0), torch.tensor(1 / 7))
    torch.testing.assert_close(bbox_iou(a, b, kind="giou", eps=0), torch.tensor(1 / 7 - 2 / 9))
    torch.testing.assert_close(bbox_iou(a, b, kind="diou", eps=0), torch.tensor(1 / 7 - 2 / 18))
    torch.testing.assert_close(bbox_iou(a, b, kind="ciou", eps=0), torch.tensor(1 / 7 - 2 / 18))  # same aspect: v = 0


def test_ciou_alpha_has_no_gradient():
    a = torch.tensor([10.0, 20, 50, 80], requires_grad=True)
    b = torch.tensor([15.0, 25, 60, 70])
    g = torch.autograd.grad(bbox_iou(a, b, kind="ciou"), a)[0]
    # Finite differences of the loss with alpha frozen at its current value.
    with torch.no_grad():
        eps = 1e-7
        w1, h1, w2, h2 = 40, 60 + eps, 45, 45 + eps
        v = (4 / torch.pi**2) * (torch.atan(torch.tensor(w2 / h2)) - torch.atan(torch.tensor(w1 / h1))) ** 2
        alpha = v / (v - bbox_iou(a, b, kind="iou") + 1 + eps)

    def frozen(x):
        iou = bbox_iou(x, b, kind="diou")
        ww, hh = x[2] - x[0], x[3] - x[1] + eps
        vv = (4 / torch.pi**2) * (torch.atan(torch.tensor(w2 / h2)) - torch.atan(ww / hh)) ** 2
        return iou - vv * alpha

    g2 = torch.autograd.grad(frozen(a), a)[0]
    torch.testing.assert_close(g, g2, rtol=1e-4, atol=1e-7)


def test_bad_kind():
    with pytest.raises(ValueError, match="kind"):
        bbox_iou(torch.zeros(4), torch.zeros(4), kind="siou")


@settings(max_examples=30)
@given(st.lists(st.tuples(coord, coord, st.floats(0, 14.9), st.floats(0, 14.9),
                          st.floats(0, 14.9), st.floats(0, 14.9)), min_size=1, max_size=8))
def test_codec_round_trip(rows):
    t = torch.tensor(rows, dtype=torch.float64)
    pts, dist = t[:, :2], t[:, 2:]
    boxes = dist2bbox(dist, pts)
    torch.testing.assert_close(bbox2dist(pts, boxes, 15), dist, rtol=1e-9, atol=1e-9)
    xywh = dist2bbox(dist, pts, xywh=True)
    torch.testing.assert_close(xywh[:, 2:], boxes[:, 2:] - boxes[:, :2])


@given(st.lists(st.tuples(coord, coord, st.floats(0, 14.9), st.floats(0, 14.9),
                          st.floats(0, 14.9), st.floats(0, 14.9)), min_size=1, max_size=8))
def test_codec_round_trip_float32_and_broadcast(rows):
    """float32 as the loss runs it, anchors [A, 2] broadcast against distances [B, A, 4]."""
    t = torch.tensor(rows, dtype=torch.float32)
    pts, dist = t[:, :2], torch.stack((t[:, 2:], t[:, 2:].flip(-1)))  # [2, A, 4]
    boxes = dist2bbox(dist, pts)
    assert boxes.shape == dist.shape
    # corners are the anchor minus left/top and plus right/bottom (hand-computed)
    torch.testing.assert_close(boxes[..., :2], pts - dist[..., :2], rtol=0, atol=0)
    torch.testing.assert_close(boxes[..., 2:], pts + dist[..., 2:], rtol=0, atol=0)
    # |coordinates| <= 115: float32 round trip within a few ulps of 128
    torch.testing.assert_close(bbox2dist(pts, boxes, 15), dist, rtol=0, atol=3e-5)


@given(st.lists(st.tuples(coord, coord, coord, coord), min_size=1, max_size=8), st.floats(1.0, 30.0))
def test_bbox2dist_stays_in_the_bin_range(rows, reg_max):
    """Any box, even one not around its anchor, encodes to distances in [0, reg_max - 0.01]."""
    t = torch.tensor(rows, dtype=torch.float64)
    boxes = torch.cat((torch.minimum(t[:, :2], t[:, 2:]), torch.maximum(t[:, :2], t[:, 2:])), -1)
    d = bbox2dist(t[:, :2] * 0.5, boxes, reg_max)
    assert (d >= 0).all() and (d <= reg_max - 0.01 + 1e-12).all()


@given(boxes_xyxy(n=st.integers(1, 6), image_size=(96, 160)))
def test_layout_round_trip_and_clip(boxes):
    torch.testing.assert_close(xywh_to_xyxy(xyxy_to_xywh(boxes)), boxes, rtol=0, atol=1e-5)
    w, h = boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1]
    torch.testing.assert_close(xyxy_to_xywh(boxes)[:, 2:], torch.stack((w, h), -1), rtol=0, atol=0)
    torch.testing.assert_close(box_area(boxes), w * h, rtol=0, atol=0)
    # boxes inside the image are unchanged by clipping; shifted ones land inside and lose area
    assert torch.equal(clip_boxes(boxes, (96, 160)), boxes)
    moved = boxes + torch.tensor([100.0, -50.0, 100.0, -50.0])
    clipped = clip_boxes(moved, (96, 160))
    assert (clipped[:, 0::2] >= 0).all() and (clipped[:, 0::2] <= 160).all()
    assert (clipped[:, 1::2] >= 0).all() and (clipped[:, 1::2] <= 96).all()
    assert (box_area(clipped) <= box_area(moved)).all()
    assert torch.equal(clip_boxes(clipped, (96, 160)), clipped)  # idempotent


@given(st.integers(0, 2**31 - 1), st.sampled_from([4, 16]), st.floats(-20.0, 20.0))
def test_dfl_expectation_range_and_shift_invariance(seed, reg_max, shift):
    logits = torch.randn(3, 5, 4 * reg_max, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 4
    d = dfl_expectation(logits, reg_max)
    assert d.shape == (3, 5, 4)
    assert (d >= 0).all() and (d <= reg_max - 1).all()
    # softmax per side: adding one constant to all bins of every side changes nothing
    torch.testing.assert_close(dfl_expectation(logits + shift, reg_max), d, rtol=1e-12, atol=1e-12)
    # the expectation written out: sum_j j * exp(l_j) / sum_k exp(l_k)
    p = logits.reshape(3, 5, 4, reg_max).softmax(-1)
    torch.testing.assert_close(d, (p * torch.arange(reg_max, dtype=torch.float64)).sum(-1), rtol=1e-12, atol=1e-12)


@given(box_pairs())
def test_iou_family_symmetric_and_bounded(pair):
    a, b = pair
    for kind in ("iou", "giou", "diou", "ciou"):
        torch.testing.assert_close(bbox_iou(a, b, kind=kind), bbox_iou(b, a, kind=kind), rtol=1e-12, atol=1e-12)
    iou, giou = bbox_iou(a, b, kind="iou"), bbox_iou(a, b, kind="giou")
    assert ((iou >= 0) & (iou <= 1)).all()
    # eps sits on the union's heights but not on the enclosing area: GIoU may pass IoU by ~2 eps
    assert (giou <= iou + 1e-6).all() and (giou >= -1).all()


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: dist2bbox(torch.zeros(3, 5), torch.zeros(3, 2)), r"dist2bbox: distance: expected float\[\.\.\., 4\], got shape \(3, 5\)"),
        (lambda: dist2bbox(torch.zeros(3, 4), torch.zeros(3, 3)), r"dist2bbox: anchor_points must be float\[\.\.\., 2\], got shape \(3, 3\)"),
        (lambda: bbox2dist(torch.zeros(3, 2), torch.zeros(3, 5), 15), r"bbox2dist: bbox: expected float\[\.\.\., 4\], got shape \(3, 5\)"),
        (lambda: dfl_expectation(torch.zeros(2, 60), 16), r"dfl_expectation: box_dist must be float\[\.\.\., 4\*reg_max=64\], got shape \(2, 60\)"),
    ],
)
def test_codec_shape_errors_name_the_function_and_argument(call, message):
    with pytest.raises(ValueError, match=r"^\[yolo_func\] " + message):
        call()
