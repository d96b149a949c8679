"""Static-shape targets (:class:`yolo_func.structures.Targets`): builders, padding and validation.

The builders run in the data pipeline (host-side logic is fine there); the loss and assignment
path only ever sees the padded result, whose shapes repeat across steps because the number of
slots ``M`` is bucketed to a power of two (:func:`bucket_size`).

Rules applied by the builders (documented behaviour, tested):

* **Clipping.** Boxes are converted to xyxy pixels and clipped to the image ``[0, W] x [0, H]``.
* **Degenerate boxes.** A box whose clipped width or height is ``<= 0`` (zero area, or wholly
  outside the image) is *ignored*: its slot keeps its position (so overlap-mask indices and
  keypoint rows still line up) but is marked ``valid=False`` and its box, class and keypoints are
  zeroed. Invalid slots are never assigned to an anchor.
* **Slot order.** The j-th target of image b is the j-th row of image b in input order, which is
  the reference's order (REFERENCE.md §2.1): overlap-mask value ``j + 1`` is slot ``j``.
* **Padding** rows are zeros with ``valid=False``.

Non-finite values (NaN / inf) raise ``ValueError`` naming the tensor, in the builders and in the
debug helpers :func:`validate_targets`, :func:`validate_preds` and :func:`check_finite` (which are
never called in the hot path: each is a host sync).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from yolo_func.structures.records import Targets
from yolo_func.structures.boxes import box_area, clip_boxes, xywh_to_xyxy

__all__ = [
    "bucket_size",
    "targets_from_flat",
    "targets_from_lists",
    "pad_targets",
    "validate_targets",
    "validate_preds",
    "check_finite",
]


def bucket_size(n: int, minimum: int = 8) -> int:
    """The padded target count for ``n`` real targets: the next power of two ``>= max(n, minimum)``.

    Args:
      n: number of real targets (>= 0).
      minimum: smallest bucket (8).

    Returns:
      int, e.g. ``bucket_size(0) == 8``, ``bucket_size(9) == 16``, ``bucket_size(16) == 16``.
    """
    if n < 0 or minimum < 1:
        raise ValueError(f"[yolo_func] bucket_size: need n >= 0 and minimum >= 1, got n={n}, minimum={minimum}")
    m = max(int(n), int(minimum))
    return 1 << (m - 1).bit_length()


def check_finite(**named: torch.Tensor | None) -> None:
    """Raise if any floating tensor holds NaN or inf (debug helper: it syncs with the host).

    Args:
      **named: tensors by the name to report; ``None`` and integer tensors are skipped.

    Raises:
      ValueError: ``"[yolo_func] <name> contains <n> non-finite values (NaN/inf) ..."``.
    """
    for name, t in named.items():
        if t is None or not torch.is_tensor(t) or not t.is_floating_point():
            continue
        bad = int((~torch.isfinite(t)).sum())
        if bad:
            raise ValueError(
                f"[yolo_func] {name} contains {bad} non-finite values (NaN/inf) in a tensor of shape "
                f"{tuple(t.shape)}; expected all finite. Check the data pipeline / the learning rate."
            )


def validate_preds(preds: Any, name: str = "preds") -> None:
    """Check every tensor field of a predictions record (``DetectPreds``, ``SegmentPreds``,
    ``PosePreds``) for NaN / inf. Debug helper, not for the hot path.

    Raises:
      ValueError: naming the field, e.g. ``preds.cls_logits``.
    """
    fields = preds._asdict() if hasattr(preds, "_asdict") else dict(preds)
    check_finite(**{f"{name}.{k}": v for k, v in fields.items()})


def _expect(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(f"[yolo_func] {msg}")


def validate_targets(t: Targets, image_size: tuple[int, int] | None = None) -> None:
    """Check a :class:`Targets` record: shapes, dtypes, finiteness and the validity rules.

    Debug / data-pipeline helper (it syncs with the host); never call it inside a training step.

    Args:
      t: the targets. ``boxes float[B, M, 4]``, ``classes int64[B, M]``, ``valid bool[B, M]``,
        optional ``masks`` int64[B, Hm, Wm] (overlap) or float[B, M, Hm, Wm], optional
        ``keypoints float[B, M, P, 2|3]``.
      image_size: (H, W) in pixels; when given, valid boxes must lie inside the image.

    Raises:
      ValueError: naming the offending tensor (``targets.boxes`` ...), with expected and actual
        shape / dtype, or the count of non-finite values.
    """
    _expect(t.boxes.ndim == 3 and t.boxes.shape[-1] == 4,
            f"targets.boxes: expected float[B, M, 4], got shape {tuple(t.boxes.shape)}")
    B, M = t.boxes.shape[:2]
    _expect(t.boxes.is_floating_point(), f"targets.boxes: expected a floating dtype, got {t.boxes.dtype}")
    _expect(tuple(t.classes.shape) == (B, M) and t.classes.dtype == torch.int64,
            f"targets.classes: expected int64[{B}, {M}], got {t.classes.dtype}{list(t.classes.shape)}")
    _expect(tuple(t.valid.shape) == (B, M) and t.valid.dtype == torch.bool,
            f"targets.valid: expected bool[{B}, {M}], got {t.valid.dtype}{list(t.valid.shape)}")
    if t.masks is not None:
        ok = (t.masks.ndim == 3 and t.masks.shape[0] == B and not t.masks.is_floating_point()) or (
            t.masks.ndim == 4 and tuple(t.masks.shape[:2]) == (B, M))
        _expect(ok, f"targets.masks: expected int64[{B}, Hm, Wm] (overlap) or float[{B}, {M}, Hm, Wm], "
                    f"got {t.masks.dtype}{list(t.masks.shape)}")
    if t.keypoints is not None:
        _expect(t.keypoints.ndim == 4 and tuple(t.keypoints.shape[:2]) == (B, M) and t.keypoints.shape[-1] in (2, 3),
                f"targets.keypoints: expected float[{B}, {M}, P, 2|3], got shape {tuple(t.keypoints.shape)}")
    check_finite(**{"targets.boxes": t.boxes, "targets.masks": t.masks, "targets.keypoints": t.keypoints})
    area = box_area(t.boxes)
    _expect(bool((area[t.valid] > 0).all()), "targets.boxes: a valid box has zero area; mark it valid=False "
                                             "(the builders do) or fix the box")
    if image_size is not None:
        h, w = image_size
        vb = t.boxes[t.valid]
        inside = (vb[:, 0] >= 0) & (vb[:, 1] >= 0) & (vb[:, 2] <= w) & (vb[:, 3] <= h)
        _expect(bool(inside.all()), f"targets.boxes: valid boxes must lie inside the image (H, W) = {tuple(image_size)}; "
                                    "the builders clip them")


def _slots(batch_idx: torch.Tensor, batch_size: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Image index and within-image position (input order) of every flat row, plus the max count."""
    b = batch_idx.reshape(-1).long()
    n = b.numel()
    if n and (int(b.min()) < 0 or int(b.max()) >= batch_size):
        raise ValueError(f"[yolo_func] batch_idx: values must lie in [0, {batch_size}), "
                         f"got min {int(b.min())} max {int(b.max())}")
    counts = torch.bincount(b, minlength=batch_size)
    order = torch.argsort(b, stable=True)  # stable: keeps the input order inside each image
    offsets = counts.cumsum(0) - counts
    slot = torch.empty_like(b)
    slot[order] = torch.arange(n, device=b.device) - offsets[b[order]]
    return b, slot, int(counts.max()) if n else 0


def _resolve_m(count: int, max_boxes: int | None) -> int:
    if max_boxes is None:
        return bucket_size(count)
    if count > max_boxes:
        raise ValueError(f"[yolo_func] max_boxes: an image has {count} targets but max_boxes={max_boxes}; "
                         "raise max_boxes (truncating would break overlap-mask indices)")
    return int(max_boxes)


def targets_from_flat(
    batch_idx: torch.Tensor,
    cls: torch.Tensor,
    bboxes_xywh_norm: torch.Tensor,
    *,
    batch_size: int,
    image_size: tuple[int, int],
    masks: torch.Tensor | None = None,
    keypoints: torch.Tensor | None = None,
    max_boxes: int | None = None,
    overlap_masks: bool = True,
) -> Targets:
    """Build padded :class:`Targets` from the reference's flat batch form (REFERENCE.md §2.1).

    Boxes are scaled to pixels, converted to xyxy and clipped to the image; boxes with zero
    clipped area are ignored (slot kept, ``valid=False``, row zeroed). See the module docstring.

    Args:
      batch_idx: float or int [N] image index of every row.
      cls: [N] or [N, 1] class ids.
      bboxes_xywh_norm: float[N, 4] normalised (cx, cy, w, h).
      batch_size: B (images without rows get only padding).
      image_size: (H, W) of the network input in pixels.
      masks: with ``overlap_masks`` (the reference's ``overlap_mask=True``) an overlap map
        [B, Hm, Wm] whose pixel value is the 1-based slot within its image (kept as int64);
        otherwise per-instance float[N, Hm, Wm] in row order (scattered to float[B, M, Hm, Wm]).
      keypoints: float[N, P, 2|3] normalised x, y (and visibility 0/1/2); scaled to pixels.
      max_boxes: fixed M; default :func:`bucket_size` of the largest per-image count.
      overlap_masks: how ``masks`` is laid out (see above).

    Returns:
      ``Targets(boxes float32[B, M, 4], classes int64[B, M], valid bool[B, M], masks, keypoints
      float32[B, M, P, D])`` on the device of ``bboxes_xywh_norm``.

    Raises:
      ValueError: wrong shapes, NaN / inf (naming the tensor), a batch index out of range, or more
        targets in one image than ``max_boxes``.
    """
    H, W = image_size
    n = bboxes_xywh_norm.shape[0]
    if bboxes_xywh_norm.ndim != 2 or bboxes_xywh_norm.shape[-1] != 4:
        raise ValueError(f"[yolo_func] bboxes_xywh_norm: expected float[N, 4], got shape {tuple(bboxes_xywh_norm.shape)}")
    cls = cls.reshape(-1)
    if cls.shape[0] != n or batch_idx.reshape(-1).shape[0] != n:
        raise ValueError(f"[yolo_func] targets_from_flat: batch_idx, cls and bboxes_xywh_norm must have N={n} rows, "
                         f"got {batch_idx.reshape(-1).shape[0]} and {cls.shape[0]}")
    check_finite(bboxes_xywh_norm=bboxes_xywh_norm, keypoints=keypoints, cls=cls.float())
    device = bboxes_xywh_norm.device
    scale = torch.tensor([W, H, W, H], dtype=torch.float32, device=device)
    xyxy = xywh_to_xyxy(bboxes_xywh_norm.float() * scale)
    kpts_px = None
    if keypoints is not None:
        if keypoints.ndim != 3 or keypoints.shape[0] != n or keypoints.shape[-1] not in (2, 3):
            raise ValueError(f"[yolo_func] keypoints: expected float[N={n}, P, 2|3], got {tuple(keypoints.shape)}")
        D = keypoints.shape[-1]
        kpts_px = keypoints.float() * torch.tensor([W, H, 1.0][:D], dtype=torch.float32, device=device)
    return _assemble(batch_idx, cls, xyxy, batch_size=batch_size, image_size=image_size, masks=masks,
                     keypoints_px=kpts_px, max_boxes=max_boxes, overlap_masks=overlap_masks)


def _assemble(batch_idx, cls, xyxy, *, batch_size, image_size, masks, keypoints_px, max_boxes, overlap_masks) -> Targets:
    """Scatter flat rows (xyxy pixels) into padded slots, applying the clip / validity rules."""
    H, W = image_size
    n = xyxy.shape[0]
    b, slot, count = _slots(batch_idx, batch_size)
    M = _resolve_m(count, max_boxes)
    device = xyxy.device
    xyxy = clip_boxes(xyxy, (H, W))
    ok = box_area(xyxy) > 0
    boxes = torch.zeros(batch_size, M, 4, device=device)
    classes = torch.zeros(batch_size, M, dtype=torch.int64, device=device)
    valid = torch.zeros(batch_size, M, dtype=torch.bool, device=device)
    boxes[b, slot] = torch.where(ok[:, None], xyxy, torch.zeros_like(xyxy))
    classes[b, slot] = torch.where(ok, cls.long(), torch.zeros_like(cls.long()))
    valid[b, slot] = ok
    out_masks = None
    if masks is not None:
        if overlap_masks:
            if masks.ndim != 3 or masks.shape[0] != batch_size:
                raise ValueError(f"[yolo_func] masks: expected an overlap map [B={batch_size}, Hm, Wm], got {tuple(masks.shape)}")
            check_finite(masks=masks if masks.is_floating_point() else None)
            out_masks = (masks.round() if masks.is_floating_point() else masks).long().to(device)
        else:
            if masks.ndim != 3 or masks.shape[0] != n:
                raise ValueError(f"[yolo_func] masks: expected per-instance float[N={n}, Hm, Wm], got {tuple(masks.shape)}")
            check_finite(masks=masks)
            out_masks = torch.zeros(batch_size, M, *masks.shape[1:], device=device)
            out_masks[b, slot] = masks.float().to(device) * ok[:, None, None]
    out_kpts = None
    if keypoints_px is not None:
        P, D = keypoints_px.shape[1:]
        out_kpts = torch.zeros(batch_size, M, P, D, device=device)
        out_kpts[b, slot] = keypoints_px.to(device) * ok[:, None, None]
    return Targets(boxes, classes, valid, out_masks, out_kpts)


def targets_from_lists(
    boxes_list: Sequence[torch.Tensor],
    classes_list: Sequence[torch.Tensor],
    *,
    image_size: tuple[int, int],
    masks_list: Sequence[torch.Tensor] | None = None,
    keypoints_list: Sequence[torch.Tensor] | None = None,
    max_boxes: int | None = None,
) -> Targets:
    """Build padded :class:`Targets` from per-image lists (the same clipping / validity rules).

    Args:
      boxes_list: B tensors float[n_b, 4], xyxy in pixels.
      classes_list: B tensors int[n_b].
      image_size: (H, W) in pixels.
      masks_list: optional B tensors float[n_b, Hm, Wm] per-instance masks (-> float[B, M, Hm, Wm]).
      keypoints_list: optional B tensors float[n_b, P, 2|3], x, y in pixels (and visibility).
      max_boxes: fixed M; default :func:`bucket_size` of the largest n_b.

    Returns:
      :class:`Targets`.
    """
    if len(boxes_list) != len(classes_list):
        raise ValueError(f"[yolo_func] targets_from_lists: {len(boxes_list)} box tensors but {len(classes_list)} class tensors")
    B = len(boxes_list)
    H, W = image_size
    counts = [int(bx.shape[0]) for bx in boxes_list]
    batch_idx = torch.cat([torch.full((c,), i, dtype=torch.int64) for i, c in enumerate(counts)]) if B else torch.zeros(0)
    boxes = torch.cat([bx.reshape(-1, 4).float().cpu() for bx in boxes_list]) if B else torch.zeros(0, 4)
    check_finite(boxes_list=boxes)
    cls = torch.cat([c.reshape(-1).long().cpu() for c in classes_list]) if B else torch.zeros(0, dtype=torch.int64)
    masks = torch.cat([m.float().cpu() for m in masks_list]) if masks_list is not None else None
    kpts = torch.cat([k.float().cpu() for k in keypoints_list]) if keypoints_list is not None else None
    check_finite(keypoints_list=kpts)
    return _assemble(batch_idx, cls, boxes, batch_size=B, image_size=image_size, masks=masks,
                     keypoints_px=kpts, max_boxes=max_boxes, overlap_masks=False)


def pad_targets(t: Targets, M: int) -> Targets:
    """Pad a :class:`Targets` record to ``M >= t.boxes.shape[1]`` slots with inert rows.

    Args:
      t: targets with M0 slots.
      M: the new slot count.

    Returns:
      :class:`Targets` with M slots (boxes 0, classes 0, valid False, per-instance masks 0,
      keypoints 0; an overlap map is unchanged).

    Raises:
      ValueError: ``M`` smaller than the current slot count.
    """
    B, M0 = t.boxes.shape[:2]
    if M < M0:
        raise ValueError(f"[yolo_func] pad_targets: M={M} is smaller than the current {M0} slots")
    extra = M - M0
    if extra == 0:
        return t

    def pad(x: torch.Tensor) -> torch.Tensor:
        return torch.cat((x, x.new_zeros((B, extra, *x.shape[2:]))), 1)

    masks = t.masks
    if masks is not None and masks.ndim == 4:
        masks = pad(masks)
    return Targets(pad(t.boxes), pad(t.classes), pad(t.valid), masks,
                   pad(t.keypoints) if t.keypoints is not None else None)
