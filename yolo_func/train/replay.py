"""Training steps that replay CUDA graphs, each bitwise equal to the eager :func:`train_step`.

Levels (``capture=``), one small class each (:class:`_Level` and its subclasses below; adding a
level is one subclass plus its entry in ``_LEVEL_CLASSES``):

- ``"none"`` (:class:`_EagerLevel`): the eager step.
- ``"network"`` (:class:`_NetworkLevel`; default on CUDA; the mission's shape): backbone + neck
  forward and backward are replayed (:func:`yolo_func.capture.capture_vjp`); each head's apply and
  loss run eagerly as their own functional calls; the heads' feature gradients are summed
  explicitly and copied into the static cotangent buffers; one backward replay. The update that
  follows — the non-finite guard, optimizer, EMA and metrics (:func:`yolo_func.train.step.finish_step`)
  — is replayed as a graph of its own over the training state (``replay_update=True``, the
  default) or runs eagerly (``replay_update=False``); either way it writes the static parameters.
- ``"network+heads"`` (:class:`_NetworkHeadsLevel`): as ``"network"``, and each head's apply
  forward/backward is replayed too (:func:`capture_head`: a graph pair w.r.t. head params and
  features with a private pool), so every head keeps an independent gradient; the assignment and
  the losses run eagerly.
- ``"step"`` (:class:`_StepLevel`): the whole eager step — network, heads, assignment, the
  static-shape losses, the explicit gradient sum, the non-finite guard, optimizer and EMA —
  replayed as one graph (:func:`yolo_func.capture.capture_step`).

Images may be ``uint8[B, 3, H, W]`` (0..255) or floating in [0, 1]; uint8 images are divided by
255 on the device inside the captured network forward (or the captured step), never as a separate
eager op (:func:`yolo_func.train.step.normalize_images`).

Capture budget: ``max_captures`` bounds the distinct input shapes (batch shape and image size at
the network levels; plus the target bucket, mask and keypoint shapes at ``"step"``) held in one
:class:`yolo_func.capture.CaptureCache`; the captures one shape needs (network, heads, update)
count once.

Gradient accumulation works at every level: the optimizer's :func:`yolo_func.optim.multi_steps`
sums into buffers of its own (never the static gradient buffers a replay returns).

Donation: replay steps keep the training state in static buffers and update them in place. The
``TrainState`` you pass in is consumed — its tensors become the static carry of the captured
update (no second copy of the state); use the one returned. ``metrics`` of a replayed update (every
level but ``"none"``, unless ``replay_update=False``) are static buffers too: fetch (or clone) them
before the next call.

Fallback: when capture cannot hold — the inputs are not on a CUDA device, a head is marked
``capturable=False`` (for ``"network+heads"`` and ``"step"``), or the bounded cache is full — the
step runs eagerly and one warning (``CaptureFallbackWarning``) names the reason, once per reason.
"""

from __future__ import annotations

import abc
import os
import warnings
from collections.abc import Callable, Hashable
from typing import Any, NamedTuple

import torch

from yolo_func import tree as T
from yolo_func._types import Feats
from yolo_func.capture import CaptureCache, Captured, CaptureUnavailable, capture_step, capture_vjp
from yolo_func.func import VJP_BACKENDS, autocast_dtype, dynamo_imported, vjp_backend, vjp_through_autograd
from yolo_func.models.yolov8 import Model
from yolo_func.nn import update_stats_in_place
from yolo_func.optim import apply_updates_
from yolo_func.structures.checks import check_batch
from yolo_func.structures.targets import pad_targets
from yolo_func.train.compiled import compiled_for
from yolo_func.train.state import Batch, TrainState
from yolo_func.train.step import (
    HeadsBackward,
    finish_step,
    heads_backward,
    input_dtype,
    losses_backward,
    normalize_images,
    train_step,
)

__all__ = ["LEVELS", "CaptureFallbackWarning", "HeadCapture", "ReplayTrainStep", "UpdateInputs", "capture_head"]


#: run :meth:`ReplayTrainStep._prewarm` (opt-in: environment ``YOLO_FUNC_PREWARM=1``). Off by default:
#: measured on the H200 (segment, batch 16, ``benchmarks/profile_fit_startup.py``), a fit's first
#: step ended at 8.2 s with it and 6.5 s without — the autograd warm-up's thousands of op dispatches
#: compete for the GIL with the ``torch._dynamo`` import it was meant to overlap.
PREWARM = os.environ.get("YOLO_FUNC_PREWARM", "0") == "1"


class CaptureFallbackWarning(UserWarning):
    """A replay level could not hold and the step ran eagerly (the message says why)."""


# ------------------------------------------------------------------------------------------------
# Records
# ------------------------------------------------------------------------------------------------
class UpdateInputs(NamedTuple):
    """What the update (:func:`yolo_func.train.step.finish_step`) reads besides the training state;
    the inputs of the captured update graph.

    Attributes:
      grads: ``{"network": g_network, "heads": {h: g_params_h}}``.
      new_state: ``{"network": ..., "heads": {h: ...}}``, the new BN statistics.
      losses: ``{h: float32[]}``.
      parts: ``{"h/part": float32[]}``.
      feat_norms: ``{h: float32[]}``.
      old_state: the BN statistics a skipped step keeps (``None`` without the non-finite guard).
    """

    grads: dict
    new_state: dict
    losses: dict
    parts: dict
    feat_norms: dict
    old_state: dict | None


class _Heads(NamedTuple):
    """What a network level's heads hand to the update.

    Attributes:
      ts: the training state, with the heads' params and state adopted as static buffers when the
        heads are replayed.
      backward: :class:`yolo_func.train.step.HeadsBackward`.
      old_state: the heads' BN statistics a skipped step keeps.
      persistent: tensors the update graph reads where they live (static buffers of the heads'
        graphs and snapshots refreshed in place).
      captures: ``{h: HeadCapture}`` of the replayed heads (empty when they run eagerly).
    """

    ts: TrainState
    backward: HeadsBackward
    old_state: Any
    persistent: list
    captures: dict


class HeadCapture(NamedTuple):
    """One head's forward and its pullback w.r.t. ``(head params, features)`` as CUDA graphs
    (:func:`capture_head`).

    Attributes:
      forward: ``(params, state, feats) -> (preds, new_state)``; replays; ``new_state`` is the
        static state (BN statistics updated in place).
      backward: ``g_preds -> (g_params, g_feats)``; replays; static gradient buffers.
      captured: the underlying :class:`yolo_func.capture.Captured` (its ``static.params`` is
        ``{"params": ..., "feats": ...}``).
    """

    forward: Callable[[dict, dict, Feats], tuple[Any, dict]]
    backward: Callable[[Any], tuple[dict, Feats]]
    captured: Captured

    @property
    def signature(self):
        """The captured :class:`yolo_func.capture.CaptureSignature` (params and feats, state)."""
        return self.captured.signature

    @property
    def params(self) -> dict:
        """The static head parameters (update them in place only)."""
        return self.captured.static.params["params"]

    @property
    def state(self) -> dict:
        """The static head BN statistics."""
        return self.captured.static.state


def capture_head(head, params: dict, state: dict, feats: Feats, *, warmup: int = 3,
                 autocast_dtype: torch.dtype | None = None, apply: Callable | None = None,
                 vjp: Callable | None = None) -> HeadCapture:
    """Capture a head's training-mode apply and its pullback w.r.t. ``(params, feats)``.

    The head's BN statistics are written in place into the static state buffers
    (:func:`yolo_func.nn.update_stats_in_place`); the graphs get a private memory pool (the heads
    of a step replay forward, forward, ..., backward, backward).

    Args:
      head: a :class:`yolo_func.heads.Head`.
      params, state: the head's subtrees (on one CUDA device).
      feats: :class:`yolo_func.Feats` ``(p3 float[B, C3, H/8, W/8], p4, p5)``.
      warmup, autocast_dtype: as :func:`yolo_func.capture.capture_vjp`.
      apply, vjp: a compiled apply ``(params, state, feats) -> (preds, new_state)`` and its vjp
        (:meth:`yolo_func.train.compiled.CompiledModel.head` and ``.vjp``); None: ``head.apply``
        through ``torch.func``.

    Returns:
      :class:`HeadCapture`.

    Raises:
      CaptureUnavailable: as :func:`yolo_func.capture.capture_vjp`.
    """
    def fn(primals, s, x):
        del x  # a head reads only its params and the features (both differentiated)
        if apply is not None:
            return apply(primals["params"], s, primals["feats"])
        return head.apply(primals["params"], s, primals["feats"], train=True)

    cap = capture_vjp(fn, {"params": params, "feats": feats}, state, warmup=warmup,
                      autocast_dtype=autocast_dtype, forward_context=update_stats_in_place, vjp=vjp)

    def forward(p: dict, s: dict, f: Feats):
        return cap.forward({"params": p, "feats": f}, s, ())

    def backward(g_preds):
        g = cap.backward(g_preds)
        return g["params"], g["feats"]

    return HeadCapture(forward, backward, cap)


def _holds(tree, static_tree) -> bool:
    """Whether ``tree``'s leaves are ``static_tree``'s own tensors (the containers may be other
    objects: a captured update returns its static carry rebuilt around the same tensors)."""
    if tree is static_tree:
        return True
    a, b = T.tree_leaves(tree), T.tree_leaves(static_tree)
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


def _adopt(tree, static_tree):
    """``static_tree`` holding ``tree``'s values: copied in unless it already is ``tree``."""
    if not _holds(tree, static_tree):
        T.tree_copy_(static_tree, tree)
    return static_tree


def _batch_key(batch: Batch) -> tuple:
    t = batch.targets
    return (
        tuple(batch.images.shape), batch.images.dtype, tuple(t.boxes.shape),
        None if t.masks is None else tuple(t.masks.shape),
        None if t.keypoints is None else tuple(t.keypoints.shape),
    )


def _without_m(key: tuple) -> tuple:
    """A :func:`_batch_key` with the target slot count M left out (per-instance masks and keypoints
    have M as their second dimension; an overlap map has none)."""
    images, dtype, boxes, masks, kpts = key
    masks = None if masks is None else (masks if len(masks) == 3 else masks[:1] + masks[2:])
    kpts = None if kpts is None else kpts[:1] + kpts[2:]
    return images, dtype, boxes[:1] + boxes[2:], masks, kpts


# ------------------------------------------------------------------------------------------------
# Levels
# ------------------------------------------------------------------------------------------------
class _Level(abc.ABC):
    """One way to run the step. ``__call__`` replays, or falls back to the eager step with one
    warning per reason; subclasses say when they cannot hold (:meth:`unavailable`) and how they
    replay (:meth:`replay`)."""

    name: str = ""
    needs_capturable_heads = False  # the heads run inside a graph

    def __init__(self, owner: "ReplayTrainStep"):
        self.owner = owner

    def unavailable(self, batch: Batch) -> str | None:
        """Why this level cannot replay ``batch`` (checked before any capture), or None."""
        if batch.images.device.type != "cuda":
            return f"the inputs are on {batch.images.device}, not a CUDA device"
        if self.needs_capturable_heads:
            not_capturable = [n for n, h in self.owner.model.heads.items() if not h.capturable]
            if not_capturable:
                return f"head(s) {not_capturable} are marked capturable=False"
        return None

    @abc.abstractmethod
    def replay(self, ts: TrainState, batch: Batch) -> tuple[TrainState, dict]:
        """One step at this level; may raise :class:`yolo_func.capture.CaptureUnavailable`."""

    def __call__(self, ts: TrainState, batch: Batch) -> tuple[TrainState, dict]:
        reason = self.unavailable(batch)
        if reason is None:
            try:
                return self.replay(ts, batch)
            except CaptureUnavailable as e:
                reason = e.reason
        self.owner._fallback(reason)
        return self.owner._eager(ts, batch)


class _EagerLevel(_Level):
    """``"none"``: the eager step, always (on any device, nothing to fall back from)."""

    name = "none"

    def unavailable(self, batch: Batch) -> str | None:
        return None

    def replay(self, ts: TrainState, batch: Batch) -> tuple[TrainState, dict]:
        return self.owner._eager(ts, batch)


class _StepLevel(_Level):
    """``"step"``: the whole eager step captured as one graph per batch signature."""

    name = "step"
    needs_capturable_heads = True

    def replay(self, ts: TrainState, batch: Batch) -> tuple[TrainState, dict]:
        o = self.owner
        dtype = o._dtype(batch.images)

        def fn(carry, inputs):
            return train_step(carry, inputs, model=o.model, tx=o.tx, ema=o.ema, autocast_dtype=dtype,
                              skip_nonfinite=o.skip_nonfinite, compiled=o.compiled)

        batch = self._reuse_bucket(batch)
        cap = o.cache.get_or_capture(
            _batch_key(batch),
            lambda: capture_step(fn, ts, batch, warmup=o.warmup, pool=o.cache.pool, donate_carry=True),
            part="step",
        )
        return cap.step(ts, batch)

    def _reuse_bucket(self, batch: Batch) -> Batch:
        """``batch`` with its targets padded (:func:`yolo_func.structures.pad_targets`) to the smallest
        target bucket already captured above its own for the same images, masks and keypoints shapes
        — instead of a new capture mid-epoch (0.2-0.5 s with the GPU idle); unchanged when its own
        bucket is captured, when no larger one is, or with ``reuse_buckets=False``. The step's results
        do not depend on the padding: inert rows only enter maxima, argmaxes and sums of 0/1 masks
        over the target axis (tested bitwise on the CPU and the GPU)."""
        o = self.owner
        key = _batch_key(batch)
        if not o.reuse_buckets or key in o.cache:
            return batch
        M = batch.targets.boxes.shape[1]
        larger = [k[2][1] for k in o.cache.keys() if k[2][1] > M and "step" in o.cache.parts(k)
                  and _without_m(k) == _without_m(key)]
        if not larger:
            return batch
        return Batch(batch.images, pad_targets(batch.targets, min(larger)))


class _NetworkLevel(_Level):
    """``"network"``: the network's forward/backward replayed; the heads eager (:meth:`heads`);
    the update replayed (or eager with ``replay_update=False``)."""

    name = "network"

    def key(self, batch: Batch) -> Hashable:
        """The cache key: what the network's and the update's graphs depend on."""
        return (tuple(batch.images.shape), batch.images.dtype)

    def replay(self, ts: TrainState, batch: Batch) -> tuple[TrainState, dict]:
        o, model, images = self.owner, self.owner.model, batch.images
        dtype, key = o._dtype(images), self.key(batch)
        to_float = input_dtype(ts.params["network"])

        def net_fn(p, s, x):  # uint8 images are divided by 255 inside the captured forward
            if o.compiled is not None:
                return o.compiled.network(p, s, x)
            return model.network.apply(p, s, normalize_images(x, to_float), train=True)

        compiled_kw = {} if o.compiled is None else {"vjp": o.compiled.vjp("network")}
        cap = o.cache.get_or_capture(key, lambda: o._quiesced(capture_vjp)(
            net_fn, ts.params["network"], ts.state["network"], images, warmup=o.warmup, autocast_dtype=dtype,
            pool=o.cache.pool, forward_context=update_stats_in_place, **compiled_kw), part="network")
        static = cap.static
        # Adopt the static buffers as the state's network leaves (copies happen only on the first
        # call with a fresh TrainState or after a switch between captures).
        if not _holds(ts.params["network"], static.params):
            ts = ts._replace(params={**ts.params, "network": _adopt(ts.params["network"], static.params)},
                             state={**ts.state, "network": _adopt(ts.state["network"], static.state)})
        # The replayed forward overwrites the static BN statistics; keep a copy for a skipped step.
        old_net = o._snapshot((key, "network"), static.state) if o.skip_nonfinite else None
        feats, net_state = cap.forward(static.params, static.state, images)
        heads = self.heads(ts, Feats(*feats), batch.targets, dtype, key)
        ts, hb = heads.ts, heads.backward
        g_network = cap.backward(hb.g_feats)
        old_state = None if old_net is None else {"network": old_net, "heads": heads.old_state}
        grads, losses, parts = {"network": g_network, "heads": hb.head_grads}, hb.losses, hb.parts
        if o.grad_reduce is not None:
            # data-parallel: the all-reduce runs here, after the replayed backward and outside every
            # graph; the network's static gradient buffers are reduced in place (the update graph
            # reads them where they live)
            grads, losses, parts = o.grad_reduce(grads, losses, parts)
        inputs = UpdateInputs(grads=grads, new_state={"network": net_state, "heads": hb.head_states},
                              losses=losses, parts=parts, feat_norms=hb.feat_norms, old_state=old_state)
        if o.replay_update:
            # static buffers of the replayed graphs and snapshots refreshed in place: read where they
            # live (the BN statistics, network and heads, are carry leaves: read in place anyway)
            persistent = T.tree_leaves([g_network, old_net, heads.persistent])
            new_ts, metrics = o._update_replay(key, ts, inputs, persistent=persistent)
        else:
            new_ts, metrics = finish_step(ts, inputs.grads, inputs.new_state, inputs.losses, inputs.parts,
                                          inputs.feat_norms, tx=o.tx, ema=o.ema, skip_nonfinite=o.skip_nonfinite,
                                          apply=apply_updates_, old_model_state=inputs.old_state)
        # Keep the BN statistics in the static buffers (a skipped step restores them there).
        state = dict(new_ts.state)
        state["network"] = _adopt(state["network"], static.state)
        if heads.captures:
            state["heads"] = {**state["heads"], **{n: _adopt(state["heads"][n], h.state)
                                                   for n, h in heads.captures.items()}}
        return new_ts._replace(state=state), metrics

    def heads(self, ts: TrainState, feats: Feats, targets, dtype, key: Hashable) -> _Heads:
        """Every head's forward, loss and pullback, eagerly."""
        hb = heads_backward(self.owner.model, ts.params["heads"], ts.state["heads"], feats, targets,
                            autocast_dtype=dtype, compiled=self.owner.compiled)
        return _Heads(ts, hb, ts.state["heads"], [], {})


class _NetworkHeadsLevel(_NetworkLevel):
    """``"network+heads"``: as ``"network"``, with each head's forward/backward replayed
    (:func:`capture_head`, stored under the network's key: one shape, one budget entry)."""

    name = "network+heads"
    needs_capturable_heads = True

    def heads(self, ts: TrainState, feats: Feats, targets, dtype, key: Hashable) -> _Heads:
        o = self.owner
        params_h, state_h = dict(ts.params["heads"]), dict(ts.state["heads"])
        captures, preds, backups = {}, {}, {}
        cm = o.compiled
        for name, head in o.model.heads.items():
            compiled_kw = {} if cm is None else {"apply": cm.head(name), "vjp": cm.vjp(name)}
            hcap = o.cache.get_or_capture(key, lambda: o._quiesced(capture_head)(
                head, params_h[name], state_h[name], feats, warmup=o.warmup, autocast_dtype=dtype, **compiled_kw),
                part=("head", name))
            if not _holds(params_h[name], hcap.params):
                params_h[name], state_h[name] = _adopt(params_h[name], hcap.params), _adopt(state_h[name], hcap.state)
            if o.skip_nonfinite:  # the replayed forward overwrites the static BN statistics
                backups[name] = o._snapshot((key, "head", name), hcap.state)
            preds[name], _ = hcap.forward(hcap.params, hcap.state, feats)
            captures[name] = hcap
        ts = ts._replace(params={**ts.params, "heads": params_h}, state={**ts.state, "heads": state_h})
        lb = losses_backward(o.model, feats, preds, {n: h.backward for n, h in captures.items()}, targets)
        hb = HeadsBackward(lb.g_feats, lb.head_grads, {n: h.state for n, h in captures.items()}, lb.losses,
                           lb.parts, lb.feat_norms)
        return _Heads(ts, hb, backups, [lb.head_grads, backups], captures)


#: Every level, by name (the order of ``LEVELS``).
_LEVEL_CLASSES: dict[str, type[_Level]] = {
    cls.name: cls for cls in (_EagerLevel, _NetworkLevel, _NetworkHeadsLevel, _StepLevel)
}
LEVELS = tuple(_LEVEL_CLASSES)


# ------------------------------------------------------------------------------------------------
# The step
# ------------------------------------------------------------------------------------------------
class ReplayTrainStep:
    """A training step at a replay level (see the module docstring).

    Args:
      model, tx, ema: as :func:`yolo_func.train.train_step`.
      capture: ``"none"``, ``"network"``, ``"network+heads"`` or ``"step"``.
      autocast_dtype: ``"auto"`` (BF16 on CUDA, none elsewhere), a dtype, or None.
      channels_last: NHWC images (default on CUDA; keep the params NHWC too, as
        :func:`init_train_state` does on CUDA).
      skip_nonfinite: the non-finite policy of :mod:`yolo_func.train.step`.
      max_captures: the bound on distinct input shapes (batch shape, image size, and at ``"step"``
        the target bucket) with captures; the captures one shape needs (network, heads, update)
        count once.
      warmup: eager warm-up runs before each capture.
      reuse_buckets: at ``"step"``, a batch whose target bucket M is smaller than one already
        captured (same images, masks and keypoints shapes) is padded to that bucket and replays its
        graph instead of capturing a new one mid-epoch; results are unchanged (bitwise: the step
        does not depend on inert padding rows). False: one capture per bucket.
      replay_update: at the ``"network"`` and ``"network+heads"`` levels, replay the update
        (guard, optimizer, EMA, metrics) as its own graph instead of running it eagerly; the
        update is static-shaped and free of host syncs whatever the heads do, and eagerly it costs
        tens of milliseconds of host time per step (hundreds of small tree operations).
      grad_reduce: data-parallel training (:class:`yolo_func.train.distributed.GradReducer`):
        ``(grads, losses, parts) -> (grads, losses, parts)`` run after the (replayed) backward and
        before the update, outside every CUDA graph. Not with ``capture="step"`` (its one graph
        holds the backward and the update together; see docs/distributed.md).
      compile: run the network and every head through ``torch.compile`` (inductor) at every level
        (the eager fall-back included) and capture the compiled kernels: ``False`` (default),
        ``True`` / ``"default"``, ``"max-autotune"``, ``"aot_eager"`` (no inductor; for debugging),
        or a :class:`yolo_func.train.compiled.CompiledModel` of ``model`` to share compiled
        functions between steps. Every level is then bitwise equal to the compiled eager step
        (``capture="none"`` with the same ``compile``), not to the uncompiled one. Compiling
        happens at the first call per input shape (before capture); :attr:`compile_seconds` says
        how long it took (:mod:`yolo_func.train.compiled`).
      vjp: the differentiation backend of every path (eager warm-ups, captures, fall-backs):
        ``"func"`` (default, ``torch.func.vjp``) or ``"autograd"`` (no ``torch._dynamo`` import;
        gradients equal ``"func"``'s up to summation order: :func:`yolo_func.func.vjp_backend`).
        Every level is bitwise equal to the eager step with the same backend.

    Call: ``step(ts, batch) -> (ts, metrics)``; ``batch.images`` ``uint8[B, 3, H, W]`` (0..255) or
    ``float[B, 3, H, W]`` in [0, 1].

    Raises:
      ValueError: an unknown ``capture`` level, ``max_captures`` not an int >= 1,
        ``grad_reduce`` with ``capture="step"``, a bad ``compile`` value, or an unknown ``vjp``.

    Example:
      >>> import torch
      >>> from yolo_func import yolov8
      >>> from yolo_func.optim import sgd
      >>> from yolo_func.train.replay import ReplayTrainStep
      >>> model = yolov8("n", num_classes=2)
      >>> step = ReplayTrainStep(model, sgd(0.01), capture="network", compile=True)  # compiles at the first call
      >>> step.compiled.mode, step.compile_seconds
      ('default', 0.0)
      >>> ReplayTrainStep(model, sgd(0.01), compile="fast")
      Traceback (most recent call last):
        ...
      ValueError: [yolo_func] compile must be True, False or one of ['none', 'default', 'max-autotune', 'aot_eager'], got 'fast'
    """

    def __init__(self, model: Model, tx, *, ema=None, capture: str = "network", autocast_dtype: Any = "auto",
                 channels_last: bool | None = None, skip_nonfinite: bool = True, max_captures: int = 4,
                 warmup: int = 3, replay_update: bool = True, grad_reduce: Callable | None = None,
                 compile: Any = False, reuse_buckets: bool = True, vjp: str = "func"):
        if capture not in _LEVEL_CLASSES:
            raise ValueError(f"[yolo_func] capture must be one of {list(LEVELS)}, got {capture!r}")
        if vjp not in VJP_BACKENDS:
            raise ValueError(f"[yolo_func] vjp must be one of {list(VJP_BACKENDS)}, got {vjp!r}")
        #: the differentiation backend (:func:`yolo_func.func.vjp_backend`)
        self.vjp = vjp
        if grad_reduce is not None and capture == "step":
            raise ValueError("[yolo_func] capture='step' replays backward and update as one graph, so a gradient "
                             "all-reduce (grad_reduce) has no place between them; use capture='network+heads' or "
                             "'network' for data-parallel training (docs/distributed.md)")
        self.grad_reduce = grad_reduce
        #: the :class:`yolo_func.train.compiled.CompiledModel` (None: uncompiled)
        self.compiled = compiled_for(model, compile)
        self.model, self.tx, self.ema, self.capture = model, tx, ema, capture
        self.autocast_dtype, self.channels_last = autocast_dtype, channels_last
        self.skip_nonfinite, self.warmup, self.replay_update = skip_nonfinite, warmup, replay_update
        self.reuse_buckets = bool(reuse_buckets)
        self._prewarmed = False
        self.cache = CaptureCache(max_captures)
        self._level = _LEVEL_CLASSES[capture](self)
        self._warned: set[str] = set()
        self._backups: dict = {}  # (key, part) -> (static tree, its snapshot buffers); see _snapshot

    # -- helpers used by the levels -------------------------------------------------------------
    def _dtype(self, images: torch.Tensor):
        if self.autocast_dtype == "auto":
            return autocast_dtype("auto", images.device)
        return self.autocast_dtype

    def _prepare(self, batch: Batch) -> Batch:
        # The boundary check (metadata only: no host sync) before anything is captured or copied
        # into static buffers; train_step repeats it for the eager paths.
        check_batch(batch, in_channels=self.model.in_channels)
        cl = self.channels_last if self.channels_last is not None else batch.images.device.type == "cuda"
        if cl and not batch.images.is_contiguous(memory_format=torch.channels_last):
            batch = Batch(batch.images.contiguous(memory_format=torch.channels_last), batch.targets)
        return batch

    def _fallback(self, reason: str) -> None:
        if reason not in self._warned:
            self._warned.add(reason)
            warnings.warn(f"[yolo_func] capture={self.capture!r} falls back to the eager step: {reason}",
                          CaptureFallbackWarning, stacklevel=4)

    def _eager(self, ts: TrainState, batch: Batch):
        return train_step(ts, batch, model=self.model, tx=self.tx, ema=self.ema,
                          autocast_dtype=self._dtype(batch.images), skip_nonfinite=self.skip_nonfinite,
                          grad_reduce=self.grad_reduce, compiled=self.compiled)

    def _update_replay(self, key: Hashable, ts: TrainState, inputs: UpdateInputs, *, persistent: list):
        """:func:`finish_step` replayed from a graph of its own (one per network capture, stored
        under the network's key), over the training state donated as its static carry.

        The network's static gradients, BN statistics and their snapshot are read in place
        (``persistent``), the heads' eager outputs are copied in (one multi-tensor copy).
        """
        def update(carry, inp: UpdateInputs):
            # the pure apply_updates: the graph writes the new carry back into the donated state
            return finish_step(carry, inp.grads, inp.new_state, inp.losses, inp.parts, inp.feat_norms,
                               tx=self.tx, ema=self.ema, skip_nonfinite=self.skip_nonfinite,
                               old_model_state=inp.old_state)

        cap = self.cache.get_or_capture(key, lambda: self._quiesced(capture_step)(
            update, ts, inputs, warmup=self.warmup, pool=self.cache.pool, donate_carry=True,
            persistent=persistent), part="update")
        return cap.step(ts, inputs)

    def _quiesced(self, capture: Callable) -> Callable:
        """``capture`` run after the device has finished all queued work when the step all-reduces
        (data-parallel): no collective is in flight while a graph is captured (a communicator's
        watchdog polling an unfinished collective's event during a capture can invalidate it). Only
        at capture time: replays never synchronise."""
        if self.grad_reduce is None or not torch.cuda.is_available():
            return capture

        def run(*args, **kwargs):
            torch.cuda.synchronize()
            return capture(*args, **kwargs)

        return run

    def _snapshot(self, key: Hashable, tree):
        """A copy of ``tree`` (static BN statistics a replayed forward is about to overwrite), in
        buffers allocated once per static tree and refreshed in place on later calls."""
        entry = self._backups.get(key)
        if entry is None or entry[0] is not tree:
            entry = self._backups[key] = (tree, T.tree_clone(tree))
        else:
            T.tree_copy_(entry[1], tree)
        return entry[1]

    @property
    def compile_seconds(self) -> float:
        """Seconds spent compiling so far (0.0 uncompiled; :attr:`CompiledModel.compile_seconds`)."""
        return 0.0 if self.compiled is None else self.compiled.compile_seconds

    def _prewarm(self, ts: TrainState, batch: Batch) -> None:
        """Before the first capture, while ``torch._dynamo`` is still being imported (a fit imports
        it on a thread; functorch's pullback needs it): one eager step through autograd
        (:func:`yolo_func.func.vjp_through_autograd`), its results discarded, so that the lazy CUDA
        set-up of the step's kernels overlaps with that import instead of following it. Once."""
        self._prewarmed = True
        # not with a gradient all-reduce (ranks would disagree on running it) nor compiled (dynamo
        # is imported by the compile anyway)
        if (not PREWARM or self.capture == "none" or not batch.images.is_cuda or self.grad_reduce is not None
                or self.compiled is not None or self.vjp == "autograd" or dynamo_imported()):
            return
        with vjp_through_autograd():
            self._eager(ts, batch)

    # -- the step -------------------------------------------------------------------------------
    def __call__(self, ts: TrainState, batch: Batch) -> tuple[TrainState, dict]:
        batch = self._prepare(batch)
        with vjp_backend(self.vjp):  # every path below (warm-ups, captures, fall-backs) differentiates alike
            if not self._prewarmed:
                self._prewarm(ts, batch)
            return self._level(ts, batch)

    def __repr__(self) -> str:
        mode = "none" if self.compiled is None else self.compiled.mode
        vjp = "" if self.vjp == "func" else f", vjp={self.vjp!r}"
        return f"ReplayTrainStep(capture={self.capture!r}, compile={mode!r}{vjp}, cache={self.cache!r})"
