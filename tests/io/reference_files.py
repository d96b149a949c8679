"""Reference-layout checkpoint files for the CI tests, without the reference package.

The file layout follows what the reference package (8.4.190) writes, as read back from a file it
made (``tests/io/fixtures/README.md``): ``torch.save`` of a dict whose ``model`` (or ``ema``) entry is
a pickled ``ultralytics.nn.tasks.<Task>Model`` ``nn.Module`` holding ``yaml``, ``names``, ``task``,
``args`` (and ``kpt_shape`` for pose) as attributes, its layers under ``model`` (an
``nn.Sequential``) and the head at ``model.22`` (``ultralytics.nn.modules.head.<Detect|Segment|Pose>``
carrying ``nc`` and ``kpt_shape``). Stand-in classes with those module paths are registered in
``sys.modules`` only while the file is written, so the reader under test never finds them.
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

_TASK_CLASS = {"detect": "DetectionModel", "segment": "SegmentationModel", "pose": "PoseModel"}
_HEAD_CLASS = {"detect": "Detect", "segment": "Segment", "pose": "Pose"}
_MODULES = {
    "ultralytics.nn.tasks": ["DetectionModel", "SegmentationModel", "PoseModel"],
    "ultralytics.nn.modules.conv": ["Conv"],
    "ultralytics.nn.modules.block": ["C2f", "Bottleneck", "SPPF", "Proto", "DFL"],
    "ultralytics.nn.modules.head": ["Detect", "Segment", "Pose"],
}


@contextlib.contextmanager
def fake_reference_classes() -> Iterator[dict[str, type]]:
    """Stand-ins for the reference's classes, importable under the reference's module names for
    the duration of the ``with`` block (``sys.modules`` is restored afterwards)."""
    with pytest.MonkeyPatch.context() as mp:
        for pkg in ("ultralytics", "ultralytics.nn", "ultralytics.nn.modules"):
            mp.setitem(sys.modules, pkg, types.ModuleType(pkg))
        classes: dict[str, type] = {}
        for mod_name, names in _MODULES.items():
            mod = types.ModuleType(mod_name)
            for name in names:
                cls = type(name, (nn.Module,), {"__module__": mod_name, "__qualname__": name})
                setattr(mod, name, cls)
                classes[name] = cls
            mp.setitem(sys.modules, mod_name, mod)
        yield classes


def _block_class(parts: list[str], i: int) -> str:
    # The reference class of module ``parts[:i+1]`` (for realism only: the reader never looks).
    path = parts[: i + 1]
    if len(path) == 2 and path[1] == "22":
        return "<head>"
    if parts[i + 1] in ("conv", "bn"):
        return "Conv"
    return "Block"


def module_tree(classes: dict[str, type], sd: Mapping[str, torch.Tensor], *, task: str, metadata: Mapping[str, Any]) -> nn.Module:
    """A stand-in module tree whose ``state_dict()`` has exactly the keys, shapes and order of ``sd``,
    carrying the reference's metadata attributes (``yaml``, ``names``, ``task``, ``kpt_shape``, ``args``)."""
    root = classes[_TASK_CLASS[task]]()
    owners: dict[str, dict[str, torch.Tensor]] = {}
    for k, v in sd.items():
        owner, leaf = k.rsplit(".", 1)
        owners.setdefault(owner, {})[leaf] = v
    for owner, leaves in owners.items():
        parts = owner.split(".")
        parent = root
        for i, name in enumerate(parts[:-1]):
            if name not in parent._modules:
                kind = _block_class(parts, i)
                if parts[: i + 1] == ["model"]:
                    child = nn.Sequential()
                elif kind == "<head>":
                    child = classes[_HEAD_CLASS[task]]()
                    child.nc = int(sd["model.22.cv3.0.2.weight"].shape[0])
                    if "kpt_shape" in metadata:
                        child.kpt_shape = list(metadata["kpt_shape"])
                elif kind == "Conv":
                    child = classes["Conv"]()
                    child.add_module("act", nn.SiLU())
                else:
                    child = classes["C2f"]()
                parent.add_module(name, child)
            parent = parent._modules[name]
        w = leaves["weight"]
        # Built on the meta device (no init cost); load_state_dict(assign=True) puts the values in.
        if parts[-1] == "bn":
            leaf_mod = nn.BatchNorm2d(w.shape[0], eps=1e-3, momentum=0.03, device="meta")
        elif parts[-1] == "upsample":
            leaf_mod = nn.ConvTranspose2d(w.shape[0], w.shape[1], 2, 2, device="meta")
        else:
            leaf_mod = nn.Conv2d(w.shape[1], w.shape[0], w.shape[2], bias="bias" in leaves, device="meta")
        parent.add_module(parts[-1], leaf_mod)
    root.register_buffer("scratch", torch.ones(3), persistent=False)  # must not appear in the weights
    for name, value in metadata.items():
        setattr(root, name, value)
    root.load_state_dict(sd, assign=True)
    return root


def write_reference_checkpoint(
    path: Path,
    sd: Mapping[str, torch.Tensor],
    *,
    task: str,
    names: Mapping[int, str] | list[str] | None = None,
    kpt_shape: tuple[int, int] | None = None,
    entry: str = "model",
    half: bool = True,
) -> Path:
    """Write ``sd`` as a reference-layout checkpoint at ``path``.

    Args:
      sd: ``{reference key: tensor}`` (e.g. ``to_reference(model, params, state)``).
      task: which ``<Task>Model`` class and head class to pickle.
      names: the model's ``names`` attribute (omitted when ``None``).
      kpt_shape: the ``kpt_shape`` attributes (model, head and yaml) for pose (omitted when ``None``).
      entry: ``"model"`` (``YOLO.save`` layout: ``ema`` None) or ``"ema"`` (trainer layout: a zeroed
        ``model`` beside the ``ema`` that holds ``sd``).
      half: store fp16 weights, as the reference does.
    """
    nc = int(sd["model.22.cv3.0.2.weight"].shape[0])
    yaml: dict[str, Any] = {"nc": nc, "scale": "?", "channels": 3}
    metadata: dict[str, Any] = {"yaml": yaml, "task": task, "args": {"task": task, "imgsz": 640}}
    if names is not None:
        metadata["names"] = names
    if kpt_shape is not None:
        yaml["kpt_shape"] = list(kpt_shape)
        metadata["kpt_shape"] = list(kpt_shape)
    with fake_reference_classes() as classes:
        tree = module_tree(classes, sd, task=task, metadata=metadata)
        tree = tree.half() if half else tree
        if entry == "model":
            ckpt = {"ema": None, "model": tree, "modelopt": None, "date": "2026-01-01T00:00:00", "version": "8.4.190"}
        elif entry == "ema":
            zero = {k: (v * 0 if v.is_floating_point() else v) for k, v in sd.items()}
            other = module_tree(classes, zero, task=task, metadata=metadata)
            ckpt = {"epoch": 3, "best_fitness": None, "model": other.half() if half else other, "ema": tree, "updates": 10,
                    "optimizer": None, "train_args": {"imgsz": 640}, "date": "2026-01-01T00:00:00"}
        else:
            raise ValueError(f"entry must be 'model' or 'ema', got {entry!r}")
        torch.save(ckpt, path)
    return path


_INITS: dict = {}


def seeded(task: str, scale: str = "n", **kwargs):
    """``(model, params, state)`` of ``yolov8(scale, task=task, **kwargs)`` from seed 0, cached (init is the slow part)."""
    from yolo_func.models import yolov8

    key = (scale, task, tuple(sorted(kwargs.items())))
    if key not in _INITS:
        model = yolov8(scale, task=task, **kwargs)
        _INITS[key] = (model, *model.init(torch.Generator().manual_seed(0)))
    return _INITS[key]


def random_state_dict(model, seed: int = 0) -> dict[str, torch.Tensor]:
    """A reference state dict for ``model`` with random float32 values (cheaper than an init):
    int64 zeros for ``num_batches_tracked``, the projection 0..15 for the DFL conv, positive BN variances."""
    from yolo_func.io import reference_layout

    gen = torch.Generator().manual_seed(seed)
    sd: dict[str, torch.Tensor] = {}
    for e in reference_layout(model):
        if e.kind == "num_batches_tracked":
            sd[e.key] = torch.zeros((), dtype=torch.int64)
        elif e.kind == "dfl":
            sd[e.key] = torch.arange(16.0).reshape(e.shape)
        else:
            v = torch.randn(e.shape, generator=gen)
            sd[e.key] = v.abs() + 0.5 if e.key.endswith("running_var") else v
    return sd
