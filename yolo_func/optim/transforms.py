"""Elementary gradient transformations (optax-shaped), each fused over the whole tree.

Numerics follow torch.optim's foreach implementations operation by operation, so that
``sgd``/``adamw`` (:mod:`yolo_func.optim.alias`) track ``torch.optim.SGD``/``AdamW``:

* :func:`add_decayed_weights` is torch SGD's coupled L2 term ``g + wd*p`` (the same fused
  ``_foreach_add(g, p, alpha=wd)``), applied *before* momentum.
* :func:`trace` is torch SGD's momentum buffer: ``buf = mu*buf + g`` with ``buf = g`` on the first
  step (dampening 0). The buffer starts at zero, and ``mu*0 + g`` is exactly ``g``, so no branch on
  the step is needed.
* :func:`scale_by_adam` / :func:`scale_by_adamw` reproduce torch's ``_multi_tensor_adam``
  (non-capturable path): ``lerp`` for the first moment, ``mul``+``addcmul`` for the second,
  ``sqrt(v)/sqrt(bc2) + eps`` for the denominator and ``(step_size*m)/denom`` with
  ``step_size = -lr/bc1``, the bias corrections computed in float64 as torch does on the host.
* :func:`clip_by_global_norm` is ``torch.nn.utils.clip_grad_norm_`` (per-leaf L2 norms, the norm of
  their stack, ``coef = clamp(max_norm/(norm + 1e-6), max=1)``).

All transforms are pure (see :mod:`yolo_func.optim.base`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from yolo_func import tree as T
from yolo_func.optim.base import (
    EmptyState,
    GradientTransformation,
    ScalarOrSchedule,
    Schedule,
    Updates,
    _as_leaf_scalar,
    _check_scalar,
    _device_of,
    _eval64,
    _is_schedule,
    _memo_value,
    _reject_unknown,
    _step_for,
    _zero_count,
)

__all__ = [
    "TraceState",
    "ScaleByScheduleState",
    "ScaleByAdamState",
    "ClipByGlobalNormState",
    "trace",
    "add_decayed_weights",
    "scale",
    "scale_by_learning_rate",
    "scale_by_schedule",
    "scale_by_adam",
    "scale_by_adamw",
    "clip_by_global_norm",
    "global_norm",
]


class TraceState(NamedTuple):
    """State of :func:`trace`.

    Attributes:
      count: int64[] updates so far.
      momentum: the momentum buffers, same tree as params (zeros before the first step).

    Example:
      >>> import torch
      >>> from yolo_func import optim
      >>> p = {"w": torch.ones(2)}
      >>> tx = optim.trace(decay=0.9)
      >>> _, s = tx.update({"w": torch.ones(2)}, tx.init(p))
      >>> int(s.count), s.momentum["w"]
      (1, tensor([1., 1.]))
    """

    count: torch.Tensor
    momentum: Any


class ScaleByScheduleState(NamedTuple):
    """State of :func:`scale_by_schedule` / scheduled :func:`scale_by_learning_rate`.

    Attributes:
      count: int64[] updates so far.

    Example:
      >>> import torch
      >>> from yolo_func import optim
      >>> p = {"w": torch.ones(2)}
      >>> tx = optim.scale_by_schedule(lambda step: 1.0 / (step + 1))
      >>> _, s = tx.update({"w": torch.ones(2)}, tx.init(p))
      >>> int(s.count)
      1
    """

    count: torch.Tensor


class ScaleByAdamState(NamedTuple):
    """State of :func:`scale_by_adam` / :func:`scale_by_adamw`.

    Attributes:
      count: int64[] updates so far (torch's ``state["step"]`` before the increment).
      mu: first moments (torch ``exp_avg``), same tree as params.
      nu: second moments (torch ``exp_avg_sq``), same tree as params.

    Example:
      >>> import torch
      >>> from yolo_func import optim
      >>> p = {"w": torch.ones(2)}
      >>> s = optim.scale_by_adam().init(p)
      >>> int(s.count), s.mu["w"], s.nu["w"]
      (0, tensor([0., 0.]), tensor([0., 0.]))
    """

    count: torch.Tensor
    mu: Any
    nu: Any


class ClipByGlobalNormState(NamedTuple):
    """State of :func:`clip_by_global_norm`.

    Attributes:
      norm: float[] the total gradient norm seen by the last update (before clipping); a free
        metric for the training loop (stays on the device).

    Example:
      >>> import torch
      >>> from yolo_func import optim
      >>> p = {"w": torch.ones(2)}
      >>> tx = optim.clip_by_global_norm(1.0)
      >>> _, s = tx.update({"w": torch.tensor([3.0, 4.0])}, tx.init(p), p)
      >>> s.norm                                    # the norm before clipping, float32[]
      tensor(5.)
    """

    norm: torch.Tensor


def _flat(tree: Any) -> tuple[list[torch.Tensor], Any]:
    return T.tree_flatten(tree)


def _need_params(fn: str, params: Any) -> None:
    if params is None:
        raise ValueError(f"[yolo_func] {fn} needs params: call tx.update(grads, state, params)")


def trace(decay: ScalarOrSchedule, nesterov: bool = False) -> GradientTransformation:
    """Momentum with torch.optim.SGD semantics (dampening 0).

    ``buf <- decay*buf + g`` (``buf = g`` on the first step); returns ``buf``, or
    ``g + decay*buf`` with ``nesterov=True``.

    Args:
      decay: momentum coefficient (torch's ``momentum``), a float or a schedule of the step.
      nesterov: Nesterov momentum.

    Returns:
      A :class:`GradientTransformation` with :class:`TraceState`.

    >>> import torch
    >>> tx = trace(0.9)
    >>> s = tx.init({"w": torch.zeros(1)})
    >>> u, s = tx.update({"w": torch.ones(1)}, s)
    >>> u, s = tx.update({"w": torch.ones(1)}, s)
    >>> round(u["w"].item(), 4)
    1.9
    """
    _check_scalar("trace(decay)", decay)

    def init(params: Any) -> TraceState:
        return TraceState(count=_zero_count(params), momentum=T.tree_zeros_like(params))

    def update(updates: Updates, state: TraceState, params: Any = None, *, iteration=None,
               **unknown) -> tuple[Updates, TraceState]:
        del params
        _reject_unknown("trace", unknown)
        g, treedef = _flat(updates)
        if not g:
            return updates, TraceState(state.count + 1, state.momentum)
        mu = _as_leaf_scalar(_eval64(decay, _step_for(state.count, iteration)), g)
        bufs = torch._foreach_mul(T.tree_leaves(state.momentum), mu)
        # alpha=1 (torch's 1 - dampening): an exact add; on the first step 0*mu + g == g.
        torch._foreach_add_(bufs, g)
        if nesterov:
            if isinstance(mu, float):
                out = torch._foreach_add(g, bufs, alpha=mu)  # torch's fused g + mu*buf
            else:
                out = torch._foreach_mul(bufs, mu)
                torch._foreach_add_(out, g)
        else:
            out = bufs
        new_state = TraceState(state.count + 1, T.tree_unflatten(treedef, bufs))
        return T.tree_unflatten(treedef, out), new_state

    return GradientTransformation(init, update)


def add_decayed_weights(weight_decay: float) -> GradientTransformation:
    """Coupled L2 decay: ``u + weight_decay * params`` (torch SGD's ``weight_decay``).

    Place it before :func:`trace` to reproduce torch SGD (decay joins the gradient before momentum).

    Args:
      weight_decay: a float >= 0 (0 makes this the identity).

    Returns:
      A stateless :class:`GradientTransformation`; ``update`` requires ``params``.

    Example:
      >>> import torch
      >>> from yolo_func import optim
      >>> p = {"w": torch.ones(2)}
      >>> tx = optim.add_decayed_weights(0.5)
      >>> u, _ = tx.update({"w": torch.zeros(2)}, tx.init(p), p)
      >>> u["w"]                                      # g + 0.5 * params
      tensor([0.5000, 0.5000])
    """
    if isinstance(weight_decay, bool) or not isinstance(weight_decay, (int, float)):
        raise TypeError(f"[yolo_func] add_decayed_weights(weight_decay) must be a float, got {type(weight_decay).__name__}")
    weight_decay = float(weight_decay)

    def init(params: Any) -> EmptyState:
        del params
        return EmptyState()

    def update(updates: Updates, state: EmptyState, params: Any = None, *, iteration=None,
               **unknown) -> tuple[Updates, EmptyState]:
        del iteration
        _reject_unknown("add_decayed_weights", unknown)
        if weight_decay == 0.0:
            return updates, state
        _need_params("add_decayed_weights", params)
        u, treedef = _flat(updates)
        if not u:
            return updates, state
        return T.tree_unflatten(treedef, torch._foreach_add(u, T.tree_leaves(params), alpha=weight_decay)), state

    return GradientTransformation(init, update)


def scale(factor: float) -> GradientTransformation:
    """Multiply updates by a constant float.

    Returns:
      A stateless :class:`GradientTransformation`.

    Example:
      >>> import torch
      >>> from yolo_func import optim
      >>> p = {"w": torch.ones(2)}
      >>> tx = optim.scale(-2.0)
      >>> tx.update({"w": torch.ones(2)}, tx.init(p))[0]["w"]
      tensor([-2., -2.])
    """
    return _scale(factor, "scale")


def _scale(factor: float, name: str) -> GradientTransformation:
    factor = float(factor)

    def init(params: Any) -> EmptyState:
        del params
        return EmptyState()

    def update(updates: Updates, state: EmptyState, params: Any = None, *, iteration=None,
               **unknown) -> tuple[Updates, EmptyState]:
        del params, iteration
        _reject_unknown(name, unknown)
        u, treedef = _flat(updates)
        return (T.tree_unflatten(treedef, torch._foreach_mul(u, factor)) if u else updates), state

    return GradientTransformation(init, update)


def scale_by_schedule(schedule: Schedule) -> GradientTransformation:
    """Multiply updates by ``schedule(step)`` (a device scalar; no host sync).

    Args:
      schedule: ``(int64[] step) -> float[]``; evaluated at ``iteration=`` if passed to ``update``,
        else at the count of updates so far.

    Returns:
      A :class:`GradientTransformation` with :class:`ScaleByScheduleState`.

    Example:
      >>> import torch
      >>> from yolo_func import optim
      >>> p = {"w": torch.ones(2)}
      >>> tx = optim.scale_by_schedule(lambda step: 0.5 ** (step + 1))
      >>> s = tx.init(p)
      >>> u, s = tx.update({"w": torch.ones(2)}, s)
      >>> u2, s = tx.update({"w": torch.ones(2)}, s)
      >>> u["w"], u2["w"]
      (tensor([0.5000, 0.5000]), tensor([0.2500, 0.2500]))
    """
    if not callable(schedule):
        raise TypeError(f"[yolo_func] scale_by_schedule needs a callable schedule, got {type(schedule).__name__}")
    return _scale_by_schedule(schedule, "scale_by_schedule")


def _scale_by_schedule(schedule: Schedule, name: str) -> GradientTransformation:

    def init(params: Any) -> ScaleByScheduleState:
        return ScaleByScheduleState(_zero_count(params))

    def update(updates: Updates, state: ScaleByScheduleState, params: Any = None, *, iteration=None, **unknown):
        del params
        _reject_unknown(name, unknown)
        u, treedef = _flat(updates)
        new_state = ScaleByScheduleState(state.count + 1)
        if not u:
            return updates, new_state
        f = _as_leaf_scalar(_eval64(schedule, _step_for(state.count, iteration)), u)
        return T.tree_unflatten(treedef, torch._foreach_mul(u, f)), new_state

    return GradientTransformation(init, update)


def scale_by_learning_rate(learning_rate: ScalarOrSchedule) -> GradientTransformation:
    """Multiply updates by ``-learning_rate`` (descent).

    Args:
      learning_rate: a float or a schedule of the step.

    Returns:
      A stateless transform for a float, a :func:`scale_by_schedule` for a schedule.

    Example:
      >>> import torch
      >>> from yolo_func import optim
      >>> p = {"w": torch.ones(2)}
      >>> tx = optim.scale_by_learning_rate(0.1)
      >>> tx.update({"w": torch.ones(2)}, tx.init(p))[0]["w"]
      tensor([-0.1000, -0.1000])
    """
    _check_scalar("learning_rate", learning_rate)
    if _is_schedule(learning_rate):
        def neg_lr(step):  # groups sharing one schedule object share its negation within an update
            return _memo_value(("neg_lr", id(learning_rate), id(step)), step, lambda: -_eval64(learning_rate, step))

        return _scale_by_schedule(neg_lr, "scale_by_learning_rate")
    return _scale(-float(learning_rate), "scale_by_learning_rate")


def _adam(b1: float, b2: float, eps: float, lr: ScalarOrSchedule | None, weight_decay: float,
          name: str) -> GradientTransformation:
    for arg, v in (("b1", b1), ("b2", b2), ("eps", eps), ("weight_decay", weight_decay)):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise TypeError(f"[yolo_func] {name}({arg}) must be a float, got {type(v).__name__}")
    if lr is not None:
        _check_scalar("learning_rate", lr)
    b1, b2, eps, weight_decay = float(b1), float(b2), float(eps), float(weight_decay)

    def init(params: Any) -> ScaleByAdamState:
        return ScaleByAdamState(_zero_count(params), T.tree_zeros_like(params), T.tree_zeros_like(params))

    def update(updates: Updates, state: ScaleByAdamState, params: Any = None, *, iteration=None, **unknown):
        _reject_unknown(name, unknown)
        g, treedef = _flat(updates)
        count = state.count + 1
        if not g:
            return updates, ScaleByAdamState(count, state.mu, state.nu)
        # torch: exp_avg.lerp_(g, 1 - b1); exp_avg_sq.mul_(b2).addcmul_(g, g, value=1 - b2)
        mu = torch._foreach_lerp(T.tree_leaves(state.mu), g, 1 - b1)
        nu = torch._foreach_mul(T.tree_leaves(state.nu), b2)
        torch._foreach_addcmul_(nu, g, g, 1 - b2)
        # Bias corrections in float64 on the device (torch computes them in Python doubles).
        t = count.to(torch.float64)
        bc1 = 1 - torch.pow(torch.full_like(t, b1), t)
        bc2 = 1 - torch.pow(torch.full_like(t, b2), t)
        lr_t = 1.0 if lr is None else _eval64(lr, _step_for(state.count, iteration))
        step_size = -(lr_t / bc1) if lr is not None else 1 / bc1
        denom = torch._foreach_sqrt(nu)
        torch._foreach_div_(denom, _as_leaf_scalar(torch.pow(bc2, 0.5), g))
        torch._foreach_add_(denom, eps)
        # torch: p.addcdiv_(exp_avg, denom, value=step_size) evaluates p + (step_size*m)/denom.
        out = torch._foreach_mul(mu, _as_leaf_scalar(step_size, g))
        torch._foreach_div_(out, denom)
        if weight_decay != 0.0:
            _need_params("scale_by_adamw", params)
            p = T.tree_leaves(params)
            # torch decays first: p <- p*(1 - lr*wd). As an update: (p*c - p), exact by Sterbenz.
            c = _as_leaf_scalar(1 - lr_t * weight_decay, g)
            decayed = torch._foreach_mul(p, c)
            torch._foreach_sub_(decayed, p)
            torch._foreach_add_(out, decayed)
        new_state = ScaleByAdamState(count, T.tree_unflatten(treedef, mu), T.tree_unflatten(treedef, nu))
        return T.tree_unflatten(treedef, out), new_state

    return GradientTransformation(init, update)


def scale_by_adam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8) -> GradientTransformation:
    """Adam's direction ``m_hat / (sqrt(v_hat) + eps)`` in torch's order of operations.

    Computes ``((1/bc1) * m) / (sqrt(v)/sqrt(bc2) + eps)`` with ``bc_i = 1 - b_i^t``. Follow it with
    :func:`scale_by_learning_rate`; for bit-level parity with ``torch.optim.AdamW`` use
    :func:`scale_by_adamw`, which folds the learning rate in as torch does.

    Args:
      b1, b2: moment decay rates (floats).
      eps: added to the bias-corrected root second moment.

    Returns:
      A :class:`GradientTransformation` with :class:`ScaleByAdamState`.

    Example:
      >>> import torch
      >>> from yolo_func import optim
      >>> p = {"w": torch.ones(2)}
      >>> tx = optim.scale_by_adam()
      >>> u, s = tx.update({"w": torch.tensor([2.0, -3.0])}, tx.init(p))
      >>> [round(x, 4) for x in u["w"].tolist()], int(s.count)    # the first direction is sign(g)
      ([1.0, -1.0], 1)
    """
    return _adam(b1, b2, eps, None, 0.0, "scale_by_adam")


def scale_by_adamw(
    learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, weight_decay: float = 0.01
) -> GradientTransformation:
    """The complete ``torch.optim.AdamW`` update (learning rate and decoupled decay included).

    The update is ``(-lr/bc1 * m) / (sqrt(v)/sqrt(bc2) + eps) + (p*(1 - lr*wd) - p)``, so that
    ``p + update`` reproduces torch's ``p*(1 - lr*wd)`` followed by ``addcdiv``. With
    ``weight_decay=0`` the result is bitwise equal to torch on the CPU; with decay the extra
    rounding of the sum can move the last bit.

    Args:
      learning_rate: float or schedule (evaluated in float64, like torch's host-side lr).
      b1, b2, eps: as torch's ``betas`` and ``eps``.
      weight_decay: decoupled decay (float).

    Returns:
      A :class:`GradientTransformation` with :class:`ScaleByAdamState`; ``update`` needs ``params``
      when ``weight_decay != 0``.

    Example:
      >>> import torch
      >>> from yolo_func import optim
      >>> p = {"w": torch.ones(2)}
      >>> tx = optim.scale_by_adamw(0.1, weight_decay=0.0)
      >>> u, _ = tx.update({"w": torch.tensor([1.0, -2.0])}, tx.init(p), p)
      >>> [round(x, 4) for x in u["w"].tolist()]
      [-0.1, 0.1]
    """
    return _adam(b1, b2, eps, learning_rate, weight_decay, "scale_by_adamw")


def global_norm(tree: Any) -> torch.Tensor:
    """Total L2 norm of all leaves, computed as ``torch.nn.utils.clip_grad_norm_`` does (fused
    per-leaf norms, then the norm of their stack).

    Half-precision per-leaf norms (e.g. of BF16 feature gradients) are upcast to float32 before
    the stack, so the total neither overflows nor depends on the leaves' mix of dtypes; float32
    and float64 norms are used as they are.

    Args:
      tree: tree of float tensors.

    Returns:
      float[] on the first leaf's device (0 for an empty tree).

    Example:
      >>> import torch
      >>> from yolo_func.optim import global_norm
      >>> global_norm({"a": torch.tensor([3.0]), "b": {"c": torch.tensor([4.0])}})
      tensor(5.)
    """
    leaves = T.tree_leaves(tree)
    if not leaves:
        return torch.zeros((), device=_device_of(tree))
    return _global_norm_of(leaves)


def _global_norm_of(leaves: list[torch.Tensor]) -> torch.Tensor:
    """:func:`global_norm` of a non-empty list of leaves (for callers that flattened already)."""
    norms = torch._foreach_norm(leaves, 2.0)
    norms = [n.float() if n.dtype in (torch.float16, torch.bfloat16) else n for n in norms]
    return torch.linalg.vector_norm(torch.stack(norms), 2.0)


def clip_by_global_norm(max_norm: float = 10.0) -> GradientTransformation:
    """Scale updates so their total L2 norm is at most ``max_norm`` (REFERENCE.md §4.3: 10.0).

    Same numerics as ``torch.nn.utils.clip_grad_norm_``: ``coef = clamp(max_norm / (norm + 1e-6),
    max=1)``, always multiplied in (no host-side ``if``).

    Args:
      max_norm: float > 0.

    Returns:
      A :class:`GradientTransformation` with :class:`ClipByGlobalNormState` (the last pre-clip norm).

    Example:
      >>> import torch
      >>> from yolo_func import optim
      >>> p = {"w": torch.ones(2)}
      >>> tx = optim.clip_by_global_norm(1.0)
      >>> u, _ = tx.update({"w": torch.tensor([3.0, 4.0])}, tx.init(p), p)
      >>> u["w"]                                       # norm 5 scaled down to 1
      tensor([0.6000, 0.8000])
    """
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not max_norm > 0:
        raise ValueError(f"[yolo_func] clip_by_global_norm(max_norm) must be a float > 0, got {max_norm!r}")
    max_norm = float(max_norm)

    def init(params: Any) -> ClipByGlobalNormState:
        return ClipByGlobalNormState(torch.zeros((), device=_device_of(params)))

    def update(updates: Updates, state: ClipByGlobalNormState, params: Any = None, *, iteration=None, **unknown):
        del params, iteration
        _reject_unknown("clip_by_global_norm", unknown)
        u, treedef = _flat(updates)
        if not u:
            return updates, state
        norm = _global_norm_of(u)  # the leaves above: no second flatten of the tree
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        return T.tree_unflatten(treedef, torch._foreach_mul(u, coef)), ClipByGlobalNormState(norm.to(state.norm.dtype))

    return GradientTransformation(init, update)
