"""YOLOv8 building blocks (REFERENCE.md §1.3): bottleneck, C2f, SPPF, upsample, concat."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from yolo_func.func import cat
from yolo_func.nn.base import Layer
from yolo_func.nn.conv import conv_bn_act

__all__ = ["bottleneck", "c2f", "sppf", "upsample", "concat"]


def bottleneck(c: int, *, shortcut: bool) -> Layer:
    """``Conv(c, c, 3) -> Conv(c, c, 3)``, plus the input when ``shortcut``.

    Params/state keys: ``cv1``, ``cv2``. Apply: ``float[B, c, H, W] -> float[B, c, H, W]``.

    Example:
      >>> import torch
      >>> gen = torch.Generator().manual_seed(0)
      >>> from yolo_func.nn import bottleneck
      >>> layer = bottleneck(8, shortcut=True)
      >>> p, s = layer.init(gen)
      >>> y, _ = layer.apply(p, s, torch.rand(1, 8, 16, 16), train=False)   # float[B, c, H, W] -> same shape
      >>> tuple(y.shape)
      (1, 8, 16, 16)
    """
    cv1, cv2 = conv_bn_act(c, c, 3), conv_bn_act(c, c, 3)

    def init(gen: torch.Generator):
        p1, s1 = cv1.init(gen)
        p2, s2 = cv2.init(gen)
        return {"cv1": p1, "cv2": p2}, {"cv1": s1, "cv2": s2}

    def apply(params, state, x, *, train: bool):
        y, s1 = cv1.apply(params["cv1"], state["cv1"], x, train=train)
        y, s2 = cv2.apply(params["cv2"], state["cv2"], y, train=train)
        return (x + y if shortcut else y), ({"cv1": s1, "cv2": s2} if train else state)

    return Layer(init, apply)


def c2f(c_in: int, c_out: int, n: int, *, shortcut: bool) -> Layer:
    """CSP bottleneck with two convolutions (YOLOv8 ``C2f``).

    ``h = c_out // 2``; ``cv1: c_in -> 2h`` split into ``(a, b)``; ``n`` bottlenecks chained from
    ``b`` (``m0(b)``, ``m1(m0)``, ...); ``cv2`` over ``concat[a, b, m0, ..., m{n-1}]`` -> ``c_out``.
    Params/state keys: ``cv1``, ``cv2``, ``m0`` ... ``m{n-1}`` (init order: cv1, cv2, m0, m1, ...).
    Apply: ``float[B, c_in, H, W] -> float[B, c_out, H, W]``.

    Example:
      >>> import torch
      >>> gen = torch.Generator().manual_seed(0)
      >>> from yolo_func.nn import c2f
      >>> layer = c2f(16, 32, 1, shortcut=True)
      >>> p, s = layer.init(gen)
      >>> y, _ = layer.apply(p, s, torch.rand(1, 16, 8, 8), train=False)   # float[B, c_in, H, W] -> float[B, c_out, H, W]
      >>> tuple(y.shape)
      (1, 32, 8, 8)
    """
    h = int(c_out * 0.5)
    cv1 = conv_bn_act(c_in, 2 * h, 1)
    cv2 = conv_bn_act((2 + n) * h, c_out, 1)
    ms = [bottleneck(h, shortcut=shortcut) for _ in range(n)]

    def init(gen: torch.Generator):
        params, state = {}, {}
        params["cv1"], state["cv1"] = cv1.init(gen)
        params["cv2"], state["cv2"] = cv2.init(gen)
        for j, m in enumerate(ms):
            params[f"m{j}"], state[f"m{j}"] = m.init(gen)
        return params, state

    def apply(params, state, x, *, train: bool):
        new_state = {}
        y, new_state["cv1"] = cv1.apply(params["cv1"], state["cv1"], x, train=train)
        a, b = y.split((h, h), dim=1)
        outs = [a, b]
        for j, m in enumerate(ms):
            b, new_state[f"m{j}"] = m.apply(params[f"m{j}"], state[f"m{j}"], b, train=train)
            outs.append(b)
        y, new_state["cv2"] = cv2.apply(params["cv2"], state["cv2"], cat(outs, 1), train=train)
        return y, (new_state if train else state)

    return Layer(init, apply)


def sppf(c_in: int, c_out: int, k: int = 5) -> Layer:
    """Spatial pyramid pooling, fast: ``cv1 (c_in -> c_in//2, with SiLU)``, three chained
    ``max_pool2d(k, stride 1, padding k//2)``, ``cv2`` over the concat of all four -> ``c_out``.

    Params/state keys: ``cv1``, ``cv2``. Apply: ``float[B, c_in, H, W] -> float[B, c_out, H, W]``.

    Example:
      >>> import torch
      >>> gen = torch.Generator().manual_seed(0)
      >>> from yolo_func.nn import sppf
      >>> layer = sppf(32, 32)
      >>> p, s = layer.init(gen)
      >>> y, _ = layer.apply(p, s, torch.rand(1, 32, 4, 4), train=False)
      >>> tuple(y.shape)
      (1, 32, 4, 4)
    """
    h = c_in // 2
    cv1 = conv_bn_act(c_in, h, 1)
    cv2 = conv_bn_act(4 * h, c_out, 1)

    def init(gen: torch.Generator):
        p1, s1 = cv1.init(gen)
        p2, s2 = cv2.init(gen)
        return {"cv1": p1, "cv2": p2}, {"cv1": s1, "cv2": s2}

    def apply(params, state, x, *, train: bool):
        y, s1 = cv1.apply(params["cv1"], state["cv1"], x, train=train)
        ys = [y]
        for _ in range(3):
            ys.append(F.max_pool2d(ys[-1], k, 1, k // 2))
        y, s2 = cv2.apply(params["cv2"], state["cv2"], cat(ys, 1), train=train)
        return y, ({"cv1": s1, "cv2": s2} if train else state)

    return Layer(init, apply)


def upsample(scale: int = 2) -> Layer:
    """Nearest-neighbour upsampling by ``scale``: ``float[B, C, H, W] -> float[B, C, sH, sW]``.

    Example:
      >>> import torch
      >>> from yolo_func.nn import upsample
      >>> up = upsample(2)
      >>> y, _ = up.apply({}, {}, torch.rand(1, 8, 4, 4), train=False)     # nearest, float[B, C, 2H, 2W]
      >>> tuple(y.shape)
      (1, 8, 8, 8)
    """

    def init(gen: torch.Generator):
        del gen
        return {}, {}

    def apply(params, state, x, *, train: bool):
        del params, train
        return F.interpolate(x, scale_factor=scale, mode="nearest"), state

    return Layer(init, apply)


def concat(dim: int = 1) -> Layer:
    """Concatenate a sequence of tensors along ``dim`` (channels by default).

    Example:
      >>> import torch
      >>> from yolo_func.nn import concat
      >>> y, _ = concat().apply({}, {}, (torch.rand(1, 8, 4, 4), torch.rand(1, 16, 4, 4)), train=False)
      >>> tuple(y.shape)
      (1, 24, 4, 4)
    """

    def init(gen: torch.Generator):
        del gen
        return {}, {}

    def apply(params, state, xs: Sequence[torch.Tensor], *, train: bool):
        del params, train
        return cat(list(xs), dim), state

    return Layer(init, apply)
