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
