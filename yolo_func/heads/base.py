"""The head protocol and the per-level conv branch every YOLOv8 head uses."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from yolo_func.func import cat
from yolo_func.nn import Layer, conv2d, conv_bn_act

__all__ = ["Head", "LEVELS", "branch", "multi_level", "flatten_levels"]

#: Level names, in level order (strides 8, 16, 32).
LEVELS = ("p3", "p4", "p5")


class Head(NamedTuple):
    """A head is a value, not a class hierarchy.

    Attributes:
      init: ``(gen) -> (params, state)``.
      apply: ``(params, state, feats: Feats, *, train) -> (preds, state)``; training-mode outputs.
      loss: ``(preds, targets, assignment) -> (scalar float[], parts dict[str, float[]])``; parts
        are detached.
      decode: ``(preds, anchors) -> float[B, E, A]``; this head's channels of the reference's
        inference output (for segment also its prototypes, see :mod:`yolo_func.heads.segment`).
      capturable: whether ``apply`` and ``loss`` keep static shapes and never sync with the host
        (needed by the deeper CUDA-graph replay levels).

    Example:
      >>> import torch
      >>> from yolo_func import Head, detect_head
      >>> head = detect_head(num_classes=5, channels=(64, 128, 256))
      >>> isinstance(head, Head), head._fields
      (True, ('init', 'apply', 'loss', 'decode', 'capturable'))
      >>> quiet = head._replace(capturable=False)    # a head is a value: change a field, get a new head
    """

    init: Callable[[torch.Generator], tuple[dict, dict]]
    apply: Callable[..., tuple[Any, dict]]
    loss: Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]
    decode: Callable[..., Any]
    capturable: bool = True


def branch(c_in: int, c_mid: int, c_out: int) -> Layer:
    """``Conv(c_in, c_mid, 3) -> Conv(c_mid, c_mid, 3) -> Conv2d(c_mid, c_out, 1, bias)``.

    Tree keys: ``conv1``, ``conv2``, ``pred`` (reference positions ``.0``, ``.1``, ``.2``).
    Apply: ``float[B, c_in, H, W] -> float[B, c_out, H, W]``.

    Example:
      >>> import torch
      >>> from yolo_func.heads import branch
      >>> b = branch(64, 64, 5)
      >>> p, s = b.init(torch.Generator().manual_seed(0))
      >>> y, _ = b.apply(p, s, torch.rand(1, 64, 8, 8), train=False)
      >>> sorted(p), tuple(y.shape)
      (['conv1', 'conv2', 'pred'], (1, 5, 8, 8))
    """
    layers = {"conv1": conv_bn_act(c_in, c_mid, 3), "conv2": conv_bn_act(c_mid, c_mid, 3), "pred": conv2d(c_mid, c_out, 1)}

    def init(gen: torch.Generator):
        params, state = {}, {}
        for name, layer in layers.items():
            params[name], state[name] = layer.init(gen)
        state.pop("pred")  # the plain conv is stateless; keep the state tree free of empty dicts
        return params, state

    def apply(params, state, x, *, train: bool):
        new = {}
        x, new["conv1"] = layers["conv1"].apply(params["conv1"], state["conv1"], x, train=train)
        x, new["conv2"] = layers["conv2"].apply(params["conv2"], state["conv2"], x, train=train)
        x, _ = layers["pred"].apply(params["pred"], {}, x, train=train)
        return x, (new if train else state)

    return Layer(init, apply)


def multi_level(channels: Sequence[int], c_mid: int, c_out: int) -> Layer:
    """One :func:`branch` per level, keyed ``p3``, ``p4``, ``p5``.

    Apply: ``feats`` (three ``float[B, C_l, H_l, W_l]``) -> tuple of three ``float[B, c_out, H_l, W_l]``.

    Example:
      >>> import torch
      >>> from yolo_func.heads import multi_level
      >>> ml = multi_level((64, 128, 256), 64, 5)
      >>> p, s = ml.init(torch.Generator().manual_seed(0))
      >>> ys, _ = ml.apply(p, s, (torch.rand(1, 64, 8, 8), torch.rand(1, 128, 4, 4), torch.rand(1, 256, 2, 2)), train=False)
      >>> sorted(p), [tuple(y.shape) for y in ys]
      (['p3', 'p4', 'p5'], [(1, 5, 8, 8), (1, 5, 4, 4), (1, 5, 2, 2)])
    """
    branches = {name: branch(c, c_mid, c_out) for name, c in zip(LEVELS, channels)}

    def init(gen: torch.Generator):
        params, state = {}, {}
        for name, b in branches.items():
            params[name], state[name] = b.init(gen)
        return params, state

    def apply(params, state, feats, *, train: bool):
        outs, new = [], {}
        for (name, b), x in zip(branches.items(), feats):
            y, new[name] = b.apply(params[name], state[name], x, train=train)
            outs.append(y)
        return tuple(outs), (new if train else state)

    return Layer(init, apply)


def flatten_levels(maps: Sequence[torch.Tensor]) -> torch.Tensor:
    """``[float[B, C, H_l, W_l], ...] -> float[B, A, C]`` (level-major, then row-major anchors).

    Example:
      >>> import torch
      >>> from yolo_func.heads import flatten_levels
      >>> flatten_levels([torch.rand(2, 5, 8, 8), torch.rand(2, 5, 4, 4), torch.rand(2, 5, 2, 2)]).shape
      torch.Size([2, 84, 5])
    """
    return cat([m.flatten(2) for m in maps], 2).transpose(1, 2)  # backward: one split
