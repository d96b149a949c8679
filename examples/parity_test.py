"""Property-based parity tests, written as a user would: two implementations, random inputs from
``yolo_func.testing``'s hypothesis strategies, compared leaf by leaf with its pytree asserts.

    python -m pytest -q examples/parity_test.py          # CPU, ~20 s

Each test pits a fast implementation against an independent one: a vectorised function against a
plain loop over Python floats, a batched forward against per-image forwards. When a property fails,
hypothesis shrinks the input to a small counterexample and prints it (with ``print_blob`` the blob
that replays it: ``@reproduce_failure(...)``).
"""

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from yolo_func import yolov8
from yolo_func.assign.anchors import make_anchors
from yolo_func.assign.tal import assign
from yolo_func.structures.boxes import bbox_iou
from yolo_func.testing import (
    assert_shape,
    assert_trees_all_close,
    boxes_xyxy,
    generators,
    images,
    padded_targets,
)

from custom_head import centerness_targets  # the vectorised function under test (examples/custom_head.py)

# derandomize: the same examples on every run (CI); deadline None: the first call of a model is slow
CI = settings(max_examples=20, deadline=None, derandomize=True, print_blob=True)


def iou_loop(a: list[float], b: list[float]) -> float:
    """IoU of two xyxy boxes with Python floats: the textbook formula, nothing shared with yolo_func."""
    iw = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    ih = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = iw * ih
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union


@CI
@given(a=boxes_xyxy(n=6, image_size=(64, 96)), b=boxes_xyxy(n=6, image_size=(64, 96)))
def test_bbox_iou_matches_the_textbook_formula(a, b):
    got = bbox_iou(a.double(), b.double(), kind="iou", eps=0.0)  # float[6], elementwise
    want = torch.tensor([iou_loop(x, y) for x, y in zip(a.tolist(), b.tolist())], dtype=torch.float64)
    assert_trees_all_close(got, want, rtol=1e-12, atol=1e-12)


@CI
@given(targets=padded_targets(batch=2, max_boxes=4, num_classes=3, image_size=(64, 64)), gen=generators())
def test_centerness_targets_match_a_loop(targets, gen):
    anchors = make_anchors([(8, 8), (4, 4), (2, 2)], (8, 16, 32))  # a 64 x 64 input: A = 84
    scores = torch.rand(2, 84, 3, generator=gen)  # random predictions drive the assignment
    xy = torch.rand(2, 84, 2, generator=gen) * 48
    boxes = torch.cat([xy, xy + 4 + torch.rand(2, 84, 2, generator=gen) * 12], -1)
    assignment = assign(scores, boxes, anchors, targets)
    got = centerness_targets(assignment)
    assert_shape(got, (2, 84))
    want = torch.zeros(2, 84)
    centres = (anchors.points * anchors.strides).tolist()
    for b in range(2):
        for i, (cx, cy) in enumerate(centres):
            if assignment.fg_mask[b, i]:
                x1, y1, x2, y2 = assignment.target_boxes[b, i].tolist()
                l, t, r, bt = (max(v, 1e-6) for v in (cx - x1, cy - y1, x2 - cx, y2 - cy))
                want[b, i] = math.sqrt(min(l, r) / max(l, r) * min(t, bt) / max(t, bt))
    assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)


MODEL = yolov8("n", num_classes=3)


@settings(CI, max_examples=4)
@given(x=images(batch=st.integers(2, 3), height=st.sampled_from([32, 64]), width=st.sampled_from([32, 64])),
       gen=generators())
def test_batched_predict_equals_per_image_predict(x, gen):
    params, state = MODEL.init(gen)
    with torch.no_grad():
        batched = MODEL.predict(params, state, x).y  # eval mode: BN uses its running statistics
        alone = torch.cat([MODEL.predict(params, state, x[i:i + 1]).y for i in range(len(x))])
    assert_trees_all_close(batched, alone, rtol=1e-4, atol=1e-4)
