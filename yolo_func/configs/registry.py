"""Recipes by name (``--model yolov8s-seg``), the built-in defaults, and the everyday CLI flags."""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

from yolo_func.configs.base import SCALES, TASKS, Config, recipe_name
from yolo_func.configs.overrides import apply_overrides, config_from_json

__all__ = ["RECIPES", "FLAGS", "get_recipe", "default_config", "build_config", "load_config_file"]

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

    Example:
      >>> from yolo_func.configs import get_recipe
      >>> cfg = get_recipe("yolov8s-seg.yaml")             # a trailing .yaml is accepted
      >>> cfg.model.scale, cfg.model.task
      ('s', 'segment')
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
    available), else ``builtin-cpu``; a given device is written into ``train.device``.

    Example:
      >>> from yolo_func.configs import default_config
      >>> cfg = default_config("cpu")                      # the builtin-cpu recipe
      >>> cfg.data.image_size, cfg.train.device, cfg.train.capture
      (320, 'cpu', 'none')
    """
    if device in (None, "auto"):
        import torch

        name = "builtin-gpu" if torch.cuda.is_available() else "builtin-cpu"
        return get_recipe(name)
    config = get_recipe("builtin-cpu" if device == "cpu" else "builtin-gpu")
    return apply_overrides(config, [f"train.device={device}"])


def load_config_file(path: str | os.PathLike) -> Config:
    """A config from a file: a Python file defining ``get_config() -> Config`` (a recipe module such
    as ``yolo_func/configs/yolov8n_detect.py``, or your own copy of one) or a JSON config (a run's
    ``config.json``).

    Raises:
      FileNotFoundError: ``path`` does not exist (named).
      ValueError: the file is neither (named, with what was expected), or ``get_config()`` did not
        return a :class:`Config`.

    Example:
      >>> import tempfile
      >>> from pathlib import Path
      >>> from yolo_func.configs import config_to_json, get_recipe, load_config_file
      >>> path = Path(tempfile.mkdtemp()) / "config.json"
      >>> _ = path.write_text(config_to_json(get_recipe("yolov8n-seg")))
      >>> load_config_file(path).model.task
      'segment'
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"[yolo_func] config file '{p}' does not exist; pass a Python file with "
                                "get_config() or a run's config.json")
    if p.suffix == ".json":
        return config_from_json(p.read_text(), source=str(p))
    if p.suffix != ".py":
        raise ValueError(f"[yolo_func] config file '{p}': expected a .py file defining get_config() or a .json "
                         f"config, got a '{p.suffix or 'no'}' suffix")
    spec = importlib.util.spec_from_file_location(f"_yolo_func_config_{p.stem}", p)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # the user's file: say which one failed and why
        raise ValueError(f"[yolo_func] config file '{p}' failed to run: {type(e).__name__}: {e}") from e
    get = getattr(module, "get_config", None)
    if not callable(get):
        raise ValueError(f"[yolo_func] config file '{p}' defines no get_config(); define get_config() -> Config")
    config = get()
    if not isinstance(config, Config):
        raise ValueError(f"[yolo_func] config file '{p}': get_config() returned {type(config).__name__}, not a Config")
    return config


def build_config(model: str | None = None, *, flags: Mapping[str, str | int | None] | None = None,
                 overrides: Iterable[str] = (), config_file: str | os.PathLike | None = None) -> Config:
    """The config a command line asks for: a recipe (or a config file), then the flags, then
    ``key=value`` overrides.

    Args:
      model: a recipe name (``--model``); None: :func:`default_config` for the ``device`` flag.
      config_file: ``--config``: a ``.py`` file with ``get_config()`` or a ``.json`` config
        (:func:`load_config_file`); used instead of the recipe (giving both is an error).
      flags: ``{flag: value}`` for the names in :data:`FLAGS`; None values are not given.
      overrides: ``["optim.lr0=0.02", ...]``, applied last.

    Returns:
      The validated :class:`Config`.

    Raises:
      ValueError: an unknown recipe, flag or key, or a bad value.

    Example:
      >>> from yolo_func.configs import build_config
      >>> cfg = build_config("yolov8s-seg", flags={"epochs": 3, "imgsz": 320}, overrides=["optim.lr0=0.02"])
      >>> cfg.model.scale, cfg.model.task, cfg.train.epochs, cfg.data.image_size, cfg.optim.lr0
      ('s', 'segment', 3, 320, 0.02)
    """
    flags = {k: v for k, v in (flags or {}).items() if v is not None}
    unknown = [k for k in flags if k not in FLAGS]
    if unknown:
        close = difflib.get_close_matches(unknown[0], list(FLAGS), n=1, cutoff=0.6)
        hint = f"; did you mean '--{close[0]}'?" if close else f"; known flags: {', '.join('--' + f for f in FLAGS)}"
        raise ValueError(f"[yolo_func] unknown flag '--{unknown[0]}'{hint}")
    if config_file is not None and model is not None:
        raise ValueError(f"[yolo_func] give a recipe (--model {model}) or a config file (--config {config_file}), not both")
    if config_file is not None:
        config = load_config_file(config_file)
    elif model is not None:
        config = get_recipe(model)
    else:
        config = default_config(str(flags["device"]) if "device" in flags else None)
    config = apply_overrides(config, [f"{FLAGS[k]}={v}" for k, v in flags.items()])
    return apply_overrides(config, list(overrides))
