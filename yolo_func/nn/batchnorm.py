"""BatchNorm over NCHW (or channels_last) activations, with statistics returned out of place.

Numerics are ``F.batch_norm`` (the same kernels as the reference): PyTorch momentum convention
(``running = (1 - momentum) * running + momentum * batch``), the unbiased batch variance for the
running estimate and the biased one for normalisation. YOLOv8 uses eps 1e-3, momentum 0.03.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

from yolo_func.nn.base import Layer, _empty

__all__ = ["batchnorm", "batchnorm_init", "batchnorm_apply", "update_stats_in_place", "sync_batchnorm", "BN_EPS",
           "BN_MOMENTUM"]

BN_EPS = 1e-3
BN_MOMENTUM = 0.03

_IN_PLACE = contextvars.ContextVar("yolo_func_bn_in_place", default=False)
_SYNC: contextvars.ContextVar[Callable[[torch.Tensor], torch.Tensor] | None] = contextvars.ContextVar(
    "yolo_func_bn_sync", default=None)


@contextlib.contextmanager
def update_stats_in_place() -> Iterator[None]:
    """Opt-in for capture: training-mode BN writes the new statistics into the state tensors it was
    given (static buffers) instead of returning fresh copies. Outside this context BN never touches
    its input state.

    Example:
      >>> import torch
      >>> from yolo_func.nn import batchnorm_apply, batchnorm_init, update_stats_in_place
      >>> p, s = batchnorm_init(2)
      >>> with update_stats_in_place():
      ...     _, s2 = batchnorm_apply(p, s, torch.ones(2, 2, 4, 4), train=True)
      >>> s2["running_mean"] is s["running_mean"], s["running_mean"]
      (True, tensor([0.0300, 0.0300]))
    """
    token = _IN_PLACE.set(True)
    try:
        yield
    finally:
        _IN_PLACE.reset(token)


@contextlib.contextmanager
def sync_batchnorm(all_reduce_sum: Callable[[torch.Tensor], torch.Tensor]) -> Iterator[None]:
    """Synchronised batch statistics: inside this context, training-mode BN normalises with the
    mean and variance of the batch of *every* data-parallel process (SyncBN), and updates the
    running statistics with them (so they stay equal on every process).

    ``all_reduce_sum(t: float[N]) -> float[N]`` must return the sum of ``t`` over the
    processes and be differentiable (its backward: the sum of the cotangents over the processes),
    e.g. :func:`yolo_func.train.distributed.differentiable_all_reduce`; the identity gives the
    one-process statistics. Every process must run the same BN layers in the same order (one
    collective per BN layer in the forward and one in the backward).

    Numerics: one collective per layer carries ``[sum(x - K), sum((x - K)^2), count]`` per channel
    with the shift ``K`` = the running mean (equal on every process), so the variance
    ``E[(x-K)^2] - E[x-K]^2`` does not cancel catastrophically; normalisation runs in at least
    float32 (half-precision activations are upcast; float64 stays float64).
    Equal to ``F.batch_norm`` up to float rounding (about 1e-6 relative) on one process.

    Example:
      >>> x = torch.randn(4, 3, 5, 5)
      >>> p, s = batchnorm_init(3)
      >>> with sync_batchnorm(lambda t: t):  # one process
      ...     y, s2 = batchnorm_apply(p, s, x, train=True)
      >>> bool(torch.allclose(y, batchnorm_apply(p, s, x, train=True)[0], atol=1e-5))
      True
    """
    token = _SYNC.set(all_reduce_sum)
    try:
        yield
    finally:
        _SYNC.reset(token)


def _synced(params: dict, x: torch.Tensor, mean_buf: torch.Tensor, var_buf: torch.Tensor, sync, eps: float,
            momentum: float) -> torch.Tensor:
    """SyncBN forward; writes the running statistics into ``mean_buf`` / ``var_buf`` in place."""
    c = x.shape[1]
    xf = x.float() if x.element_size() < 4 else x  # at least float32 (float64 stays float64)
    shift = mean_buf.detach().to(xf.dtype).view(1, c, 1, 1)  # a constant, equal on every process
    d = xf - shift
    dims = (0, 2, 3)
    count = torch.full((1,), float(x.numel() // c), dtype=xf.dtype, device=x.device)
    tot = sync(torch.cat([d.sum(dims), (d * d).sum(dims), count]))
    n = tot[2 * c]
    m1 = tot[:c] / n
    var = (tot[c:2 * c] / n - m1 * m1).clamp(min=0.0)  # biased, as F.batch_norm normalises
    mean = shift.view(c) + m1
    y = (xf - mean.view(1, c, 1, 1)) * torch.rsqrt(var + eps).view(1, c, 1, 1)
    y = y * params["weight"].to(xf.dtype).view(1, c, 1, 1) + params["bias"].to(xf.dtype).view(1, c, 1, 1)
    # Running statistics: F.batch_norm's own in-place update (it is what works inside torch.func
    # transforms on plain buffers) fed two points per channel whose mean and unbiased variance are
    # the global batch's: a, b = mean +- sqrt(var_unbiased / 2).
    with torch.no_grad():
        nd = n.detach()
        var_u = var.detach() * nd / (nd - 1).clamp(min=1.0)
        half = torch.sqrt(var_u / 2)
        z = torch.stack([mean.detach() + half, mean.detach() - half])  # [2, C]
        F.batch_norm(z.to(mean_buf.dtype), mean_buf, var_buf, None, None, True, momentum, eps)
    return y.to(x.dtype)


def _mode() -> tuple[bool, Callable[[torch.Tensor], torch.Tensor] | None]:
    """``(in place?, the SyncBN all-reduce or None)`` of the calling context.

    Under ``torch.compile`` (dynamo cannot trace ``ContextVar.get``) the in-place flag is read by
    :func:`_in_place_at_trace`, which :func:`enable_compile` marks as a trace-time constant: it is
    baked into the compiled graph without a guard, so a compiled function must always be called
    under the same :func:`update_stats_in_place` setting (:mod:`yolo_func.train.compiled` enters it
    around every call). SyncBN is never traced (the compiled step refuses :func:`sync_batchnorm`).
    """
    if torch.compiler.is_compiling():
        return _in_place_at_trace(), None
    return _IN_PLACE.get(), _SYNC.get()


def _in_place_at_trace() -> bool:
    return _IN_PLACE.get()


def enable_compile() -> None:
    """Let ``torch.compile`` trace training-mode BN in one graph (see :func:`_mode`); imports dynamo.

    Called by :mod:`yolo_func.train.compiled` before it compiles anything; idempotent. Without it
    dynamo breaks the graph at every BN layer (correct, but many small graphs).
    """
    torch.compiler.assume_constant_result(_in_place_at_trace)


def sync_active() -> bool:
    """Whether a :func:`sync_batchnorm` context is active here (compiled functions refuse it)."""
    return _SYNC.get() is not None


def batchnorm_init(channels: int) -> tuple[dict, dict]:
    """``({"weight": ones[C], "bias": zeros[C]}, {"running_mean": zeros[C], "running_var": ones[C]})``.

    Example:
      >>> from yolo_func.nn import batchnorm_init
      >>> p, s = batchnorm_init(3)
      >>> p["weight"].tolist(), p["bias"].tolist(), s["running_var"].tolist()
      ([1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [1.0, 1.0, 1.0])
    """
    params = {"weight": _empty((channels,)).fill_(1.0), "bias": _empty((channels,)).fill_(0.0)}
    state = {"running_mean": _empty((channels,)).fill_(0.0), "running_var": _empty((channels,)).fill_(1.0)}
    return params, state


def batchnorm_apply(
    params: dict, state: dict, x: torch.Tensor, *, train: bool, eps: float = BN_EPS, momentum: float = BN_MOMENTUM
) -> tuple[torch.Tensor, dict]:
    """Normalise ``x: float[B, C, H, W]``.

    Returns ``(y float[B, C, H, W], new_state)``. In eval mode ``new_state is state`` (identity).
    In train mode the running statistics are updated on clones, so ``state`` is untouched, unless
    :func:`update_stats_in_place` is active; inside :func:`sync_batchnorm` the batch statistics are
    the data-parallel processes' together.

    Example:
      >>> import torch
      >>> from yolo_func.nn import batchnorm_apply, batchnorm_init
      >>> p, s = batchnorm_init(2)
      >>> x = torch.tensor([[[[1.0]], [[2.0]]], [[[3.0]], [[6.0]]]])    # float[2, 2, 1, 1]
      >>> y, s2 = batchnorm_apply(p, s, x, train=True)
      >>> s2["running_mean"]                                            # 0.97 * 0 + 0.03 * batch mean
      tensor([0.0600, 0.1200])
    """
    if not train:
        y = F.batch_norm(x, state["running_mean"], state["running_var"], params["weight"], params["bias"], False, 0.0, eps)
        return y, state
    in_place, sync = _mode()
    if in_place:
        mean, var = state["running_mean"], state["running_var"]
    else:
        mean, var = state["running_mean"].clone(), state["running_var"].clone()
    if sync is not None:
        return _synced(params, x, mean, var, sync, eps, momentum), {"running_mean": mean, "running_var": var}
    if x.device.type == "cpu" and not torch.is_autocast_enabled("cpu"):
        # The kernel F.batch_norm reaches on the CPU (through _batch_norm_impl_index, which also
        # allocates an unused reserve tensor: one aten op per BN layer per step). Same kernel,
        # same backward (native_batch_norm_backward), same values. On CUDA F.batch_norm may pick
        # cuDNN, and under autocast it casts: both keep the public call.
        _check_batch_size(x)
        y = torch.ops.aten.native_batch_norm(x, params["weight"], params["bias"], mean, var, True, momentum, eps)[0]
    else:
        y = F.batch_norm(x, mean, var, params["weight"], params["bias"], True, momentum, eps)
    return y, {"running_mean": mean, "running_var": var}


def _check_batch_size(x: torch.Tensor) -> None:
    """F.batch_norm's training-mode check: more than one value per channel."""
    if x.dim() < 2 or x.numel() // max(x.shape[1], 1) <= 1:
        raise ValueError(f"Expected more than 1 value per channel when training, got input size {list(x.shape)}")


def batchnorm(channels: int, *, eps: float = BN_EPS, momentum: float = BN_MOMENTUM) -> Layer:
    """BatchNorm2d layer (no RNG consumed at init).

    Example:
      >>> import torch
      >>> gen = torch.Generator().manual_seed(0)
      >>> from yolo_func.nn import batchnorm
      >>> bn = batchnorm(4)
      >>> p, s = bn.init(gen)
      >>> y, s2 = bn.apply(p, s, torch.randn(2, 4, 8, 8) * 3 + 1, train=True)   # float[B, C, H, W]
      >>> y.shape, s2["running_mean"].shape, torch.equal(s["running_mean"], torch.zeros(4))
      (torch.Size([2, 4, 8, 8]), torch.Size([4]), True)
    """

    def init(gen: torch.Generator):
        del gen
        return batchnorm_init(channels)

    def apply(params, state, x, *, train: bool):
        return batchnorm_apply(params, state, x, train=train, eps=eps, momentum=momentum)

    return Layer(init, apply)
