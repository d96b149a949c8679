"""The losses' precision rule: half-precision inputs are upcast, float32/float64 pass through."""

from __future__ import annotations

import torch

__all__ = ["at_least_f32", "at_least_f32_dtype"]


def at_least_f32_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype :func:`at_least_f32` gives a tensor of ``dtype``: float32 for half precision,
    else ``dtype`` itself (float32, float64)."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def at_least_f32(x: torch.Tensor) -> torch.Tensor:
    """Upcast half-precision predictions to float32; float32 and float64 pass through unchanged
    (so a float64 model gets a float64 loss, e.g. for tight parity tests).

    Args:
      x: float[...] of any floating dtype.

    Returns:
      float[...] in float32 (from float16 / bfloat16) or ``x`` itself.

    Example:
      >>> import torch
      >>> from yolo_func.losses import at_least_f32
      >>> at_least_f32(torch.ones(2, dtype=torch.bfloat16)).dtype, at_least_f32(torch.ones(2, dtype=torch.float64)).dtype
      (torch.float32, torch.float64)
    """
    return x.to(at_least_f32_dtype(x.dtype))
