"""The reference's internal per-class metric (REFERENCE.md §3.6), used for the per-epoch table.

Host-side numpy on small per-image arrays; pycocotools' numbers come from
:mod:`yolo_func.eval.coco_eval`. The differences to pycocotools, by design of the reference:
TP matching visits detections in descending confidence and claims the best not-yet-matched
same-class GT (IoU >= threshold) with no crowd or area rules; AP integrates the precision envelope
with the trapezoidal rule over 101 recall points (pycocotools averages 101 sampled precisions);
classes without labels are left out of the means.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

__all__ = [
    "IOU_THRESHOLDS",
    "COCO_KPT_SIGMAS",
    "GroundTruth",
    "box_iou",
    "mask_iou",
    "keypoint_oks",
    "match_predictions",
    "compute_ap",
    "ap_per_class",
    "MetricAccumulator",
    "fitness",
]

#: The 10 IoU thresholds 0.50:0.05:0.95.
IOU_THRESHOLDS = np.linspace(0.5, 0.95, 10)

#: COCO's 17 keypoint OKS sigmas (person keypoints).
COCO_KPT_SIGMAS = np.array(
    [0.26, 0.25, 0.25, 0.35, 0.35, 0.79, 0.79, 0.72, 0.72, 0.62, 0.62, 1.07, 1.07, 0.87, 0.87, 0.89, 0.89]
) / 10.0


def kpt_sigmas(num_keypoints: int, sigmas: Sequence[float] | None = None) -> np.ndarray:
    """OKS sigmas: the given ones, COCO's for 17 keypoints, else ``1 / P`` each (the reference's rule).

    Raises:
      ValueError: ``sigmas`` of the wrong length.
    """
    if sigmas is not None:
        s = np.asarray(sigmas, dtype=np.float64)
        if s.shape != (num_keypoints,):
            raise ValueError(f"[yolo_func] kpt sigmas: expected {num_keypoints} values, got shape {s.shape}")
        return s
    return COCO_KPT_SIGMAS.copy() if num_keypoints == 17 else np.full(num_keypoints, 1.0 / num_keypoints)


class GroundTruth(NamedTuple):
    """Labels of one image, in the same pixel space as its detections.

    Attributes:
      boxes: float[M, 4] xyxy.
      classes: int64[M].
      masks: bool[M, h, w] at the detections' mask resolution, or None.
      keypoints: float[M, P, 3] (x, y, visibility), or None.
    """

    boxes: torch.Tensor
    classes: torch.Tensor
    masks: torch.Tensor | None = None
    keypoints: torch.Tensor | None = None


def box_iou(a: torch.Tensor, b: torch.Tensor, eps: float = 1e-7) -> torch.Tensor:
    """IoU matrix of the metric (with eps, unlike NMS).

    Args:
      a: float[N, 4] xyxy.
      b: float[M, 4] xyxy.

    Returns:
      float[N, M] = inter / (area_a + area_b - inter + eps).
    """
    lt = torch.maximum(a[:, None, :2], b[None, :, :2])
    rb = torch.minimum(a[:, None, 2:], b[None, :, 2:])
    inter = (rb - lt).clamp(min=0).prod(-1)
    area_a = (a[:, 2:] - a[:, :2]).prod(-1)
    area_b = (b[:, 2:] - b[:, :2]).prod(-1)
    return inter / (area_a[:, None] + area_b[None, :] - inter + eps)


def mask_iou(a: torch.Tensor, b: torch.Tensor, eps: float = 1e-7) -> torch.Tensor:
    """Mask IoU matrix: |A ∩ B| / (|A| + |B| - |A ∩ B| + eps).

    Args:
      a: bool[N, h, w].
      b: bool[M, h, w].

    Returns:
      float[N, M].
    """
    fa, fb = a.flatten(1).float(), b.flatten(1).float()
    inter = fa @ fb.T
    return inter / (fa.sum(1)[:, None] + fb.sum(1)[None, :] - inter + eps)


def keypoint_oks(gt: torch.Tensor, pred: torch.Tensor, area: torch.Tensor, sigmas: Sequence[float], eps: float = 1e-7) -> torch.Tensor:
    """Object keypoint similarity of every (GT, prediction) pair (the reference's ``kpt_iou``).

    Args:
      gt: float[N, P, 3] (x, y, visibility); visibility 0 = not labelled.
      pred: float[M, P, >=2].
      area: float[N] GT areas (the reference passes box w*h*0.53).
      sigmas: P per-keypoint sigmas.

    Returns:
      float[N, M]: ``sum_k exp(-d_k^2 / ((2 sigma_k)^2 (area + eps) 2)) [v_k > 0] / (n_visible + eps)``.
    """
    s = torch.as_tensor(np.asarray(sigmas), dtype=gt.dtype, device=gt.device)
    d = (gt[:, None, :, 0] - pred[None, :, :, 0]) ** 2 + (gt[:, None, :, 1] - pred[None, :, :, 1]) ** 2
    vis = (gt[..., 2] != 0).to(gt.dtype)  # [N, P]
    e = d / ((2 * s) ** 2 * (area[:, None, None] + eps) * 2)
    return (torch.exp(-e) * vis[:, None]).sum(-1) / (vis.sum(-1)[:, None] + eps)


def match_predictions(
    pred_classes: np.ndarray, gt_classes: np.ndarray, iou: np.ndarray, thresholds: np.ndarray = IOU_THRESHOLDS
) -> np.ndarray:
    """True positives at each threshold: detections in the given (descending-confidence) order each
    claim their best not-yet-claimed same-class GT whose IoU >= threshold.

    Args:
      pred_classes: int[N], detections sorted by descending confidence.
      gt_classes: int[M].
      iou: float[M, N] (GT x detection).
      thresholds: float[T].

    Returns:
      bool[N, T].
    """
    N, T = len(pred_classes), len(thresholds)
    correct = np.zeros((N, T), dtype=bool)
    if N == 0 or len(gt_classes) == 0:
        return correct
    iou = np.where(gt_classes[:, None] == pred_classes[None, :], iou, 0.0)
    claimed = np.zeros((T, len(gt_classes)), dtype=bool)
    # Only detections that reach the lowest threshold with some GT can ever match.
    for n in np.nonzero((iou >= thresholds.min()).any(0))[0]:
        cand = np.where(claimed, -1.0, iou[None, :, n])  # [T, M]
        best = cand.argmax(1)
        hit = cand[np.arange(T), best] >= thresholds
        correct[n] = hit
        claimed[np.arange(T)[hit], best[hit]] = True
    return correct


def compute_ap(recall: np.ndarray, precision: np.ndarray) -> float:
    """101-point interpolated AP of one curve (trapezoidal integral of the precision envelope).

    Args:
      recall: float[n] increasing.
      precision: float[n].

    Returns:
      AP in [0, 1].
    """
    # Sentinels as the reference: recall [0, r..., r_last, 1], precision [1, p..., 0, 0], so the
    # precision drops to 0 right after the last recall reached (no ramp down to recall 1).
    r_last = recall[-1:] if len(recall) else np.zeros(1)
    mrec = np.concatenate(([0.0], recall, r_last, [1.0]))
    mpre = np.concatenate(([1.0], precision, [0.0, 0.0]))
    mpre = np.flip(np.maximum.accumulate(np.flip(mpre)))
    x = np.linspace(0, 1, 101)
    y = np.interp(x, mrec, mpre)
    return float(np.sum((x[1:] - x[:-1]) * (y[1:] + y[:-1]) / 2))


def _smooth(y: np.ndarray, f: float = 0.05) -> np.ndarray:
    """Box filter of fraction ``f`` with edge padding."""
    nf = round(len(y) * f * 2) // 2 + 1
    p = np.ones(nf // 2)
    yp = np.concatenate((p * y[0], y, p * y[-1]))
    return np.convolve(yp, np.ones(nf) / nf, mode="valid")


def ap_per_class(
    tp: np.ndarray, conf: np.ndarray, pred_cls: np.ndarray, target_cls: np.ndarray, eps: float = 1e-16
) -> dict[str, np.ndarray]:
    """Per-class AP at every threshold, and precision / recall at the max-mean-F1 confidence.

    Args:
      tp: bool[N, T] true positives of all detections of the dataset.
      conf: float[N] confidences.
      pred_cls: int[N].
      target_cls: int[G] classes of every label.

    Returns:
      ``{"classes": int[C], "ap": float[C, T], "p": float[C], "r": float[C], "f1": float[C]}`` over the
      C classes that have labels (P and R at the confidence maximising the smoothed mean F1).
    """
    order = np.argsort(-conf, kind="stable")
    tp, conf, pred_cls = tp[order], conf[order], pred_cls[order]
    classes, n_labels = np.unique(target_cls, return_counts=True)
    C, T = len(classes), tp.shape[1]
    px = np.linspace(0, 1, 1000)
    ap = np.zeros((C, T))
    p_curve, r_curve = np.zeros((C, 1000)), np.zeros((C, 1000))
    for ci, c in enumerate(classes):
        sel = pred_cls == c
        if not sel.any():
            continue
        tpc = tp[sel].cumsum(0)
        fpc = (1 - tp[sel]).cumsum(0)
        recall = tpc / (n_labels[ci] + eps)
        precision = tpc / (tpc + fpc)
        r_curve[ci] = np.interp(-px, -conf[sel], recall[:, 0], left=0)
        p_curve[ci] = np.interp(-px, -conf[sel], precision[:, 0], left=1)
        for t in range(T):
            ap[ci, t] = compute_ap(recall[:, t], precision[:, t])
    f1 = 2 * p_curve * r_curve / (p_curve + r_curve + eps)
    i = int(_smooth(f1.mean(0), 0.1).argmax()) if C else 0
    return {"classes": classes, "ap": ap, "p": p_curve[:, i], "r": r_curve[:, i], "f1": f1[:, i]}


class MetricAccumulator:
    """Accumulates the reference's per-epoch metric over a validation pass.

    Call :meth:`process` per batch with detections and labels in the same pixel space, then
    :meth:`compute`. Kinds: ``"box"`` always, ``"mask"`` when both sides have masks, ``"pose"`` when
    both have keypoints (OKS with area = GT box w*h*0.53).

    Args:
      sigmas: OKS sigmas for pose (default: COCO's for 17 keypoints, else 1/P).
    """

    def __init__(self, sigmas: Sequence[float] | None = None):
        self._sigmas = sigmas
        self.reset()

    def reset(self) -> None:
        """Forget everything processed."""
        self._tp: dict[str, list[np.ndarray]] = {}
        self._conf: list[np.ndarray] = []
        self._cls: list[np.ndarray] = []
        self._target_cls: list[np.ndarray] = []

    def process(self, detections: Sequence, ground_truth: Sequence[GroundTruth]) -> None:
        """Add a batch.

        Args:
          detections: per image :class:`~yolo_func.eval.Detections` (descending score order).
          ground_truth: per image :class:`GroundTruth`.

        Raises:
          ValueError: the two lists differ in length.
        """
        if len(detections) != len(ground_truth):
            raise ValueError(
                f"[yolo_func] MetricAccumulator.process: {len(detections)} detections vs {len(ground_truth)} ground truths; pass one of each per image"
            )
        for det, gt in zip(detections, ground_truth):
            det = type(det)(*(None if t is None else t.detach().cpu() for t in det))
            gt = GroundTruth(*(None if t is None else t.detach().cpu() for t in gt))
            pc, gc = det.classes.numpy().astype(np.int64), gt.classes.numpy().astype(np.int64)
            self._conf.append(det.scores.double().numpy())
            self._cls.append(pc)
            self._target_cls.append(gc)
            kinds = {"box": lambda: box_iou(gt.boxes.double(), det.boxes.double())}
            if det.masks is not None and gt.masks is not None:
                kinds["mask"] = lambda: mask_iou(gt.masks, det.masks).double()
            if det.keypoints is not None and gt.keypoints is not None:
                def oks():
                    wh = (gt.boxes[:, 2:] - gt.boxes[:, :2]).double()
                    sig = kpt_sigmas(gt.keypoints.shape[1], self._sigmas)
                    return keypoint_oks(gt.keypoints.double(), det.keypoints.double(), wh.prod(-1) * 0.53, sig)
                kinds["pose"] = oks
            for kind, iou_fn in kinds.items():
                if len(pc) and len(gc):
                    tp = match_predictions(pc, gc, iou_fn().numpy())
                else:
                    tp = np.zeros((len(pc), len(IOU_THRESHOLDS)), dtype=bool)
                self._tp.setdefault(kind, []).append(tp)

    def compute(self) -> dict[str, dict[str, float]]:
        """Metrics per kind: ``{"box": {"P", "R", "mAP50", "mAP50-95"}, "mask": ..., "pose": ...}`` plus
        ``"fitness"`` (see :func:`fitness`) and ``"per_class"`` (``{kind: {"classes", "ap50", "ap"}}``).
        Zeros when nothing was labelled or detected.
        """
        conf = np.concatenate(self._conf) if self._conf else np.zeros(0)
        cls = np.concatenate(self._cls) if self._cls else np.zeros(0, dtype=np.int64)
        target = np.concatenate(self._target_cls) if self._target_cls else np.zeros(0, dtype=np.int64)
        out: dict = {"per_class": {}}
        for kind, tps in self._tp.items():
            tp = np.concatenate(tps) if tps else np.zeros((0, len(IOU_THRESHOLDS)), dtype=bool)
            r = ap_per_class(tp, conf, cls, target)
            has = len(r["classes"]) > 0
            out[kind] = {
                "P": float(r["p"].mean()) if has else 0.0,
                "R": float(r["r"].mean()) if has else 0.0,
                "mAP50": float(r["ap"][:, 0].mean()) if has else 0.0,
                "mAP50-95": float(r["ap"].mean()) if has else 0.0,
            }
            out["per_class"][kind] = {"classes": r["classes"], "ap50": r["ap"][:, 0], "ap": r["ap"].mean(1)}
        if "box" not in out:
            out["box"] = {"P": 0.0, "R": 0.0, "mAP50": 0.0, "mAP50-95": 0.0}
        out["fitness"] = fitness(out)
        return out


def fitness(metrics: dict) -> float:
    """Best-checkpoint score: box mAP50-95, plus mask (segment) or pose mAP50-95 when present
    (the reference's 8.4.190 rule).

    Args:
      metrics: ``{"box": {"mAP50-95": ...}, ["mask" | "pose": {...}]}`` as :meth:`MetricAccumulator.compute` returns.

    Returns:
      A float.

    Example:
      >>> from yolo_func.eval import fitness
      >>> fitness({"box": {"mAP50-95": 0.4}}), fitness({"box": {"mAP50-95": 0.4}, "mask": {"mAP50-95": 0.3}})
      (0.4, 0.7)
    """
    return float(sum(metrics[k]["mAP50-95"] for k in ("box", "mask", "pose") if k in metrics))
