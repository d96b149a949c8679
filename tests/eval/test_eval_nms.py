"""NMS and candidate selection against a brute-force greedy O(n^2) implementation (hypothesis).

Integer box coordinates keep every IoU exact in float64, so boxes sitting exactly on the threshold,
exact duplicates and tied scores are all exercised; the tie rule is: rank by score descending,
then by row index (rows numbered anchor-major, then class).
"""

from __future__ import annotations

import sys
from pathlib import Path

import hypothesis.strategies as st
import numpy as np
import pytest
import torch
from hypothesis import given, settings

from yolo_func.eval import postprocess, postprocess_static
from yolo_func.eval.nms import nms_sorted
from yolo_func.models import Inference
from yolo_func.testing import assert_trees_all_equal

sys.path.insert(0, str(Path(__file__).resolve().parent))
import eval_cases as cases  # noqa: E402


def iou_py(a, b) -> float:
    """torchvision's formula in Python floats (same operation order as ours)."""
    area_a = (a[2] - a[0]) * (a[3] - a[1])
    area_b = (b[2] - b[0]) * (b[3] - b[1])
    w = max(min(a[2], b[2]) - max(a[0], b[0]), 0.0)
    h = max(min(a[3], b[3]) - max(a[1], b[1]), 0.0)
    inter = w * h
    union = area_a + area_b - inter
    return inter / union if union else float("nan")


def greedy(boxes, order, thr, max_det, same_group=lambda i, j: True) -> list[int]:
    """Brute-force greedy NMS over candidates visited in ``order``."""
    keep: list[int] = []
    for i in order:
        if all(not (same_group(i, j) and iou_py(boxes[i], boxes[j]) > thr) for j in keep):
            keep.append(i)
            if len(keep) == max_det:
                break
    return keep


def int_boxes(n: int):
    coord = st.integers(0, 12)
    size = st.integers(1, 8)
    box = st.tuples(coord, coord, size, size).map(lambda t: (t[0], t[1], t[0] + t[2], t[1] + t[3]))
    return st.lists(box, min_size=n, max_size=n)


@settings(parent=settings.get_profile("ci"))
@given(
    data=st.data(),
    n=st.integers(0, 40),
    thr=st.sampled_from([0.0, 0.25, 0.5, 0.7, 1.0]),
    max_det=st.integers(1, 12),
    block=st.sampled_from([1, 3, 7, 64]),
)
def test_nms_sorted_equals_brute_force(data, n, thr, max_det, block):
    boxes = data.draw(int_boxes(n))
    valid = data.draw(st.lists(st.booleans(), min_size=n, max_size=n))
    order = [i for i in range(n) if valid[i]]
    want = greedy(boxes, order, thr, max_det)
    bt = torch.tensor(boxes, dtype=torch.float64).reshape(1, n, 4)
    vt = torch.tensor(valid, dtype=torch.bool).reshape(1, n)
    for iters in (None, max(n, 1)):  # eager, and static with enough passes (>= N) to be exact
        res = nms_sorted(bt, vt, iou=thr, max_det=max_det, block=block, iters=iters)
        assert res.index[0, : int(res.count[0])].tolist() == want, iters
        assert res.valid[0].tolist() == [i < len(want) for i in range(max_det)]
        assert bool(res.converged.all())


@settings(parent=settings.get_profile("ci"))
@given(
    data=st.data(),
    B=st.integers(1, 3),
    n=st.integers(0, 40),
    thr=st.sampled_from([0.0, 0.25, 0.5, 0.7]),
    max_det=st.integers(1, 12),
    block=st.sampled_from([1, 5, 64]),
    iters=st.integers(1, 6),
    hidden=st.integers(0, 3),
)
def test_static_nms_converged_flag_is_sound(data, B, n, thr, max_det, block, iters, hidden):
    """Any pass count and any truncation: where ``converged`` is True the result IS the greedy answer
    (of the full candidate list, of which ``boxes`` holds the first n ranks); with passes >= n and
    nothing hidden it is always True. Tied / duplicate boxes (small integer grid) give long chains."""
    coord, size = st.integers(0, 10), st.integers(1, 6)
    full, valid = [], []
    for _ in range(B):  # n shown + `hidden` more candidates, valid after the shown ones
        bx = data.draw(st.lists(st.tuples(coord, coord, size, size), min_size=n + hidden, max_size=n + hidden))
        full.append([(x, y, x + w, y + h) for x, y, w, h in bx])
        valid.append(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)))
    bt = torch.tensor([f[:n] for f in full], dtype=torch.float64).reshape(B, n, 4)
    vt = torch.tensor(valid, dtype=torch.bool).reshape(B, n)
    total = vt.sum(1) + hidden
    res = nms_sorted(bt, vt, iou=thr, max_det=max_det, block=block, iters=iters, total=total)
    exact = nms_sorted(bt, vt, iou=thr, max_det=max_det, block=block, iters=max(n, 1))
    assert bool(exact.converged.all())
    for b in range(B):
        order = [i for i in range(n) if valid[b][i]] + list(range(n, n + hidden))
        want = greedy(full[b], order, thr, max_det)
        assert exact.index[b, : int(exact.count[b])].tolist() == greedy(full[b], order[: len(order) - hidden], thr, max_det)
        if bool(res.converged[b]):
            assert res.index[b, : int(res.count[b])].tolist() == want
            assert res.valid[b].tolist() == [i < len(want) for i in range(max_det)]
        if hidden == 0 and iters >= n:
            assert bool(res.converged[b])


def test_static_nms_op_count_does_not_depend_on_the_data():
    """The static form dispatches the same ops whatever the boxes (no data-dependent shape or early
    exit), and few kernels: ceil(N / block) IoU groups of ~22, 5 per Jacobi pass, a fixed tail
    (views, which launch nothing, not counted)."""
    from yolo_func.testing import count_aten_ops

    views = {"unsqueeze", "slice", "select", "alias", "expand", "view", "t", "transpose", "unbind", "as_strided",
             "_unsafe_view", "permute", "squeeze"}

    g = torch.Generator().manual_seed(0)
    counts = []
    for spread in (2.0, 500.0):  # heavy overlap (long chains) vs none
        xy = torch.rand(2, 300, 2, generator=g) * spread
        boxes = torch.cat([xy, xy + 10], -1)
        valid = torch.rand(2, 300, generator=g) > 0.3
        with count_aten_ops() as c:
            nms_sorted(boxes, valid, iou=0.5, max_det=50, block=128, iters=6)
        counts.append(sum(k for op, k in c.by_op.items() if op.split(".")[1] not in views))
    assert counts[0] == counts[1]
    assert counts[0] <= 3 * 24 + 5 * (6 + 1) + 30, counts


@settings(parent=settings.get_profile("ci"))
@given(data=st.data(), B=st.integers(1, 3), R=st.integers(1, 50), n=st.integers(1, 50))
def test_ranked_rows_is_a_stable_descending_sort_cut_at_n(data, B, R, n):
    from yolo_func.eval.postprocess import _ranked_rows

    n = min(n, R)
    vals = st.sampled_from([0.0, 1e-45, 1e-3, 0.25, 0.5, 0.5 + 2**-24, 1.0, 3e38, float("inf")])
    key = torch.tensor(data.draw(st.lists(vals, min_size=B * R, max_size=B * R)), dtype=torch.float32).reshape(B, R)
    want = [sorted(range(R), key=lambda i: (-float(key[b, i]), i))[:n] for b in range(B)]
    assert _ranked_rows(key, n).tolist() == want  # the packed int64 top-k (keys >= 0)
    assert _ranked_rows(key.double(), n).tolist() == want  # the top-k + stable-sort path
    neg = key.double().masked_fill(key == 0, -float("inf"))  # any order for the float64 path
    assert _ranked_rows(neg, n).tolist() == want


def brute_postprocess(y: np.ndarray, *, conf, iou, max_det, multi_label, agnostic, cap):
    """Reference rules written plainly: rows, stable rank, cap, class-aware greedy NMS."""
    out = []
    K = y.shape[1] - 4
    for img in y.transpose(0, 2, 1).astype(np.float64):
        rows = []  # (score, row index, box, class)
        for a, r in enumerate(img):
            box = (r[0] - r[2] / 2, r[1] - r[3] / 2, r[0] + r[2] / 2, r[1] + r[3] / 2)
            if multi_label and K > 1:
                rows += [(r[4 + k], a * K + k, box, k) for k in range(K) if r[4 + k] > conf]
            else:
                k = int(np.argmax(r[4:]))
                if r[4 + k] > conf:
                    rows.append((r[4 + k], a, box, k))
        rows.sort(key=lambda t: (-t[0], t[1]))
        rows = rows[:cap]
        same = (lambda i, j: True) if agnostic else (lambda i, j: rows[i][3] == rows[j][3])
        keep = greedy([t[2] for t in rows], range(len(rows)), iou, max_det, same)
        out.append([(rows[i][2], rows[i][0], rows[i][3]) for i in keep])
    return out


@settings(parent=settings.get_profile("ci"))
@given(
    data=st.data(),
    anchors=st.integers(1, 24),
    num_classes=st.integers(1, 3),
    multi_label=st.booleans(),
    agnostic=st.booleans(),
    conf=st.sampled_from([0.0, 0.2, 0.5]),
    iou=st.sampled_from([0.3, 0.5, 0.7]),
    max_det=st.integers(1, 20),
    cap=st.integers(1, 60),
    candidates=st.integers(1, 80),
)
def test_postprocess_equals_brute_force(data, anchors, num_classes, multi_label, agnostic, conf, iou, max_det, cap,
                                        candidates):
    B = 2
    cx = data.draw(st.lists(st.integers(2, 30), min_size=B * anchors * 2, max_size=B * anchors * 2))
    wh = data.draw(st.lists(st.sampled_from([2, 4, 6, 8]), min_size=B * anchors * 2, max_size=B * anchors * 2))
    sc = data.draw(st.lists(st.sampled_from([0.1, 0.3, 0.6, 0.9]), min_size=B * anchors * num_classes, max_size=B * anchors * num_classes))
    y = np.concatenate(
        [np.reshape(cx, (B, 2, anchors)), np.reshape(wh, (B, 2, anchors)), np.reshape(sc, (B, num_classes, anchors))], 1
    ).astype(np.float64)
    want = brute_postprocess(y, conf=conf, iou=iou, max_det=max_det, multi_label=multi_label, agnostic=agnostic, cap=cap)
    kw = dict(conf=conf, iou=iou, max_det=max_det, multi_label=multi_label, agnostic=agnostic, max_candidates=cap)
    got = postprocess(Inference(torch.from_numpy(y)), block=16, **kw)
    rows = anchors * num_classes if multi_label else anchors
    static = postprocess_static(Inference(torch.from_numpy(y)), block=16, iters=rows, **kw)
    assert bool(static.converged.all())
    # the static form on the `candidates` highest ranks only: exact wherever it says so, and it
    # says so whenever those ranks hold every (capped) candidate of the image
    top = postprocess_static(Inference(torch.from_numpy(y)), block=7, iters=rows, candidates=candidates, **kw)
    for w, g, s, t, conv in zip(want, got, static.unpad(), top.unpad(), top.converged.tolist()):
        assert g.boxes.tolist() == [list(t[0]) for t in w]
        assert g.scores.tolist() == [t[1] for t in w]
        assert g.classes.tolist() == [t[2] for t in w]
        assert_trees_all_equal(tuple(g[:3]), tuple(s[:3]))
        if conv:
            assert_trees_all_equal(tuple(g[:3]), tuple(t[:3]))
    n_rows = (y[:, 4:] > conf).sum((1, 2)) if multi_label and num_classes > 1 else (y[:, 4:].max(1) > conf).sum(1)
    for b in range(B):
        if min(int(n_rows[b]), cap) <= candidates:
            assert bool(top.converged[b])


def chain(B: int = 1) -> Inference:
    """Three boxes in a row: IoU(a, b) = IoU(b, c) = 0.6, IoU(a, c) = 0.2; scores a > b > c."""
    xywh = torch.tensor([[5.0, 5, 10, 10], [7, 5, 10, 10], [9, 5, 10, 10]], dtype=torch.float64)
    y = torch.cat([xywh, torch.tensor([[0.9], [0.8], [0.7]], dtype=torch.float64)], 1).T
    return Inference(y[None].expand(B, -1, -1).contiguous())


def test_chain_hand_computed_and_static_convergence_flag():
    # greedy keeps a (suppresses b), then c (b is gone): a and c at IoU 0.5.
    (d,) = postprocess(chain(), conf=0.1, iou=0.5)
    assert d.scores.tolist() == [0.9, 0.7]
    # One fixed-point iteration is not enough here (c waits for b's fate): flagged, not silent.
    s1 = postprocess_static(chain(), conf=0.1, iou=0.5, iters=1)
    assert s1.converged.tolist() == [False]
    s2 = postprocess_static(chain(), conf=0.1, iou=0.5, iters=2)
    assert s2.converged.tolist() == [True]
    assert s2.scores[0, : int(s2.count[0])].tolist() == [0.9, 0.7]


@pytest.mark.parametrize("cfg", cases.DETECT_CONFIGS, ids=[c[0] for c in cases.DETECT_CONFIGS])
def test_static_equals_eager_and_block_invariance(cfg):
    _, ml, ag, conf, iou, max_det, cap = cfg
    inf = Inference(torch.from_numpy(cases.raw_output(3, anchors=240)))
    kw = dict(conf=conf, iou=iou, max_det=max_det, multi_label=ml, agnostic=ag, max_candidates=cap)
    eager = postprocess(inf, **kw)
    static = postprocess_static(inf, block=256, iters=8, **kw)
    assert bool(static.converged.all())
    assert_trees_all_equal([tuple(d[:3]) for d in eager], [tuple(d[:3]) for d in static.unpad()])
    assert_trees_all_equal([tuple(d[:3]) for d in eager], [tuple(d[:3]) for d in postprocess(inf, block=1000, **kw)])
    # Padded rows are zeros and invalid; scores descend within each image.
    assert not static.valid[:, 1:][~static.valid[:, :-1]].any()
    assert (static.scores[~static.valid] == 0).all()
    for d in eager:
        assert len(d.scores) <= max_det and bool((d.scores[1:] <= d.scores[:-1]).all())
    # float32 (the GPU dtype: the packed int64 ranking) with few candidates: certified images equal
    inf32 = Inference(inf.y.float())
    eager32 = postprocess(inf32, **kw)
    for cands in (7, 64, 4096):
        top = postprocess_static(inf32, iters=64, candidates=cands, **kw)
        for e, t, conv in zip(eager32, top.unpad(), top.converged.tolist()):
            if conv:
                assert_trees_all_equal(tuple(e[:3]), tuple(t[:3]))
        if cands == 4096:
            assert bool(top.converged.all())


def test_no_candidates_gives_typed_empty_detections():
    y = torch.from_numpy(cases.raw_output(4, num_classes=2, extra=32))
    p = torch.zeros(2, 32, cases.INPUT_SHAPE[0] // 4, cases.INPUT_SHAPE[1] // 4)
    for method in ("val", "predict"):
        dets = postprocess(Inference(y, p), conf=0.99999, mask_method=method)
        for d in dets:
            assert d.boxes.shape == (0, 4) and d.scores.shape == (0,) and d.classes.dtype == torch.int64
            assert d.masks.dtype == torch.bool and d.masks.shape[0] == 0
    yp = torch.from_numpy(cases.pose_output(4))
    (d, _) = postprocess(Inference(yp), conf=0.99999, kpt_shape=(17, 3))
    assert d.keypoints.shape == (0, 17, 3)
    s = postprocess_static(Inference(yp), conf=0.99999, kpt_shape=(17, 3), max_det=7)
    assert s.count.tolist() == [0, 0] and s.keypoints.shape == (2, 7, 17, 3)


def test_bad_arguments_name_the_problem():
    inf = Inference(torch.from_numpy(cases.raw_output(0)))
    with pytest.raises(ValueError, match=r"^\[yolo_func\] postprocess: conf"):
        postprocess(inf, conf=1.5)
    with pytest.raises(ValueError, match="max_det"):
        postprocess(inf, max_det=0)
    with pytest.raises(ValueError, match="mask_method"):
        postprocess(inf, mask_method="retina")
    with pytest.raises(TypeError, match="Inference"):
        postprocess(inf.y)
    with pytest.raises(ValueError, match="kpt_shape"):
        postprocess(inf, num_classes=3)
    with pytest.raises(ValueError, match="native"):
        y = torch.from_numpy(cases.raw_output(1, num_classes=3, extra=32))
        postprocess(Inference(y, torch.from_numpy(cases.protos(1))), mask_method="native")
