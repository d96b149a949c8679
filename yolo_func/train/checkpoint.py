"""The resumable training checkpoint: the :class:`TrainState`, the config, the data position and
the RNG states, in one atomic file (built on :mod:`yolo_func.io.checkpoint`).

Contents (``torch.load(weights_only=True)``-safe plain data)::

    tensors  every TrainState leaf by path: params/..., state/... (BN statistics), opt_state/...,
             ema/..., step, skipped
    config   the run's Config as a dict (config_to_dict)
    extra    {"format": "yolo_func.training/1",
              "position": {"epoch", "batch", "seed"},      # where the data stream stands
              "rng": {"torch", "cuda", "numpy", "python", "generators": {name: state}}}
    meta     plain data for humans (metrics of the epoch, wall time, ...)

Resume semantics: :class:`DataPosition` ``(epoch=e, batch=b, seed=s)`` means epochs ``0..e-1``
are complete and ``b`` batches of epoch ``e`` have been trained; the loader rebuilt with seed ``s``
skips to batch ``b`` of epoch ``e`` (its order and augmentation are functions of ``(seed, epoch,
index)``), so the next batch is the one an uninterrupted run would have seen.
"""

from __future__ import annotations

import os
import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from yolo_func.configs import Config, config_from_dict, config_to_dict
from yolo_func.configs.base import recipe_name
from yolo_func.io.checkpoint import HostStaging, checkpoint_payload, read_checkpoint, restore_tree, write_checkpoint_payload
from yolo_func.train.state import TrainState

__all__ = [
    "TRAINING_FORMAT",
    "DataPosition",
    "TrainingCheckpoint",
    "capture_rng",
    "restore_rng",
    "save_training_checkpoint",
    "training_payload",
    "read_training_checkpoint",
    "load_training_checkpoint",
]

#: The version of the ``extra`` block; bumped when its meaning changes.
TRAINING_FORMAT = "yolo_func.training/1"

#: The model options a checkpoint must agree on to be resumed by a run.
_MODEL_KEYS = ("scale", "task", "kpt_shape", "num_classes")


class DataPosition(NamedTuple):
    """Where the data stream stands.

    Attributes:
      epoch: the epoch in progress, 0-based (epochs ``0..epoch-1`` are complete).
      batch: batches of ``epoch`` already trained (0 at an epoch boundary).
      seed: the loader seed (order and augmentation are functions of ``(seed, epoch, index)``).

    Example:
      >>> from yolo_func.train import DataPosition
      >>> DataPosition(epoch=3, batch=0, seed=0)            # epochs 0, 1, 2 done; epoch 3 starts at batch 0
      DataPosition(epoch=3, batch=0, seed=0)
    """

    epoch: int
    batch: int
    seed: int


class TrainingCheckpoint(NamedTuple):
    """What :func:`load_training_checkpoint` returns.

    Attributes:
      train_state: the :class:`TrainState`, laid out like the template.
      config: the :class:`Config` the checkpoint was written with.
      position: the :class:`DataPosition` to resume from.
      rng: the RNG states (:func:`capture_rng`'s dict; pass it to :func:`restore_rng`).
      meta: plain data written with it.

    Example:
      >>> import torch
      >>> from yolo_func import yolov8
      >>> from yolo_func.optim import sgd
      >>> from yolo_func.train import init_train_state
      >>> model = yolov8("n", task="detect", num_classes=5)
      >>> tx = sgd(0.01, momentum=0.9)
      >>> ts = init_train_state(model, tx, torch.Generator().manual_seed(0))
      >>> import tempfile
      >>> from pathlib import Path
      >>> tmp = Path(tempfile.mkdtemp())
      >>> from yolo_func.configs import get_recipe
      >>> from yolo_func.train import DataPosition, load_training_checkpoint, save_training_checkpoint
      >>> path = save_training_checkpoint(tmp / "last.pt", ts, config=get_recipe("yolov8n"), position=DataPosition(1, 0, 0),
      ...                                 meta={"note": "hello"})
      >>> ck = load_training_checkpoint(path, ts)              # a TrainingCheckpoint
      >>> ck._fields, ck.meta["note"]
      (('train_state', 'config', 'position', 'rng', 'meta'), 'hello')
    """

    train_state: TrainState
    config: Config
    position: DataPosition
    rng: dict
    meta: dict


def capture_rng(generators: Mapping[str, torch.Generator] | None = None) -> dict:
    """Snapshot the RNG states a run may draw from: the named explicit generators (the design's
    randomness), and the global torch CPU / CUDA, numpy and Python states (in case a library uses them).

    Args:
      generators: ``{name: torch.Generator}`` (CPU or CUDA).

    Returns:
      ``{"torch": uint8[N], "cuda": [uint8[N], ...], "numpy": {...}, "python": [...],
      "generators": {name: uint8[N]}}`` (CPU tensors and plain data; a host sync for CUDA states).

    Example:
      >>> import torch
      >>> from yolo_func.train import capture_rng, restore_rng
      >>> gen = torch.Generator().manual_seed(0)
      >>> rng = capture_rng({"loader": gen})
      >>> a = torch.rand(2, generator=gen)
      >>> restore_rng(rng, {"loader": gen})
      >>> torch.equal(torch.rand(2, generator=gen), a)        # the same draws again
      True
    """
    name, keys, pos, has_gauss, cached = np.random.get_state()
    version, internal, gauss = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "cuda": [s.cpu() for s in torch.cuda.get_rng_state_all()] if torch.cuda.is_initialized() else [],
        "numpy": {"name": str(name), "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached": float(cached)},
        "python": [int(version), list(internal), gauss],
        "generators": {k: g.get_state().cpu() for k, g in (generators or {}).items()},
    }


def restore_rng(rng: Mapping[str, Any], generators: Mapping[str, torch.Generator] | None = None) -> None:
    """Set the states :func:`capture_rng` recorded (the inverse; same ``generators`` names).

    CUDA states are restored for the devices both runs have (a run resumed on the CPU ignores them).

    Raises:
      ValueError: a generator in ``generators`` has no saved state.

    Example:
      >>> import random
      >>> from yolo_func.train import capture_rng, restore_rng
      >>> rng = capture_rng()
      >>> x = random.random()
      >>> restore_rng(rng)
      >>> random.random() == x                               # global Python, numpy and torch states restored
      True
    """
    missing = [k for k in (generators or {}) if k not in rng.get("generators", {})]
    if missing:
        raise ValueError(f"[yolo_func] restore_rng: no saved state for generator(s) {missing}; "
                         f"the checkpoint has {sorted(rng.get('generators', {}))}")
    torch.set_rng_state(rng["torch"])
    if rng.get("cuda") and torch.cuda.is_available():
        for i, state in enumerate(rng["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(state, i)
    n = rng["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached"]))
    version, internal, gauss = rng["python"]
    random.setstate((version, tuple(internal), gauss))
    for k, g in (generators or {}).items():
        g.set_state(rng["generators"][k])  # a CPU uint8 tensor, for CPU and CUDA generators alike


def save_training_checkpoint(path: str | os.PathLike, train_state: TrainState, *, config: Config, position: DataPosition,
                             rng: dict | None = None, meta: dict | None = None) -> Path:
    """Atomically write a resumable checkpoint (temp file + fsync + rename).

    Args:
      path: e.g. ``run/weights/last.pt``.
      train_state: the :class:`TrainState` (any device; copied to the CPU: a host sync).
      config: the run's :class:`Config`.
      position: the :class:`DataPosition` of the next batch.
      rng: :func:`capture_rng`'s dict (default: captured now, without named generators).
      meta: plain data for humans.

    Returns:
      The path written.

    Example:
      >>> import torch
      >>> from yolo_func import yolov8
      >>> from yolo_func.optim import sgd
      >>> from yolo_func.train import init_train_state
      >>> model = yolov8("n", task="detect", num_classes=5)
      >>> tx = sgd(0.01, momentum=0.9)
      >>> ts = init_train_state(model, tx, torch.Generator().manual_seed(0))
      >>> import tempfile
      >>> from pathlib import Path
      >>> tmp = Path(tempfile.mkdtemp())
      >>> from yolo_func.configs import get_recipe
      >>> from yolo_func.train import DataPosition, read_training_checkpoint, save_training_checkpoint
      >>> cfg = get_recipe("yolov8n")
      >>> path = save_training_checkpoint(tmp / "last.pt", ts, config=cfg, position=DataPosition(1, 0, 0))
      >>> config, position, meta = read_training_checkpoint(path)
      >>> config == cfg, position
      (True, DataPosition(epoch=1, batch=0, seed=0))
    """
    return write_checkpoint_payload(path, training_payload(train_state, config=config, position=position, rng=rng,
                                                           meta=meta))


def training_payload(train_state: TrainState, *, config: Config, position: DataPosition, rng: dict | None = None,
                     meta: dict | None = None, staging: HostStaging | None = None) -> dict:
    """The payload :func:`save_training_checkpoint` writes, tensors copied to the CPU (a host sync),
    detached from ``train_state``: write it with :func:`yolo_func.io.checkpoint.write_checkpoint_payload`
    (e.g. on a background thread while training goes on). With ``staging``
    (:class:`yolo_func.io.checkpoint.HostStaging`) the copies are only queued (no host sync): call
    ``staging.synchronize()`` before writing."""
    if not isinstance(train_state, TrainState):
        raise TypeError(f"[yolo_func] save_training_checkpoint expects a TrainState; got {type(train_state).__name__}")
    if not isinstance(config, Config):
        raise TypeError(f"[yolo_func] save_training_checkpoint expects config: Config; got {type(config).__name__}")
    position = DataPosition(*(int(v) for v in position))
    extra = {"format": TRAINING_FORMAT, "position": position._asdict(), "rng": capture_rng() if rng is None else rng}
    return checkpoint_payload(train_state, config=config_to_dict(config), meta=meta, extra=extra, staging=staging)


def _check_payload(path: Path, payload: dict) -> None:
    fmt = payload["extra"].get("format")
    if fmt is None:
        raise ValueError(f"[yolo_func] {str(path)!r} is a weights checkpoint, not a training checkpoint (no data position, "
                         f"RNG state or format {TRAINING_FORMAT!r}); start from it with model.weights={path}, not by resuming")
    if fmt != TRAINING_FORMAT:
        raise ValueError(f"[yolo_func] {str(path)!r} is a training checkpoint of format {fmt!r}; this yolo_func reads "
                         f"{TRAINING_FORMAT!r} (written by another version?)")
    position = payload["extra"].get("position")
    if not isinstance(position, dict) or set(position) != set(DataPosition._fields):
        raise ValueError(f"[yolo_func] {str(path)!r}: the data position is {position!r}, expected {list(DataPosition._fields)}; the file is damaged")


def read_training_checkpoint(path: str | os.PathLike) -> tuple[Config, DataPosition, dict]:
    """The config, data position and meta of a training checkpoint, without its tensors' template
    (to build the template from the checkpoint's own config before :func:`load_training_checkpoint`).

    Raises:
      ValueError: not a training checkpoint (see :func:`load_training_checkpoint`).

    Example:
      >>> import torch
      >>> from yolo_func import yolov8
      >>> from yolo_func.optim import sgd
      >>> from yolo_func.train import init_train_state
      >>> model = yolov8("n", task="detect", num_classes=5)
      >>> tx = sgd(0.01, momentum=0.9)
      >>> ts = init_train_state(model, tx, torch.Generator().manual_seed(0))
      >>> import tempfile
      >>> from pathlib import Path
      >>> tmp = Path(tempfile.mkdtemp())
      >>> from yolo_func.configs import get_recipe
      >>> from yolo_func.train import DataPosition, read_training_checkpoint, save_training_checkpoint
      >>> path = save_training_checkpoint(tmp / "last.pt", ts, config=get_recipe("yolov8n"), position=DataPosition(2, 5, 0))
      >>> config, position, meta = read_training_checkpoint(path)    # no template needed
      >>> config.model.scale, position.epoch, position.batch
      ('n', 2, 5)
    """
    path = Path(path)
    payload = read_checkpoint(path)
    _check_payload(path, payload)
    config = config_from_dict(payload["config"], source=f"the config in {path}")
    return config, DataPosition(**payload["extra"]["position"]), payload["meta"]


def _model_mismatch(saved: Config, wanted: Config) -> list[str]:
    out = []
    for k in _MODEL_KEYS:
        a, b = getattr(saved.model, k), getattr(wanted.model, k)
        if k == "num_classes" and (a is None or b is None):
            continue
        if k == "kpt_shape" and saved.model.task != "pose" and wanted.model.task != "pose":
            continue
        if a != b:
            out.append(f"model.{k}: checkpoint {a!r}, this run {b!r}")
    return out


def load_training_checkpoint(path: str | os.PathLike, template: TrainState, *, config: Config | None = None) -> TrainingCheckpoint:
    """Load a checkpoint written by :func:`save_training_checkpoint` into ``template``'s layout.

    Args:
      path: the file.
      template: a :class:`TrainState` of the wanted structure, devices, dtypes and memory formats
        (e.g. ``init_train_state`` of the model the config describes).
      config: this run's config; its model (scale, task, number of classes, keypoints) must be the
        checkpoint's.

    Returns:
      :class:`TrainingCheckpoint`.

    Raises:
      FileNotFoundError: no such file.
      ValueError: a truncated / damaged / foreign file, a weights-only checkpoint, another format
        version, a checkpoint of another model or task, or a tree that does not fit the template
        (paths listed); every message names the file.

    Example:
      >>> import torch
      >>> from yolo_func import yolov8
      >>> from yolo_func.optim import sgd
      >>> from yolo_func.train import init_train_state
      >>> model = yolov8("n", task="detect", num_classes=5)
      >>> tx = sgd(0.01, momentum=0.9)
      >>> ts = init_train_state(model, tx, torch.Generator().manual_seed(0))
      >>> import tempfile
      >>> from pathlib import Path
      >>> tmp = Path(tempfile.mkdtemp())
      >>> from yolo_func.configs import get_recipe
      >>> from yolo_func.testing import assert_trees_all_equal
      >>> from yolo_func.train import DataPosition, load_training_checkpoint, save_training_checkpoint
      >>> cfg = get_recipe("yolov8n")
      >>> path = save_training_checkpoint(tmp / "last.pt", ts, config=cfg, position=DataPosition(1, 0, 0))
      >>> ck = load_training_checkpoint(path, ts)              # ts is the template (structure, devices, dtypes)
      >>> assert_trees_all_equal(ck.train_state, ts)
      >>> ck.position, ck.config == cfg
      (DataPosition(epoch=1, batch=0, seed=0), True)
    """
    path = Path(path)
    payload = read_checkpoint(path)
    _check_payload(path, payload)
    saved = config_from_dict(payload["config"], source=f"the config in {path}")
    if config is not None:
        bad = _model_mismatch(saved, config)
        if bad:
            raise ValueError(
                f"[yolo_func] checkpoint {str(path)!r} is a {recipe_name(saved.model.scale, saved.model.task)} checkpoint that "
                f"does not fit this run ({recipe_name(config.model.scale, config.model.task)}): {'; '.join(bad)}. "
                "Resume with the checkpoint's own config, or start a new run in another folder (train.out)")
    if not isinstance(template, TrainState):
        raise TypeError(f"[yolo_func] load_training_checkpoint expects template: TrainState; got {type(template).__name__}")
    ts = restore_tree(payload["tensors"], template, source=str(path), config=payload["config"].get("model"))
    return TrainingCheckpoint(ts, saved, DataPosition(**payload["extra"]["position"]), payload["extra"]["rng"], payload["meta"])
