"""The network's and each head's training-mode apply through ``torch.compile`` (inductor).

:class:`CompiledModel` holds one compiled function for the network (backbone + neck, uint8 images
divided by 255 inside) and one per head. The eager step (:func:`yolo_func.train.train_step` with
``compiled=``) and every replay level of :class:`yolo_func.train.ReplayTrainStep` (``compile=``)
call the same compiled functions, so a replay records the compiled kernels in its CUDA graphs and
stays bitwise equal to the compiled eager step.

How it is differentiated
------------------------
``torch.func.vjp`` cannot transform a compiled function (dynamo does not run under functorch's
transforms). The compiled functions are differentiated through autograd instead
(:func:`yolo_func.func.autograd_vjp`): parameters (and, for a head, the features) enter as fresh
``requires_grad`` leaves, AOTAutograd compiles the joint forward/backward graph, and the pullback is
one ``torch.autograd.grad`` call (recorded in the backward graph by
:func:`yolo_func.capture.capture_vjp` with ``vjp=autograd_vjp``). The pytrees cross
``torch.compile`` as they are (nested dicts of tensors: dynamo guards on their keys).

BatchNorm statistics are updated in place inside the compiled graph (AOTAutograd turns the
mutation into a copy into the input at the end of the graph): every call runs under
:func:`yolo_func.nn.update_stats_in_place` (entered here, around the compiled call; the flag is a
trace-time constant, :func:`yolo_func.nn.batchnorm.enable_compile`). The eager step passes fresh
clones of the statistics; a replay passes its static buffers. SyncBN (:func:`yolo_func.nn.sync_batchnorm`)
is not compiled: a call inside it raises.

Shapes and recompiles
---------------------
``dynamic=False`` and ``fullgraph=True``: one graph per input shape (batch, image size, dtypes,
memory format), and a graph break is an error rather than a silent split. A new shape compiles anew
(as a replay captures anew); the recompile limit is raised to :data:`RECOMPILE_LIMIT` per compiled
function around every call and hitting it raises (never a silent fall back to eager code).

Compile time
------------
The first forward and the first backward of each (part, input shape) are timed (host wall time:
trace, compile and one run): :attr:`CompiledModel.compile_times` per ``"part/forward"`` /
``"part/backward"``, :attr:`CompiledModel.compile_seconds` in total. Inductor's caches (FX graph
and AOTAutograd caches, on by default) live under ``TORCHINDUCTOR_CACHE_DIR`` (default
``/tmp/torchinductor_<user>``): a second process compiling the same shapes skips code generation
(dynamo still traces: seconds).

Modes (``compile=`` of :class:`yolo_func.train.ReplayTrainStep`, ``train.compile`` of the fit):
``"default"`` (``True``), ``"max-autotune"`` (inductor's autotuned kernels, without its own CUDA
graphs: this package captures the graphs; long compiles), ``"aot_eager"`` (dynamo and AOTAutograd
without inductor: quick to compile; for debugging and CPU tests), ``"none"`` (``False``).
"""

from __future__ import annotations

import contextlib
import importlib
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from yolo_func import tree as T
from yolo_func.func import autograd_vjp
from yolo_func.nn import update_stats_in_place

__all__ = ["COMPILE_MODES", "RECOMPILE_LIMIT", "CompiledModel", "compile_mode"]

#: The accepted ``compile=`` names (besides ``True`` = ``"default"`` and ``False`` / ``None`` = ``"none"``).
COMPILE_MODES = ("none", "default", "max-autotune", "aot_eager")

#: Compiled graphs per compiled function (one per input shape) before a call raises.
RECOMPILE_LIMIT = 64

# name -> torch.compile keyword arguments
_KWARGS = {
    "default": {"backend": "inductor", "mode": None},
    # inductor's "max-autotune" mode also records its own CUDA graphs, which cannot sit inside ours
    "max-autotune": {"backend": "inductor", "mode": "max-autotune-no-cudagraphs"},
    "aot_eager": {"backend": "aot_eager"},
}


def compile_mode(compile: Any) -> str:
    """The canonical name of a ``compile=`` value.

    Args:
      compile: ``False`` / ``None`` / ``"none"``, ``True`` / ``"default"``, ``"max-autotune"``,
        ``"aot_eager"``, or a :class:`CompiledModel` (its mode).

    Returns:
      One of :data:`COMPILE_MODES`.

    Raises:
      ValueError: any other value (e.g. ``"reduce-overhead"``: inductor's own CUDA graphs cannot be
        captured inside this package's).

    Example:
      >>> from yolo_func.train.compiled import compile_mode
      >>> compile_mode(True), compile_mode(False), compile_mode("max-autotune")
      ('default', 'none', 'max-autotune')
    """
    if isinstance(compile, CompiledModel):
        return compile.mode
    if compile is None or compile is False:
        return "none"
    if compile is True:
        return "default"
    if isinstance(compile, str) and compile in COMPILE_MODES:
        return compile
    hint = ""
    if compile in ("reduce-overhead", "max-autotune-no-cudagraphs"):
        hint = (" (inductor's own CUDA graphs cannot run inside the replayed graphs: 'max-autotune' already "
                "means inductor's max-autotune-no-cudagraphs, and capture= chooses what is replayed)")
    raise ValueError(f"[yolo_func] compile must be True, False or one of {list(COMPILE_MODES)}, got {compile!r}{hint}")


def _dynamo_limits() -> contextlib.AbstractContextManager:
    """Dynamo's config around a compiled call: a raised recompile limit that raises when hit
    (default torch: eight graphs, then silently eager). Only the options this torch has."""
    cfg = importlib.import_module("torch._dynamo.config")
    opts = {}
    if hasattr(cfg, "recompile_limit"):
        opts["recompile_limit"] = max(cfg.recompile_limit, RECOMPILE_LIMIT)
    elif hasattr(cfg, "cache_size_limit"):
        opts["cache_size_limit"] = max(cfg.cache_size_limit, RECOMPILE_LIMIT)
    if hasattr(cfg, "fail_on_recompile_limit_hit"):
        opts["fail_on_recompile_limit_hit"] = True
    return cfg.patch(**opts) if opts else contextlib.nullcontext()


def _key(tree: Any) -> tuple:
    """Shapes, dtypes and strides of ``tree``'s tensor leaves (what a new compile depends on)."""
    return tuple((tuple(x.shape), x.dtype, x.stride()) for x in T.tree_leaves(tree) if isinstance(x, torch.Tensor))


class CompiledModel:
    """A model's network and heads, training-mode apply, compiled (see the module docstring).

    Args:
      model: a :class:`yolo_func.Model`.
      compile: ``True`` / ``"default"``, ``"max-autotune"`` or ``"aot_eager"`` (:func:`compile_mode`).

    Attributes:
      mode: the canonical mode name.
      compile_times: ``{"network/forward": s, "network/backward": s, "<head>/forward": s, ...}``,
        host seconds of the first call per input shape, summed over shapes.
      compile_seconds: their sum.

    Raises:
      ValueError: a bad ``compile`` value, or ``"none"`` (build no :class:`CompiledModel` then).

    Example:
      >>> import torch
      >>> from yolo_func import yolov8
      >>> from yolo_func.train.compiled import CompiledModel
      >>> cm = CompiledModel(yolov8("n", num_classes=2), compile="aot_eager")   # compiles lazily, per shape
      >>> cm.mode, cm.compile_seconds, sorted(cm.heads)
      ('aot_eager', 0.0, ['detect'])
    """

    def __init__(self, model, compile: Any = True):
        mode = compile_mode(compile)
        if mode == "none":
            raise ValueError("[yolo_func] CompiledModel needs a compile mode other than 'none' "
                             f"(one of {list(COMPILE_MODES[1:])}); pass compiled=None to run uncompiled")
        importlib.import_module("yolo_func.nn.batchnorm").enable_compile()
        self.model, self.mode = model, mode
        kw = dict(_KWARGS[mode], dynamic=False, fullgraph=True)
        network = model.network

        def network_apply(params, state, x, dtype):
            # uint8 pixels divided by 255 inside the compiled graph (train.step.normalize_images)
            if x.dtype == torch.uint8:
                x = x.to(dtype) / 255
            return network.apply(params, state, x, train=True)[0]  # the statistics: updated in `state`

        self._network = torch.compile(network_apply, **kw)
        self._heads = {name: torch.compile(_head_apply(head), **kw) for name, head in model.heads.items()}
        self.heads = tuple(self._heads)
        self.compile_times: dict[str, float] = {}
        self._seen: set = set()

    @property
    def compile_seconds(self) -> float:
        """Seconds spent on first calls (compiles) so far, every part and shape."""
        return float(sum(self.compile_times.values()))

    @contextlib.contextmanager
    def _call(self, part: str, key: tuple) -> Iterator[None]:
        if importlib.import_module("yolo_func.nn.batchnorm").sync_active():
            raise ValueError("[yolo_func] a compiled network cannot run inside sync_batchnorm (SyncBN's all-reduce "
                             "is not traced); use compile=False with train.sync_bn")
        first = (part, key) not in self._seen
        t0 = time.perf_counter()
        with _dynamo_limits(), update_stats_in_place():
            yield
        if first:
            self._seen.add((part, key))
            self.compile_times[part] = self.compile_times.get(part, 0.0) + time.perf_counter() - t0

    # -- the compiled functions (in-place BN statistics, differentiable through autograd) --------
    def network(self, params: dict, state: dict, x: torch.Tensor):
        """``(feats: Feats, new_state)``: the compiled network, training mode.

        Args:
          params, state: the ``network`` subtrees (``state`` is updated in place and returned).
          x: ``uint8[B, 3, H, W]`` (divided by 255 inside) or ``float[B, 3, H, W]`` in [0, 1].
        """
        dtype = next((p.dtype for p in T.tree_leaves(params) if p.is_floating_point()), torch.float32)
        with self._call("network/forward", _key(x)):
            # BN writes the new statistics into `state` (in place, inside the graph): `state` is the
            # new state, as the uncompiled in-place path returns it (no aliased outputs to rebuild)
            return self._network(params, state, x, dtype), state

    def head(self, name: str) -> Callable:
        """Head ``name``'s compiled apply: ``(params, state, feats) -> (preds, new_state)``
        (``state`` updated in place and returned)."""
        fn = self._heads[name]

        def apply(params: dict, state: dict, feats):
            with self._call(f"{name}/forward", _key(feats)):
                return fn(params, state, feats), state

        return apply

    def vjp(self, part: str) -> Callable:
        """:func:`yolo_func.func.autograd_vjp` whose pullback's first call per shape is timed as
        ``"<part>/backward"`` (AOTAutograd compiles the backward lazily, at its first call)."""
        def run(fn: Callable, *primals: Any):
            out, pullback, aux = autograd_vjp(fn, *primals)
            key = _key(out)

            def timed(cotangents: Any, **kwargs):
                with self._call(f"{part}/backward", key):
                    return pullback(cotangents, **kwargs)

            return out, timed, aux

        return run

    def __repr__(self) -> str:
        return f"CompiledModel(mode={self.mode!r}, heads={list(self.heads)}, compile_seconds={self.compile_seconds:.1f})"


def _head_apply(head) -> Callable:
    def head_apply(params, state, feats):
        return head.apply(params, state, feats, train=True)[0]  # the statistics: updated in `state`

    return head_apply


def compiled_for(model, compile: Any) -> "CompiledModel | None":
    """``compile`` as a :class:`CompiledModel` for ``model`` (a given one is checked and reused),
    or None for ``"none"``.

    Raises:
      ValueError: a bad value, or a :class:`CompiledModel` of another model.
    """
    if isinstance(compile, CompiledModel):
        if compile.model is not model:
            raise ValueError("[yolo_func] compile= got a CompiledModel built for another model; build one with "
                             "CompiledModel(model, ...) for this model")
        return compile
    return None if compile_mode(compile) == "none" else CompiledModel(model, compile)


def compile_times_event(compiled: "CompiledModel | None") -> Mapping[str, Any]:
    """The fields of the fit's ``compile`` event: mode, total seconds and seconds per part."""
    if compiled is None:
        return {"mode": "none", "seconds": 0.0, "parts": {}}
    return {"mode": compiled.mode, "seconds": round(compiled.compile_seconds, 3),
            "parts": {k: round(v, 3) for k, v in sorted(compiled.compile_times.items())}}
