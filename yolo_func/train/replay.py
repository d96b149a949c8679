"""Training steps that replay CUDA graphs, each bitwise equal to the eager :func:`train_step`.

Levels (``capture=``):

- ``"none"``: the eager step.
- ``"network"`` (default on CUDA; the mission's shape): backbone + neck forward and backward are
  replayed (:func:`yolo_func.capture.capture_vjp`); each head's apply and loss run eagerly as their
  own functional calls; the heads' feature gradients are summed explicitly and copied into the
  static cotangent buffers; one backward replay. The update that follows — the non-finite guard,
  optimizer, EMA and metrics (:func:`yolo_func.train.step.finish_step`) — is replayed as a graph
  of its own over the training state (``replay_update=True``, the default) or runs eagerly
  (``replay_update=False``); either way it writes the static parameters.
- ``"network+heads"``: as ``"network"``, and each head's apply forward/backward is replayed too,
  as its own graph pair w.r.t. (head params, features) with a private pool, so every head keeps an
  independent gradient; the assignment and the losses run eagerly.
- ``"step"``: the whole eager step — network, heads, assignment, the static-shape losses, the
  explicit gradient sum, the non-finite guard, optimizer and EMA — replayed as one graph
  (:func:`yolo_func.capture.capture_step`), one capture per (batch shape, image size, target
  bucket) in a bounded cache sharing one memory pool.

Gradient accumulation works at every level: the optimizer's :func:`yolo_func.optim.multi_steps`
sums into buffers of its own (never the static gradient buffers a replay returns).

Donation: replay steps keep the training state in static buffers and update them in place. The
``TrainState`` you pass in is consumed — its tensors become the static carry of the captured
update (no second copy of the state); use the one returned. ``metrics`` of a replayed update (every
level but ``"none"``, unless ``replay_update=False``) are static buffers too: fetch (or clone) them
before the next call.

Fallback: when capture cannot hold — the inputs are not on a CUDA device, a head is marked
``capturable=False`` (for ``"network+heads"`` and ``"step"``), or the bounded cache is full — the step runs eagerly and
one warning (``CaptureFallbackWarning``) names the reason, once per reason.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import torch

from yolo_func import tree as T
from yolo_func._types import Feats
from yolo_func.capture import CaptureCache, CaptureUnavailable, capture_step, capture_vjp
from yolo_func.models.yolov8 import Model
from yolo_func.optim import apply_updates_
from yolo_func.train.state import Batch, TrainState
from yolo_func.train.step import finish_step, heads_backward, losses_backward, train_step

__all__ = ["LEVELS", "CaptureFallbackWarning", "ReplayTrainStep"]

LEVELS = ("none", "network", "network+heads", "step")


class CaptureFallbackWarning(UserWarning):
    """A replay level could not hold and the step ran eagerly (the message says why)."""


def _batch_key(batch: Batch) -> tuple:
    t = batch.targets
    return (
        tuple(batch.images.shape), batch.images.dtype, tuple(t.boxes.shape),
        None if t.masks is None else tuple(t.masks.shape),
        None if t.keypoints is None else tuple(t.keypoints.shape),
    )


class ReplayTrainStep:
    """A training step at a replay level (see the module docstring).

    Args:
      model, tx, ema: as :func:`yolo_func.train.train_step`.
      capture: ``"none"``, ``"network"``, ``"network+heads"`` or ``"step"``.
      autocast_dtype: ``"auto"`` (BF16 on CUDA, none elsewhere), a dtype, or None.
      channels_last: NHWC images (default on CUDA; keep the params NHWC too, as
        :func:`init_train_state` does on CUDA).
      skip_nonfinite: the non-finite policy of :mod:`yolo_func.train.step`.
      max_captures: bound of the capture cache (distinct batch / image / bucket shapes).
      warmup: eager warm-up runs before each capture.
      replay_update: at the ``"network"`` and ``"network+heads"`` levels, replay the update
        (guard, optimizer, EMA, metrics) as its own graph instead of running it eagerly; the
        update is static-shaped and free of host syncs whatever the heads do, and eagerly it costs
        tens of milliseconds of host time per step (hundreds of small tree operations).

    Call: ``step(ts, batch) -> (ts, metrics)``.
    """

    def __init__(self, model: Model, tx, *, ema=None, capture: str = "network", autocast_dtype: Any = "auto",
                 channels_last: bool | None = None, skip_nonfinite: bool = True, max_captures: int = 4,
                 warmup: int = 3, replay_update: bool = True):
        if capture not in LEVELS:
            raise ValueError(f"[yolo_func] capture must be one of {list(LEVELS)}, got {capture!r}")
        self.model, self.tx, self.ema, self.capture = model, tx, ema, capture
        self.autocast_dtype, self.channels_last = autocast_dtype, channels_last
        self.skip_nonfinite, self.warmup, self.replay_update = skip_nonfinite, warmup, replay_update
        self._updates: dict = {}  # network capture key -> the captured update (one per network capture)
        self.cache = CaptureCache(max_captures)
        self._warned: set[str] = set()
        self._dummy = None
        self._head_caps: dict = {}
        self._head_backups: dict = {}
        self._backups: dict = {}  # key -> (static tree, its snapshot buffers); see _snapshot

    # -- helpers ---------------------------------------------------------------------------
    def _dtype(self, images: torch.Tensor):
        if self.autocast_dtype == "auto":
            return torch.bfloat16 if images.device.type == "cuda" else None
        return self.autocast_dtype

    def _prepare(self, batch: Batch) -> Batch:
        cl = self.channels_last if self.channels_last is not None else batch.images.device.type == "cuda"
        if cl and not batch.images.is_contiguous(memory_format=torch.channels_last):
            batch = Batch(batch.images.contiguous(memory_format=torch.channels_last), batch.targets)
        return batch

    def _fallback(self, reason: str) -> None:
        if reason not in self._warned:
            self._warned.add(reason)
            warnings.warn(f"[yolo_func] capture={self.capture!r} falls back to the eager step: {reason}",
                          CaptureFallbackWarning, stacklevel=3)

    def _eager(self, ts: TrainState, batch: Batch):
        return train_step(ts, batch, model=self.model, tx=self.tx, ema=self.ema,
                          autocast_dtype=self._dtype(batch.images), skip_nonfinite=self.skip_nonfinite)

    # -- the step --------------------------------------------------------------------------
    def __call__(self, ts: TrainState, batch: Batch) -> tuple[TrainState, dict]:
        batch = self._prepare(batch)
        if self.capture == "none":
            return self._eager(ts, batch)
        if batch.images.device.type != "cuda":
            self._fallback(f"the inputs are on {batch.images.device}, not a CUDA device")
            return self._eager(ts, batch)
        if self.capture in ("step", "network+heads"):
            not_capturable = [n for n, h in self.model.heads.items() if not h.capturable]
            if not_capturable:
                self._fallback(f"head(s) {not_capturable} are marked capturable=False")
                return self._eager(ts, batch)
        try:
            if self.capture == "step":
                return self._step_replay(ts, batch)
            return self._network_replay(ts, batch)
        except CaptureUnavailable as e:
            self._fallback(e.reason)
            return self._eager(ts, batch)

    def _step_replay(self, ts: TrainState, batch: Batch):
        def fn(carry, inputs):
            return train_step(carry, inputs, model=self.model, tx=self.tx, ema=self.ema,
                              autocast_dtype=self._dtype(batch.images), skip_nonfinite=self.skip_nonfinite)

        cap = self.cache.get_or_capture(
            ("step",) + _batch_key(batch),
            lambda: capture_step(fn, ts, batch, warmup=self.warmup, pool=self.cache.pool, donate_carry=True),
        )
        return cap.step(ts, batch)

    def _network_replay(self, ts: TrainState, batch: Batch):
        model, images = self.model, batch.images
        dtype = self._dtype(images)

        def net_fn(p, s, x):
            return model.network.apply(p, s, x, train=True)

        net_key = ("network", tuple(images.shape), images.dtype)
        cap = self.cache.get_or_capture(
            net_key,
            lambda: capture_vjp(net_fn, ts.params["network"], ts.state["network"], images, warmup=self.warmup,
                                autocast_dtype=dtype, pool=self.cache.pool),
        )
        static = cap.static
        # Adopt the static buffers as the state's network leaves (copies happen only on the first
        # call with a fresh TrainState or after a switch between captures).
        if not _holds(ts.params["network"], static.params):
            T.tree_copy_(static.params, ts.params["network"])
            T.tree_copy_(static.state, ts.state["network"])
            ts = ts._replace(params={**ts.params, "network": static.params}, state={**ts.state, "network": static.state})
        old_net_state = None
        if self.skip_nonfinite:
            # The replayed forward overwrites the static BN statistics; keep a copy for a skipped step.
            old_net_state = self._snapshot("network", static.state)
        feats, net_state = cap.forward(static.params, static.state, images)
        if self.capture == "network+heads":
            ts, heads_out = self._heads_replay(ts, Feats(*feats), batch.targets, dtype)
            g_feats, head_grads, head_states, losses, parts, norms = heads_out
        else:
            g_feats, head_grads, head_states, losses, parts, norms = heads_backward(
                model, ts.params["heads"], ts.state["heads"], Feats(*feats), batch.targets, autocast_dtype=dtype
            )
        g_network = cap.backward(g_feats)
        grads = {"network": g_network, "heads": head_grads}
        new_state = {"network": net_state, "heads": head_states}
        old_state = None
        if old_net_state is not None:
            old_heads = self._head_backups if self.capture == "network+heads" else ts.state["heads"]
            old_state = {"network": old_net_state, "heads": old_heads}
        if self.replay_update:
            # static buffers of the replayed graphs and snapshots refreshed in place: read where they
            # live (the BN statistics, network and heads, are carry leaves: read in place anyway)
            persistent = [g_network, old_net_state]
            if self.capture == "network+heads":
                persistent += [head_grads, self._head_backups]
            new_ts, metrics = self._update_replay(net_key, ts, (grads, new_state, losses, parts, norms, old_state),
                                                  persistent=T.tree_leaves(persistent))
        else:
            new_ts, metrics = finish_step(ts, grads, new_state, losses, parts, norms, tx=self.tx, ema=self.ema,
                                          skip_nonfinite=self.skip_nonfinite, apply=apply_updates_,
                                          old_model_state=old_state)
        # Keep the BN statistics in the static buffers (a skipped step restores them there).
        if not _holds(new_ts.state["network"], static.state):
            T.tree_copy_(static.state, new_ts.state["network"])
            new_ts = new_ts._replace(state={**new_ts.state, "network": static.state})
        if self.capture == "network+heads":
            heads_state = dict(new_ts.state["heads"])
            for name, hcap in self._head_caps.items():
                if not _holds(heads_state[name], hcap.static.state):
                    T.tree_copy_(hcap.static.state, heads_state[name])
                    heads_state[name] = hcap.static.state
            new_ts = new_ts._replace(state={**new_ts.state, "heads": heads_state})
        return new_ts, metrics

    def _update_replay(self, net_key, ts: TrainState, inputs: tuple, *, persistent: list):
        """:func:`finish_step` replayed from a graph of its own (one per network capture and
        level), over the training state donated as its static carry.

        ``inputs = (grads, new_model_state, losses, parts, feat_norms, old_model_state)``; the
        network's static gradients, BN statistics and their snapshot are read in place
        (``persistent``), the heads' eager outputs are copied in (one multi-tensor copy).
        """
        def update(carry, inp):
            grads, new_state, losses, parts, norms, old_state = inp
            # the pure apply_updates: the graph writes the new carry back into the donated state
            return finish_step(carry, grads, new_state, losses, parts, norms, tx=self.tx, ema=self.ema,
                               skip_nonfinite=self.skip_nonfinite, old_model_state=old_state)

        key = (self.capture,) + net_key
        cap = self._updates.get(key)
        if cap is None:
            cap = self._updates[key] = capture_step(update, ts, inputs, warmup=self.warmup, pool=self.cache.pool,
                                                    donate_carry=True, persistent=persistent)
        return cap.step(ts, inputs)

    def _snapshot(self, key, tree):
        """A copy of ``tree`` (static BN statistics a replayed forward is about to overwrite), in
        buffers allocated once per static tree and refreshed in place on later calls."""
        entry = self._backups.get(key)
        if entry is None or entry[0] is not tree:
            entry = self._backups[key] = (tree, T.tree_clone(tree))
        else:
            T.tree_copy_(entry[1], tree)
        return entry[1]

    def _heads_replay(self, ts: TrainState, feats: Feats, targets, dtype):
        """Each head's forward/backward replayed w.r.t. ``{"params": head params, "feats": feats}``
        (private pools: the heads' graphs interleave forward, forward, ..., backward, backward)."""
        model = self.model
        if self._dummy is None:  # capture_vjp needs an input tree; the heads read only p2["feats"]
            self._dummy = torch.zeros(1, device=feats[0].device)
        self._head_caps, self._head_backups = {}, {}
        params_h, state_h = dict(ts.params["heads"]), dict(ts.state["heads"])
        preds = {}
        for name, head in model.heads.items():
            def fn(p2, s, x, head=head):
                del x
                return head.apply(p2["params"], s, p2["feats"], train=True)

            key = ("head", name, tuple(tuple(f.shape) for f in feats), feats[0].dtype)
            hcap = self.cache.get_or_capture(key, lambda: capture_vjp(
                fn, {"params": params_h[name], "feats": feats}, state_h[name], self._dummy, warmup=self.warmup,
                autocast_dtype=dtype))
            st = hcap.static
            if not _holds(params_h[name], st.params["params"]):
                T.tree_copy_(st.params["params"], params_h[name])
                T.tree_copy_(st.state, state_h[name])
                params_h[name], state_h[name] = st.params["params"], st.state
            if self.skip_nonfinite:  # the replayed forward overwrites the static BN statistics
                self._head_backups[name] = self._snapshot(("head", name), st.state)
            preds[name], _ = hcap.forward({"params": st.params["params"], "feats": feats}, st.state, self._dummy)
            self._head_caps[name] = hcap
        ts = ts._replace(params={**ts.params, "heads": params_h}, state={**ts.state, "heads": state_h})
        pullbacks = {name: functools.partial(_param_feat_grads, hcap) for name, hcap in self._head_caps.items()}
        g_feats, head_grads, losses, parts, norms = losses_backward(model, feats, preds, pullbacks, targets)
        new_states = {name: hcap.static.state for name, hcap in self._head_caps.items()}
        return ts, (g_feats, head_grads, new_states, losses, parts, norms)

    def __repr__(self) -> str:
        return f"ReplayTrainStep(capture={self.capture!r}, cache={self.cache!r})"


def _holds(tree, static_tree) -> bool:
    """Whether ``tree``'s leaves are ``static_tree``'s own tensors (the containers may be other
    objects: a captured update returns its static carry rebuilt around the same tensors)."""
    if tree is static_tree:
        return True
    a, b = T.tree_leaves(tree), T.tree_leaves(static_tree)
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


def _param_feat_grads(hcap, g_preds):
    """A captured head's pullback in the eager form ``g_preds -> (g_params, g_feats)``."""
    g = hcap.backward(g_preds)
    return g["params"], g["feats"]

