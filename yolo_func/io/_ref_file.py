"""Reading reference checkpoint files (``yolov8n.pt``, a trainer's ``last.pt``): the weights, the
metadata pickled beside them (class names, ``kpt_shape``, the model yaml), and the model they hold.
Internal: import the public names from :mod:`yolo_func.io.ultralytics`.

A reference checkpoint is a ``torch.save``'d dict whose ``ema`` (preferred when not None) or
``model`` entry is a pickled ``DetectionModel`` / ``SegmentationModel`` / ``PoseModel`` (usually
fp16). It is read with :data:`~yolo_func.io._safe_pickle.restricted_pickle` (no code from the file
runs); the module tree (``_modules``, ``_parameters``, ``_buffers``) is walked like
``nn.Module.state_dict()`` does. What else the pickled model object carries and is read here
(checked on files written by the reference package 8.4.190):

- ``names``: ``{class id: name}`` (older files: a list);
- ``kpt_shape`` (pose), also in its ``yaml`` dict and on the head module (``model.22.kpt_shape``);
- ``yaml``: the model's configuration dict (``nc``, ``scale``, ``kpt_shape``, ``backbone``, ...);
- ``task``: ``"detect"``, ``"segment"`` or ``"pose"`` (else ``args["task"]``, else the pickled class:
  ``DetectionModel``, ``SegmentationModel``, ``PoseModel``).

Errors a user can act on: a missing path raises :class:`FileNotFoundError`; a file that is not a
checkpoint (empty, text, random bytes, a zip that is not a torch file, a truncated download) raises
:class:`ValueError` naming the file and what was expected; a global outside the allow-list raises
:class:`~yolo_func.io._safe_pickle.RefusedGlobalError`.
"""

from __future__ import annotations

import os
import zipfile
from collections.abc import Mapping
from os import PathLike
from typing import IO, Any, NamedTuple

import torch

from yolo_func.io._ref_convert import Loaded, _from_reference
from yolo_func.io._ref_infer import infer_reference_spec
from yolo_func.io._ref_keys import HEAD_LAYER
from yolo_func.io._safe_pickle import PickledObject, RefusedGlobalError, restricted_pickle

__all__ = [
    "ReferenceCheckpoint",
    "ReferenceModel",
    "read_reference_checkpoint",
    "load_reference_checkpoint",
    "load_reference_weights",
    "load_reference_model",
]

_EXPECTED = (
    "Expected a YOLOv8 checkpoint written by torch.save (a zip archive holding data.pkl, or the legacy "
    "pickle format), e.g. yolov8n.pt or a trainer's weights/last.pt"
)
_ZIP_MAGIC = b"PK\x03\x04"
#: The reference's model classes (``ultralytics.nn.tasks.<name>``) and the task each one is.
_TASK_OF_CLASS = {"DetectionModel": "detect", "SegmentationModel": "segment", "PoseModel": "pose"}
_PICKLE_PROTO = 0x80  # PROTO opcode: the first byte of a protocol >= 2 pickle (torch's legacy format)


class ReferenceCheckpoint(NamedTuple):
    """What a reference checkpoint file holds.

    Attributes:
      state_dict: ``{reference key: tensor}`` in the stored dtypes (fp16 weights, int64
        ``num_batches_tracked``) and the stored key order, on the CPU.
      names: ``{class id: name}`` as stored on the pickled model (or the checkpoint dict), else ``None``.
      kpt_shape: ``(P, D)`` as stored (pose files), else ``None``.
      task: the stored task name, else ``None``.
      yaml: the stored model configuration dict, else ``None``.
      entry: which entry the weights came from: ``"ema"``, ``"model"`` or ``"<root>"``.

    Example:
      >>> import torch
      >>> from yolo_func import yolov8
      >>> from yolo_func import io
      >>> model = yolov8("n", task="detect", num_classes=5)
      >>> params, state = model.init(torch.Generator().manual_seed(0))
      >>> import tempfile
      >>> from pathlib import Path
      >>> path = Path(tempfile.mkdtemp()) / "yolov8n-5.pt"
      >>> torch.save({"model": io.to_reference(model, params, state)}, path)   # a reference-layout file
      >>> ck = io.read_reference_checkpoint(path)             # a ReferenceCheckpoint
      >>> ck._fields[:3], ck.state_dict["model.0.conv.weight"].dtype
      (('state_dict', 'names', 'kpt_shape'), torch.float32)
    """

    state_dict: dict[str, torch.Tensor]
    names: dict[int, str] | None = None
    kpt_shape: tuple[int, int] | None = None
    task: str | None = None
    yaml: dict | None = None
    entry: str = "model"


class ReferenceModel(NamedTuple):
    """A model built from a reference checkpoint alone: ``model, params, state, names = ...``.

    Attributes:
      model: the :class:`yolo_func.models.Model` the weights fit (scale, task, classes, keypoints).
      params, state: float32 trees on the CPU.
      names: ``{class id: name}`` for ids ``0..K-1`` (stored names; ``str(id)`` for any id the file
        does not name, as the reference does).

    Example:
      >>> import torch
      >>> from yolo_func import yolov8
      >>> from yolo_func import io
      >>> model = yolov8("n", task="detect", num_classes=5)
      >>> params, state = model.init(torch.Generator().manual_seed(0))
      >>> import tempfile
      >>> from pathlib import Path
      >>> path = Path(tempfile.mkdtemp()) / "yolov8n-5.pt"
      >>> torch.save({"model": io.to_reference(model, params, state)}, path)   # a reference-layout file
      >>> m, p2, s2, names = io.load_reference_model(path)    # a ReferenceModel
      >>> m.num_classes, names                               # the file stores no names: str(id)
      (5, {0: '0', 1: '1', 2: '2', 3: '3', 4: '4'})
    """

    model: Any
    params: dict
    state: dict
    names: dict[int, str]


def _describe(path: Any) -> str:
    if isinstance(path, (str, PathLike)):
        return os.fspath(path)
    return str(getattr(path, "name", f"<{type(path).__name__}>"))


def _not_a_checkpoint(name: str, why: str) -> ValueError:
    return ValueError(f"[yolo_func] {name!r} is not a PyTorch checkpoint: {why}. {_EXPECTED}.")


def _check_file(path: Any, name: str) -> None:
    """Cheap checks before unpickling: the path exists, is a file, and starts like a torch file."""
    if isinstance(path, (str, PathLike)):
        if not os.path.exists(path):
            where = "" if os.path.isabs(path) else f" (relative to the working directory {os.getcwd()!r})"
            raise FileNotFoundError(
                f"[yolo_func] reference checkpoint {name!r} does not exist{where}; "
                f"pass the path of a YOLOv8 .pt file, e.g. yolov8n.pt"
            )
        if os.path.isdir(path):
            raise _not_a_checkpoint(name, "it is a directory")
        with open(path, "rb") as f:
            head = f.read(8)
    elif hasattr(path, "read") and hasattr(path, "seek") and hasattr(path, "tell"):
        pos = path.tell()
        head = path.read(8)
        path.seek(pos)
    else:
        raise TypeError(
            f"[yolo_func] read_reference_checkpoint: path must be a str, os.PathLike or a seekable binary file, "
            f"got {type(path).__name__}"
        )
    if not isinstance(head, bytes):
        raise TypeError(f"[yolo_func] read_reference_checkpoint: {name!r} must be opened in binary mode ('rb')")
    if not head:
        raise _not_a_checkpoint(name, "it is empty (0 bytes)")
    if head.startswith(_ZIP_MAGIC):
        _check_zip(path, name)
    elif head[0] != _PICKLE_PROTO:
        hint = " (a text file?)" if all(32 <= b < 127 or b in b"\t\r\n" for b in head) else ""
        raise _not_a_checkpoint(name, f"it starts with {head!r}{hint}, not a zip archive or a pickle")


def _check_zip(path: Any, name: str) -> None:
    """A torch zip checkpoint holds ``<folder>/data.pkl``; say what is wrong with one that does not."""
    pos = None if isinstance(path, (str, PathLike)) else path.tell()
    try:
        with zipfile.ZipFile(path) as z:
            members = z.namelist()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as e:
        raise _not_a_checkpoint(name, f"it is a damaged zip archive ({e}): a truncated download?") from e
    finally:
        if pos is not None:
            path.seek(pos)
    if not any(m.endswith("/data.pkl") and m.count("/") == 1 for m in members):
        shown = ", ".join(repr(m) for m in members[:3]) + (", ..." if len(members) > 3 else "")
        raise _not_a_checkpoint(name, f"it is a zip archive without '<folder>/data.pkl' (it holds {shown or 'nothing'})")


def _load(path: Any, name: str) -> Any:
    _check_file(path, name)
    try:
        return torch.load(path, map_location="cpu", pickle_module=restricted_pickle, weights_only=False)
    except RefusedGlobalError as e:
        raise RefusedGlobalError(f"{e} (in {name!r})") from None
    except Exception as e:  # whatever a damaged or foreign file makes torch / pickle / zipfile raise
        why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".rstrip(": ")
        raise _not_a_checkpoint(name, f"reading it failed ({why}): a truncated or damaged file?") from e


def _module_state_dict(obj: PickledObject, prefix: str, out: dict[str, torch.Tensor], where: str) -> None:
    state = _module_dict(obj, where)
    skip = set(state.get("_non_persistent_buffers_set") or ())
    for name, t in state["_parameters"].items():
        if t is not None:
            out[prefix + name] = t.detach()
    for name, t in state["_buffers"].items():
        if t is not None and name not in skip:
            out[prefix + name] = t.detach()
    for name, child in state["_modules"].items():
        if child is None:
            continue
        if not isinstance(child, PickledObject):
            raise ValueError(f"[yolo_func] checkpoint entry {where + '.' + name!r} is a {type(child).__name__}, not a module")
        _module_state_dict(child, f"{prefix}{name}.", out, f"{where}.{name}")


def _module_dict(obj: PickledObject, where: str) -> Mapping:
    state = obj.state
    if isinstance(state, tuple) and len(state) == 2 and isinstance(state[0], Mapping):
        state = state[0]  # (dict state, slot state)
    if not isinstance(state, Mapping) or not all(k in state for k in ("_parameters", "_buffers", "_modules")):
        raise ValueError(
            f"[yolo_func] checkpoint entry {where!r} ({obj.pickled_class}) is not a pickled torch.nn.Module "
            f"(no _parameters/_buffers/_modules)"
        )
    return state


def _names(value: Any) -> dict[int, str] | None:
    if isinstance(value, Mapping):
        try:
            return {int(k): str(v) for k, v in value.items()}
        except (TypeError, ValueError):
            return None
    if isinstance(value, (list, tuple)):
        return {i: str(v) for i, v in enumerate(value)}
    return None


def _kpt_shape(value: Any) -> tuple[int, int] | None:
    if isinstance(value, (list, tuple)) and len(value) == 2 and all(isinstance(v, int) for v in value):
        return int(value[0]), int(value[1])
    return None


def _metadata(root: PickledObject, ckpt: Any, where: str) -> dict[str, Any]:
    attrs = _module_dict(root, where)
    yaml = attrs.get("yaml") if isinstance(attrs.get("yaml"), Mapping) else None
    names = _names(attrs.get("names"))
    if names is None and isinstance(ckpt, Mapping):
        names = _names(ckpt.get("names"))
    # kpt_shape: the head module built the tensors from it, so it wins over the model's copies.
    kpt = None
    try:
        layers = _module_dict(attrs["_modules"]["model"], f"{where}.model")
        head = _module_dict(layers["_modules"][str(HEAD_LAYER)], f"{where}.model.{HEAD_LAYER}")
        kpt = _kpt_shape(head.get("kpt_shape"))
    except (KeyError, AttributeError, TypeError, ValueError):
        kpt = None  # no readable head metadata (a stripped or foreign layout): the model's copies below
    kpt = kpt or _kpt_shape(attrs.get("kpt_shape")) or _kpt_shape((yaml or {}).get("kpt_shape"))
    task = attrs.get("task")
    if not isinstance(task, str):
        args = attrs.get("args")
        task = args.get("task") if isinstance(args, Mapping) else None
    if not isinstance(task, str):
        task = _TASK_OF_CLASS.get(root.pickled_class.rsplit(".", 1)[-1])
    return {"names": names, "kpt_shape": kpt, "task": task, "yaml": dict(yaml) if yaml is not None else None}


def read_reference_checkpoint(path: str | PathLike | IO[bytes]) -> ReferenceCheckpoint:
    """Read the weights and metadata of a reference checkpoint without the reference package.

    Args:
      path: file path or seekable binary file object.

    Returns:
      A :class:`ReferenceCheckpoint`: the state dict (stored dtypes and order, CPU) and what is
      stored beside it (class names, ``kpt_shape``, task, yaml), ``None`` where absent. A checkpoint
      whose entry is already a state dict gives that dict and no metadata.

    Raises:
      FileNotFoundError: ``path`` does not exist (named; a relative one with the working directory).
      ValueError: not a checkpoint (empty, text, random bytes, a zip without torch's layout,
        truncated), or no usable ``ema`` / ``model`` entry; the message names the file.
      RefusedGlobalError: the file references a global outside the allow-list (named); nothing ran.
      TypeError: ``path`` is neither a path nor a seekable binary file.

    Example:
      >>> import torch
      >>> from yolo_func import yolov8
      >>> from yolo_func import io
      >>> model = yolov8("n", task="detect", num_classes=5)
      >>> params, state = model.init(torch.Generator().manual_seed(0))
      >>> import tempfile
      >>> from pathlib import Path
      >>> path = Path(tempfile.mkdtemp()) / "yolov8n-5.pt"
      >>> torch.save({"model": io.to_reference(model, params, state)}, path)   # a reference-layout file
      >>> ck = io.read_reference_checkpoint(path)             # no reference package needed
      >>> len(ck.state_dict) == len(io.to_reference(model, params, state)), ck.names
      (True, None)
    """
    name = _describe(path)
    ckpt = _load(path, name)
    if isinstance(ckpt, PickledObject):
        root, where = ckpt, "<root>"
    elif isinstance(ckpt, Mapping):
        if ckpt.get("ema") is not None:
            root, where = ckpt["ema"], "ema"
        elif ckpt.get("model") is not None:
            root, where = ckpt["model"], "model"
        else:
            raise ValueError(
                f"[yolo_func] checkpoint {name!r} has neither an 'ema' nor a 'model' entry (keys {sorted(map(str, ckpt))}); "
                f"{_EXPECTED}."
            )
    else:
        raise ValueError(
            f"[yolo_func] checkpoint {name!r} must hold a dict with 'ema'/'model', got a {type(ckpt).__name__}. {_EXPECTED}."
        )
    if isinstance(root, Mapping) and all(isinstance(v, torch.Tensor) for v in root.values()):
        return ReferenceCheckpoint({str(k): v.detach() for k, v in root.items()}, entry=where)
    if not isinstance(root, PickledObject):
        raise ValueError(f"[yolo_func] checkpoint {name!r}: entry {where!r} is a {type(root).__name__}, not a pickled module")
    out: dict[str, torch.Tensor] = {}
    _module_state_dict(root, "", out, where)
    return ReferenceCheckpoint(out, entry=where, **_metadata(root, ckpt, where))


def load_reference_checkpoint(path: str | PathLike | IO[bytes]) -> dict[str, torch.Tensor]:
    """The weights of a reference checkpoint: ``read_reference_checkpoint(path).state_dict``.

    Returns:
      ``{reference key: tensor}`` in the stored dtypes and order, on the CPU; pass it to
      :func:`~yolo_func.io.ultralytics.from_reference` (which casts to float32).

    Raises:
      As :func:`read_reference_checkpoint`.

    Example:
      >>> import torch
      >>> from yolo_func import yolov8
      >>> from yolo_func import io
      >>> model = yolov8("n", task="detect", num_classes=5)
      >>> params, state = model.init(torch.Generator().manual_seed(0))
      >>> import tempfile
      >>> from pathlib import Path
      >>> path = Path(tempfile.mkdtemp()) / "yolov8n-5.pt"
      >>> torch.save({"model": io.to_reference(model, params, state)}, path)   # a reference-layout file
      >>> sd = io.load_reference_checkpoint(path)             # {reference key: tensor}
      >>> tuple(sd["model.0.conv.weight"].shape)
      (16, 3, 3, 3)
    """
    return read_reference_checkpoint(path).state_dict


def load_reference_weights(model, path: str | PathLike | IO[bytes], **kwargs) -> tuple[dict, dict] | Loaded:
    """``from_reference(model, load_reference_checkpoint(path), **kwargs)``: float32 ``(params, state)``.

    A mismatch error names the file and, when the file holds another model, the call that builds it.

    Example:
      >>> import torch
      >>> from yolo_func import yolov8
      >>> from yolo_func import io
      >>> model = yolov8("n", task="detect", num_classes=5)
      >>> params, state = model.init(torch.Generator().manual_seed(0))
      >>> import tempfile
      >>> from pathlib import Path
      >>> path = Path(tempfile.mkdtemp()) / "yolov8n-5.pt"
      >>> torch.save({"model": io.to_reference(model, params, state)}, path)   # a reference-layout file
      >>> from yolo_func.testing import assert_trees_all_equal
      >>> p2, s2 = io.load_reference_weights(model, path)
      >>> assert_trees_all_equal(p2, params)
    """
    name = _describe(path)
    kwargs = {"strict": True, "base": None, "copy": True, **kwargs}
    ck = read_reference_checkpoint(path)
    return _from_reference(
        model, ck.state_dict, **kwargs, source=f"the file {name!r}", builder="load_reference_model(path)",
        kpt_shape=ck.kpt_shape if _fits_kpt(ck) else None,
    )


def load_reference_model(path: str | PathLike | IO[bytes]) -> ReferenceModel:
    """Build the model a reference checkpoint holds and load its weights: all from the file alone.

    Scale, task, classes and keypoint channels come from the tensor shapes
    (:func:`~yolo_func.io.ultralytics.infer_reference_model`); ``kpt_shape`` from the file's metadata
    when stored (else the documented rule); the class names from the metadata.

    Args:
      path: file path or seekable binary file object, e.g. ``"yolov8n-seg.pt"``.

    Returns:
      ``ReferenceModel(model, params, state, names)`` with float32 trees on the CPU.

    Raises:
      As :func:`read_reference_checkpoint`; ValueError when the weights are not a complete YOLOv8
      model (the message lists what does not fit).

    Example:
      >>> model, params, state, names = load_reference_model("yolov8n.pt")  # doctest: +SKIP
      >>> model.task, model.num_classes, names[0]  # doctest: +SKIP
      ('detect', 80, 'person')
    """
    ck = read_reference_checkpoint(path)
    kpt_shape = ck.kpt_shape if _fits_kpt(ck) else None
    spec = infer_reference_spec(ck.state_dict, kpt_shape=kpt_shape)
    model = spec.build()
    params, state = _from_reference(
        model, ck.state_dict, strict=True, base=None, copy=True,
        source=f"the file {_describe(path)!r}", builder="load_reference_model(path)", kpt_shape=kpt_shape,
    )
    stored = ck.names or {}
    names = {i: stored.get(i, str(i)) for i in range(spec.num_classes)}
    return ReferenceModel(model, params, state, names)


def _fits_kpt(ck: ReferenceCheckpoint) -> bool:
    # Stored kpt_shape is used only when it fits the tensors (a stale yaml must not break loading).
    key = f"model.{HEAD_LAYER}.cv4.0.2.weight"
    if ck.kpt_shape is None or key not in ck.state_dict:
        return False
    if any(k.startswith(f"model.{HEAD_LAYER}.proto.") for k in ck.state_dict):
        return False  # a segment model: cv4 is the mask coefficients
    p, d = ck.kpt_shape
    return p >= 1 and d in (2, 3) and p * d == ck.state_dict[key].shape[0]
