"""Checkpoints of pytrees (params, BN state, optimizer state, EMA, step) plus a config.

Format: one ``torch.save`` file holding only plain data — ``{"format", "tensors": {path: tensor},
"config": dict, "meta": dict, "extra": dict}`` — so it loads with ``torch.load(weights_only=True)``
and never executes code. ``extra`` (optional; ``{}`` in files written before it existed) carries
plain data and tensors that are not part of the tree, e.g. the data position and RNG states of a
resumable training checkpoint (:mod:`yolo_func.train.checkpoint`). Functions (model, heads, optimizer) are not stored: they are rebuilt from the config,
and the saved tensors are poured into a *template* tree of the same structure (big_vision's
``load(init_params, ...)`` contract).

Writes are atomic: the payload goes to a temporary file in the same folder, is flushed and
fsync'ed, then ``os.replace``'d over the target, so an interruption (even SIGKILL) leaves either
the old or the new checkpoint, never a torn one (:func:`atomic_write`). A truncated, damaged or
foreign file is refused with a ``ValueError`` naming it.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch

from yolo_func import tree as T

__all__ = ["FORMAT", "TEMP_SUFFIX", "atomic_write", "save_checkpoint", "load_checkpoint", "read_checkpoint", "restore_tree"]

FORMAT = "yolo_func.checkpoint/1"
#: Temporary files of :func:`atomic_write` are ``.<name>.<random>.tmp`` beside the target; a process
#: killed mid-write leaves one behind (the target itself is intact), safe to delete when no write runs.
TEMP_SUFFIX = ".tmp"


def atomic_write(path: str | os.PathLike, write: Callable[[IO[bytes]], None]) -> Path:
    """Write a file atomically: ``write(f)`` fills a temporary file in the same folder, which is
    flushed, fsync'ed and renamed over ``path`` (``os.replace``); the folder is fsync'ed so the
    rename is durable. A reader sees the old file or the new one, never a part.

    Args:
      path: the target; parent folders are created.
      write: called once with the open binary temporary file.

    Returns:
      The path written.

    Example:
      >>> import tempfile
      >>> from pathlib import Path
      >>> tmp = Path(tempfile.mkdtemp())
      >>> from yolo_func.io import atomic_write
      >>> path = atomic_write(tmp / "a" / "b.bin", lambda f: f.write(b"hello"))
      >>> path.read_bytes(), sorted(p.name for p in path.parent.iterdir())     # no temporary file left
      (b'hello', ['b.bin'])
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=TEMP_SUFFIX, dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    try:  # make the rename itself durable
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:  # some file systems cannot fsync a directory; the rename itself has happened
        return path
    return path


def _own_cpu_copy(x: torch.Tensor) -> torch.Tensor:
    """``x`` on the CPU, owning exactly its storage: a view into a larger buffer (e.g. a flat static
    buffer) is copied so the file holds only its elements; a CPU tensor that owns its whole storage
    is cloned (strides kept) so the payload never shares memory with the caller's tensors: it may be
    written on another thread while training changes them in place."""
    y = x.detach().to("cpu")
    if y.storage_offset() or y.untyped_storage().nbytes() != y.numel() * y.element_size():
        return y.contiguous().clone() if y.is_contiguous() else y.contiguous()
    if y.untyped_storage().data_ptr() == x.untyped_storage().data_ptr():  # already on the CPU: still x's memory
        y = y.clone(memory_format=torch.preserve_format)
    return y


def save_checkpoint(path: str | os.PathLike, tree: Any, *, config: dict | None = None, meta: dict | None = None,
                    extra: dict | None = None) -> Path:
    """Atomically write ``tree`` (any pytree of tensors) with a plain-data ``config`` and ``meta``.

    Tensors are copied to the CPU (a host sync; call it between steps, not inside one).

    Args:
      path: target file; parent folders are created.
      tree: e.g. a ``TrainState``.
      config: plain Python data (str, int, float, bool, None, lists, dicts) to rebuild the functions.
      meta: plain Python data for humans (epoch, metrics, ...).
      extra: plain data and CPU tensors that are not part of ``tree`` (RNG states, data position).

    Returns:
      The path written.

    Example:
      >>> import tempfile
      >>> from pathlib import Path
      >>> tmp = Path(tempfile.mkdtemp())
      >>> import torch
      >>> from yolo_func.io import load_checkpoint, save_checkpoint
      >>> tree = {"w": torch.ones(2, 3), "n": torch.tensor(7)}
      >>> path = save_checkpoint(tmp / "w.pt", tree, config={"lr": 0.1}, meta={"note": "x"})
      >>> loaded, config, meta = load_checkpoint(path, tree)
      >>> loaded["w"].shape, int(loaded["n"]), config, meta
      (torch.Size([2, 3]), 7, {'lr': 0.1}, {'note': 'x'})
    """
    return write_checkpoint_payload(path, checkpoint_payload(tree, config=config, meta=meta, extra=extra))


class HostStaging:
    """Host buffers, allocated once and reused, that a pytree's tensors are copied into without a
    host sync: CUDA tensors go to pinned memory with ``non_blocking`` copies queued on the current
    stream (behind the work that produced them, ahead of any later in-place change), CPU tensors
    are copied at once. :meth:`synchronize` waits for the copies (call it on the thread that
    reads the buffers, e.g. a checkpoint writer); the training thread never waits.

    The buffers are overwritten by the next :meth:`copy`: finish reading (writing the file) first.
    Each buffer keeps its tensor's layout (``torch.empty_like``: the strides of a dense tensor,
    e.g. channels-last weights; a view into a larger buffer gets only its own elements).

    Example:
      >>> import torch
      >>> from yolo_func.io.checkpoint import HostStaging
      >>> staging = HostStaging()
      >>> tree = {"w": torch.ones(2, 3), "b": {"n": torch.tensor(7)}}
      >>> host = staging.copy(tree); staging.synchronize()
      >>> sorted(host), host["w"].data_ptr() != tree["w"].data_ptr(), int(host["b/n"])
      (['b/n', 'w'], True, 7)
      >>> staging.copy(tree)["w"] is host["w"]              # the same buffer, refreshed in place
      True
    """

    def __init__(self) -> None:
        self._buffers: dict[str, tuple[tuple, torch.Tensor]] = {}
        self._event: Any = None

    def copy(self, tree: Any) -> dict[str, torch.Tensor]:
        """``{path: host tensor}`` of every leaf of ``tree``, the copies queued (not awaited).

        Args:
          tree: a pytree of tensors (any device; CUDA leaves of several devices are not supported).

        Returns:
          ``{"/"-joined path: CPU tensor}`` (pinned for CUDA leaves), valid after :meth:`synchronize`.
        """
        out: dict[str, torch.Tensor] = {}
        cuda = None
        for p, x in T.tree_items(tree):
            x = x.detach()
            pin = x.is_cuda
            key = (tuple(x.shape), x.dtype, x.stride(), pin)
            entry = self._buffers.get(p)
            if entry is None or entry[0] != key:
                entry = self._buffers[p] = (key, torch.empty_like(x, device="cpu", pin_memory=pin))
            buf = entry[1]
            buf.copy_(x, non_blocking=pin)
            out[p] = buf
            if pin:
                cuda = x.device
        self._event = None
        if cuda is not None:
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(cuda))
        return out

    def synchronize(self) -> None:
        """Wait until the last :meth:`copy`'s device-to-host copies have landed."""
        if self._event is not None:
            self._event.synchronize()


def checkpoint_payload(tree: Any, *, config: dict | None = None, meta: dict | None = None,
                       extra: dict | None = None, staging: HostStaging | None = None) -> dict:
    """What :func:`save_checkpoint` writes, with every tensor already copied to the CPU (a host
    sync): the payload no longer shares memory with ``tree``, so it can be written later or on
    another thread while ``tree`` changes.

    With ``staging`` (a :class:`HostStaging`) the tensors go to its reused buffers without a host
    sync: call ``staging.synchronize()`` before writing the payload, and write it before the
    staging's next copy."""
    return {
        "format": FORMAT,
        "tensors": staging.copy(tree) if staging is not None else {p: _own_cpu_copy(x) for p, x in T.tree_items(tree)},
        "config": config or {},
        "meta": meta or {},
        "extra": extra or {},
    }


def write_checkpoint_payload(path: str | os.PathLike, payload: dict) -> Path:
    """Atomically write a :func:`checkpoint_payload` (temp file + fsync + rename)."""
    return atomic_write(path, lambda f: torch.save(payload, f))


_ZIP_MAGIC = b"PK\x03\x04"


def _unreadable(path: Path, error: BaseException) -> ValueError:
    """A ValueError saying why ``path`` cannot be a checkpoint (truncated archive or foreign file)."""
    with open(path, "rb") as f:
        head = f.read(16)
    size = path.stat().st_size
    reason = f"{type(error).__name__}: {str(error).splitlines()[0][:160] if str(error) else 'no detail'}"
    if size == 0:
        what = "is empty (0 bytes)"
    elif head.startswith(_ZIP_MAGIC):
        what = f"is a torch archive that is truncated or damaged ({size} bytes; {reason})"
    else:
        what = f"is not a torch checkpoint file (it starts with {head[:12]!r})"
    return ValueError(f"[yolo_func] checkpoint {str(path)!r} {what}; delete it or give another file")


def read_checkpoint(path: str | os.PathLike) -> dict:
    """Read the raw payload ``{"format", "tensors", "config", "meta", "extra"}`` (plain data only;
    ``torch.load(weights_only=True)`` never runs code from the file).

    Raises:
      FileNotFoundError: no such file.
      ValueError: the file is empty, truncated or damaged, not a torch file (a JSON, random bytes, a
        pickle with code), or another program's torch file; the message names the file.

    Example:
      >>> import tempfile
      >>> from pathlib import Path
      >>> tmp = Path(tempfile.mkdtemp())
      >>> import torch
      >>> from yolo_func.io import read_checkpoint, save_checkpoint
      >>> payload = read_checkpoint(save_checkpoint(tmp / "w.pt", {"a": {"b": torch.ones(1)}}))
      >>> sorted(payload), list(payload["tensors"])
      (['config', 'extra', 'format', 'meta', 'tensors'], ['a/b'])
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"[yolo_func] no checkpoint at {str(path)!r}")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except (FileNotFoundError, PermissionError, IsADirectoryError):
        raise
    except Exception as e:  # a truncated zip (RuntimeError or OSError EINVAL), EOFError, UnpicklingError, ...
        raise _unreadable(path, e) from e
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        got = payload.get("format") if isinstance(payload, dict) else type(payload).__name__
        keys = f", keys {sorted(map(str, payload))[:6]}" if isinstance(payload, dict) else ""
        raise ValueError(f"[yolo_func] {str(path)!r} is not a {FORMAT} checkpoint (format: {got!r}{keys}); "
                         "reference (Ultralytics) weights load with yolo_func.io.load_reference_checkpoint")
    tensors = payload.get("tensors")
    if not isinstance(tensors, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in tensors.items()):
        raise ValueError(f"[yolo_func] checkpoint {str(path)!r} has format {FORMAT!r} but no {{path: tensor}} 'tensors' table; the file is damaged")
    for key in ("config", "meta", "extra"):
        payload.setdefault(key, {})
        if not isinstance(payload[key], dict):
            raise ValueError(f"[yolo_func] checkpoint {str(path)!r}: {key!r} is a {type(payload[key]).__name__}, expected a dict; the file is damaged")
    return payload


def restore_tree(tensors: dict[str, torch.Tensor], template: Any, *, source: str = "checkpoint", config: Any = None) -> Any:
    """Pour ``{path: tensor}`` into the structure of ``template`` (same paths and shapes).

    Each leaf takes the template leaf's device, dtype and memory format.

    Args:
      tensors: saved leaves by ``/``-path (a payload's ``"tensors"``).
      template: a tree of the wanted structure (e.g. a freshly initialised ``TrainState``).
      source: names the origin in messages (the file).
      config: shown in the message on a mismatch.

    Raises:
      ValueError: the paths/shapes differ; the message lists missing (`` - ``), unexpected
        (`` + ``) and mis-shaped (`` ~ ``) paths, e.g. for a checkpoint of another scale or task.

    Example:
      >>> import torch
      >>> from yolo_func.io import restore_tree
      >>> restore_tree({"a/b": torch.ones(2)}, {"a": {"b": torch.zeros(2, dtype=torch.float16)}})
      {'a': {'b': tensor([1., 1.], dtype=torch.float16)}}
    """
    items = T.tree_items(template)
    want = {p: x for p, x in items}
    lines = [f" - {p} (in the template, not in the checkpoint)" for p in want if p not in tensors]
    lines += [f" + {p} (in the checkpoint, not in the template)" for p in tensors if p not in want]
    for p, x in items:
        if p in tensors and tuple(tensors[p].shape) != tuple(x.shape):
            lines.append(f" ~ {p}: checkpoint {list(tensors[p].shape)} != template {list(x.shape)}")
    if lines:
        shown = "\n".join(lines[:40]) + (f"\n ... and {len(lines) - 40} more" if len(lines) > 40 else "")
        raise ValueError(f"[yolo_func] checkpoint {source!r} (config {config}) does not fit the template:\n{shown}")

    def restore(x: torch.Tensor, saved_x: torch.Tensor) -> torch.Tensor:
        fmt = torch.channels_last if (x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()) else torch.contiguous_format
        return saved_x.to(device=x.device, dtype=x.dtype).contiguous(memory_format=fmt)

    leaves = [restore(x, tensors[p]) for p, x in items]
    return T.tree_unflatten(T.tree_structure(template), leaves)


def load_checkpoint(path: str | os.PathLike, template: Any) -> tuple[Any, dict, dict]:
    """Load a checkpoint into the structure of ``template`` (same paths, shapes and dtypes).

    Each loaded leaf takes the template leaf's device, dtype and memory format.

    Returns:
      ``(tree, config, meta)``.

    Raises:
      ValueError: the saved paths/shapes differ from the template's; the message lists missing
        (`` - ``), unexpected (`` + ``) and mis-shaped (`` ~ ``) paths, e.g. for a checkpoint of
        another scale or task.

    Example:
      >>> import tempfile
      >>> from pathlib import Path
      >>> tmp = Path(tempfile.mkdtemp())
      >>> import torch
      >>> from yolo_func.io import load_checkpoint, save_checkpoint
      >>> path = save_checkpoint(tmp / "w.pt", {"w": torch.ones(2)})
      >>> tree, config, meta = load_checkpoint(path, {"w": torch.zeros(2, dtype=torch.float64)})   # template's dtype
      >>> tree["w"]
      tensor([1., 1.], dtype=torch.float64)
      >>> try:
      ...     load_checkpoint(path, {"v": torch.zeros(2)})
      ... except ValueError as e:
      ...     print(str(e).startswith("[yolo_func]"))
      True
    """
    payload = read_checkpoint(path)
    tree = restore_tree(payload["tensors"], template, source=str(path), config=payload["config"])
    return tree, payload["config"], payload["meta"]
