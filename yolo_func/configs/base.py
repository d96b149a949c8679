"""The training configuration: a tree of frozen dataclasses with the reference's defaults.

A :class:`Config` holds numbers and choices only (STYLE.md §8): the model, heads, optimizer and
data pipeline are built by calling factories with these values. Every option carries its help
text and its bounds in the field's metadata, so validation, the ``key=value`` override parser
(:mod:`yolo_func.configs.overrides`) and the options table of ``docs/training.md``
(:func:`yolo_func.configs.docs.options_table`) all read one source.

Defaults are the reference's ``default.yaml`` (REFERENCE.md §4.1-4.6); a recipe
(:func:`recipe`) changes only the model section.

Example:
  >>> from yolo_func.configs import recipe
  >>> cfg = recipe("s", "segment")
  >>> cfg.model.scale, cfg.model.task, cfg.optim.lr0, cfg.data.augment.mosaic
  ('s', 'segment', 0.01, 1.0)
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import types
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union, get_args, get_origin, get_type_hints

__all__ = [
    "ModelConfig",
    "AugmentConfig",
    "DataConfig",
    "OptimConfig",
    "LossConfig",
    "ValConfig",
    "TrainConfig",
    "Config",
    "SCALES",
    "TASKS",
    "TASK_SUFFIX",
    "recipe",
    "recipe_name",
    "config_keys",
    "field_info",
    "FieldInfo",
    "check_value",
    "type_name",
]

#: Network scales (reference ``yolov8{n,s,m,l,x}``).
SCALES = ("n", "s", "m", "l", "x")
#: Tasks, and the suffix the reference's model names use for them (``yolov8s-seg``).
TASKS = ("detect", "segment", "pose")
TASK_SUFFIX = {"detect": "", "segment": "-seg", "pose": "-pose"}

_DEVICE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


def _opt(default: Any, help: str, *, ge: float | None = None, gt: float | None = None, le: float | None = None,
         lt: float | None = None, multiple_of: int | None = None, pattern: re.Pattern | None = None) -> Any:
    """A dataclass field with its help text and bounds in ``metadata``."""
    meta = {"help": help, "ge": ge, "gt": gt, "le": le, "lt": lt, "multiple_of": multiple_of, "pattern": pattern}
    return field(default=default, metadata=meta)


def _section(cls: type, help: str) -> Any:
    return field(default_factory=cls, metadata={"help": help, "section": True})


# --------------------------------------------------------------------------------------------- types


def _is_optional(tp: Any) -> tuple[bool, Any]:
    """``(True, X)`` for ``Optional[X]`` / ``X | None``, else ``(False, tp)``."""
    if get_origin(tp) in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(get_args(tp)) == 2:
            return True, args[0]
    return False, tp


def type_name(tp: Any) -> str:
    """Human-readable name of a config field type (``int``, ``float or None``, ``one of 'a', 'b'``,
    ``tuple[int, int]``)."""
    optional, inner = _is_optional(tp)
    if optional:
        return f"{type_name(inner)} or None"
    if get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if get_origin(tp) is tuple:
        args = get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return f"tuple[{type_name(args[0])}, ...]"
        return "tuple[" + ", ".join(type_name(a) for a in args) + "]"
    return getattr(tp, "__name__", str(tp))


def _bounds_problem(value: Any, meta: dict) -> str | None:
    """Why ``value`` violates the field's bounds, or None."""
    if isinstance(value, tuple):
        for v in value:
            bad = _bounds_problem(v, meta)
            if bad:
                return bad
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if isinstance(value, float) and not math.isfinite(value):
            return "a finite number"
        for key, op, text in (("ge", lambda a, b: a >= b, ">="), ("gt", lambda a, b: a > b, ">"),
                              ("le", lambda a, b: a <= b, "<="), ("lt", lambda a, b: a < b, "<")):
            bound = meta.get(key)
            if bound is not None and not op(value, bound):
                return f"a value {text} {bound}"
        m = meta.get("multiple_of")
        if m and value % m:
            return f"a multiple of {m}"
    if isinstance(value, str) and meta.get("pattern") is not None and not meta["pattern"].match(value):
        return f"a string matching {meta['pattern'].pattern!r}"
    return None


def check_value(key: str, tp: Any, value: Any, meta: dict | None = None) -> Any:
    """Check a Python value against a config field's type and bounds; return it normalised
    (an int for a float field becomes a float, a list for a tuple field a tuple).

    Args:
      key: the dotted key, for messages (``"optim.lr0"``).
      tp: the field's type annotation.
      value: the value to check.
      meta: the field's metadata (bounds); None skips the bounds.

    Raises:
      TypeError: the value has another type (names the key, the expected type and the value).
      ValueError: the value is out of bounds or not one of the choices.
    """
    optional, inner = _is_optional(tp)
    if value is None:
        if optional:
            return None
        raise TypeError(f"[yolo_func] config key {key!r} expects {type_name(tp)}; got None. Give a value, e.g. {key}=...")
    tp = inner
    got = f"{value!r} ({type(value).__name__})"
    if get_origin(tp) is Literal:
        choices = get_args(tp)
        if value not in choices or type(value) is not type(choices[0]):
            raise ValueError(f"[yolo_func] config key {key!r} expects {type_name(tp)}; got {got}")
        return value
    if get_origin(tp) is tuple:
        if not isinstance(value, (tuple, list)):
            raise TypeError(f"[yolo_func] config key {key!r} expects {type_name(tp)}; got {got}")
        args = get_args(tp)
        elems = [args[0]] * len(value) if (len(args) == 2 and args[1] is Ellipsis) else list(args)
        if len(elems) != len(value):
            raise TypeError(f"[yolo_func] config key {key!r} expects {type_name(tp)} ({len(elems)} items); got {got}")
        out = tuple(check_value(key, t, v) for t, v in zip(elems, value))
    elif tp is bool:
        if not isinstance(value, bool):
            raise TypeError(f"[yolo_func] config key {key!r} expects bool (true/false); got {got}")
        out = value
    elif tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"[yolo_func] config key {key!r} expects int; got {got}")
        out = value
    elif tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"[yolo_func] config key {key!r} expects float; got {got}")
        out = float(value)
    elif tp is str:
        if not isinstance(value, str):
            raise TypeError(f"[yolo_func] config key {key!r} expects str; got {got}")
        out = value
    else:  # a programming error in this module, not a user error
        raise TypeError(f"[yolo_func] config key {key!r} has an unsupported type {tp!r}")
    if meta is not None:
        bad = _bounds_problem(out, meta)
        if bad:
            raise ValueError(f"[yolo_func] config key {key!r} expects {bad}; got {value!r}")
    return out


@dataclass(frozen=True)
class FieldInfo:
    """One option of the config tree.

    Attributes:
      key: dotted key (``"data.augment.mosaic"``).
      type: the annotation (``float``, ``Optional[int]``, ``Literal[...]``).
      default: the default of a plain :class:`Config`.
      help: one line of documentation.
      meta: bounds (``ge``, ``gt``, ``le``, ``lt``, ``multiple_of``, ``pattern``).

    Example:
      >>> from yolo_func.configs import field_info
      >>> f = next(f for f in field_info() if f.key == "data.image_size")   # a FieldInfo
      >>> f.default, {k: v for k, v in f.meta.items() if v is not None}
      (640, {'gt': 0, 'multiple_of': 32})
    """

    key: str
    type: Any
    default: Any
    help: str
    meta: dict


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return get_type_hints(cls)


def _is_section(tp: Any) -> bool:
    return dataclasses.is_dataclass(tp) and isinstance(tp, type)


def _validate(obj: Any) -> None:
    """Check (and normalise in place of construction) every leaf field of one section."""
    prefix = getattr(type(obj), "_prefix", "")
    for f in dataclasses.fields(obj):
        tp = _hints(type(obj))[f.name]
        value = getattr(obj, f.name)
        key = f"{prefix}{f.name}"
        if _is_section(tp):
            if not isinstance(value, tp):
                raise TypeError(f"[yolo_func] config section {key!r} expects a {tp.__name__}; got {type(value).__name__}")
            continue
        object.__setattr__(obj, f.name, check_value(key, tp, value, f.metadata))


@functools.cache
def field_info(cls: type | None = None) -> tuple[FieldInfo, ...]:
    """Every leaf option of the config tree, in declaration order.

    Args:
      cls: a section class (default :class:`Config`).

    Returns:
      A tuple of :class:`FieldInfo`.
    """
    cls = Config if cls is None else cls
    out: list[FieldInfo] = []
    for f in dataclasses.fields(cls):
        tp = _hints(cls)[f.name]
        if _is_section(tp):
            out.extend(field_info(tp))
            continue
        meta = dict(f.metadata)
        out.append(FieldInfo(f"{cls._prefix}{f.name}", tp, f.default, meta.pop("help"), meta))
    return tuple(out)


def config_keys(cls: type | None = None) -> list[str]:
    """All dotted leaf keys (``["model.scale", ..., "train.plots"]``).

    Example:
      >>> from yolo_func.configs import config_keys
      >>> keys = config_keys()
      >>> keys[:3], "data.augment.mosaic" in keys
      (['model.scale', 'model.task', 'model.num_classes'], True)
    """
    return [f.key for f in field_info(cls)]


# ------------------------------------------------------------------------------------------ sections


@dataclass(frozen=True)
class ModelConfig:
    """The network and its heads (``yolov8(scale, task=..., num_classes=..., kpt_shape=...)``).

    Example:
      >>> from yolo_func.configs import ModelConfig
      >>> ModelConfig(scale="s", task="pose").kpt_shape
      (17, 3)
    """

    _prefix = "model."
    scale: Literal["n", "s", "m", "l", "x"] = _opt("n", "network scale: yolov8n / s / m / l / x")
    task: Literal["detect", "segment", "pose"] = _opt("detect", "detect; segment (detect + segment heads); pose (detect + pose heads)")
    num_classes: Optional[int] = _opt(None, "K, the reference's `nc`; None: the data's number of categories", ge=1)
    kpt_shape: tuple[int, int] = _opt((17, 3), "pose: keypoints per instance and values per keypoint (x, y[, visibility])", ge=1)
    weights: Optional[str] = _opt(
        None, "start from these weights: our checkpoint or a reference `.pt` (heads re-initialised when the number of classes differs); None: the seeded init")

    def __post_init__(self) -> None:
        _validate(self)
        if self.kpt_shape[1] not in (2, 3):
            raise ValueError(f"[yolo_func] config key 'model.kpt_shape' expects (P, D) with D 2 or 3; got {self.kpt_shape}")


@dataclass(frozen=True)
class AugmentConfig:
    """Training augmentation (REFERENCE.md §4.6); validation images are only letterboxed.

    Example:
      >>> from yolo_func.configs import AugmentConfig
      >>> a = AugmentConfig(mosaic=0.0)
      >>> a.mosaic, a.fliplr, a.close_mosaic
      (0.0, 0.5, 10)
    """

    _prefix = "data.augment."
    mosaic: float = _opt(1.0, "probability of a 2x2 mosaic", ge=0.0, le=1.0)
    translate: float = _opt(0.1, "random affine: translation, fraction of the image size", ge=0.0, le=1.0)
    scale: float = _opt(0.5, "random affine: scale gain drawn from U(1 - scale, 1 + scale)", ge=0.0, lt=1.0)
    degrees: float = _opt(0.0, "random affine: rotation range in degrees (+/-)", ge=0.0, le=180.0)
    shear: float = _opt(0.0, "random affine: shear range in degrees (+/-)", ge=0.0, le=90.0)
    perspective: float = _opt(0.0, "random affine: perspective range", ge=0.0, le=0.001)
    hsv_h: float = _opt(0.015, "HSV hue gain (fraction)", ge=0.0, le=1.0)
    hsv_s: float = _opt(0.7, "HSV saturation gain (fraction)", ge=0.0, le=1.0)
    hsv_v: float = _opt(0.4, "HSV value gain (fraction)", ge=0.0, le=1.0)
    flipud: float = _opt(0.0, "probability of a vertical flip", ge=0.0, le=1.0)
    fliplr: float = _opt(0.5, "probability of a horizontal flip (pose: keypoints re-ordered by the flip index)", ge=0.0, le=1.0)
    close_mosaic: int = _opt(10, "turn mosaic off for the last N epochs (affine, HSV and flips stay on)", ge=0)

    def __post_init__(self) -> None:
        _validate(self)


@dataclass(frozen=True)
class DataConfig:
    """Where the images come from and how batches are formed.

    Example:
      >>> from yolo_func.configs import DataConfig
      >>> d = DataConfig(image_size=320, batch_size=8)
      >>> d.path, d.image_size, d.augment.mosaic
      ('builtin', 320, 1.0)
    """

    _prefix = "data."
    path: str = _opt("builtin", "'builtin' (the packaged data), a COCO folder, a COCO JSON (with data.images) or a YOLO data.yaml")
    images: Optional[str] = _opt(None, "image folder for a COCO JSON given as data.path; None: next to the JSON")
    image_size: int = _opt(640, "square training and validation size in pixels (a multiple of 32)", gt=0, multiple_of=32)
    batch_size: int = _opt(16, "images per training step (accumulated to optim.nbs)", ge=1)
    workers: int = _opt(8, "loader worker processes (0: load in the main process)", ge=0)
    cache: Literal["none", "ram"] = _opt("none", "keep decoded, resized images in RAM ('ram') or read them every epoch ('none')")
    prefetch: int = _opt(4, "batches each worker loads ahead (shared memory: workers x prefetch batches); a deep queue "
                            "fills while the fit captures, validates and checkpoints", ge=1)
    max_boxes: Optional[int] = _opt(
        None, "pad targets to this many boxes per image; None: each batch's largest count rounded up to a power of two", ge=1)
    mask_source: Literal["auto", "polygons", "bitmaps"] = _opt(
        "auto", "segmentation masks through the augmentation: 'polygons' (the reference's form: resampled, transformed, "
                "filled at the end), 'bitmaps' (the dataset's masks warped), 'auto' (polygons where the dataset has them)")
    augment: AugmentConfig = _section(AugmentConfig, "training augmentation")

    def __post_init__(self) -> None:
        _validate(self)


@dataclass(frozen=True)
class OptimConfig:
    """The reference's SGD recipe (:func:`yolo_func.train.yolo_sgd`) and the model EMA.

    Example:
      >>> from yolo_func.configs import OptimConfig
      >>> o = OptimConfig(lr0=0.02)
      >>> o.lr0, o.momentum, o.nbs
      (0.02, 0.937, 64)
    """

    _prefix = "optim."
    optimizer: Literal["SGD"] = _opt("SGD", "the optimizer (Nesterov SGD with the reference's three parameter groups)")
    lr0: float = _opt(0.01, "initial learning rate", gt=0.0)
    lrf: float = _opt(0.01, "final learning rate as a fraction of lr0", gt=0.0, le=1.0)
    momentum: float = _opt(0.937, "SGD momentum", ge=0.0, lt=1.0)
    weight_decay: float = _opt(5e-4, "L2 weight decay at the nominal batch (scaled by batch * accumulate / nbs)", ge=0.0)
    warmup_epochs: float = _opt(3.0, "warmup length in epochs (fractions allowed)", ge=0.0)
    warmup_momentum: float = _opt(0.8, "momentum at the start of warmup", ge=0.0, lt=1.0)
    warmup_bias_lr: float = _opt(0.1, "bias learning rate at the start of warmup", ge=0.0)
    nbs: int = _opt(64, "nominal batch size: gradients are accumulated to it", ge=1)
    cos_lr: bool = _opt(False, "cosine instead of linear learning-rate decay")
    max_norm: float = _opt(10.0, "clip the global gradient norm to this before each step", gt=0.0)
    ema_decay: float = _opt(0.9999, "EMA decay d in d * (1 - exp(-updates / ema_tau))", gt=0.0, lt=1.0)
    ema_tau: float = _opt(2000.0, "EMA warmup constant in updates", gt=0.0)

    def __post_init__(self) -> None:
        _validate(self)


@dataclass(frozen=True)
class LossConfig:
    """Loss gains (``yolo_func.losses.LossGains``; the segmentation term uses the box gain).

    Example:
      >>> from yolo_func.configs import LossConfig
      >>> LossConfig()
      LossConfig(box=7.5, cls=0.5, dfl=1.5, pose=12.0, kobj=1.0)
    """

    _prefix = "loss."
    box: float = _opt(7.5, "box (CIoU) gain; also the segmentation gain", ge=0.0)
    cls: float = _opt(0.5, "classification (BCE) gain", ge=0.0)
    dfl: float = _opt(1.5, "distribution focal loss gain", ge=0.0)
    pose: float = _opt(12.0, "keypoint (OKS) gain", ge=0.0)
    kobj: float = _opt(1.0, "keypoint visibility (BCE) gain", ge=0.0)

    def __post_init__(self) -> None:
        _validate(self)


@dataclass(frozen=True)
class ValConfig:
    """Validation during training (REFERENCE.md §3.1), on the EMA weights.

    Example:
      >>> from yolo_func.configs import ValConfig
      >>> v = ValConfig()
      >>> v.conf, v.iou, v.max_det, v.precision, v.coco
      (0.001, 0.7, 300, 'auto', 'auto')
    """

    _prefix = "val."
    conf: float = _opt(0.001, "confidence threshold before NMS", ge=0.0, lt=1.0)
    iou: float = _opt(0.7, "NMS IoU threshold", gt=0.0, le=1.0)
    max_det: int = _opt(300, "detections kept per image", ge=1)
    batch_size: Optional[int] = _opt(None, "validation batch; None: twice data.batch_size", ge=1)
    precision: Literal["auto", "bf16", "fp16", "fp32"] = _opt(
        "auto", "the network's autocast during validation ('auto': fp16 on CUDA, fp32 on the CPU; bf16 blurs "
        "boxes at high IoU thresholds: -0.05 box mAP50-95 measured)")
    coco: Literal["auto", "on", "off"] = _opt(
        "auto", "pycocotools evaluation of each validation, in a worker process while training goes on (coco.csv, "
        "events.jsonl 'coco', FitResult.coco); 'auto': on when the val data carries a COCO JSON (CocoDataset, builtin)")

    def __post_init__(self) -> None:
        _validate(self)


@dataclass(frozen=True)
class TrainConfig:
    """The loop: length, device, replay, precision, stopping, the run folder.

    Example:
      >>> from yolo_func.configs import TrainConfig
      >>> t = TrainConfig(epochs=5, device="cpu")
      >>> t.epochs, t.capture, t.name
      (5, 'auto', 'exp')
    """

    _prefix = "train."
    epochs: int = _opt(100, "epochs over the training split", ge=1)
    device: str = _opt("auto", "'auto' (CUDA when available, else the CPU), 'cpu', 'cuda' or 'cuda:N'", pattern=_DEVICE)
    capture: Literal["auto", "none", "network", "network+heads", "step"] = _opt(
        "auto", "CUDA-graph replay level on CUDA ('auto': 'step' where the heads allow it); 'none': eager. The CPU is always eager")
    autocast: Literal["auto", "bfloat16", "none"] = _opt("auto", "mixed precision ('auto': bfloat16 on CUDA, none on the CPU)")
    compile: Literal["none", "auto", "default", "max-autotune", "aot_eager"] = _opt(
        "none", "torch.compile (inductor) of the network and heads, captured by the replay levels: 'default', "
        "'max-autotune' (longer compiles), 'aot_eager' (no inductor; debugging), 'auto' ('default' on CUDA, 'none' on "
        "the CPU), 'none'. Seconds spent compiling: events.jsonl 'compile'; cache: TORCHINDUCTOR_CACHE_DIR")
    vjp: Literal["auto", "func", "autograd"] = _opt(
        "auto", "how the step differentiates: 'func' (torch.func.vjp; its first backward imports torch._dynamo, "
        "~5 s of start-up measured on an H200 host) or 'autograd' (torch.autograd.grad: the same kernels, gradients "
        "equal up to float summation order, no torch._dynamo import: ~1.5 s less start-up on a 2-core CPU). 'auto': "
        "'autograd' on the CPU, 'func' on CUDA. Replay equals eager bitwise with either")
    seed: int = _opt(0, "seed of the init, the loader order and the augmentation", ge=0)
    patience: int = _opt(100, "stop after this many epochs without a better fitness (0: never)", ge=0)
    time_limit_hours: Optional[float] = _opt(None, "stop (and save) after this much wall-clock time; None: no limit", gt=0.0)
    val_every: int = _opt(1, "validate every N epochs (and always after the last one)", ge=1)
    out: Optional[str] = _opt(None, "the run folder; an existing one with weights/last.pt resumes. None: runs/<task>/<name>")
    name: str = _opt("exp", "run name under runs/<task>/ (exp, exp2, ... when taken)", pattern=re.compile(r"^[\w.+-]+$"))
    resume: bool = _opt(False, "resume the most recent run of this task (when train.out is not given)")
    plots: bool = _opt(True, "write PNG plots (needs matplotlib: pip install 'yolo_func[plots]')")
    sync_bn: bool = _opt(False, "data-parallel runs (torchrun / --devices): BN batch statistics over every rank's batch "
                              "(SyncBN; the network runs eagerly: collectives cannot sit inside the replayed graphs)")

    def __post_init__(self) -> None:
        _validate(self)


@dataclass(frozen=True)
class Config:
    """The whole training configuration (every leaf is a JSON scalar or a tuple of them).

    Attributes:
      model: :class:`ModelConfig`.
      data: :class:`DataConfig` (with ``augment``: :class:`AugmentConfig`).
      optim: :class:`OptimConfig`.
      loss: :class:`LossConfig`.
      val: :class:`ValConfig`.
      train: :class:`TrainConfig`.

    Example:
      >>> from yolo_func.configs import Config
      >>> cfg = Config()                                   # the reference's default.yaml
      >>> cfg.data.image_size, cfg.optim.lr0, cfg.train.epochs
      (640, 0.01, 100)
      >>> import dataclasses                              # frozen dataclasses: change with replace
      >>> dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, epochs=3)).train.epochs
      3
    """

    _prefix = ""
    model: ModelConfig = _section(ModelConfig, "the network and its heads")
    data: DataConfig = _section(DataConfig, "images and batches")
    optim: OptimConfig = _section(OptimConfig, "optimizer, schedules and EMA")
    loss: LossConfig = _section(LossConfig, "loss gains")
    val: ValConfig = _section(ValConfig, "validation")
    train: TrainConfig = _section(TrainConfig, "the loop and the run folder")

    def __post_init__(self) -> None:
        _validate(self)


# ------------------------------------------------------------------------------------------- recipes


def recipe_name(scale: str, task: str) -> str:
    """The reference's model name for a scale and task: ``recipe_name("s", "segment") == "yolov8s-seg"``.

    Example:
      >>> from yolo_func.configs import recipe_name
      >>> recipe_name("s", "segment"), recipe_name("n", "detect"), recipe_name("x", "pose")
      ('yolov8s-seg', 'yolov8n', 'yolov8x-pose')
    """
    if scale not in SCALES or task not in TASKS:
        raise ValueError(f"[yolo_func] no recipe for scale {scale!r} and task {task!r}; expected a scale in {SCALES} and a task in {TASKS}")
    return f"yolov8{scale}{TASK_SUFFIX[task]}"


def recipe(scale: str, task: str) -> Config:
    """The reference's recipe for one model: its ``default.yaml`` (640 px, batch 16, 100 epochs,
    SGD lr0 0.01, the augmentation of REFERENCE.md §4.6) with this scale and task.

    Args:
      scale: ``"n"``, ``"s"``, ``"m"``, ``"l"`` or ``"x"``.
      task: ``"detect"``, ``"segment"`` or ``"pose"``.

    Returns:
      A :class:`Config`; ``model.num_classes`` stays None (taken from the data).

    Raises:
      ValueError: an unknown scale or task.

    Example:
      >>> from yolo_func.configs import recipe
      >>> cfg = recipe("m", "pose")
      >>> cfg.model.scale, cfg.model.task, cfg.data.image_size
      ('m', 'pose', 640)
    """
    recipe_name(scale, task)  # validates
    return Config(model=ModelConfig(scale=scale, task=task))
