"""The eager training step: one network VJP, one VJP per head, explicit sum of feature gradients.

Data flow (DESIGN.md §1)::

    feats, net_pullback = vjp(network.apply, params.network)            # forward once
    preds_h, head_pullback_h = vjp(head_h.apply, params.heads[h], feats)  # each head once
    assignment = assign_from_detect(preds["detect"].detach(), targets)     # once, no gradient
    g_preds_h, loss_h, parts_h = loss_grad(head_h, preds_h, ...)            # each loss on its own
    g_params_h, g_feats_h = head_pullback_h(g_preds_h)
    g_feats = sum_h g_feats_h                                              # explicit sum
    g_network = net_pullback(g_feats)
    updates, opt_state = apply_if_finite(tx).update(grads, opt_state, params, finite=finite)
    params = apply_updates(params, updates); ema = ema.update(..., stepped=opt_state.stepped)

Nothing here synchronises with the host: metrics stay on the device until
:func:`yolo_func.train.metrics.fetch_metrics` reads them at a log step. (On the CPU, where there is
no device to wait for, the optimizer's selects read their flags on the host:
:func:`yolo_func.optim.base.host_flag`.)

Numerics: the network and heads run under autocast when ``autocast_dtype`` is given (BF16 on CUDA
by default in :class:`yolo_func.train.replay.ReplayTrainStep`); every loss runs in float32 on float32 copies of the head
outputs (the gradient flows back through the cast), as the assignment does (trap T20).

Non-finite policy: when the summed loss or the global gradient norm is not finite, the step is
skipped on the device, for every optimizer. The step wraps the user's ``tx`` in
:func:`yolo_func.optim.apply_if_finite` (in :func:`init_train_state`, so ``TrainState.opt_state``
is an :class:`yolo_func.optim.ApplyIfFiniteState` around ``tx``'s state, and in
:func:`finish_step`); that wrapper zeroes this micro-batch's gradients, returns zero updates and
keeps the whole inner optimizer state (momenta, Adam moments and counts, accumulation buffers), so
the params do not move; the BN statistics keep their previous values here and the EMA does not
move (it follows the wrapper's ``stepped`` flag). ``TrainState.skipped`` counts it and
``metrics["finite"]`` is False. Integer counters that advance anyway: ``TrainState.step`` and the
wrapper's ``count`` (the iteration ``ni`` the schedules and ``multi_steps`` read: the reference's
loop index, which counts every micro-batch) and its non-finite counters.
:func:`yolo_func.train.metrics.fetch_metrics` reports the step and the offending loss parts.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch

from yolo_func import tree as T
from yolo_func._types import Assignment, Feats
from yolo_func.assign.tal import assign_from_detect
from yolo_func.func import autocast, first_order, flat_vjp, vjp_backend  # re-exported: they live in yolo_func.func
from yolo_func.losses.precision import at_least_f32
from yolo_func.models.yolov8 import Model
from yolo_func.nn import update_stats_in_place
from yolo_func.optim import apply_if_finite, apply_updates, flat, global_norm
from yolo_func.optim.base import finite_scalar, host_flag
from yolo_func.structures.checks import check_batch
from yolo_func.train.state import Batch, TrainState

__all__ = [
    "autocast",
    "first_order",
    "flat_vjp",
    "HeadsBackward",
    "LossesBackward",
    "normalize_images",
    "input_dtype",
    "network_vjp",
    "head_vjp",
    "loss_grad",
    "heads_backward",
    "losses_backward",
    "finish_step",
    "train_step",
    "init_train_state",
    "global_norm",
]


def _stateful_vjp(apply: Callable[..., tuple[Any, Any]], state: Any, primals: tuple, device: torch.device,
                  autocast_dtype, vjp: Callable | None = None):
    """``apply(*primals, state) -> (outputs, new_state)`` through :func:`flat_vjp` (or ``vjp``,
    e.g. a :class:`yolo_func.train.compiled.CompiledModel`'s), first order.

    BN statistics are updated in place on a flat copy of ``state`` (a couple of kernels rather
    than two clones per BN layer); the caller's ``state`` is never written. A compiled ``apply``
    gets separate clones instead (views of one buffer would reach AOTAutograd as aliased mutated
    inputs: another graph than the replay's static buffers get).
    """
    fresh = T.tree_clone_flat(state) if vjp is None else T.tree_clone(state)

    def fn(*p):
        with update_stats_in_place():
            return apply(*p, fresh)

    with autocast(device, autocast_dtype):
        out, pullback, new_state = (flat_vjp if vjp is None else vjp)(fn, *primals)
    return out, first_order(pullback), new_state


class LossesBackward(NamedTuple):
    """What :func:`losses_backward` returns.

    Attributes:
      g_feats: :class:`yolo_func.Feats`, the explicit sum of every head's feature gradients.
      head_grads: ``{h: g_params_h}``.
      losses: ``{h: float32[]}``, each head's loss.
      parts: ``{"h/part": float32[]}``, the loss items.
      feat_norms: ``{h: float32[]}``, the norm of each head's feature gradient.
    """

    g_feats: Feats
    head_grads: dict
    losses: dict
    parts: dict
    feat_norms: dict


class HeadsBackward(NamedTuple):
    """What :func:`heads_backward` returns: :class:`LossesBackward`'s fields plus the heads' new
    BN statistics.

    Attributes:
      g_feats, head_grads, losses, parts, feat_norms: as :class:`LossesBackward`.
      head_states: ``{h: new_state_h}``.
    """

    g_feats: Feats
    head_grads: dict
    head_states: dict
    losses: dict
    parts: dict
    feat_norms: dict


def normalize_images(images: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The network's input: ``uint8`` pixels (0..255) divided by 255 on their device, or floating
    images in [0, 1] as they are (the same tensor).

    Called inside the differentiated (and captured) network function, so a replayed step converts
    on the device inside its graph. ``images.to(dtype) / 255`` is exactly what a caller computing
    ``images.float() / 255`` gets, bit for bit.

    Args:
      images: ``uint8[B, 3, H, W]`` or ``float[B, 3, H, W]``.
      dtype: the floating dtype for uint8 images (the network parameters' dtype).

    Returns:
      ``dtype[B, 3, H, W]`` for uint8 images (same memory format), else ``images`` itself.

    Raises:
      TypeError: ``images`` is neither uint8 nor floating.
    """
    if images.dtype == torch.uint8:
        return images.to(dtype) / 255
    if not images.is_floating_point():
        raise TypeError(
            f"[yolo_func] images must be uint8 (0..255) or floating (0..1), got {images.dtype}; "
            f"convert them with images.to(torch.uint8) or images.float() / 255"
        )
    return images


def input_dtype(params: Any) -> torch.dtype:
    """The floating dtype uint8 images are converted to: the first floating leaf's of ``params``
    (float32 when there is none)."""
    leaf = T.tree_first_leaf(params, lambda x: isinstance(x, torch.Tensor) and x.is_floating_point())
    return torch.float32 if leaf is None else leaf.dtype


def network_vjp(model: Model, params: dict, state: dict, images: torch.Tensor, *, autocast_dtype=None,
                compiled=None):
    """Network forward with its pullback.

    Args:
      params, state: the ``network`` subtrees.
      images: ``uint8[B, 3, H, W]`` (0..255; divided by 255 inside the differentiated function)
        or ``float[B, 3, H, W]`` in [0, 1].
      compiled: a :class:`yolo_func.train.compiled.CompiledModel` of ``model``: its compiled
        network, differentiated through autograd; None: the plain network through ``torch.func``.

    Returns:
      ``(feats: Feats, pullback: Feats -> (g_params,), new_state)``.
    """
    if compiled is not None:
        return _stateful_vjp(lambda p, s: compiled.network(p, s, images), state, (params,), images.device,
                             autocast_dtype, vjp=compiled.vjp("network"))
    dtype = input_dtype(params)

    def features(p, s):
        return model.features(p, s, normalize_images(images, dtype), train=True)

    return _stateful_vjp(features, state, (params,), images.device, autocast_dtype)


def head_vjp(head, params: dict, state: dict, feats: Feats, *, autocast_dtype=None, compiled_apply=None,
             vjp: Callable | None = None):
    """One head's forward with its pullback w.r.t. ``(params, feats)``.

    Args:
      compiled_apply, vjp: a compiled apply ``(params, state, feats) -> (preds, new_state)`` and
        the vjp that differentiates it (:meth:`yolo_func.train.compiled.CompiledModel.head` and
        ``.vjp``); None: ``head.apply`` through ``torch.func``.

    Returns:
      ``(preds, pullback: g_preds -> (g_params, g_feats), new_state)``.
    """
    if compiled_apply is not None:
        return _stateful_vjp(lambda p, f, s: compiled_apply(p, s, f), state, (params, feats), feats[0].device,
                             autocast_dtype, vjp=vjp)
    return _stateful_vjp(lambda p, f, s: head.apply(p, s, f, train=True), state, (params, feats),
                         feats[0].device, autocast_dtype)


def loss_grad(head, preds: Any, targets: Any, assignment: Assignment):
    """Gradient of one head's loss w.r.t. its own predictions; the loss runs in at least float32
    (half-precision predictions are upcast inside the differentiated function).

    Returns:
      ``(g_preds (same tree and dtypes as preds), loss float[], parts dict of float[])``.
    """
    # A first-order reverse pass (torch.autograd.grad, create_graph=False) over fresh leaves: the
    # same gradient as grad_and_value, without recording a graph of the backward (host time).
    leaves, treedef = T.tree_flatten(preds)
    with torch.enable_grad():
        xs = [x.detach().requires_grad_(True) for x in leaves]
        pr = T.tree_map(at_least_f32, T.tree_unflatten(treedef, xs))
        loss, parts = head.loss(pr, targets, assignment)
    grads = torch.autograd.grad(loss, xs, allow_unused=True)
    g_preds = T.tree_unflatten(treedef, [torch.zeros_like(x) if g is None else g for x, g in zip(xs, grads)])
    # Parts a loss already detached are kept as they are (no second detach op).
    loss, parts = loss.detach(), {k: v.detach() if v.requires_grad else v for k, v in parts.items()}
    # The head's backward sees each cotangent in its prediction's layout: a captured head replays
    # its backward on cotangent buffers laid out like its outputs, and BN/conv backward kernels
    # (and their reduction order) depend on the layout — e.g. the mask loss returns an NCHW
    # gradient for NHWC prototypes. A stride check on the host; a copy only when they differ.
    g_preds = T.tree_map(_like_layout, g_preds, preds)
    return g_preds, loss, parts


def _like_layout(g: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """``g`` with the strides of ``ref`` (same shape): ``g`` itself when they already match."""
    if g.stride() == ref.stride():
        return g
    return torch.empty_like(ref, dtype=g.dtype).copy_(g)


def heads_backward(model: Model, head_params: Mapping, head_states: Mapping, feats: Feats, targets: Any, *,
                   autocast_dtype=None, assign_kw: Mapping | None = None, compiled=None):
    """Every head's forward, the shared assignment, every head's loss gradient and pullback.

    Args:
      head_params, head_states: ``params["heads"]``, ``state["heads"]``.
      feats: the network outputs (plain tensors: leaves of the heads' VJPs).
      targets: padded :class:`yolo_func.Targets`.
      compiled: a :class:`yolo_func.train.compiled.CompiledModel` (each head's compiled apply) or None.

    Returns:
      :class:`HeadsBackward` ``(g_feats: Feats (explicit sum over heads), head_grads: {h: g_params_h},
      head_states: {h: new_state_h}, losses: {h: float32[]}, parts: {"h/part": float32[]},
      feat_norms: {h: float32[]})``.
    """
    preds, pullbacks, new_states = {}, {}, {}
    for name, head in model.heads.items():
        extra = {} if compiled is None else {"compiled_apply": compiled.head(name), "vjp": compiled.vjp(name)}
        preds[name], pullbacks[name], new_states[name] = head_vjp(
            head, head_params[name], head_states[name], feats, autocast_dtype=autocast_dtype, **extra
        )
    g_feats, head_grads, losses, parts, norms = losses_backward(model, feats, preds, pullbacks, targets,
                                                               assign_kw=assign_kw)
    return HeadsBackward(g_feats, head_grads, new_states, losses, parts, norms)


def losses_backward(model: Model, feats: Feats, preds: Mapping, pullbacks: Mapping, targets: Any, *,
                    assign_kw: Mapping | None = None):
    """The shared assignment, then each head's loss gradient through that head's own pullback, and
    the explicit sum of the feature gradients (eager heads and replayed heads alike).

    Args:
      feats: the network outputs (for the anchors).
      preds: ``{h: head h's predictions}``.
      pullbacks: ``{h: g_preds -> (g_params_h, g_feats_h)}``.
      targets: padded :class:`yolo_func.Targets`.

    Returns:
      :class:`LossesBackward` ``(g_feats: Feats, head_grads: {h: g_params_h}, losses: {h: float32[]},
      parts: {"h/part": float32[]}, feat_norms: {h: float32[]})``.
    """
    assignment = assign_from_detect(preds["detect"], targets, model.anchors(feats), reg_max=model.reg_max,
                                    **(assign_kw or {}))
    g_feats, head_grads, losses, parts, norms = None, {}, {}, {}, {}
    for name, head in model.heads.items():
        g_preds, losses[name], head_parts = loss_grad(head, preds[name], targets, assignment)
        head_grads[name], g_f = pullbacks[name](g_preds)
        norms[name] = global_norm(g_f)
        g_feats = g_f if g_feats is None else T.tree_add(g_feats, g_f)  # the explicit sum over heads
        parts.update({f"{name}/{k}": v for k, v in head_parts.items()})
    return LossesBackward(Feats(*g_feats), head_grads, losses, parts, norms)


def finish_step(ts: TrainState, grads: dict, new_model_state: dict, losses: Mapping, parts: Mapping,
                feat_norms: Mapping, *, tx, ema=None, skip_nonfinite: bool = True, apply=apply_updates,
                old_model_state: dict | None = None, grad_reduce: Callable | None = None):
    """Optimizer, EMA, the non-finite guard and the metrics (shared by the eager and replay steps).

    Args:
      tx: the user's optimizer; it runs wrapped in :func:`yolo_func.optim.apply_if_finite`
        (``ts.opt_state`` is that wrapper's state, as :func:`init_train_state` builds it), which
        owns skipping: ``finite`` (summed loss and gradient norm both finite) is its veto.
      skip_nonfinite: False builds the wrapper with ``enabled=False`` (nothing is skipped; the
        state keeps its structure).
      apply: ``apply_updates`` (pure) or ``apply_updates_`` (in place, for static buffers).
      old_model_state: the BN statistics a skipped step keeps (default ``ts.state``; a replayed
        network has already overwritten its static statistics, so it passes a backup).
      grad_reduce: data-parallel training: ``(grads, losses, parts) -> (grads, losses, parts)``
        run first, between the backward and the optimizer
        (:class:`yolo_func.train.distributed.GradReducer`: gradients summed over the ranks, loss
        values averaged); None: one process.

    Returns:
      ``(TrainState, metrics)``; metrics are device tensors.
    """
    if grad_reduce is not None:
        grads, losses, parts = grad_reduce(grads, losses, parts)
    total = torch.stack([v.float() for v in losses.values()]).sum()
    gnorm = global_norm(grads)
    guard = apply_if_finite(tx, enabled=skip_nonfinite)
    # The guard's own check is isfinite(gnorm): it reuses this norm (no second pass over the
    # gradients). Without the guard the veto must carry the gradient check itself.
    veto = finite_scalar(total) if skip_nonfinite else finite_scalar(total) & finite_scalar(gnorm)
    updates, opt_state = guard.update(grads, ts.opt_state, ts.params, finite=veto, grad_norm=gnorm)
    finite = opt_state.notfinite_count == 0  # the wrapper's verdict (the veto AND its own gradient check)
    if skip_nonfinite:
        old = ts.state if old_model_state is None else old_model_state
        new_model_state = flat.tree_where(finite, new_model_state, old)  # one kernel per flat buffer, no copy of `old`
    stepped = opt_state.stepped  # false on a skipped call and on accumulating micro-steps
    if apply is apply_updates and host_flag(stepped) is False:
        params = ts.params  # read on the host (CPU, eager): no step, the params stay (the updates are zeros)
    else:
        params = apply(ts.params, updates)
    ema_state = ts.ema
    if ema is not None:
        ema_state = ema.update({"params": params, "state": new_model_state}, ts.ema, stepped=stepped)
    metrics = {f"loss/{k}": v for k, v in parts.items()}
    metrics.update({f"feat_grad_norm/{k}": v for k, v in feat_norms.items()})
    # step: a copy, so a captured step's metric is not the carry buffer it later overwrites
    metrics.update(loss=total, grad_norm=gnorm, finite=finite, stepped=stepped.clone(), step=ts.step.clone())
    new_ts = TrainState(params, new_model_state, opt_state, ema_state, ts.step + 1,
                        ts.skipped + ~finite)  # int64 + bool: one add, no cast
    return new_ts, metrics


def train_step(ts: TrainState, batch: Batch, *, model: Model, tx, ema=None, autocast_dtype: torch.dtype | None = None,
               skip_nonfinite: bool = True, assign_kw: Mapping | None = None,
               grad_reduce: Callable | None = None, compiled=None, vjp: str | None = None) -> tuple[TrainState, dict]:
    """One eager training step (pure: returns a new state, never writes the old one).

    Args:
      ts: :class:`TrainState`.
      batch: ``Batch(images, targets)``; images ``uint8[B, 3, H, W]`` (0..255, divided by 255 on
        the device inside the network's differentiated function: :func:`normalize_images`) or
        ``float[B, 3, H, W]`` in [0, 1].
      model: the :class:`Model` whose params ``ts`` holds.
      tx: any :class:`yolo_func.optim.GradientTransformation` (``sgd``, ``adamw``,
        ``yolo_sgd(...).tx``, ``multi_steps(...)``); the step wraps it in
        :func:`yolo_func.optim.apply_if_finite` (``ts`` must come from :func:`init_train_state`
        with the same ``tx``).
      ema: an :class:`yolo_func.optim.Ema` or None.
      autocast_dtype: e.g. ``torch.bfloat16``; None runs in the params' dtype.
      skip_nonfinite: apply the non-finite policy of this module's docstring.
      grad_reduce: as :func:`finish_step` (data-parallel: the gradient all-reduce).
      compiled: a :class:`yolo_func.train.compiled.CompiledModel` of ``model``: the network and
        heads run compiled (differentiated through autograd); None: plain ``torch.func``.
      vjp: the differentiation backend, ``"func"`` or ``"autograd"``
        (:func:`yolo_func.func.vjp_backend`: same kernels, gradients equal up to summation order,
        ``"autograd"`` never imports ``torch._dynamo``); None: the calling thread's (``"func"``
        unless inside a ``vjp_backend`` block).

    Returns:
      ``(new TrainState, metrics)``: metrics hold ``loss/<head>/<part>`` (the reference's loss
      items), ``feat_grad_norm/<head>``, ``loss``, ``grad_norm``, ``finite``, ``stepped``, ``step``.

    Example:
      >>> import torch
      >>> from yolo_func import yolov8
      >>> from yolo_func.optim import sgd
      >>> from yolo_func.train import init_train_state
      >>> model = yolov8("n", task="detect", num_classes=5)
      >>> tx = sgd(0.01, momentum=0.9)
      >>> ts = init_train_state(model, tx, torch.Generator().manual_seed(0))
      >>> from yolo_func.testing.synthetic import synthetic_batch
      >>> from yolo_func.train import train_step
      >>> batch = synthetic_batch("detect", 2, 64, num_classes=5)    # Batch(images uint8[2, 3, 64, 64], targets)
      >>> ts2, metrics = train_step(ts, batch, model=model, tx=tx)
      >>> int(ts2.step), int(ts.step), bool(metrics["finite"]), sorted(k for k in metrics if k.startswith("loss/"))[:3]
      (1, 0, True, ['loss/detect/box', 'loss/detect/cls', 'loss/detect/dfl'])
    """
    check_batch(batch, in_channels=model.in_channels)  # metadata only: no host sync, safe under capture
    if vjp is not None:
        with vjp_backend(vjp):
            return train_step(ts, batch, model=model, tx=tx, ema=ema, autocast_dtype=autocast_dtype,
                              skip_nonfinite=skip_nonfinite, assign_kw=assign_kw, grad_reduce=grad_reduce,
                              compiled=compiled)
    images = batch.images
    feats, net_pullback, net_state = network_vjp(model, ts.params["network"], ts.state["network"], images,
                                                 autocast_dtype=autocast_dtype, compiled=compiled)
    g_feats, head_grads, head_states, losses, parts, norms = heads_backward(
        model, ts.params["heads"], ts.state["heads"], feats, batch.targets, autocast_dtype=autocast_dtype,
        assign_kw=assign_kw, compiled=compiled
    )
    (g_network,) = net_pullback(g_feats)
    grads = {"network": g_network, "heads": head_grads}
    new_state = {"network": net_state, "heads": head_states}
    return finish_step(ts, grads, new_state, losses, parts, norms, tx=tx, ema=ema, skip_nonfinite=skip_nonfinite,
                       grad_reduce=grad_reduce)


def init_train_state(model: Model, tx, gen: torch.Generator, *, device: torch.device | str = "cpu", ema=None,
                     channels_last: bool | None = None, params: dict | None = None, state: dict | None = None) -> TrainState:
    """Initialise (or wrap given) params and state, the optimizer state and the EMA on ``device``.

    The optimizer state is ``apply_if_finite(tx).init(params)``: an
    :class:`yolo_func.optim.ApplyIfFiniteState` whose ``inner_state`` is ``tx``'s own, the form
    :func:`train_step` and :class:`yolo_func.train.replay.ReplayTrainStep` update (pass the plain
    ``tx`` to both; the step adds the guard).

    Args:
      tx: the optimizer (any :class:`yolo_func.optim.GradientTransformation`).
      channels_last: lay 4-D parameters out NHWC; defaults to True on CUDA, False elsewhere.
      params, state: start from these trees (e.g. converted reference weights) instead of ``init``.

    Example:
      >>> import torch
      >>> from yolo_func import yolov8
      >>> from yolo_func.optim import sgd
      >>> from yolo_func.train import init_train_state
      >>> model = yolov8("n", task="detect", num_classes=5)
      >>> tx = sgd(0.01, momentum=0.9)
      >>> ts = init_train_state(model, tx, torch.Generator().manual_seed(0))
      >>> sorted(ts.params), type(ts.opt_state).__name__
      (['heads', 'network'], 'ApplyIfFiniteState')
      >>> ts.params["network"]["backbone"]["stem"]["conv"]["weight"].device.type
      'cpu'
    """
    device = torch.device(device)
    if channels_last is None:
        channels_last = device.type == "cuda"
    if params is None or state is None:
        params, state = model.init(gen)
    params = T.tree_to(params, device, channels_last=channels_last)
    state = T.tree_to(state, device)
    zero = torch.zeros((), dtype=torch.int64, device=device)
    ema_state = ema.init({"params": params, "state": state}) if ema is not None else None
    return TrainState(params, state, apply_if_finite(tx).init(params), ema_state, zero, zero.clone())
