"""Reference (Ultralytics YOLOv8) state-dict layout <-> our params/state trees, and a safe reader
for official-style ``.pt`` checkpoints (REFERENCE.md §1.4, §1.6-1.10).

This is the only module that knows the reference's positional names. The mapping is one table:

================================  =====================================================
reference key prefix              our path prefix (params and state trees)
================================  =====================================================
``model.0``                       ``network/backbone/stem``
``model.1`` / ``model.2``         ``network/backbone/stage1/conv`` / ``.../stage1/c2f``
``model.3`` / ``model.4``         ``network/backbone/stage2/{conv,c2f}`` (P3)
``model.5`` / ``model.6``         ``network/backbone/stage3/{conv,c2f}`` (P4)
``model.7`` / ``model.8``         ``network/backbone/stage4/{conv,c2f}``
``model.9``                       ``network/backbone/sppf``
``model.12``                      ``network/neck/p4_td/c2f``
``model.15``                      ``network/neck/p3_out/c2f``
``model.16`` / ``model.18``       ``network/neck/p4_out/down`` / ``.../p4_out/c2f``
``model.19`` / ``model.21``       ``network/neck/p5_out/down`` / ``.../p5_out/c2f``
``model.22.cv2.<i>.<j>``          ``heads/detect/box/<level>/<conv1|conv2|pred>``
``model.22.cv3.<i>.<j>``          ``heads/detect/cls/<level>/<conv1|conv2|pred>``
``model.22.cv4.<i>.<j>``          ``heads/segment/coeff/...`` or ``heads/pose/kpt/...``
``model.22.proto.<cv1|cv2|cv3>``  ``heads/segment/proto/<cv1|cv2|cv3>``
``model.22.proto.upsample``       ``heads/segment/proto/upsample``
================================  =====================================================

Inside a block: C2f ``m.<j>`` <-> ``m<j>``; level index ``0/1/2`` <-> ``p3/p4/p5``; branch position
``0/1/2`` <-> ``conv1/conv2/pred``; the Conv block leaves ``conv.weight`` -> params ``conv/weight``,
``bn.weight|bias`` -> params ``bn/weight|bias``, ``bn.running_mean|running_var`` -> **state**
``bn/running_mean|running_var``.

Two reference entries have no counterpart in our trees:

- ``*.bn.num_batches_tracked`` (int64 scalar): YOLOv8 sets a fixed BN momentum, so the counter never
  affects the numerics. :func:`to_reference` emits ``0``; :func:`from_reference` accepts and ignores it
  (whatever its value).
- ``model.22.dfl.conv.weight`` float[1, 16, 1, 1]: the frozen DFL projection, the constant
  ``0..15``. We hold it as a constant, not a parameter. :func:`to_reference` emits it;
  :func:`from_reference` checks its shape and that it equals ``arange(16)`` (else it is reported).

Checkpoints: official ``.pt`` files pickle whole ``nn.Module`` objects. :func:`load_reference_checkpoint`
reads them without the reference package and without running any code from the file: a restricted
unpickler rebuilds tensors, storages and plain containers, replaces every class from ``ultralytics.*``
and ``torch.nn.*`` by an inert :class:`PickledObject` that only records its pickled state, and refuses
every other global with :class:`pickle.UnpicklingError`.
"""

from __future__ import annotations

import pickle
import re
import types
from collections.abc import Iterable, Mapping
from os import PathLike
from typing import IO, Any, NamedTuple

import torch

from yolo_func import tree as T

__all__ = [
    "HEAD_LAYER",
    "NETWORK_LAYERS",
    "RefEntry",
    "LoadReport",
    "Loaded",
    "PickledObject",
    "reference_key",
    "our_path",
    "reference_layout",
    "to_reference",
    "from_reference",
    "load_reference_checkpoint",
    "load_reference_weights",
    "restricted_pickle",
]

# ---------------------------------------------------------------------------------------------
# The name table
# ---------------------------------------------------------------------------------------------

#: Reference layer index -> (our block path under ``network/``, block kind).
NETWORK_LAYERS: dict[int, tuple[str, str]] = {
    0: ("backbone/stem", "conv"),
    1: ("backbone/stage1/conv", "conv"),
    2: ("backbone/stage1/c2f", "c2f"),
    3: ("backbone/stage2/conv", "conv"),
    4: ("backbone/stage2/c2f", "c2f"),
    5: ("backbone/stage3/conv", "conv"),
    6: ("backbone/stage3/c2f", "c2f"),
    7: ("backbone/stage4/conv", "conv"),
    8: ("backbone/stage4/c2f", "c2f"),
    9: ("backbone/sppf", "sppf"),
    12: ("neck/p4_td/c2f", "c2f"),
    15: ("neck/p3_out/c2f", "c2f"),
    16: ("neck/p4_out/down", "conv"),
    18: ("neck/p4_out/c2f", "c2f"),
    19: ("neck/p5_out/down", "conv"),
    21: ("neck/p5_out/c2f", "c2f"),
}
_NETWORK_BY_PATH = {path: (i, kind) for i, (path, kind) in NETWORK_LAYERS.items()}

#: Reference index of the head layer (Detect / Segment / Pose).
HEAD_LAYER = 22

_LEVELS = ("p3", "p4", "p5")
_BRANCH_POS = ("conv1", "conv2", "pred")
#: reference head branch -> our head-relative path (cv4 depends on the task).
_BRANCHES = {"cv2": "detect/box", "cv3": "detect/cls"}
_CV4 = {"segment": "segment/coeff", "pose": "pose/kpt"}
_DFL_KEY = f"model.{HEAD_LAYER}.dfl.conv.weight"

_BN_PARAMS = ("weight", "bias")
_BN_STATE = ("running_mean", "running_var")
_NBT = "num_batches_tracked"

# A Conv block leaf, reference side: ``conv.weight`` or ``bn.<leaf>``.
_REF_CONV = r"(?P<leaf>conv\.weight|bn\.(?:weight|bias|running_mean|running_var|num_batches_tracked))"
# ... and our side.
_OUR_CONV = r"(?P<leaf>conv/weight|bn/(?:weight|bias|running_mean|running_var))"


def _leaf_kind(leaf: str) -> str:
    return "state" if leaf.rsplit("/", 1)[-1] in _BN_STATE else "params"


def _bad_key(key: str, why: str) -> ValueError:
    return ValueError(f"[yolo_func] {key!r} is not a YOLOv8 reference state-dict key: {why}")


def our_path(key: str, *, task: str | None = None) -> tuple[str, str] | None:
    """Our ``(kind, path)`` for a reference state-dict key.

    Args:
      key: e.g. ``"model.2.m.0.cv1.bn.running_mean"``.
      task: ``"segment"`` or ``"pose"``; needed only for ``model.22.cv4.*`` (that branch belongs to
        the segment head's coefficients or to the pose head's keypoints).

    Returns:
      ``("params" | "state", path)`` such as ``("state", "network/backbone/stage1/c2f/m0/cv1/bn/running_mean")``,
      or ``None`` for the reference-only entries (``*.bn.num_batches_tracked`` and
      ``model.22.dfl.conv.weight``; see the module docstring).

    Raises:
      ValueError: the key is not part of the YOLOv8 layout (message says which part), or a ``cv4``
        key without ``task``.

    Example:
      >>> our_path("model.22.cv3.1.2.bias")
      ('params', 'heads/detect/cls/p4/pred/bias')
    """
    m = re.fullmatch(r"model\.(\d+)\.(.+)", key)
    if m is None:
        raise _bad_key(key, "expected 'model.<layer index>.<...>'")
    layer, rest = int(m.group(1)), m.group(2)
    if layer in NETWORK_LAYERS:
        block, kind = NETWORK_LAYERS[layer]
        prefix = f"network/{block}"
        if kind == "conv":
            mm = re.fullmatch(_REF_CONV, rest)
            inner = "" if mm else None
        elif kind == "sppf":
            mm = re.fullmatch(rf"(?P<sub>cv1|cv2)\.{_REF_CONV}", rest)
            inner = f"{mm.group('sub')}/" if mm else None
        else:  # c2f
            mm = re.fullmatch(rf"(?:(?P<sub>cv1|cv2)|m\.(?P<j>\d+)\.(?P<msub>cv1|cv2))\.{_REF_CONV}", rest)
            if mm is None:
                inner = None
            elif mm.group("sub"):
                inner = f"{mm.group('sub')}/"
            else:
                inner = f"m{int(mm.group('j'))}/{mm.group('msub')}/"
        if mm is None:
            raise _bad_key(key, f"layer {layer} is a {kind} block ({prefix})")
        leaf = mm.group("leaf")
    elif layer == HEAD_LAYER:
        if key == _DFL_KEY:
            return None
        mm = re.fullmatch(
            rf"(?P<br>cv2|cv3|cv4)\.(?P<lvl>[012])\.(?:(?P<pos>[01])\.{_REF_CONV}|2\.(?P<pred>weight|bias))", rest
        )
        if mm is not None:
            br = mm.group("br")
            if br == "cv4":
                if task not in _CV4:
                    raise ValueError(
                        f"[yolo_func] {key!r}: 'cv4' is the segment head's coefficients or the pose head's "
                        f"keypoints; pass task='segment' or task='pose', got task={task!r}"
                    )
                head = _CV4[task]
            else:
                head = _BRANCHES[br]
            prefix = f"heads/{head}/{_LEVELS[int(mm.group('lvl'))]}"
            if mm.group("pred"):
                return "params", f"{prefix}/pred/{mm.group('pred')}"
            inner, leaf = f"{_BRANCH_POS[int(mm.group('pos'))]}/", mm.group("leaf")
        else:
            mm = re.fullmatch(rf"proto\.(?:(?P<sub>cv1|cv2|cv3)\.{_REF_CONV}|upsample\.(?P<up>weight|bias))", rest)
            if mm is None:
                raise _bad_key(key, "layer 22 holds cv2/cv3/cv4.<0-2>.<0-2>, proto.* and dfl.conv.weight")
            if mm.group("up"):
                return "params", f"heads/segment/proto/upsample/{mm.group('up')}"
            prefix, inner, leaf = "heads/segment/proto", f"{mm.group('sub')}/", mm.group("leaf")
    else:
        raise _bad_key(key, f"layer {layer} has no parameters (known: {sorted(NETWORK_LAYERS) + [HEAD_LAYER]})")
    leaf = leaf.replace(".", "/")
    if leaf.endswith(_NBT):
        return None
    return _leaf_kind(leaf), f"{prefix}/{inner}{leaf}"


def reference_key(path: str, *, kind: str) -> str:
    """The reference state-dict key of one of our leaves.

    Args:
      path: a ``"/"``-joined leaf path of the whole-model params or state tree, e.g.
        ``"network/neck/p4_out/down/conv/weight"``.
      kind: ``"params"`` or ``"state"``: which tree ``path`` lives in (BN running statistics are
        state, everything else params).

    Returns:
      e.g. ``"model.16.conv.weight"``.

    Raises:
      ValueError: unknown path, or a ``kind`` that does not fit the leaf.

    Example:
      >>> reference_key("heads/segment/coeff/p5/conv2/bn/running_var", kind="state")
      'model.22.cv4.2.1.bn.running_var'
    """
    if kind not in ("params", "state"):
        raise ValueError(f"[yolo_func] reference_key: kind must be 'params' or 'state', got {kind!r}")
    want = _leaf_kind(path)
    if want != kind:
        raise ValueError(f"[yolo_func] reference_key: {path!r} is a {want} leaf, got kind={kind!r}")
    bad = ValueError(f"[yolo_func] reference_key: {path!r} is not a YOLOv8 {kind} path")
    if path.startswith("network/"):
        rest = path[len("network/") :]
        for block, (layer, bkind) in _NETWORK_BY_PATH.items():
            if not rest.startswith(block + "/"):
                continue
            inner = rest[len(block) + 1 :]
            if bkind == "conv":
                mm = re.fullmatch(_OUR_CONV, inner)
                sub = ""
            elif bkind == "sppf":
                mm = re.fullmatch(rf"(?P<sub>cv1|cv2)/{_OUR_CONV}", inner)
                sub = f"{mm.group('sub')}." if mm else ""
            else:
                mm = re.fullmatch(rf"(?:(?P<sub>cv1|cv2)|m(?P<j>\d+)/(?P<msub>cv1|cv2))/{_OUR_CONV}", inner)
                if mm is not None:
                    sub = f"{mm.group('sub')}." if mm.group("sub") else f"m.{int(mm.group('j'))}.{mm.group('msub')}."
            if mm is None:
                raise bad
            return f"model.{layer}.{sub}{mm.group('leaf').replace('/', '.')}"
        raise bad
    mm = re.fullmatch(
        rf"heads/(?P<head>detect/box|detect/cls|segment/coeff|pose/kpt)/(?P<lvl>p3|p4|p5)/"
        rf"(?:(?P<pos>conv1|conv2)/{_OUR_CONV}|pred/(?P<pred>weight|bias))",
        path,
    )
    if mm is not None:
        br = {"detect/box": "cv2", "detect/cls": "cv3"}.get(mm.group("head"), "cv4")
        lvl = _LEVELS.index(mm.group("lvl"))
        if mm.group("pred"):
            return f"model.{HEAD_LAYER}.{br}.{lvl}.2.{mm.group('pred')}"
        pos = _BRANCH_POS.index(mm.group("pos"))
        return f"model.{HEAD_LAYER}.{br}.{lvl}.{pos}.{mm.group('leaf').replace('/', '.')}"
    mm = re.fullmatch(rf"heads/segment/proto/(?:(?P<sub>cv1|cv2|cv3)/{_OUR_CONV}|upsample/(?P<up>weight|bias))", path)
    if mm is not None:
        if mm.group("up"):
            return f"model.{HEAD_LAYER}.proto.upsample.{mm.group('up')}"
        return f"model.{HEAD_LAYER}.proto.{mm.group('sub')}.{mm.group('leaf').replace('/', '.')}"
    raise bad


# ---------------------------------------------------------------------------------------------
# The layout of one model
# ---------------------------------------------------------------------------------------------


class RefEntry(NamedTuple):
    """One entry of a model's reference state dict.

    Attributes:
      key: reference key, e.g. ``"model.0.bn.running_mean"``.
      shape: its shape.
      kind: ``"params"``, ``"state"``, ``"num_batches_tracked"`` or ``"dfl"`` (the last two are
        reference-only).
      path: our leaf path (``None`` for the reference-only entries).
    """

    key: str
    shape: tuple[int, ...]
    kind: str
    path: str | None


def _walk(node: Mapping, prefix: str) -> Iterable[tuple[str, Any]]:
    # Insertion order == init order == the reference's registration order (REFERENCE.md §1.9).
    for k, v in node.items():
        p = f"{prefix}/{k}" if prefix else k
        if isinstance(v, Mapping):
            yield from _walk(v, p)
        else:
            yield p, v


def _layout_from_trees(params: Mapping, state: Mapping, reg_max: int) -> list[RefEntry]:
    """Reference-ordered entries from insertion-ordered ``(params, state)`` trees (as built by init)."""
    flat_state = dict(_walk(state, ""))
    entries: list[RefEntry] = []
    for path, leaf in _walk(params, ""):
        entries.append(RefEntry(reference_key(path, kind="params"), tuple(leaf.shape), "params", path))
        if path.endswith("/bn/bias"):  # a Conv block's BN: the buffers follow its parameters
            bn = path[: -len("bias")]
            for name in _BN_STATE:
                s = flat_state[bn + name]
                entries.append(RefEntry(reference_key(bn + name, kind="state"), tuple(s.shape), "state", bn + name))
            key = reference_key(bn + "weight", kind="params")[: -len("weight")] + _NBT
            entries.append(RefEntry(key, (), _NBT, None))
        if path == "heads/detect/cls/p5/pred/bias":  # the DFL conv is registered after cv2 and cv3
            entries.append(RefEntry(_DFL_KEY, (1, reg_max, 1, 1), "dfl", None))
    return entries


def reference_layout(model) -> list[RefEntry]:
    """The reference state-dict layout of ``model`` (keys in the reference's order, with shapes).

    Args:
      model: a :class:`yolo_func.models.Model` built by ``yolov8(scale, task=...)``.

    Returns:
      list of :class:`RefEntry`; for yolov8n 355 entries, yolov8n-seg 417, yolov8n-pose 397.
    """
    params, state = model.abstract_init()
    return _layout_from_trees(params, state, model.reg_max)


def _model_name(model) -> str:
    return f"yolov8{model.scale} ({model.task}, {model.num_classes} classes)"


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
    """

    missing: tuple[str, ...] = ()
    unexpected: tuple[str, ...] = ()
    mismatched: tuple[tuple[str, tuple[int, ...], tuple[int, ...]], ...] = ()
    invalid: tuple[tuple[str, str], ...] = ()

    @property
    def ok(self) -> bool:
        """True when everything fitted."""
        return not (self.missing or self.unexpected or self.mismatched or self.invalid)

    def format(self) -> str:
        """One line per problem: `` - `` missing, `` + `` unexpected, `` ~ `` mis-shaped, `` ! `` invalid."""
        lines = [f" - {k} (missing)" for k in self.missing]
        lines += [f" + {k} (unexpected)" for k in self.unexpected]
        lines += [f" ~ {k}: expected {list(a)}, got {list(b)}" for k, a, b in self.mismatched]
        lines += [f" ! {k}: {why}" for k, why in self.invalid]
        return "\n".join(lines)


class Loaded(NamedTuple):
    """Result of a non-strict :func:`from_reference`: ``params, state, report = ...``."""

    params: dict
    state: dict
    report: LoadReport


def _hints(model, report: LoadReport) -> list[str]:
    hints = []
    shapes = {k: b for k, _, b in report.mismatched}
    stem = shapes.get("model.0.conv.weight")
    if stem is not None and len(stem) == 4:
        from yolo_func.models.scales import SCALES, channels

        guess = [s for s, sc in SCALES.items() if channels(64, sc) == stem[0]]
        hints.append(
            f"model.0.conv.weight has {stem[0]} output channels: a state dict of scale {guess or '?'}, "
            f"not {model.scale}? Build the model with yolov8({(guess or ['?'])[0]!r}, task={model.task!r})."
        )
    cls = shapes.get(f"model.{HEAD_LAYER}.cv3.0.2.weight")
    if cls is not None and len(cls) == 4:
        hints.append(f"the class branch predicts {cls[0]} classes, the model {model.num_classes}: pass num_classes={cls[0]}.")
    extra = " ".join(report.unexpected)
    if ".proto." in extra:
        hints.append("the state dict has a 'proto' branch: a segmentation checkpoint (task='segment')?")
    elif ".cv4." in extra:
        hints.append("the state dict has a 'cv4' branch: a segmentation or pose checkpoint?")
    if report.unexpected and not any(k.startswith("model.") for k in report.unexpected):
        first = next(iter(report.unexpected))
        hints.append(f"no key starts with 'model.' (e.g. {first!r}): strip the wrapper prefix first.")
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
      model: the :class:`yolo_func.models.Model` to load into (scale, task and classes must fit).
      state_dict: ``{reference key: tensor}``, e.g. ``ref.state_dict()`` or
        :func:`load_reference_checkpoint`'s result.
      strict: raise on any problem (default). With ``strict=False`` a :class:`Loaded` is returned
        instead, whose ``report`` lists the problems.
      base: only for ``strict=False``: ``(params, state)`` whose values fill the entries that are
        missing, mis-shaped or invalid (e.g. a fresh init, to fine-tune with another number of
        classes). Without it those leaves are left out of the returned trees.
      copy: copy the tensors (default). ``copy=False`` lets float32 entries alias the given tensors.

    Returns:
      strict: ``(params, state)``, float32 plain dicts in init order. Non-strict: ``Loaded(params,
      state, report)``.

    Raises:
      ValueError: (strict) one message naming every missing (`` - ``), unexpected (`` + ``),
        mis-shaped (`` ~ ``) and invalid (`` ! ``) key, with hints (another scale, task or class count).
      TypeError: ``state_dict`` is not a mapping.
    """
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"[yolo_func] from_reference: state_dict must be a mapping of str -> Tensor, got {type(state_dict).__name__}")
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
            continue  # accepted and ignored (see the module docstring)
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
        good[e.kind][e.path] = v.to(torch.float32, copy=copy)
    report = LoadReport(missing, unexpected, tuple(mismatched), tuple(invalid))
    if strict and not report.ok:
        head = (
            f"[yolo_func] the state dict does not fit {_model_name(model)}: {len(missing)} missing, "
            f"{len(unexpected)} unexpected, {len(mismatched)} mis-shaped, {len(invalid)} invalid "
            f"(expected {len(layout)} keys, got {len(state_dict)}); pass strict=False to load what fits"
        )
        raise ValueError("\n".join([head, report.format(), *_hints(model, report)]))
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


# ---------------------------------------------------------------------------------------------
# Reading official checkpoints safely
# ---------------------------------------------------------------------------------------------


class PickledObject:
    """Inert stand-in for a class of ``ultralytics.*`` or ``torch.nn.*`` met in a checkpoint.

    It never runs code of the class it replaces; it records what the pickle gave it.

    Attributes:
      pickled_class: ``"module.QualName"`` of the class it stands for.
      state: the state the pickle restored (``BUILD``), e.g. an ``nn.Module``'s ``__dict__``.
      args: positional arguments the pickle constructed it with.
    """

    _pickled_class = "?"
    # Defaults for objects the pickle builds with NEWOBJ (which does not call __init__).
    args: tuple = ()
    kwargs: dict | None = None
    state: Any = None

    def __init__(self, *args, **kwargs):  # REDUCE calls the class; record only
        self.__dict__.update(args=args, kwargs=kwargs)

    def __setstate__(self, state):
        self.__dict__["state"] = state

    @property
    def pickled_class(self) -> str:
        """``"module.QualName"`` of the class this stub stands for."""
        return type(self)._pickled_class

    def __repr__(self) -> str:
        return f"PickledObject({self.pickled_class})"


_STUBS: dict[tuple[str, str], type] = {}


def _stub(module: str, name: str) -> type:
    key = (module, name)
    if key not in _STUBS:
        _STUBS[key] = type(name, (PickledObject,), {"_pickled_class": f"{module}.{name}", "__module__": __name__})
    return _STUBS[key]


_STUB_PREFIXES = ("ultralytics.", "torch.nn.")
# Globals that rebuild tensors and plain containers. Calling them runs only their own code.
_ALLOWED: dict[str, frozenset[str]] = {
    "builtins": frozenset({"set", "frozenset", "complex", "slice", "bytearray"}),
    "collections": frozenset({"OrderedDict"}),
    "torch._utils": frozenset(
        {"_rebuild_tensor", "_rebuild_tensor_v2", "_rebuild_tensor_v3", "_rebuild_parameter", "_rebuild_parameter_with_state"}
    ),
    "torch": frozenset({"Size", "device"}),
    # numpy scalars and arrays sometimes appear in training metadata (e.g. fitness values).
    "numpy": frozenset({"dtype", "ndarray"}),
    "numpy.core.multiarray": frozenset({"scalar", "_reconstruct"}),
    "numpy._core.multiarray": frozenset({"scalar", "_reconstruct"}),
}


class RestrictedUnpickler(pickle.Unpickler):
    """Unpickler that rebuilds only tensors, storages and plain containers.

    Classes from ``ultralytics.*`` / ``torch.nn.*`` become :class:`PickledObject` stubs (their code is
    never imported or run); torch dtypes and the globals in an allow-list are resolved; anything else
    raises :class:`pickle.UnpicklingError` naming the global.
    """

    def find_class(self, module: str, name: str):  # noqa: D102
        import _compat_pickle

        # Protocol <= 2 pickles carry Python 2 names (e.g. '__builtin__ set'); map them like pickle does.
        if (module, name) in _compat_pickle.NAME_MAPPING:
            module, name = _compat_pickle.NAME_MAPPING[(module, name)]
        elif module in _compat_pickle.IMPORT_MAPPING:
            module = _compat_pickle.IMPORT_MAPPING[module]
        if module == "ultralytics" or module.startswith(_STUB_PREFIXES) or module == "torch.nn":
            return _stub(module, name)
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module == "torch" and name.endswith("Storage") and hasattr(torch, name):
            return getattr(torch, name)  # legacy typed-storage classes (torch's loader maps these first)
        raise pickle.UnpicklingError(
            f"[yolo_func] refusing to load global '{module}.{name}' from a checkpoint: only tensors, storages, "
            f"plain containers and (inert) ultralytics.* / torch.nn.* classes are allowed"
        )


def _restricted_load(file: IO[bytes], **kwargs) -> Any:
    return RestrictedUnpickler(file, **kwargs).load()


def _restricted_loads(data: bytes, **kwargs) -> Any:
    import io

    return RestrictedUnpickler(io.BytesIO(data), **kwargs).load()


#: A pickle-module stand-in for ``torch.load(..., pickle_module=restricted_pickle, weights_only=False)``.
restricted_pickle = types.ModuleType("yolo_func.io.restricted_pickle")
restricted_pickle.Unpickler = RestrictedUnpickler
restricted_pickle.UnpicklingError = pickle.UnpicklingError
restricted_pickle.load = _restricted_load
restricted_pickle.loads = _restricted_loads


def _module_state_dict(obj: PickledObject, prefix: str, out: dict[str, torch.Tensor], where: str) -> None:
    state = obj.state
    if isinstance(state, tuple) and len(state) == 2 and isinstance(state[0], Mapping):
        state = state[0]  # (dict state, slot state)
    if not isinstance(state, Mapping) or not all(k in state for k in ("_parameters", "_buffers", "_modules")):
        raise ValueError(
            f"[yolo_func] checkpoint entry {where!r} ({obj.pickled_class}) is not a pickled torch.nn.Module "
            f"(no _parameters/_buffers/_modules)"
        )
    skip = set(state.get("_non_persistent_buffers_set") or ())
    for name, t in state["_parameters"].items():
        if t is not None:
            out[prefix + name] = t.detach()
    for name, t in state["_buffers"].items():
        if t is not None and name not in skip:
            out[prefix + name] = t.detach()
    for name, child in state["_modules"].items():
        if child is None:
            continue
        if not isinstance(child, PickledObject):
            raise ValueError(f"[yolo_func] checkpoint entry {where + '.' + name!r} is a {type(child).__name__}, not a module")
        _module_state_dict(child, f"{prefix}{name}.", out, f"{where}.{name}")


def load_reference_checkpoint(path: str | PathLike | IO[bytes]) -> dict[str, torch.Tensor]:
    """Read the weights of an official-style reference checkpoint without the reference package.

    The file is a ``torch.save``'d dict whose ``ema`` (preferred when not None) or ``model`` entry
    is a pickled ``nn.Module`` (usually fp16). It is read with :data:`restricted_pickle`: classes of
    ``ultralytics.*`` / ``torch.nn.*`` become inert :class:`PickledObject` stubs and any other global
    is refused, so loading never runs code from the file. The module tree (``_modules``,
    ``_parameters``, ``_buffers``) is then walked like ``nn.Module.state_dict()`` does.

    Args:
      path: file path or binary file object.

    Returns:
      ``{reference key: tensor}`` in the stored dtypes (fp16 weights, int64 ``num_batches_tracked``)
      and the stored key order, on the CPU. Pass it to :func:`from_reference` (which casts to fp32).
      A checkpoint whose entry is already a state dict is returned as a plain dict.

    Raises:
      pickle.UnpicklingError: the file references a global outside the allow-list (named).
      ValueError: no usable ``ema`` / ``model`` entry.
    """
    ckpt = torch.load(path, map_location="cpu", pickle_module=restricted_pickle, weights_only=False)
    if isinstance(ckpt, PickledObject):
        root, where = ckpt, "<root>"
    elif isinstance(ckpt, Mapping):
        if ckpt.get("ema") is not None:
            root, where = ckpt["ema"], "ema"
        elif ckpt.get("model") is not None:
            root, where = ckpt["model"], "model"
        else:
            raise ValueError(f"[yolo_func] checkpoint has neither an 'ema' nor a 'model' entry; keys {sorted(map(str, ckpt))}")
    else:
        raise ValueError(f"[yolo_func] checkpoint must hold a dict with 'ema'/'model', got {type(ckpt).__name__}")
    if isinstance(root, Mapping) and all(isinstance(v, torch.Tensor) for v in root.values()):
        return {str(k): v.detach() for k, v in root.items()}
    if not isinstance(root, PickledObject):
        raise ValueError(f"[yolo_func] checkpoint entry {where!r} is a {type(root).__name__}, not a pickled module")
    out: dict[str, torch.Tensor] = {}
    _module_state_dict(root, "", out, where)
    return out


def load_reference_weights(model, path: str | PathLike | IO[bytes], **kwargs) -> tuple[dict, dict] | Loaded:
    """``from_reference(model, load_reference_checkpoint(path), **kwargs)``: float32 ``(params, state)``."""
    return from_reference(model, load_reference_checkpoint(path), **kwargs)
