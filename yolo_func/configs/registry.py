"""Recipes by name (``--model yolov8s-seg``), the built-in defaults, and the everyday CLI flags."""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Iterable, Mapping

from yolo_func.configs.base import SCALES, TASKS, Config, recipe_name
from yolo_func.configs.overrides import apply_overrides

__all__ = ["RECIPES", "FLAGS", "get_recipe", "default_config", "build_config"]

#: Recipe name -> the module whose ``get_config()`` builds it. Names are the reference's model
#: names (``yolov8n``, ``yolov8n-seg``, ``yolov8n-pose``, ...) plus the two built-in defaults.
RECIPES: dict[str, str] = {
    **{recipe_name(s, t): f"yolo_func.configs.yolov8{s}_{t}" for s in SCALES for t in TASKS},
    "builtin-cpu": "yolo_func.configs.builtin_cpu",
    "builtin-gpu": "yolo_func.configs.builtin_gpu",
}

#: The everyday command-line flags and the config keys they set (``--imgsz 320`` is
#: ``data.image_size=320``). ``--model`` picks the recipe itself (:func:`get_recipe`).
FLAGS: dict[str, str] = {
    "data": "data.path",
    "images": "data.images",
    "epochs": "train.epochs",
    "batch": "data.batch_size",
    "imgsz": "data.image_size",
    "device": "train.device",
    "weights": "model.weights",
    "out": "train.out",
}


def get_recipe(name: str) -> Config:
    """The config of a recipe named as the reference names its models.

    Args:
      name: ``"yolov8s-seg"``, ``"yolov8n"``, ``"yolov8m-pose"``, ``"builtin-cpu"``, ...; a trailing
        ``.yaml`` (the reference's spelling of a model config) is accepted.

    Returns:
      The recipe module's ``get_config()``.

    Raises:
      ValueError: an unknown name, with the closest names.
    """
    if not isinstance(name, str):
        raise TypeError(f"[yolo_func] get_recipe expects a recipe name (str); got {type(name).__name__}")
    key = name.strip().removesuffix(".yaml")
    if key not in RECIPES:
        close = difflib.get_close_matches(key, list(RECIPES), n=3, cutoff=0.6)
        hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
        if key.endswith(".pt"):
            hint += " (a .pt file is weights: pass it as --weights / model.weights)"
        raise ValueError(f"[yolo_func] unknown recipe {name!r}{hint} Known: {', '.join(RECIPES)}")
    return importlib.import_module(RECIPES[key]).get_config()


def default_config(device: str | None = None) -> Config:
    """The built-in default: ``builtin-gpu`` when ``device`` is CUDA (or ``"auto"``/None and CUDA is
    available), else ``builtin-cpu``; a given device is written into ``train.device``."""
    if device in (None, "auto"):
        import torch

        name = "builtin-gpu" if torch.cuda.is_available() else "builtin-cpu"
        return get_recipe(name)
    config = get_recipe("builtin-cpu" if device == "cpu" else "builtin-gpu")
    return apply_overrides(config, [f"train.device={device}"])


def build_config(model: str | None = None, *, flags: Mapping[str, str | int | None] | None = None,
                 overrides: Iterable[str] = ()) -> Config:
    """The config a command line asks for: a recipe, then the flags, then ``key=value`` overrides.

    Args:
      model: a recipe name (``--model``); None: :func:`default_config` for the ``device`` flag.
      flags: ``{flag: value}`` for the names in :data:`FLAGS`; None values are not given.
      overrides: ``["optim.lr0=0.02", ...]``, applied last.

    Returns:
      The validated :class:`Config`.

    Raises:
      ValueError: an unknown recipe, flag or key, or a bad value.
    """
    flags = {k: v for k, v in (flags or {}).items() if v is not None}
    unknown = [k for k in flags if k not in FLAGS]
    if unknown:
        close = difflib.get_close_matches(unknown[0], list(FLAGS), n=1, cutoff=0.6)
        hint = f"; did you mean '--{close[0]}'?" if close else f"; known flags: {', '.join('--' + f for f in FLAGS)}"
        raise ValueError(f"[yolo_func] unknown flag '--{unknown[0]}'{hint}")
    config = get_recipe(model) if model is not None else default_config(str(flags["device"]) if "device" in flags else None)
    config = apply_overrides(config, [f"{FLAGS[k]}={v}" for k, v in flags.items()])
    return apply_overrides(config, list(overrides))
