"""What a CUDA-graph capture depends on, and the errors that say it cannot be replayed.

A graph replays fixed kernels on fixed addresses, so a capture is valid only for inputs with the
tree structures, shapes, dtypes, devices and memory formats it was recorded with (and the same
autocast dtype). :class:`CaptureSignature` records all of them per leaf; :class:`CaptureMismatch`
shows a call's differences from it. :class:`CaptureUnavailable` (and :class:`CaptureCacheFull`)
tell a caller to fall back to eager.

Example:
  >>> import torch
  >>> sig = signature_of({"w": torch.zeros(2, 3)}, {}, torch.zeros(1, 3, 4, 4))
  >>> [path for path, _ in sig.entries]
  ['params/w', 'x']
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import Any, NamedTuple

import torch

from yolo_func import tree as T

__all__ = [
    "CaptureCacheFull",
    "CaptureMismatch",
    "CaptureSignature",
    "CaptureUnavailable",
    "TensorSpec",
    "check_autocast",
    "memory_format_of",
    "signature_of",
    "signature_of_groups",
]

PyTree = Any

_AUTOCAST_DTYPES = (None, torch.bfloat16, torch.float16)


# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------
class CaptureUnavailable(RuntimeError):
    """Capture cannot be used for these inputs (CPU tensors, no CUDA, a capture already underway,
    a full :class:`CaptureCache`). A caller falls back to eager and warns once with ``reason``.

    Attributes:
      reason: one line saying why.
    """

    def __init__(self, reason: str):
        self.reason = reason
        super().__init__(f"[yolo_func] CUDA-graph capture unavailable: {reason}")


class CaptureCacheFull(CaptureUnavailable):
    """A :class:`yolo_func.capture.CaptureCache` holds captures for ``max_keys`` keys (input shapes)
    and was asked for a new key.

    Attributes:
      key: the key that was not captured.
      keys: the keys held.
    """

    def __init__(self, key: Hashable, keys: tuple, max_keys: int):
        self.key, self.keys = key, keys
        super().__init__(
            f"capture cache full ({max_keys} keys, {list(keys)}); not capturing key {key!r} "
            f"(raise max_captures / max_keys, or keep input shapes to a few buckets)"
        )


class CaptureMismatch(ValueError):
    """A call's inputs differ from what was captured (shape, dtype, device, memory format, tree).

    Attributes:
      expected: the captured :class:`CaptureSignature`.
      got: the call's :class:`CaptureSignature`.
      differences: the differing entries, one line each (also first in the message).
    """

    def __init__(self, expected: "CaptureSignature", got: "CaptureSignature", *, what: str = "inputs",
                 fields: tuple[str, ...] = ("shape", "dtype", "device", "memory_format")):
        self.expected, self.got = expected, got
        self.differences = got.differences(expected, fields=fields)
        diff = "\n".join(f"  {line}" for line in self.differences) or "  (no entry differs)"
        super().__init__(
            f"[yolo_func] the call's {what} do not match the captured signature; a CUDA graph replays "
            f"fixed shapes, dtypes, devices and layouts and is never re-captured silently (capture "
            f"again for these inputs, e.g. through a CaptureCache keyed by input shape). Differences:\n{diff}\n"
            f"call {got.describe()}\ncaptured {expected.describe()}"
        )


# --------------------------------------------------------------------------------------------
# Signatures
# --------------------------------------------------------------------------------------------
def memory_format_of(t: torch.Tensor) -> str:
    """``"channels_last"``, ``"contiguous"`` or ``"strided"`` (neither) for a tensor.

    4-D tensors that are both contiguous and channels_last (size-1 channel or spatial dims, e.g. a
    1x1 conv kernel) are told apart by their strides the way they were laid out: channels_last
    when the channel stride is below the width stride.

    Example:
      Args: ``t`` a tensor of any shape and dtype.

      >>> import torch
      >>> from yolo_func.capture import memory_format_of
      >>> x = torch.ones(1, 3, 4, 4)
      >>> memory_format_of(x), memory_format_of(x.to(memory_format=torch.channels_last)), memory_format_of(x[..., ::2])
      ('contiguous', 'channels_last', 'strided')
    """
    contiguous = t.is_contiguous()
    if t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last):
        if not contiguous or t.stride(1) < t.stride(3):
            return "channels_last"
    if contiguous:
        return "contiguous"
    return "strided"


def _dtype_name(dtype: torch.dtype | None) -> str:
    return "None" if dtype is None else str(dtype).replace("torch.", "")


class TensorSpec(NamedTuple):
    """What a captured kernel depends on for one tensor.

    Attributes:
      shape: the sizes.
      dtype: the element type.
      device: ``str(tensor.device)``, e.g. ``"cuda:0"``.
      memory_format: see :func:`memory_format_of`.

    Example:
      >>> import torch
      >>> from yolo_func.capture import signature_of
      >>> dict(signature_of({"w": torch.ones(2)}, {}, torch.ones(3)).entries)["x"]    # a TensorSpec
      TensorSpec(shape=(3,), dtype=torch.float32, device='cpu', memory_format='contiguous')
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: str
    memory_format: str

    @staticmethod
    def of(t: torch.Tensor) -> "TensorSpec":
        return TensorSpec(tuple(t.shape), t.dtype, str(t.device), memory_format_of(t))

    def render(self, fields: tuple[str, ...] = ("shape", "dtype", "device", "memory_format")) -> str:
        parts = []
        for f in fields:
            v = getattr(self, f)
            parts.append(_dtype_name(v) if f == "dtype" else str(v))
        return " ".join(parts)

    def __str__(self) -> str:
        return self.render()


class CaptureSignature(NamedTuple):
    """Everything a capture depends on: tree structures and per-leaf :class:`TensorSpec` of each
    input group (``params``, ``state``, ``x``), plus the autocast dtype. Hashable, so it can key a
    :class:`CaptureCache`.

    Attributes:
      treedefs: ``((group, treedef), ...)``.
      entries: ``((path, TensorSpec), ...)``, paths ``"params/..."``, ``"state/..."``, ``"x"``.
      autocast_dtype: ``None``, ``torch.bfloat16`` or ``torch.float16``.

    Example:
      >>> import torch
      >>> from yolo_func.capture import signature_of
      >>> captured = signature_of({"w": torch.ones(2)}, {}, torch.ones(3))
      >>> signature_of({"w": torch.ones(2)}, {}, torch.ones(4)).differences(captured)   # what a CaptureMismatch lists
      ['x: (4,) != captured (3,)']
    """

    treedefs: tuple[tuple[str, Any], ...]
    entries: tuple[tuple[str, TensorSpec], ...]
    autocast_dtype: torch.dtype | None

    def describe(self) -> str:
        """Multi-line listing: header, then one ``path: shape dtype device format`` per leaf."""
        lines = [f"signature (autocast {_dtype_name(self.autocast_dtype)}, {len(self.entries)} tensors):"]
        lines += [f"  {path}: {spec}" for path, spec in self.entries]
        return "\n".join(lines)

    def differences(self, captured: "CaptureSignature", *,
                    fields: tuple[str, ...] = ("shape", "dtype", "device", "memory_format")) -> list[str]:
        """Entries where ``self`` (a call) differs from ``captured``, one line each, e.g.
        ``x: (16, 3, 672, 672) != captured (16, 3, 640, 640)``. Empty when they agree on ``fields``."""
        out: list[str] = []
        if self.autocast_dtype != captured.autocast_dtype:
            out.append(f"autocast: {_dtype_name(self.autocast_dtype)} != captured {_dtype_name(captured.autocast_dtype)}")
        mine, theirs = dict(self.entries), dict(captured.entries)
        for path, _ in self.entries:
            if path not in theirs:
                out.append(f"{path}: not in the captured inputs")
        for path, _ in captured.entries:
            if path not in mine:
                out.append(f"{path}: missing (the capture has it)")
        for path, spec in self.entries:
            ref = theirs.get(path)
            if ref is None:
                continue
            diff = tuple(f for f in fields if getattr(spec, f) != getattr(ref, f))
            if diff:
                out.append(f"{path}: {spec.render(diff)} != captured {ref.render(diff)}")
        if not out:
            # same leaves, other containers (a tuple for a list, a NamedTuple for a dict, ...)
            for (group, a), (_, b) in zip(self.treedefs, captured.treedefs):
                if a != b:
                    out.append(f"{group}: tree structure {_short(repr(a))} != captured {_short(repr(b))}")
        return out

    def __str__(self) -> str:
        return self.describe()

    def __repr__(self) -> str:
        x = [f"{p}={s.shape}" for p, s in self.entries if p == "x" or p.startswith("x/")]
        return (f"CaptureSignature({len(self.entries)} tensors, {', '.join(x)}, "
                f"autocast={_dtype_name(self.autocast_dtype)})")


def _short(s: str, n: int = 160) -> str:
    return s if len(s) <= n else s[: n - 3] + "..."


def _group_entries(group: str, tree: PyTree) -> tuple[Any, list[tuple[str, TensorSpec]]]:
    items = T.tree_items(tree)
    entries = []
    for path, leaf in items:
        name = f"{group}/{path}" if path else group
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(f"[yolo_func] {name}: expected a torch.Tensor leaf, got {type(leaf).__name__}")
        entries.append((name, TensorSpec.of(leaf)))
    return T.tree_structure(tree), entries


def signature_of_groups(groups: Mapping[str, PyTree], autocast_dtype: torch.dtype | None) -> CaptureSignature:
    """The :class:`CaptureSignature` of named groups of trees (``{"params": ..., "x": ...}``, or a
    captured step's ``{"carry": ..., "inputs": ...}``); entry paths are ``"<group>/<leaf path>"``.

    Raises:
      TypeError: a leaf is not a tensor.
    """
    treedefs, entries = [], []
    for group, tree in groups.items():
        treedef, e = _group_entries(group, tree)
        treedefs.append((group, treedef))
        entries += e
    return CaptureSignature(tuple(treedefs), tuple(entries), autocast_dtype)


def signature_of(params: PyTree, state: PyTree, x: PyTree, *, autocast_dtype: torch.dtype | None = None) -> CaptureSignature:
    """The :class:`CaptureSignature` of a call.

    Args:
      params, state: pytrees of tensors.
      x: a tensor (e.g. ``float[B, 3, H, W]``) or a pytree of tensors.
      autocast_dtype: the autocast dtype the capture runs under (``None``: no autocast).

    Raises:
      TypeError: a leaf is not a tensor.

    Example:
      >>> import torch
      >>> from yolo_func.capture import signature_of
      >>> print(signature_of({"w": torch.ones(2)}, {}, torch.ones(3)).describe())
      signature (autocast None, 2 tensors):
        params/w: (2,) float32 cpu contiguous
        x: (3,) float32 cpu contiguous
    """
    check_autocast(autocast_dtype)
    return signature_of_groups({"params": params, "state": state, "x": x}, autocast_dtype)


def check_autocast(autocast_dtype: Any) -> None:
    """Raise ``ValueError`` unless ``autocast_dtype`` is ``None``, ``torch.bfloat16`` or ``torch.float16``."""
    if autocast_dtype not in _AUTOCAST_DTYPES:
        raise ValueError(
            f"[yolo_func] autocast_dtype must be None, torch.bfloat16 or torch.float16, got {autocast_dtype!r}"
        )


