"""The lean assigner (``assign.tal.assign``) against the dense one (``assign.tal_dense``), bit for bit.

The dense formulation is the assigner as it stood before issue 17 (kept frozen as the second
implementation). The inputs are built to hit every rule that could tell the two apart: ties in
the alignment metric and in top-k (constant or quantised predictions, zero scores, targets with
fewer candidates than k: trap T9), targets claimed by several boxes with equal overlaps (duplicate
boxes: the lowest slot must win), padded rows, images without targets, M = 0, boxes outside the
image, tiny and degenerate boxes, and A < topk.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from yolo_func._types import Targets
from yolo_func.assign import assign, make_anchors
from yolo_func.assign.tal_dense import assign_dense

GRIDS = {
    "64px": make_anchors([(8, 8), (4, 4), (2, 2)], (8, 16, 32)),   # A = 84
    "tiny": make_anchors([(2, 2)], (8,)),                          # A = 4 < topk
    "wide": make_anchors([(4, 12), (2, 6)], (8, 16)),               # 32 x 96, A = 60
}


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32) if x.dtype == torch.float32 else x


def assert_bitwise_equal(new, old, targets):
    for name in ("fg_mask", "gt_idx", "target_boxes", "target_scores"):
        a, b = getattr(new, name), getattr(old, name)
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(_bits(a), _bits(b)), (name, (a != b).nonzero()[:5].tolist())
    # The label the class loss reads (the class of the assigned slot).
    if targets.boxes.shape[1]:
        assert torch.equal(targets.classes.gather(1, new.gt_idx), targets.classes.gather(1, old.gt_idx))


@st.composite
def cases(draw):
    grid = draw(st.sampled_from(sorted(GRIDS)))
    anchors = GRIDS[grid]
    A = anchors.points.shape[0]
    extent = (anchors.points * anchors.strides).amax(0) + 4  # roughly the image (w, h)
    B = draw(st.integers(1, 3))
    M = draw(st.integers(0, 7))
    K = draw(st.integers(1, 4))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    px = anchors.points * anchors.strides

    # Targets, one kind per row.
    boxes = torch.zeros(B, M, 4)
    for b in range(B):
        for j in range(M):
            kind = draw(st.sampled_from(["normal", "normal", "tiny", "outside", "degenerate", "duplicate", "grid"]))
            x1, y1 = (torch.rand(2, generator=g) * extent).tolist()
            w, h = (torch.rand(2, generator=g) * extent * 0.7 + 2).tolist()
            if kind == "tiny":
                w, h = (torch.rand(2, generator=g) * 6 + 0.1).tolist()
            elif kind == "outside":
                x1, y1 = x1 - extent[0].item() * 0.8, y1 + extent[1].item() * 0.5
            elif kind == "degenerate":
                w = 0.0
            elif kind == "grid":  # edges on anchor centres: the strict in-box test at equality
                x1, y1, w, h = 4.0 * round(x1 / 4), 4.0 * round(y1 / 4), 8.0 * round(w / 8 + 1), 8.0 * round(h / 8 + 1)
            if kind == "duplicate" and j > 0:
                boxes[b, j] = boxes[b, draw(st.integers(0, j - 1))]
            else:
                boxes[b, j] = torch.tensor([x1, y1, x1 + w, y1 + h])
    valid = torch.rand(B, M, generator=g) < draw(st.sampled_from([0.0, 0.5, 0.8, 1.0]))
    if B > 1 and draw(st.booleans()):
        valid[draw(st.integers(0, B - 1))] = False  # an image without targets
    classes = torch.randint(0, K, (B, M), generator=g)
    classes = torch.where(valid | draw(st.booleans()), classes, -1)  # padding as the collate writes it, or junk

    # Predictions: continuous, constant (every anchor predicts one box: metric ties everywhere),
    # or quantised (ties among some anchors).
    pred_kind = draw(st.sampled_from(["continuous", "constant", "quantised"]))
    if pred_kind == "constant":
        box = torch.tensor([[0.0, 0.0, 1.0, 1.0]]) * torch.cat((extent, extent)) * torch.rand(1, generator=g)
        pred_boxes = box.expand(B, A, 4).clone()
        scores = torch.full((B, A, K), draw(st.sampled_from([0.0, 0.25, 0.5, 1.0])))
    else:
        half = torch.rand(B, A, 2, generator=g) * extent.max() / 3 + 1
        shift = torch.randn(B, A, 2, generator=g) * 4
        pred_boxes = torch.cat((px + shift - half, px + shift + half), -1)
        scores = torch.rand(B, A, K, generator=g)
        if pred_kind == "quantised":
            pred_boxes = (pred_boxes / 8).round() * 8
            scores = (scores * 4).floor() / 4  # includes exact zeros
    topk = draw(st.sampled_from([1, 3, 10, 13]))
    return scores, pred_boxes, anchors, Targets(boxes, classes, valid), topk


@settings(max_examples=200, deadline=None)
@given(cases())
def test_lean_assigner_equals_dense_bitwise(case):
    scores, pred_boxes, anchors, targets, topk = case
    new = assign(scores, pred_boxes, anchors, targets, topk=topk)
    old = assign_dense(scores, pred_boxes, anchors, targets, topk=topk)
    assert_bitwise_equal(new, old, targets)


def test_cases_reach_the_tie_rules():
    """The strategy really produces the situations the tie rules govern (so the test above can fail)."""
    anchors = GRIDS["64px"]
    A = anchors.points.shape[0]
    # Two identical targets over constant predictions: every candidate anchor is claimed by both
    # with equal overlaps; the lowest slot must win, and top-k must fall on tied metrics.
    box = torch.tensor([8.0, 8.0, 40.0, 40.0])
    targets = Targets(box.expand(1, 2, 4).clone(), torch.tensor([[0, 1]]), torch.ones(1, 2, dtype=torch.bool))
    pred_boxes = torch.tensor([10.0, 10.0, 38.0, 38.0]).expand(1, A, 4).clone()
    scores = torch.full((1, A, 2), 0.5)
    new, old = assign(scores, pred_boxes, anchors, targets), assign_dense(scores, pred_boxes, anchors, targets)
    assert_bitwise_equal(new, old, targets)
    assert new.fg_mask.sum() == 10 and (new.gt_idx[new.fg_mask] == 0).all()   # slot 0 wins the duplicate
    from yolo_func.structures.ciou import ciou
    u = ciou(box, pred_boxes[0, 0]).clamp(min=0)
    # t = t_max for every positive, so its score is t * u_max / (t + 1e-9) = u to float rounding.
    torch.testing.assert_close(new.target_scores[new.fg_mask][:, 0], u.expand(10), rtol=1e-6, atol=0)


def test_an_anchor_goes_to_the_best_overlap_even_when_that_target_did_not_pick_it():
    """Conflict rule over *all* in-box targets (REFERENCE.md §2.3 step 5) on a case built by hand."""
    anchors = make_anchors([(4, 4)], (8,))  # centres 4, 12, 20, 28 on a 32 x 32 image
    # Target 0 and 1 both pick anchor (12, 12) with topk=1 (only candidate with a non-zero score for
    # their class); target 2 covers it too but picks elsewhere; its overlap with the prediction there
    # is the largest, so the anchor goes to target 2.
    boxes = torch.tensor([[[8.0, 8.0, 16.0, 16.0], [6.0, 6.0, 18.0, 18.0], [9.0, 9.0, 24.0, 24.0]]])
    targets = Targets(boxes, torch.tensor([[0, 0, 1]]), torch.ones(1, 3, dtype=torch.bool))
    pred_boxes = torch.tensor([[0.0, 0.0, 8.0, 8.0]]).repeat(1, 16, 1)
    pred_boxes[0, 5] = torch.tensor([9.0, 9.0, 23.0, 23.0])  # anchor 5 = (12, 12)
    scores = torch.zeros(1, 16, 2)
    scores[0, 5, 0] = 0.9
    scores[0, 10, 1] = 0.9  # target 2 (class 1) prefers anchor 10 = (20, 20)
    pred_boxes[0, 10] = torch.tensor([9.0, 9.0, 24.0, 24.0])
    new, old = (f(scores, pred_boxes, anchors, targets, topk=1) for f in (assign, assign_dense))
    assert_bitwise_equal(new, old, targets)
    assert new.fg_mask[0, 5] and new.gt_idx[0, 5] == 2
    assert new.fg_mask[0, 10] and new.gt_idx[0, 10] == 2
    assert int(new.fg_mask.sum()) == 2


def _random_case(seed=0, B=2, M=8, K=3):
    anchors = GRIDS["64px"]
    g = torch.Generator().manual_seed(seed)
    A = anchors.points.shape[0]
    px = anchors.points * anchors.strides
    half = torch.rand(B, A, 2, generator=g) * 16 + 2
    pred_boxes = torch.cat((px - half, px + half), -1) + torch.randn(B, A, 4, generator=g)
    xy = torch.rand(B, M, 2, generator=g) * 48
    wh = torch.rand(B, M, 2, generator=g) * 30 + 2
    valid = torch.rand(B, M, generator=g) < 0.7
    targets = Targets(torch.cat((xy, xy + wh), -1), torch.randint(0, K, (B, M), generator=g), valid)
    return torch.rand(B, A, K, generator=g), pred_boxes, anchors, targets


def test_lean_assigner_makes_fewer_passes_over_B_M_A():
    """The point of the lean selection: fewer kernels over [B, M, A] (counted, not timed)."""
    from yolo_func.testing import count_aten_ops
    scores, pred_boxes, anchors, targets = _random_case()
    B, A, K = scores.shape
    M = targets.boxes.shape[1]
    counts = {}
    for f in (assign, assign_dense):
        with count_aten_ops(min_numel=B * M * A) as c:
            f(scores, pred_boxes, anchors, targets)
        counts[f.__name__] = c.total
    # Measured 2026-12-04: dense 63, lean 48 (3 of them gathers that read A elements of a
    # [B, M, A] tensor); the shared metrics (in-box test, CIoU, alignment) are ~42 in both.
    assert counts["assign"] <= 50, counts
    assert counts["assign"] <= counts["assign_dense"] - 12, counts


@pytest.mark.slow
def test_inductor_compiles_the_lean_assigner():
    """``torch.compile(assign)`` (inductor, CPU) runs and agrees with eager: the same positives,
    slots and boxes on a tie-free random case, scores to float32 rounding (inductor may reorder
    float work, so the compiled variant is not the bitwise default)."""
    case = _random_case(1)
    torch._dynamo.reset()
    compiled = torch.compile(assign, backend="inductor", dynamic=False)
    got, want = compiled(*case), assign(*case)
    assert want.fg_mask.any()
    for name in ("fg_mask", "gt_idx", "target_boxes"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    torch.testing.assert_close(got.target_scores, want.target_scores, rtol=1e-6, atol=1e-7)


@pytest.mark.cuda
def test_lean_equals_dense_on_cuda_at_640_and_under_graph_replay():
    """On the GPU: bitwise equal to the dense assigner at training size (the scatters and the
    argmax run as CUDA kernels there), and a CUDA-graph replay reproduces the eager call."""
    dev = "cuda"
    anchors = make_anchors([(80, 80), (40, 40), (20, 20)], (8, 16, 32))
    g = torch.Generator().manual_seed(3)
    B, M, K, A = 8, 32, 80, 8400
    px = anchors.points * anchors.strides
    half = torch.rand(B, A, 2, generator=g) * 60 + 4
    pred_boxes = (torch.cat((px - half, px + half), -1) + torch.randn(B, A, 4, generator=g) * 4).to(dev)
    scores = torch.rand(B, A, K, generator=g).pow(4).to(dev)
    scores[:, ::7] = 0.0  # zero-metric ties
    wh = torch.rand(B, M, 2, generator=g) * 250 + 2
    xy = torch.rand(B, M, 2, generator=g) * (640 - wh)
    valid = torch.arange(M)[None] < torch.randint(0, 21, (B, 1), generator=g)
    targets = Targets(torch.cat((xy, xy + wh), -1).to(dev), torch.randint(0, K, (B, M), generator=g).to(dev), valid.to(dev))
    anchors = type(anchors)(anchors.points.to(dev), anchors.strides.to(dev))
    new, old = assign(scores, pred_boxes, anchors, targets), assign_dense(scores, pred_boxes, anchors, targets)
    assert new.fg_mask.any()
    assert_bitwise_equal(new, old, targets)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        assign(scores, pred_boxes, anchors, targets)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = assign(scores, pred_boxes, anchors, targets)
    graph.replay()
    torch.cuda.synchronize()
    assert_bitwise_equal(captured, new, targets)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 3), st.integers(1, 9), st.integers(1, 40), st.integers(0, 2**31 - 1), st.booleans())
def test_first_max_index_is_argmax_with_ties_and_nan(b, m, a, seed, nan):
    """The CPU form (``max(1).indices``) picks the same slot as ``argmax(1)``: quantised values
    give many ties (the first maximum wins), and a NaN counts as the maximum."""
    from yolo_func.assign.tal import _first_max_index

    g = torch.Generator().manual_seed(seed)
    x = (torch.rand(b, m, a, generator=g) * 3).floor() / 3  # 4 levels: ties in most columns
    if nan:
        x[torch.rand(b, m, a, generator=g) < 0.05] = float("nan")
    assert torch.equal(_first_max_index(x), x.argmax(1))
    assert torch.equal(_first_max_index(torch.zeros(b, m, a)), torch.zeros(b, a, dtype=torch.int64))
