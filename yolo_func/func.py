"""Generic ``torch.func`` helpers shared by the eager step (:mod:`yolo_func.train`) and the captured
one (:mod:`yolo_func.capture`), so both differentiate and cast the same way.

Low floor: imports only torch and :mod:`yolo_func.tree`.

- :func:`autocast`: ``torch.autocast`` with the weight cache off (capture-safe, and eager casts
  the same way as a replay).
- :func:`first_order`: a pullback run under ``torch.no_grad()`` (native first-order backward
  kernels, no graph of the backward).
- :func:`flat_vjp`: ``torch.func.vjp`` whose trees cross the transform as flat leaf tuples.
- :func:`autograd_vjp`: the same contract through ``torch.autograd``, for functions ``torch.func``
  cannot transform (``torch.compile``'d ones: AOTAutograd differentiates them).
- :func:`vjp_backend`: which of the two :func:`flat_vjp` uses on this thread (``"func"`` by
  default; ``"autograd"`` spares a process the ``torch._dynamo`` import of functorch's pullback).
- :func:`cat`: ``torch.cat`` whose backward is one ``split`` instead of one ``slice`` per input.

Example:
  >>> import torch
  >>> out, pullback, aux = flat_vjp(lambda p: ({"y": p["w"] * 3.0}, {"n": torch.tensor(1)}),
  ...                               {"w": torch.tensor([1.0, 2.0])})
  >>> first_order(pullback)({"y": torch.tensor([1.0, 1.0])})[0]["w"]
  tensor([3., 3.])
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.func import vjp

from yolo_func import tree as T

__all__ = ["VJP_BACKENDS", "autocast", "autocast_dtype", "autograd_vjp", "cat", "current_vjp_backend", "dynamo_imported",
           "eval_autocast_dtype", "first_order", "flat_vjp", "vjp_backend", "vjp_through_autograd"]


_AUTOCAST_NAMES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
                   "none": None, "fp32": None}


def autocast_dtype(name: str, device: torch.device | str) -> torch.dtype | None:
    """The autocast dtype a precision name means on ``device`` (None: float32, no autocast).

    One rule for the training step (``train.autocast``), :class:`~yolo_func.train.ReplayTrainStep`
    and validation / prediction (``precision=``): ``"auto"`` is BF16 on CUDA and float32
    elsewhere; ``"bfloat16"`` / ``"bf16"``, ``"float16"`` / ``"fp16"`` and ``"none"`` / ``"fp32"``
    name a dtype on any device. Callers check their own vocabulary first.

    Raises:
      ValueError: an unknown name.

    Example:
      >>> from yolo_func.func import autocast_dtype
      >>> autocast_dtype("auto", "cuda"), autocast_dtype("auto", "cpu"), autocast_dtype("fp16", "cpu")
      (torch.bfloat16, None, torch.float16)
    """
    if name == "auto":
        return torch.bfloat16 if (device if isinstance(device, str) else device.type) == "cuda" else None
    if name not in _AUTOCAST_NAMES:
        raise ValueError(f"[yolo_func] unknown precision {name!r}; expected 'auto' or one of {sorted(_AUTOCAST_NAMES)}")
    return _AUTOCAST_NAMES[name]


def eval_autocast_dtype(name: str, device: torch.device | str) -> torch.dtype | None:
    """The autocast dtype a precision name means for validation / prediction on ``device``.

    As :func:`autocast_dtype`, except that ``"auto"`` is **FP16** on CUDA (float32 elsewhere): the
    network's outputs feed box regression at IoU thresholds up to 0.95, where BF16's 8-bit mantissa
    shows. Measured on one H200 (``benchmarks/results/eval_precision_20261204T1635Z.md``): the same
    trained weights gave internal box mAP50-95 0.702 under BF16, 0.7543 under FP16 and 0.7544 in
    FP32, against 0.7533 from the reference's own ``val``. FP16 autocast is also what the reference
    validates with during training. Training keeps :func:`autocast_dtype`'s BF16.

    Raises:
      ValueError: an unknown name.

    Example:
      >>> from yolo_func.func import eval_autocast_dtype
      >>> eval_autocast_dtype("auto", "cuda"), eval_autocast_dtype("auto", "cpu"), eval_autocast_dtype("bf16", "cuda")
      (torch.float16, None, torch.bfloat16)
    """
    if name == "auto":
        return torch.float16 if (device if isinstance(device, str) else device.type) == "cuda" else None
    return autocast_dtype(name, device)


def autocast(device: torch.device | str, dtype: torch.dtype | None):
    """``torch.autocast(device.type, dtype, cache_enabled=False)``, or a no-op when ``dtype`` is None.

    The weight cache is off so eager and captured steps cast the same way (and capture is legal:
    the cache would freeze a half-precision copy of the parameters made at capture time into the
    graph).

    Args:
      device: the device (or its type string, e.g. ``"cuda"``) the autocast region runs on.
      dtype: ``torch.bfloat16``, ``torch.float16`` or None.

    Example:
      >>> import torch
      >>> from yolo_func.func import autocast
      >>> with autocast("cpu", torch.bfloat16):
      ...     y = torch.ones(2, 2) @ torch.ones(2, 2)
      >>> y.dtype
      torch.bfloat16
      >>> with autocast("cpu", None):                        # a no-op
      ...     (torch.ones(2, 2) @ torch.ones(2, 2)).dtype
      torch.float32
    """
    if dtype is None:
        return contextlib.nullcontext()
    device_type = device if isinstance(device, str) else device.type
    return torch.autocast(device_type, dtype=dtype, cache_enabled=False)


def first_order(pullback: Callable) -> Callable:
    """``pullback`` run under ``torch.no_grad()``: a torch.func pullback then skips building a graph
    of the backward (``create_graph=False``) and autograd picks the native first-order backward
    kernels (e.g. one ``silu_backward`` instead of its five-op differentiable decomposition), as
    ``loss.backward()`` does. :func:`yolo_func.capture.capture_vjp` records its backward through
    this too, so eager and replayed gradients stay bitwise equal.

    Args:
      pullback: ``(*cotangents, **kwargs) -> gradients`` (keyword arguments such as
        ``retain_graph=False`` are passed through).

    Example:
      >>> import torch
      >>> from yolo_func.func import first_order
      >>> x = torch.tensor([1.0, 2.0])
      >>> y, pullback = torch.func.vjp(lambda t: (t ** 2).sum(), x)
      >>> first_order(pullback)(torch.tensor(1.0))          # d/dx sum(x^2) = 2x, without a graph of the backward
      (tensor([2., 4.]),)
    """
    def run(*cotangents, **kwargs):
        with torch.no_grad():
            return pullback(*cotangents, **kwargs)

    return run


_VJP = threading.local()

#: the differentiation backends of :func:`flat_vjp` (:func:`vjp_backend`)
VJP_BACKENDS = ("func", "autograd")


def current_vjp_backend() -> str:
    """The backend :func:`flat_vjp` uses on this thread now: ``"func"`` (the default) or
    ``"autograd"`` (inside :func:`vjp_backend`).

    Example:
      >>> from yolo_func.func import current_vjp_backend, vjp_backend
      >>> with vjp_backend("autograd"):
      ...     inside = current_vjp_backend()
      >>> inside, current_vjp_backend()
      ('autograd', 'func')
    """
    return "autograd" if getattr(_VJP, "autograd", False) else "func"


@contextlib.contextmanager
def vjp_backend(name: str) -> Iterator[None]:
    """Within the block (this thread only), :func:`flat_vjp` differentiates through ``name``.

    - ``"func"`` (the default outside any block): ``torch.func.vjp``. Composes with outer
      ``torch.func`` transforms (``vmap`` of a step, per-sample gradients). Its first pullback in a
      process imports ``torch._dynamo`` (functorch's backward enters
      ``torch._dynamo.compiled_autograd._disable()``): measured 4.9-5.1 s of interpreter time on
      the H200 host (``benchmarks/results/startup_*``), the largest piece of a short fit's start-up.
    - ``"autograd"``: :func:`autograd_vjp` — every primal leaf replaced by a fresh
      ``requires_grad`` leaf and one ``torch.autograd.grad`` call. The same forward bits and the
      same backward kernels (the same dispatched ops, counted); the gradients equal ``"func"``'s
      up to float summation order (autograd's engine accumulates a multiply-used tensor's
      gradient in another order: ~1e-6 relative, measured on yolov8n). Never imports
      ``torch._dynamo``. Does not compose with outer ``torch.func`` transforms.

    Each backend is deterministic and a replayed step equals its own eager step bitwise
    whichever backend both use; mixing backends between a replay and its eager reference does not.

    Args:
      name: ``"func"`` or ``"autograd"``.

    Raises:
      ValueError: any other name.

    Example:
      >>> import torch
      >>> from yolo_func.func import flat_vjp, vjp_backend, current_vjp_backend
      >>> with vjp_backend("autograd"):
      ...     out, pullback, aux = flat_vjp(lambda p: ((p["w"] * 3).sum(), {}), {"w": torch.ones(2)})
      ...     current_vjp_backend()
      'autograd'
      >>> pullback(torch.tensor(1.0))[0]["w"], current_vjp_backend()
      (tensor([3., 3.]), 'func')
    """
    if name not in VJP_BACKENDS:
        raise ValueError(f"[yolo_func] vjp backend must be one of {list(VJP_BACKENDS)}, got {name!r}")
    before = getattr(_VJP, "autograd", False)
    _VJP.autograd = name == "autograd"
    try:
        yield
    finally:
        _VJP.autograd = before


@contextlib.contextmanager
def vjp_through_autograd() -> Iterator[None]:
    """``vjp_backend("autograd")``, for warm-up runs whose results are discarded.

    Before a capture, one eager run sets up the CUDA state the step needs (kernel modules, cuDNN
    plans, cuBLAS handles) — the same kernels through autograd as through ``torch.func`` —
    without functorch's pullback, whose first call imports ``torch._dynamo``
    (:func:`vjp_backend`). The values equal ``torch.func``'s up to the backward's summation order;
    never use it for a step that counts under the ``"func"`` backend.

    Example:
      >>> import torch
      >>> from yolo_func.func import flat_vjp, vjp_through_autograd
      >>> with vjp_through_autograd():
      ...     out, pullback, aux = flat_vjp(lambda p: ((p["w"] * 3).sum(), {}), {"w": torch.ones(2)})
      >>> pullback(torch.tensor(1.0))[0]["w"]
      tensor([3., 3.])
    """
    with vjp_backend("autograd"):
        yield


def dynamo_imported() -> bool:
    """Whether ``torch._dynamo`` is fully imported (an import under way on another thread: False).

    Example:
      >>> import torch._dynamo
      >>> from yolo_func.func import dynamo_imported
      >>> dynamo_imported()
      True
    """
    m = sys.modules.get("torch._dynamo")
    return m is not None and not getattr(getattr(m, "__spec__", None), "_initializing", False)


def flat_vjp(fn: Callable[..., tuple[Any, Any]], *primals: Any):
    """``torch.func.vjp(fn, *primals, has_aux=True)`` with every tree crossing the transform as a
    flat tuple of leaves.

    torch.func walks its arguments, outputs and aux with torch's Python pytree on every call; for
    the network's nested dicts (hundreds of leaves) that is milliseconds of host time per step.
    Here optree (C++) flattens the primals, ``fn`` sees them rebuilt, and its outputs and aux
    leave the transform flat. The aux must not depend on the primals (BN statistics do not: they
    are updated in place on plain tensors).

    Args:
      fn: ``(*primals) -> (outputs, aux)``.
      primals: pytrees of tensors (differentiated).

    Returns:
      ``(outputs, pullback: cotangents (outputs' tree) -> tuple of gradient trees, aux)``.

    Example:
      >>> import torch
      >>> from yolo_func.func import flat_vjp
      >>> def fn(p):                                          # a tree in, (output, aux) out
      ...     return (p["w"] * 3).sum(), {"n": p["w"].detach().sum()}
      >>> out, pullback, aux = flat_vjp(fn, {"w": torch.ones(2)})
      >>> out, aux, pullback(torch.tensor(1.0))[0]["w"]
      (tensor(6.), {'n': tensor(2.)}, tensor([3., 3.]))
    """
    if getattr(_VJP, "autograd", False):  # vjp_backend("autograd") (see there)
        return autograd_vjp(fn, *primals)
    flat, defs = [], []
    for p in primals:
        leaves, treedef = T.tree_flatten(p)
        flat.append(tuple(leaves))
        defs.append(treedef)
    box: dict[str, Any] = {}

    def flat_fn(*leaf_tuples):
        out, aux = fn(*(T.tree_unflatten(d, list(ls)) for d, ls in zip(defs, leaf_tuples)))
        out_leaves, box["out_def"] = T.tree_flatten(out)
        aux_leaves, box["aux_def"] = T.tree_flatten(aux)
        return tuple(out_leaves), tuple(aux_leaves)

    out_leaves, pullback, aux_leaves = vjp(flat_fn, *flat, has_aux=True)

    def flat_pullback(cotangents: Any) -> tuple[Any, ...]:
        grads = pullback(tuple(T.tree_leaves(cotangents)))
        return tuple(T.tree_unflatten(d, list(g)) for d, g in zip(defs, grads))

    return (T.tree_unflatten(box["out_def"], list(out_leaves)), flat_pullback,
            T.tree_unflatten(box["aux_def"], list(aux_leaves)))


def autograd_vjp(fn: Callable[..., tuple[Any, Any]], *primals: Any):
    """:func:`flat_vjp`'s contract through ``torch.autograd`` instead of ``torch.func``.

    ``torch.func.vjp`` cannot differentiate a ``torch.compile``'d function (dynamo does not run
    under functorch's transforms); autograd can: AOTAutograd compiles the forward and backward of
    a function whose inputs are ``requires_grad`` leaves. Here every primal leaf is replaced by a
    fresh leaf (``detach().requires_grad_()``: same storage, so in-place updates of the originals
    are seen by later calls), ``fn`` runs under ``torch.enable_grad()``, and the pullback is one
    ``torch.autograd.grad`` call. The outputs are returned detached (as ``torch.func.vjp`` returns
    plain tensors); the graph behind them lives in the pullback.

    Args:
      fn: ``(*primals) -> (outputs, aux)``; ``aux`` must not depend on the primals.
      primals: pytrees of floating tensors (differentiated).

    Returns:
      ``(outputs, pullback, aux)``; ``pullback(cotangents, retain_graph=False) -> tuple of
      gradient trees`` (one per primal; zeros where an input does not reach the outputs). Call it
      once (or pass ``retain_graph=True``).

    Example:
      >>> import torch
      >>> from yolo_func.func import autograd_vjp
      >>> def fn(p):                                          # a tree in, (output, aux) out
      ...     return (p["w"] * 3).sum(), {"n": p["w"].detach().sum()}
      >>> out, pullback, aux = autograd_vjp(fn, {"w": torch.ones(2)})
      >>> out, aux, pullback(torch.tensor(1.0))[0]["w"]
      (tensor(6.), {'n': tensor(2.)}, tensor([3., 3.]))
    """
    trees, flat_in, counts = [], [], []
    for p in primals:
        leaves, treedef = T.tree_flatten(p)
        fresh = [x.detach().requires_grad_(True) for x in leaves]
        trees.append((treedef, len(fresh)))
        flat_in.extend(fresh)
    it = iter(flat_in)
    args = [T.tree_unflatten(d, [next(it) for _ in range(n)]) for d, n in trees]
    with torch.enable_grad():
        out, aux = fn(*args)
    out_leaves, out_def = T.tree_flatten(out)

    def pullback(cotangents: Any, *, retain_graph: bool = False) -> tuple[Any, ...]:
        cts = T.tree_leaves(cotangents)
        if len(cts) != len(out_leaves):
            raise ValueError(f"[yolo_func] autograd_vjp: {len(cts)} cotangent leaves for {len(out_leaves)} outputs")
        pairs = [(o, c) for o, c in zip(out_leaves, cts) if o.requires_grad]
        grads = torch.autograd.grad([o for o, _ in pairs], flat_in, [c for _, c in pairs], retain_graph=retain_graph,
                                    allow_unused=True) if pairs else [None] * len(flat_in)
        grads = [torch.zeros_like(x) if g is None else g for x, g in zip(flat_in, grads)]
        gi = iter(grads)
        return tuple(T.tree_unflatten(d, [next(gi) for _ in range(n)]) for d, n in trees)

    return T.tree_unflatten(out_def, [o.detach() for o in out_leaves]), pullback, aux


class _Cat(torch.autograd.Function):
    """``torch.cat`` with a one-op backward: autograd's own backward of ``cat`` narrows the
    gradient once per input (one ``slice`` each); this one splits it (one ``split_with_sizes``,
    the same views). Usable under ``torch.func`` transforms (``setup_context`` form)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(dim, *xs):
        return torch.cat(xs, dim)

    @staticmethod
    def setup_context(ctx, inputs, output):
        dim, xs = inputs[0], inputs[1:]
        ctx.dim = dim
        ctx.sizes = [x.shape[dim] for x in xs]
        ctx.dtypes = [x.dtype for x in xs]

    @staticmethod
    def backward(ctx, g):
        parts = g.split(ctx.sizes, ctx.dim)
        # as autograd's cat backward: each input's gradient in that input's dtype (a cast only
        # where the dtypes of the inputs differed, e.g. under autocast's type promotion)
        return (None, *(p if p.dtype == dt else p.to(dt) for p, dt in zip(parts, ctx.dtypes)))


_CAT_FUNCTION = True  # tests switch it off to compare with plain torch.cat
_CAT_ON_CPU = False  # tests switch it on to run the Function on CPU tensors


def cat(xs, dim: int = 0) -> torch.Tensor:
    """``torch.cat(xs, dim)``, the same values forward and backward, with a backward of one op.

    Autograd's backward of ``torch.cat`` over ``n`` inputs dispatches ``n`` ``slice`` ops; this
    one dispatches one ``split_with_sizes`` giving the same views (the network's C2f blocks, SPPF
    and neck concatenations, the heads' level flattening). Inside ``torch.compile``, when no
    input needs a gradient, and for CPU tensors (where the Function's host cost outweighs the ops
    it saves) it is ``torch.cat`` itself.

    Args:
      xs: sequence of tensors, equal shapes except along ``dim``.
      dim: the concatenation axis (negative allowed).

    Returns:
      the concatenation, as ``torch.cat``.

    Example:
      >>> import torch
      >>> a, b = torch.ones(2, 1, requires_grad=True), torch.zeros(2, 2, requires_grad=True)
      >>> y = cat([a, b], 1)
      >>> y.shape, torch.equal(y, torch.cat([a, b], 1))
      (torch.Size([2, 3]), True)
      >>> ga, gb = torch.autograd.grad((y * torch.arange(6.0).view(2, 3)).sum(), (a, b))
      >>> ga.tolist(), gb.tolist()
      ([[0.0], [3.0]], [[1.0, 2.0], [4.0, 5.0]])
    """
    xs = tuple(xs)
    if (not _CAT_FUNCTION or torch.compiler.is_compiling() or not torch.is_grad_enabled()
            or not any(isinstance(x, torch.Tensor) and x.requires_grad for x in xs)
            or (xs[0].is_cpu and not _CAT_ON_CPU)):
        # On the CPU the Function costs more host time than the slices it saves: under torch.func
        # (the eager step's default vjp) functorch builds a single-level Function class per call
        # (about 0.3 ms; 15 calls: +6 ms of a 65 ms step at 64 px, benchmarks/results/eager_ops_2026-12-05.md).
        # Both vjp backends take this branch, so they keep dispatching the same ops.
        return torch.cat(xs, dim)
    return _Cat.apply(dim if dim >= 0 else dim + xs[0].dim(), *xs)
