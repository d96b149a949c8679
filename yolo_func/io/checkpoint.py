"""Checkpoints of pytrees (params, BN state, optimizer state, EMA, step) plus a config.

Format: one ``torch.save`` file holding only plain data — ``{"format", "tensors": {path: tensor},
"config": dict, "meta": dict}`` — so it loads with ``torch.load(weights_only=True)`` and never
executes code. Functions (model, heads, optimizer) are not stored: they are rebuilt from the config,
and the saved tensors are poured into a *template* tree of the same structure (big_vision's
``load(init_params, ...)`` contract).

Writes are atomic: the payload goes to a temporary file in the same folder, is flushed and
fsync'ed, then ``os.replace``'d over the target, so an interruption leaves either the old or the
new checkpoint, never a torn one.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from yolo_func import tree as T

__all__ = ["FORMAT", "save_checkpoint", "load_checkpoint", "read_checkpoint"]

FORMAT = "yolo_func.checkpoint/1"


def save_checkpoint(path: str | os.PathLike, tree: Any, *, config: dict | None = None, meta: dict | None = None) -> Path:
    """Atomically write ``tree`` (any pytree of tensors) with a plain-data ``config`` and ``meta``.

    Tensors are copied to the CPU (a host sync; call it between steps, not inside one).

    Args:
      path: target file; parent folders are created.
      tree: e.g. a ``TrainState``.
      config: plain Python data (str, int, float, bool, None, lists, dicts) to rebuild the functions.
      meta: plain Python data for humans (epoch, metrics, ...).

    Returns:
      The path written.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "format": FORMAT,
        "tensors": {p: x.detach().to("cpu", memory_format=torch.contiguous_format).clone() for p, x in T.tree_items(tree)},
        "config": config or {},
        "meta": meta or {},
    }
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(payload, f)
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
    except OSError:
        pass
    return path


def read_checkpoint(path: str | os.PathLike) -> dict:
    """Read the raw payload ``{"format", "tensors", "config", "meta"}`` (plain data only).

    Raises:
      FileNotFoundError: no such file.
      ValueError: not a yolo_func checkpoint.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"[yolo_func] no checkpoint at {str(path)!r}")
    payload = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        got = payload.get("format") if isinstance(payload, dict) else type(payload).__name__
        raise ValueError(f"[yolo_func] {str(path)!r} is not a {FORMAT} checkpoint (format: {got!r})")
    return payload


def load_checkpoint(path: str | os.PathLike, template: Any) -> tuple[Any, dict, dict]:
    """Load a checkpoint into the structure of ``template`` (same paths, shapes and dtypes).

    Each loaded leaf takes the template leaf's device, dtype and memory format.

    Returns:
      ``(tree, config, meta)``.

    Raises:
      ValueError: the saved paths/shapes differ from the template's; the message lists missing
        (`` - ``), unexpected (`` + ``) and mis-shaped (`` ~ ``) paths, e.g. for a checkpoint of
        another scale or task.
    """
    payload = read_checkpoint(path)
    saved = payload["tensors"]
    items = T.tree_items(template)
    want = {p: x for p, x in items}
    lines = [f" - {p} (in the template, not in the checkpoint)" for p in want if p not in saved]
    lines += [f" + {p} (in the checkpoint, not in the template)" for p in saved if p not in want]
    for p, x in items:
        if p in saved and tuple(saved[p].shape) != tuple(x.shape):
            lines.append(f" ~ {p}: checkpoint {list(saved[p].shape)} != template {list(x.shape)}")
    if lines:
        shown = "\n".join(lines[:40]) + (f"\n ... and {len(lines) - 40} more" if len(lines) > 40 else "")
        cfg = payload["config"]
        raise ValueError(f"[yolo_func] checkpoint {str(path)!r} (config {cfg}) does not fit the template:\n{shown}")

    def restore(x: torch.Tensor, saved_x: torch.Tensor) -> torch.Tensor:
        fmt = torch.channels_last if (x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()) else torch.contiguous_format
        return saved_x.to(device=x.device, dtype=x.dtype).contiguous(memory_format=fmt)

    leaves = [restore(x, saved[p]) for p, x in items]
    return T.tree_unflatten(T.tree_structure(template), leaves), payload["config"], payload["meta"]
