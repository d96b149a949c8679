"""Distribution focal loss helpers (REFERENCE.md §1.6, §2.4)."""

from __future__ import annotations

import torch

__all__ = ["dfl_expectation"]


def dfl_expectation(box_dist: torch.Tensor, reg_max: int = 16) -> torch.Tensor:
    """Expected distance per side: softmax over the ``R`` bins of each side, then ``sum_j j * p_j``.

    Args:
      box_dist: float[..., 4*R] raw logits, side-major (left, top, right, bottom) x R bins.
      reg_max: R (16).

    Returns:
      float[..., 4] distances in grid units.
    """
    shape = box_dist.shape[:-1]
    if box_dist.shape[-1] != 4 * reg_max:
        raise ValueError(f"[yolo_func] box_dist last dim must be 4*reg_max={4 * reg_max}, got {box_dist.shape[-1]}")
    p = box_dist.reshape(*shape, 4, reg_max).softmax(-1)
    proj = torch.arange(reg_max, device=box_dist.device, dtype=p.dtype)
    return p.matmul(proj)  # a matmul, as the reference's loss decode does (same rounding)
