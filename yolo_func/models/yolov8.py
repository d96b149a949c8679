"""The YOLOv8 model: a network (backbone + neck) and a dict of heads (REFERENCE.md §1)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

from yolo_func import tree as T
from yolo_func._types import Anchors, Feats
from yolo_func.assign.anchors import anchors_for_feats
from yolo_func.heads import Head, detect_head, pose_head, segment_head
from yolo_func.models.backbone import backbone
from yolo_func.models.neck import neck, neck_channels
from yolo_func.models.scales import Scale, channels, get_scale
from yolo_func.nn import Layer, abstract_init

__all__ = ["Model", "Inference", "network", "yolov8", "TASKS", "check_images"]

TASKS = ("detect", "segment", "pose")


class Inference(NamedTuple):
    """Reference-layout inference output.

    Attributes:
      y: float[B, 4 + K + E, A]: (cx, cy, w, h) pixels, class probabilities, then E extra channels
        (mask coefficients for segment, decoded keypoints for pose).
      protos: float[B, NM, H/4, W/4] for segmentation models, else None.

    Example:
      >>> import torch
      >>> from yolo_func import yolov8
      >>> model = yolov8("n", task="segment", num_classes=5)
      >>> params, state = model.init(torch.Generator().manual_seed(0))
      >>> out = model.predict(params, state, torch.rand(1, 3, 64, 64))
      >>> tuple(out.y.shape), tuple(out.protos.shape)     # (B, 4 + K + NM, A), (B, NM, H/4, W/4)
      ((1, 41, 84), (1, 32, 16, 16))
    """

    y: torch.Tensor
    protos: torch.Tensor | None = None


def check_images(images: Any, *, in_channels: int = 3, multiple: int = 32) -> None:
    """Validate a batch of images.

    Raises:
      TypeError: not a floating-point tensor.
      ValueError: not ``float[B, in_channels, H, W]`` with H, W multiples of ``multiple``.

    Example:
      >>> import torch
      >>> from yolo_func.models import check_images
      >>> check_images(torch.rand(2, 3, 64, 96))              # fine: float[B, 3, H, W], H and W multiples of 32
      >>> try:
      ...     check_images(torch.rand(2, 3, 60, 64))
      ... except ValueError as e:
      ...     print(str(e)[:60])
      [yolo_func] images H and W must be positive multiples of 32,
    """
    if not isinstance(images, torch.Tensor):
        raise TypeError(f"[yolo_func] images must be a torch.Tensor float[B, {in_channels}, H, W], got {type(images).__name__}")
    if not images.is_floating_point():
        raise TypeError(
            f"[yolo_func] images must be floating point (uint8 images: divide by 255 first), got dtype {images.dtype}"
        )
    if images.dim() != 4 or images.shape[1] != in_channels:
        raise ValueError(f"[yolo_func] images must be float[B, {in_channels}, H, W], got shape {tuple(images.shape)}")
    h, w = images.shape[-2:]
    if h % multiple or w % multiple or h == 0 or w == 0:
        raise ValueError(
            f"[yolo_func] images H and W must be positive multiples of {multiple}, got H={h}, W={w}; "
            f"letterbox or resize to e.g. {max(multiple, -(-h // multiple) * multiple)}x{max(multiple, -(-w // multiple) * multiple)}"
        )


def network(scale: str | Scale) -> Layer:
    """Backbone + neck as one pure layer.

    Tree keys: ``backbone/...`` and ``neck/...`` (see :mod:`yolo_func.models.backbone`, ``neck``).
    Apply: ``images float[B, 3, H, W] -> (Feats(p3, p4, p5), state)``.

    Example:
      >>> import torch
      >>> from yolo_func.models import network
      >>> net = network("n")
      >>> p, s = net.init(torch.Generator().manual_seed(0))
      >>> feats, _ = net.apply(p, s, torch.rand(1, 3, 64, 64), train=False)    # Feats(p3, p4, p5)
      >>> sorted(p), tuple(feats.p5.shape)
      (['backbone', 'neck'], (1, 256, 2, 2))
    """
    scale = get_scale(scale)
    bb, nk = backbone(scale), neck(scale)

    def init(gen: torch.Generator):
        bp, bs = bb.init(gen)
        np_, ns = nk.init(gen)
        return {"backbone": bp, "neck": np_}, {"backbone": bs, "neck": ns}

    def apply(params, state, images, *, train: bool) -> tuple[Feats, dict]:
        c, bs = bb.apply(params["backbone"], state["backbone"], images, train=train)
        feats, ns = nk.apply(params["neck"], state["neck"], c, train=train)
        return feats, ({"backbone": bs, "neck": ns} if train else state)

    return Layer(init, apply)


@dataclasses.dataclass(frozen=True)
class Model:
    """A network and named heads. Build with :func:`yolov8`; swap heads with :meth:`with_heads`.

    Params and state trees are ``{"network": ..., "heads": {name: ...}}``.

    Example:
      >>> import torch
      >>> from yolo_func import yolov8
      >>> model = yolov8("n", task="detect", num_classes=5)       # a Model
      >>> params, state = model.init(torch.Generator().manual_seed(0))
      >>> sorted(model.heads), model.num_params(params)
      (['detect'], 3011823)
      >>> preds, new_state = model.apply(params, state, torch.rand(1, 3, 64, 64), train=True)
      >>> model.predict(params, state, torch.rand(1, 3, 64, 64)).y.shape
      torch.Size([1, 9, 84])
    """

    network: Layer
    heads: Mapping[str, Head]
    scale: str = "n"
    task: str = "detect"
    num_classes: int = 80
    strides: tuple[int, ...] = (8, 16, 32)
    reg_max: int = 16
    in_channels: int = 3

    def __post_init__(self):
        if "detect" not in self.heads:
            raise ValueError(
                f"[yolo_func] a model needs a 'detect' head (boxes, classes and the assignment come from it); got heads {list(self.heads)}"
            )
        if next(iter(self.heads)) != "detect":
            raise ValueError(f"[yolo_func] 'detect' must be the first head (init order, output layout); got {list(self.heads)}")
        object.__setattr__(self, "heads", dict(self.heads))

    # -- building ---------------------------------------------------------------------------
    def init(self, gen: torch.Generator) -> tuple[dict, dict]:
        """Draw parameters from a CPU generator: network first, then heads in dict order
        (the reference's registration order, so a seed reproduces its weights).

        Returns:
          ``(params, state)`` on the CPU, float32.
        """
        if not isinstance(gen, torch.Generator) or gen.device.type != "cpu":
            raise TypeError(f"[yolo_func] init needs a CPU torch.Generator, got {gen!r}")
        net_p, net_s = self.network.init(gen)
        head_p, head_s = {}, {}
        for name, head in self.heads.items():
            head_p[name], head_s[name] = head.init(gen)
        return {"network": net_p, "heads": head_p}, {"network": net_s, "heads": head_s}

    def with_heads(self, heads: Mapping[str, Head], **changes) -> "Model":
        """A copy of this model with another head dict (and optionally other fields)."""
        return dataclasses.replace(self, heads=dict(heads), **changes)

    # -- running ------------------------------------------------------------------------------
    def features(self, params: dict, state: dict, images: torch.Tensor, *, train: bool) -> tuple[Feats, dict]:
        """Network forward. ``params``/``state`` are the ``network`` subtrees.

        Returns ``(Feats, new network state)``.
        """
        check_images(images, in_channels=self.in_channels)
        return self.network.apply(params, state, images, train=train)

    def apply(self, params: dict, state: dict, images: torch.Tensor, *, train: bool) -> tuple[dict[str, Any], dict]:
        """Full forward.

        Args:
          params, state: whole-model trees.
          images: float[B, 3, H, W], H and W multiples of 32.
          train: training mode (batch statistics, BN state updated out of place).

        Returns:
          ``({head_name: preds}, new_state)``; see each head for its preds.
        """
        self._check_trees(params, state)
        feats, net_s = self.features(params["network"], state["network"], images, train=train)
        preds, head_s = {}, {}
        for name, head in self.heads.items():
            preds[name], head_s[name] = head.apply(params["heads"][name], state["heads"][name], feats, train=train)
        return preds, ({"network": net_s, "heads": head_s} if train else state)

    def anchors(self, feats: Feats) -> Anchors:
        """Anchor points and strides for these feature maps."""
        return anchors_for_feats(feats, self.strides)

    def decode(self, preds: Mapping[str, Any], anchors: Anchors) -> Inference:
        """Reference-layout inference output from training-mode preds (see :class:`Inference`)."""
        ys, protos = [], None
        for name, head in self.heads.items():
            out = head.decode(preds[name], anchors)
            if isinstance(out, tuple):
                out, protos = out
            ys.append(out)
        return Inference(torch.cat(ys, 1), protos)

    def predict(self, params: dict, state: dict, images: torch.Tensor) -> Inference:
        """Eval-mode forward and decode: the reference's inference output (before NMS)."""
        self._check_trees(params, state)
        feats, _ = self.features(params["network"], state["network"], images, train=False)
        preds = {
            name: head.apply(params["heads"][name], state["heads"][name], feats, train=False)[0]
            for name, head in self.heads.items()
        }
        return self.decode(preds, self.anchors(feats))

    # -- inspecting ---------------------------------------------------------------------------
    def num_params(self, params: dict, *, include_frozen: bool = True) -> int:
        """Number of parameter elements; with ``include_frozen`` also the detect head's frozen DFL
        projection (R values) that the reference counts as a parameter."""
        return T.tree_count(params) + (self.reg_max if include_frozen else 0)

    def abstract_init(self) -> tuple[dict, dict]:
        """Shapes without memory: ``init`` on the meta device."""
        with abstract_init():
            return self.init(torch.Generator().manual_seed(0))

    def check_trees(self, params: dict, state: dict) -> None:
        """Full validation of ``params`` and ``state`` against this model's paths and shapes.

        Raises:
          ValueError: listing missing (`` - ``), unexpected (`` + ``) and mis-shaped (`` ~ ``) paths.
        """
        exp_p, exp_s = self.abstract_init()
        for what, got, exp in (("params", params, exp_p), ("state", state, exp_s)):
            diff = T.tree_diff(exp, got, names=("expected", "given"))
            if diff:
                raise ValueError(
                    f"[yolo_func] {what} do not fit yolov8{self.scale} ({self.task}, {self.num_classes} classes):\n{diff}"
                )

    def _check_trees(self, params: Any, state: Any) -> None:
        # Cheap checks on every call (no full tree walk): top-level layout and the widths of the
        # first and last network convs, which differ between scales.
        for what, tree in (("params", params), ("state", state)):
            if not isinstance(tree, Mapping) or set(tree) != {"network", "heads"}:
                got = sorted(tree) if isinstance(tree, Mapping) else type(tree).__name__
                hint = " (did you pass params and state in the wrong order, or only a subtree?)"
                raise ValueError(f"[yolo_func] {what} must be a dict with keys ['heads', 'network'], got {got}{hint}")
            if set(tree["heads"]) != set(self.heads):
                raise ValueError(f"[yolo_func] {what}['heads'] has {sorted(tree['heads'])}, the model has heads {sorted(self.heads)}")
        try:
            stem = params["network"]["backbone"]["stem"]["conv"]["weight"]
            last = params["network"]["neck"]["p5_out"]["c2f"]["cv2"]["conv"]["weight"]
        except (KeyError, TypeError) as e:
            raise ValueError(f"[yolo_func] params['network'] is not a YOLOv8 network tree (missing {e})") from None
        scale = get_scale(self.scale)
        want = (channels(64, scale), self.in_channels, 3, 3)
        if tuple(stem.shape) != want:
            raise ValueError(
                f"[yolo_func] params do not fit yolov8{self.scale}: network/backbone/stem/conv/weight has shape "
                f"{list(stem.shape)}, expected {list(want)} (a params tree from another scale?)"
            )
        if last.shape[0] != channels(1024, scale):
            raise ValueError(
                f"[yolo_func] params do not fit yolov8{self.scale}: network/neck/p5_out/c2f/cv2/conv/weight has "
                f"{last.shape[0]} output channels, expected {channels(1024, scale)} (a params tree from another scale?)"
            )


def yolov8(
    scale: str = "n",
    *,
    task: str = "detect",
    num_classes: int | None = None,
    kpt_shape: tuple[int, int] = (17, 3),
    num_masks: int = 32,
) -> Model:
    """Build a YOLOv8 model.

    Args:
      scale: one of ``"n", "s", "m", "l", "x"``.
      task: ``"detect"``, ``"segment"`` (detect + segment heads) or ``"pose"`` (detect + pose heads).
      num_classes: K (reference ``nc``); defaults to 80, or 1 for pose.
      kpt_shape: (P, D) keypoints for pose, D in {2, 3}.
      num_masks: NM mask coefficients for segment.

    Returns:
      A :class:`Model`.

    Example:
      >>> import torch
      >>> model = yolov8("n", task="segment")
      >>> params, state = model.init(torch.Generator().manual_seed(0))
      >>> model.num_params(params)
      3409968
    """
    if task not in TASKS:
        raise ValueError(f"[yolo_func] unknown task {task!r}; expected one of {list(TASKS)}")
    sc = get_scale(scale)
    if num_classes is None:
        num_classes = 1 if task == "pose" else 80
    ch = neck_channels(sc)
    strides = (8, 16, 32)
    heads: dict[str, Head] = {"detect": detect_head(num_classes=num_classes, channels=ch, strides=strides)}
    if task == "segment":
        heads["segment"] = segment_head(channels=ch, num_masks=num_masks, proto_channels=channels(256, sc))
    elif task == "pose":
        heads["pose"] = pose_head(channels=ch, kpt_shape=tuple(kpt_shape))
    return Model(network(sc), heads, scale=sc.name, task=task, num_classes=num_classes, strides=strides)
