"""Properties of the IoU family and the box <-> distance codecs."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from yolo_func.structures import bbox2dist, bbox_iou, dist2bbox

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
