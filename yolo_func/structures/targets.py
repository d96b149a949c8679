"""Static-shape targets (:class:`yolo_func.structures.Targets`): builders, padding and validation.

The builders run in the data pipeline (host-side logic is fine there); the loss and assignment
path only ever sees the padded result, whose shapes repeat across steps because the number of
slots ``M`` is bucketed to a power of two (:func:`bucket_size`).

Rules applied by the builders (documented behaviour, tested):

* **Clipping.** Boxes are converted to xyxy pixels and clipped to the image ``[0, W] x [0, H]``.
* **Dropped boxes.** A box whose clipped width or height is ``<= 0`` (wholly outside the image,
  or zero width / height) is *dropped*, as the reference's data pipeline removes zero-area boxes
  after clipping (REFERENCE.md §4.6). Its slot keeps its position (so overlap-mask indices and
  keypoint rows still line up) but is marked ``valid=False`` and its box, class and keypoints are
  zeroed; it is never assigned to an anchor. The builders *count* what they drop: pass
  ``return_report=True`` to get ``(targets, TargetsReport(given, dropped))`` with per-image
  counts, so a data pipeline can log how many labels fell outside its crops.
* **Slot order.** The j-th target of image b is the j-th row of image b in input order, which is
  the reference's order (REFERENCE.md §2.1): overlap-mask value ``j + 1`` is slot ``j``.
* **Padding** rows are zeros with ``valid=False``.

Input errors raise ``ValueError`` (``TypeError`` for a non-tensor) naming the argument, the image
index, the row and the bad value, before anything is built:

* a class id that is not a whole number, is negative, or (when ``num_classes=K`` is passed) is
  ``>= K``; without ``num_classes`` ids above the model's range cannot be seen here, so pass the
  model's class count wherever the builders are called (the step's boundary check,
  :func:`yolo_func.structures.check_batch`, reads no values);
* boxes that are not ``[n, 4]``, and class / mask / keypoint tensors whose row count differs
  from the boxes';
* a reversed box: ``x2 < x1`` or ``y2 < y1`` (xyxy input), a negative width or height (the flat
  form's normalised xywh); a box of zero width is not reversed: it is dropped and counted;
* an image index outside ``[0, batch_size)`` or not a whole number (flat form);
* non-finite values (NaN / inf), naming the tensor, in the builders and in the debug helpers
  :func:`validate_targets`, :func:`validate_preds` and :func:`check_finite` (which are never
  called in the hot path: each is a host sync).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple, overload

import torch

from yolo_func.structures.boxes import box_area, clip_boxes, xywh_to_xyxy
from yolo_func.structures.checks import check_targets
from yolo_func.structures.records import Targets

__all__ = [
    "TargetsReport",
    "bucket_size",
    "targets_from_flat",
    "targets_from_lists",
    "pad_targets",
    "validate_targets",
    "validate_preds",
    "check_finite",
]


class TargetsReport(NamedTuple):
    """What a builder did with the boxes it was given (``return_report=True``).

    ``given - dropped == targets.valid.sum(1)`` for every image.

    Attributes:
      given: int64[B] boxes given per image.
      dropped: int64[B] boxes dropped per image because their clipped area is zero (wholly
        outside the image, or zero width / height); their slots stay, with ``valid=False``.

    Example:
      >>> import torch
      >>> from yolo_func.structures import TargetsReport
      >>> r = TargetsReport(given=torch.tensor([3, 1]), dropped=torch.tensor([1, 0]))
      >>> (r.given - r.dropped).tolist()          # valid boxes per image
      [2, 1]
    """

    given: torch.Tensor
    dropped: torch.Tensor


def bucket_size(n: int, minimum: int = 8) -> int:
    """The padded target count for ``n`` real targets: the next power of two ``>= max(n, minimum)``.

    Args:
      n: number of real targets (>= 0).
      minimum: smallest bucket (8).

    Returns:
      int, e.g. ``bucket_size(0) == 8``, ``bucket_size(9) == 16``, ``bucket_size(16) == 16``.

    Example:
      >>> from yolo_func.structures import bucket_size
      >>> bucket_size(0), bucket_size(9), bucket_size(16), bucket_size(3, minimum=2)
      (8, 16, 16, 4)
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

    Example:
      Args are ``float[...]`` tensors of any shape (integer tensors and None are skipped).

      >>> import torch
      >>> from yolo_func.structures import check_finite
      >>> check_finite(loss=torch.tensor(1.0), boxes=None)
      >>> try:
      ...     check_finite(loss=torch.tensor(float("nan")))
      ... except ValueError as e:
      ...     print(str(e)[:44])
      [yolo_func] loss contains 1 non-finite value
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

    Example:
      >>> import torch
      >>> from yolo_func import DetectPreds
      >>> from yolo_func.structures import validate_preds
      >>> validate_preds(DetectPreds(torch.zeros(1, 84, 64), torch.zeros(1, 84, 5)))
      >>> try:
      ...     validate_preds(DetectPreds(torch.zeros(1, 84, 64), torch.full((1, 84, 5), float("inf"))))
      ... except ValueError as e:
      ...     print("cls_logits" in str(e))
      True
    """
    fields = preds._asdict() if hasattr(preds, "_asdict") else dict(preds)
    check_finite(**{f"{name}.{k}": v for k, v in fields.items()})


def _expect(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(f"[yolo_func] {msg}")


def validate_targets(t: Targets, image_size: tuple[int, int] | None = None, *, num_classes: int | None = None) -> None:
    """Check a :class:`Targets` record: shapes, dtypes, finiteness, class ids and the validity rules.

    Debug / data-pipeline helper (it syncs with the host); never call it inside a training step
    (:func:`yolo_func.structures.check_batch` is the step's metadata-only check).

    Args:
      t: the targets. ``boxes float[B, M, 4]``, ``classes int64[B, M]``, ``valid bool[B, M]``,
        optional ``masks`` int64[B, Hm, Wm] (overlap) or float[B, M, Hm, Wm], optional
        ``keypoints float[B, M, P, 2|3]``.
      image_size: (H, W) in pixels; when given, valid boxes must lie inside the image.
      num_classes: K; when given, the class id of every valid slot must lie in ``[0, K)``.

    Raises:
      ValueError: naming the offending tensor (``targets.boxes`` ...), with expected and actual
        shape / dtype, the count of non-finite values, or the image, slot and value of a bad
        class id.

    Example:
      >>> import torch
      >>> from yolo_func.structures import Targets, validate_targets
      >>> t = Targets(torch.tensor([[[0.0, 0.0, 8.0, 8.0]]]), torch.tensor([[2]]), torch.tensor([[True]]))
      >>> validate_targets(t, (64, 64), num_classes=5)
      >>> try:
      ...     validate_targets(t, (64, 64), num_classes=2)          # class id 2 is out of range
      ... except ValueError as e:
      ...     print(str(e).startswith("[yolo_func]"))
      True
    """
    _check_num_classes(num_classes)
    check_targets(t, name="targets")
    check_finite(**{"targets.boxes": t.boxes, "targets.masks": t.masks, "targets.keypoints": t.keypoints})
    area = box_area(t.boxes)
    _expect(bool((area[t.valid] > 0).all()), "targets.boxes: a valid box has zero area; mark it valid=False "
                                             "(the builders do) or fix the box")
    bad = t.classes < 0
    if num_classes is not None:
        bad = bad | (t.classes >= num_classes)
    bad = bad & t.valid
    if bool(bad.any()):
        b, j = (int(v) for v in bad.nonzero()[0])
        expected = f"ids in [0, {num_classes}) (num_classes={num_classes})" if num_classes is not None else "ids >= 0"
        raise ValueError(f"[yolo_func] targets.classes: image {b} slot {j} has class id {int(t.classes[b, j])}; "
                         f"expected {expected}; fix the labels or the model's num_classes")
    if image_size is not None:
        h, w = image_size
        vb = t.boxes[t.valid]
        inside = (vb[:, 0] >= 0) & (vb[:, 1] >= 0) & (vb[:, 2] <= w) & (vb[:, 3] <= h)
        _expect(bool(inside.all()), f"targets.boxes: valid boxes must lie inside the image (H, W) = {tuple(image_size)}; "
                                    "the builders clip them")


# -- input checks of the builders (host-side: they read values) ------------------------------------

def _check_num_classes(num_classes: Any) -> None:
    if num_classes is not None and (not isinstance(num_classes, int) or isinstance(num_classes, bool) or num_classes < 1):
        raise ValueError(f"[yolo_func] num_classes: expected an int >= 1 (K, the model's class count) or None, "
                         f"got {num_classes!r}")


def _check_image_size(image_size: Any) -> tuple[int, int]:
    ok = isinstance(image_size, Sequence) and len(image_size) == 2 and all(
        isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in image_size)
    if not ok:
        raise ValueError(f"[yolo_func] image_size: expected (H, W) positive ints in pixels, got {image_size!r}")
    return int(image_size[0]), int(image_size[1])


def _as_tensor(name: str, x: Any) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x
    try:
        return torch.as_tensor(x)
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(f"[yolo_func] {name}: expected a tensor (or array), got {type(x).__name__}") from None


def _first(mask: torch.Tensor) -> int:
    return int(mask.nonzero()[0, 0])


def _check_class_ids(arg: str, cls: torch.Tensor, where: Callable[[int], str], num_classes: int | None) -> None:
    """Class ids ``cls [n]`` must be whole numbers in ``[0, num_classes)`` (``>= 0`` without K)."""
    if cls.numel() == 0:
        return
    c = cls.double()
    frac = c != c.round()
    if bool(frac.any()):
        i = _first(frac)
        raise ValueError(f"[yolo_func] {arg}: {where(i)} has class id {float(c[i]):g}; expected whole numbers "
                         "(class indices)")
    bad = c < 0
    if num_classes is not None:
        bad = bad | (c >= num_classes)
    if bool(bad.any()):
        i = _first(bad)
        expected = f"ids in [0, {num_classes}) (num_classes={num_classes})" if num_classes is not None else "ids >= 0"
        fix = "fix the label or pass the model's num_classes" if num_classes is not None else "fix the label"
        raise ValueError(f"[yolo_func] {arg}: {where(i)} has class id {int(c[i])}; expected {expected}; {fix}")


def _box_text(row: torch.Tensor) -> str:
    return "(" + ", ".join(f"{float(v):g}" for v in row) + ")"


def _image_index(batch_idx: torch.Tensor, batch_size: int) -> torch.Tensor:
    """int64[N]: the image of every flat row, checked to be a whole number in ``[0, batch_size)``."""
    b = batch_idx.reshape(-1)
    if b.is_floating_point():
        check_finite(batch_idx=b)
        frac = b != b.round()
        if bool(frac.any()):
            i = _first(frac)
            raise ValueError(f"[yolo_func] batch_idx: row {i} has image index {float(b[i]):g}; expected whole numbers "
                             f"in [0, {batch_size})")
    b = b.long()
    bad = (b < 0) | (b >= batch_size)
    if bool(bad.any()):
        i = _first(bad)
        raise ValueError(f"[yolo_func] batch_idx: row {i} has image index {int(b[i])}; expected values in "
                         f"[0, {batch_size}) (batch_size={batch_size})")
    return b


def _slots(b: torch.Tensor, batch_size: int) -> tuple[torch.Tensor, int]:
    """Within-image position (input order) of every flat row, and the largest per-image count."""
    n = b.numel()
    counts = torch.bincount(b, minlength=batch_size)
    order = torch.argsort(b, stable=True)  # stable: keeps the input order inside each image
    offsets = counts.cumsum(0) - counts
    slot = torch.empty_like(b)
    slot[order] = torch.arange(n, device=b.device) - offsets[b[order]]
    return slot, int(counts.max()) if n else 0


def _resolve_m(count: int, max_boxes: int | None) -> int:
    if max_boxes is None:
        return bucket_size(count)
    if count > max_boxes:
        raise ValueError(f"[yolo_func] max_boxes: an image has {count} targets but max_boxes={max_boxes}; "
                         "raise max_boxes (truncating would break overlap-mask indices)")
    return int(max_boxes)


@overload
def targets_from_flat(batch_idx: torch.Tensor, cls: torch.Tensor, bboxes_xywh_norm: torch.Tensor, *, batch_size: int,
                      image_size: tuple[int, int], masks: torch.Tensor | None = ..., keypoints: torch.Tensor | None = ...,
                      max_boxes: int | None = ..., overlap_masks: bool = ..., num_classes: int | None = ...,
                      return_report: Literal[False] = ...) -> Targets: ...
@overload
def targets_from_flat(batch_idx: torch.Tensor, cls: torch.Tensor, bboxes_xywh_norm: torch.Tensor, *, batch_size: int,
                      image_size: tuple[int, int], masks: torch.Tensor | None = ..., keypoints: torch.Tensor | None = ...,
                      max_boxes: int | None = ..., overlap_masks: bool = ..., num_classes: int | None = ...,
                      return_report: Literal[True]) -> tuple[Targets, TargetsReport]: ...


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
    num_classes: int | None = None,
    return_report: bool = False,
) -> Targets | tuple[Targets, TargetsReport]:
    """Build padded :class:`Targets` from the reference's flat batch form (REFERENCE.md §2.1).

    Boxes are scaled to pixels, converted to xyxy and clipped to the image; boxes with zero
    clipped area are dropped (slot kept, ``valid=False``, row zeroed) and counted. See the module
    docstring for every rule and input error.

    Args:
      batch_idx: float or int [N] image index of every row (whole numbers in ``[0, batch_size)``).
      cls: [N] or [N, 1] class ids (whole numbers ``>= 0``, float or int).
      bboxes_xywh_norm: float[N, 4] normalised (cx, cy, w, h), ``w, h >= 0``.
      batch_size: B (images without rows get only padding).
      image_size: (H, W) of the network input in pixels.
      masks: with ``overlap_masks`` (the reference's ``overlap_mask=True``) an overlap map
        [B, Hm, Wm] whose pixel value is the 1-based slot within its image (kept as int64);
        otherwise per-instance float[N, Hm, Wm] in row order (scattered to float[B, M, Hm, Wm]).
      keypoints: float[N, P, 2|3] normalised x, y (and visibility 0/1/2); scaled to pixels.
      max_boxes: fixed M; default :func:`bucket_size` of the largest per-image count.
      overlap_masks: how ``masks`` is laid out (see above).
      num_classes: K; when given, class ids ``>= K`` raise (negative ids always do).
      return_report: also return a :class:`TargetsReport` (per-image given / dropped counts).

    Returns:
      ``Targets(boxes float32[B, M, 4], classes int64[B, M], valid bool[B, M], masks, keypoints
      float32[B, M, P, D])`` on the device of ``bboxes_xywh_norm``; with ``return_report`` the
      pair ``(targets, TargetsReport(given int64[B], dropped int64[B]))``.

    Raises:
      ValueError: wrong shapes, NaN / inf (naming the tensor), an image index or class id out of
        range, a negative width / height (naming the row, its image and the value), or more
        targets in one image than ``max_boxes``.

    Example:
      >>> t = targets_from_flat(torch.tensor([0.0]), torch.tensor([2.0]), torch.tensor([[0.5, 0.5, 0.5, 0.25]]),
      ...                       batch_size=1, image_size=(64, 64), num_classes=3)
      >>> t.boxes[0, 0].tolist(), t.classes[0, 0].item(), t.valid.sum().item()
      ([16.0, 24.0, 48.0, 40.0], 2, 1)
    """
    H, W = _check_image_size(image_size)
    _check_num_classes(num_classes)
    bboxes_xywh_norm = _as_tensor("bboxes_xywh_norm", bboxes_xywh_norm)
    if bboxes_xywh_norm.ndim != 2 or bboxes_xywh_norm.shape[-1] != 4:
        raise ValueError(f"[yolo_func] bboxes_xywh_norm: expected float[N, 4] (normalised cx, cy, w, h), got shape "
                         f"{tuple(bboxes_xywh_norm.shape)}")
    n = bboxes_xywh_norm.shape[0]
    cls, batch_idx = _as_tensor("cls", cls), _as_tensor("batch_idx", batch_idx)
    if not (cls.ndim == 1 or (cls.ndim == 2 and cls.shape[1] == 1)) or cls.shape[0] != n:
        raise ValueError(f"[yolo_func] cls: expected [N={n}] or [N={n}, 1] class ids (one per row of "
                         f"bboxes_xywh_norm), got shape {tuple(cls.shape)}")
    if batch_idx.ndim != 1 or batch_idx.shape[0] != n:
        raise ValueError(f"[yolo_func] batch_idx: expected [N={n}] image indices (one per row of bboxes_xywh_norm), "
                         f"got shape {tuple(batch_idx.shape)}")
    cls = cls.reshape(-1)
    check_finite(bboxes_xywh_norm=bboxes_xywh_norm, keypoints=keypoints, cls=cls.float())
    b = _image_index(batch_idx, batch_size)
    _check_class_ids("cls", cls, lambda i: f"row {i} (image {int(b[i])})", num_classes)
    neg = (bboxes_xywh_norm[:, 2] < 0) | (bboxes_xywh_norm[:, 3] < 0)
    if bool(neg.any()):
        i = _first(neg)
        raise ValueError(f"[yolo_func] bboxes_xywh_norm: row {i} (image {int(b[i])}) is reversed, (cx, cy, w, h) = "
                         f"{_box_text(bboxes_xywh_norm[i])} has a negative width or height; expected w >= 0 and h >= 0")
    device = bboxes_xywh_norm.device
    scale = torch.tensor([W, H, W, H], dtype=torch.float32, device=device)
    xyxy = xywh_to_xyxy(bboxes_xywh_norm.float() * scale)
    kpts_px = None
    if keypoints is not None:
        if keypoints.ndim != 3 or keypoints.shape[0] != n or keypoints.shape[-1] not in (2, 3):
            raise ValueError(f"[yolo_func] keypoints: expected float[N={n}, P, 2|3], got {tuple(keypoints.shape)}")
        D = keypoints.shape[-1]
        kpts_px = keypoints.float() * torch.tensor([W, H, 1.0][:D], dtype=torch.float32, device=device)
    out = _assemble(b.to(device), cls, xyxy, batch_size=batch_size, image_size=(H, W), masks=masks,
                    keypoints_px=kpts_px, max_boxes=max_boxes, overlap_masks=overlap_masks)
    return out if return_report else out[0]


def _assemble(b, cls, xyxy, *, batch_size, image_size, masks, keypoints_px, max_boxes,
              overlap_masks) -> tuple[Targets, TargetsReport]:
    """Scatter flat rows (xyxy pixels, image index ``b``) into padded slots, applying the clip /
    drop rules; also count what was given and dropped per image."""
    H, W = image_size
    n = xyxy.shape[0]
    slot, count = _slots(b, batch_size)
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
    given = torch.bincount(b, minlength=batch_size)
    dropped = torch.bincount(b[~ok], minlength=batch_size)
    return Targets(boxes, classes, valid, out_masks, out_kpts), TargetsReport(given, dropped)


def _lists_checked(boxes_list, classes_list, masks_list, keypoints_list, num_classes, *,
                   values: bool = True) -> tuple[list, list, list, list]:
    """Per-image lists checked one image at a time, in order (raises the first error with its image
    and row); returns (boxes float32, classes int64, masks float32, keypoints float32) per image.
    ``values=False`` checks only types and shapes and returns the classes as given (their values
    are checked batched, :func:`_lists_fast`)."""
    B = len(boxes_list)
    boxes, classes, masks, kpts = [], [], [], []
    for i in range(B):
        bx = _as_tensor(f"boxes_list[{i}]", boxes_list[i])
        if bx.ndim == 1 and bx.numel() == 0:
            bx = bx.reshape(0, 4)
        if bx.ndim != 2 or bx.shape[1] != 4:
            raise ValueError(f"[yolo_func] boxes_list[{i}]: image {i}: expected float[n, 4] (x1, y1, x2, y2 pixels, one "
                             f"row per box), got shape {tuple(bx.shape)}")
        bx = bx.float().cpu()
        n = bx.shape[0]
        if values:
            check_finite(**{f"boxes_list[{i}]": bx})
            rev = (bx[:, 2] < bx[:, 0]) | (bx[:, 3] < bx[:, 1])
            if bool(rev.any()):
                j = _first(rev)
                raise ValueError(f"[yolo_func] boxes_list[{i}]: image {i} row {j} is reversed, (x1, y1, x2, y2) = "
                                 f"{_box_text(bx[j])}; expected x1 <= x2 and y1 <= y2 (xyxy corners; centre-form boxes: "
                                 "convert with yolo_func.structures.xywh_to_xyxy)")
        c = _as_tensor(f"classes_list[{i}]", classes_list[i])
        if not (c.ndim == 1 or (c.ndim == 2 and c.shape[1] == 1)) or c.shape[0] != n:
            raise ValueError(f"[yolo_func] classes_list[{i}]: image {i}: expected int[{n}] (one id per box of "
                             f"boxes_list[{i}]), got shape {tuple(c.shape)}")
        c = c.reshape(-1).cpu()
        if values:
            if c.is_floating_point():
                check_finite(**{f"classes_list[{i}]": c})
            _check_class_ids(f"classes_list[{i}]", c, lambda j, i=i: f"image {i} row {j}", num_classes)
        boxes.append(bx)
        classes.append(c.long() if values else c)
        if masks_list is not None:
            m = _as_tensor(f"masks_list[{i}]", masks_list[i])
            if m.ndim != 3 or m.shape[0] != n or (masks and tuple(m.shape[1:]) != tuple(masks[0].shape[1:])):
                want = f"[{n}, Hm, Wm]" if not masks else f"[{n}, {masks[0].shape[1]}, {masks[0].shape[2]}]"
                raise ValueError(f"[yolo_func] masks_list[{i}]: image {i}: expected float{want} (one mask per box, the "
                                 f"same size in every image), got shape {tuple(m.shape)}")
            masks.append(m.float().cpu())
        if keypoints_list is not None:
            k = _as_tensor(f"keypoints_list[{i}]", keypoints_list[i])
            if k.ndim != 3 or k.shape[0] != n or k.shape[2] not in (2, 3) or (kpts and tuple(k.shape[1:]) != tuple(kpts[0].shape[1:])):
                want = f"[{n}, P, 2|3]" if not kpts else f"[{n}, {kpts[0].shape[1]}, {kpts[0].shape[2]}]"
                raise ValueError(f"[yolo_func] keypoints_list[{i}]: image {i}: expected float{want} (one row per box, "
                                 f"the same (P, D) in every image), got shape {tuple(k.shape)}")
            kpts.append(k.float().cpu())
    return boxes, classes, masks, kpts


def _lists_fast(boxes_list, classes_list, masks_list, keypoints_list, num_classes) -> tuple[list, list, list, list] | None:
    """:func:`_lists_checked`'s result with the value checks run once on the concatenated rows
    (finite boxes with ``x1 <= x2``, ``y1 <= y2``; finite, whole, non-negative class ids below
    ``num_classes``); None (nothing raised) when any check fails, so that the caller can name the
    first bad entry with the per-image checks."""
    try:
        boxes, classes, masks, kpts = _lists_checked(boxes_list, classes_list, masks_list, keypoints_list,
                                                     num_classes, values=False)
    except (TypeError, ValueError, RuntimeError):
        return None
    if boxes:
        xyxy = torch.cat(boxes)
        if not bool(torch.isfinite(xyxy).all()) or bool(((xyxy[:, 2] < xyxy[:, 0]) | (xyxy[:, 3] < xyxy[:, 1])).any()):
            return None
        float_classes = [c for c in classes if c.is_floating_point()]
        if float_classes and not bool(torch.isfinite(torch.cat([c.double() for c in float_classes])).all()):
            return None
        cd = torch.cat([c.double() for c in classes])
        bad = (cd != cd.round()) | (cd < 0)
        if num_classes is not None:
            bad = bad | (cd >= num_classes)
        if bool(bad.any()):
            return None
    return boxes, [c.long() for c in classes], masks, kpts


@overload
def targets_from_lists(boxes_list: Sequence[torch.Tensor], classes_list: Sequence[torch.Tensor], *,
                       image_size: tuple[int, int], masks_list: Sequence[torch.Tensor] | None = ...,
                       keypoints_list: Sequence[torch.Tensor] | None = ..., max_boxes: int | None = ...,
                       num_classes: int | None = ..., return_report: Literal[False] = ...) -> Targets: ...
@overload
def targets_from_lists(boxes_list: Sequence[torch.Tensor], classes_list: Sequence[torch.Tensor], *,
                       image_size: tuple[int, int], masks_list: Sequence[torch.Tensor] | None = ...,
                       keypoints_list: Sequence[torch.Tensor] | None = ..., max_boxes: int | None = ...,
                       num_classes: int | None = ..., return_report: Literal[True]) -> tuple[Targets, TargetsReport]: ...


def targets_from_lists(
    boxes_list: Sequence[torch.Tensor],
    classes_list: Sequence[torch.Tensor],
    *,
    image_size: tuple[int, int],
    masks_list: Sequence[torch.Tensor] | None = None,
    keypoints_list: Sequence[torch.Tensor] | None = None,
    max_boxes: int | None = None,
    num_classes: int | None = None,
    return_report: bool = False,
) -> Targets | tuple[Targets, TargetsReport]:
    """Build padded :class:`Targets` from per-image lists (the same clipping / drop rules and input
    checks as :func:`targets_from_flat`; see the module docstring).

    Args:
      boxes_list: B tensors float[n_b, 4], xyxy in pixels with ``x1 <= x2``, ``y1 <= y2`` (an image
        without boxes may pass ``[0, 4]`` or an empty ``[0]``).
      classes_list: B tensors int[n_b] (or [n_b, 1]; whole-number floats are accepted).
      image_size: (H, W) in pixels.
      masks_list: optional B tensors float[n_b, Hm, Wm] per-instance masks (-> float[B, M, Hm, Wm]).
      keypoints_list: optional B tensors float[n_b, P, 2|3], x, y in pixels (and visibility).
      max_boxes: fixed M; default :func:`bucket_size` of the largest n_b.
      num_classes: K; when given, class ids ``>= K`` raise (negative ids always do).
      return_report: also return a :class:`TargetsReport` (per-image given / dropped counts).

    Returns:
      :class:`Targets` on the CPU; with ``return_report`` the pair ``(targets, TargetsReport)``.

    Raises:
      ValueError: naming the argument and image (``classes_list[1]: image 1 row 0 has class id 7;
        expected ids in [0, 3) ...``) for a class id out of range, boxes not ``[n, 4]``, a reversed
        box, row counts that differ between the lists, or NaN / inf.
      TypeError: an entry that is not a tensor or array.

    Example:
      >>> t, report = targets_from_lists([torch.tensor([[8.0, 8, 40, 24], [70, 70, 90, 90]])], [torch.tensor([2, 0])],
      ...                                image_size=(64, 64), num_classes=3, return_report=True)
      >>> t.valid[0, :2].tolist(), report.given.tolist(), report.dropped.tolist()
      ([True, False], [2], [1])
    """
    H, W = _check_image_size(image_size)
    _check_num_classes(num_classes)
    if len(boxes_list) != len(classes_list):
        raise ValueError(f"[yolo_func] targets_from_lists: {len(boxes_list)} box tensors but {len(classes_list)} class tensors; "
                         "expected one of each per image")
    B = len(boxes_list)
    for name, extra in (("masks_list", masks_list), ("keypoints_list", keypoints_list)):
        if extra is not None and len(extra) != B:
            raise ValueError(f"[yolo_func] {name}: expected {B} tensors (one per image, like boxes_list), got {len(extra)}")
    got = _lists_fast(boxes_list, classes_list, masks_list, keypoints_list, num_classes)
    if got is None:  # some input is bad: the per-image checks find the first error, in input order
        got = _lists_checked(boxes_list, classes_list, masks_list, keypoints_list, num_classes)
    boxes, classes, masks, kpts = got
    counts = [int(bx.shape[0]) for bx in boxes]
    b = torch.cat([torch.full((c,), i, dtype=torch.int64) for i, c in enumerate(counts)]) if B else torch.zeros(0, dtype=torch.int64)
    xyxy = torch.cat(boxes) if B else torch.zeros(0, 4)
    cls = torch.cat(classes) if B else torch.zeros(0, dtype=torch.int64)
    masks_t = torch.cat(masks) if masks_list is not None and B else None
    kpts_t = torch.cat(kpts) if keypoints_list is not None and B else None
    check_finite(keypoints_list=kpts_t)
    out = _assemble(b, cls, xyxy, batch_size=B, image_size=(H, W), masks=masks_t, keypoints_px=kpts_t,
                    max_boxes=max_boxes, overlap_masks=False)
    return out if return_report else out[0]


def pad_targets(t: Targets, M: int) -> Targets:
    """Pad a :class:`Targets` record to ``M >= t.boxes.shape[1]`` slots with inert rows.

    Args:
      t: targets with M0 slots (shapes and dtypes as :func:`yolo_func.structures.check_targets`
        requires).
      M: the new slot count, an int.

    Returns:
      :class:`Targets` with M slots (boxes 0, classes 0, valid False, per-instance masks 0,
      keypoints 0; an overlap map is unchanged).

    Raises:
      TypeError: ``t`` is not a :class:`Targets`, or ``M`` is not an int.
      ValueError: a field of ``t`` with the wrong shape / dtype (named), or ``M`` smaller than the
        current slot count.

    Example:
      >>> import torch
      >>> from yolo_func.structures import Targets, pad_targets
      >>> t = Targets(torch.ones(1, 2, 4), torch.ones(1, 2, dtype=torch.int64), torch.ones(1, 2, dtype=torch.bool))
      >>> p = pad_targets(t, 8)
      >>> p.boxes.shape, p.valid.sum().item()
      (torch.Size([1, 8, 4]), 2)
    """
    check_targets(t, name="t")
    if not isinstance(M, int) or isinstance(M, bool):
        raise TypeError(f"[yolo_func] pad_targets: M must be an int (the new slot count), got {type(M).__name__} {M!r}")
    B, M0 = t.boxes.shape[:2]
    if M < M0:
        raise ValueError(f"[yolo_func] pad_targets: M={M} is smaller than the current {M0} slots; pass M >= {M0}")
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
