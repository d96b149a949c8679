"""The reference's internal metric against hand-computed values."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from yolo_func.eval import Detections, fitness, metrics


def test_match_visits_detections_by_confidence():
    # d1 (higher confidence) takes the only GT at IoU 0.6, d2 (IoU 0.9) is then a false positive
    # at thresholds <= 0.6 and the true positive above.
    tp = metrics.match_predictions(np.array([0, 0]), np.array([0]), np.array([[0.6, 0.9]]))
    t = metrics.IOU_THRESHOLDS
    assert tp[0].tolist() == (t <= 0.6 + 1e-12).tolist()
    assert tp[1].tolist() == ((t > 0.6 + 1e-12) & (t <= 0.9 + 1e-12)).tolist()
    # d1 claims its best GT (g2 at 0.85) rather than g1 (0.8); d2 only overlaps g2.
    tp = metrics.match_predictions(np.array([0, 0]), np.array([0, 0]), np.array([[0.8, 0.0], [0.85, 0.9]]))
    assert tp[0].tolist() == (t <= 0.85 + 1e-12).tolist()
    assert tp[1].tolist() == ((t > 0.85 + 1e-12) & (t <= 0.9 + 1e-12)).tolist()
    # Another class never matches.
    assert not metrics.match_predictions(np.array([1]), np.array([0]), np.array([[1.0]])).any()


def test_compute_ap_hand_computed():
    # Envelope: 1 up to recall 0.25, linear 1 -> 0.5 up to 0.75, 0 after: area 0.25 + 0.375 = 0.625;
    # the 101-point trapezoid smears the drop at 0.75 over one step (at most 0.0025).
    ap = metrics.compute_ap(np.array([0.25, 0.75]), np.array([1.0, 0.5]))
    assert ap == pytest.approx(0.625, abs=0.0026)
    # A precision dip is filled by the envelope (0.2 at recall 0.5 becomes 0.5): 1 on [0, 0.25],
    # 1 -> 0.5 on [0.25, 0.5], 0.5 on [0.5, 0.75]: 0.25 + 0.1875 + 0.125 = 0.5625.
    assert metrics.compute_ap(np.array([0.25, 0.5, 0.75]), np.array([1.0, 0.2, 0.5])) == pytest.approx(0.5625, abs=0.0026)


def test_ap_per_class_perfect_and_missing_classes():
    tp = np.ones((4, 10), dtype=bool)
    r = metrics.ap_per_class(tp, np.array([0.9, 0.8, 0.7, 0.6]), np.array([0, 0, 1, 1]), np.array([0, 0, 1, 1, 2]))
    assert r["classes"].tolist() == [0, 1, 2]
    assert r["ap"][:2] == pytest.approx(np.ones((2, 10)), abs=0.006)
    assert (r["ap"][2] == 0).all()  # class 2 has labels but no detections


def test_oks_hand_computed():
    gt = torch.tensor([[[10.0, 10.0, 2.0], [20.0, 20.0, 0.0]]], dtype=torch.float64)
    pred = torch.tensor([[[13.0, 14.0, 0.9], [0.0, 0.0, 0.1]]], dtype=torch.float64)
    s = [0.5, 0.5]
    oks = metrics.keypoint_oks(gt, pred, torch.tensor([100.0], dtype=torch.float64), s)
    e = 25.0 / ((2 * 0.5) ** 2 * (100.0 + 1e-7) * 2)  # only the visible keypoint counts
    assert oks.item() == pytest.approx(np.exp(-e) / (1 + 1e-7))


def test_accumulator_perfect_predictions_and_fitness():
    boxes = torch.tensor([[0.0, 0.0, 10.0, 10.0], [20.0, 20.0, 40.0, 30.0]])
    cls = torch.tensor([0, 1])
    masks = torch.zeros(2, 8, 8, dtype=torch.bool)
    masks[0, :4, :4] = True
    masks[1, 5:, 5:] = True
    det = Detections(boxes, torch.tensor([0.9, 0.8]), cls, masks)
    acc = metrics.MetricAccumulator()
    acc.process([det, Detections(boxes[:0], torch.zeros(0), cls[:0], masks[:0])], [metrics.GroundTruth(boxes, cls, masks)] * 2)
    out = acc.compute()
    # Second image: its two labels are missed -> recall 0.5 for each class, precision 1.
    for kind in ("box", "mask"):
        assert out[kind]["R"] == pytest.approx(0.5, abs=1e-3) and out[kind]["P"] == pytest.approx(1.0, abs=1e-3)
        assert out[kind]["mAP50"] == pytest.approx(0.5, abs=0.006)
    assert out["fitness"] == pytest.approx(out["box"]["mAP50-95"] + out["mask"]["mAP50-95"])
    assert fitness({"box": {"mAP50-95": 0.25}}) == 0.25
    empty = metrics.MetricAccumulator().compute()
    assert empty["box"] == {"P": 0.0, "R": 0.0, "mAP50": 0.0, "mAP50-95": 0.0} and empty["fitness"] == 0.0
    with pytest.raises(ValueError, match="one of each per image"):
        acc.process([det], [])


# ------------------------------------------------- the batched matching and process, old vs new
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


def _old_process(dets, gts, sigmas=None):
    """The per-image accumulation as it was before the batched rewrite (the expectation)."""
    tp, conf, cls, tcls = {}, [], [], []
    for det, gt in zip(dets, gts):
        pc, gc = det.classes.numpy().astype(np.int64), gt.classes.numpy().astype(np.int64)
        conf.append(det.scores.double().numpy())
        cls.append(pc)
        tcls.append(gc)
        kinds = {"box": lambda: metrics.box_iou(gt.boxes.double(), det.boxes.double())}
        if det.masks is not None and gt.masks is not None:
            kinds["mask"] = lambda: metrics.mask_iou(gt.masks, det.masks).double()
        if det.keypoints is not None and gt.keypoints is not None:
            def oks():
                wh = (gt.boxes[:, 2:] - gt.boxes[:, :2]).double()
                sig = metrics.kpt_sigmas(gt.keypoints.shape[1], sigmas)
                return metrics.keypoint_oks(gt.keypoints.double(), det.keypoints.double(), wh.prod(-1) * 0.53, sig)
            kinds["pose"] = oks
        for kind, fn in kinds.items():
            t = (metrics.match_predictions(pc, gc, fn().numpy()) if len(pc) and len(gc)
                 else np.zeros((len(pc), len(metrics.IOU_THRESHOLDS)), dtype=bool))
            tp.setdefault(kind, []).append(t)
    return ({k: np.concatenate(v) for k, v in tp.items()}, np.concatenate(conf), np.concatenate(cls), np.concatenate(tcls))


def _boxes(rng, n, grid):
    # corners on a coarse grid: many exact ties and IoUs right at the thresholds
    xy = rng.integers(0, grid, (n, 2)) * 4.0
    wh = rng.integers(1, 5, (n, 2)) * 4.0
    return torch.tensor(np.concatenate([xy, xy + wh], 1), dtype=torch.float32)


def _image(rng, nd, ng, classes, masks, kpts):
    gt_boxes = _boxes(rng, ng, 5)
    # detections: jittered copies of the GT (so that they match) and random boxes
    pick = rng.integers(0, max(ng, 1), nd)
    src = gt_boxes[pick] if ng else _boxes(rng, nd, 5)
    det_boxes = (src + torch.tensor(rng.integers(-1, 2, (nd, 4)) * 1.0, dtype=torch.float32)).clone()
    det_boxes[:, 2:] = torch.maximum(det_boxes[:, 2:], det_boxes[:, :2])
    scores = torch.tensor(np.sort(rng.choice([0.9, 0.5, 0.5, 0.1], nd))[::-1].copy(), dtype=torch.float32)
    det_m = torch.tensor(rng.random((nd, 4, 4)) < 0.5) if masks else None
    gt_m = torch.tensor(rng.random((ng, 4, 4)) < 0.5) if masks else None
    det_k = torch.tensor(rng.integers(0, 20, (nd, 3, 3)), dtype=torch.float32) if kpts else None
    gt_k = torch.tensor(rng.integers(0, 20, (ng, 3, 3)) * [1, 1, 0.5], dtype=torch.float32) if kpts else None
    gt_cls = torch.tensor(rng.integers(0, classes, ng))
    det_cls = torch.tensor(rng.integers(0, classes, nd))
    if ng:  # mostly the class of the GT it copies
        det_cls = torch.where(torch.tensor(rng.random(nd) < 0.8), gt_cls[pick], det_cls)
    det = Detections(det_boxes, scores, det_cls, det_m, det_k)
    return det, metrics.GroundTruth(gt_boxes, gt_cls, gt_m, gt_k)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), batch=st.integers(1, 6), classes=st.integers(1, 3),
       masks=st.booleans(), kpts=st.booleans())
def test_process_equals_the_per_image_accumulation(seed, batch, classes, masks, kpts):
    rng = np.random.default_rng(seed)
    pairs = [_image(rng, int(rng.integers(0, 9)), int(rng.integers(0, 6)), classes, masks, kpts) for _ in range(batch)]
    dets, gts = [p[0] for p in pairs], [p[1] for p in pairs]
    acc = metrics.MetricAccumulator()
    acc.process(dets, gts)
    tp, conf, cls, tcls = _old_process(dets, gts)
    assert sorted(acc._tp) == sorted(tp)
    for kind in tp:
        np.testing.assert_array_equal(np.concatenate(acc._tp[kind]), tp[kind])
    np.testing.assert_array_equal(np.concatenate(acc._conf), conf)
    np.testing.assert_array_equal(np.concatenate(acc._cls), cls)
    np.testing.assert_array_equal(np.concatenate(acc._target_cls), tcls)


@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), batch=st.integers(1, 5), classes=st.integers(1, 3),
       low=st.sampled_from([0.5, 0.0, -2.0]))
def test_batched_matching_equals_match_predictions(seed, batch, classes, low):
    # IoU values on a 0.05 grid: ties and values exactly at the thresholds; thresholds <= 0 take the
    # one-image loop (padding could match them), the rest the batched one
    rng = np.random.default_rng(seed)
    thresholds = np.linspace(low, 0.95, 10)
    nd, ng = rng.integers(0, 7, batch), rng.integers(0, 5, batch)
    M, N = int(ng.max()) + 1, int(nd.max()) + 2
    iou = np.round(rng.integers(0, 21, (batch, M, N)) * 0.05, 2)
    iou[rng.random(iou.shape) < 0.05] = np.nan
    pcs = [rng.integers(0, classes, n) for n in nd]
    gcs = [rng.integers(0, classes, n) for n in ng]
    got = metrics.match_predictions_batch(pcs, gcs, iou, thresholds)
    for b in range(batch):
        np.testing.assert_array_equal(got[b], metrics.match_predictions(pcs[b], gcs[b], iou[b, :ng[b], :nd[b]], thresholds))


def test_batched_box_iou_is_the_per_image_one_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    a = torch.rand(3, 5, 4, generator=g, dtype=torch.float64) * 50
    b = torch.rand(3, 7, 4, generator=g, dtype=torch.float64) * 50
    a[..., 2:] += a[..., :2]
    b[..., 2:] += b[..., :2]
    batched = metrics.box_iou(a, b)
    assert batched.shape == (3, 5, 7)
    for i in range(3):
        assert torch.equal(batched[i], metrics.box_iou(a[i], b[i]))


def test_packed_host_copy_keeps_every_dtype_shape_and_bit():
    # what process uses to move a batch off the GPU in one copy, run here on CPU tensors
    ts = [torch.tensor([[1.5, -2.0, 3.0, float("inf")]]), torch.tensor([0.25, 1e-30], dtype=torch.float64),
          torch.tensor([7, -1]), torch.zeros(0, 4), torch.tensor([[True, False, True]]),
          torch.arange(5, dtype=torch.float16).reshape(5, 1), torch.tensor([3], dtype=torch.uint8)]
    got = metrics._copy_packed(ts)
    for x, y in zip(got, ts):
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
    (rec,) = metrics._to_host([Detections(ts[0], ts[1][:1], ts[2][:1], None, None)])
    assert rec.masks is None and torch.equal(rec.boxes, ts[0])


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), batch=st.integers(1, 5), classes=st.integers(1, 4))
def test_same_class_pair_iou_is_box_iou_bit_for_bit(seed, batch, classes):
    # what process matches on: box_iou's value for (GT, detection) pairs of one image and class, 0 elsewhere
    rng = np.random.default_rng(seed)
    ng, nd = rng.integers(0, 6, batch), rng.integers(0, 8, batch)
    gts = [torch.tensor(rng.random((n, 4)) * 30, dtype=torch.float32) for n in ng]
    dets = [torch.tensor(rng.random((n, 4)) * 30, dtype=torch.float32) for n in nd]
    gts = [torch.cat([b[:, :2], b[:, :2] + b[:, 2:]], 1) for b in gts]
    dets = [torch.cat([b[:, :2], b[:, :2] + b[:, 2:]], 1) for b in dets]
    gcs = [rng.integers(0, classes, n) for n in ng]
    pcs = [rng.integers(0, classes, n) for n in nd]
    M, N = int(ng.max()) + 1, int(nd.max())
    img, g, d, iou = metrics._same_class_pairs(torch.cat(gts).double().numpy(), torch.cat(dets).double().numpy(), gcs, pcs)
    got = np.zeros((batch, M, N))
    got[img, g, d] = iou
    assert len(iou) == sum(int((gcs[b][:, None] == pcs[b][None, :]).sum()) for b in range(batch))  # each pair once
    # the matching from these pairs alone is match_predictions on the whole IoU matrix
    tp = metrics._match_pairs(img, g, d, iou, nd)
    for b in range(batch):
        want = np.where(gcs[b][:, None] == pcs[b][None, :], metrics.box_iou(gts[b].double(), dets[b].double()).numpy(), 0.0)
        np.testing.assert_array_equal(got[b, :ng[b], :nd[b]], want)
        assert not got[b, ng[b]:].any() and not got[b, :, nd[b]:].any()
        full = metrics.box_iou(gts[b].double(), dets[b].double()).numpy()
        np.testing.assert_array_equal(tp[b], metrics.match_predictions(pcs[b], gcs[b], full))
    assert metrics._match_pairs(img, g, d, np.full_like(iou, np.nan), nd) is None or not len(iou)
