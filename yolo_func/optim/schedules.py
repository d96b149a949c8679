"""Learning-rate, momentum and accumulation schedules as pure functions of a device step counter.

The reference (REFERENCE.md §4.3) sets each parameter group's ``lr`` and ``momentum`` from the host
at every iteration during warmup and steps a ``LambdaLR`` once per epoch. Here the same values are
functions of the *global iteration* ``ni`` (micro-batches seen, ``ni = i + nb*epoch``) held as an
``int64[]`` tensor on the device: ``torch.where`` replaces the host ``if ni <= nw``, and every
scalar is computed in float64 with the operation order of the reference's Python floats (and of
``np.interp``), so the values equal the reference's to the last bit or within an ulp of ``cos``.
No function here synchronises with the host, so they can run inside a captured step.

Shared evaluation: one optimizer update asks for the same values many times (each parameter
group's SGD reads the momentum and a learning rate; two groups share one learning-rate function),
and each evaluation is a chain of scalar kernels. Inside :func:`schedule_memo` (opened for every
update by :func:`share_schedules`), a :func:`memoized` schedule is evaluated once per step tensor;
the values are the same tensors, so the results are bitwise unchanged.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch

from yolo_func.optim.base import _SCHEDULE_MEMO, GradientTransformation, Schedule

__all__ = [
    "linear_lf",
    "cosine_lf",
    "interp_warmup",
    "YoloSchedules",
    "yolo_schedules",
    "warmup_iterations",
    "memoized",
    "schedule_memo",
    "share_schedules",
]

# id(memoized schedule), id(step) -> (step, value); None outside schedule_memo()
_MEMO = _SCHEDULE_MEMO  # lives in optim.base, which also memoises the leaf-dtype casts of schedule values


@contextlib.contextmanager
def schedule_memo() -> Iterator[None]:
    """Inside this block, every :func:`memoized` schedule is evaluated at most once per step
    tensor (the same tensor object); outside it, every call evaluates.

    Scoped to a block, never global: a step counter that is updated in place between updates (the
    static carry of a captured step) cannot hand back a stale value.

    Example:
      >>> import torch
      >>> from yolo_func.optim import memoized, schedule_memo
      >>> f = memoized(lambda step: step * 2.0)
      >>> with schedule_memo():
      ...     a = f(torch.tensor(1.0)); b = f(torch.tensor(1.0))
      >>> a, b                                      # two step tensors: two evaluations
      (tensor(2.), tensor(2.))
    """
    token = _MEMO.set({})
    try:
        yield
    finally:
        _MEMO.reset(token)


def memoized(schedule: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """``schedule`` evaluated once per step tensor inside :func:`schedule_memo` (see there).

    The schedule must be pure and its callers must not write its output in place (the same
    tensor is handed to every caller within the block).

    Args:
      schedule: ``(int64[] step) -> tensor``.

    Returns:
      A schedule with the same values.

    Example:
      >>> import torch
      >>> from yolo_func.optim import memoized, schedule_memo
      >>> calls = []
      >>> def lr(step):
      ...     calls.append(1)
      ...     return 0.1 * torch.ones_like(step, dtype=torch.float64)
      >>> f = memoized(lr)
      >>> step = torch.tensor(3)
      >>> with schedule_memo():
      ...     _ = f(step), f(step)                     # evaluated once for this step tensor
      >>> len(calls)
      1
    """
    @functools.wraps(schedule)
    def wrapped(step: torch.Tensor) -> torch.Tensor:
        memo = _MEMO.get()
        if memo is None:
            return schedule(step)
        key = (id(wrapped), id(step))
        hit = memo.get(key)
        if hit is not None and hit[0] is step:  # the entry keeps `step` alive: its id is not reused
            return hit[1]
        out = schedule(step)
        memo[key] = (step, out)
        return out

    return wrapped


def share_schedules(tx: GradientTransformation) -> GradientTransformation:
    """``tx`` with every update run inside :func:`schedule_memo`, so the :func:`memoized`
    schedules its parameter groups read are evaluated once per update. Same state, same values.

    Args:
      tx: any :class:`GradientTransformation`.

    Returns:
      A :class:`GradientTransformation` with ``tx``'s init and state. ``update`` forwards its
      keywords to ``tx`` unchanged: the keywords it accepts are ``tx``'s, and ``tx`` raises
      ``TypeError`` on the others.

    Example:
      >>> import torch
      >>> from yolo_func import optim
      >>> p = {"w": torch.ones(2)}
      >>> tx = optim.share_schedules(optim.sgd(0.1))    # same results; memoized schedules run once a step
      >>> tx.update({"w": torch.ones(2)}, tx.init(p), p)[0]["w"]
      tensor([-0.1000, -0.1000])
    """
    if not isinstance(tx, GradientTransformation):
        raise TypeError(f"[yolo_func] share_schedules(tx) must be a GradientTransformation, got {type(tx).__name__}")

    def update(updates, state, params=None, **keywords):
        with schedule_memo():
            return tx.update(updates, state, params, **keywords)

    return GradientTransformation(tx.init, update)

_F64 = torch.float64


def _as64(x: torch.Tensor | float | int, device: torch.device | None = None) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        if x.dtype == _F64:
            return x
        # Inside schedule_memo() the step counter is converted once per update (every group's
        # schedules read the same step tensor), not once per schedule.
        memo = _MEMO.get()
        if memo is None:
            return x.to(dtype=_F64)
        key = ("as64", id(x))
        hit = memo.get(key)
        if hit is not None and hit[0] is x:  # the entry keeps `x` alive: its id is not reused
            return hit[1]
        out = x.to(dtype=_F64)
        memo[key] = (x, out)
        return out
    # torch.full launches a fill kernel; torch.tensor would copy from the host (not capturable).
    return torch.full((), float(x), dtype=_F64, device=device)


def linear_lf(lrf: float, epochs: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """The reference's linear LR factor ``lf(e) = max(1 - e/E, 0) * (1 - lrf) + lrf``.

    Args:
      lrf: final factor (``lr0*lrf`` is the last learning rate).
      epochs: E.

    Returns:
      ``lf(epoch: int or float tensor []) -> float64[]``; lf(0) = 1, lf(E) = lrf.

    Example:
      >>> import torch
      >>> from yolo_func.optim import linear_lf
      >>> lf = linear_lf(lrf=0.01, epochs=10)
      >>> [round(float(lf(torch.tensor(e, dtype=torch.float64))), 4) for e in (0, 5, 10)]
      [1.0, 0.505, 0.01]
    """
    _check_epochs(epochs)
    one_minus_lrf = 1.0 - float(lrf)

    def lf(epoch: torch.Tensor) -> torch.Tensor:
        e = _as64(epoch)
        return torch.clamp(1 - e / epochs, min=0.0) * one_minus_lrf + float(lrf)

    return lf


def cosine_lf(lrf: float, epochs: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """The reference's cosine LR factor ``lf(e) = max((1 - cos(e*pi/E))/2, 0) * (lrf - 1) + 1``.

    Args:
      lrf: final factor.
      epochs: E.

    Returns:
      ``lf(epoch) -> float64[]``; lf(0) = 1, lf(E/2) = (1 + lrf)/2, lf(E) = lrf.

    Example:
      >>> import torch
      >>> from yolo_func.optim import cosine_lf
      >>> lf = cosine_lf(lrf=0.01, epochs=10)
      >>> [round(float(lf(torch.tensor(e, dtype=torch.float64))), 4) for e in (0, 5, 10)]
      [1.0, 0.505, 0.01]
    """
    _check_epochs(epochs)
    lrf_minus_one = float(lrf) - 1.0

    def lf(epoch: torch.Tensor) -> torch.Tensor:
        e = _as64(epoch)
        return torch.clamp((1 - torch.cos(e * math.pi / epochs)) / 2, min=0.0) * lrf_minus_one + 1

    return lf


def _check_epochs(epochs: int) -> None:
    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs <= 0:
        raise ValueError(f"[yolo_func] epochs must be a positive int, got {epochs!r}")


def interp_warmup(x: torch.Tensor, end: int, start_value: torch.Tensor | float, end_value: torch.Tensor | float) -> torch.Tensor:
    """``np.interp(x, [0, end], [start_value, end_value])`` for ``0 <= x <= end``, on the device.

    Uses numpy's formula ``slope*(x - 0) + y0`` with ``slope = (y1 - y0)/(end - 0)`` and returns
    ``y1`` exactly at ``x == end`` (as numpy does, also when ``end == 0``).

    Args:
      x: int64[] or float[] position.
      end: the right end of the interval (Python int >= 0).
      start_value, end_value: float64 tensors [] or floats.

    Returns:
      float64[] (values for ``x > end`` are meaningless; callers select with ``torch.where``).

    Example:
      >>> import torch
      >>> from yolo_func.optim import interp_warmup
      >>> interp_warmup(torch.tensor(25.0), 100, 0.1, 0.01)       # a quarter of the way from 0.1 to 0.01
      tensor(0.0775, dtype=torch.float64)
    """
    xf = _as64(x)
    if isinstance(start_value, torch.Tensor) or isinstance(end_value, torch.Tensor):
        y0 = start_value.to(dtype=_F64) if isinstance(start_value, torch.Tensor) else float(start_value)
        y1 = end_value.to(dtype=_F64) if isinstance(end_value, torch.Tensor) else float(end_value)
    else:
        y0, y1 = float(start_value), float(end_value)
    # Python floats stay Python floats: their arithmetic is float64 arithmetic (IEEE double, the
    # same roundings as float64 device scalars), without a fill kernel per constant.
    slope = (y1 - y0) / max(end, 1)
    return torch.where(xf == end, y1, slope * xf + y0)


def warmup_iterations(warmup_epochs: float, epochs: int, batches_per_epoch: int) -> int:
    """``nw = round(min(warmup_epochs, max(E - 1, 0)) * nb)``, 0 if ``warmup_epochs <= 0``.

    Python ``round`` (half to even), as the reference (8.4.190: no 100-iteration minimum).

    Example:
      >>> from yolo_func.optim import warmup_iterations
      >>> warmup_iterations(3.0, epochs=100, batches_per_epoch=50), warmup_iterations(3.0, epochs=2, batches_per_epoch=50)
      (150, 50)
    """
    if warmup_epochs <= 0:
        return 0
    return round(min(warmup_epochs, max(epochs - 1, 0)) * batches_per_epoch)


class YoloSchedules(NamedTuple):
    """The reference's per-iteration schedules, all functions of the global iteration ``ni``.

    Attributes:
      lr: ``{"decay", "no_decay", "bias"} -> schedule``; float64[] learning rates.
      momentum: float64[] SGD momentum (every group).
      accumulate: int64[] micro-batches per optimizer step (for :func:`multi_steps`).
      lf: the epoch factor ``lf(epoch) -> float64[]``.
      warmup_iters: nw (Python int).

    Example:
      >>> import torch
      >>> from yolo_func.optim import yolo_schedules
      >>> sch = yolo_schedules(lr0=0.01, lrf=0.01, epochs=10, batches_per_epoch=100)
      >>> sorted(sch.lr), sch.warmup_iters
      (['bias', 'decay', 'no_decay'], 300)
      >>> round(float(sch.lr["bias"](torch.tensor(0))), 4), int(sch.accumulate(torch.tensor(0)))    # warmup starts at warmup_bias_lr
      (0.1, 1)
    """

    lr: dict
    momentum: Schedule
    accumulate: Schedule
    lf: Callable[[torch.Tensor], torch.Tensor]
    warmup_iters: int


def yolo_schedules(
    lr0: float,
    lrf: float,
    epochs: int,
    batches_per_epoch: int,
    warmup_epochs: float = 3.0,
    warmup_bias_lr: float = 0.1,
    warmup_momentum: float = 0.8,
    momentum: float = 0.937,
    cos_lr: bool = False,
    nominal_accumulate: int = 4,
) -> YoloSchedules:
    """YOLOv8's warmup + epoch schedule (REFERENCE.md §4.3, trap T15) as device functions of ``ni``.

    With ``epoch = ni // nb`` and ``nw`` from :func:`warmup_iterations`:

    * ``ni <= nw``: bias lr ``interp(ni, [0, nw], [warmup_bias_lr, lr0*lf(epoch)])``, other groups
      ``interp(ni, [0, nw], [0, lr0*lf(epoch)])``, momentum ``interp(.., [warmup_momentum,
      momentum])``, accumulate ``max(1, round_half_even(interp(.., [1, nominal_accumulate])))``;
    * afterwards: lr ``lr0*lf(epoch)`` for every group, momentum ``momentum``, accumulate
      ``nominal_accumulate``.

    Args:
      lr0: initial learning rate (``lr0``; 0.01 for SGD).
      lrf: final LR factor (``lrf``).
      epochs: E.
      batches_per_epoch: nb (``len(loader)``).
      warmup_epochs, warmup_bias_lr, warmup_momentum, momentum: as the reference's ``default.yaml``.
      cos_lr: cosine instead of linear ``lf``.
      nominal_accumulate: ``max(round(nbs / batch), 1)`` (4 for batch 16, nbs 64).

    Returns:
      :class:`YoloSchedules`; each schedule maps ``ni: int64[]`` (device) to a device tensor.

    >>> import torch
    >>> s = yolo_schedules(0.01, 0.01, epochs=10, batches_per_epoch=100)
    >>> ni = torch.tensor(0)
    >>> [round(float(s.lr["bias"](ni)), 6), float(s.lr["decay"](ni)), int(s.accumulate(ni))]
    [0.1, 0.0, 1]
    """
    _check_epochs(epochs)
    if isinstance(batches_per_epoch, bool) or not isinstance(batches_per_epoch, int) or batches_per_epoch <= 0:
        raise ValueError(f"[yolo_func] batches_per_epoch must be a positive int, got {batches_per_epoch!r}")
    if isinstance(nominal_accumulate, bool) or not isinstance(nominal_accumulate, int) or nominal_accumulate < 1:
        raise ValueError(f"[yolo_func] nominal_accumulate must be an int >= 1, got {nominal_accumulate!r}")
    nb = batches_per_epoch
    nw = warmup_iterations(warmup_epochs, epochs, nb)
    lf = cosine_lf(lrf, epochs) if cos_lr else linear_lf(lrf, epochs)
    lr0, warmup_bias_lr = float(lr0), float(warmup_bias_lr)
    warmup_momentum, momentum = float(warmup_momentum), float(momentum)

    # memoized: inside one update (share_schedules) the groups' lr and momentum reads and the
    # target shared by the lr schedules are evaluated once each
    @memoized
    def target(ni: torch.Tensor) -> torch.Tensor:
        epoch = torch.div(ni, nb, rounding_mode="floor")
        return lr0 * lf(epoch)

    def make_lr(start: float) -> Schedule:
        @memoized
        def lr(ni: torch.Tensor) -> torch.Tensor:
            tgt = target(ni)
            return torch.where(ni <= nw, interp_warmup(ni, nw, start, tgt), tgt)

        return lr

    @memoized
    def momentum_fn(ni: torch.Tensor) -> torch.Tensor:
        m = torch.full((), momentum, dtype=_F64, device=ni.device)
        return torch.where(ni <= nw, interp_warmup(ni, nw, warmup_momentum, momentum), m)

    @memoized
    def accumulate_fn(ni: torch.Tensor) -> torch.Tensor:
        warm = torch.clamp(torch.round(interp_warmup(ni, nw, 1.0, float(nominal_accumulate))), min=1.0)
        nominal = torch.full((), nominal_accumulate, dtype=torch.int64, device=ni.device)
        return torch.where(ni <= nw, warm.to(torch.int64), nominal)

    weights_lr = make_lr(0.0)
    return YoloSchedules(
        lr={"decay": weights_lr, "no_decay": weights_lr, "bias": make_lr(warmup_bias_lr)},
        momentum=momentum_fn,
        accumulate=accumulate_fn,
        lf=lf,
        warmup_iters=nw,
    )
