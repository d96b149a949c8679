"""Gradient accumulation (:func:`multi_steps`) with a device-side, time-varying accumulation count.

The reference (REFERENCE.md §4.3, trap T12) sums the gradients of consecutive micro-batches in
``.grad`` and steps the optimizer at iteration ``ni`` when ``ni - last_step >= accumulate``, where
``accumulate`` ramps from 1 to ``nbs/batch`` during warmup. :func:`multi_steps` does the same as a
pure transform: every call adds the micro-batch gradient into its own buffers, runs the inner
transform on the sum, and keeps its result only when the call steps, selected on the device (no
host branch), so the whole thing can sit inside a captured training step. On a plain CPU tensor in
eager mode the ``stepped`` flag is read on the host (:func:`yolo_func.optim.base.host_flag`): a
stepping call skips the ``x * 1`` passes and keeps the inner state whole, and an accumulating call
does not run the inner transform at all (its results would all be selected away), which is what
the reference does between its optimizer steps. The host path selects exactly (``torch.where``);
the device form's arithmetic select has the same values (it can differ only in the sign of a zero
and where the discarded branch holds a NaN or an infinity).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Union

import torch

from yolo_func import tree as T
from yolo_func.optim.base import GradientTransformation, Updates, _reject_unknown, _select, _zero_count, host_flag

__all__ = ["MultiStepsState", "multi_steps", "scaled_weight_decay", "nominal_accumulate"]

Every = Union[int, torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]


class MultiStepsState(NamedTuple):
    """State of :func:`multi_steps`.

    Attributes:
      count: int64[] calls so far: the global iteration ``ni`` of the next call when the caller
        passes no ``iteration`` (the reference's ``ni`` in standalone use). Under
        :func:`yolo_func.optim.apply_if_finite` (the training step), which passes ``iteration`` and
        restores this whole state on a skipped call, it counts the applied calls.
      last_step: int64[] ``ni`` of the last optimizer step (-1 before the first).
      stepped: bool[] whether the latest call stepped (for the EMA and metrics).
      acc_grads: summed gradients since the last step (own buffers, same tree as params).
      inner_state: the wrapped transform's state (advances only on stepping calls).

    Example:
      >>> import torch
      >>> from yolo_func import optim
      >>> p = {"w": torch.ones(2)}
      >>> tx = optim.multi_steps(optim.sgd(0.1), every=2)
      >>> s = tx.init(p)
      >>> _, s = tx.update({"w": torch.ones(2)}, s, p)
      >>> int(s.count), bool(s.stepped), s.acc_grads["w"]      # the first micro-batch is only accumulated
      (1, False, tensor([1., 1.]))
    """

    count: torch.Tensor
    last_step: torch.Tensor
    stepped: torch.Tensor
    acc_grads: Any
    inner_state: Any


def multi_steps(tx: GradientTransformation, every: Every) -> GradientTransformation:
    """Accumulate (sum) gradients and apply ``tx`` once every ``every`` micro-steps.

    At call ``ni`` (0-based): ``acc += grads``; ``stepped = ni - last_step >= every(ni)``; when
    stepped, ``updates = tx.update(acc, ...)`` and ``acc = 0``, ``last_step = ni``; otherwise the
    updates are zeros and the inner state is unchanged. The inner transform always runs (static
    shapes, no host branch) and its results are selected with the device flag. ``ni`` is the
    ``iteration`` keyword when the caller passes one, else the state's ``count``; schedules inside
    ``tx`` (and ``every``) are evaluated at ``ni``. ``update`` accepts no other keyword; skipping a
    non-finite micro-batch is :func:`yolo_func.optim.apply_if_finite`'s job (wrapped around this
    transform by the training step: a skipped call then leaves this state untouched while ``ni``,
    passed from outside, still advances, as the reference's loop index does).

    Args:
      tx: the optimizer to wrap (e.g. ``chain(clip_by_global_norm(10.0), partition(...))``).
      every: accumulation count: an int >= 1, an int tensor [], or a callable ``ni -> int64[]``
        (e.g. :attr:`YoloSchedules.accumulate`).

    Returns:
      A :class:`GradientTransformation` with :class:`MultiStepsState`.

    >>> import torch
    >>> from yolo_func.optim import sgd
    >>> tx = multi_steps(sgd(1.0), every=2)
    >>> p = {"w": torch.zeros(1)}
    >>> s = tx.init(p)
    >>> u, s = tx.update({"w": torch.ones(1)}, s, p)
    >>> u["w"].abs().item(), bool(s.stepped)
    (0.0, False)
    >>> u, s = tx.update({"w": torch.ones(1)}, s, p)
    >>> u["w"].item(), bool(s.stepped)
    (-2.0, True)
    """
    if not isinstance(tx, GradientTransformation):
        raise TypeError(f"[yolo_func] multi_steps(tx) must be a GradientTransformation, got {type(tx).__name__}")
    if isinstance(every, bool) or not (isinstance(every, (int, torch.Tensor)) or callable(every)):
        raise TypeError(f"[yolo_func] multi_steps(every) must be an int, an int64[] tensor or a callable, got {type(every).__name__}")
    if isinstance(every, int) and every < 1:
        raise ValueError(f"[yolo_func] multi_steps(every) must be >= 1, got {every}")

    def every_at(ni: torch.Tensor) -> torch.Tensor:
        if callable(every) and not isinstance(every, torch.Tensor):
            k = every(ni)
        else:
            k = every
        if isinstance(k, torch.Tensor):
            return k.to(ni.device)
        # A fill kernel, not a host-to-device copy (copies are not allowed under graph capture).
        return torch.full((), int(k), dtype=torch.int64, device=ni.device)

    def init(params: Any) -> MultiStepsState:
        count = _zero_count(params)
        return MultiStepsState(
            count=count,
            last_step=count - 1,
            stepped=torch.zeros((), dtype=torch.bool, device=count.device),
            acc_grads=T.tree_zeros_like(params),
            inner_state=tx.init(params),
        )

    def update(updates: Updates, state: MultiStepsState, params: Any = None, *, iteration=None,
               **unknown) -> tuple[Updates, MultiStepsState]:
        _reject_unknown("multi_steps", unknown)
        ni = state.count if iteration is None else iteration
        g, treedef = T.tree_flatten(updates)
        acc_old, acc_def = T.tree_flatten(state.acc_grads)
        if acc_def != treedef:
            raise ValueError(
                "[yolo_func] multi_steps: gradients do not match the accumulation buffers:\n"
                + T.tree_diff(state.acc_grads, updates, names=("state", "grads"))
            )
        # Fresh tensors: the caller's gradient buffers are never aliased or written.
        acc = torch._foreach_add(acc_old, g) if g else []
        stepped = (ni - state.last_step) >= every_at(ni)
        known = host_flag(stepped)  # True / False on the CPU (a free read), None on a GPU
        if known is False:
            # Accumulating, read on the host (CPU, eager): the inner transform's results would all
            # be selected away, so it does not run. Its state stays as it is and the updates are
            # zeros (what where(stepped, u, 0) gives; the device form's u * 0 has the same values).
            inner_state = state.inner_state
            updates = T.tree_zeros_like(updates)  # shaped, typed and placed like the gradients
        else:
            inner_u, inner_new = tx.update(T.tree_unflatten(treedef, acc), state.inner_state, params, iteration=ni)
            u_leaves, u_def = T.tree_flatten(inner_u)
            if u_leaves and known is None:
                # An exact copy when stepping (x*1), zeros otherwise (x*0), fused over the tree.
                u_leaves = torch._foreach_mul(u_leaves, stepped.to(u_leaves[0].dtype))
            old_s, s_def = T.tree_flatten(state.inner_state)
            new_s, new_def = T.tree_flatten(inner_new)
            if s_def != new_def:
                raise ValueError("[yolo_func] multi_steps: the inner transform changed its state structure between calls")
            inner_state = T.tree_unflatten(s_def, _select(stepped, new_s, old_s))
            updates = T.tree_unflatten(u_def, u_leaves)
            if acc:
                # Reset the sum after a step (last: the inner results above may read these buffers):
                # zeros when the CPU read says stepping, acc * (1 - stepped) on a GPU.
                if known:
                    torch._foreach_zero_(acc)
                else:
                    torch._foreach_mul_(acc, (~stepped).to(acc[0].dtype))
        new_state = MultiStepsState(
            count=state.count + 1,
            last_step=torch.where(stepped, ni, state.last_step),
            stepped=stepped,
            acc_grads=T.tree_unflatten(treedef, acc),
            inner_state=inner_state,
        )
        return updates, new_state

    return GradientTransformation(init, update)


def nominal_accumulate(batch_size: int, nbs: int = 64) -> int:
    """``max(round(nbs / batch_size), 1)`` (REFERENCE.md §4.3; 4 for batch 16).

    Example:
      >>> from yolo_func.optim import nominal_accumulate
      >>> nominal_accumulate(16), nominal_accumulate(4), nominal_accumulate(128)
      (4, 16, 1)
    """
    return max(round(nbs / batch_size), 1)


def scaled_weight_decay(weight_decay: float = 5e-4, batch_size: int = 16, accumulate: int = 4, nbs: int = 64) -> float:
    """The reference's effective decay ``weight_decay * batch_size * accumulate / nbs``.

    Accumulated gradients are summed (trap T12), so the coupled decay is scaled to match; the
    reference computes it once from the nominal accumulation (host float, Python's operation order).

    Returns:
      A float (5e-4 for the defaults).

    Example:
      >>> from yolo_func.optim import scaled_weight_decay
      >>> scaled_weight_decay(0.0005, batch_size=16, accumulate=4, nbs=64)
      0.0005
    """
    return weight_decay * batch_size * accumulate / nbs
