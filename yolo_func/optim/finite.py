"""Skip non-finite updates on the device: :func:`apply_if_finite` (optax's ``apply_if_finite``).

The wrapper owns the non-finite policy of the optimizer: it decides whether a call is applied
(its own check of the gradients, AND-ed with the caller's veto), selects the inner state (new or
old) and the updates (the inner's or zeros) with ``torch.where`` on the device, and keeps counters in its state. Static
shapes, no host branch, no ``.item()``: it runs inside a captured training step. (On a plain CPU
tensor in eager mode the selects read the flag on the host instead — there is no device to wait
for — and return the chosen tree whole, :func:`yolo_func.optim.base.host_flag`.)

On a skipped call nothing of the inner transform moves: every leaf of its state — momenta, Adam
moments and step counts, accumulation buffers, ``multi_steps``' counters — is returned bitwise
as it was, and the updates are zeros, so ``apply_updates`` leaves the params bitwise unchanged.
The only trace of the call is in :class:`ApplyIfFiniteState`: ``count`` advances (it is the
iteration ``ni`` the inner schedules and :func:`yolo_func.optim.multi_steps` read, which counts
every micro-batch as the reference's loop index ``ni = i + nb*epoch`` does) and the non-finite
counters record it.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from yolo_func import tree as T
from yolo_func.optim import flat
from yolo_func.optim.base import GradientTransformation, Updates, _reject_unknown, _zero_count, finite_scalar
from yolo_func.optim.transforms import global_norm

__all__ = ["ApplyIfFiniteState", "apply_if_finite"]


class ApplyIfFiniteState(NamedTuple):
    """State of :func:`apply_if_finite`.

    Attributes:
      count: int64[] calls so far, applied or skipped: the ``iteration`` passed to the inner
        transform when the caller passes none (schedules and ``multi_steps`` read it as the global
        micro-batch index ``ni``, so a skipped micro-batch still advances them by one, as in the
        reference, without touching any inner state).
      notfinite_count: int64[] consecutive skipped calls up to the latest: 0 exactly when the latest
        call was applied (its gradients finite and not vetoed by the caller; optax's
        ``last_finite`` is ``notfinite_count == 0``). A training loop can stop when it grows.
      total_notfinite_count: int64[] skipped calls since init.
      stepped: bool[] whether the latest call changed the params: applied, and, when the inner
        state has a ``stepped`` flag (:func:`yolo_func.optim.multi_steps`), that flag (false on
        accumulating micro-steps). The EMA moves only when it is true.
      inner_state: the wrapped transform's state, as of the latest applied call (its own
        ``stepped`` field, if any, is the latest *applied* call's).

    Example:
      >>> import torch
      >>> from yolo_func import optim
      >>> p = {"w": torch.ones(2)}
      >>> s = optim.apply_if_finite(optim.sgd(0.1)).init(p)
      >>> type(s).__name__, int(s.count), int(s.notfinite_count), bool(s.stepped)
      ('ApplyIfFiniteState', 0, 0, True)
    """

    count: torch.Tensor
    notfinite_count: torch.Tensor
    total_notfinite_count: torch.Tensor
    stepped: torch.Tensor
    inner_state: Any


def apply_if_finite(inner: GradientTransformation, *, enabled: bool = True) -> GradientTransformation:
    """Apply ``inner`` only on calls whose gradients are finite and that the caller does not veto.

    ``update(grads, state, params=None, *, finite=None, iteration=None, grad_norm=None)``: the call is applied
    when ``global_norm(grads)`` is finite (every gradient finite, and the sum of their squares
    does not overflow) and ``finite`` (a device ``bool[]``, e.g. the training step's check of the
    summed loss) is true or None. The inner transform always runs (static shapes) on the
    gradients as they are (a skipped call's non-finite values reach only results that are then
    discarded), and receives ``iteration`` (or the state's ``count``). Then, selected by the applied flag with ``torch.where`` (exact, and NaN in the
    unchosen side never leaks): the updates are the inner's or zeros, the inner state the new one
    or the old one. On an applied call the updates and inner state are bitwise the inner's own.

    Unlike optax's ``max_consecutive_errors``, a skipped call is never applied later: a non-finite
    update would overwrite every parameter with NaN. ``notfinite_count`` tells a loop when to stop.

    Args:
      inner: the optimizer to guard (``sgd``, ``adamw``, ``multi_steps(...)``, any transform whose
        ``update`` accepts ``iteration``).
      enabled: False turns the guard off (the training step's ``skip_nonfinite=False``): nothing
        is checked, zeroed or selected (the inner's results pass through), ``stepped`` is the
        inner's flag (or true), and the non-finite counters record only the caller's ``finite``. The
        state has the same structure either way.

    Returns:
      A :class:`GradientTransformation` with :class:`ApplyIfFiniteState`. ``update`` accepts the
      keywords ``finite``, ``iteration`` and ``grad_norm`` (the caller's ``global_norm(grads)``,
      float[] on the device, when it has computed it already: the check then reuses it instead of
      a second pass over the gradients) and raises ``TypeError`` on any other.

    Raises:
      TypeError: ``inner`` is not a :class:`GradientTransformation`.

    >>> import torch
    >>> from yolo_func.optim import sgd
    >>> tx = apply_if_finite(sgd(0.1, momentum=0.9))
    >>> p = {"w": torch.ones(2)}
    >>> s = tx.init(p)
    >>> u, s = tx.update({"w": torch.tensor([1.0, float("nan")])}, s, p)
    >>> u["w"].tolist(), int(s.notfinite_count), bool(s.stepped), int(s.count)
    ([0.0, 0.0], 1, False, 1)
    >>> u, s = tx.update({"w": torch.ones(2)}, s, p, finite=torch.tensor(True))
    >>> [round(x, 6) for x in u["w"].tolist()], int(s.notfinite_count), int(s.total_notfinite_count)
    ([-0.1, -0.1], 0, 1)
    """
    if not isinstance(inner, GradientTransformation):
        raise TypeError(
            f"[yolo_func] apply_if_finite(inner) must be a GradientTransformation (e.g. sgd(0.01)), "
            f"got {type(inner).__name__}"
        )
    enabled = bool(enabled)

    def init(params: Any) -> ApplyIfFiniteState:
        count = _zero_count(params)
        return ApplyIfFiniteState(count=count, notfinite_count=count.clone(), total_notfinite_count=count.clone(),
                                  stepped=torch.ones((), dtype=torch.bool, device=count.device),
                                  inner_state=T.tree_clone_flat(inner.init(params)))

    def update(updates: Updates, state: ApplyIfFiniteState, params: Any = None, *, finite: torch.Tensor | None = None,
               iteration: torch.Tensor | None = None, grad_norm: torch.Tensor | None = None,
               **unknown) -> tuple[Updates, ApplyIfFiniteState]:
        _reject_unknown("apply_if_finite", unknown, ("finite", "iteration", "grad_norm"))
        if not isinstance(state, ApplyIfFiniteState):
            raise TypeError(
                f"[yolo_func] apply_if_finite.update needs the ApplyIfFiniteState made by its init, got "
                f"{type(state).__name__}; build the state with apply_if_finite(tx).init(params) (the training "
                "step's init_train_state does)"
            )
        device = state.count.device
        if finite is not None and (not isinstance(finite, torch.Tensor) or finite.dtype != torch.bool or finite.dim()):
            raise TypeError(
                f"[yolo_func] apply_if_finite.update(finite=) must be a bool[] tensor (0-dim) on the device or None, "
                f"got {finite.dtype if isinstance(finite, torch.Tensor) else type(finite).__name__}"
                f"{list(finite.shape) if isinstance(finite, torch.Tensor) else ''}; e.g. torch.isfinite(loss)"
            )
        it = state.count if iteration is None else iteration
        if enabled:
            norm = global_norm(updates) if grad_norm is None else grad_norm
            applied = finite_scalar(norm).to(device)
            if finite is not None:
                applied = applied & finite.to(device)
        else:
            applied = torch.ones((), dtype=torch.bool, device=device) if finite is None else finite.to(device)
        # The gradients go in as they are: on a skipped call whatever the inner computes from them
        # (NaN included) is replaced below by the old state and zero updates, so zeroing them first
        # would change nothing but cost a model-sized select (and a view per leaf).
        new_u, new_inner = inner.update(updates, state.inner_state, params, iteration=it)
        inner_stepped = getattr(new_inner, "stepped", None)  # a state type's field: a host-side constant
        if enabled:
            new_u = flat.tree_where(applied, new_u, 0.0)
            new_inner = flat.tree_where(applied, new_inner, state.inner_state)
            stepped = applied.clone() if inner_stepped is None else applied & inner_stepped.to(device)
        else:
            stepped = torch.ones((), dtype=torch.bool, device=device) if inner_stepped is None else inner_stepped.clone()
        skipped = (~applied).to(state.notfinite_count.dtype)
        new_state = ApplyIfFiniteState(
            count=state.count + 1,
            notfinite_count=(state.notfinite_count + 1) * skipped,
            total_notfinite_count=state.total_notfinite_count + skipped,
            stepped=stepped,
            inner_state=new_inner,
        )
        return new_u, new_state

    return GradientTransformation(init, update)
