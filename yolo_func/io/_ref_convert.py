"""Our ``(params, state)`` trees <-> a reference state dict: export, import with shape and dtype
checks, and the mismatch report with its hints. Internal: import the public names from
:mod:`yolo_func.io.ultralytics`.

The names come from :mod:`yolo_func.io._ref_keys`; the hints ask :mod:`yolo_func.io._ref_infer`
which model the state dict holds, so a hint is given only when it is true (another scale or task,
another class count, other keypoint or mask channels).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import torch

from yolo_func import tree as T
from yolo_func.io._ref_infer import classes_phrase, infer_reference_spec, scale_from_state_dict, task_from_state_dict
from yolo_func.io._ref_keys import _NBT, HEAD_LAYER, reference_layout

__all__ = ["LoadReport", "Loaded", "to_reference", "from_reference", "REPORT_LIMIT"]

#: How many problems a strict :func:`from_reference` error lists (then "... and N more").
REPORT_LIMIT = 20

_SUFFIX = {"detect": "", "segment": "-seg", "pose": "-pose"}


def _model_name(model) -> str:
    return f"yolov8{model.scale}{_SUFFIX.get(model.task, '')} ({model.task}, scale {model.scale}, {classes_phrase(model.num_classes)})"


# ---------------------------------------------------------------------------------------------
# Export
# ---------------------------------------------------------------------------------------------


def to_reference(model, params: Mapping, state: Mapping) -> dict[str, torch.Tensor]:
    """Our trees as a reference state dict (loadable with ``load_state_dict`` into the reference's
    ``DetectionModel`` / ``SegmentationModel`` / ``PoseModel`` built from the matching yaml).

    Args:
      model: the :class:`yolo_func.models.Model` the trees belong to.
      params: whole-model params ``{"network": ..., "heads": ...}``, float tensors.
      state: whole-model state (BN running statistics).

    Returns:
      ``{key: tensor}`` as a plain dict in the reference's key order. Parameter and statistic
      values are the very tensors of ``params``/``state`` (no copy, like ``nn.Module.state_dict()``:
      clone before mutating them). Added: ``*.bn.num_batches_tracked = int64[] 0`` and
      ``model.22.dfl.conv.weight = float32[1, 16, 1, 1] (0..15)``, on the device of the stem weight.

    Raises:
      ValueError: the trees do not fit ``model`` (missing, unexpected and mis-shaped paths listed).

    Example:
      >>> import torch
      >>> from yolo_func import yolov8
      >>> from yolo_func import io
      >>> model = yolov8("n", task="detect", num_classes=5)
      >>> params, state = model.init(torch.Generator().manual_seed(0))
      >>> sd = io.to_reference(model, params, state)            # {reference key: tensor}
      >>> next(iter(sd)), tuple(sd["model.0.conv.weight"].shape)
      ('model.0.conv.weight', (16, 3, 3, 3))
    """
    model.check_trees(params, state)
    flat = {"params": T.tree_flat_dict(params), "state": T.tree_flat_dict(state)}
    device = flat["params"]["network/backbone/stem/conv/weight"].device
    out: dict[str, torch.Tensor] = {}
    for e in reference_layout(model):
        if e.kind == _NBT:
            out[e.key] = torch.zeros((), dtype=torch.int64, device=device)
        elif e.kind == "dfl":
            out[e.key] = torch.arange(model.reg_max, dtype=torch.float32, device=device).reshape(e.shape)
        else:
            out[e.key] = flat[e.kind][e.path]
    return out


# ---------------------------------------------------------------------------------------------
# Import
# ---------------------------------------------------------------------------------------------


class LoadReport(NamedTuple):
    """What did not fit when loading a reference state dict.

    Attributes:
      missing: keys the model needs that the state dict lacks.
      unexpected: keys of the state dict the model does not have.
      mismatched: ``(key, expected shape, given shape)`` for entries with the wrong shape.
      invalid: ``(key, reason)``: not a tensor, a non-floating dtype, or a DFL projection that is
        not ``0..15``.

    Example:
      >>> import torch
      >>> from yolo_func import yolov8
      >>> from yolo_func import io
      >>> model = yolov8("n", task="detect", num_classes=5)
      >>> params, state = model.init(torch.Generator().manual_seed(0))
      >>> sd = io.to_reference(model, params, state)
      >>> sd["model.22.cv3.0.2.weight"] = torch.zeros(80, 64, 1, 1)       # an 80-class head in a 5-class model
      >>> report = io.from_reference(model, sd, strict=False).report
      >>> report.mismatched
      (('model.22.cv3.0.2.weight', (5, 64, 1, 1), (80, 64, 1, 1)),)
    """

    missing: tuple[str, ...] = ()
    unexpected: tuple[str, ...] = ()
    mismatched: tuple[tuple[str, tuple[int, ...], tuple[int, ...]], ...] = ()
    invalid: tuple[tuple[str, str], ...] = ()

    @property
    def ok(self) -> bool:
        """True when everything fitted."""
        return not (self.missing or self.unexpected or self.mismatched or self.invalid)

    def summary(self) -> str:
        """One line of counts, e.g. ``"125 missing, 187 unexpected, 15 mis-shaped"`` (``", 1 invalid"``
        is added only when there are invalid entries)."""
        out = f"{len(self.missing)} missing, {len(self.unexpected)} unexpected, {len(self.mismatched)} mis-shaped"
        return out + (f", {len(self.invalid)} invalid" if self.invalid else "")

    def format(self, limit: int | None = None) -> str:
        """One line per problem: `` - `` missing, `` + `` unexpected, `` ~ `` mis-shaped, `` ! `` invalid.

        Args:
          limit: list at most this many lines, shared round-robin between the four kinds (so each
            kind present shows at least one line when ``limit >= 4``), then `` ... and N more``.
            ``None`` lists everything.
        """
        kinds = [
            [f" - {k} (missing)" for k in self.missing],
            [f" + {k} (unexpected)" for k in self.unexpected],
            [f" ~ {k}: expected {list(a)}, got {list(b)}" for k, a, b in self.mismatched],
            [f" ! {k}: {why}" for k, why in self.invalid],
        ]
        total = sum(map(len, kinds))
        if limit is None or total <= limit:
            return "\n".join(line for lines in kinds for line in lines)
        if limit < 0:
            raise ValueError(f"[yolo_func] LoadReport.format: limit must be >= 0 or None, got {limit}")
        quota, left = [0] * len(kinds), limit
        while left:
            for i, lines in enumerate(kinds):
                if left and quota[i] < len(lines):
                    quota[i] += 1
                    left -= 1
        shown = [line for lines, q in zip(kinds, quota) for line in lines[:q]]
        return "\n".join([*shown, f" ... and {total - limit} more"])


class Loaded(NamedTuple):
    """Result of a non-strict :func:`from_reference`: ``params, state, report = ...``.

    Example:
      >>> import torch
      >>> from yolo_func import yolov8
      >>> from yolo_func import io
      >>> model = yolov8("n", task="detect", num_classes=5)
      >>> params, state = model.init(torch.Generator().manual_seed(0))
      >>> sd = io.to_reference(model, params, state)
      >>> loaded = io.from_reference(model, sd, strict=False)
      >>> loaded._fields, loaded.report.missing, loaded.report.mismatched    # everything fitted
      (('params', 'state', 'report'), (), ())
    """

    params: dict
    state: dict
    report: LoadReport


def _hints(model, state_dict: Mapping, source: str, builder: str, kpt_shape: tuple[int, int] | None) -> list[str]:
    """Hints that are true of ``state_dict`` versus ``model`` (empty when none applies)."""
    hints: list[str] = []
    try:
        spec = infer_reference_spec(state_dict, kpt_shape=kpt_shape)
    except (TypeError, ValueError):
        spec = None
    if spec is not None:
        if (spec.scale, spec.task) != (model.scale, model.task):
            hints.append(f"{source} holds {spec.describe()}; build the model with {spec.call()} (or {builder}).")
        elif spec.num_classes != model.num_classes:
            hints.append(
                f"the class branch predicts {classes_phrase(spec.num_classes)}, the model {model.num_classes}: build the model "
                f"with {spec.call()}, or pass strict=False, base=model.init(gen) to keep the rest and train a new "
                f"{model.num_classes}-class branch."
            )
        elif not spec.matches(model):
            hints.append(f"{source} holds {spec.describe()}; build the model with {spec.call()} (or {builder}).")
    else:
        # A partial or foreign state dict: say only what its keys and shapes show.
        try:
            scale = scale_from_state_dict(state_dict)
        except ValueError:
            scale = None
        task = task_from_state_dict(state_dict)
        if scale is not None and (scale, task) != (model.scale, model.task):
            hints.append(
                f"{source} looks like yolov8{scale}{_SUFFIX[task]} ({task}, scale {scale}; from its stem width and head "
                f"keys); build the model with yolov8({scale!r}, task={task!r})."
            )
        elif task != model.task:
            hints.append(f"{source} has the head branches of a {task} model: build the model with task={task!r}.")
        cls = getattr(state_dict.get(f"model.{HEAD_LAYER}.cv3.0.2.weight"), "shape", ())
        if len(cls) == 4 and cls[0] != model.num_classes:
            hints.append(
                f"the class branch predicts {classes_phrase(cls[0])}, the model {model.num_classes}: pass num_classes={cls[0]}."
            )
        keys = [str(k) for k in state_dict]
        if keys and not any(k.startswith("model.") for k in keys):
            hints.append(
                f"no key starts with 'model.' (e.g. {keys[0]!r}): strip the wrapper's prefix first "
                f"(e.g. 'module.' from DataParallel)."
            )
    return [f"hint: {h}" for h in hints]


def from_reference(
    model,
    state_dict: Mapping[str, torch.Tensor],
    *,
    strict: bool = True,
    base: tuple[Mapping, Mapping] | None = None,
    copy: bool = True,
) -> tuple[dict, dict] | Loaded:
    """Our ``(params, state)`` trees from a reference state dict.

    Floating-point entries are cast to float32 (official checkpoints are fp16); devices are kept.
    ``*.bn.num_batches_tracked`` entries are accepted and ignored (YOLOv8's BN momentum is fixed, so
    the counter never changes the numerics); ``model.22.dfl.conv.weight`` must be ``0..15``.

    Args:
      model: the :class:`yolo_func.models.Model` to load into (scale, task and classes must fit;
        :func:`yolo_func.io.ultralytics.infer_reference_model` builds the one that does).
      state_dict: ``{reference key: tensor}``, e.g. ``ref.state_dict()`` or
        :func:`yolo_func.io.ultralytics.load_reference_checkpoint`'s result.
      strict: raise on any problem (default). With ``strict=False`` a :class:`Loaded` is returned
        instead, whose ``report`` lists the problems.
      base: only for ``strict=False``: ``(params, state)`` whose values fill the entries that are
        missing, mis-shaped or invalid (e.g. a fresh init, to fine-tune with another number of
        classes). Without it those leaves are left out of the returned trees.
      copy: copy the tensors (default; the copies are contiguous). ``copy=False`` lets float32
        entries alias the given tensors.

    Returns:
      strict: ``(params, state)``, float32 plain dicts in init order. Non-strict: ``Loaded(params,
      state, report)``.

    Raises:
      ValueError: (strict) one message: the counts (``N missing, M unexpected, K mis-shaped``),
        then the hints that are true (the model the state dict holds, the class count), then at most
        :data:`REPORT_LIMIT` of the missing (`` - ``), unexpected (`` + ``), mis-shaped (`` ~ ``)
        and invalid (`` ! ``) keys, then `` ... and N more``.
      TypeError: ``state_dict`` is not a mapping.

    Example:
      >>> import torch
      >>> from yolo_func import yolov8
      >>> from yolo_func import io
      >>> model = yolov8("n", task="detect", num_classes=5)
      >>> params, state = model.init(torch.Generator().manual_seed(0))
      >>> from yolo_func.testing import assert_trees_all_equal
      >>> p2, s2 = io.from_reference(model, io.to_reference(model, params, state))   # the round trip
      >>> assert_trees_all_equal(p2, params); assert_trees_all_equal(s2, state)
      >>> sd = io.to_reference(model, params, state); del sd["model.0.conv.weight"]
      >>> p3, s3, report = io.from_reference(model, sd, strict=False)     # a Loaded record
      >>> report.missing
      ('model.0.conv.weight',)
    """
    return _from_reference(model, state_dict, strict=strict, base=base, copy=copy)


def _from_reference(
    model,
    state_dict: Mapping[str, torch.Tensor],
    *,
    strict: bool,
    base: tuple[Mapping, Mapping] | None,
    copy: bool,
    source: str = "the state dict",
    builder: str = "infer_reference_model(state_dict)",
    kpt_shape: tuple[int, int] | None = None,
) -> tuple[dict, dict] | Loaded:
    # ``source`` / ``builder`` name what is loaded in the error (a file path when read from one);
    # ``kpt_shape`` is the file's stored one (checked to fit the tensors), for a true hint.
    if not isinstance(state_dict, Mapping):
        raise TypeError(
            f"[yolo_func] from_reference: state_dict must be a mapping of str -> Tensor, got {type(state_dict).__name__}"
        )
    layout = reference_layout(model)
    expected = {e.key: e for e in layout}
    missing = tuple(k for k in expected if k not in state_dict)
    unexpected = tuple(k for k in state_dict if k not in expected)
    mismatched, invalid = [], []
    good: dict[str, dict[str, torch.Tensor]] = {"params": {}, "state": {}}
    for e in layout:
        if e.key not in state_dict:
            continue
        t = state_dict[e.key]
        if not isinstance(t, torch.Tensor):
            invalid.append((e.key, f"expected a tensor, got {type(t).__name__}"))
            continue
        if tuple(t.shape) != e.shape:
            mismatched.append((e.key, e.shape, tuple(t.shape)))
            continue
        if e.kind == _NBT:
            continue  # accepted and ignored (see the module docstring of _ref_keys)
        if not t.is_floating_point():
            invalid.append((e.key, f"expected a floating-point tensor, got dtype {t.dtype}"))
            continue
        if e.kind == "dfl":
            want = torch.arange(model.reg_max, dtype=torch.float32, device=t.device).reshape(e.shape)
            if t.device.type != "meta" and not torch.equal(t.detach().float(), want):
                got = [round(float(v), 4) for v in t.detach().float().flatten()[:6]]
                invalid.append((e.key, f"expected the frozen DFL projection 0..{model.reg_max - 1}, got {got}..."))
            continue
        v = t.detach() if t.requires_grad else t
        if copy:
            good[e.kind][e.path] = v.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
        else:
            good[e.kind][e.path] = v.to(torch.float32)
    report = LoadReport(missing, unexpected, tuple(mismatched), tuple(invalid))
    if strict and not report.ok:
        head = (
            f"[yolo_func] {source} does not fit {_model_name(model)}: {report.summary()} "
            f"(expected {len(layout)} keys, got {len(state_dict)})"
        )
        n = len(missing) + len(unexpected) + len(mismatched) + len(invalid)
        listing = (
            f"{'the' if n <= REPORT_LIMIT else f'{REPORT_LIMIT} of the'} {n} problem(s) "
            f"(strict=False returns them all in its .report and loads what fits, with base= filling the rest):"
        )
        raise ValueError("\n".join([head, *_hints(model, state_dict, source, builder, kpt_shape), listing, report.format(REPORT_LIMIT)]))
    base_flat = {"params": {}, "state": {}}
    if base is not None:
        base_flat = {"params": T.tree_flat_dict(base[0]), "state": T.tree_flat_dict(base[1])}
    trees = {}
    for kind in ("params", "state"):
        flat = {}
        for e in layout:
            if e.kind != kind:
                continue
            if e.path in good[kind]:
                flat[e.path] = good[kind][e.path]
            elif e.path in base_flat[kind]:
                flat[e.path] = base_flat[kind][e.path]
        trees[kind] = T.tree_from_flat_dict(flat)
    if strict:
        return trees["params"], trees["state"]
    return Loaded(trees["params"], trees["state"], report)
