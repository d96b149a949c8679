"""Properties of the task-aligned assigner over padded targets."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from yolo_func._types import Targets
from yolo_func.assign import assign, make_anchors
from yolo_func.assign.tal import _metrics
from yolo_func.assign.tal_dense import _topk_positives
from yolo_func.structures import pad_targets

ANCHORS = make_anchors([(8, 8), (4, 4), (2, 2)], (8, 16, 32))  # a 64x64 image, A = 84
B, A, K = 2, 84, 3


def _preds(seed):
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(B, A, K, generator=g) * 0.9 + 0.05
    px = ANCHORS.points * ANCHORS.strides
    half = torch.rand(B, A, 2, generator=g) * 20 + 4
    shift = torch.randn(B, A, 2, generator=g) * 3
    return scores, torch.cat((px + shift - half, px + shift + half), -1)


@st.composite
def targets(draw, max_m=6):
    n = [draw(st.integers(0, max_m)) for _ in range(B)]
    M = max(max(n), 1)
    boxes, classes, valid = torch.zeros(B, M, 4), torch.zeros(B, M, dtype=torch.int64), torch.zeros(B, M, dtype=torch.bool)
    for b in range(B):
        for j in range(n[b]):
            x, y = draw(st.floats(0, 56)), draw(st.floats(0, 56))
            w, h = draw(st.floats(2, 64 - x)), draw(st.floats(2, 64 - y))
            boxes[b, j] = torch.tensor([x, y, x + w, y + h])
            classes[b, j] = draw(st.integers(0, K - 1))
            valid[b, j] = True
    return Targets(boxes, classes, valid)


def _same(a, b):
    assert torch.equal(a.fg_mask, b.fg_mask)
    assert torch.equal(torch.where(a.fg_mask, a.gt_idx, 0), torch.where(b.fg_mask, b.gt_idx, 0))
    # Assignments (masks, indices) are exact; scores to float32 rounding: a longer M axis can change
    # the vectorised CIoU kernel's tail handling by an ulp.
    torch.testing.assert_close(a.target_scores, b.target_scores, rtol=1e-6, atol=1e-8)


@settings(max_examples=20)
@given(targets(), st.integers(0, 2**16))
def test_structure_and_padding(t, seed):
    scores, boxes = _preds(seed)
    a = assign(scores, boxes, ANCHORS, t)
    # Every positive anchor has exactly one target: its score sits on that target's class only.
    nonzero = (a.target_scores > 0).sum(-1)
    assert (nonzero <= 1).all() and not (a.target_scores[~a.fg_mask] != 0).any()
    cls = t.classes.gather(1, a.gt_idx)
    assert (a.target_scores.argmax(-1)[nonzero == 1] == cls[nonzero == 1]).all()
    # Positives belong to valid targets only, and their box is that target's box.
    assert t.valid.gather(1, a.gt_idx)[a.fg_mask].all()
    torch.testing.assert_close(a.target_boxes[a.fg_mask], t.boxes.gather(1, a.gt_idx[..., None].expand(B, A, 4))[a.fg_mask])
    assert ((a.target_scores >= 0) & (a.target_scores <= 1)).all()
    # Before conflict resolution each target owns at most topk anchors.
    cand, _, align = _metrics(scores, boxes, ANCHORS.points * ANCHORS.strides, t, alpha=0.5, beta=6.0, eps=1e-9, enlarge_to=16.0)
    assert (_topk_positives(align, cand, t.valid, 10).sum(-1) <= 10).all()
    # Extra padding rows change nothing.
    _same(a, assign(scores, boxes, ANCHORS, pad_targets(t, t.boxes.shape[1] + 5)))


@settings(max_examples=20)
@given(targets(), st.integers(0, 2**16), st.randoms(use_true_random=False))
def test_permutation_equivariance(t, seed, rnd):
    scores, boxes = _preds(seed)
    M = t.boxes.shape[1]
    perm = list(range(M))
    rnd.shuffle(perm)
    perm = torch.tensor(perm)
    tp = Targets(t.boxes[:, perm], t.classes[:, perm], t.valid[:, perm])
    a, ap = assign(scores, boxes, ANCHORS, t), assign(scores, boxes, ANCHORS, tp)
    # Continuous random boxes: no overlap ties between targets, so conflicts resolve the same way.
    assert torch.equal(a.fg_mask, ap.fg_mask)
    inv = torch.argsort(perm)
    assert torch.equal(torch.where(a.fg_mask, a.gt_idx, 0), torch.where(ap.fg_mask, perm[ap.gt_idx], 0))
    torch.testing.assert_close(a.target_scores, ap.target_scores, rtol=1e-6, atol=1e-7)
    del inv


@settings(max_examples=15)
@given(targets(), st.integers(0, 2**16))
def test_invalid_rows_never_assigned(t, seed):
    scores, boxes = _preds(seed)
    # Mark every other real target invalid: those must behave exactly like absent rows.
    drop = t.valid & (torch.arange(t.valid.shape[1]) % 2 == 0)
    t2 = Targets(t.boxes, t.classes, t.valid & ~drop)
    a = assign(scores, boxes, ANCHORS, t2)
    assert not drop.gather(1, a.gt_idx)[a.fg_mask].any()


def test_zero_targets_all_background():
    scores, boxes = _preds(0)
    for M in (0, 4):
        t = Targets(torch.zeros(B, M, 4), torch.zeros(B, M, dtype=torch.int64), torch.zeros(B, M, dtype=torch.bool))
        a = assign(scores, boxes, ANCHORS, t)
        assert not a.fg_mask.any() and a.target_scores.abs().sum() == 0
        assert a.target_scores.shape == (B, A, K) and a.gt_idx.shape == (B, A)


def test_no_gradient():
    scores, boxes = _preds(1)
    scores.requires_grad_(True)
    t = Targets(torch.tensor([[[4.0, 4, 40, 40]], [[10, 10, 50, 30]]]), torch.tensor([[0], [1]]), torch.ones(B, 1, dtype=torch.bool))
    a = assign(scores, boxes, ANCHORS, t)
    assert not a.target_scores.requires_grad and a.fg_mask.any()
