"""YOLOv8's three parameter groups as labels, decided by path and rank (never by order)."""

from __future__ import annotations

from typing import Any

import torch

from yolo_func import tree as T

__all__ = ["yolo_param_labels", "YOLO_GROUPS"]

#: The labels :func:`yolo_param_labels` produces.
YOLO_GROUPS = ("decay", "no_decay", "bias")


def _label(path: str, leaf: Any) -> str:
    parts = path.split("/")
    if parts[-1] == "bias":
        return "bias"  # conv biases and BN betas: no decay, warmup from warmup_bias_lr
    if parts[-1] == "weight" and len(parts) >= 2 and parts[-2] == "bn":
        return "no_decay"  # BN gammas
    if isinstance(leaf, torch.Tensor) and leaf.dim() < 2:
        # A 1-D weight that is not under "bn" is still a scale/shift vector, never a kernel.
        return "no_decay"
    return "decay"


def yolo_param_labels(params: Any) -> Any:
    """Label every leaf ``"bias"``, ``"no_decay"`` or ``"decay"`` (REFERENCE.md §4.2).

    * ``"bias"``: any leaf whose path ends in ``/bias`` (conv biases and BN betas);
    * ``"no_decay"``: BN weights (``.../bn/weight``) and any other rank < 2 leaf;
    * ``"decay"``: everything else (rank >= 2 kernels).

    On yolov8n detect this gives 63 / 57 / 63 (the reference's 64 decayed weights include its
    frozen DFL kernel, a constant here).

    Args:
      params: a params tree (or any tree of the same structure, e.g. gradients).

    Returns:
      A tree of ``str`` with the structure of ``params``; use with :func:`partition`.

    >>> import torch
    >>> p = {"conv": {"weight": torch.zeros(2, 2, 1, 1)}, "bn": {"weight": torch.ones(2), "bias": torch.zeros(2)}}
    >>> labels = yolo_param_labels(p)
    >>> labels["conv"]["weight"], labels["bn"]["weight"], labels["bn"]["bias"]
    ('decay', 'no_decay', 'bias')
    """
    leaves, treedef = T.tree_flatten(params)
    paths = T.tree_paths(params)
    return T.tree_unflatten(treedef, [_label(p, x) for p, x in zip(paths, leaves)])
