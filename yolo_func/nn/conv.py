"""Convolution layers: plain conv (optionally biased), conv+BN+SiLU, transposed conv."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from yolo_func.nn.base import Layer, conv_bias, conv_weight
from yolo_func.nn.batchnorm import BN_EPS, BN_MOMENTUM, batchnorm_apply, batchnorm_init

__all__ = ["conv2d", "conv_bn_act", "conv_transpose2d"]


def conv2d(c_in: int, c_out: int, k: int = 1, s: int = 1, *, bias: bool = True) -> Layer:
    """Plain ``Conv2d(c_in -> c_out, k, stride s, padding k//2)``.

    Params: ``{"weight": float[c_out, c_in, k, k], "bias": float[c_out]}`` (bias only if ``bias``).
    Apply: ``x float[B, c_in, H, W] -> float[B, c_out, H/s, W/s]``; stateless.

    Example:
      >>> import torch
      >>> gen = torch.Generator().manual_seed(0)
      >>> from yolo_func.nn import conv2d
      >>> conv = conv2d(3, 8, 3, 2)                       # c_in, c_out, kernel, stride
      >>> p, s = conv.init(gen)
      >>> sorted(p), tuple(p["weight"].shape), s
      (['bias', 'weight'], (8, 3, 3, 3), {})
      >>> y, _ = conv.apply(p, s, torch.rand(1, 3, 32, 32), train=False)
      >>> tuple(y.shape)
      (1, 8, 16, 16)
    """
    fan_in = c_in * k * k

    def init(gen: torch.Generator):
        p = {"weight": conv_weight(gen, (c_out, c_in, k, k), fan_in)}
        if bias:
            p["bias"] = conv_bias(gen, c_out, fan_in)
        return p, {}

    def apply(params, state, x, *, train: bool):
        del train
        return F.conv2d(x, params["weight"], params.get("bias"), s, k // 2), state

    return Layer(init, apply)


def conv_bn_act(
    c_in: int, c_out: int, k: int = 1, s: int = 1, *, eps: float = BN_EPS, momentum: float = BN_MOMENTUM
) -> Layer:
    """The YOLOv8 ``Conv`` block: Conv2d (no bias, padding k//2) -> BatchNorm2d -> SiLU.

    Params: ``{"conv": {"weight": float[c_out, c_in, k, k]}, "bn": {"weight", "bias": float[c_out]}}``.
    State: ``{"bn": {"running_mean", "running_var": float[c_out]}}``.
    Apply: ``x float[B, c_in, H, W] -> float[B, c_out, H/s, W/s]``.

    Example:
      >>> import torch
      >>> gen = torch.Generator().manual_seed(0)
      >>> from yolo_func.nn import conv_bn_act
      >>> conv = conv_bn_act(3, 16, 3, 2)
      >>> p, s = conv.init(gen)
      >>> y, new_s = conv.apply(p, s, torch.rand(2, 3, 64, 64), train=True)
      >>> tuple(y.shape), sorted(new_s["bn"])
      ((2, 16, 32, 32), ['running_mean', 'running_var'])
    """
    fan_in = c_in * k * k

    def init(gen: torch.Generator):
        bn_p, bn_s = batchnorm_init(c_out)
        return {"conv": {"weight": conv_weight(gen, (c_out, c_in, k, k), fan_in)}, "bn": bn_p}, {"bn": bn_s}

    def apply(params, state, x, *, train: bool):
        y = F.conv2d(x, params["conv"]["weight"], None, s, k // 2)
        y, bn_state = batchnorm_apply(params["bn"], state["bn"], y, train=train, eps=eps, momentum=momentum)
        return F.silu(y), ({"bn": bn_state} if train else state)

    return Layer(init, apply)


def conv_transpose2d(c_in: int, c_out: int, k: int = 2, s: int = 2, *, bias: bool = True) -> Layer:
    """``ConvTranspose2d(c_in -> c_out, kernel k, stride s, padding 0)``.

    Params: ``{"weight": float[c_in, c_out, k, k], "bias": float[c_out]}``. PyTorch takes the init
    fan-in from weight dim 1, i.e. ``c_out * k * k``.
    Apply: ``x float[B, c_in, H, W] -> float[B, c_out, H*s, W*s]`` (for k == s).

    Example:
      >>> import torch
      >>> gen = torch.Generator().manual_seed(0)
      >>> from yolo_func.nn import conv_transpose2d
      >>> up = conv_transpose2d(8, 8)                     # kernel 2, stride 2
      >>> p, s = up.init(gen)
      >>> y, _ = up.apply(p, s, torch.rand(1, 8, 4, 4), train=False)
      >>> tuple(y.shape)
      (1, 8, 8, 8)
    """
    fan_in = c_out * k * k

    def init(gen: torch.Generator):
        p = {"weight": conv_weight(gen, (c_in, c_out, k, k), fan_in)}
        if bias:
            p["bias"] = conv_bias(gen, c_out, fan_in)
        return p, {}

    def apply(params, state, x, *, train: bool):
        del train
        return F.conv_transpose2d(x, params["weight"], params.get("bias"), s, 0), state

    return Layer(init, apply)
