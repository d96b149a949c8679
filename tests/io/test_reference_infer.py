"""The model a reference state dict holds, read from the tensor shapes (``infer_reference_spec`` /
``infer_reference_model``; owner module ``io/_ref_infer.py``). CPU only, meta tensors (no memory);
the same checks against the reference package's own models are in ``test_reference_parity.py``."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from yolo_func.io import ReferenceSpec, infer_reference_model, infer_reference_spec, reference_layout
from yolo_func.models import yolov8

#: REFERENCE.md §1.2 table: the stem's output channels per scale, and C2f model.2's bottlenecks.
STEM = {"n": 16, "s": 32, "m": 48, "l": 64, "x": 80}
DEPTH2 = {"n": 1, "s": 1, "m": 2, "l": 3, "x": 3}


def meta_sd(model) -> dict[str, torch.Tensor]:
    return {e.key: torch.empty(e.shape, device="meta") for e in reference_layout(model)}


def layout(model) -> list[tuple[str, tuple[int, ...]]]:
    return [(e.key, e.shape) for e in reference_layout(model)]


@pytest.mark.parametrize("scale", list(STEM))
@pytest.mark.parametrize(
    "task, kwargs, want",
    [
        ("detect", {}, (80, None, None)),
        ("segment", {}, (80, None, 32)),
        ("pose", {}, (1, (17, 3), None)),
        ("detect", {"num_classes": 3}, (3, None, None)),
        ("segment", {"num_classes": 3, "num_masks": 16}, (3, None, 16)),
        ("pose", {"num_classes": 2, "kpt_shape": (5, 2)}, (2, (5, 2), None)),
    ],
)
def test_every_scale_and_task(scale, task, kwargs, want):
    model = yolov8(scale, task=task, **kwargs)
    sd = meta_sd(model)
    assert sd["model.0.conv.weight"].shape[0] == STEM[scale]
    assert len({k.split(".")[3] for k in sd if k.startswith("model.2.m.")}) == DEPTH2[scale]
    spec = infer_reference_spec(sd)
    assert spec == ReferenceSpec(scale, task, *want)
    built = infer_reference_model(sd)
    assert (built.scale, built.task, built.num_classes) == (scale, task, want[0])
    assert layout(built) == layout(model)  # same keys, shapes and order
    assert spec.matches(model) and spec.matches(built)


def test_names_and_calls():
    assert ReferenceSpec("s", "segment", 80, num_masks=32).describe() == "yolov8s-seg (segment, scale s, 80 classes)"
    assert ReferenceSpec("s", "segment", 80, num_masks=32).call() == "yolov8('s', task='segment')"
    spec = ReferenceSpec("x", "pose", 1, kpt_shape=(17, 3))
    assert (spec.name, spec.call()) == ("yolov8x-pose", "yolov8('x', task='pose')")
    assert spec.describe() == "yolov8x-pose (pose, scale x, 1 class, keypoints 17x3)"
    spec = ReferenceSpec("n", "pose", 4, kpt_shape=(5, 2))
    assert spec.call() == "yolov8('n', task='pose', num_classes=4, kpt_shape=(5, 2))"
    assert ReferenceSpec("m", "detect", 3).call() == "yolov8('m', task='detect', num_classes=3)"
    assert not ReferenceSpec("n", "pose", 1, kpt_shape=(5, 2)).matches(yolov8("n", task="pose"))  # 10 vs 51 channels


def _pose_keys(nk: int) -> dict[str, torch.Tensor]:
    """The few entries the inference reads, for a nano pose model with ``nk`` keypoint channels."""
    e = lambda *s: torch.empty(s, device="meta")  # noqa: E731
    return {"model.0.conv.weight": e(16, 3, 3, 3), "model.2.m.0.cv1.conv.weight": e(16, 16, 3, 3),
            "model.22.cv3.0.2.weight": e(1, 64, 1, 1), "model.22.cv4.0.2.weight": e(nk, 51, 1, 1)}


@given(st.integers(1, 60), st.sampled_from([2, 3]))
def test_kpt_shape_rule_and_metadata(p, d):
    sd = _pose_keys(p * d)
    # with the stored kpt_shape: exactly it
    assert infer_reference_spec(sd, kpt_shape=(p, d)).kpt_shape == (p, d)
    # without: D = 3 whenever P*D is a multiple of 3, else D = 2 (the documented rule)
    got = infer_reference_spec(sd).kpt_shape
    assert got[0] * got[1] == p * d
    assert got == ((p * d // 3, 3) if (p * d) % 3 == 0 else (p * d // 2, 2))
    if d == 3 or p % 3 != 0:
        assert got == (p, d)  # unambiguous unless P*D = P'*3 with D = 2 (P a multiple of 3)


def test_errors():
    with pytest.raises(TypeError, match=r"^\[yolo_func\] infer_reference_model: state_dict must be a mapping"):
        infer_reference_spec([("model.0.conv.weight", torch.empty(16, 3, 3, 3))])
    with pytest.raises(ValueError, match=r"^\[yolo_func\] infer_reference_model: the state dict has no 'model\.0\.conv\.weight'"):
        infer_reference_spec({"module.model.0.conv.weight": torch.empty(16, 3, 3, 3)})
    sd = _pose_keys(51)
    sd["model.0.conv.weight"] = torch.empty(24, 3, 3, 3, device="meta")
    with pytest.raises(ValueError, match=r"has 24 output channels; the YOLOv8 scales have n 16, s 32, m 48, l 64, x 80"):
        infer_reference_spec(sd)
    sd = _pose_keys(51)
    sd["model.2.m.1.cv1.conv.weight"] = sd["model.2.m.0.cv1.conv.weight"]
    with pytest.raises(ValueError, match=r"scale 'n', whose first C2f \(model\.2\) has 1 bottleneck\(s\), but the state dict has 2"):
        infer_reference_spec(sd)
    with pytest.raises(ValueError, match=r"has 7 output channels, which is not P\*2 or P\*3"):
        infer_reference_spec(_pose_keys(7))
    with pytest.raises(ValueError, match=r"kpt_shape=\(17, 3\) does not fit the keypoint branch .* has 10 output channels"):
        infer_reference_spec(_pose_keys(10), kpt_shape=(17, 3))
    with pytest.raises(ValueError, match=r"kpt_shape=\(17, 3\) was given but the state dict has no keypoint branch"):
        infer_reference_spec(meta_sd(yolov8("n")), kpt_shape=(17, 3))
    with pytest.raises(ValueError, match=r"'model\.22\.cv3\.0\.2\.weight' should be a 4-d tensor, got shape \[3\]"):
        infer_reference_spec({**_pose_keys(51), "model.22.cv3.0.2.weight": torch.empty(3)})
