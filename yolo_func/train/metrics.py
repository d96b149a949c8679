"""Host-side reading of the device metrics a training step returns (the only place that syncs)."""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping

import torch

__all__ = ["NonFiniteLossWarning", "fetch_metrics"]


class NonFiniteLossWarning(RuntimeWarning):
    """A step saw a non-finite loss or gradient and was skipped (see :mod:`yolo_func.train.step`)."""


def fetch_metrics(metrics: Mapping[str, torch.Tensor], *, warn: bool = True) -> dict[str, float]:
    """Copy a step's device metrics to Python floats (one host sync), and report a skipped step.

    When ``metrics["finite"]`` is False, a :class:`NonFiniteLossWarning` names the step and every
    loss part that was not finite (or says the gradients were the culprit), e.g.
    ``step 41: non-finite loss/segment/seg=nan; the step was skipped (params, optimizer state,
    BN statistics and EMA unchanged)``.

    Returns:
      ``{name: float}``.
    """
    names = list(metrics)
    # One stack on the device, one copy to the host.
    values = torch.stack([metrics[k].detach().double().reshape(()) for k in names]).cpu().tolist()
    out = dict(zip(names, values))
    if warn and "finite" in out and not out["finite"]:
        bad = [f"{k}={out[k]}" for k in names if k.startswith("loss") and not math.isfinite(out[k])]
        what = ", ".join(bad) if bad else f"gradients (grad_norm={out.get('grad_norm')})"
        step = int(out["step"]) if "step" in out else "?"
        warnings.warn(
            f"[yolo_func] step {step}: non-finite {what}; the step was skipped "
            "(params, optimizer state, BN statistics and EMA unchanged)",
            NonFiniteLossWarning,
            stacklevel=2,
        )
    return out
