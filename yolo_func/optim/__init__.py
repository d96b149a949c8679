"""Functional optimizers, optax-shaped: ``tx = sgd(...); state = tx.init(params);
updates, state = tx.update(grads, state, params); params = apply_updates(params, updates)``.

All states are NamedTuples of device tensors (``count: int64[]`` where a transform needs one);
updates use fused ``torch._foreach_*`` ops and never synchronise with the host. REFERENCE.md §4
describes the YOLOv8 recipe these pieces reproduce: ``multi_steps(chain(clip_by_global_norm(10.0),
partition({"decay": sgd(...), "no_decay": sgd(...), "bias": sgd(...)}, yolo_param_labels)),
every=yolo_schedules(...).accumulate)`` and ``ema()`` gated by ``ApplyIfFiniteState.stepped``; the training step wraps every optimizer in
:func:`apply_if_finite` (non-finite micro-batches are skipped on the device).
"""

from yolo_func.optim.accumulate import MultiStepsState, multi_steps, nominal_accumulate, scaled_weight_decay
from yolo_func.optim.alias import adamw, sgd
from yolo_func.optim.base import (
    EmptyState,
    GradientTransformation,
    ScalarOrSchedule,
    Schedule,
    apply_updates,
    apply_updates_,
    identity,
)
from yolo_func.optim.combine import PartitionState, chain, partition
from yolo_func.optim.ema import Ema, EmaState, ema, ema_decay
from yolo_func.optim.finite import ApplyIfFiniteState, apply_if_finite
from yolo_func.optim.labels import YOLO_GROUPS, yolo_param_labels
from yolo_func.optim.schedules import (
    YoloSchedules,
    cosine_lf,
    interp_warmup,
    linear_lf,
    memoized,
    schedule_memo,
    share_schedules,
    warmup_iterations,
    yolo_schedules,
)
from yolo_func.optim.transforms import (
    ClipByGlobalNormState,
    ScaleByAdamState,
    ScaleByScheduleState,
    TraceState,
    add_decayed_weights,
    clip_by_global_norm,
    global_norm,
    scale,
    scale_by_adam,
    scale_by_adamw,
    scale_by_learning_rate,
    scale_by_schedule,
    trace,
)

__all__ = [
    # protocol
    "GradientTransformation",
    "EmptyState",
    "Schedule",
    "ScalarOrSchedule",
    "identity",
    "apply_updates",
    "apply_updates_",
    # transforms
    "trace",
    "TraceState",
    "add_decayed_weights",
    "scale",
    "scale_by_learning_rate",
    "scale_by_schedule",
    "ScaleByScheduleState",
    "scale_by_adam",
    "scale_by_adamw",
    "ScaleByAdamState",
    "clip_by_global_norm",
    "ClipByGlobalNormState",
    "global_norm",
    # combinators
    "chain",
    "partition",
    "PartitionState",
    # optimizers
    "sgd",
    "adamw",
    # schedules
    "linear_lf",
    "cosine_lf",
    "interp_warmup",
    "warmup_iterations",
    "yolo_schedules",
    "YoloSchedules",
    "memoized",
    "schedule_memo",
    "share_schedules",
    # parameter groups
    "yolo_param_labels",
    "YOLO_GROUPS",
    # accumulation
    "multi_steps",
    "MultiStepsState",
    "nominal_accumulate",
    "scaled_weight_decay",
    # non-finite skipping
    "apply_if_finite",
    "ApplyIfFiniteState",
    # EMA
    "ema",
    "Ema",
    "EmaState",
    "ema_decay",
]
