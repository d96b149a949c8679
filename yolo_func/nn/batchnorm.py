"""BatchNorm over NCHW (or channels_last) activations, with statistics returned out of place.

Numerics are ``F.batch_norm`` (the same kernels as the reference): PyTorch momentum convention
(``running = (1 - momentum) * running + momentum * batch``), the unbiased batch variance for the
running estimate and the biased one for normalisation. YOLOv8 uses eps 1e-3, momentum 0.03.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from yolo_func.nn.base import Layer, _empty

__all__ = ["batchnorm", "batchnorm_init", "batchnorm_apply", "update_stats_in_place", "BN_EPS", "BN_MOMENTUM"]

BN_EPS = 1e-3
BN_MOMENTUM = 0.03

_IN_PLACE = contextvars.ContextVar("yolo_func_bn_in_place", default=False)


@contextlib.contextmanager
def update_stats_in_place() -> Iterator[None]:
    """Opt-in for capture: training-mode BN writes the new statistics into the state tensors it was
    given (static buffers) instead of returning fresh copies. Outside this context BN never touches
    its input state."""
    token = _IN_PLACE.set(True)
    try:
        yield
    finally:
        _IN_PLACE.reset(token)


def batchnorm_init(channels: int) -> tuple[dict, dict]:
    """``({"weight": ones[C], "bias": zeros[C]}, {"running_mean": zeros[C], "running_var": ones[C]})``."""
    params = {"weight": _empty((channels,)).fill_(1.0), "bias": _empty((channels,)).fill_(0.0)}
    state = {"running_mean": _empty((channels,)).fill_(0.0), "running_var": _empty((channels,)).fill_(1.0)}
    return params, state


def batchnorm_apply(
    params: dict, state: dict, x: torch.Tensor, *, train: bool, eps: float = BN_EPS, momentum: float = BN_MOMENTUM
) -> tuple[torch.Tensor, dict]:
    """Normalise ``x: float[B, C, H, W]``.

    Returns ``(y float[B, C, H, W], new_state)``. In eval mode ``new_state is state`` (identity).
    In train mode the running statistics are updated on clones, so ``state`` is untouched, unless
    :func:`update_stats_in_place` is active.
    """
    if not train:
        y = F.batch_norm(x, state["running_mean"], state["running_var"], params["weight"], params["bias"], False, 0.0, eps)
        return y, state
    if _IN_PLACE.get():
        mean, var = state["running_mean"], state["running_var"]
    else:
        mean, var = state["running_mean"].clone(), state["running_var"].clone()
    y = F.batch_norm(x, mean, var, params["weight"], params["bias"], True, momentum, eps)
    return y, {"running_mean": mean, "running_var": var}


def batchnorm(channels: int, *, eps: float = BN_EPS, momentum: float = BN_MOMENTUM) -> Layer:
    """BatchNorm2d layer (no RNG consumed at init)."""

    def init(gen: torch.Generator):
        del gen
        return batchnorm_init(channels)

    def apply(params, state, x, *, train: bool):
        return batchnorm_apply(params, state, x, train=train, eps=eps, momentum=momentum)

    return Layer(init, apply)
