"""The reference (Ultralytics YOLOv8) state-dict names <-> our ``/``-paths, and the reference layout
of one model (REFERENCE.md §1.4, §1.6-1.10). Internal: import the public names from
:mod:`yolo_func.io.ultralytics`.

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
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

__all__ = ["HEAD_LAYER", "NETWORK_LAYERS", "RefEntry", "our_path", "reference_key", "reference_layout"]

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

    Example:
      >>> import torch
      >>> from yolo_func import yolov8
      >>> from yolo_func import io
      >>> model = yolov8("n", task="detect", num_classes=5)
      >>> params, state = model.init(torch.Generator().manual_seed(0))
      >>> e = io.reference_layout(model)[0]                      # a RefEntry
      >>> e.key, e.shape, e.kind, e.path
      ('model.0.conv.weight', (16, 3, 3, 3), 'params', 'network/backbone/stem/conv/weight')
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

    Example:
      >>> import torch
      >>> from yolo_func import yolov8
      >>> from yolo_func import io
      >>> model = yolov8("n", task="detect", num_classes=5)
      >>> params, state = model.init(torch.Generator().manual_seed(0))
      >>> layout = io.reference_layout(model)
      >>> len(layout), sorted({e.kind for e in layout})
      (355, ['dfl', 'num_batches_tracked', 'params', 'state'])
    """
    params, state = model.abstract_init()
    return _layout_from_trees(params, state, model.reg_max)

