"""The optimizer protocol (optax-shaped) and the small helpers every transform shares.

A :class:`GradientTransformation` is a pair of pure functions::

    state = tx.init(params)
    updates, state = tx.update(grads, state, params, iteration=None)
    params = apply_updates(params, updates)          # or apply_updates_ on static buffers

Trees are nested plain dicts (or NamedTuples, tuples) of tensors, handled through
:mod:`yolo_func.tree`. Inside ``update`` every transform works on the flat leaf lists with
``torch._foreach_*`` multi-tensor ops; in-place ops only ever touch tensors the transform has just
allocated itself, so the caller's ``updates``, ``state`` and ``params`` are never written (the
returned updates may share storage with the returned state, as JAX arrays would; treat both as
read-only).

Hyper-parameters are either Python floats (baked into the closure) or *schedules*: callables of an
``int64[]`` step tensor returning a 0-dim device tensor. A schedule is evaluated at the keyword
``iteration`` when the caller passes one (:func:`yolo_func.optim.multi_steps` and
:func:`yolo_func.optim.apply_if_finite` pass the global micro-batch index ``ni``), otherwise at the
transform's own ``count`` (updates so far).

Extra keywords are strict: every transform's ``update`` accepts ``iteration`` and nothing else,
except the few that document more (``apply_if_finite`` also takes ``finite``); an unknown keyword
raises ``TypeError("[yolo_func] <name>.update got an unexpected keyword ...")`` instead of being
dropped on the way down (a veto that only one transform reads is a veto the others ignore).
Nothing here calls ``.item()`` or branches on tensor values, so an update can be captured in a
CUDA graph.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from typing import Any, NamedTuple, Union

import torch

from yolo_func import tree as T

# id(memoized schedule), id(step) -> (step, value); None outside optim.schedule_memo() (defined in
# optim.schedules: the block every update of share_schedules runs in)
_SCHEDULE_MEMO: contextvars.ContextVar[dict | None] = contextvars.ContextVar("yolo_func_schedule_memo", default=None)


def _memo_value(key: tuple, anchor: Any, compute: Callable[[], Any]) -> Any:
    """``compute()`` once per ``key`` inside ``schedule_memo()`` (every call outside it). ``anchor``
    is kept with the entry, so the ids in ``key`` of objects it holds alive are not reused."""
    memo = _SCHEDULE_MEMO.get()
    if memo is None:
        return compute()
    hit = memo.get(key)
    if hit is not None and hit[0] is anchor:
        return hit[1]
    out = compute()
    memo[key] = (anchor, out)
    return out

__all__ = [
    "Params",
    "Updates",
    "OptState",
    "Schedule",
    "ScalarOrSchedule",
    "GradientTransformation",
    "EmptyState",
    "identity",
    "apply_updates",
    "apply_updates_",
]

Params = Any
Updates = Any
OptState = Any
#: ``(step: int64[]) -> float[]`` on the step's device.
Schedule = Callable[[torch.Tensor], torch.Tensor]
ScalarOrSchedule = Union[float, Schedule]


class GradientTransformation(NamedTuple):
    """A pure gradient transformation.

    Attributes:
      init: ``(params) -> state``; state tensors live on the params' device.
      update: ``(updates, state, params=None, *, iteration=None) -> (updates, state)``;
        ``updates`` has the structure of ``params``. ``iteration`` (``int64[]`` or None) is the step
        at which schedules are evaluated; combinators forward it to their inner transforms. Every
        transform of :mod:`yolo_func.optim` raises ``TypeError`` on any other keyword (a few
        document more, e.g. :func:`yolo_func.optim.apply_if_finite`'s ``finite``); a transform of
        your own must accept ``iteration`` too, since the training step's guard passes it.

    Example:
      >>> import torch
      >>> from yolo_func import optim
      >>> p = {"w": torch.ones(2)}
      >>> tx = optim.chain(optim.scale(2.0), optim.scale_by_learning_rate(0.1))   # a GradientTransformation
      >>> u, s = tx.update({"w": torch.ones(2)}, tx.init(p), p)
      >>> optim.apply_updates(p, u)["w"]
      tensor([0.8000, 0.8000])
    """

    init: Callable[[Params], OptState]
    update: Callable[..., tuple[Updates, OptState]]


class EmptyState(NamedTuple):
    """State of a stateless transform (no fields, no tensors).

    Example:
      >>> import torch
      >>> from yolo_func import optim
      >>> p = {"w": torch.ones(2)}
      >>> optim.scale(2.0).init(p)
      EmptyState()
    """


def identity() -> GradientTransformation:
    """The transform that returns its updates unchanged.

    >>> import torch
    >>> tx = identity()
    >>> u, s = tx.update({"w": torch.ones(2)}, tx.init({"w": torch.zeros(2)}))
    >>> u["w"].tolist()
    [1.0, 1.0]
    """

    def init(params: Params) -> EmptyState:
        del params
        return EmptyState()

    def update(updates: Updates, state: EmptyState, params: Params = None, *, iteration=None,
               **unknown) -> tuple[Updates, EmptyState]:
        del params, iteration
        _reject_unknown("identity", unknown)
        return updates, state

    return GradientTransformation(init, update)


def _check_same_structure(fn: str, a: Any, b: Any, names: tuple[str, str]) -> tuple[list, list, Any]:
    a_leaves, a_def = T.tree_flatten(a)
    b_leaves, b_def = T.tree_flatten(b)
    if a_def != b_def:
        raise ValueError(
            f"[yolo_func] {fn}: {names[0]} and {names[1]} must have the same tree structure; differences:\n"
            + T.tree_diff(a, b, names=names)
        )
    return a_leaves, b_leaves, a_def


def apply_updates(params: Params, updates: Updates) -> Params:
    """Pure ``params + updates`` (new tensors; the inputs are untouched).

    Args:
      params: tree of float tensors (any shapes).
      updates: tree of the same structure, shapes and dtypes (cast to each param's dtype).

    Returns:
      A new tree ``p + u`` computed with one fused multi-tensor add.

    Raises:
      ValueError: the two trees differ in structure (paths listed).

    Example:
      >>> import torch
      >>> from yolo_func import optim
      >>> p = {"w": torch.ones(2)}
      >>> new = optim.apply_updates(p, {"w": torch.full((2,), -0.5)})
      >>> new["w"], p["w"]                             # the input is untouched
      (tensor([0.5000, 0.5000]), tensor([1., 1.]))
    """
    p, u, treedef = _check_same_structure("apply_updates", params, updates, ("params", "updates"))
    if not p:
        return T.tree_unflatten(treedef, [])
    u = [x if x.dtype == y.dtype else x.to(y.dtype) for x, y in zip(u, p)]
    return T.tree_unflatten(treedef, torch._foreach_add(p, u))


def apply_updates_(params: Params, updates: Updates) -> Params:
    """In-place ``params += updates`` on static buffers (CUDA-graph replay, eager fast path).

    The parameter tensors keep their storage (pointers captured in a graph stay valid). Same
    numerics as :func:`apply_updates`.

    Args:
      params: tree of float tensors, written in place.
      updates: tree of the same structure.

    Returns:
      ``params`` (the same object).

    Raises:
      ValueError: the two trees differ in structure (paths listed).

    Example:
      >>> import torch
      >>> from yolo_func import optim
      >>> p = {"w": torch.ones(2)}
      >>> same = optim.apply_updates_(p, {"w": torch.full((2,), -0.5)})
      >>> same["w"] is p["w"], p["w"]
      (True, tensor([0.5000, 0.5000]))
    """
    p, u, _ = _check_same_structure("apply_updates_", params, updates, ("params", "updates"))
    if p:
        u = [x if x.dtype == y.dtype else x.to(y.dtype) for x, y in zip(u, p)]
        torch._foreach_add_(p, u)
    return params


# -- helpers shared by the transforms (private) ---------------------------------------------------


def _device_of(tree: Any) -> torch.device:
    """The device of the first tensor leaf (CPU for an empty tree)."""
    leaf = T.tree_first_leaf(tree, lambda x: isinstance(x, torch.Tensor))
    return torch.device("cpu") if leaf is None else leaf.device


def _zero_count(tree: Any) -> torch.Tensor:
    """``int64[]`` zero on the tree's device: the ``count`` every stateful transform carries."""
    return torch.zeros((), dtype=torch.int64, device=_device_of(tree))


def _step_for(state_count: torch.Tensor, iteration: torch.Tensor | None) -> torch.Tensor:
    """The step a schedule is evaluated at: ``iteration`` if given, else the count."""
    return state_count if iteration is None else iteration


def _reject_unknown(name: str, unknown: dict, accepted: tuple[str, ...] = ("iteration",)) -> None:
    """Raise on extra keywords a transform does not read (instead of dropping them silently).

    Args:
      name: the transform's name as the user wrote it (``"sgd"``, ``"multi_steps"``...).
      unknown: the keywords left over after the accepted ones were bound.
      accepted: the keywords ``name``'s update does accept.

    Raises:
      TypeError: ``unknown`` is not empty.
    """
    if not unknown:
        return
    key = sorted(unknown)[0]
    hint = (" To skip a step on a non-finite loss, wrap the optimizer in apply_if_finite(tx) and pass "
            "finite= to its update (the training step does this for you)." if key in ("skip", "finite") else "")
    raise TypeError(
        f"[yolo_func] {name}.update got an unexpected keyword {key!r}; it accepts "
        f"{', '.join(repr(a) for a in accepted) or 'no extra keywords'}. Remove the keyword or pass it "
        f"to the transform that reads it.{hint}"
    )


def _is_schedule(x: Any) -> bool:
    return callable(x)


def _check_scalar(name: str, x: Any) -> None:
    if _is_schedule(x):
        return
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise TypeError(
            f"[yolo_func] {name} must be a float or a schedule (a callable of the int64[] step "
            f"returning a 0-dim tensor), got {type(x).__name__}"
        )


def _eval64(value: ScalarOrSchedule, step: torch.Tensor) -> torch.Tensor | float:
    """A Python float stays a float; a schedule gives a float64 0-dim tensor on the step's device.

    Scalar arithmetic (bias corrections, ``1 - lr*wd``) is done in float64 as torch's optimizers
    do it on the host in Python doubles, and cast to the parameter dtype only where it meets the
    tensors (as the kernels cast a Python scalar to their opmath type).
    """
    if not _is_schedule(value):
        return float(value)
    out = value(step)
    if not isinstance(out, torch.Tensor):
        # A schedule returning a Python number: make it a device tensor (no host sync involved).
        return torch.full((), float(out), dtype=torch.float64, device=step.device)
    return out.to(device=step.device, dtype=torch.float64)


def finite_scalar(x: torch.Tensor) -> torch.Tensor:
    """``torch.isfinite(x)`` for a floating tensor as ``(x - x) == 0``: two kernels where
    ``isfinite`` dispatches four (``abs``, ``ne``, ``eq``, ``mul``). The same booleans: ``x - x`` is
    exactly 0 for every finite ``x`` and NaN for ``±inf`` and NaN.

    Example:
      >>> import torch
      >>> finite_scalar(torch.tensor([1.0, float("inf"), float("nan"), -0.0])).tolist()
      [True, False, False, True]
    """
    return (x - x) == 0


_HOST_FLAGS = True


def set_host_flags(on: bool) -> bool:
    """Turn the CPU fast path of :func:`host_flag` on or off (process-wide); returns the old value.

    Off, every select stays a device-side ``torch.where`` / multiply as on a GPU. For parity tests
    and benchmarks: the results have the same values either way (an arithmetic select can differ
    from an exact one only in the sign of a zero and in a NaN or infinity of the discarded branch).
    """
    global _HOST_FLAGS
    old, _HOST_FLAGS = _HOST_FLAGS, bool(on)
    return old


def host_flag(flag: torch.Tensor) -> bool | None:
    """The value of a ``bool[]`` flag when reading it costs nothing, else None.

    A plain CPU tensor in eager mode has no device to wait for, so a select on it can be a Python
    branch (``where(flag, new, old)`` is ``new`` or ``old`` whole, ``torch.where``'s exact selection,
    without a pass over a model-sized buffer). Everywhere else — a GPU (a read would synchronise the host and
    break graph capture), meta tensors, tensor subclasses (fake tensors), ``torch.func``
    transforms, ``torch.compile`` tracing, or after :func:`set_host_flags` ``(False)`` — the
    caller keeps its device-side select.

    Args:
      flag: ``bool[]`` (0-dim).

    Returns:
      ``True`` / ``False`` on the CPU fast path, else ``None``.

    Example:
      >>> import torch
      >>> host_flag(torch.tensor(True)), host_flag(torch.tensor(True, device="meta"))
      (True, None)
    """
    if flag.dtype != torch.bool or not host_readable(flag):
        return None
    return bool(flag)


def host_readable(x: torch.Tensor) -> bool:
    """Whether :func:`host_flag`'s fast path may read the 0-dim tensor ``x`` on the host: a plain
    CPU tensor in eager mode (not meta, not a subclass, not inside ``torch.func`` transforms or
    ``torch.compile`` tracing) while :func:`set_host_flags` is on."""
    return (_HOST_FLAGS and type(x) is torch.Tensor and x.device.type == "cpu" and x.dim() == 0
            and not torch.compiler.is_compiling() and not torch._C._functorch.is_functorch_wrapped_tensor(x))


def _as_leaf_scalar(x: torch.Tensor | float, like: list[torch.Tensor]) -> torch.Tensor | float:
    """Cast a float64 device scalar to the leaves' dtype (floats pass through). Inside
    ``schedule_memo()`` a value shared by several parameter groups (the momentum, a learning rate)
    is cast once per dtype and device."""
    if isinstance(x, torch.Tensor) and like:
        dtype, device = like[0].dtype, like[0].device
        if x.dtype == dtype and x.device == device:
            return x
        return _memo_value(("leaf_scalar", id(x), dtype, device), x, lambda: x.to(dtype=dtype, device=device))
    return x


def _select(flag: torch.Tensor, new: list[torch.Tensor], old: list[torch.Tensor]) -> list[torch.Tensor]:
    """``where(flag, new, old)`` over leaf lists without a host branch or a per-leaf loop.

    Float leaves: ``new * f + old * (1 - f)`` with ``f`` in {0, 1}, which is exact for finite
    values (x*1 = x, x*0 = 0, x + 0 = x) and fused over the list. Integer and bool leaves (the
    few counters) use ``torch.where``.

    With the flag read on the host (:func:`host_flag`: a CPU bool in eager mode) the result is
    ``new`` or ``old`` itself: ``torch.where``'s exact selection, no pass over the leaves. It has
    the device form's values; the device form's arithmetic can differ from an exact select only in
    the sign of a zero (``-0 * 1 + 0 * old`` is ``+0``) and in a NaN or infinity of the discarded
    branch (``inf * 0`` is NaN).
    """
    if not new:
        return []
    known = host_flag(flag)
    if known is not None:
        return list(new) if known else list(old)
    out: list[torch.Tensor | None] = [None] * len(new)
    f_idx = [i for i, x in enumerate(new) if x.is_floating_point()]
    o_idx = [i for i, x in enumerate(new) if not x.is_floating_point()]
    if f_idx:
        dtype, device = new[f_idx[0]].dtype, new[f_idx[0]].device
        f = flag.to(dtype=dtype, device=device)
        nf = [new[i] for i in f_idx]
        of = [old[i] for i in f_idx]
        sel = torch._foreach_mul(nf, f)
        torch._foreach_add_(sel, torch._foreach_mul(of, 1 - f))
        for i, x in zip(f_idx, sel):
            out[i] = x
    for i in o_idx:
        out[i] = torch.where(flag, new[i], old[i])
    return out  # type: ignore[return-value]

