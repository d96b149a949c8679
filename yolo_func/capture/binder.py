"""Static input buffers of a capture and the check-then-copy of a call's trees into them.

A captured graph reads its inputs from fixed addresses. :class:`Binder` holds those static trees
(in named groups: ``params``/``state``/``x`` of :func:`yolo_func.capture.capture_vjp`, ``carry``/
``inputs`` of :func:`yolo_func.capture.capture_step`, the output cotangents) and, for each call,
checks the call's trees against the captured :class:`yolo_func.capture.CaptureSignature`, then copies
every leaf that is not already the static leaf with one fused copy. :func:`check_available` says
whether a capture can run at all for some trees (CUDA tensors on one device). Both run on the CPU,
so their logic is tested there.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Mapping
from typing import Any

import torch

from yolo_func import tree as T
from yolo_func.capture.signature import (
    CaptureMismatch,
    CaptureUnavailable,
    memory_format_of,
    signature_of_groups,
)

__all__ = ["Binder", "check_available"]

PyTree = Any


class Binder:
    """The static leaves of some groups of trees, and the check-then-copy of call trees into them.

    ``load`` accepts a call's trees when their structure and each leaf's spec (restricted to
    ``fields``) equal the captured ones, copies every leaf that is not already the static leaf, and
    otherwise raises :class:`CaptureMismatch` with both full signatures.
    """

    def __init__(self, static: Mapping[str, PyTree], autocast_dtype: torch.dtype | None, *, what: str,
                 fields: tuple[str, ...] = ("shape", "dtype", "device", "memory_format")):
        self.static = dict(static)
        self.what, self.fields, self.autocast_dtype = what, fields, autocast_dtype
        self.signature = signature_of_groups(self.static, autocast_dtype)
        self._groups = []
        for group, tree in self.static.items():
            leaves, treedef = T.tree_flatten(tree)
            specs = [spec for path, spec in self.signature.entries if path == group or path.startswith(group + "/")]
            self._groups.append((group, tree, treedef, leaves, specs))

    def _collect(self, tree: PyTree, static_tree: PyTree, treedef: Any, leaves: list, specs: list,
                 dst: list, src: list) -> bool:
        if tree is static_tree:  # the caller hands back the static tree itself: nothing to do
            return True
        got, got_def = T.tree_flatten(tree)
        if got_def != treedef:
            return False
        check_dtype = "dtype" in self.fields
        check_format = "memory_format" in self.fields
        for s, g, spec in zip(leaves, got, specs):
            if g is s:
                continue
            if not isinstance(g, torch.Tensor) or tuple(g.shape) != spec.shape or str(g.device) != spec.device:
                return False
            if check_dtype and g.dtype != spec.dtype:
                return False
            if check_format and memory_format_of(g) != spec.memory_format:
                return False
            if g.data_ptr() == s.data_ptr() and g.stride() == s.stride() and g.dtype == s.dtype:
                continue  # an alias of the static buffer (e.g. a .detach()): same memory, no copy
            dst.append(s)
            src.append(g)
        return True

    def load(self, *trees: PyTree) -> int:
        """Check ``trees`` (one per group, in order) and copy them into the static buffers.

        Returns:
          the number of leaves copied.

        Raises:
          CaptureMismatch: a tree or leaf differs from the captured signature.
        """
        dst: list[torch.Tensor] = []
        src: list[torch.Tensor] = []
        for tree, (_, static_tree, treedef, leaves, specs) in zip(trees, self._groups):
            if not self._collect(tree, static_tree, treedef, leaves, specs, dst, src):
                got = signature_of_groups(dict(zip(self.static, trees)), self.autocast_dtype)
                raise CaptureMismatch(self.signature, got, what=self.what, fields=self.fields)
        T.foreach_copy_(dst, src)
        return len(dst)


# The stream-capture mode of every CUDA graph this package records. "thread_local": only the
# capturing thread's potentially unsafe CUDA calls (cudaMalloc, syncs) invalidate the capture. A fit
# runs helper threads (checkpoint writer, the loader's pinned-memory thread, COCO evaluation,
# imports) that never touch the captured stream; under torch's default "global" mode one of their
# calls during a capture aborts it with cudaErrorStreamCaptureInvalidated.
CAPTURE_ERROR_MODE = "thread_local"


@contextlib.contextmanager
def gc_paused():
    """Python's cyclic garbage collector off for the block (a capture), back on after.

    ``torch.cuda.graph`` collects once before capturing, but a collection triggered *during*
    the capture runs finalizers on the capturing thread: freeing an unrelated tensor from an
    earlier step (pinned host memory, a foreign stream's block) can make a CUDA call that is
    illegal while the stream captures and aborts the capture. Captures are short; nothing is lost
    by collecting after them.
    """
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def check_available(groups: Mapping[str, PyTree], generators: tuple = (), *, caller: str = "capture_vjp") -> torch.device:
    """The one CUDA device every leaf of ``groups`` lives on, or why capture cannot run.

    Args:
      groups: ``{group name: pytree of tensors}``.
      generators: CUDA generators the captured function draws from (must be on the same device).
      caller: the public function named in error messages.

    Returns:
      the device.

    Raises:
      CaptureUnavailable: a leaf is not on a CUDA device, CUDA is unavailable, or a capture is
        already underway on the current stream (the caller may fall back to eager).
      TypeError: a leaf is not a tensor.
      ValueError: leaves (or a generator) on several devices, or no tensor at all.
    """
    device = None
    named = [(f"{group}/{path}" if path else group, leaf) for group, tree in groups.items() for path, leaf in T.tree_items(tree)]
    for name, leaf in named:
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(f"[yolo_func] {caller}: {name} must be a torch.Tensor, got {type(leaf).__name__}")
    for name, leaf in named:
        if leaf.device.type != "cuda":
            raise CaptureUnavailable(f"inputs are on {leaf.device}, not a CUDA device (first: {name})")
        if device is None:
            device = leaf.device
        elif leaf.device != device:
            raise ValueError(f"[yolo_func] {caller}: all inputs must be on one device; {name} is on "
                             f"{leaf.device}, earlier inputs on {device}")
    if device is None:
        raise ValueError(f"[yolo_func] {caller}: the inputs hold no tensors (groups {list(groups)})")
    if not torch.cuda.is_available():
        raise CaptureUnavailable("CUDA is not available")
    if torch.cuda.is_current_stream_capturing():
        raise CaptureUnavailable("a CUDA graph capture is already underway on the current stream")
    for g in generators:
        index = g.device.index if g.device.index is not None else torch.cuda.current_device()
        if index != device.index:
            raise ValueError(f"[yolo_func] {caller}: a generator is on {g.device}, the inputs on {device}")
    return device

