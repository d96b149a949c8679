"""The training state: everything a step reads and writes, as one pytree."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from yolo_func import tree as T
from yolo_func.structures.records import Batch  # re-exported: it lives in structures/

__all__ = ["TrainState", "Batch"]


class TrainState(NamedTuple):
    """Params, BN statistics, optimizer state, EMA state and the iteration counter.

    Attributes:
      params: ``{"network": ..., "heads": {name: ...}}``.
      state: BN statistics, same shape as ``params`` minus the non-BN leaves.
      opt_state: the optimizer's state (NamedTuples of trees; see :mod:`yolo_func.optim`).
      ema: the EMA transform's state (averaged params and BN statistics), or ``None``.
      step: int64[] on the device: micro-batches seen (the reference's global iteration ``ni``).
      skipped: int64[] on the device: steps skipped because the loss or gradients were not finite.

    Example:
      >>> import torch
      >>> from yolo_func import yolov8
      >>> from yolo_func.optim import sgd
      >>> from yolo_func.train import init_train_state
      >>> model = yolov8("n", task="detect", num_classes=5)
      >>> tx = sgd(0.01, momentum=0.9)
      >>> ts = init_train_state(model, tx, torch.Generator().manual_seed(0))
      >>> type(ts).__name__, ts._fields
      ('TrainState', ('params', 'state', 'opt_state', 'ema', 'step', 'skipped'))
      >>> int(ts.step), int(ts.skipped), ts.step.dtype, ts.ema is None
      (0, 0, torch.int64, True)
    """

    params: dict
    state: dict
    opt_state: Any
    ema: Any
    step: torch.Tensor
    skipped: torch.Tensor

    def to(self, device: torch.device | str, *, channels_last: bool = False) -> "TrainState":
        """Move every leaf (4-D leaves to channels_last when asked)."""
        return T.tree_to(self, device, channels_last=channels_last)
