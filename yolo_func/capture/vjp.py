"""Replay a pure function's forward pass and its ``torch.func.vjp`` as two CUDA graphs.

:func:`capture_vjp` turns ``fn(params, state, x) -> (outputs, new_state)`` (for example
``lambda p, s, x: model.network.apply(p, s, x, train=True)``) into a :class:`Captured` pair of
replayable calls, bitwise equal to running ``torch.func.vjp`` eagerly with the same inputs.

How it works
------------
*Static buffers.* A CUDA graph replays fixed kernels on fixed addresses, so every tensor that
crosses the graph boundary lives in a buffer that outlives the graphs and is never rebound:
parameters, state (BatchNorm running statistics), the input ``x`` (clones of what
:func:`capture_vjp` was given, same layout), the outputs, the output cotangents and the parameter
gradients. They are exposed as ``captured.static`` (:class:`StaticBuffers`).
``forward``/``backward`` copy their arguments into the input buffers with one fused
``torch._foreach_copy_``, skipping every leaf that already *is* the static leaf (identity, or the
same ``data_ptr`` and strides). A training step that keeps ``captured.static.params`` as its
parameters and updates them in place (``torch._foreach_add_``, an in-place optimizer) pays no copy.

*Two graphs, one pool.* Graph 1 records ``torch.func.vjp(lambda p: fn(p, state, x), params,
has_aux=True)``: the forward pass plus everything the pullback saves. Graph 2 records the pullback
applied to the static cotangent buffers. Both are captured into one memory pool (private unless
``pool`` is given), so graph 2 reads the activations graph 1 wrote. The pullback closure (and so
its saved activations), the outputs and the gradients are kept alive by :class:`Captured`; the
pool's other blocks are scratch that each replay rewrites. Eager code between ``forward`` and
``backward`` (heads, losses) allocates from the ordinary caching allocator and cannot disturb them.

*The forward's context (e.g. BatchNorm in place).* ``forward_context`` is a factory of a context
manager entered around every forward (warm-up and capture); this package knows nothing of the
layers. The training step passes :func:`yolo_func.nn.update_stats_in_place`, so the recorded BN
kernels write the new running statistics straight into the static state buffers: each forward
replay updates them exactly once, like one eager step, and ``forward`` returns the static state
tree itself as the new state (pass it back in and no copy happens). Without it the new statistics
land in pool buffers that ``forward`` returns; passing them back in copies them into the static
state.

*Warm-up and restoration.* Before capture, ``warmup`` eager forward+pullback runs on a side stream
initialise cuDNN/cuBLAS handles and workspaces (work that must not happen during capture). The
static state and the states of the registered generators (and the device's default CUDA
generator) are snapshotted first; the state is restored after warm-up and again after capture, the
generators after warm-up (capturing advances only a graph-internal offset), so neither leaves a
trace: the first replay starts from exactly the statistics and random streams that were passed in.
Registered generators are attached to both graphs (``register_generator_state``), so every replay
draws fresh numbers, as eager calls would.

*Autocast.* With ``autocast_dtype`` the forward runs under ``torch.autocast("cuda", dtype,
cache_enabled=False)`` in warm-up and capture: the autocast weight cache would otherwise hold a
bf16 copy of the parameters made at capture time, and the replays would keep using it after the
parameters change. The pullback runs outside autocast and under ``torch.no_grad()`` (first order:
native backward kernels), as in the eager counterpart (``out, vjp_fn = vjp(...)`` under autocast;
``yolo_func.func.first_order(vjp_fn)(ct)`` after it).

What invalidates a capture
--------------------------
Anything that changes which kernels or addresses the graphs use: another shape, dtype, device,
memory format (channels_last vs contiguous) or tree structure of ``params``, ``state`` or ``x``.
:class:`CaptureSignature` records all of them; a call that differs raises :class:`CaptureMismatch`
showing both signatures: there is never a silent re-capture. Hold one :class:`Captured` per input
shape in a bounded :class:`yolo_func.capture.CaptureCache` for multi-scale training. Rebinding the static buffers
(assigning new tensors into ``captured.static.params``) detaches them from the graphs; update them
in place only. Global flags read at capture time are frozen into the graphs: for bitwise parity
with eager, ``torch.backends.cudnn.benchmark``/``deterministic``/``allow_tf32`` must be the same
for the eager run as they were at capture.

Aliasing
--------
``forward`` returns the static output buffers and ``backward`` the static gradient buffers: the
next replay overwrites them. Clone what you keep; accumulate gradients into separate buffers.
Captures that share a pool (``pool=...``, e.g. all entries of a :class:`yolo_func.capture.CaptureCache`) must be
replayed as forward→backward pairs, and their returned buffers consumed before another capture of
the same pool replays: one capture's scratch may be another's outputs. ``backward`` raises if
another capture of its pool replayed since its ``forward``.

Memory
------
Static inputs cost one copy of params, state and ``x``; the pool holds one step's activations,
outputs and gradients (about what one eager step peaks at, plus scratch). The backward is captured
with ``retain_graph=False``: each saved activation is released once its backward node has run, so
the backward's scratch reuses that memory as in an eager backward. The released blocks are free
to later captures of the same pool; that is safe under the pairing rule above (a forward rewrites
its activations before its backward reads them). Warm-up temporarily allocates one eager step's
worth from the caching allocator (freed, cached for reuse).

Example (needs a GPU)::

    model = yolo_func.yolov8("n")
    params, state = yolo_func.tree.tree_to(model.init(torch.Generator().manual_seed(0)), "cuda")
    fn = lambda p, s, x: model.network.apply(p, s, x, train=True)
    cap = capture_vjp(fn, params["network"], state["network"], images, autocast_dtype=torch.bfloat16,
                      forward_context=yolo_func.nn.update_stats_in_place)
    feats, _ = cap.forward(cap.static.params, cap.static.state, images)   # replays graph 1
    grads = cap.backward(d_feats)                                         # replays graph 2
    torch._foreach_add_(tree_leaves(cap.static.params), tree_leaves(grads), alpha=-lr)  # SGD, in place
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections.abc import Callable, Iterator
from typing import Any, ContextManager, NamedTuple

import torch

from yolo_func import tree as T
from yolo_func.capture.binder import CAPTURE_ERROR_MODE, Binder, check_available, gc_paused
from yolo_func.capture.counter import count_capture
from yolo_func.capture.signature import CaptureSignature, check_autocast
from yolo_func.func import autocast, autograd_vjp, current_vjp_backend, first_order

__all__ = ["capture_vjp", "Captured", "CaptureStats", "StaticBuffers"]

PyTree = Any


class StaticBuffers(NamedTuple):
    """The tensors the graphs read and write (never rebind them; update in place only).

    Attributes:
      params, state, x: inputs (trees like the ones given to :func:`capture_vjp`).
      outputs: ``fn``'s outputs (overwritten by every forward replay).
      new_state: ``fn``'s new state (``state`` itself when ``forward_context`` updates it in place).
      cotangents: output cotangents (same tree, shapes, dtypes and layouts as ``outputs``).
      grads: parameter gradients (same tree as ``params``; overwritten by every backward replay).

    Example:
      >>> from yolo_func.capture import StaticBuffers
      >>> StaticBuffers._fields                            # Captured.static: the graphs' tensors, updated in place
      ('params', 'state', 'x', 'outputs', 'new_state', 'cotangents', 'grads')
    """

    params: PyTree
    state: PyTree
    x: PyTree
    outputs: PyTree
    new_state: PyTree
    cotangents: PyTree
    grads: PyTree


@dataclasses.dataclass
class CaptureStats:
    """Counters of one capture (mutable; for tests and benchmarks).

    Attributes:
      capture_index: the process-wide number of this capture (see :func:`yolo_func.capture.num_captures`).
      forward_replays, backward_replays: replays so far.
      leaves_copied: input leaves copied by the last ``forward`` (0 when the static trees were passed).

    Example:
      >>> from yolo_func.capture import CaptureStats
      >>> CaptureStats(capture_index=1)                    # Captured.stats, counted by the replays
      CaptureStats(capture_index=1, forward_replays=0, backward_replays=0, leaves_copied=0)
    """

    capture_index: int
    forward_replays: int = 0
    backward_replays: int = 0
    leaves_copied: int = 0


class Captured(NamedTuple):
    """A captured forward/pullback pair (see the module docstring).

    Attributes:
      forward: ``(params, state, x) -> (outputs, new_state)``; copies inputs into the static
        buffers (skipped for leaves that are the static ones), replays graph 1, returns the static
        outputs (overwritten by the next replay: clone what you keep).
        Raises :class:`CaptureMismatch` for inputs with another signature.
      backward: ``d_outputs -> grads`` (same tree as params); copies the cotangents (same tree and
        shapes as outputs; other float dtypes are cast as autograd would) into the static buffers,
        replays graph 2, returns the static gradient buffers (overwritten by the next backward:
        accumulate into separate buffers). Raises ``RuntimeError`` before any ``forward``.
      signature: the captured :class:`CaptureSignature`.
      static: the :class:`StaticBuffers`.
      stats: :class:`CaptureStats`.
      pool: the graphs' memory pool handle (pass it to another capture to share the pool).

    Example:
      >>> from yolo_func.capture import Captured
      >>> Captured._fields                                 # what capture_vjp returns (CUDA)
      ('forward', 'backward', 'signature', 'static', 'stats', 'pool')
    """

    forward: Callable[[PyTree, PyTree, PyTree], tuple[PyTree, PyTree]]
    backward: Callable[[PyTree], PyTree]
    signature: CaptureSignature
    static: StaticBuffers
    stats: CaptureStats
    pool: Any

    def __repr__(self) -> str:
        return f"Captured({self.signature!r}, {self.stats})"


class _PoolToken:
    """Which capture of a shared pool replayed last (guards backward against interleaving)."""

    __slots__ = ("owner", "__weakref__")

    def __init__(self) -> None:
        self.owner = 0


_POOL_TOKENS: "weakref.WeakValueDictionary[Any, _PoolToken]" = weakref.WeakValueDictionary()


def _pool_token(pool: Any) -> _PoolToken:
    token = _POOL_TOKENS.get(pool)
    if token is None:
        token = _PoolToken()
        _POOL_TOKENS[pool] = token
    return token


class _Replay:
    """Holds the graphs and the binders; its bound methods are ``Captured.forward`` / ``backward``.
    The saved activations live in the pool at the addresses both graphs recorded (nothing else
    replays in between: see the pool token)."""

    def __init__(self, *, index, g_fwd, g_bwd, inputs: Binder, cotangents: Binder, static, stats, token):
        self.index, self.g_fwd, self.g_bwd = index, g_fwd, g_bwd
        self.inputs, self.cotangents, self.static, self.stats, self.token = inputs, cotangents, static, stats, token
        self.forwarded = False

    def forward(self, params: PyTree, state: PyTree, x: PyTree) -> tuple[PyTree, PyTree]:
        self.stats.leaves_copied = self.inputs.load(params, state, x)
        self.g_fwd.replay()
        self.token.owner = self.index
        self.forwarded = True
        self.stats.forward_replays += 1
        return self.static.outputs, self.static.new_state

    def backward(self, d_outputs: PyTree) -> PyTree:
        if not self.forwarded:
            raise RuntimeError(
                "[yolo_func] Captured.backward() called before any forward(): graph 2 replays the pullback "
                "of the activations graph 1 saves; call forward(params, state, x) first"
            )
        if self.token.owner != self.index:
            raise RuntimeError(
                "[yolo_func] Captured.backward(): another capture sharing this memory pool replayed since this "
                "capture's forward(), so the saved activations may be overwritten; replay forward() and "
                "backward() of one capture as a pair"
            )
        self.cotangents.load(d_outputs)
        self.g_bwd.replay()
        self.stats.backward_replays += 1
        return self.static.grads


def _check_args(fn, warmup, autocast_dtype, generators) -> tuple:
    if not callable(fn):
        raise TypeError(f"[yolo_func] capture_vjp: fn must be callable, got {type(fn).__name__}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
        raise ValueError(
            f"[yolo_func] capture_vjp: warmup must be an int >= 1 (cuDNN/cuBLAS set-up must happen before "
            f"capture), got {warmup!r}"
        )
    check_autocast(autocast_dtype)
    generators = tuple(generators)
    for g in generators:
        if not isinstance(g, torch.Generator):
            raise TypeError(f"[yolo_func] capture_vjp: generators must be torch.Generator, got {type(g).__name__}")
        if g.device.type != "cuda":
            raise ValueError(
                f"[yolo_func] capture_vjp: generators must be CUDA generators (a graph replays device RNG only), "
                f"got one on {g.device}"
            )
    return generators


@contextlib.contextmanager
def _forward_context(autocast_dtype: torch.dtype | None,
                     forward_context: Callable[[], ContextManager] | None) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        stack.enter_context(autocast("cuda", autocast_dtype))
        if forward_context is not None:
            stack.enter_context(forward_context())
        yield


def capture_vjp(
    fn: Callable[[PyTree, PyTree, PyTree], tuple[PyTree, PyTree]],
    params: PyTree,
    state: PyTree,
    x: PyTree = (),
    *,
    warmup: int = 3,
    autocast_dtype: torch.dtype | None = None,
    generators: tuple[torch.Generator, ...] = (),
    pool: Any = None,
    forward_context: Callable[[], ContextManager] | None = None,
    vjp: Callable | None = None,
) -> Captured:
    """Capture ``fn``'s forward pass and its pullback w.r.t. ``params`` as two CUDA graphs.

    Args:
      fn: pure ``(params, state, x) -> (outputs, new_state)``; ``outputs`` a tuple/NamedTuple (any
        pytree) of floating tensors, e.g. ``Feats(p3, p4, p5)``; ``new_state`` a pytree.
      params: pytree of float tensors on one CUDA device (differentiated).
      state: pytree of tensors (BN running statistics; not differentiated).
      x: ``float[B, C, H, W]`` or ``uint8[B, C, H, W]`` (or any pytree of tensors, ``()`` when
        ``fn`` needs none; not differentiated).
      warmup: eager warm-up iterations on a side stream (>= 1).
      autocast_dtype: ``None`` (no autocast), ``torch.bfloat16`` or ``torch.float16``; the forward
        runs under ``torch.autocast("cuda", dtype, cache_enabled=False)``.
      generators: CUDA generators ``fn`` draws from, attached to both graphs; their states (and the
        default CUDA generator's) are restored after warm-up.
      pool: a memory pool handle to share (``torch.cuda.graph_pool_handle()``, another
        ``Captured.pool``); ``None`` makes a private one. See "Aliasing" in the module docstring.
      forward_context: a zero-argument factory of a context manager entered around every forward
        (warm-up and capture), e.g. :func:`yolo_func.nn.update_stats_in_place` to record BN
        statistic updates straight into the static state buffers; None: no context.
      vjp: ``(f, params) -> (outputs, pullback, new_state)`` with ``f: params -> (outputs,
        new_state)``, the differentiation recorded in both graphs; None: the calling thread's
        backend (:func:`yolo_func.func.vjp_backend`): ``torch.func.vjp`` (``has_aux=True``), or
        :func:`yolo_func.func.autograd_vjp` inside ``vjp_backend("autograd")``.
        :func:`yolo_func.func.autograd_vjp` for a ``torch.compile``'d ``fn``
        (:class:`yolo_func.train.compiled.CompiledModel`).

    Returns:
      :class:`Captured`. Its static buffers start as copies of ``params``, ``state`` and ``x``,
      which are left untouched.

    Raises:
      CaptureUnavailable: an input is not on a CUDA device, CUDA is unavailable, or a capture is
        already underway.
      TypeError, ValueError: bad arguments (non-tensor leaves, mixed devices, CPU generators, ...).

    Example:
      >>> import torch
      >>> from yolo_func.capture import CaptureUnavailable, capture_vjp
      >>> def fn(params, state, x):                         # (outputs, new_state); here y = sum(w * x)
      ...     return (params["w"] * x).sum(), state
      >>> # on CUDA: cap = capture_vjp(fn, params, state, x); y, s = cap.forward(params, state, x); g = cap.backward(dy)
      >>> try:                                              # CPU tensors cannot be captured; the reason is given
      ...     capture_vjp(fn, {"w": torch.ones(2)}, {}, torch.ones(2))
      ... except CaptureUnavailable as e:
      ...     print(e.reason)
      inputs are on cpu, not a CUDA device (first: params/w)
    """
    generators = _check_args(fn, warmup, autocast_dtype, generators)
    if forward_context is not None and not callable(forward_context):
        raise TypeError(f"[yolo_func] capture_vjp: forward_context must be a zero-argument factory of a "
                        f"context manager (e.g. yolo_func.nn.update_stats_in_place) or None, got "
                        f"{type(forward_context).__name__}")
    if vjp is not None and not callable(vjp):
        raise TypeError(f"[yolo_func] capture_vjp: vjp must be callable (e.g. yolo_func.func.autograd_vjp) or None, "
                        f"got {type(vjp).__name__}")
    device = check_available({"params": params, "state": state, "x": x}, generators)
    if vjp is None and current_vjp_backend() == "autograd":
        vjp = autograd_vjp  # as the eager step differentiates on this thread (flat_vjp)

    static_params, static_state, static_x = T.tree_clone(params), T.tree_clone(state), T.tree_clone(x)
    inputs = Binder({"params": static_params, "state": static_state, "x": static_x}, autocast_dtype, what="inputs")

    def run_forward():
        with _forward_context(autocast_dtype, forward_context):
            if vjp is None:
                return torch.func.vjp(lambda p: fn(p, static_state, static_x), static_params, has_aux=True)
            return vjp(lambda p: fn(p, static_state, static_x), static_params)

    with torch.cuda.device(device):
        # Snapshot everything warm-up may advance: BN statistics and random streams.
        # The default generator is attached to every capture by torch itself; ours are the others.
        default_gen = torch.cuda.default_generators[device.index]
        generators = tuple(g for g in generators if g is not default_gen)
        all_gens = generators + (default_gen,)
        state_backup = T.tree_clone(static_state)
        gen_backup = [g.get_state() for g in all_gens]

        def restore_state():
            T.tree_copy_(static_state, state_backup)

        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(warmup):
                out, vjp_fn, _ = run_forward()
                first_order(vjp_fn)(T.tree_map(torch.ones_like, out))  # as the eager step's pullback
                # Drop this run's activations before the next forward: otherwise two runs' worth
                # are alive at once and warm-up, not the graphs, sets the peak (~1.7x eager).
                del out, vjp_fn
        torch.cuda.current_stream(device).wait_stream(side)
        restore_state()
        # Generators are restored before capture; capturing advances only a graph-internal offset.
        for g, g_state in zip(all_gens, gen_backup):
            g.set_state(g_state)

        g_fwd, g_bwd = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        for g in generators:
            g_fwd.register_generator_state(g)
            g_bwd.register_generator_state(g)
        pool = torch.cuda.graph_pool_handle() if pool is None else pool
        with gc_paused(), torch.cuda.graph(g_fwd, pool=pool, capture_error_mode=CAPTURE_ERROR_MODE):  # see whole_step.py
            outputs, vjp_fn, new_state = run_forward()
        # Cotangent buffers live outside the pool: they are inputs, written by the caller.
        cotangents = T.tree_map(torch.zeros_like, outputs)
        # retain_graph=False: the pullback releases each saved activation once its backward node
        # has run, so the backward's scratch reuses that memory within the pool, as an eager
        # backward does (with the activations kept alive, the pool held both: ~1.3x the eager
        # peak). Replays read and write the recorded addresses; the closure is not called again.
        with gc_paused(), torch.cuda.graph(g_bwd, pool=pool, capture_error_mode=CAPTURE_ERROR_MODE):
            (grads,) = first_order(vjp_fn)(cotangents, retain_graph=False)
        del vjp_fn
        restore_state()  # capture executes nothing, but keep the promise cheap and explicit
        del state_backup, gen_backup

    index = count_capture()
    static = StaticBuffers(static_params, static_state, static_x, outputs, new_state, cotangents, grads)
    stats = CaptureStats(capture_index=index)
    cot_binder = Binder({"d_outputs": cotangents}, None, what="output cotangents", fields=("shape", "device"))
    replay = _Replay(index=index, g_fwd=g_fwd, g_bwd=g_bwd, inputs=inputs, cotangents=cot_binder,
                     static=static, stats=stats, token=_pool_token(pool))
    return Captured(replay.forward, replay.backward, inputs.signature, static, stats, pool)


