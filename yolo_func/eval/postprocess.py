"""From the raw inference output to detections: candidates, NMS, masks, keypoints, letterbox undo.

``postprocess`` is the eager form (a list of variable-length :class:`Detections`, one per image);
``postprocess_static`` the static-shape form (:class:`PaddedDetections`, padded to ``max_det``,
no data-dependent shapes and no host sync, so it can be captured in a CUDA graph). Both follow
REFERENCE.md §3.2: candidates with a class score > ``conf`` (one row per (anchor, class) when
``multi_label`` and K > 1, else one row per anchor with its best class), at most
``max_candidates`` (30 000) highest-scoring rows, class-aware greedy NMS through the reference's
offset trick (``class * 7680`` on every coordinate), the first ``max_det`` kept rows in
descending score order. Ranking ties: lower row index first, rows numbered anchor-major then
class (the reference's ``nonzero`` order).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from yolo_func.eval import masks as M
from yolo_func.eval.nms import CLASS_OFFSET, nms_sorted
from yolo_func.models.yolov8 import Inference
from yolo_func.structures.boxes import clip_boxes, xywh_to_xyxy

__all__ = [
    "Detections",
    "PaddedDetections",
    "Letterbox",
    "postprocess",
    "postprocess_static",
    "postprocess_with_coco",
    "top_per_category",
    "COCO_MAX_DETS",
    "unpad",
    "scale_to_original",
    "clip_detections",
    "MAX_CANDIDATES",
    "STATIC_CANDIDATES",
]

#: The reference's cap on NMS input rows per image (``max_nms``).
MAX_CANDIDATES = 30000
#: Detections per (image, category) pycocotools' ``COCOeval`` scores at most: ``maxDets[-1]`` of its
#: default parameters, 100 for ``bbox`` and ``segm`` (20 for ``keypoints``), so a record that
#: carries box, mask and keypoints together needs the largest (:func:`top_per_category`).
COCO_MAX_DETS = 100
#: Rows per image the static form ranks and gives to its NMS (:func:`postprocess_static`).
STATIC_CANDIDATES = 1024


class Detections(NamedTuple):
    """Detections of one image, in descending score order.

    Attributes:
      boxes: float[N, 4] xyxy pixels (network input, or original image after :func:`scale_to_original`).
      scores: float[N] class confidence.
      classes: int64[N] class index (0-based, the model's order).
      masks: bool[N, h, w] for segmentation models, else None (h, w depend on the mask method).
      keypoints: float[N, P, D] (x, y[, confidence]) pixels for pose models, else None.

    Example:
      >>> import torch
      >>> from yolo_func.eval import Detections
      >>> d = Detections(boxes=torch.tensor([[0.0, 0.0, 10.0, 10.0]]), scores=torch.tensor([0.9]), classes=torch.tensor([2]))
      >>> d.boxes.shape, d.masks is None, d.keypoints is None
      (torch.Size([1, 4]), True, True)
    """

    boxes: torch.Tensor
    scores: torch.Tensor
    classes: torch.Tensor
    masks: torch.Tensor | None = None
    keypoints: torch.Tensor | None = None


class PaddedDetections(NamedTuple):
    """Static-shape detections of a batch, padded to D = ``max_det`` rows per image.

    Attributes:
      boxes: float[B, D, 4] xyxy input pixels (zeros where padded).
      scores: float[B, D] (zeros where padded).
      classes: int64[B, D] (zeros where padded).
      valid: bool[B, D], a prefix of each row.
      count: int64[B] real rows per image.
      masks: bool[B, D, Hp, Wp] at prototype resolution (the ``"val"`` method) or None.
      keypoints: float[B, D, P, Dk] or None.
      converged: bool[B]; True where the NMS was provably exact (see :mod:`yolo_func.eval.nms`).

    Example:
      >>> import torch
      >>> from yolo_func import Inference
      >>> y = torch.zeros(1, 4 + 2, 3)                    # float[B, 4 + K, A]: three candidate boxes, K = 2
      >>> y[0, :4] = torch.tensor([[10.0, 11.0, 40.0], [10.0, 10.0, 40.0], [8.0, 8.0, 8.0], [8.0, 8.0, 8.0]])
      >>> y[0, 4] = torch.tensor([0.9, 0.8, 0.7])          # class 0 scores; boxes 0 and 1 overlap
      >>> inf = Inference(y)
      >>> from yolo_func.eval import postprocess_static
      >>> p = postprocess_static(inf, conf=0.25, iou=0.5, max_det=4)
      >>> p.scores.shape, p.classes.dtype, p.masks is None
      (torch.Size([1, 4]), torch.int64, True)
    """

    boxes: torch.Tensor
    scores: torch.Tensor
    classes: torch.Tensor
    valid: torch.Tensor
    count: torch.Tensor
    masks: torch.Tensor | None
    keypoints: torch.Tensor | None
    converged: torch.Tensor

    def unpad(self) -> list[Detections]:
        """One :class:`Detections` per image (one host read of ``count``)."""
        return unpad(self)


class Letterbox(NamedTuple):
    """How an original image was put into the network input.

    Attributes:
      orig_shape: (h0, w0) original image size in pixels.
      gain: input pixels per original pixel, one number or (gain_y, gain_x) (the reference's
        ``ratio_pad[0]``).
      pad: (left, top) padding in input pixels (the reference's ``ratio_pad[1]``).

    Example:
      >>> from yolo_func.eval import Letterbox
      >>> lb = Letterbox(orig_shape=(480, 640), gain=0.1, pad=(0.0, 8.0))   # 640x480 -> 64x48, padded to 64x64
      >>> lb.orig_shape, lb.gain, lb.pad
      ((480, 640), 0.1, (0.0, 8.0))
    """

    orig_shape: tuple[int, int]
    gain: float | tuple[float, float]
    pad: tuple[float, float]


# -- splitting the inference output ---------------------------------------------------------------


def _check_inference(inference: object) -> None:
    if not isinstance(inference, Inference):
        raise TypeError(
            f"[yolo_func] postprocess: inference must be a yolo_func.Inference (Model.predict's output), got "
            f"{type(inference).__name__}; wrap a raw tensor as Inference(y, protos)"
        )


def _layout(inference: Inference, num_classes: int | None, kpt_shape: tuple[int, int] | None) -> tuple[int, tuple[int, int] | None]:
    """``(K, kpt_shape or None)`` from the channel count of ``inference.y``."""
    _check_inference(inference)
    y = inference.y
    if y.dim() != 3 or y.shape[1] < 5:
        raise ValueError(f"[yolo_func] postprocess: inference.y must be float[B, 4 + K + E, A], got shape {tuple(y.shape)}")
    C = y.shape[1]
    if inference.protos is not None:
        extra, kpts = inference.protos.shape[1], None
    elif kpt_shape is not None:
        kpts = (int(kpt_shape[0]), int(kpt_shape[1]))
        extra = kpts[0] * kpts[1]
    elif num_classes is not None:
        extra, kpts = C - 4 - num_classes, None
        if extra:
            raise ValueError(
                f"[yolo_func] postprocess: inference.y has {C} channels = 4 + {num_classes} classes + {extra} extra, "
                f"but no protos; pass kpt_shape=(P, D) for a pose model"
            )
    else:
        extra, kpts = 0, None
    K = C - 4 - extra
    if K < 1 or (num_classes is not None and K != num_classes):
        raise ValueError(
            f"[yolo_func] postprocess: inference.y has {C} channels, which does not split into 4 box + "
            f"{num_classes if num_classes is not None else 'K'} classes + {extra} extra channels; check num_classes / kpt_shape"
        )
    return K, kpts


def _rows(inference: Inference, K: int, *, conf: float, multi_label: bool, n_cand: int | None, max_candidates: int):
    """Ranked candidate rows: ``(boxes xyxy [B,N,4], scores [B,N], classes [B,N], extra [B,N,E], valid [B,N],
    total)``.

    ``n_cand`` None means eager: N = the largest per-image candidate count, capped (one host read),
    and ``total`` is None; an int: the ``n_cand`` highest-ranked rows (static shapes), and ``total``
    is int64[B], each image's number of valid rows after the ``max_candidates`` cap (what the eager
    form ranks).
    """
    static = n_cand is not None
    dtype = torch.promote_types(inference.y.dtype, torch.float32)
    y = inference.y.to(dtype).transpose(1, 2)  # [B, A, C]
    B, A, _ = y.shape
    boxes, scores, extra = xywh_to_xyxy(y[..., :4]), y[..., 4 : 4 + K], y[..., 4 + K :]
    if multi_label and K > 1:
        row_scores = scores.reshape(B, A * K)  # row = anchor * K + class: the reference's nonzero order
        row_anchor = torch.arange(A * K, device=y.device) // K
        row_class = torch.arange(A * K, device=y.device) % K
        row_anchor, row_class = row_anchor.expand(B, -1), row_class.expand(B, -1)
    else:
        row_scores, row_class = scores.max(-1)
        row_anchor = torch.arange(A, device=y.device).expand(B, -1)
    rows = row_scores.shape[1]
    row_valid = row_scores > conf
    if n_cand is None:
        per_image = row_valid.sum(1)
        n_valid = int(per_image.max())
        if n_valid <= max_candidates:  # eager, no cap reached: every valid row, no top-k over all rows
            return (*_valid_rows(row_scores, row_valid, per_image, max(1, n_valid), boxes, extra, row_anchor, row_class),
                    None)
        n_cand = max_candidates
    n_cand = max(1, min(n_cand, rows))
    # valid scores are > conf >= 0, so 0 ranks every invalid row after every valid one
    key = torch.where(row_valid, row_scores, torch.zeros((), dtype=row_scores.dtype, device=row_scores.device))
    idx = _ranked_rows(key, n_cand)
    anchor = row_anchor.gather(1, idx)
    out_scores = row_scores.gather(1, idx)
    out_valid = row_valid.gather(1, idx)
    out_classes = row_class.gather(1, idx)
    out_boxes = boxes.gather(1, anchor[..., None].expand(-1, -1, 4))
    out_extra = extra.gather(1, anchor[..., None].expand(-1, -1, extra.shape[-1]))
    total = row_valid.sum(1).clamp(max=max_candidates) if static else None
    return out_boxes, out_scores, out_classes, out_extra, out_valid, total


def _valid_rows(row_scores, row_valid, per_image, n, boxes, extra, row_anchor, row_class):
    """:func:`_rows` when every image has at most ``n`` valid rows: the valid rows gathered with one
    ``nonzero`` (ascending row index per image), then stably sorted by score (descending), so the
    valid rows come out exactly as from the top-k path; the ``n - count`` slots after them are
    padding (valid False, score -inf in the sort, row 0), which NMS never keeps."""
    B = row_scores.shape[0]
    nz = row_valid.nonzero()  # [V, 2] (image, row), image-major, rows ascending
    img, row = nz[:, 0], nz[:, 1]
    starts = per_image.cumsum(0) - per_image
    slot = torch.arange(img.shape[0], device=img.device) - starts[img]
    idx = torch.zeros(B, n, dtype=torch.long, device=row_scores.device)
    idx[img, slot] = row
    valid = torch.arange(n, device=row_scores.device)[None] < per_image[:, None]
    key = torch.where(valid, row_scores.gather(1, idx), torch.full((), -torch.inf, dtype=row_scores.dtype,
                                                                    device=row_scores.device))
    order = key.sort(dim=1, descending=True, stable=True).indices
    idx, valid = idx.gather(1, order), valid.gather(1, order)
    anchor = row_anchor.gather(1, idx)
    out_scores = row_scores.gather(1, idx)
    out_classes = row_class.gather(1, idx)
    out_boxes = boxes.gather(1, anchor[..., None].expand(-1, -1, 4))
    out_extra = extra.gather(1, anchor[..., None].expand(-1, -1, extra.shape[-1]))
    return out_boxes, out_scores, out_classes, out_extra, valid


def _ranked_rows(key: torch.Tensor, n: int) -> torch.Tensor:
    """Indices of the ``n`` largest keys per row in rank order: descending key, ties lower index
    first (a stable descending sort, cut at ``n``); static shapes.

    float32 keys (the GPU path): one ``topk`` of unique int64 keys, the float's bits in the high
    half (for floats >= +0 the int32 bit patterns are in the floats' order) and ``R - 1 - index``
    in the low half, so ties resolve by index inside the top-k itself. Other dtypes:
    :func:`_top_rows` then a stable sort of the ``n`` selected keys.

    Args:
      key: float[B, R], >= +0 when float32 (no NaN, no -0.0: the caller's scores > conf >= 0,
        0 for the invalid rows); any non-NaN values otherwise.
      n: 1 <= n <= R.

    Returns:
      int64[B, n].

    Example:
      >>> _ranked_rows(torch.tensor([[0.5, 0.9, 0.5, 0.0, 0.9]]), 4).tolist()
      [[1, 4, 0, 2]]
    """
    R = key.shape[1]
    if key.dtype == torch.float32 and R < 2**31:
        packed = key.view(torch.int32).to(torch.int64).mul_(2**32)
        packed.add_(R - 1 - torch.arange(R, device=key.device))
        return packed.topk(n, dim=1).indices
    idx = _top_rows(key, n)
    # Stable sort of the selected rows by score (descending): ties keep the lower row index first.
    return idx.gather(1, key.gather(1, idx).sort(dim=1, descending=True, stable=True).indices)


def _top_rows(key: torch.Tensor, n: int) -> torch.Tensor:
    """Indices (ascending) of the ``n`` largest keys per row, ties at the cut taken lowest index
    first; static shapes, O(rows) work besides a top-k (no full sort of every row).

    Args:
      key: float[B, R].
      n: 1 <= n <= R.

    Returns:
      int64[B, n].
    """
    B, R = key.shape
    if n >= R:
        return torch.arange(R, device=key.device).expand(B, -1)
    kth = key.topk(n, dim=1).values[:, -1:]
    above, tie = key > kth, key == kth
    need = n - above.sum(1, keepdim=True)
    sel = above | (tie & (tie.long().cumsum(1) <= need))
    pos = torch.where(sel, sel.long().cumsum(1) - 1, torch.full_like(kth, n, dtype=torch.long))
    rows = torch.arange(R, device=key.device).expand(B, -1)
    # Slot n is a sink for the rows left out (static-shape scatter).
    return torch.zeros(B, n + 1, dtype=torch.long, device=key.device).scatter(1, pos, rows)[:, :n]


def _nms(inference, K, *, conf, iou, max_det, multi_label, agnostic, n_cand, max_candidates, block, iters):
    boxes, scores, classes, extra, valid, total = _rows(
        inference, K, conf=conf, multi_label=multi_label, n_cand=n_cand, max_candidates=max_candidates
    )
    offset = torch.zeros_like(scores) if agnostic else classes.to(boxes.dtype) * CLASS_OFFSET
    res = nms_sorted(boxes + offset[..., None], valid, iou=iou, max_det=max_det, block=block, iters=iters, total=total)
    zero = torch.zeros((), dtype=boxes.dtype, device=boxes.device)
    pick = res.index
    out_boxes = torch.where(res.valid[..., None], boxes.gather(1, pick[..., None].expand(-1, -1, 4)), zero)
    out_scores = torch.where(res.valid, scores.gather(1, pick), zero)
    out_classes = torch.where(res.valid, classes.gather(1, pick), torch.zeros_like(pick))
    out_extra = torch.where(res.valid[..., None], extra.gather(1, pick[..., None].expand(-1, -1, extra.shape[-1])), zero)
    return out_boxes, out_scores, out_classes.long(), out_extra, res


def _check_args(conf, iou, max_det, max_candidates, mask_method=None):
    if not 0.0 <= conf < 1.0:
        raise ValueError(f"[yolo_func] postprocess: conf must be in [0, 1), got {conf}")
    if not 0.0 <= iou <= 1.0:
        raise ValueError(f"[yolo_func] postprocess: iou must be in [0, 1], got {iou}")
    if not isinstance(max_det, int) or max_det < 1:
        raise ValueError(f"[yolo_func] postprocess: max_det must be a positive int, got {max_det!r}")
    if not isinstance(max_candidates, int) or max_candidates < 1:
        raise ValueError(f"[yolo_func] postprocess: max_candidates must be a positive int, got {max_candidates!r}")
    if mask_method is not None and mask_method not in M.MASK_METHODS:
        raise ValueError(f"[yolo_func] postprocess: mask_method must be one of {list(M.MASK_METHODS)}, got {mask_method!r}")


# -- public ---------------------------------------------------------------------------------------


def postprocess(
    inference: Inference,
    *,
    conf: float = 0.25,
    iou: float = 0.7,
    max_det: int = 300,
    multi_label: bool = False,
    agnostic: bool = False,
    num_classes: int | None = None,
    kpt_shape: tuple[int, int] | None = None,
    mask_method: str = "predict",
    letterbox: Sequence[Letterbox] | None = None,
    max_candidates: int = MAX_CANDIDATES,
    block: int = 256,
    masks: bool = True,
    clip: bool = True,
) -> list[Detections]:
    """NMS, masks and keypoints for a batch of raw inference outputs (REFERENCE.md §3.2-3.4).

    Args:
      inference: ``Model.predict`` output: ``y float[B, 4 + K + E, A]`` ((cx, cy, w, h) input
        pixels, class probabilities, E extra channels) and ``protos float[B, NM, Hp, Wp]`` or None.
      conf: keep rows with class score > conf (val uses 0.001, predict 0.25).
      iou: suppress when IoU > iou.
      max_det: at most this many detections per image.
      multi_label: one row per (anchor, class) above ``conf`` (validation) instead of the best class.
      agnostic: class-agnostic NMS.
      num_classes: K; needed only to check the layout (inferred from the channels otherwise).
      kpt_shape: (P, D) for a pose model's output (required to split its channels).
      mask_method: ``"val"`` (prototype resolution), ``"predict"`` (input size) or ``"native"``
        (original size; needs ``letterbox``). See :mod:`yolo_func.eval.masks`.
      letterbox: one :class:`Letterbox` per image: the results are then in original-image pixels
        (:func:`scale_to_original`; masks of ``"native"`` come straight from the logits).
      max_candidates: rows per image kept before NMS (the reference's 30 000).
      block: NMS block size (memory ``B * block^2`` booleans; results do not depend on it).
      masks: assemble masks for a segmentation model's output (False: ``masks`` None, e.g. when
        only boxes are scored).
      clip: with ``letterbox``, clip boxes and keypoints to the original image (see
        :func:`scale_to_original`; False for the reference's validation metric).

    Returns:
      B :class:`Detections` in descending score order. Floats are float32 (float64 inputs stay
      float64) whatever the inference dtype.

    Raises:
      TypeError: ``inference`` is not an :class:`~yolo_func.Inference`.
      ValueError: bad thresholds, a channel layout that does not split, a letterbox list of the
        wrong length, or ``"native"`` masks without a letterbox.

    Example:
      >>> import torch
      >>> from yolo_func import Inference
      >>> y = torch.zeros(1, 4 + 2, 3)                    # float[B, 4 + K, A]: three candidate boxes, K = 2
      >>> y[0, :4] = torch.tensor([[10.0, 11.0, 40.0], [10.0, 10.0, 40.0], [8.0, 8.0, 8.0], [8.0, 8.0, 8.0]])
      >>> y[0, 4] = torch.tensor([0.9, 0.8, 0.7])          # class 0 scores; boxes 0 and 1 overlap
      >>> inf = Inference(y)
      >>> from yolo_func.eval import postprocess
      >>> d = postprocess(inf, conf=0.25, iou=0.5)[0]      # NMS drops box 1 (IoU with box 0 > 0.5)
      >>> d.boxes.tolist(), d.scores.tolist(), d.classes.tolist()
      ([[6.0, 6.0, 14.0, 14.0], [36.0, 36.0, 44.0, 44.0]], [0.8999999761581421, 0.699999988079071], [0, 0])
    """
    _check_args(conf, iou, max_det, max_candidates, mask_method)
    _check_letterbox(inference, mask_method, letterbox)
    sel = _select(inference, conf=conf, iou=iou, max_det=max_det, multi_label=multi_label, agnostic=agnostic,
                  num_classes=num_classes, kpt_shape=kpt_shape, max_candidates=max_candidates, block=block)
    return _assemble(inference, sel, mask_method=mask_method, letterbox=letterbox, masks=masks, clip=clip)


def postprocess_with_coco(
    inference: Inference,
    *,
    coco_letterbox: Sequence[Letterbox],
    max_per_category: int | None = COCO_MAX_DETS,
    category_of: Sequence[int] | torch.Tensor | None = None,
    coco_masks: bool = True,
    conf: float = 0.25,
    iou: float = 0.7,
    max_det: int = 300,
    multi_label: bool = False,
    agnostic: bool = False,
    num_classes: int | None = None,
    kpt_shape: tuple[int, int] | None = None,
    mask_method: str = "predict",
    letterbox: Sequence[Letterbox] | None = None,
    max_candidates: int = MAX_CANDIDATES,
    block: int = 256,
    masks: bool = True,
    clip: bool = True,
) -> tuple[list[Detections], list[Detections]]:
    """One NMS, two outputs: :func:`postprocess`'s detections and the COCO records' detections.

    The first list equals ``postprocess(inference, conf=..., ..., mask_method=mask_method,
    letterbox=letterbox, masks=masks)``. The second is ``postprocess(inference, ...,
    mask_method="native", letterbox=coco_letterbox)`` (original-image pixels, masks at the original
    size) restricted to the first ``max_per_category`` detections of each (image, category), in
    the same order: the rows pycocotools' ``COCOeval`` can score (:func:`top_per_category`); masks
    are assembled at the original size for those rows only. The NMS, which the two calls would
    each run, runs once.

    Args:
      inference: as in :func:`postprocess`.
      coco_letterbox: one :class:`Letterbox` per image (the COCO records are in original pixels).
      max_per_category: detections kept per (image, category); None keeps all. The default,
        :data:`COCO_MAX_DETS` = 100, is the most ``COCOeval`` reads for any iou type.
      category_of: int[K], the category of each class (classes sharing a category share its cap);
        default: each class its own.
      coco_masks: assemble the COCO detections' masks (segmentation models).
      conf, iou, max_det, multi_label, agnostic, num_classes, kpt_shape, mask_method, letterbox,
        max_candidates, block, masks, clip: as in :func:`postprocess`, for the first list (the COCO
        detections are always clipped to the image).

    Returns:
      ``(detections, coco_detections)``: two lists of B :class:`Detections`.

    Raises:
      ValueError: as :func:`postprocess`; a ``coco_letterbox`` of the wrong length; a
        ``max_per_category`` < 1.

    Example:
      >>> import torch
      >>> from yolo_func import Inference
      >>> from yolo_func.eval import Letterbox
      >>> y = torch.zeros(1, 4 + 2, 3)                    # float[B, 4 + K, A]: three separate boxes, K = 2
      >>> y[0, :4] = torch.tensor([[10.0, 30.0, 50.0], [10.0, 10.0, 10.0], [8.0, 8.0, 8.0], [8.0, 8.0, 8.0]])
      >>> y[0, 4] = torch.tensor([0.9, 0.8, 0.7])          # all class 0
      >>> lb = [Letterbox((64, 64), 1.0, (0.0, 0.0))]
      >>> dets, coco = postprocess_with_coco(Inference(y), coco_letterbox=lb, max_per_category=2, conf=0.25)
      >>> dets[0].scores.tolist() == [0.8999999761581421, 0.800000011920929, 0.699999988079071], coco[0].scores.shape
      (True, torch.Size([2]))
    """
    _check_args(conf, iou, max_det, max_candidates, mask_method)
    _check_letterbox(inference, mask_method, letterbox)
    B = inference.y.shape[0]
    if len(coco_letterbox) != B:
        raise ValueError(f"[yolo_func] postprocess_with_coco: coco_letterbox must hold one Letterbox per image ({B}), "
                         f"got {len(coco_letterbox)}")
    if max_per_category is not None and (not isinstance(max_per_category, int) or max_per_category < 1):
        raise ValueError(f"[yolo_func] postprocess_with_coco: max_per_category must be a positive int or None, "
                         f"got {max_per_category!r}")
    sel = _select(inference, conf=conf, iou=iou, max_det=max_det, multi_label=multi_label, agnostic=agnostic,
                  num_classes=num_classes, kpt_shape=kpt_shape, max_candidates=max_candidates, block=block)
    dets = _assemble(inference, sel, mask_method=mask_method, letterbox=letterbox, masks=masks, clip=clip)
    rows = None
    if max_per_category is not None:
        valid = torch.arange(sel.boxes.shape[1], device=sel.boxes.device)[None] < torch.tensor(
            sel.counts, device=sel.boxes.device)[:, None]
        keep = top_per_category(sel.classes, valid, max_per_category, category_of=category_of)
        if not bool((keep == valid).all()):  # something to drop (one host read)
            kept = keep.sum(1)
            order = torch.sort((~keep).to(torch.uint8), dim=1, stable=True).indices  # kept rows first, in order
            rows = [order[b, :n] for b, n in enumerate(kept.tolist())]
    coco = _assemble(inference, sel, mask_method="native", letterbox=coco_letterbox, masks=coco_masks, rows=rows)
    return dets, coco


def top_per_category(classes: torch.Tensor, valid: torch.Tensor, k: int, *,
                     category_of: Sequence[int] | torch.Tensor | None = None) -> torch.Tensor:
    """The rows among the first ``k`` valid ones of their (image, category), rows in rank order.

    pycocotools' ``COCOeval`` scores, per (image, category), the ``maxDets[-1]`` highest-scoring
    detections (100 for ``bbox`` / ``segm``, 20 for ``keypoints``), sorted by a stable
    ``np.argsort(-score, kind="mergesort")``: among equal scores the earlier record first.
    :func:`postprocess`'s detections are in descending score order (ties: lower candidate rank
    first), the COCO records keep that order and their 5-decimal rounding of the scores keeps it
    non-increasing, so ``COCOeval``'s choice is exactly the first ``k`` records of each (image,
    category): rows past them can never change its numbers. Vectorised (one stable sort per
    image row), no per-box loop.

    Args:
      classes: int64[B, D], each row's class, rows in rank order.
      valid: bool[B, D]; invalid rows are never kept and do not count.
      k: rows kept per (image, category), >= 1.
      category_of: int[K], each class's category (default: the class itself).

    Returns:
      bool[B, D]: valid and among the first ``k`` of its (image, category).

    Example:
      >>> classes = torch.tensor([[0, 1, 0, 0, 1, 2]])
      >>> top_per_category(classes, torch.ones(1, 6, dtype=torch.bool), 2).tolist()
      [[True, True, True, False, True, True]]
      >>> top_per_category(classes, torch.ones(1, 6, dtype=torch.bool), 2, category_of=[0, 1, 1]).tolist()
      [[True, True, True, False, True, False]]
    """
    if classes.shape != valid.shape or classes.dim() != 2:
        raise ValueError(f"[yolo_func] top_per_category: expected classes int64[B, D] and valid bool[B, D], got "
                         f"{tuple(classes.shape)} and {tuple(valid.shape)}")
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"[yolo_func] top_per_category: k must be a positive int, got {k!r}")
    B, D = classes.shape
    if D == 0:
        return valid.clone()
    group = classes.long()
    if category_of is not None:
        cats = torch.as_tensor(category_of, dtype=torch.int64, device=classes.device)
        group = cats[group]
    # invalid rows in a group of their own, sorted after every category
    group = torch.where(valid, group, torch.full_like(group, torch.iinfo(torch.int64).max))
    sg, order = torch.sort(group, dim=1, stable=True)  # each category's rows together, in rank order
    pos = torch.arange(D, device=classes.device).expand(B, D)
    starts = torch.ones_like(sg, dtype=torch.bool)
    starts[:, 1:] = sg[:, 1:] != sg[:, :-1]
    first = torch.where(starts, pos, torch.zeros_like(pos)).cummax(1).values  # where the row's group starts
    within = torch.empty_like(pos).scatter_(1, order, pos - first)  # rank inside its (image, category)
    return valid & (within < k)


class _Selected(NamedTuple):
    """The NMS's kept rows of a batch, padded: boxes float[B, D, 4] xyxy input pixels, scores float[B, D],
    classes int64[B, D], extra float[B, D, E] (mask coefficients or flat keypoints), counts (host
    ints, the real rows per image), kpts (P, Dk) or None."""

    boxes: torch.Tensor
    scores: torch.Tensor
    classes: torch.Tensor
    extra: torch.Tensor
    counts: list
    kpts: tuple | None


def _check_letterbox(inference, mask_method, letterbox) -> None:
    _check_inference(inference)  # first: the letterbox checks read inference.y
    B = inference.y.shape[0]
    if letterbox is not None and len(letterbox) != B:
        raise ValueError(f"[yolo_func] postprocess: letterbox must hold one Letterbox per image ({B}), got {len(letterbox)}")
    if mask_method == "native" and inference.protos is not None and letterbox is None:
        raise ValueError('[yolo_func] postprocess: mask_method="native" needs letterbox=[Letterbox(orig_shape, gain, pad), ...]')


def _select(inference, *, conf, iou, max_det, multi_label, agnostic, num_classes, kpt_shape, max_candidates, block) -> _Selected:
    K, kpts = _layout(inference, num_classes, kpt_shape)
    boxes, scores, classes, extra, res = _nms(
        inference, K, conf=conf, iou=iou, max_det=max_det, multi_label=multi_label, agnostic=agnostic,
        n_cand=None, max_candidates=max_candidates, block=block, iters=None,
    )
    return _Selected(boxes, scores, classes, extra, res.count.tolist(), kpts)  # sizes: a host read


def _assemble(inference, sel: _Selected, *, mask_method, letterbox, masks, rows=None, clip=True) -> list[Detections]:
    """Per-image :class:`Detections` of the selected rows (``rows``: per image, the indices of the
    rows to return, in order; None: all of them), masks assembled for those rows only."""
    boxes, scores, classes, extra, counts, kpts = sel
    B, D = boxes.shape[:2]
    keypoints = extra.reshape(B, D, *kpts) if kpts is not None else None
    with_masks = inference.protos is not None and masks
    input_shape = _input_shape(inference)
    if letterbox is not None:  # boxes and keypoints of the whole batch at once (as scale_to_original)
        orig_boxes, orig_kpts = _scale_batch(boxes, keypoints, letterbox, clip)
    val_masks = None
    if with_masks and mask_method == "val":  # the whole batch in one matmul + crop, kept rows only
        d = max(counts, default=0)
        val_masks = M.masks_val(inference.protos, extra[:, :d], boxes[:, :d], input_shape)

    def pick(t, b, n):
        return t[b, :n] if rows is None else t[b, :n][rows[b]]

    out = []
    for b, n in enumerate(counts):
        det = Detections(pick(boxes, b, n), pick(scores, b, n), pick(classes, b, n),
                         keypoints=None if keypoints is None else pick(keypoints, b, n))
        orig = None
        if letterbox is not None:
            orig = det._replace(boxes=pick(orig_boxes, b, n), keypoints=None if orig_kpts is None else pick(orig_kpts, b, n))
        if with_masks:
            if mask_method == "native":
                lb = letterbox[b]
                # the logits of every kept row (the matmul as postprocess always ran it), then the rows asked for
                logits = M.mask_logits(inference.protos[b], extra[b, :n])
                m = M.masks_native_from_logits(
                    logits if rows is None else logits[rows[b]], orig.boxes, input_shape=input_shape,
                    orig_shape=tuple(lb.orig_shape), gain=lb.gain, pad=tuple(lb.pad),
                )
                out.append(orig._replace(masks=m))
                continue
            if val_masks is not None:
                m = pick(val_masks, b, n)
            else:
                m = M.masks_predict(inference.protos[b], pick(extra, b, n), det.boxes, input_shape)
            if orig is not None:
                lb = letterbox[b]
                m = M.rescale_masks(m, input_shape=input_shape, orig_shape=(int(lb.orig_shape[0]), int(lb.orig_shape[1])),
                                    gain=lb.gain, pad=(float(lb.pad[0]), float(lb.pad[1])))
                out.append(orig._replace(masks=m))
                continue
            det = det._replace(masks=m)
        out.append(det if orig is None else orig)
    return out


def _scale_batch(boxes: torch.Tensor, keypoints: torch.Tensor | None, letterbox: Sequence[Letterbox], clip: bool = True):
    """:func:`scale_to_original` of boxes float[B, D, 4] and keypoints float[B, D, P, Dk] | None for
    the whole batch (the same elementwise operations, so bitwise the same numbers; one small
    host-to-device copy instead of two per image)."""
    rows = []
    for lb in letterbox:
        gy, gx = M.gains(lb.gain)
        h0, w0 = int(lb.orig_shape[0]), int(lb.orig_shape[1])
        rows.append((float(lb.pad[0]), float(lb.pad[1]), gx, gy, w0, h0))
    t = torch.tensor(rows, dtype=boxes.dtype).to(boxes.device, non_blocking=True)[:, None]  # [B, 1, 6]
    pad, gain, lim = t[..., 0:2], t[..., 2:4], t[..., 4:6]
    zero = torch.zeros((), dtype=boxes.dtype, device=boxes.device)
    def undo(xy, lim):
        xy = (xy - pad[..., None, :]) / gain[..., None, :]
        return torch.minimum(torch.maximum(xy, zero), lim) if clip else xy

    xy = undo(boxes.unflatten(-1, (2, 2)), lim[..., None, :]).flatten(-2)
    kp = None
    if keypoints is not None:
        kp = torch.cat((undo(keypoints[..., :2], lim[..., None, :]), keypoints[..., 2:]), -1)
    return xy, kp


def _input_shape(inference: Inference) -> tuple[int, int] | None:
    """Network input (H, W): 4x the prototype size for segmentation models, else unknown."""
    if inference.protos is None:
        return None
    hp, wp = inference.protos.shape[-2:]
    return (4 * hp, 4 * wp)


def postprocess_static(
    inference: Inference,
    *,
    conf: float = 0.25,
    iou: float = 0.7,
    max_det: int = 300,
    multi_label: bool = False,
    agnostic: bool = False,
    num_classes: int | None = None,
    kpt_shape: tuple[int, int] | None = None,
    max_candidates: int = MAX_CANDIDATES,
    block: int = 256,
    iters: int = 16,
    masks: bool = True,
    candidates: int = STATIC_CANDIDATES,
) -> PaddedDetections:
    """Static-shape :func:`postprocess`: same rules, fixed shapes, no host sync (CUDA-graph capturable).

    Every image gets its N = ``min(candidates, max_candidates, rows)`` highest-ranked rows (rows at
    or below ``conf`` carried as invalid), the ``[B, N, N]`` suppression matrix is built once and
    the greedy rule runs ``iters`` Jacobi passes over it (:func:`yolo_func.eval.nms.nms_sorted`).
    Greedy NMS decides rank i from ranks < i only, so the first N ranks are decided exactly as the
    eager form decides them: the result equals :func:`postprocess` wherever ``converged`` is True,
    i.e. where the passes reached the greedy answer and either ``max_det`` boxes were kept within
    those N rows or the image has no more than N valid rows (after the ``max_candidates`` cap).
    Elsewhere ``converged`` is False (and :func:`~yolo_func.eval.evaluate`'s replay redoes the
    batch eagerly).

    Args:
      inference: as in :func:`postprocess`.
      conf, iou, max_det, multi_label, agnostic, num_classes, kpt_shape, max_candidates:
        as in :func:`postprocess`.
      block: rows of the suppression matrix per IoU step (memory ``B * block * N`` floats; results
        do not depend on it).
      iters: Jacobi passes of the greedy rule (``iters >= N`` is always exact; clustered detections
        settle in a handful).
      masks: assemble masks at prototype resolution (the ``"val"`` method) for segmentation models.
      candidates: N, the rows per image given to the NMS (work ``B * N^2 / 2`` IoUs and
        ``B * N^2`` per pass; the eager form ranks up to ``max_candidates`` = 30 000). Raise it
        when images keep fewer than ``max_det`` boxes among more than N valid rows (``converged``
        False).

    Returns:
      :class:`PaddedDetections` with D = ``max_det``.

    Raises:
      TypeError, ValueError: as :func:`postprocess`.

    Example:
      >>> import torch
      >>> from yolo_func import Inference
      >>> y = torch.zeros(1, 4 + 2, 3)                    # float[B, 4 + K, A]: three candidate boxes, K = 2
      >>> y[0, :4] = torch.tensor([[10.0, 11.0, 40.0], [10.0, 10.0, 40.0], [8.0, 8.0, 8.0], [8.0, 8.0, 8.0]])
      >>> y[0, 4] = torch.tensor([0.9, 0.8, 0.7])          # class 0 scores; boxes 0 and 1 overlap
      >>> inf = Inference(y)
      >>> from yolo_func.eval import postprocess_static
      >>> p = postprocess_static(inf, conf=0.25, iou=0.5, max_det=4)   # PaddedDetections, fixed shapes
      >>> tuple(p.boxes.shape), p.valid.tolist(), p.count.tolist(), p.converged.tolist()
      ((1, 4, 4), [[True, True, False, False]], [2], [True])
    """
    _check_args(conf, iou, max_det, max_candidates)
    if not isinstance(iters, int) or iters < 1:
        raise ValueError(f"[yolo_func] postprocess_static: iters must be a positive int, got {iters!r}")
    if not isinstance(candidates, int) or candidates < 1:
        raise ValueError(f"[yolo_func] postprocess_static: candidates must be a positive int, got {candidates!r}")
    K, kpts = _layout(inference, num_classes, kpt_shape)
    boxes, scores, classes, extra, res = _nms(
        inference, K, conf=conf, iou=iou, max_det=max_det, multi_label=multi_label, agnostic=agnostic,
        n_cand=min(candidates, max_candidates), max_candidates=max_candidates, block=block, iters=iters,
    )
    B = boxes.shape[0]
    out_masks = out_kpts = None
    if kpts is not None:
        out_kpts = extra.reshape(B, max_det, *kpts)
    if inference.protos is not None and masks:
        # padded rows have zero boxes, which crop their masks to nothing
        out_masks = M.masks_val(inference.protos, extra, boxes, _input_shape(inference))
    return PaddedDetections(boxes, scores, classes, res.valid, res.count, out_masks, out_kpts, res.converged)


def unpad(padded: PaddedDetections) -> list[Detections]:
    """Split :class:`PaddedDetections` into one :class:`Detections` per image (one host read).

    Args:
      padded: a static-shape batch.

    Returns:
      B :class:`Detections` (views into the padded tensors).

    Example:
      >>> import torch
      >>> from yolo_func import Inference
      >>> y = torch.zeros(1, 4 + 2, 3)                    # float[B, 4 + K, A]: three candidate boxes, K = 2
      >>> y[0, :4] = torch.tensor([[10.0, 11.0, 40.0], [10.0, 10.0, 40.0], [8.0, 8.0, 8.0], [8.0, 8.0, 8.0]])
      >>> y[0, 4] = torch.tensor([0.9, 0.8, 0.7])          # class 0 scores; boxes 0 and 1 overlap
      >>> inf = Inference(y)
      >>> from yolo_func.eval import postprocess_static, unpad
      >>> dets = unpad(postprocess_static(inf, conf=0.25, iou=0.5, max_det=4))
      >>> len(dets), dets[0].boxes.shape
      (1, torch.Size([2, 4]))
    """
    out = []
    for b, n in enumerate(padded.count.tolist()):
        out.append(
            Detections(
                padded.boxes[b, :n], padded.scores[b, :n], padded.classes[b, :n],
                None if padded.masks is None else padded.masks[b, :n],
                None if padded.keypoints is None else padded.keypoints[b, :n],
            )
        )
    return out


def clip_detections(detections: Detections, orig_shape: tuple[int, int]) -> Detections:
    """Boxes and keypoints clipped to the image ``[0, w0] x [0, h0]`` (scores, classes, masks and
    keypoint confidences untouched): ``scale_to_original(d, ..., clip=False)`` followed by this
    equals ``scale_to_original(d, ..., clip=True)`` bit for bit.

    Args:
      detections: one image's :class:`Detections` in original pixels, boxes float[N, 4] xyxy,
        keypoints float[N, P, D] or None.
      orig_shape: (h0, w0).

    Returns:
      :class:`Detections`.

    Example:
      >>> import torch
      >>> from yolo_func.eval import Detections, clip_detections
      >>> d = Detections(torch.tensor([[-4.0, 2.0, 70.0, 30.0]]), torch.tensor([0.9]), torch.tensor([0]))
      >>> clip_detections(d, (32, 64)).boxes
      tensor([[ 0.,  2., 64., 30.]])
    """
    h0, w0 = int(orig_shape[0]), int(orig_shape[1])
    k = detections.keypoints
    if k is not None:
        k = torch.cat((k[..., :1].clamp(0, w0), k[..., 1:2].clamp(0, h0), k[..., 2:]), -1)
    return detections._replace(boxes=clip_boxes(detections.boxes, (h0, w0)), keypoints=k)


def scale_to_original(
    detections: Detections,
    *,
    orig_shape: tuple[int, int],
    gain: float | tuple[float, float],
    pad: tuple[float, float],
    input_shape: tuple[int, int] | None = None,
    clip: bool = True,
) -> Detections:
    """Undo the letterbox: from network-input pixels to original-image pixels.

    Boxes and keypoints: ``(xy - pad) / gain`` (per axis) then, with ``clip``, clipped to
    ``[0, w0] x [0, h0]`` (keypoint confidences untouched). Masks (covering the whole input at any resolution): the padding is
    cropped, the rest resized bilinearly to ``orig_shape`` and thresholded at 0.5
    (:func:`yolo_func.eval.masks.rescale_masks`).

    Args:
      detections: one image's :class:`Detections` in input pixels.
      orig_shape: (h0, w0).
      gain: input pixels per original pixel: one number, or (gain_y, gain_x) as the reference's
        ``ratio_pad[0]``.
      pad: (left, top) padding in input pixels.
      input_shape: (H, W) of the network input; needed only with masks, and inferred as
        ``round(orig * gain + 2 * pad)`` (a centred letterbox) when not given.
      clip: clip boxes and keypoints to the image (predictions, COCO records). False keeps them
        as the network placed them, possibly past the image: the reference's internal
        validation metric scores those (:func:`yolo_func.eval.evaluate`); masks are unaffected.

    Returns:
      :class:`Detections` in original-image pixels (masks bool[N, h0, w0]).

    Raises:
      ValueError: a non-positive gain or a malformed shape / pad.

    Example:
      >>> import torch
      >>> from yolo_func.eval import Detections, scale_to_original
      >>> d = Detections(torch.tensor([[0.0, 8.0, 32.0, 40.0]]), torch.tensor([0.9]), torch.tensor([0]))
      >>> scale_to_original(d, orig_shape=(480, 640), gain=0.1, pad=(0.0, 8.0)).boxes   # (xy - pad) / gain
      tensor([[  0.,   0., 320., 320.]])
    """
    if not isinstance(detections, Detections):
        raise TypeError(f"[yolo_func] scale_to_original: detections must be Detections, got {type(detections).__name__}")
    if len(orig_shape) != 2 or len(pad) != 2:
        raise ValueError(
            f"[yolo_func] scale_to_original: expected orig_shape (h0, w0) and pad (left, top), got {orig_shape!r} and {pad!r}"
        )
    gy, gx = M.gains(gain)
    h0, w0 = int(orig_shape[0]), int(orig_shape[1])
    px, py = float(pad[0]), float(pad[1])
    b = detections.boxes
    out = detections._replace(boxes=(b - b.new_tensor([px, py, px, py])) / b.new_tensor([gx, gy, gx, gy]))
    k = detections.keypoints
    if k is not None:
        x = (k[..., 0] - px) / gx
        y = (k[..., 1] - py) / gy
        out = out._replace(keypoints=torch.cat((x[..., None], y[..., None], k[..., 2:]), -1))
    if clip:
        out = clip_detections(out, (h0, w0))
    if detections.masks is not None:
        if input_shape is None:
            input_shape = (int(round(h0 * gy + 2 * py)), int(round(w0 * gx + 2 * px)))
        out = out._replace(
            masks=M.rescale_masks(detections.masks, input_shape=input_shape, orig_shape=(h0, w0), gain=gain, pad=(px, py))
        )
    return out
