"""Ready-made optimizers: :func:`sgd` (torch.optim.SGD) and :func:`adamw` (torch.optim.AdamW)."""

from __future__ import annotations

from yolo_func.optim.base import GradientTransformation, ScalarOrSchedule, _check_scalar, _is_schedule, _reject_unknown
from yolo_func.optim.combine import chain
from yolo_func.optim.transforms import _adam, add_decayed_weights, scale_by_learning_rate, trace

__all__ = ["sgd", "adamw"]


def sgd(
    learning_rate: ScalarOrSchedule,
    momentum: ScalarOrSchedule = 0.0,
    nesterov: bool = False,
    weight_decay: float = 0.0,
) -> GradientTransformation:
    """``torch.optim.SGD`` (dampening 0) as ``chain(add_decayed_weights, trace, scale_by_learning_rate)``.

    Order of operations as torch: ``g <- g + wd*p``; ``buf <- mu*buf + g`` (``buf = g`` first);
    ``d = g + mu*buf`` (nesterov) or ``buf``; ``update = -lr*d``. YOLOv8 uses
    ``sgd(lr, momentum=0.937, nesterov=True, weight_decay=5e-4*batch*accumulate/64)`` on the decayed
    group (REFERENCE.md §4.2).

    Args:
      learning_rate: float or schedule of the step (device scalar).
      momentum: float or schedule; a float 0 leaves momentum out (no state).
      nesterov: Nesterov momentum (needs a momentum).
      weight_decay: coupled L2 decay (float).

    Returns:
      A :class:`GradientTransformation` (state: a tuple of the chained states; ``update`` accepts
      ``iteration`` only).

    Raises:
      ValueError: ``nesterov`` without momentum, or a negative hyper-parameter.

    >>> import torch
    >>> tx = sgd(0.1, momentum=0.9)
    >>> p = {"w": torch.ones(2)}
    >>> u, s = tx.update({"w": torch.ones(2)}, tx.init(p), p)
    >>> u["w"].tolist()
    [-0.10000000149011612, -0.10000000149011612]
    """
    _check_scalar("sgd(learning_rate)", learning_rate)
    _check_scalar("sgd(momentum)", momentum)
    for name, v in (("learning_rate", learning_rate), ("momentum", momentum), ("weight_decay", weight_decay)):
        if not _is_schedule(v) and v < 0:
            raise ValueError(f"[yolo_func] sgd({name}) must be >= 0, got {v}")
    has_momentum = _is_schedule(momentum) or momentum != 0
    if nesterov and not has_momentum:
        raise ValueError("[yolo_func] sgd(nesterov=True) needs a momentum > 0 (as torch.optim.SGD), got momentum=0")
    txs = []
    if weight_decay != 0:
        txs.append(add_decayed_weights(weight_decay))
    if has_momentum:
        txs.append(trace(momentum, nesterov=nesterov))
    txs.append(scale_by_learning_rate(learning_rate))
    inner = chain(*txs)

    def update(updates, state, params=None, *, iteration=None, **unknown):
        _reject_unknown("sgd", unknown)  # named for the user (the chain would say "chain")
        return inner.update(updates, state, params, iteration=iteration)

    return GradientTransformation(inner.init, update)


def adamw(
    learning_rate: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.01,
) -> GradientTransformation:
    """``torch.optim.AdamW`` (non-fused foreach implementation, ``amsgrad=False``).

    ``p <- p*(1 - lr*wd)``; ``m <- lerp(m, g, 1-b1)``; ``v <- b2*v + (1-b2)*g*g``;
    ``p <- p + (-lr/bc1 * m) / (sqrt(v)/sqrt(bc2) + eps)``, returned as one update. The reference
    uses AdamW with betas ``(momentum, 0.999)`` when ``optimizer=auto`` picks it (REFERENCE.md §4.2).

    Args:
      learning_rate: float or schedule.
      b1, b2: torch's ``betas``.
      eps: torch's ``eps``.
      weight_decay: decoupled decay (0 for the no-decay groups).

    Returns:
      A :class:`GradientTransformation` whose state is a ``ScaleByAdamState`` (``update`` accepts
      ``iteration`` only).

    Example:
      >>> import torch
      >>> from yolo_func import optim
      >>> p = {"w": torch.ones(2)}
      >>> tx = optim.adamw(0.1, weight_decay=0.0)
      >>> u, _ = tx.update({"w": torch.tensor([1.0, -2.0])}, tx.init(p), p)
      >>> [round(x, 4) for x in u["w"].tolist()]    # the first Adam step is -lr * sign(g)
      [-0.1, 0.1]
    """
    _check_scalar("adamw(learning_rate)", learning_rate)
    if not 0.0 <= b1 < 1.0 or not 0.0 <= b2 < 1.0:
        raise ValueError(f"[yolo_func] adamw betas must be in [0, 1), got b1={b1}, b2={b2}")
    return _adam(b1, b2, eps, learning_rate, weight_decay, "adamw")
