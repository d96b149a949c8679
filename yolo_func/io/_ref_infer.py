"""Which YOLOv8 model a reference state dict holds: scale, task, classes, keypoints, read from the
tensor shapes alone (REFERENCE.md §1.1-1.2, §1.6-1.8, §1.10). Internal: import the public names from
:mod:`yolo_func.io.ultralytics`.

What each quantity is read from:

==============  =====================================================================================
scale           the stem's output channels ``model.0.conv.weight[0]`` (n 16, s 32, m 48, l 64, x 80:
                one width per scale), confirmed by the depth: the bottlenecks of ``model.2``
                (``model.2.m.<j>``: n 1, s 1, m 2, l 3, x 3).
task            ``model.22.proto.*`` present: segment; else ``model.22.cv4.*`` present: pose; else
                detect.
classes (K)     the class branch's output channels ``model.22.cv3.0.2.weight[0]`` (reference ``nc``).
masks (NM)      segment: ``model.22.cv4.0.2.weight[0]``.
keypoints       pose: ``model.22.cv4.0.2.weight[0]`` = P·D channels with D in {2, 3}. The product
                alone is ambiguous when it is a multiple of 6 (6 = 2x3 or 3x2, 12 = 4x3 or 6x2).
                Rule without metadata: D = 3 when P·D is a multiple of 3 (the reference's default,
                x, y and a visibility logit; COCO's 51 = 17x3 is a multiple of 3 only), else D = 2.
                Reference checkpoints pickle ``kpt_shape`` beside the weights:
                :func:`yolo_func.io.ultralytics.read_reference_checkpoint` reads it and passes it as
                ``kpt_shape=``, which then wins (checked against the channels).
==============  =====================================================================================
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, NamedTuple

from yolo_func.io._ref_keys import HEAD_LAYER
from yolo_func.models.scales import SCALES, channels, repeats

__all__ = ["ReferenceSpec", "infer_reference_spec", "infer_reference_model"]

_STEM = "model.0.conv.weight"
_CLS_PRED = f"model.{HEAD_LAYER}.cv3.0.2.weight"
_CV4_PRED = f"model.{HEAD_LAYER}.cv4.0.2.weight"
_SUFFIX = {"detect": "", "segment": "-seg", "pose": "-pose"}
_DEFAULT_CLASSES = {"detect": 80, "segment": 80, "pose": 1}


def classes_phrase(k: int) -> str:
    """``"1 class"``, ``"80 classes"``."""
    return f"{k} class" if k == 1 else f"{k} classes"


class ReferenceSpec(NamedTuple):
    """What a reference state dict holds; :meth:`build` makes the matching model.

    Attributes:
      scale: ``"n"``, ``"s"``, ``"m"``, ``"l"`` or ``"x"``.
      task: ``"detect"``, ``"segment"`` or ``"pose"``.
      num_classes: K (reference ``nc``).
      kpt_shape: ``(P, D)`` for pose, else ``None``.
      num_masks: NM for segment, else ``None``.

    Example:
      >>> import torch
      >>> from yolo_func import yolov8
      >>> from yolo_func import io
      >>> model = yolov8("n", task="detect", num_classes=5)
      >>> params, state = model.init(torch.Generator().manual_seed(0))
      >>> spec = io.infer_reference_spec(io.to_reference(model, params, state))
      >>> spec
      ReferenceSpec(scale='n', task='detect', num_classes=5, kpt_shape=None, num_masks=None)
      >>> spec.build().num_classes
      5
    """

    scale: str
    task: str
    num_classes: int
    kpt_shape: tuple[int, int] | None = None
    num_masks: int | None = None

    @property
    def name(self) -> str:
        """The reference's model name, e.g. ``"yolov8s-seg"``."""
        return f"yolov8{self.scale}{_SUFFIX[self.task]}"

    def describe(self) -> str:
        """e.g. ``"yolov8s-seg (segment, scale s, 80 classes)"``."""
        extra = f", keypoints {self.kpt_shape[0]}x{self.kpt_shape[1]}" if self.kpt_shape else ""
        return f"{self.name} ({self.task}, scale {self.scale}, {classes_phrase(self.num_classes)}{extra})"

    def call(self) -> str:
        """The :func:`yolo_func.models.yolov8` call that builds it, e.g. ``"yolov8('s', task='segment')"``
        (arguments at their defaults are left out)."""
        args = [repr(self.scale), f"task={self.task!r}"]
        if self.num_classes != _DEFAULT_CLASSES[self.task]:
            args.append(f"num_classes={self.num_classes}")
        if self.kpt_shape is not None and self.kpt_shape != (17, 3):
            args.append(f"kpt_shape={self.kpt_shape}")
        if self.num_masks is not None and self.num_masks != 32:
            args.append(f"num_masks={self.num_masks}")
        return f"yolov8({', '.join(args)})"

    def build(self):
        """The :class:`yolo_func.models.Model` this spec describes (``yolov8(...)``)."""
        from yolo_func.models import yolov8

        kwargs: dict[str, Any] = {"task": self.task, "num_classes": self.num_classes}
        if self.kpt_shape is not None:
            kwargs["kpt_shape"] = self.kpt_shape
        if self.num_masks is not None:
            kwargs["num_masks"] = self.num_masks
        return yolov8(self.scale, **kwargs)

    def matches(self, model) -> bool:
        """True when ``model`` (a :class:`yolo_func.models.Model`) has this scale, task and classes and,
        for pose / segment, this many keypoint / mask channels."""
        if (model.scale, model.task, model.num_classes) != (self.scale, self.task, self.num_classes):
            return False
        if self.task == "detect":
            return True
        head = "segment" if self.task == "segment" else "pose"
        want = self.num_masks if self.task == "segment" else self.kpt_shape[0] * self.kpt_shape[1]
        return _branch_channels(model, head) == want


def _branch_channels(model, head: str) -> int | None:
    # Output channels of the model's cv4 counterpart, read from an abstract (meta-device) init.
    params, _ = model.abstract_init()
    sub = "coeff" if head == "segment" else "kpt"
    try:
        return int(params["heads"][head][sub]["p3"]["pred"]["weight"].shape[0])
    except (KeyError, TypeError):
        return None


def _shape(state_dict: Mapping[str, Any], key: str, ndim: int) -> tuple[int, ...]:
    if key not in state_dict:
        raise ValueError(
            f"[yolo_func] infer_reference_model: the state dict has no {key!r}; expected the keys of a YOLOv8 "
            f"reference model ('model.<layer>.<...>', e.g. DetectionModel.state_dict() or the weights of a .pt "
            f"file read with load_reference_checkpoint); got {len(state_dict)} keys such as {list(state_dict)[:3]}"
        )
    shape = tuple(getattr(state_dict[key], "shape", ()))
    if len(shape) != ndim:
        raise ValueError(
            f"[yolo_func] infer_reference_model: {key!r} should be a {ndim}-d tensor, got shape {list(shape)}"
        )
    return shape


def scale_from_state_dict(state_dict: Mapping[str, Any]) -> str:
    """The scale whose widths and depths the tensors have (see the module docstring).

    Raises:
      ValueError: no stem conv, or widths / depths of no YOLOv8 scale (names what was found).
    """
    width = _shape(state_dict, _STEM, 4)[0]
    by_width = {channels(64, sc): name for name, sc in SCALES.items()}
    if width not in by_width:
        known = ", ".join(f"{n} {c}" for c, n in sorted(by_width.items()))
        raise ValueError(
            f"[yolo_func] infer_reference_model: {_STEM!r} has {width} output channels; the YOLOv8 scales have "
            f"{known}: not a stock YOLOv8 scale"
        )
    name = by_width[width]
    pattern = re.compile(r"model\.2\.m\.(\d+)\.")
    depth = len({m.group(1) for k in state_dict if (m := pattern.match(k))})
    want = repeats(3, SCALES[name])
    if depth != want:
        raise ValueError(
            f"[yolo_func] infer_reference_model: the stem width {width} is scale {name!r}, whose first C2f "
            f"(model.2) has {want} bottleneck(s), but the state dict has {depth}: not a stock YOLOv8 scale"
        )
    return name


def task_from_state_dict(state_dict: Mapping[str, Any]) -> str:
    """``"segment"`` (a ``proto`` branch), ``"pose"`` (a ``cv4`` branch without ``proto``) or ``"detect"``."""
    head = f"model.{HEAD_LAYER}."
    if any(k.startswith(head + "proto.") for k in state_dict):
        return "segment"
    if any(k.startswith(head + "cv4.") for k in state_dict):
        return "pose"
    return "detect"


def infer_reference_spec(state_dict: Mapping[str, Any], *, kpt_shape: tuple[int, int] | None = None) -> ReferenceSpec:
    """Scale, task, classes and keypoint shape of a reference state dict, from the tensor shapes.

    Args:
      state_dict: ``{reference key: tensor}`` (only ``.shape`` is read; meta tensors work), e.g.
        ``DetectionModel.state_dict()`` or :func:`yolo_func.io.ultralytics.load_reference_checkpoint`'s result.
      kpt_shape: pose only: ``(P, D)`` from the checkpoint's metadata; it must fit the keypoint
        branch's P·D channels. Without it the module docstring's rule picks D.

    Returns:
      A :class:`ReferenceSpec`.

    Raises:
      TypeError: ``state_dict`` is not a mapping.
      ValueError: a key the inference needs is missing, a width / depth of no YOLOv8 scale, keypoint
        channels that no ``(P, D in {2, 3})`` gives, or a ``kpt_shape`` that does not fit them.

    Example:
      >>> from yolo_func.models import yolov8
      >>> from yolo_func.io.ultralytics import reference_layout
      >>> import torch
      >>> sd = {e.key: torch.empty(e.shape, device="meta") for e in reference_layout(yolov8("s", task="segment"))}
      >>> infer_reference_spec(sd).call()
      "yolov8('s', task='segment')"
    """
    if not isinstance(state_dict, Mapping):
        raise TypeError(
            f"[yolo_func] infer_reference_model: state_dict must be a mapping of reference key -> tensor, got "
            f"{type(state_dict).__name__}"
        )
    scale = scale_from_state_dict(state_dict)
    task = task_from_state_dict(state_dict)
    num_classes = _shape(state_dict, _CLS_PRED, 4)[0]
    if task == "segment":
        return ReferenceSpec(scale, task, num_classes, num_masks=_shape(state_dict, _CV4_PRED, 4)[0])
    if task == "detect":
        if kpt_shape is not None:
            raise ValueError(
                f"[yolo_func] infer_reference_model: kpt_shape={tuple(kpt_shape)} was given but the state dict has no "
                f"keypoint branch (model.22.cv4.*): a detect model"
            )
        return ReferenceSpec(scale, task, num_classes)
    nk = _shape(state_dict, _CV4_PRED, 4)[0]
    if kpt_shape is not None:
        p, d = (int(v) for v in kpt_shape)
        if p * d != nk or d not in (2, 3) or p < 1:
            raise ValueError(
                f"[yolo_func] infer_reference_model: kpt_shape={(p, d)} does not fit the keypoint branch "
                f"({_CV4_PRED!r} has {nk} output channels = P*D with D in (2, 3))"
            )
        return ReferenceSpec(scale, task, num_classes, kpt_shape=(p, d))
    if nk % 3 == 0:
        return ReferenceSpec(scale, task, num_classes, kpt_shape=(nk // 3, 3))
    if nk % 2 == 0:
        return ReferenceSpec(scale, task, num_classes, kpt_shape=(nk // 2, 2))
    raise ValueError(
        f"[yolo_func] infer_reference_model: the keypoint branch ({_CV4_PRED!r}) has {nk} output channels, "
        f"which is not P*2 or P*3 keypoint channels"
    )


def infer_reference_model(state_dict: Mapping[str, Any], *, kpt_shape: tuple[int, int] | None = None):
    """The :class:`yolo_func.models.Model` a reference state dict holds (``infer_reference_spec(...).build()``).

    Args:
      state_dict: ``{reference key: tensor}`` (shapes only are read).
      kpt_shape: pose only: ``(P, D)`` when known from elsewhere (checkpoint metadata); see
        :func:`infer_reference_spec` for the rule used without it.

    Returns:
      ``yolov8(scale, task=..., num_classes=..., kpt_shape=..., num_masks=...)``; its
      :func:`~yolo_func.io.ultralytics.reference_layout` has the state dict's keys and shapes.

    Raises:
      TypeError, ValueError: as :func:`infer_reference_spec`.

    Example:
      >>> import torch
      >>> from yolo_func import yolov8
      >>> from yolo_func import io
      >>> model = yolov8("n", task="detect", num_classes=5)
      >>> params, state = model.init(torch.Generator().manual_seed(0))
      >>> m = io.infer_reference_model(io.to_reference(model, params, state))   # shapes only
      >>> m.scale, m.task, m.num_classes
      ('n', 'detect', 5)
    """
    return infer_reference_spec(state_dict, kpt_shape=kpt_shape).build()
