"""Classification term: binary cross-entropy against soft task-aligned targets (REFERENCE.md §2.4)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["cls_loss"]


def cls_loss(cls_logits: torch.Tensor, target_scores: torch.Tensor, normalizer: torch.Tensor) -> torch.Tensor:
    """``sum BCEWithLogits(logit, target) / S`` over every anchor and class (trap T10).

    Background anchors (target 0) count too; the sum is not averaged. Matches the reference's
    ``bce(pred_scores, target_scores).sum() / target_scores_sum``.

    Args:
      cls_logits: float[B, A, K] raw logits.
      target_scores: float[B, A, K] soft targets in [0, 1] (no gradient).
      normalizer: float[] ``S = max(sum target_scores, 1)``.

    Returns:
      float[] (>= 0).

    Example:
      >>> import torch
      >>> from yolo_func.losses import cls_loss
      >>> logits = torch.zeros(1, 4, 3)                      # float[B, A, K]
      >>> cls_loss(logits, torch.zeros(1, 4, 3), torch.tensor(1.0))   # 12 x BCE(0, 0) = 12 log 2
      tensor(8.3178)
    """
    if cls_logits.shape != target_scores.shape:
        raise ValueError(f"[yolo_func] cls_loss: cls_logits {tuple(cls_logits.shape)} and target_scores "
                         f"{tuple(target_scores.shape)} must match")
    bce = F.binary_cross_entropy_with_logits(cls_logits, target_scores.to(cls_logits.dtype), reduction="sum")
    return bce / normalizer
