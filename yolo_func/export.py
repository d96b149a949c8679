"""ONNX export of the pure predict function (REFERENCE.md §3.1): raw inference output, optionally
followed by non-maximum suppression inside the graph.

:func:`to_onnx` wraps ``Model.predict`` (BatchNorm in eval form, no state update) in a throwaway
``torch.nn.Module`` whose buffers are the ``params`` / ``state`` leaves, exports it with the
``torch.export``-based ONNX exporter (``torch.onnx.export(..., dynamo=True)``), optionally appends
an ONNX ``NonMaxSuppression`` block, and stores what a consumer needs as ONNX metadata
(:func:`read_metadata`): task, class names, input size, strides, output layout.

The graph (the raw variant):

======================  ====================================================================
``images``              float32[B, 3, H, W] (float16 with ``half=True``), RGB in [0, 1]
``output0``             float[B, 4 + K + E, A]: (cx, cy, w, h) input pixels, K class
                        probabilities, E extra channels (NM mask coefficients for segment,
                        P * D decoded keypoints for pose, none for detect);
                        A = H/8 * W/8 + H/16 * W/16 + H/32 * W/32
``output1``             segment only: float[B, NM, H/4, W/4] mask prototypes
======================  ====================================================================

``output0`` / ``output1`` are exactly :class:`~yolo_func.Inference`'s ``y`` / ``protos`` (the
reference's layout), so :func:`yolo_func.eval.postprocess` turns them into detections::

    y, *protos = session.run(None, {"images": images})
    dets = postprocess(Inference(torch.from_numpy(y), torch.from_numpy(protos[0]) if protos else None), ...)

With ``nms=True`` the graph ends in NMS instead (best class per anchor, class-aware, the reference's
``conf`` / ``iou`` / ``max_det`` rules, as :func:`yolo_func.eval.postprocess` with its defaults):

======================  ====================================================================
``det_batch``           int64[N]: the image of each detection (rows grouped by image)
``det_boxes``           float32[N, 4]: xyxy input pixels
``det_scores``          float32[N]: class probability, descending within an image
``det_classes``         int64[N]: class index
``det_extra``           float32[N, E]: mask coefficients or keypoints (absent for detect)
``output1``             segment only: the prototypes, as above
======================  ====================================================================

Needs ``onnx`` and ``onnxscript`` (``pip install 'yolo_func[export]'``, which also brings
``onnxruntime`` to run the file).
"""

from __future__ import annotations

import json
import logging
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from yolo_func import tree as T
from yolo_func._types import Anchors
from yolo_func.eval.nms import CLASS_OFFSET

__all__ = ["to_onnx", "add_nms", "read_metadata", "DEFAULT_OPSET", "MIN_OPSET", "FORMATS", "EXTRA"]

#: ONNX opset written by default (the exporter's native one in torch 2.13).
DEFAULT_OPSET = 20
#: The lowest opset the ``torch.export``-based exporter writes.
MIN_OPSET = 18
#: Formats ``yolo-func export --format`` knows.
FORMATS = ("onnx",)
#: The pip extra that installs the export dependencies.
EXTRA = "pip install 'yolo_func[export]'  (onnx, onnxscript, onnxruntime)"
#: Largest dynamic batch / side (in multiples of 32) the exported graph accepts.
_MAX_BATCH, _MAX_SIDE_32 = 4096, 512
_FLAT_SEP = "__"


def _require(name: str) -> Any:
    """Import an optional export dependency or raise an ImportError that names the pip extra."""
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError:
        raise ImportError(f"[yolo_func] ONNX export needs the {name!r} package, which is not installed; {EXTRA}") from None


def _image_hw(image_size: int | Sequence[int]) -> tuple[int, int]:
    hw = (image_size, image_size) if isinstance(image_size, int) else tuple(image_size)
    if len(hw) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 32 and v % 32 == 0 for v in hw):
        raise ValueError(f"[yolo_func] to_onnx: image_size must be a positive multiple of 32 or (H, W) of them "
                         f"(the network's largest stride), got {image_size!r}; e.g. 640 or (480, 640)")
    return int(hw[0]), int(hw[1])


def _anchors(feats: Sequence[torch.Tensor], strides: Sequence[int]) -> Anchors:
    """:func:`yolo_func.assign.anchors.anchors_for_feats` without turning sizes into Python ints, so
    that H and W stay symbolic in a dynamic export (same values: cell centres, level-major, y outer)."""
    points, stride_list = [], []
    for f, s in zip(feats, strides):
        h, w = f.shape[-2:]
        gy, gx = torch.meshgrid(torch.arange(h, dtype=f.dtype, device=f.device) + 0.5,
                                torch.arange(w, dtype=f.dtype, device=f.device) + 0.5, indexing="ij")
        points.append(torch.stack((gx, gy), -1).reshape(-1, 2))
        stride_list.append(torch.full_like(gx.reshape(-1, 1), float(s)))
    return Anchors(torch.cat(points), torch.cat(stride_list))


class _Predict(torch.nn.Module):
    """``Model.predict`` as a module: the tree leaves are buffers (ONNX initializers)."""

    def __init__(self, model: Any, params: dict, state: dict):
        super().__init__()
        self.model = model
        self._names = {}
        for prefix, tree in (("params", params), ("state", state)):
            for path, leaf in T.tree_flat_dict(tree).items():
                name = f"{prefix}/{path}".replace("/", _FLAT_SEP)
                self.register_buffer(name, leaf.detach().clone())
                self._names[name] = f"{prefix}/{path}"

    def forward(self, images: torch.Tensor):
        flat = {self._names[n]: b for n, b in self.named_buffers()}
        params = T.tree_from_flat_dict({k[len("params/"):]: v for k, v in flat.items() if k.startswith("params/")})
        state = T.tree_from_flat_dict({k[len("state/"):]: v for k, v in flat.items() if k.startswith("state/")})
        m = self.model
        # Model.predict, step by step, with anchors from symbolic sizes (see _anchors).
        feats, _ = m.features(params["network"], state["network"], images, train=False)
        preds = {name: head.apply(params["heads"][name], state["heads"][name], feats, train=False)[0]
                 for name, head in m.heads.items()}
        out = m.decode(preds, _anchors(feats, m.strides))
        return (out.y,) if out.protos is None else (out.y, out.protos)


def _kpt_shape(model: Any, extra: int) -> list[int]:
    """(P, D) of a pose model: its head's decode of zeros at a unit anchor at the origin gives
    x = y = -0.5 and, with D = 3, a visibility of sigmoid(0) = 0.5 in channel 2."""
    from yolo_func._types import PosePreds

    out = model.heads["pose"].decode(PosePreds(torch.zeros(1, 1, extra)), Anchors(torch.zeros(1, 2), torch.ones(1, 1)))
    D = 3 if extra % 3 == 0 and extra >= 3 and float(out[0, 2, 0]) == 0.5 else 2
    return [extra // D, D]


def add_nms(proto: Any, *, num_classes: int, conf: float = 0.25, iou: float = 0.7, max_det: int = 300) -> Any:
    """Replace ``output0`` of a raw export by an ONNX ``NonMaxSuppression`` block, in place.

    Best class per anchor, class-aware through the ``class * 7680`` offset (as
    :func:`yolo_func.eval.postprocess` with ``multi_label=False``): rows with score > ``conf``,
    suppressed when IoU > ``iou``, at most ``max_det`` per image, descending score within an image.
    Unlike :func:`~yolo_func.eval.postprocess` there is no cap of 30 000 candidates (it only matters
    above ~1200 px). Outputs are float32 whatever the raw dtype (see the module docstring for them).

    Args:
      proto: an ``onnx.ModelProto`` whose graph has the raw ``output0`` (float[B, 4 + K + E, A]),
        e.g. ``onnx.load(f)`` of a :func:`to_onnx` file without NMS.
      num_classes: K.
      conf, iou, max_det: the NMS rules.

    Returns:
      ``proto`` (checked with ``onnx.checker``).

    Raises:
      ValueError: no ``output0`` or its channel count is not static / smaller than 4 + K.

    Example:
      >>> import numpy as np, onnx, onnxruntime as ort
      >>> from onnx import TensorProto, helper
      >>> raw = helper.make_model(helper.make_graph(  # a stand-in "network": output0 = its input
      ...     [helper.make_node("Identity", ["y"], ["output0"])], "raw",
      ...     [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 6, 3])],
      ...     [helper.make_tensor_value_info("output0", TensorProto.FLOAT, [1, 6, 3])]),
      ...     opset_imports=[helper.make_opsetid("", 20)])
      >>> y = np.array([[[10, 11, 50],  # cx of 3 anchors; K = 2 classes
      ...                [10, 10, 50],  # cy
      ...                [8, 8, 8], [8, 8, 8],  # w, h: anchors 0 and 1 overlap (IoU 0.78)
      ...                [0.9, 0.8, 0.1],  # class 0 scores
      ...                [0.1, 0.1, 0.7]]], np.float32)  # class 1 scores
      >>> session = ort.InferenceSession(add_nms(raw, num_classes=2, iou=0.7).SerializeToString())
      >>> batch, boxes, scores, classes = session.run(None, {"y": y})
      >>> boxes.tolist(), [round(float(v), 2) for v in scores], classes.tolist()  # anchor 1 suppressed
      ([[6.0, 6.0, 14.0, 14.0], [46.0, 46.0, 54.0, 54.0]], [0.9, 0.7], [0, 1])
    """
    onnx = _require("onnx")
    from onnx import TensorProto, helper, numpy_helper

    import numpy as np

    g = proto.graph
    y_name = "output0"
    y_out = [o for o in g.output if o.name == y_name]
    channels = y_out[0].type.tensor_type.shape.dim[1].dim_value if y_out else 0
    if channels < 4 + num_classes:
        raise ValueError(f"[yolo_func] add_nms: the graph needs a raw output0 float[B, 4 + K + E, A] with static "
                         f"channels >= 4 + {num_classes}; got outputs {[o.name for o in g.output]} "
                         f"(output0 channels {channels or 'unknown'}); pass a to_onnx(..., nms=False) model and its num_classes")
    K, E = num_classes, channels - 4 - num_classes
    inits = {
        "nms/axis2": np.array([2], np.int64), "nms/axis1": np.array([1], np.int64),
        "nms/s0": np.array([0], np.int64), "nms/s2": np.array([2], np.int64), "nms/s4": np.array([4], np.int64),
        "nms/s4K": np.array([4 + K], np.int64),
        "nms/two": np.array(2.0, np.float32), "nms/offset": np.array(CLASS_OFFSET, np.float32),
        "nms/max_det": np.array([max_det], np.int64), "nms/iou": np.array([iou], np.float32),
        "nms/conf": np.array([conf], np.float32), "nms/i0": np.array(0, np.int64), "nms/i2": np.array(2, np.int64),
    }
    if E:
        inits["nms/end"] = np.array([np.iinfo(np.int64).max], np.int64)
    for name, value in inits.items():
        g.initializer.append(numpy_helper.from_array(value, name))
    n = helper.make_node
    nodes = [
        n("Cast", [y_name], ["nms/y32"], to=TensorProto.FLOAT),
        n("Transpose", ["nms/y32"], ["nms/yT"], perm=[0, 2, 1]),  # [B, A, C]
        n("Slice", ["nms/yT", "nms/s0", "nms/s4", "nms/axis2"], ["nms/xywh"]),
        n("Slice", ["nms/yT", "nms/s4", "nms/s4K", "nms/axis2"], ["nms/cls"]),
        n("ReduceMax", ["nms/cls", "nms/axis2"], ["nms/score"], keepdims=0),  # [B, A]
        n("ArgMax", ["nms/cls"], ["nms/label"], axis=2, keepdims=0),  # int64 [B, A]
        n("Slice", ["nms/xywh", "nms/s0", "nms/s2", "nms/axis2"], ["nms/xy"]),
        n("Slice", ["nms/xywh", "nms/s2", "nms/s4", "nms/axis2"], ["nms/wh"]),
        n("Div", ["nms/wh", "nms/two"], ["nms/half_wh"]),
        n("Sub", ["nms/xy", "nms/half_wh"], ["nms/x1y1"]),
        n("Add", ["nms/xy", "nms/half_wh"], ["nms/x2y2"]),
        n("Concat", ["nms/x1y1", "nms/x2y2"], ["nms/xyxy"], axis=2),
        # Class-aware NMS with one class: every box shifted by class * 7680 (as eval.nms does).
        n("Cast", ["nms/label"], ["nms/label_f"], to=TensorProto.FLOAT),
        n("Mul", ["nms/label_f", "nms/offset"], ["nms/off"]),
        n("Unsqueeze", ["nms/off", "nms/axis2"], ["nms/off3"]),
        n("Add", ["nms/xyxy", "nms/off3"], ["nms/xyxy_off"]),
        n("Unsqueeze", ["nms/score", "nms/axis1"], ["nms/score3"]),  # [B, 1, A]
        n("NonMaxSuppression", ["nms/xyxy_off", "nms/score3", "nms/max_det", "nms/iou", "nms/conf"], ["nms/selected"],
          center_point_box=0),  # [N, 3] (image, 0, anchor)
        n("Gather", ["nms/selected", "nms/i0"], ["det_batch"], axis=1),
        n("Gather", ["nms/selected", "nms/i2"], ["nms/anchor"], axis=1),
        n("Unsqueeze", ["det_batch", "nms/axis1"], ["nms/b1"]),
        n("Unsqueeze", ["nms/anchor", "nms/axis1"], ["nms/a1"]),
        n("Concat", ["nms/b1", "nms/a1"], ["nms/ba"], axis=1),  # [N, 2]
        n("GatherND", ["nms/xyxy", "nms/ba"], ["det_boxes"]),
        n("GatherND", ["nms/score", "nms/ba"], ["det_scores"]),
        n("GatherND", ["nms/label", "nms/ba"], ["det_classes"]),
    ]
    outputs = [
        helper.make_tensor_value_info("det_batch", TensorProto.INT64, ["num_det"]),
        helper.make_tensor_value_info("det_boxes", TensorProto.FLOAT, ["num_det", 4]),
        helper.make_tensor_value_info("det_scores", TensorProto.FLOAT, ["num_det"]),
        helper.make_tensor_value_info("det_classes", TensorProto.INT64, ["num_det"]),
    ]
    if E:
        nodes += [n("Slice", ["nms/yT", "nms/s4K", "nms/end", "nms/axis2"], ["nms/extra"]),
                  n("GatherND", ["nms/extra", "nms/ba"], ["det_extra"])]
        outputs.append(helper.make_tensor_value_info("det_extra", TensorProto.FLOAT, ["num_det", E]))
    g.node.extend(nodes)
    kept = [o for o in g.output if o.name != y_name]
    del g.output[:]
    g.output.extend(outputs + kept)
    onnx.checker.check_model(proto)
    return proto


def _set_metadata(proto: Any, meta: dict[str, Any]) -> None:
    del proto.metadata_props[:]
    for key, value in meta.items():
        entry = proto.metadata_props.add()
        entry.key, entry.value = key, value if isinstance(value, str) else json.dumps(value)


def read_metadata(path: str | Path) -> dict[str, Any]:
    """The metadata :func:`to_onnx` stored in an ONNX file, JSON values decoded.

    Args:
      path: an ``.onnx`` file written by :func:`to_onnx`.

    Returns:
      ``{"producer": "yolo_func", "task", "scale", "names": [str] * K, "num_classes", "imgsz": [H, W],
      "stride": 32, "strides": [8, 16, 32], "batch": int or "dynamic", "dynamic", "half", "nms",
      "outputs": [names], "layout": str, ...}`` plus ``kpt_shape`` (pose), ``num_masks`` (segment)
      and ``conf`` / ``iou`` / ``max_det`` (with NMS).

    Raises:
      ValueError: the file cannot be read as ONNX.

    Example:
      >>> import os, tempfile, onnx
      >>> from onnx import TensorProto, helper
      >>> graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g",
      ...                           [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
      ...                           [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
      >>> proto = helper.make_model(graph)
      >>> helper.set_model_props(proto, {"task": "detect", "names": '["person", "car"]', "imgsz": "[640, 640]"})
      >>> f = os.path.join(tempfile.mkdtemp(), "m.onnx"); onnx.save(proto, f)
      >>> read_metadata(f)
      {'task': 'detect', 'names': ['person', 'car'], 'imgsz': [640, 640]}
    """
    onnx = _require("onnx")
    try:
        proto = onnx.load(str(path), load_external_data=False)
    except Exception as e:  # noqa: BLE001 - protobuf/IO errors of every kind
        raise ValueError(f"[yolo_func] read_metadata: cannot read {str(path)!r} as ONNX ({type(e).__name__}: {e})") from None
    out: dict[str, Any] = {}
    for entry in proto.metadata_props:
        try:
            out[entry.key] = json.loads(entry.value)
        except ValueError:
            out[entry.key] = entry.value
    return out


def to_onnx(
    model: Any,
    params: dict,
    state: dict,
    path: str | Path,
    *,
    image_size: int | Sequence[int] = 640,
    batch: int = 1,
    dynamic: bool = False,
    half: bool = False,
    nms: bool = False,
    conf: float = 0.25,
    iou: float = 0.7,
    max_det: int = 300,
    opset: int = DEFAULT_OPSET,
    names: Sequence[str] | None = None,
) -> Path:
    """Export ``model.predict`` (eval-mode forward and decode) to an ONNX file.

    Args:
      model: a :class:`yolo_func.Model` (custom heads work when their apply/decode trace).
      params, state: the model's trees (any device and float dtype; copied to the CPU).
      path: the ``.onnx`` file to write (parent folders created; one self-contained file).
      image_size: input side, or (H, W); multiples of 32. With ``dynamic`` only the example size.
      batch: B of the input (ignored with ``dynamic``).
      dynamic: batch, height and width become dynamic axes (H and W multiples of 32 up to 16384;
        B up to 4096).
      half: float16 weights, input and raw outputs (for GPU runtimes, e.g. onnxruntime's CUDA
        provider or TensorRT; CPU runtimes often lack float16 convolutions). NMS outputs stay float32.
      nms: end the graph in NMS (outputs ``det_batch``, ``det_boxes``, ``det_scores``,
        ``det_classes``, ``det_extra``; see the module docstring) instead of ``output0``.
      conf, iou, max_det: the NMS rules (score > conf; suppress IoU > iou; at most max_det per image).
      opset: ONNX opset, >= 18.
      names: K class names for the metadata; default ``"0" .. "K-1"``.

    Returns:
      ``path`` as a :class:`~pathlib.Path`.

    Raises:
      ImportError: ``onnx`` / ``onnxscript`` missing (names ``pip install 'yolo_func[export]'``).
      ValueError: bad sizes, thresholds or names, trees that do not fit ``model``.
      TypeError: ``model`` is not a yolo_func Model.

    Example:
      >>> import torch, onnxruntime as ort, tempfile, os
      >>> from yolo_func import yolov8
      >>> model = yolov8("n", num_classes=2)
      >>> params, state = model.init(torch.Generator().manual_seed(0))
      >>> f = to_onnx(model, params, state, os.path.join(tempfile.mkdtemp(), "m.onnx"), image_size=64)
      >>> y, = ort.InferenceSession(str(f)).run(None, {"images": torch.rand(1, 3, 64, 64).numpy()})
      >>> y.shape  # [B, 4 + K, A], A = 8*8 + 4*4 + 2*2
      (1, 6, 84)
    """
    from yolo_func.models import Model

    if not isinstance(model, Model):
        raise TypeError(f"[yolo_func] to_onnx: model must be a yolo_func Model (yolov8(...)), got {type(model).__name__}")
    H, W = _image_hw(image_size)
    if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
        raise ValueError(f"[yolo_func] to_onnx: batch must be an int >= 1, got {batch!r}")
    if not isinstance(opset, int) or opset < MIN_OPSET:
        raise ValueError(f"[yolo_func] to_onnx: opset must be an int >= {MIN_OPSET} (the torch.export-based "
                         f"exporter's lowest), got {opset!r}")
    if nms:
        if not 0.0 <= conf < 1.0 or not 0.0 <= iou <= 1.0:
            raise ValueError(f"[yolo_func] to_onnx: need 0 <= conf < 1 and 0 <= iou <= 1, got conf={conf}, iou={iou}")
        if not isinstance(max_det, int) or max_det < 1:
            raise ValueError(f"[yolo_func] to_onnx: max_det must be an int >= 1, got {max_det!r}")
    K = model.num_classes
    names = [str(i) for i in range(K)] if names is None else [str(n) for n in names]
    if len(names) != K:
        raise ValueError(f"[yolo_func] to_onnx: names has {len(names)} entries, the model has {K} classes")
    path = Path(path)
    if path.suffix.lower() != ".onnx":
        raise ValueError(f"[yolo_func] to_onnx: path must end in .onnx, got {str(path)!r}")
    onnx = _require("onnx")
    _require("onnxscript")  # the torch.export-based exporter translates through it
    if tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) < (2, 6):
        raise ImportError(f"[yolo_func] ONNX export needs torch >= 2.6 (torch.onnx.export(..., dynamo=True) returning "
                          f"the program), found {torch.__version__}; pip install -U torch")
    model.check_trees(params, state)

    dtype = torch.float16 if half else torch.float32
    cast = lambda t: t.detach().to("cpu", dtype if t.is_floating_point() else t.dtype)  # noqa: E731
    module = _Predict(model, T.tree_map(cast, params), T.tree_map(cast, state)).eval()
    # A dynamic dim needs an example size other than 1 (torch.export specialises 0/1) and H != W
    # (equal sizes would be assumed equal).
    example_b, example_w = (max(batch, 2), W + 32 if W == H else W) if dynamic else (batch, W)
    images = torch.zeros(example_b, model.in_channels, H, example_w, dtype=dtype)
    kwargs: dict[str, Any] = {}
    if dynamic:
        Dim = torch.export.Dim
        kwargs["dynamic_shapes"] = {"images": {
            0: Dim("batch", min=1, max=_MAX_BATCH),
            2: 32 * Dim("height_32", min=1, max=_MAX_SIDE_32),
            3: 32 * Dim("width_32", min=1, max=_MAX_SIDE_32),
        }}
    output_names = ["output0"] + (["output1"] if model.task == "segment" else [])
    registry_log = logging.getLogger("torch.onnx._internal.exporter._registration")
    level = registry_log.level
    registry_log.setLevel(logging.ERROR)  # "torchvision is not installed. Skipping torchvision::nms": not used here
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # exporter chatter (deprecations in its dependencies)
        try:
            program = torch.onnx.export(module, (images,), None, input_names=["images"], output_names=output_names,
                                        opset_version=opset, dynamo=True, external_data=False, verbose=False,
                                        optimize=True, **kwargs)
        finally:
            registry_log.setLevel(level)
    proto = program.model_proto
    E = proto.graph.output[0].type.tensor_type.shape.dim[1].dim_value - 4 - K  # static even when dynamic
    if nms:
        proto = add_nms(proto, num_classes=K, conf=float(conf), iou=float(iou), max_det=int(max_det))
    meta: dict[str, Any] = {
        "producer": "yolo_func", "task": model.task, "scale": model.scale, "names": names, "num_classes": K,
        "imgsz": [H, W], "stride": max(model.strides), "strides": list(model.strides),
        "batch": "dynamic" if dynamic else batch, "dynamic": bool(dynamic), "half": bool(half), "nms": bool(nms),
        "input": "images: float[B, 3, H, W] RGB in [0, 1]" + (" (float16)" if half else ""),
        "outputs": [o.name for o in proto.graph.output],
        "layout": ("det_batch int64[N], det_boxes float32[N, 4] xyxy, det_scores float32[N], det_classes int64[N]"
                   + (f", det_extra float32[N, {E}]" if E else "") if nms else
                   f"output0 float[B, 4 + {K} + {E}, A]: cx, cy, w, h (input pixels), {K} class probabilities, "
                   f"{E} extra") + (", output1 float[B, NM, H/4, W/4] mask prototypes" if model.task == "segment" else ""),
    }
    if model.task == "pose":
        meta["kpt_shape"] = _kpt_shape(model, E)
    if model.task == "segment":
        meta["num_masks"] = E
    if nms:
        meta.update(conf=float(conf), iou=float(iou), max_det=int(max_det))
    from yolo_func import __version__

    meta["yolo_func_version"] = __version__
    _set_metadata(proto, meta)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save_model(proto, str(path))
    return path
