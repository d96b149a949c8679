"""ONNX export: onnxruntime runs the file and gets ``model.predict``'s output (detect, segment, pose),
dynamic batch and size (pose; a dynamic export costs ~2.5x a static one), NMS in the graph against :func:`yolo_func.eval.postprocess`, the CLI, clear errors.

Models are yolov8n at 64-128 px, randomly initialised from a fixed generator, with BatchNorm
statistics calibrated on one random batch (so activations keep a realistic scale through the
network instead of fading, as they do with the init's (0, 1) statistics) and the class logits
scaled down (so scores spread over (0, 1) instead of saturating, and NMS has real decisions).
Tolerance: rtol 1e-4 with atol 1e-4 of the output's largest magnitude: ORT's and torch's float32
convolutions round differently, and a box centre is a difference of two large DFL distances, so
an element near zero can carry an absolute error of ~2e-5 of the output range (measured).
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

ort = pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxscript")

from yolo_func import tree as T  # noqa: E402
from yolo_func import yolov8  # noqa: E402
from yolo_func.cli import main  # noqa: E402
from yolo_func.eval import postprocess  # noqa: E402
from yolo_func.export import add_nms, read_metadata, to_onnx  # noqa: E402
from yolo_func.nn.batchnorm import BN_MOMENTUM  # noqa: E402


def _model(task: str, num_classes: int = 3, seed: int = 0):
    """yolov8n with calibrated BN statistics and spread class scores (see the module docstring)."""
    model = yolov8("n", task=task, num_classes=num_classes)
    params, state = model.init(torch.Generator().manual_seed(seed))
    for level in params["heads"]["detect"]["cls"].values():
        level["pred"]["weight"] = level["pred"]["weight"] * 0.1
        level["pred"]["bias"] = torch.zeros_like(level["pred"]["bias"])
    images = torch.rand(4, 3, 64, 64, generator=torch.Generator().manual_seed(seed + 100))
    with torch.no_grad():
        _, new = model.apply(params, state, images, train=True)
    # running = (1 - m) old + m batch  =>  batch statistics, exactly
    state = T.tree_map(lambda n, o: (n - (1 - BN_MOMENTUM) * o) / BN_MOMENTUM, new, state)
    return model, params, state


def _assert_close(got: np.ndarray, want: np.ndarray, what: str) -> None:
    assert got.shape == want.shape, (what, got.shape, want.shape)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()), err_msg=what)


def _run(path, images: torch.Tensor) -> list[np.ndarray]:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, {"images": images.numpy()})


def _images(b: int, h: int, w: int, seed: int) -> torch.Tensor:
    return torch.rand(b, 3, h, w, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def pose(tmp_path_factory):
    model, params, state = _model("pose")
    path = to_onnx(model, params, state, tmp_path_factory.mktemp("pose") / "pose.onnx", image_size=64, dynamic=True,
                   names=["person", "cat", "dog"])
    return model, params, state, path


def test_detect_static_equals_predict(tmp_path):
    model, params, state = _model("detect")
    path = to_onnx(model, params, state, tmp_path / "det.onnx", image_size=(64, 96), batch=2)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert [(i.name, i.shape) for i in session.get_inputs()] == [("images", [2, 3, 64, 96])]
    assert [(o.name, o.shape) for o in session.get_outputs()] == [("output0", [2, 4 + 3, 8 * 12 + 4 * 6 + 2 * 3])]
    images = _images(2, 64, 96, 1)
    (y,) = _run(path, images)
    _assert_close(y, model.predict(params, state, images).y.numpy(), "detect output0")
    meta = read_metadata(path)
    assert meta["task"] == "detect" and meta["imgsz"] == [64, 96] and meta["batch"] == 2
    assert meta["dynamic"] is False and meta["nms"] is False and meta["half"] is False
    assert meta["stride"] == 32 and meta["strides"] == [8, 16, 32] and meta["names"] == ["0", "1", "2"]


@pytest.mark.parametrize("shape", [(1, 64, 64), (3, 96, 128)])
def test_pose_dynamic_equals_predict(pose, shape):
    model, params, state, path = pose
    images = _images(*shape, seed=shape[0])
    (y,) = _run(path, images)
    _assert_close(y, model.predict(params, state, images).y.numpy(), f"pose output0 at {shape}")
    b, h, w = shape
    assert y.shape == (b, 4 + 3 + 51, (h // 8) * (w // 8) + (h // 16) * (w // 16) + (h // 32) * (w // 32))


def test_pose_metadata(pose):
    meta = read_metadata(pose[3])
    assert meta["producer"] == "yolo_func" and meta["task"] == "pose" and meta["kpt_shape"] == [17, 3]
    assert meta["names"] == ["person", "cat", "dog"] and meta["num_classes"] == 3
    assert meta["batch"] == "dynamic" and meta["dynamic"] is True and meta["outputs"] == ["output0"]


def test_nms_in_the_graph_equals_postprocess(pose):
    model, params, state, path = pose
    proto = add_nms(onnx.load(str(path)), num_classes=3, conf=0.5, iou=0.6, max_det=20)
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    assert [o.name for o in session.get_outputs()] == ["det_batch", "det_boxes", "det_scores", "det_classes", "det_extra"]
    images = _images(2, 96, 96, 7)
    batch_idx, boxes, scores, classes, extra = session.run(None, {"images": images.numpy()})
    want = postprocess(model.predict(params, state, images), conf=0.5, iou=0.6, max_det=20, kpt_shape=(17, 3))
    assert np.bincount(batch_idx, minlength=2).tolist() == [len(d.boxes) for d in want]
    assert all(len(d.boxes) > 3 for d in want)  # real NMS decisions were made
    assert any(len(d.boxes) == 20 for d in want) or all(len(d.boxes) < 20 for d in want)
    for b, d in enumerate(want):
        rows = batch_idx == b
        np.testing.assert_array_equal(classes[rows], d.classes.numpy())
        _assert_close(scores[rows], d.scores.numpy(), "scores")
        _assert_close(boxes[rows], d.boxes.numpy(), "boxes")
        _assert_close(extra[rows], d.keypoints.reshape(len(d.boxes), -1).numpy(), "keypoints")
        assert (np.diff(scores[rows]) <= 0).all()


def _checkpoint(path, task, names):
    from yolo_func.configs import apply_overrides, config_to_dict, get_recipe
    from yolo_func.io import save_checkpoint

    model, params, state = _model(task, num_classes=len(names), seed=3)
    config = apply_overrides(get_recipe("yolov8n"), [f"model.task={task}"])
    save_checkpoint(path, {"params": params, "state": state}, config=config_to_dict(config), meta={"names": list(names)})
    return model, params, state


def test_cli_exports_a_segment_checkpoint(tmp_path, capsys):
    model, params, state = _checkpoint(tmp_path / "last.pt", "segment", ["person", "bicycle"])
    out = tmp_path / "out" / "m.onnx"
    assert main(["export", "--weights", str(tmp_path / "last.pt"), "--imgsz", "64", "--batch", "2", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"wrote {out}" in printed and "onnxruntime check: max |onnx - predict|" in printed
    meta = read_metadata(out)
    assert meta["names"] == ["person", "bicycle"] and meta["task"] == "segment" and meta["num_masks"] == 32
    assert meta["outputs"] == ["output0", "output1"] and meta["batch"] == 2 and meta["imgsz"] == [64, 64]
    images = _images(2, 64, 64, 2)
    y, protos = _run(out, images)
    ref = model.predict(params, state, images)
    _assert_close(y, ref.y.numpy(), "segment output0")
    _assert_close(protos, ref.protos.numpy(), "segment output1")
    assert y.shape == (2, 4 + 2 + 32, 84) and protos.shape == (2, 32, 16, 16)


@pytest.mark.slow
def test_half_export_with_nms(tmp_path):
    """float16 file with NMS: float16 input, float32 NMS outputs, detections close to the float32
    ``postprocess`` (loosely: float16 keeps ~3 significant digits through 50+ layers)."""
    model, params, state = _model("detect")
    path = to_onnx(model, params, state, tmp_path / "h.onnx", image_size=64, half=True, nms=True, conf=0.5, iou=0.6,
                   max_det=10)
    proto = onnx.load(str(path))
    assert proto.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT16
    types = {o.name: o.type.tensor_type.elem_type for o in proto.graph.output}
    F, I = onnx.TensorProto.FLOAT, onnx.TensorProto.INT64
    assert types == {"det_batch": I, "det_boxes": F, "det_scores": F, "det_classes": I}
    meta = read_metadata(path)
    assert meta["half"] is True and meta["nms"] is True and (meta["conf"], meta["iou"], meta["max_det"]) == (0.5, 0.6, 10)
    images = _images(1, 64, 64, 5)
    try:
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        batch_idx, boxes, scores, classes = session.run(None, {"images": images.half().numpy()})
    except Exception as e:  # noqa: BLE001 - ORT builds differ in the float16 kernels they have on the CPU
        if "NOT_IMPLEMENTED" in str(e) or "Could not find an implementation" in str(e):
            pytest.skip(f"this onnxruntime has no float16 CPU kernel for the graph (half is meant for GPU runtimes): {e}")
        raise
    (want,) = postprocess(model.predict(params, state, images), conf=0.5, iou=0.6, max_det=10)
    assert (batch_idx == 0).all() and len(want.boxes) >= 3 and abs(len(boxes) - len(want.boxes)) <= 1
    # the best detection is the same one
    assert classes[0] == int(want.classes[0])
    np.testing.assert_allclose(scores[0], float(want.scores[0]), rtol=2e-2)
    np.testing.assert_allclose(boxes[0], want.boxes[0].numpy(), rtol=2e-2, atol=2e-2 * float(want.boxes.abs().max()))


# -- errors ---------------------------------------------------------------------------------------


def test_export_help_shows_defaults(capsys):
    assert main(["export", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    for d in ["(default: onnx)", "(default: 640)", "(default: 1)", "(default: 0.25)", "(default: 0.7)", "(default: 300)",
              "(default: 20)", "(default: False)"]:
        assert d in out, d


def test_cli_unknown_format(tmp_path, capsys):
    assert main(["export", "--weights", str(tmp_path / "x.pt"), "--format", "tflite"]) == 2
    err = capsys.readouterr().err
    assert "unknown format 'tflite'; supported: onnx" in err


def test_cli_unreadable_weights(tmp_path, capsys):
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a checkpoint")
    assert main(["export", "--weights", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "error:" in err and str(bad) in err and "neither a yolo_func checkpoint" in err
    assert main(["export", "--weights", str(tmp_path / "missing.pt")]) == 2
    assert "no such file" in capsys.readouterr().err


@pytest.mark.parametrize("missing", ["onnx", "onnxscript"])
def test_missing_package_names_the_extra(tmp_path, capsys, monkeypatch, missing):
    monkeypatch.setitem(sys.modules, missing, None)  # import raises ImportError
    model = yolov8("n", num_classes=2)
    params, state = model.abstract_init()
    with pytest.raises(ImportError, match=rf"needs the '{missing}' package.*pip install 'yolo_func\[export\]'"):
        to_onnx(model, params, state, tmp_path / "m.onnx", image_size=64)
    assert main(["export", "--weights", str(tmp_path / "any.pt")]) == 1
    assert "pip install 'yolo_func[export]'" in capsys.readouterr().err


def test_bad_arguments_are_named(tmp_path):
    model = yolov8("n", num_classes=2)
    params, state = model.abstract_init()
    cases = [
        (dict(image_size=100), "image_size must be a positive multiple of 32"),
        (dict(path=tmp_path / "m.pt"), "path must end in .onnx"),
        (dict(names=["a"]), "names has 1 entries, the model has 2 classes"),
        (dict(opset=13), "opset must be an int >= 18"),
        (dict(nms=True, conf=1.5), "need 0 <= conf < 1"),
        (dict(batch=0), "batch must be an int >= 1"),
    ]
    for kwargs, message in cases:
        kwargs.setdefault("path", tmp_path / "m.onnx")
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
            to_onnx(model, params, state, **kwargs)
    with pytest.raises(TypeError, match="model must be a yolo_func Model"):
        to_onnx(object(), params, state, tmp_path / "m.onnx")
    with pytest.raises(ValueError, match="do not fit"):
        to_onnx(yolov8("n", num_classes=3), params, state, tmp_path / "m.onnx", image_size=64)
