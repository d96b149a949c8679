"""REFERENCE.md §2.8 golden values (recorded from the reference), rtol 1e-5."""

from __future__ import annotations

import math

import pytest
import torch

from yolo_func._types import DetectPreds, PosePreds, SegmentPreds, Targets
from yolo_func.assign import assign, assign_from_detect, make_anchors
from yolo_func.losses import bbox_iou, detect_loss, dfl_loss, pose_loss, segment_loss
from yolo_func.structures import targets_from_flat

R = dict(rtol=1e-5, atol=1e-6)


def synth(shape, a, b, c):
    t = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
    return torch.sin(a * t) * b + c


def test_ciou_golden():
    b1, b2 = torch.tensor([10.0, 20, 50, 80]), torch.tensor([15.0, 25, 60, 70])
    torch.testing.assert_close(bbox_iou(b1, b2, kind="ciou"), torch.tensor(0.5418472), **R)
    torch.testing.assert_close(bbox_iou(b1, b2, kind="iou"), torch.tensor(0.5526316), **R)


@pytest.mark.parametrize("target,expected", [(3.7, 4.451334), (15.5, 1.440667)])
def test_dfl_golden(target, expected):
    logits = torch.linspace(-2, 2, 16).repeat(4)  # the same bins on all four sides
    out = dfl_loss(logits, torch.full((4,), target))
    torch.testing.assert_close(out, torch.tensor(expected), **R)


def _assigner_setup():
    anchors = make_anchors([(8, 8), (4, 4), (2, 2)], (8, 16, 32))
    k = torch.arange(84 * 3).reshape(84, 3)
    scores = (0.1 + 0.8 * ((7 * k) % 10) / 10).float()[None]
    return anchors, scores, anchors.points * anchors.strides


def test_assigner_a_golden():
    anchors, scores, px = _assigner_setup()
    boxes = torch.cat((px - 12, px + 12), -1)[None]
    t = Targets(torch.tensor([[[4.0, 4, 36, 30], [20, 16, 60, 60]]]), torch.tensor([[1, 0]]), torch.tensor([[True, True]]))
    a = assign(scores, boxes, anchors, t)
    pos = [9, 10, 11, 17, 18, 19, 26, 28, 29, 35, 36, 37, 38, 44, 45, 65, 69, 74, 80, 83]
    gts = [0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 1, 0, 1]
    sc = [0.012968, 0.111161, 0.014648, 0.029377, 0.261215, 0.034522, 0.001544, 0.203441, 0.214156, 0.029398,
          0.305736, 0.326140, 0.035765, 0.219221, 0.239190, 0.005531, 0.030503, 0.282919, 0.682248, 0.103892]
    assert a.fg_mask[0].nonzero().flatten().tolist() == pos
    assert a.gt_idx[0, pos].tolist() == gts
    # The soft score sits on the assigned target's class only.
    cls = torch.tensor([1, 0])[torch.tensor(gts)]
    torch.testing.assert_close(a.target_scores[0, pos, cls], torch.tensor(sc), rtol=0, atol=6e-7)
    torch.testing.assert_close(a.target_scores.sum(), torch.tensor(3.143576), **R)
    torch.testing.assert_close(a.target_boxes[0, pos], t.boxes[0, torch.tensor(gts)])


def test_assigner_b_tiny_golden():
    anchors, scores, px = _assigner_setup()
    boxes = torch.cat((px - 3, px + 3), -1)[None]
    t = Targets(torch.tensor([[[10.0, 10, 14, 13]]]), torch.tensor([[2]]), torch.tensor([[True]]))
    from yolo_func.assign.tal import _in_box

    cand = _in_box(px, t.boxes, t.valid, 16.0, 1e-9)
    assert cand[0, 0].nonzero().flatten().tolist() == [1, 9, 64, 80]
    a = assign(scores, boxes, anchors, t, topk=1)
    assert a.fg_mask[0].nonzero().flatten().tolist() == [9]
    torch.testing.assert_close(a.target_scores[0, 9, 2], torch.tensor(0.329762), rtol=0, atol=6e-7)


def _full_setup(task):
    anchors = make_anchors([(16, 16), (8, 8), (4, 4)], (8, 16, 32))
    nc = 1 if task == "pose" else 3
    dp = DetectPreds(synth([2, 64, 336], 0.37, 2.0, 1.0).transpose(1, 2), synth([2, nc, 336], 0.23, 3.0, -2.0).transpose(1, 2))
    xywh = torch.tensor([[40.0, 34, 64, 52], [80, 76, 80, 88], [64, 64, 100, 90]]) / 128
    cls = torch.zeros(3) if task == "pose" else torch.tensor([1.0, 0, 2])
    kw = {}
    if task == "segment":
        masks = torch.zeros(2, 32, 32)
        masks[0, 3:14, 4:16] = 1
        masks[0, 9:30, 11:30] = 2
        masks[1, 10:25, 8:26] = 1
        kw["masks"] = masks
    if task == "pose":
        i, j = torch.arange(3.0)[:, None], torch.arange(17.0)[None]
        x = xywh[:, :1] + torch.cos(j + i) * 0.4 * xywh[:, 2:3]
        y = xywh[:, 1:2] + torch.sin(2 * j + i) * 0.4 * xywh[:, 3:4]
        v = torch.where((j + i) % 3 == 0, 0.0, 2.0)
        kw["keypoints"] = torch.stack((x, y, v), -1)
    t = targets_from_flat(torch.tensor([0.0, 0, 1]), cls, xywh, batch_size=2, image_size=(128, 128), **kw)
    return dp, t, assign_from_detect(dp, t, anchors), nc


def test_detect_golden():
    dp, t, a, nc = _full_setup("detect")
    total, parts = detect_loss(num_classes=nc)(dp, t, a)
    vec = torch.stack([parts["box"], parts["cls"], parts["dfl"]]) * 2
    torch.testing.assert_close(vec, torch.tensor([7.542442, 78.60987, 10.616846]), **R)
    torch.testing.assert_close(total, vec.sum(), **R)
    torch.testing.assert_close(parts["box"], torch.tensor(3.771221), **R)


def test_segment_golden():
    dp, t, a, nc = _full_setup("segment")
    sp = SegmentPreds(synth([2, 32, 336], 0.07, 1.0, 0).transpose(1, 2), synth([2, 32, 32, 32], 0.11, 1.0, 0))
    _, dparts = detect_loss(num_classes=nc)(dp, t, a)
    total, parts = segment_loss()(sp, t, a)
    vec = torch.stack([dparts["box"], parts["seg"], dparts["cls"], dparts["dfl"]]) * 2
    torch.testing.assert_close(vec, torch.tensor([7.542442, 10.969585, 78.60987, 10.616846]), **R)
    torch.testing.assert_close(parts["seg"], torch.tensor(5.484793), **R)
    torch.testing.assert_close(total, parts["seg"] * 2, **R)


def test_pose_golden():
    dp, t, a, nc = _full_setup("pose")
    pp = PosePreds(synth([2, 51, 336], 0.05, 0.5, 0).transpose(1, 2))
    _, d = detect_loss(num_classes=nc)(dp, t, a)
    total, p = pose_loss(kpt_shape=(17, 3))(pp, t, a)
    vec = torch.stack([d["box"], p["pose"], p["kobj"], d["cls"], d["dfl"]]) * 2
    torch.testing.assert_close(vec, torch.tensor([7.692112, 21.130077, 1.474198, 26.699116, 11.219818]), **R)
    torch.testing.assert_close(total, (p["pose"] + p["kobj"]) * 2, **R)
