"""Model EMA over parameters and BN statistics as a pure transform (REFERENCE.md §4.4, trap T16).

``d(u) = decay * (1 - exp(-u / tau))`` with ``u`` the number of EMA updates *including* the
current one, and ``ema <- lerp(ema, model, 1 - d)`` (i.e. ``ema + (1 - d)(model - ema)``) for every
floating-point leaf. ``torch.lerp`` is the operation the reference's EMA matches bit for bit (checked
against it as a black box); ``d`` is computed in float64 as the reference does in Python. The count
and the decay live on the device; an optional ``stepped`` flag (the training step passes
:class:`yolo_func.optim.ApplyIfFiniteState`'s, false on accumulating micro-steps and on skipped
non-finite ones) makes the update a no-op on those calls without a host branch. On the CPU in
eager mode the lerp is one ``_foreach_lerp`` over the leaves (the same bits as the flat-buffer
lerp).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from yolo_func import tree as T
from yolo_func.optim import flat
from yolo_func.optim.base import _reject_unknown, _zero_count, host_flag, host_readable

__all__ = ["EmaState", "Ema", "ema", "ema_decay"]


class EmaState(NamedTuple):
    """State of :func:`ema`.

    Attributes:
      count: int64[] EMA updates so far (the reference's ``updates``).
      ema: the averaged tree (same structure as the model tree it was built from).

    Example:
      >>> import torch
      >>> from yolo_func import optim
      >>> p = {"w": torch.ones(2)}
      >>> s = optim.ema().init(p)
      >>> int(s.count), s.ema["w"]
      (0, tensor([1., 1.]))
    """

    count: torch.Tensor
    ema: Any


class Ema(NamedTuple):
    """A pure EMA transform.

    Attributes:
      init: ``(model) -> EmaState``; the EMA starts as a copy of the model.
      update: ``(model, state, stepped=None) -> EmaState``; ``stepped`` is a bool[] device flag.

    Example:
      >>> import torch
      >>> from yolo_func import optim
      >>> p = {"w": torch.ones(2)}
      >>> e = optim.ema(decay=0.5, tau=1e-9)        # an Ema(init, update) pair
      >>> s = e.init(p)
      >>> s = e.update({"w": torch.full((2,), 3.0)}, s)
      >>> s.ema["w"]                                 # 0.5 * 1 + 0.5 * 3
      tensor([2., 2.])
    """

    init: Callable[[Any], EmaState]
    update: Callable[..., EmaState]


def ema_decay(count: torch.Tensor | int, decay: float = 0.9999, tau: float = 2000.0) -> torch.Tensor:
    """``d(u) = decay * (1 - exp(-u / tau))`` in float64.

    Args:
      count: u, int64[] tensor or int (updates including the current one).
      decay, tau: the reference's 0.9999 and 2000.

    Returns:
      float64[] on the count's device: d(1) = 4.998e-4, d(2000) = 0.632057, d(10000) = 0.993163.

    Example:
      >>> from yolo_func.optim import ema_decay
      >>> round(float(ema_decay(0)), 4), round(float(ema_decay(2000)), 4), round(float(ema_decay(10 ** 6)), 4)
      (0.0, 0.6321, 0.9999)
    """
    u = count.to(torch.float64) if isinstance(count, torch.Tensor) else torch.tensor(float(count), dtype=torch.float64)
    return decay * (1 - torch.exp(-u / tau))


def ema(decay: float = 0.9999, tau: float = 2000.0) -> Ema:
    """Model EMA (the reference's ``ModelEMA``) as ``Ema(init, update)``.

    Pass the tree to average, typically ``{"params": params, "state": model_state}`` so BN running
    statistics are averaged too. Non-floating leaves keep the EMA's own value.

    Args:
      decay: asymptotic decay (0.9999).
      tau: ramp time constant in updates (2000).

    Returns:
      :class:`Ema`. ``update(model, state, stepped=None)`` returns a new :class:`EmaState`; with a
      ``stepped`` flag the count advances and the average moves only when it is true.

    >>> import torch
    >>> e = ema()
    >>> s = e.init({"w": torch.zeros(1)})
    >>> s = e.update({"w": torch.ones(1)}, s)
    >>> round(s.ema["w"].item(), 6), int(s.count)
    (0.9995, 1)
    """
    decay, tau = float(decay), float(tau)

    def init(model: Any) -> EmaState:
        return EmaState(count=_zero_count(model), ema=T.tree_clone_flat(model))  # one flat buffer per dtype

    def update(model: Any, state: EmaState, stepped: torch.Tensor | None = None, **unknown) -> EmaState:
        _reject_unknown("ema", unknown, ("stepped",))
        if stepped is not None and host_flag(stepped) is False:
            # Read on the host (CPU, eager): no step, so the average stays as it is (the device
            # form's lerp with weight 0 has the same values) and the count does not advance.
            return EmaState(count=state.count + stepped, ema=state.ema)
        e_leaves, treedef = T.tree_flatten(state.ema)
        m_leaves, m_def = T.tree_flatten(model)
        if m_def != treedef:
            raise ValueError(
                "[yolo_func] ema.update: the model tree differs from the EMA's:\n"
                + T.tree_diff(state.ema, model, names=("ema", "model"))
            )
        if stepped is None:
            count = state.count + 1
            w = 1 - ema_decay(count, decay, tau)
        else:
            count = state.count + stepped  # an integer count plus a bool: the count's dtype, no cast kernel
            # Weight 0 on non-stepping calls: lerp(e, m, 0) == e exactly.
            w = torch.where(stepped, 1 - ema_decay(count, decay, tau), torch.zeros((), dtype=torch.float64, device=count.device))
        idx = [i for i, x in enumerate(e_leaves) if x.is_floating_point()]
        out = list(e_leaves)
        if idx:
            ef = [e_leaves[i] for i in idx]
            mf = [m_leaves[i] for i in idx]  # read under no_grad below: no per-leaf detach
            if all(x.device.type == "cpu" for x in ef) and host_readable(w):
                # CPU, eager: one fused lerp over the leaves (no gathering copy of the model into a
                # buffer, no views of a result buffer). The same bits: the same 0-dim weight in the
                # leaves' dtype, and each element goes through the same lerp kernel, per leaf or in
                # one buffer.
                lerped = _lerp_by_dtype(ef, mf, w)
            else:
                with torch.no_grad():  # one lerp per flat (dtype, device) group, not one per leaf
                    lerped = flat.leafwise(
                        lambda e, m: torch.lerp(e, m, w.to(dtype=e.dtype, device=e.device)), ef, mf,
                        fn_out=lambda e, m, out: torch.lerp(e, m, w.to(dtype=e.dtype, device=e.device), out=out))
            for i, x in zip(idx, lerped):
                out[i] = x
        return EmaState(count=count, ema=T.tree_unflatten(treedef, out))

    return Ema(init, update)


def _lerp_by_dtype(ef: list[torch.Tensor], mf: list[torch.Tensor], w: torch.Tensor) -> list[torch.Tensor]:
    """``[lerp(e, m, w.to(e.dtype)) for e, m]`` with one ``_foreach_lerp`` per dtype (CPU leaves,
    ``w`` a CPU float64[])."""
    out: list = [None] * len(ef)
    groups: dict = {}
    for i, x in enumerate(ef):
        groups.setdefault(x.dtype, []).append(i)
    with torch.no_grad():
        for dtype, idx in groups.items():
            res = torch._foreach_lerp([ef[i] for i in idx], [mf[i] for i in idx], w.to(dtype))
            for i, x in zip(idx, res):
                out[i] = x
    return out
