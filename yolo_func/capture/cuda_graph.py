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

*BatchNorm in place.* With ``bn_in_place=True`` the capture runs inside
:func:`yolo_func.nn.update_stats_in_place`, so the recorded BN kernels write the new running
statistics straight into the static state buffers: each forward replay updates them exactly once,
like one eager step, and ``forward`` returns the static state tree itself as the new state (pass it
back in and no copy happens). With ``bn_in_place=False`` the new statistics land in pool buffers
that ``forward`` returns; passing them back in copies them into the static state.

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
``yolo_func.train.first_order(vjp_fn)(ct)`` after it).

What invalidates a capture
--------------------------
Anything that changes which kernels or addresses the graphs use: another shape, dtype, device,
memory format (channels_last vs contiguous) or tree structure of ``params``, ``state`` or ``x``.
:class:`CaptureSignature` records all of them; a call that differs raises :class:`CaptureMismatch`
showing both signatures: there is never a silent re-capture. Hold one :class:`Captured` per input
shape in a bounded :class:`CaptureCache` for multi-scale training. Rebinding the static buffers
(assigning new tensors into ``captured.static.params``) detaches them from the graphs; update them
in place only. Global flags read at capture time are frozen into the graphs: for bitwise parity
with eager, ``torch.backends.cudnn.benchmark``/``deterministic``/``allow_tf32`` must be the same
for the eager run as they were at capture.

Aliasing
--------
``forward`` returns the static output buffers and ``backward`` the static gradient buffers: the
next replay overwrites them. Clone what you keep; accumulate gradients into separate buffers.
Captures that share a pool (``pool=...``, e.g. all entries of a :class:`CaptureCache`) must be
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
    cap = capture_vjp(fn, params["network"], state["network"], images, autocast_dtype=torch.bfloat16)
    feats, _ = cap.forward(cap.static.params, cap.static.state, images)   # replays graph 1
    grads = cap.backward(d_feats)                                         # replays graph 2
    torch._foreach_add_(tree_leaves(cap.static.params), tree_leaves(grads), alpha=-lr)  # SGD, in place
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import weakref
from collections.abc import Callable, Hashable, Iterator, Mapping
from typing import Any, NamedTuple

import torch

from yolo_func import tree as T
from yolo_func.nn.batchnorm import update_stats_in_place

__all__ = [
    "capture_vjp",
    "Captured",
    "CaptureCache",
    "CaptureCacheFull",
    "CaptureMismatch",
    "CaptureSignature",
    "CaptureStats",
    "CaptureUnavailable",
    "StaticBuffers",
    "TensorSpec",
    "memory_format_of",
    "num_captures",
    "signature_of",
]

PyTree = Any

_AUTOCAST_DTYPES = (None, torch.bfloat16, torch.float16)


# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------
class CaptureUnavailable(RuntimeError):
    """Capture cannot be used for these inputs (CPU tensors, no CUDA, a capture already underway,
    a full :class:`CaptureCache`). A caller falls back to eager and warns once with ``reason``.

    Attributes:
      reason: one line saying why.
    """

    def __init__(self, reason: str):
        self.reason = reason
        super().__init__(f"[yolo_func] CUDA-graph capture unavailable: {reason}")


class CaptureCacheFull(CaptureUnavailable):
    """A :class:`CaptureCache` holds ``max_entries`` captures and was asked for a new key.

    Attributes:
      key: the key that was not captured.
      keys: the keys held.
    """

    def __init__(self, key: Hashable, keys: tuple, max_entries: int):
        self.key, self.keys = key, keys
        super().__init__(
            f"capture cache full ({max_entries} entries, keys {list(keys)}); not capturing key {key!r} "
            f"(raise max_entries, or keep input shapes to a few buckets)"
        )


class CaptureMismatch(ValueError):
    """A call's inputs differ from what was captured (shape, dtype, device, memory format, tree).

    Attributes:
      expected: the captured :class:`CaptureSignature`.
      got: the call's :class:`CaptureSignature`.
      differences: the differing entries, one line each (also first in the message).
    """

    def __init__(self, expected: "CaptureSignature", got: "CaptureSignature", *, what: str = "inputs",
                 fields: tuple[str, ...] = ("shape", "dtype", "device", "memory_format")):
        self.expected, self.got = expected, got
        self.differences = got.differences(expected, fields=fields)
        diff = "\n".join(f"  {line}" for line in self.differences) or "  (no entry differs)"
        super().__init__(
            f"[yolo_func] the call's {what} do not match the captured signature; a CUDA graph replays "
            f"fixed shapes, dtypes, devices and layouts and is never re-captured silently (capture "
            f"again for these inputs, e.g. through a CaptureCache keyed by input shape). Differences:\n{diff}\n"
            f"call {got.describe()}\ncaptured {expected.describe()}"
        )


# --------------------------------------------------------------------------------------------
# Signatures
# --------------------------------------------------------------------------------------------
def memory_format_of(t: torch.Tensor) -> str:
    """``"channels_last"``, ``"contiguous"`` or ``"strided"`` (neither) for a tensor.

    4-D tensors that are both contiguous and channels_last (size-1 channel or spatial dims, e.g. a
    1x1 conv kernel) are told apart by their strides the way they were laid out: channels_last
    when the channel stride is below the width stride.
    """
    contiguous = t.is_contiguous()
    if t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last):
        if not contiguous or t.stride(1) < t.stride(3):
            return "channels_last"
    if contiguous:
        return "contiguous"
    return "strided"


def _dtype_name(dtype: torch.dtype | None) -> str:
    return "None" if dtype is None else str(dtype).replace("torch.", "")


class TensorSpec(NamedTuple):
    """What a captured kernel depends on for one tensor.

    Attributes:
      shape: the sizes.
      dtype: the element type.
      device: ``str(tensor.device)``, e.g. ``"cuda:0"``.
      memory_format: see :func:`memory_format_of`.
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: str
    memory_format: str

    @staticmethod
    def of(t: torch.Tensor) -> "TensorSpec":
        return TensorSpec(tuple(t.shape), t.dtype, str(t.device), memory_format_of(t))

    def render(self, fields: tuple[str, ...] = ("shape", "dtype", "device", "memory_format")) -> str:
        parts = []
        for f in fields:
            v = getattr(self, f)
            parts.append(_dtype_name(v) if f == "dtype" else str(v))
        return " ".join(parts)

    def __str__(self) -> str:
        return self.render()


class CaptureSignature(NamedTuple):
    """Everything a capture depends on: tree structures and per-leaf :class:`TensorSpec` of each
    input group (``params``, ``state``, ``x``), plus the autocast dtype. Hashable, so it can key a
    :class:`CaptureCache`.

    Attributes:
      treedefs: ``((group, treedef), ...)``.
      entries: ``((path, TensorSpec), ...)``, paths ``"params/..."``, ``"state/..."``, ``"x"``.
      autocast_dtype: ``None``, ``torch.bfloat16`` or ``torch.float16``.
    """

    treedefs: tuple[tuple[str, Any], ...]
    entries: tuple[tuple[str, TensorSpec], ...]
    autocast_dtype: torch.dtype | None

    def describe(self) -> str:
        """Multi-line listing: header, then one ``path: shape dtype device format`` per leaf."""
        lines = [f"signature (autocast {_dtype_name(self.autocast_dtype)}, {len(self.entries)} tensors):"]
        lines += [f"  {path}: {spec}" for path, spec in self.entries]
        return "\n".join(lines)

    def differences(self, captured: "CaptureSignature", *,
                    fields: tuple[str, ...] = ("shape", "dtype", "device", "memory_format")) -> list[str]:
        """Entries where ``self`` (a call) differs from ``captured``, one line each, e.g.
        ``x: (16, 3, 672, 672) != captured (16, 3, 640, 640)``. Empty when they agree on ``fields``."""
        out: list[str] = []
        if self.autocast_dtype != captured.autocast_dtype:
            out.append(f"autocast: {_dtype_name(self.autocast_dtype)} != captured {_dtype_name(captured.autocast_dtype)}")
        mine, theirs = dict(self.entries), dict(captured.entries)
        for path, _ in self.entries:
            if path not in theirs:
                out.append(f"{path}: not in the captured inputs")
        for path, _ in captured.entries:
            if path not in mine:
                out.append(f"{path}: missing (the capture has it)")
        for path, spec in self.entries:
            ref = theirs.get(path)
            if ref is None:
                continue
            diff = tuple(f for f in fields if getattr(spec, f) != getattr(ref, f))
            if diff:
                out.append(f"{path}: {spec.render(diff)} != captured {ref.render(diff)}")
        if not out:
            # same leaves, other containers (a tuple for a list, a NamedTuple for a dict, ...)
            for (group, a), (_, b) in zip(self.treedefs, captured.treedefs):
                if a != b:
                    out.append(f"{group}: tree structure {_short(repr(a))} != captured {_short(repr(b))}")
        return out

    def __str__(self) -> str:
        return self.describe()

    def __repr__(self) -> str:
        x = [f"{p}={s.shape}" for p, s in self.entries if p == "x" or p.startswith("x/")]
        return (f"CaptureSignature({len(self.entries)} tensors, {', '.join(x)}, "
                f"autocast={_dtype_name(self.autocast_dtype)})")


def _short(s: str, n: int = 160) -> str:
    return s if len(s) <= n else s[: n - 3] + "..."


def _group_entries(group: str, tree: PyTree) -> tuple[Any, list[tuple[str, TensorSpec]]]:
    items = T.tree_items(tree)
    entries = []
    for path, leaf in items:
        name = f"{group}/{path}" if path else group
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(f"[yolo_func] {name}: expected a torch.Tensor leaf, got {type(leaf).__name__}")
        entries.append((name, TensorSpec.of(leaf)))
    return T.tree_structure(tree), entries


def _signature_of_groups(groups: Mapping[str, PyTree], autocast_dtype: torch.dtype | None) -> CaptureSignature:
    treedefs, entries = [], []
    for group, tree in groups.items():
        treedef, e = _group_entries(group, tree)
        treedefs.append((group, treedef))
        entries += e
    return CaptureSignature(tuple(treedefs), tuple(entries), autocast_dtype)


def signature_of(params: PyTree, state: PyTree, x: PyTree, *, autocast_dtype: torch.dtype | None = None) -> CaptureSignature:
    """The :class:`CaptureSignature` of a call.

    Args:
      params, state: pytrees of tensors.
      x: a tensor (e.g. ``float[B, 3, H, W]``) or a pytree of tensors.
      autocast_dtype: the autocast dtype the capture runs under (``None``: no autocast).

    Raises:
      TypeError: a leaf is not a tensor.
    """
    _check_autocast(autocast_dtype)
    return _signature_of_groups({"params": params, "state": state, "x": x}, autocast_dtype)


def _check_autocast(autocast_dtype: Any) -> None:
    if autocast_dtype not in _AUTOCAST_DTYPES:
        raise ValueError(
            f"[yolo_func] autocast_dtype must be None, torch.bfloat16 or torch.float16, got {autocast_dtype!r}"
        )


# --------------------------------------------------------------------------------------------
# Static buffers and the copy-in logic (CPU-testable)
# --------------------------------------------------------------------------------------------
class _Binder:
    """The static leaves of some groups of trees, and the check-then-copy of call trees into them.

    ``load`` accepts a call's trees when their structure and each leaf's spec (restricted to
    ``fields``) equal the captured ones, copies every leaf that is not already the static leaf, and
    otherwise raises :class:`CaptureMismatch` with both full signatures.
    """

    def __init__(self, static: Mapping[str, PyTree], autocast_dtype: torch.dtype | None, *, what: str,
                 fields: tuple[str, ...] = ("shape", "dtype", "device", "memory_format")):
        self.static = dict(static)
        self.what, self.fields, self.autocast_dtype = what, fields, autocast_dtype
        self.signature = _signature_of_groups(self.static, autocast_dtype)
        self._groups = []
        for group, tree in self.static.items():
            leaves, treedef = T.tree_flatten(tree)
            specs = [spec for path, spec in self.signature.entries if path == group or path.startswith(group + "/")]
            self._groups.append((group, tree, treedef, leaves, specs))

    def _collect(self, tree: PyTree, static_tree: PyTree, treedef: Any, leaves: list, specs: list,
                 dst: list, src: list) -> bool:
        if tree is static_tree:  # the caller hands back the static tree itself: nothing to do
            return True
        got, got_def = T.tree_flatten(tree)
        if got_def != treedef:
            return False
        check_dtype = "dtype" in self.fields
        check_format = "memory_format" in self.fields
        for s, g, spec in zip(leaves, got, specs):
            if g is s:
                continue
            if not isinstance(g, torch.Tensor) or tuple(g.shape) != spec.shape or str(g.device) != spec.device:
                return False
            if check_dtype and g.dtype != spec.dtype:
                return False
            if check_format and memory_format_of(g) != spec.memory_format:
                return False
            if g.data_ptr() == s.data_ptr() and g.stride() == s.stride() and g.dtype == s.dtype:
                continue  # an alias of the static buffer (e.g. a .detach()): same memory, no copy
            dst.append(s)
            src.append(g)
        return True

    def load(self, *trees: PyTree) -> int:
        """Check ``trees`` (one per group, in order) and copy them into the static buffers.

        Returns:
          the number of leaves copied.

        Raises:
          CaptureMismatch: a tree or leaf differs from the captured signature.
        """
        dst: list[torch.Tensor] = []
        src: list[torch.Tensor] = []
        for tree, (_, static_tree, treedef, leaves, specs) in zip(trees, self._groups):
            if not self._collect(tree, static_tree, treedef, leaves, specs, dst, src):
                got = _signature_of_groups(dict(zip(self.static, trees)), self.autocast_dtype)
                raise CaptureMismatch(self.signature, got, what=self.what, fields=self.fields)
        T.foreach_copy_(dst, src)
        return len(dst)


class StaticBuffers(NamedTuple):
    """The tensors the graphs read and write (never rebind them; update in place only).

    Attributes:
      params, state, x: inputs (trees like the ones given to :func:`capture_vjp`).
      outputs: ``fn``'s outputs (overwritten by every forward replay).
      new_state: ``fn``'s new state (``state`` itself with ``bn_in_place``).
      cotangents: output cotangents (same tree, shapes, dtypes and layouts as ``outputs``).
      grads: parameter gradients (same tree as ``params``; overwritten by every backward replay).
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
      capture_index: the process-wide number of this capture (see :func:`num_captures`).
      forward_replays, backward_replays: replays so far.
      leaves_copied: input leaves copied by the last ``forward`` (0 when the static trees were passed).
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
    """

    forward: Callable[[PyTree, PyTree, PyTree], tuple[PyTree, PyTree]]
    backward: Callable[[PyTree], PyTree]
    signature: CaptureSignature
    static: StaticBuffers
    stats: CaptureStats
    pool: Any

    def __repr__(self) -> str:
        return f"Captured({self.signature!r}, {self.stats})"


# --------------------------------------------------------------------------------------------
# Capture
# --------------------------------------------------------------------------------------------
_capture_counter = itertools.count(1)
_num_captures = 0


def num_captures() -> int:
    """How many :func:`capture_vjp` captures completed in this process (for "captured once" asserts)."""
    return _num_captures


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

    def __init__(self, *, index, g_fwd, g_bwd, inputs: _Binder, cotangents: _Binder, static, stats, token):
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


def _check_available(groups: Mapping[str, PyTree], generators: tuple) -> torch.device:
    device = None
    named = [(f"{group}/{path}" if path else group, leaf) for group, tree in groups.items() for path, leaf in T.tree_items(tree)]
    for name, leaf in named:
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(f"[yolo_func] capture_vjp: {name} must be a torch.Tensor, got {type(leaf).__name__}")
    for name, leaf in named:
        if leaf.device.type != "cuda":
            raise CaptureUnavailable(f"inputs are on {leaf.device}, not a CUDA device (first: {name})")
        if device is None:
            device = leaf.device
        elif leaf.device != device:
            raise ValueError(f"[yolo_func] capture_vjp: all inputs must be on one device; {name} is on "
                             f"{leaf.device}, earlier inputs on {device}")
    if device is None:
        raise ValueError("[yolo_func] capture_vjp: params, state and x hold no tensors")
    if not torch.cuda.is_available():
        raise CaptureUnavailable("CUDA is not available")
    if torch.cuda.is_current_stream_capturing():
        raise CaptureUnavailable("a CUDA graph capture is already underway on the current stream")
    for g in generators:
        index = g.device.index if g.device.index is not None else torch.cuda.current_device()
        if index != device.index:
            raise ValueError(f"[yolo_func] capture_vjp: a generator is on {g.device}, the inputs on {device}")
    return device


def _check_args(fn, warmup, autocast_dtype, generators) -> tuple:
    if not callable(fn):
        raise TypeError(f"[yolo_func] capture_vjp: fn must be callable, got {type(fn).__name__}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
        raise ValueError(
            f"[yolo_func] capture_vjp: warmup must be an int >= 1 (cuDNN/cuBLAS set-up must happen before "
            f"capture), got {warmup!r}"
        )
    _check_autocast(autocast_dtype)
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
def _forward_context(autocast_dtype: torch.dtype | None, bn_in_place: bool) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        if autocast_dtype is not None:
            stack.enter_context(torch.autocast("cuda", dtype=autocast_dtype, cache_enabled=False))
        if bn_in_place:
            stack.enter_context(update_stats_in_place())
        yield


def capture_vjp(
    fn: Callable[[PyTree, PyTree, PyTree], tuple[PyTree, PyTree]],
    params: PyTree,
    state: PyTree,
    x: PyTree,
    *,
    warmup: int = 3,
    autocast_dtype: torch.dtype | None = None,
    generators: tuple[torch.Generator, ...] = (),
    pool: Any = None,
    bn_in_place: bool = True,
) -> Captured:
    """Capture ``fn``'s forward pass and its pullback w.r.t. ``params`` as two CUDA graphs.

    Args:
      fn: pure ``(params, state, x) -> (outputs, new_state)``; ``outputs`` a tuple/NamedTuple (any
        pytree) of floating tensors, e.g. ``Feats(p3, p4, p5)``; ``new_state`` a pytree.
      params: pytree of float tensors on one CUDA device (differentiated).
      state: pytree of tensors (BN running statistics; not differentiated).
      x: ``float[B, C, H, W]`` (or a pytree of tensors; not differentiated).
      warmup: eager warm-up iterations on a side stream (>= 1).
      autocast_dtype: ``None`` (no autocast), ``torch.bfloat16`` or ``torch.float16``; the forward
        runs under ``torch.autocast("cuda", dtype, cache_enabled=False)``.
      generators: CUDA generators ``fn`` draws from, attached to both graphs; their states (and the
        default CUDA generator's) are restored after warm-up.
      pool: a memory pool handle to share (``torch.cuda.graph_pool_handle()``, another
        ``Captured.pool``); ``None`` makes a private one. See "Aliasing" in the module docstring.
      bn_in_place: record BN statistic updates straight into the static state buffers.

    Returns:
      :class:`Captured`. Its static buffers start as copies of ``params``, ``state`` and ``x``,
      which are left untouched.

    Raises:
      CaptureUnavailable: an input is not on a CUDA device, CUDA is unavailable, or a capture is
        already underway.
      TypeError, ValueError: bad arguments (non-tensor leaves, mixed devices, CPU generators, ...).
    """
    global _num_captures
    generators = _check_args(fn, warmup, autocast_dtype, generators)
    device = _check_available({"params": params, "state": state, "x": x}, generators)

    static_params, static_state, static_x = T.tree_clone(params), T.tree_clone(state), T.tree_clone(x)
    inputs = _Binder({"params": static_params, "state": static_state, "x": static_x}, autocast_dtype, what="inputs")

    def run_forward():
        with _forward_context(autocast_dtype, bn_in_place):
            return torch.func.vjp(lambda p: fn(p, static_state, static_x), static_params, has_aux=True)

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
                with torch.no_grad():  # first-order backward, as yolo_func.train.first_order
                    vjp_fn(T.tree_map(torch.ones_like, out))
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
        with torch.cuda.graph(g_fwd, pool=pool):
            outputs, vjp_fn, new_state = run_forward()
        # Cotangent buffers live outside the pool: they are inputs, written by the caller.
        cotangents = T.tree_map(torch.zeros_like, outputs)
        # retain_graph=False: the pullback releases each saved activation once its backward node
        # has run, so the backward's scratch reuses that memory within the pool, as an eager
        # backward does (with the activations kept alive, the pool held both: ~1.3x the eager
        # peak). Replays read and write the recorded addresses; the closure is not called again.
        with torch.cuda.graph(g_bwd, pool=pool), torch.no_grad():
            (grads,) = vjp_fn(cotangents, retain_graph=False)
        del vjp_fn
        restore_state()  # capture executes nothing, but keep the promise cheap and explicit
        del state_backup, gen_backup

    index = next(_capture_counter)
    _num_captures += 1
    static = StaticBuffers(static_params, static_state, static_x, outputs, new_state, cotangents, grads)
    stats = CaptureStats(capture_index=index)
    cot_binder = _Binder({"d_outputs": cotangents}, None, what="output cotangents", fields=("shape", "device"))
    replay = _Replay(index=index, g_fwd=g_fwd, g_bwd=g_bwd, inputs=inputs, cotangents=cot_binder,
                     static=static, stats=stats, token=_pool_token(pool))
    return Captured(replay.forward, replay.backward, inputs.signature, static, stats, pool)


# --------------------------------------------------------------------------------------------
# A bounded cache of captures
# --------------------------------------------------------------------------------------------
class CaptureCache:
    """At most ``max_entries`` :class:`Captured`, keyed by a hashable key (input shape, dtype, heads,
    target bucket, ...). It never evicts (evicting would re-capture over and over); a new key past
    the bound raises :class:`CaptureCacheFull` (a :class:`CaptureUnavailable`), so a caller falls
    back to eager with one warning naming the reason.

    Entries may share one memory pool: pass ``pool=cache.pool`` to :func:`capture_vjp` (see
    "Aliasing" in the module docstring for the replay-order rule that comes with it).

    Example::

        cache = CaptureCache(max_entries=4)
        cap = cache.get_or_capture(tuple(x.shape), lambda: capture_vjp(fn, p, s, x, pool=cache.pool))
    """

    def __init__(self, max_entries: int = 4):
        if isinstance(max_entries, bool) or not isinstance(max_entries, int) or max_entries < 1:
            raise ValueError(f"[yolo_func] CaptureCache: max_entries must be an int >= 1, got {max_entries!r}")
        self.max_entries = max_entries
        self._entries: dict[Hashable, Captured] = {}
        self._pool = None
        self.num_captures = 0  #: captures this cache made
        self.overflows = 0  #: requests refused because the cache was full

    @property
    def pool(self) -> Any:
        """A memory pool handle shared by this cache's entries (created on first use; needs CUDA)."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        return self._pool

    def get(self, key: Hashable) -> Captured | None:
        """The entry for ``key``, or ``None``."""
        return self._entries.get(key)

    def get_or_capture(self, key: Hashable, capture: Callable[[], Captured]) -> Captured:
        """The entry for ``key``; if absent, call ``capture()`` once and store its result.

        Raises:
          CaptureCacheFull: ``key`` is new and the cache is full (``capture`` is not called).
          Whatever ``capture`` raises (nothing is stored then).
        """
        hash(key)  # an unhashable key fails here, with Python's own TypeError
        entry = self._entries.get(key)
        if entry is not None:
            return entry
        if len(self._entries) >= self.max_entries:
            self.overflows += 1
            raise CaptureCacheFull(key, tuple(self._entries), self.max_entries)
        entry = capture()
        if not hasattr(entry, "signature"):  # a Captured or a CapturedStep
            raise TypeError(f"[yolo_func] CaptureCache: capture() must return a Captured or CapturedStep, got {type(entry).__name__}")
        self._entries[key] = entry
        self.num_captures += 1
        return entry

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> list[Hashable]:
        """The keys held, in capture order."""
        return list(self._entries)

    def clear(self) -> None:
        """Drop every entry (their graphs and pool memory are freed once no one else holds them)."""
        self._entries.clear()

    def __repr__(self) -> str:
        return f"CaptureCache({len(self)}/{self.max_entries} entries, keys={self.keys()})"
