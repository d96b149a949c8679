"""Metadata checks of the step's inputs: shapes, dtypes and devices, never tensor values.

:func:`check_batch` runs at the top of the training step (``train.step.train_step``) and of the
replayed steps. It reads only ``.shape``, ``.dtype`` and ``.device``, so it never synchronises
with the device and is safe inside a CUDA-graph capture; a batch that would otherwise fail deep
inside the network or the assigner (or, on a GPU, trip a device-side assert) is rejected at the
door with the field's name, what was expected and what was given.

What it cannot see are the values: class ids outside ``[0, K)``, reversed or non-finite boxes.
The target builders (:func:`yolo_func.structures.targets_from_lists`,
:func:`~yolo_func.structures.targets_from_flat`) check those when the data is built, and
:func:`yolo_func.structures.validate_targets` is the debug helper that checks a finished record
(a host sync; never inside a step).
"""

from __future__ import annotations

from typing import Any

import torch

from yolo_func.structures.records import Batch, Targets

__all__ = ["check_batch", "check_targets"]


def _fail(name: str, expected: str, got: str, fix: str = "") -> None:
    raise ValueError(f"[yolo_func] {name}: expected {expected}, got {got}" + (f"; {fix}" if fix else ""))


def _desc(x: Any) -> str:
    """``torch.float32[2, 8, 4]`` for a tensor, the type name otherwise."""
    if isinstance(x, torch.Tensor):
        return f"{x.dtype}{list(x.shape)}" + ("" if x.device.type == "cpu" else f" on {x.device}")
    return type(x).__name__


def _tensor(name: str, x: Any, expected: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"[yolo_func] {name}: expected a torch.Tensor {expected}, got {type(x).__name__}")
    return x


def _same_device(name: str, x: torch.Tensor, device: torch.device | None) -> None:
    if device is not None and x.device != device:
        _fail(name, f"a tensor on {device} (the images' device)", f"{x.dtype}{list(x.shape)} on {x.device}",
              "move the images and every target tensor to one device")


_BUILDERS = "build targets with yolo_func.structures.targets_from_lists / targets_from_flat"


def check_targets(targets: Any, *, batch_size: int | None = None, device: torch.device | None = None,
                  kpt_shape: tuple[int, int] | None = None, name: str = "targets") -> None:
    """Check the shapes, dtypes and devices of a :class:`Targets` record (no tensor values read).

    Args:
      targets: ``Targets(boxes float[B, M, 4], classes int64[B, M], valid bool[B, M], masks
        None | int[B, Hm, Wm] (overlap map) | float[B, M, Hm, Wm], keypoints None | float[B, M, P, D])``.
      batch_size: the expected ``B`` (the images' batch); None takes it from ``boxes``.
      device: every tensor must be on it; None skips the device check.
      kpt_shape: the expected ``(P, D)`` of the keypoints when they are given; None accepts any
        ``P >= 1`` and ``D in {2, 3}``.
      name: the record's name in messages (``"batch.targets"`` from :func:`check_batch`).

    Raises:
      TypeError: ``targets`` is not a :class:`Targets` or a field is not a tensor.
      ValueError: ``"[yolo_func] <name>.<field>: expected <dtype/shape>, got <dtype/shape>; <fix>"``.

    Example:
      >>> import torch
      >>> from yolo_func.structures import Targets, check_targets
      >>> t = Targets(torch.zeros(2, 8, 4), torch.zeros(2, 8, dtype=torch.int64), torch.zeros(2, 8, dtype=torch.bool))
      >>> check_targets(t, batch_size=2)
      >>> try:
      ...     check_targets(t._replace(classes=t.classes.float()))
      ... except ValueError as e:
      ...     print(type(e).__name__)
      ValueError
    """
    if not isinstance(targets, Targets):
        raise TypeError(f"[yolo_func] {name}: expected a yolo_func.structures.Targets record, got "
                        f"{type(targets).__name__}; {_BUILDERS}")
    boxes = _tensor(f"{name}.boxes", targets.boxes, "float[B, M, 4]")
    if boxes.ndim != 3 or boxes.shape[-1] != 4 or not boxes.is_floating_point():
        _fail(f"{name}.boxes", "float[B, M, 4] (xyxy pixels)", _desc(boxes), _BUILDERS)
    B, M = boxes.shape[:2]
    if batch_size is not None and B != batch_size:
        _fail(f"{name}.boxes", f"B = {batch_size} rows (one per image), float[{batch_size}, M, 4]", _desc(boxes),
              "build the targets from the same images")
    _same_device(f"{name}.boxes", boxes, device)
    classes = _tensor(f"{name}.classes", targets.classes, f"int64[{B}, {M}]")
    if tuple(classes.shape) != (B, M) or classes.dtype != torch.int64:
        _fail(f"{name}.classes", f"torch.int64[{B}, {M}]", _desc(classes), _BUILDERS)
    _same_device(f"{name}.classes", classes, device)
    valid = _tensor(f"{name}.valid", targets.valid, f"bool[{B}, {M}]")
    if tuple(valid.shape) != (B, M) or valid.dtype != torch.bool:
        _fail(f"{name}.valid", f"torch.bool[{B}, {M}]", _desc(valid), _BUILDERS)
    _same_device(f"{name}.valid", valid, device)
    masks = targets.masks
    if masks is not None:
        masks = _tensor(f"{name}.masks", masks, f"int64[{B}, Hm, Wm] or float[{B}, {M}, Hm, Wm]")
        overlap = masks.ndim == 3 and masks.shape[0] == B and not masks.is_floating_point()
        per_instance = masks.ndim == 4 and tuple(masks.shape[:2]) == (B, M) and masks.is_floating_point()
        if not (overlap or per_instance):
            _fail(f"{name}.masks", f"an overlap map int64[{B}, Hm, Wm] or per-instance float[{B}, {M}, Hm, Wm]",
                  _desc(masks), _BUILDERS)
        _same_device(f"{name}.masks", masks, device)
    kpts = targets.keypoints
    if kpts is not None:
        kpts = _tensor(f"{name}.keypoints", kpts, f"float[{B}, {M}, P, D]")
        want = f"float[{B}, {M}, {kpt_shape[0]}, {kpt_shape[1]}]" if kpt_shape is not None else f"float[{B}, {M}, P, 2|3]"
        ok = (kpts.ndim == 4 and tuple(kpts.shape[:2]) == (B, M) and kpts.is_floating_point()
              and kpts.shape[2] >= 1 and kpts.shape[3] in (2, 3))
        if ok and kpt_shape is not None:
            ok = tuple(kpts.shape[2:]) == tuple(kpt_shape)
        if not ok:
            _fail(f"{name}.keypoints", want, _desc(kpts), "the model's kpt_shape and the data's keypoints must agree")
        _same_device(f"{name}.keypoints", kpts, device)


def check_batch(batch: Any, *, in_channels: int = 3, multiple: int = 32,
                kpt_shape: tuple[int, int] | None = None) -> None:
    """The step's boundary check: shapes, dtypes and devices of a :class:`Batch` (no values read).

    Metadata only: no host synchronisation, nothing that reads a tensor's values, so it costs a
    few microseconds and may run inside a captured step. Value errors (class ids, reversed boxes)
    are the builders' job (module docstring).

    Args:
      batch: ``Batch(images uint8[B, C, H, W] (0..255) or float[B, C, H, W] (0..1), targets)``
        with ``B >= 1`` and H, W positive multiples of ``multiple``; ``targets`` as in
        :func:`check_targets`, with the images' ``B`` and on the images' device.
      in_channels: C (3).
      multiple: the network's largest stride (32).
      kpt_shape: the pose head's ``(P, D)`` when the keypoints are to be checked against it.

    Raises:
      TypeError: ``batch`` is not a :class:`Batch`, or a field is not a tensor.
      ValueError: naming the field (``batch.images``, ``batch.targets.classes`` ...), the expected
        and the actual shape / dtype / device.

    Example:
      >>> import torch
      >>> from yolo_func.structures import Batch, targets_from_lists
      >>> t = targets_from_lists([torch.tensor([[2.0, 2, 20, 20]])], [torch.tensor([0])], image_size=(32, 32))
      >>> check_batch(Batch(torch.zeros(1, 3, 32, 32, dtype=torch.uint8), t))
      >>> check_batch(Batch(torch.zeros(1, 3, 30, 32), t))
      Traceback (most recent call last):
      ...
      ValueError: [yolo_func] batch.images: expected H and W positive multiples of 32, got torch.float32[1, 3, 30, 32]; letterbox or resize to e.g. 32x32
    """
    if not isinstance(batch, Batch):
        raise TypeError(f"[yolo_func] batch: expected a yolo_func.structures.Batch(images, targets), got "
                        f"{type(batch).__name__}")
    images = _tensor("batch.images", batch.images, f"uint8 or float[B, {in_channels}, H, W]")
    if not (images.dtype == torch.uint8 or images.is_floating_point()):
        _fail("batch.images", "dtype uint8 (0..255) or a floating dtype (0..1)", _desc(images))
    if images.ndim != 4 or images.shape[1] != in_channels:
        _fail("batch.images", f"[B, {in_channels}, H, W]", _desc(images), "images are NCHW")
    b, _, h, w = images.shape
    if b < 1:
        _fail("batch.images", "at least one image (B >= 1)", _desc(images))
    if h < 1 or w < 1 or h % multiple or w % multiple:
        up = lambda v: max(multiple, -(-v // multiple) * multiple)  # noqa: E731
        _fail("batch.images", f"H and W positive multiples of {multiple}", _desc(images),
              f"letterbox or resize to e.g. {up(h)}x{up(w)}")
    check_targets(batch.targets, batch_size=b, device=images.device, kpt_shape=kpt_shape, name="batch.targets")
