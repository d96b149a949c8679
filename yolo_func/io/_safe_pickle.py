"""Safe unpickling of reference checkpoint files: a restricted unpickler that rebuilds tensors,
storages and plain containers, and inert stand-ins for the reference's classes. Internal: import
the public names from :mod:`yolo_func.io.ultralytics`.

Official ``.pt`` files pickle whole ``nn.Module`` objects. :class:`RestrictedUnpickler` reads them
without the reference package and without running any code from the file: it replaces every class
from ``ultralytics.*`` and ``torch.nn.*`` by an inert :class:`PickledObject` that only records its
pickled state, resolves the globals of an allow-list (tensor rebuilders, ``OrderedDict``, torch
dtypes and storages, a few numpy rebuilders), and refuses every other global with
:class:`RefusedGlobalError` (a :class:`pickle.UnpicklingError`). Use it through
:data:`restricted_pickle`, a pickle-module stand-in for ``torch.load(..., pickle_module=...)``.
"""

from __future__ import annotations

import io
import pickle
import types
from typing import IO, Any

import torch

__all__ = ["PickledObject", "RefusedGlobalError", "RestrictedUnpickler", "restricted_pickle"]


class RefusedGlobalError(pickle.UnpicklingError):
    """A checkpoint references a global outside the allow-list (the message names it); nothing of it ran."""


class PickledObject:
    """Inert stand-in for a class of ``ultralytics.*`` or ``torch.nn.*`` met in a checkpoint.

    It never runs code of the class it replaces; it records what the pickle gave it.

    Attributes:
      pickled_class: ``"module.QualName"`` of the class it stands for.
      state: the state the pickle restored (``BUILD``), e.g. an ``nn.Module``'s ``__dict__``.
      args: positional arguments the pickle constructed it with.

    Example:
      >>> from yolo_func.io import PickledObject
      >>> PickledObject.__name__                          # what read_reference_checkpoint unpickles reference classes as
      'PickledObject'
    """

    _pickled_class = "?"
    # Defaults for objects the pickle builds with NEWOBJ (which does not call __init__).
    args: tuple = ()
    kwargs: dict | None = None
    state: Any = None

    def __init__(self, *args, **kwargs):  # REDUCE calls the class; record only
        self.__dict__.update(args=args, kwargs=kwargs)

    def __setstate__(self, state):
        self.__dict__["state"] = state

    @property
    def pickled_class(self) -> str:
        """``"module.QualName"`` of the class this stub stands for."""
        return type(self)._pickled_class

    def __repr__(self) -> str:
        return f"PickledObject({self.pickled_class})"


_STUBS: dict[tuple[str, str], type] = {}


def _stub(module: str, name: str) -> type:
    key = (module, name)
    if key not in _STUBS:
        _STUBS[key] = type(name, (PickledObject,), {"_pickled_class": f"{module}.{name}", "__module__": __name__})
    return _STUBS[key]


_STUB_PREFIXES = ("ultralytics.", "torch.nn.")
# Globals that rebuild tensors and plain containers. Calling them runs only their own code.
_ALLOWED: dict[str, frozenset[str]] = {
    "builtins": frozenset({"set", "frozenset", "complex", "slice", "bytearray"}),
    "collections": frozenset({"OrderedDict"}),
    "torch._utils": frozenset(
        {"_rebuild_tensor", "_rebuild_tensor_v2", "_rebuild_tensor_v3", "_rebuild_parameter", "_rebuild_parameter_with_state"}
    ),
    "torch": frozenset({"Size", "device"}),
    # numpy scalars and arrays sometimes appear in training metadata (e.g. fitness values).
    "numpy": frozenset({"dtype", "ndarray"}),
    "numpy.core.multiarray": frozenset({"scalar", "_reconstruct"}),
    "numpy._core.multiarray": frozenset({"scalar", "_reconstruct"}),
}


class RestrictedUnpickler(pickle.Unpickler):
    """Unpickler that rebuilds only tensors, storages and plain containers.

    Classes from ``ultralytics.*`` / ``torch.nn.*`` become :class:`PickledObject` stubs (their code is
    never imported or run); torch dtypes and the globals in an allow-list are resolved; anything else
    raises :class:`RefusedGlobalError` (a :class:`pickle.UnpicklingError`) naming the global.
    """

    def find_class(self, module: str, name: str):  # noqa: D102
        import _compat_pickle

        # Protocol <= 2 pickles carry Python 2 names (e.g. '__builtin__ set'); map them like pickle does.
        if (module, name) in _compat_pickle.NAME_MAPPING:
            module, name = _compat_pickle.NAME_MAPPING[(module, name)]
        elif module in _compat_pickle.IMPORT_MAPPING:
            module = _compat_pickle.IMPORT_MAPPING[module]
        if module == "ultralytics" or module.startswith(_STUB_PREFIXES) or module == "torch.nn":
            return _stub(module, name)
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module == "torch" and name.endswith("Storage") and hasattr(torch, name):
            return getattr(torch, name)  # legacy typed-storage classes (torch's loader maps these first)
        raise RefusedGlobalError(
            f"[yolo_func] refusing to load global '{module}.{name}' from a checkpoint: only tensors, storages, "
            f"plain containers and (inert) ultralytics.* / torch.nn.* classes are allowed"
        )


def _restricted_load(file: IO[bytes], **kwargs) -> Any:
    return RestrictedUnpickler(file, **kwargs).load()


def _restricted_loads(data: bytes, **kwargs) -> Any:
    return RestrictedUnpickler(io.BytesIO(data), **kwargs).load()


#: A pickle-module stand-in for ``torch.load(..., pickle_module=restricted_pickle, weights_only=False)``.
restricted_pickle = types.ModuleType("yolo_func.io.restricted_pickle")
restricted_pickle.Unpickler = RestrictedUnpickler
restricted_pickle.UnpicklingError = pickle.UnpicklingError
restricted_pickle.load = _restricted_load
restricted_pickle.loads = _restricted_loads
