"""The model a reference state dict holds, against the reference package's own models (black-box
oracle; marker ``parity``): every yaml yolov8{n,s,m,l,x}{,-seg,-pose}, the default class counts and
nc=3, plus checkpoint files written by the reference's public ``YOLO(...).save``. CPU, fp32.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

from yolo_func.io import (
    from_reference,
    infer_reference_model,
    infer_reference_spec,
    load_reference_model,
    read_reference_checkpoint,
    reference_layout,
    to_reference,
)
from yolo_func.testing import assert_trees_all_equal

pytestmark = pytest.mark.parity

os.environ.setdefault("YOLO_OFFLINE", "1")
os.environ.setdefault("YOLO_CONFIG_DIR", os.path.join(tempfile.gettempdir(), "yolo_func_ycfg"))

SUFFIX = {"detect": "", "segment": "-seg", "pose": "-pose"}
DEFAULT_NC = {"detect": 80, "segment": 80, "pose": 1}


def reference_model(scale: str, task: str, nc: int | None = None):
    tasks = pytest.importorskip("ultralytics.nn.tasks")
    cls = {"detect": tasks.DetectionModel, "segment": tasks.SegmentationModel, "pose": tasks.PoseModel}[task]
    return cls(f"yolov8{scale}{SUFFIX[task]}.yaml", nc=nc or DEFAULT_NC[task], verbose=False)


def check(scale: str, task: str, nc: int) -> None:
    torch.manual_seed(0)
    ref = reference_model(scale, task, nc)
    sd = ref.state_dict()
    spec = infer_reference_spec(sd)
    assert (spec.scale, spec.task, spec.num_classes) == (scale, task, nc)
    assert spec.kpt_shape == ((17, 3) if task == "pose" else None)  # the yaml's kpt_shape
    assert spec.num_masks == (32 if task == "segment" else None)
    model = infer_reference_model(sd)
    assert [(e.key, e.shape) for e in reference_layout(model)] == [(k, tuple(v.shape)) for k, v in sd.items()]
    params, state = from_reference(model, sd, copy=False)  # loads strictly: every key and shape fits
    back = to_reference(model, params, state)
    assert_trees_all_equal({k: v for k, v in back.items() if not k.endswith("num_batches_tracked")},
                           {k: v for k, v in sd.items() if not k.endswith("num_batches_tracked")})


@pytest.mark.parametrize("task", ["detect", "segment", "pose"])
def test_every_yaml_nano(task):
    check("n", task, DEFAULT_NC[task])


@pytest.mark.slow  # 10-30 s each on a busy 2-core CPU (the reference builds and inits the full model)
@pytest.mark.parametrize("task", ["detect", "segment", "pose"])
@pytest.mark.parametrize("scale", ["s", "m", "l", "x"])
def test_every_yaml_larger(scale, task):
    check(scale, task, DEFAULT_NC[task])


@pytest.mark.parametrize("task", ["detect", "segment", "pose"])
def test_three_classes(task):
    check("n", task, 3)


@pytest.mark.parametrize("task", ["detect", "segment", "pose"])
def test_files_saved_by_the_reference(task, tmp_path):
    yolo = pytest.importorskip("ultralytics").YOLO
    torch.manual_seed(0)
    y = yolo(f"yolov8n{SUFFIX[task]}.yaml", task=task)
    y.save(tmp_path / "w.pt")  # the reference's own writer: fp16 model, ema None
    ck = read_reference_checkpoint(tmp_path / "w.pt")
    assert ck.task == task and ck.entry == "model"
    assert ck.names == {i: str(i) for i in range(DEFAULT_NC[task])}  # what the reference names them by default
    assert ck.kpt_shape == ((17, 3) if task == "pose" else None)
    model, params, state, names = load_reference_model(tmp_path / "w.pt")
    assert (model.scale, model.task, model.num_classes) == ("n", task, DEFAULT_NC[task])
    assert names == ck.names
    want = {k: v.half().float() if v.is_floating_point() else v for k, v in y.model.state_dict().items()}
    got = to_reference(model, params, state)
    assert_trees_all_equal({k: got[k] for k in want if not k.endswith("num_batches_tracked")},
                           {k: v for k, v in want.items() if not k.endswith("num_batches_tracked")})
