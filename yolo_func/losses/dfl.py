"""Distribution focal loss (REFERENCE.md §1.6, §2.4).

The DFL decode (:func:`dfl_expectation`, bin logits -> distances) is a codec used by the head's
decode and the assigner too; it lives in :mod:`yolo_func.structures.boxes` and is re-exported here.
"""

from __future__ import annotations

import torch

from yolo_func.structures.boxes import dfl_expectation

__all__ = ["dfl_expectation", "dfl_loss"]


def dfl_loss(box_dist: torch.Tensor, target: torch.Tensor, *, reg_max: int = 16) -> torch.Tensor:
    """Distribution focal loss per anchor, the mean over its four sides (Li et al., "Generalized
    Focal Loss", NeurIPS 2020; ultralytics ``DFLoss``; REFERENCE.md §2.4, trap T11).

    Each side's target ``t`` (grid units) is clamped to ``[0, R - 1 - 0.01]``; with
    ``tl = floor(t)``, ``tr = tl + 1``, ``wl = tr - t``, ``wr = 1 - wl`` the side loss is
    ``-(wl * log_softmax(bins)[tl] + wr * log_softmax(bins)[tr])``.

    Args:
      box_dist: float[..., 4*R] raw logits, side-major (left, top, right, bottom) x R bins.
      target: float[..., 4] target ltrb distances in grid units (no gradient needed).
      reg_max: R (16).

    Returns:
      float[...]: the mean of the four side losses (>= 0).

    Example:
      >>> import torch
      >>> from yolo_func.losses import dfl_loss
      >>> logits = torch.full((1, 64), -20.0)
      >>> logits[0, [3, 16 + 3, 32 + 3, 48 + 3]] = 20.0      # every side sure of bin 3
      >>> dfl_loss(logits, torch.full((1, 4), 3.0)).abs() < 1e-6      # float[A]: target exactly bin 3, ~0
      tensor([True])
    """
    if box_dist.shape[-1] != 4 * reg_max or target.shape[-1] != 4:
        raise ValueError(
            f"[yolo_func] dfl_loss: expected box_dist [..., {4 * reg_max}] and target [..., 4], "
            f"got {tuple(box_dist.shape)} and {tuple(target.shape)}"
        )
    logp = box_dist.reshape(*box_dist.shape[:-1], 4, reg_max).log_softmax(-1)
    t = target.detach().clamp(0, reg_max - 1 - 0.01)
    tl = t.floor()
    wl = tl + 1 - t
    wr = 1 - wl
    idx = tl.long().unsqueeze(-1)
    # Both neighbouring bins in one gather (and one scatter in its backward): idx and idx + 1 are
    # distinct bins of a row, so each logit still receives at most one gradient term.
    lp_l, lp_r = logp.gather(-1, torch.cat((idx, idx + 1), -1)).unbind(-1)
    return -(lp_l * wl + lp_r * wr).mean(-1)
