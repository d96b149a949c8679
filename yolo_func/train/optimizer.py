"""The reference's optimizer recipe assembled from :mod:`yolo_func.optim` (REFERENCE.md §4.2-4.3)."""

from __future__ import annotations

from typing import NamedTuple

from yolo_func.optim import (
    GradientTransformation,
    YoloSchedules,
    chain,
    clip_by_global_norm,
    multi_steps,
    nominal_accumulate,
    partition,
    scaled_weight_decay,
    sgd,
    share_schedules,
    yolo_param_labels,
    yolo_schedules,
)

__all__ = ["YoloOptimizer", "yolo_sgd"]


class YoloOptimizer(NamedTuple):
    """The transform and the schedules it reads (for logging ``lr`` / ``momentum`` / ``accumulate``).

    Example:
      >>> import torch
      >>> from yolo_func.train import yolo_sgd
      >>> opt = yolo_sgd(batch_size=4, batches_per_epoch=10, epochs=5)
      >>> opt.accumulate, round(float(opt.schedules.lr["bias"](torch.tensor(0))), 3)   # 64 / 4; warmup_bias_lr
      (16, 0.1)
    """

    tx: GradientTransformation
    schedules: YoloSchedules
    accumulate: int
    weight_decay: float


def yolo_sgd(
    *,
    batch_size: int,
    batches_per_epoch: int,
    epochs: int,
    lr0: float = 0.01,
    lrf: float = 0.01,
    momentum: float = 0.937,
    weight_decay: float = 5e-4,
    warmup_epochs: float = 3.0,
    warmup_bias_lr: float = 0.1,
    warmup_momentum: float = 0.8,
    cos_lr: bool = False,
    nbs: int = 64,
    max_norm: float = 10.0,
) -> YoloOptimizer:
    """YOLOv8's SGD recipe: three parameter groups by path (decayed weights, BN weights, biases),
    Nesterov momentum, coupled weight decay scaled by ``batch * accumulate / nbs``, gradient-norm
    clipping at ``max_norm`` before the step, per-iteration warmup (bias lr falling from
    ``warmup_bias_lr``, momentum rising from ``warmup_momentum``, accumulation rising from 1 to
    ``round(nbs / batch)``), then ``lr0 * lf(epoch)``.

    ``tx = share_schedules(multi_steps(chain(clip_by_global_norm(max_norm), partition({decay,
    no_decay, bias}: sgd)), every=schedules.accumulate))``; its count is the global iteration ``ni``
    (micro-batches seen).

    Returns:
      :class:`YoloOptimizer`.

    Example:
      >>> from yolo_func.train import yolo_sgd
      >>> opt = yolo_sgd(batch_size=16, batches_per_epoch=100, epochs=10)   # a YoloOptimizer
      >>> opt.accumulate, opt.weight_decay, opt.schedules.warmup_iters
      (4, 0.0005, 300)
    """
    acc = nominal_accumulate(batch_size, nbs)
    wd = scaled_weight_decay(weight_decay, batch_size, acc, nbs)
    sched = yolo_schedules(
        lr0, lrf, epochs, batches_per_epoch, warmup_epochs=warmup_epochs, warmup_bias_lr=warmup_bias_lr,
        warmup_momentum=warmup_momentum, momentum=momentum, cos_lr=cos_lr, nominal_accumulate=acc,
    )
    groups = {
        "decay": sgd(sched.lr["decay"], sched.momentum, nesterov=True, weight_decay=wd),
        "no_decay": sgd(sched.lr["no_decay"], sched.momentum, nesterov=True),
        "bias": sgd(sched.lr["bias"], sched.momentum, nesterov=True),
    }
    tx = multi_steps(chain(clip_by_global_norm(max_norm), partition(groups, yolo_param_labels)), every=sched.accumulate)
    tx = share_schedules(tx)  # each schedule evaluated once per update, not once per group
    return YoloOptimizer(tx, sched, acc, wd)
