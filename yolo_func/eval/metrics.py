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
    "match_predictions_batch",
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
    """IoU matrix of the metric (with eps, unlike NMS), of one image or of a batch of them.

    Args:
      a: float[..., N, 4] xyxy.
      b: float[..., M, 4] xyxy (the same leading dims as ``a``).

    Returns:
      float[..., N, M] = inter / (area_a + area_b - inter + eps).
    """
    lt = torch.maximum(a[..., :, None, :2], b[..., None, :, :2])
    rb = torch.minimum(a[..., :, None, 2:], b[..., None, :, 2:])
    inter = (rb - lt).clamp(min=0).prod(-1)
    area_a = (a[..., 2:] - a[..., :2]).prod(-1)
    area_b = (b[..., 2:] - b[..., :2]).prod(-1)
    return inter / (area_a[..., :, None] + area_b[..., None, :] - inter + eps)


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


def match_predictions_batch(
    pred_classes: Sequence[np.ndarray], gt_classes: Sequence[np.ndarray], iou: np.ndarray,
    thresholds: np.ndarray = IOU_THRESHOLDS,
) -> list[np.ndarray]:
    """:func:`match_predictions` of a batch of images at once (the same greedy rule, the same result).

    The Python loop runs over the k-th candidate detection of every image together (a candidate
    reaches the lowest threshold with some same-class GT), so it is as long as the most candidates
    of one image rather than all of them.

    Args:
      pred_classes: B arrays int[N_b], each image's detections sorted by descending confidence.
      gt_classes: B arrays int[M_b].
      iou: float[B, M, N] with ``M >= max M_b`` and ``N >= max N_b``: image b's (GT x detection)
        IoU in ``iou[b, :M_b, :N_b]``; the rest is ignored.
      thresholds: float[T].

    Returns:
      B arrays bool[N_b, T], each ``match_predictions(pred_classes[b], gt_classes[b], iou[b, :M_b, :N_b], thresholds)``.

    Example:
      >>> import numpy as np
      >>> iou = np.array([[[0.6, 0.9]], [[0.3, 0.0]]])
      >>> [t[:, 0].tolist() for t in match_predictions_batch([np.array([0, 0]), np.array([1, 1])], [np.array([0]), np.array([1])], iou)]
      [[True, False], [False, False]]
    """
    thresholds = np.asarray(thresholds, dtype=np.float64)
    T = len(thresholds)
    nd = np.array([len(p) for p in pred_classes], dtype=np.int64)
    ng = np.array([len(g) for g in gt_classes], dtype=np.int64)
    out = [np.zeros((int(n), T), dtype=bool) for n in nd]
    live = np.nonzero((nd > 0) & (ng > 0))[0]
    if not len(live) or T == 0:
        return out
    if thresholds.min() <= 0:  # padding below could then match: the one-image loop
        for b in live:
            out[b] = match_predictions(np.asarray(pred_classes[b]), np.asarray(gt_classes[b]),
                                       iou[b, :ng[b], :nd[b]], thresholds)
        return out
    L, M, N = len(live), int(ng[live].max()), int(nd[live].max())
    pc = np.full((L, N), -1, dtype=np.int64)
    gc = np.full((L, M), -1, dtype=np.int64)
    for j, b in enumerate(live):
        pc[j, :nd[b]] = pred_classes[b]
        gc[j, :ng[b]] = gt_classes[b]
    real = (np.arange(M)[None, :, None] < ng[live][:, None, None]) & (np.arange(N)[None, None, :] < nd[live][:, None, None])
    blk = np.where(gc[:, :, None] == pc[:, None, :], iou[live][:, :M, :N], 0.0)  # another class: 0, as one image does
    blk = np.where(real, blk, -np.inf)  # padding: below every threshold and every real value
    cols, K, correct = _greedy_block(blk, thresholds)
    for j, b in enumerate(live):
        out[b][cols[j, :K[j]]] = correct[j, :K[j]]
    return out


def _greedy_block(blk: np.ndarray, thresholds: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The greedy matching of :func:`match_predictions` on L images at once.

    Args:
      blk: float[L, M, N] (GT x detection) IoU per image, another class already 0, padding -inf;
        detections in descending confidence order.
      thresholds: float[T], all > 0.

    Returns:
      (cols int[L, Kx]: each image's candidate detections (columns reaching ``min(thresholds)``)
      first, in order; K int[L]: how many; correct bool[L, Kx, T]: the result of candidate k).
    """
    L, M, N = blk.shape
    T = len(thresholds)
    cand = (blk >= thresholds.min()).any(1)  # [L, N]
    K = cand.sum(1)
    Kx = int(K.max()) if L else 0
    cols = np.argsort(~cand, axis=1, kind="stable")[:, :Kx]  # each image's candidates, in confidence order
    correct = np.zeros((L, Kx, T), dtype=bool)
    if Kx == 0:
        return cols, K, correct
    blk = np.take_along_axis(blk, cols[:, None, :], 2)  # [L, M, Kx]
    blk = np.where((np.arange(Kx)[None, :] < K[:, None])[:, None, :], blk, -np.inf)
    claimed = np.zeros((L, T, M), dtype=bool)
    for k in range(Kx):
        c = np.where(claimed, -1.0, blk[:, None, :, k])  # [L, T, M]
        best = c.argmax(2)
        hit = c.max(2) >= thresholds  # the value at best (a NaN: NaN, as the argmax's pick)
        correct[:, k] = hit
        li, ti = np.nonzero(hit)
        claimed[li, ti, best[li, ti]] = True
    return cols, K, correct


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


def _copy_packed(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors (one device) on the host with one copy: their bytes packed, each at an 8-byte
    offset, copied, and viewed back as their dtype and shape (the same bits)."""
    parts, spans, at = [], [], 0
    for t in tensors:
        t = t.detach().contiguous().reshape(-1)
        raw = t.view(torch.uint8) if t.numel() else t.new_zeros(0, dtype=torch.uint8)
        n = raw.numel()
        parts.append(raw)
        if n % 8:
            parts.append(raw.new_zeros(8 - n % 8))
        spans.append((at, n))
        at += n + (-n) % 8
    host = torch.cat(parts).cpu() if parts else torch.zeros(0, dtype=torch.uint8)
    return [host[o:o + n].view(t.dtype).reshape(t.shape) for t, (o, n) in zip(tensors, spans)]


def _to_host(records: list) -> list:
    """Records (NamedTuples of tensors or None) with every tensor detached and on the host, the ones
    on another device moved with one copy per device (:func:`_copy_packed`)."""
    out = [[None if t is None else t.detach() for t in rec] for rec in records]
    by_device: dict[torch.device, list[tuple[int, int]]] = {}
    for r, rec in enumerate(records):
        for f, t in enumerate(rec):
            if t is not None and t.device.type != "cpu":
                by_device.setdefault(t.device, []).append((r, f))
    for pos in by_device.values():
        for (r, f), h in zip(pos, _copy_packed([records[r][f] for r, f in pos])):
            out[r][f] = h
    return [type(rec)(*fields) for rec, fields in zip(records, out)]


def _same_class_pairs(gt_boxes: np.ndarray, det_boxes: np.ndarray, gt_classes: list[np.ndarray],
                      det_classes: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Every (GT, detection) pair of one image and one class with its :func:`box_iou` (computed per pair;
    another class scores 0 in the matching whatever its IoU).

    Args:
      gt_boxes: float64[G, 4], the batch's GT boxes image after image; ``gt_classes`` B arrays int[M_b].
      det_boxes: float64[D, 4] likewise; ``det_classes`` B arrays int[N_b].

    Returns:
      (image int64[P], GT row in its image int64[P], detection row in its image int64[P], IoU float64[P]),
      in GT order.
    """
    ng = np.array([len(c) for c in gt_classes], dtype=np.int64)
    nd = np.array([len(c) for c in det_classes], dtype=np.int64)
    G, D = int(ng.sum()), int(nd.sum())
    if not G or not D:
        return tuple(np.zeros(0, dtype=t) for t in (np.int64, np.int64, np.int64, np.float64))
    gi, di = np.repeat(np.arange(len(ng)), ng), np.repeat(np.arange(len(nd)), nd)  # image of each row
    gs, ds = np.arange(G) - np.repeat(np.cumsum(ng) - ng, ng), np.arange(D) - np.repeat(np.cumsum(nd) - nd, nd)
    _, inv = np.unique(np.concatenate([*gt_classes, *det_classes]), return_inverse=True)
    C = int(inv.max()) + 1
    gkey, dkey = gi * C + inv[:G], di * C + inv[G:]
    order = np.argsort(dkey, kind="stable")
    sk = dkey[order]
    lo, hi = np.searchsorted(sk, gkey, "left"), np.searchsorted(sk, gkey, "right")
    cnt = hi - lo
    g = np.repeat(np.arange(G), cnt)  # pairs: GT row g with detection row d
    d = order[np.repeat(lo, cnt) + np.arange(int(cnt.sum())) - np.repeat(np.cumsum(cnt) - cnt, cnt)]
    # box_iou of each pair on its own: a batch of P (1 x 1) IoU matrices
    iou = box_iou(torch.from_numpy(gt_boxes[g])[:, None], torch.from_numpy(det_boxes[d])[:, None])[:, 0, 0]
    return gi[g], gs[g], ds[d], iou.numpy()


def _match_pairs(img: np.ndarray, g: np.ndarray, d: np.ndarray, iou: np.ndarray, nd: Sequence[int],
                 thresholds: np.ndarray = IOU_THRESHOLDS) -> list[np.ndarray] | None:
    """:func:`match_predictions` of every image from its same-class pairs (:func:`_same_class_pairs`).

    Only pairs reaching the lowest threshold can claim or be claimed, so the greedy loop runs on
    them alone: per image, the GTs and detections that have one, in their order, the rest of the
    block 0 (below every threshold, as another class or no overlap). None where that does not hold
    (a NaN IoU, a threshold <= 0): the caller then matches on the whole block.

    Returns:
      B arrays bool[N_b, T].
    """
    thresholds = np.asarray(thresholds, dtype=np.float64)
    T = len(thresholds)
    if T == 0 or thresholds.min() <= 0 or np.isnan(iou).any():
        return None
    out = [np.zeros((int(n), T), dtype=bool) for n in nd]
    keep = iou >= thresholds.min()
    if not keep.any():
        return out
    img, g, d, iou = img[keep], g[keep], d[keep], iou[keep]
    W = int(max(g.max(), d.max())) + 1
    ug, gr = np.unique(img * W + g, return_inverse=True)  # each image's GTs with a pair, in order
    ud, dr = np.unique(img * W + d, return_inverse=True)  # ... and detections (confidence order)
    images, li = np.unique(img, return_inverse=True)
    g_first = np.searchsorted(ug // W, images)  # where each image's GTs start in ug
    d_first = np.searchsorted(ud // W, images)
    g_rank, d_rank = gr - g_first[li], dr - d_first[li]
    blk = np.zeros((len(images), int(g_rank.max()) + 1, int(d_rank.max()) + 1))
    blk[li, g_rank, d_rank] = iou
    cols, K, correct = _greedy_block(blk, thresholds)
    d_end = np.append(d_first[1:], len(ud))
    for j, b in enumerate(images):
        rows = ud[d_first[j]:d_end[j]] % W  # every column is a candidate, so cols[j, :K[j]] = 0..K[j]-1
        out[b][rows] = correct[j, :K[j]]
    return out


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
        if not detections:
            return
        B, T = len(detections), len(IOU_THRESHOLDS)
        host = _to_host([*detections, *(GroundTruth(*g) for g in ground_truth)])  # one copy per device
        dets, gts = host[:B], host[B:]
        nd = [int(d.scores.shape[0]) for d in dets]
        ng = [int(g.classes.shape[0]) for g in gts]
        pcs = np.split(torch.cat([d.classes.reshape(-1) for d in dets]).numpy().astype(np.int64), np.cumsum(nd)[:-1])
        gcs = np.split(torch.cat([g.classes.reshape(-1) for g in gts]).numpy().astype(np.int64), np.cumsum(ng)[:-1])
        self._conf.append(torch.cat([d.scores.reshape(-1).double() for d in dets]).numpy())
        self._cls.append(np.concatenate(pcs))
        self._target_cls.append(np.concatenate(gcs))
        M, N = max(ng), max(nd)
        # box IoU of the same-class (GT, detection) pairs of every image at once (another class
        # scores 0 in the matching whatever its IoU)
        gb = torch.cat([g.boxes.reshape(-1, 4) for g in gts]).double().numpy()
        db = torch.cat([d.boxes.reshape(-1, 4) for d in dets]).double().numpy()
        pairs = _same_class_pairs(gb, db, gcs, pcs)
        box_tp = _match_pairs(*pairs, nd)
        if box_tp is None:  # the whole block
            blk = np.zeros((B, M, N))
            blk[pairs[0], pairs[1], pairs[2]] = pairs[3]
            box_tp = match_predictions_batch(pcs, gcs, blk)
        tps = {"box": (range(B), box_tp)}
        for kind, ok in (("mask", lambda d, g: d.masks is not None and g.masks is not None),
                         ("pose", lambda d, g: d.keypoints is not None and g.keypoints is not None)):
            which = [b for b in range(B) if ok(dets[b], gts[b])]
            if which:
                blk = np.zeros((B, M, N))
                for b in which:
                    if nd[b] and ng[b]:
                        blk[b, :ng[b], :nd[b]] = self._iou(kind, dets[b], gts[b]).numpy()
                tps[kind] = (which, match_predictions_batch(pcs, gcs, blk))
        for kind, (which, tp) in tps.items():
            self._tp.setdefault(kind, []).append(
                np.concatenate([tp[b] for b in which]) if len(which) else np.zeros((0, T), dtype=bool))

    def _iou(self, kind: str, det, gt: GroundTruth) -> torch.Tensor:
        """float64[M, N] (GT x detection) mask IoU or keypoint OKS of one image."""
        if kind == "mask":
            return mask_iou(gt.masks, det.masks).double()
        wh = (gt.boxes[:, 2:] - gt.boxes[:, :2]).double()
        sig = kpt_sigmas(gt.keypoints.shape[1], self._sigmas)
        return keypoint_oks(gt.keypoints.double(), det.keypoints.double(), wh.prod(-1) * 0.53, sig)

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
