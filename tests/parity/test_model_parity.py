"""Model outputs against the reference package (black-box oracle; marker ``parity``).

Both directions: our seeded init loaded into the reference (``to_reference`` + ``load_state_dict``),
and the reference's own init read back (``from_reference``); plus an official-format checkpoint
written by the reference's classes and read by ``load_reference_checkpoint``. fp32 on the CPU.
"""

from __future__ import annotations

import copy
import os
import tempfile

import pytest
import torch

from yolo_func import tree as T
from yolo_func.io import from_reference, load_reference_checkpoint, to_reference
from yolo_func.models import yolov8

pytestmark = pytest.mark.parity

os.environ.setdefault("YOLO_OFFLINE", "1")
os.environ.setdefault("YOLO_CONFIG_DIR", os.path.join(tempfile.gettempdir(), "yolo_func_ycfg"))

TOL = dict(rtol=1e-5, atol=1e-6)
TASKS = ("detect", "segment", "pose")
YAML = {"detect": "yolov8n.yaml", "segment": "yolov8n-seg.yaml", "pose": "yolov8n-pose.yaml"}
SHAPES = [(2, 3, 64, 64), (2, 3, 64, 96)]


def reference_model(task: str, nc: int):
    """The reference nano model for ``task`` (built from its yaml: the YOLOv8 legacy head, trap T1)."""
    tasks = pytest.importorskip("ultralytics.nn.tasks")
    cls = {"detect": tasks.DetectionModel, "segment": tasks.SegmentationModel, "pose": tasks.PoseModel}[task]
    return cls(YAML[task], nc=nc, verbose=False).float()


def images(shape) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(1))


def close(ours: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    assert ours.shape == ref.shape, f"{what}: {tuple(ours.shape)} vs {tuple(ref.shape)}"
    torch.testing.assert_close(ours, ref, **TOL, msg=lambda m: f"{what}: {m}")


def compare_train(model, params, state, ref, x) -> dict:
    """Train-mode forward of both; returns our new state. Also compares the BN statistics after it."""
    ref.train()
    with torch.no_grad():
        raw = ref(x)
    preds, new_state = model.apply(params, state, x, train=True)
    feats, _ = model.features(params["network"], state["network"], x, train=True)
    for i, (a, b) in enumerate(zip(feats, raw["feats"], strict=True)):
        close(a, b, f"feats[{i}]")
    close(preds["detect"].box_dist.transpose(1, 2), raw["boxes"], "boxes")
    close(preds["detect"].cls_logits.transpose(1, 2), raw["scores"], "scores")
    if "segment" in preds:
        close(preds["segment"].coeffs.transpose(1, 2), raw["mask_coefficient"], "mask_coefficient")
        close(preds["segment"].protos, raw["proto"], "proto")
    if "pose" in preds:
        close(preds["pose"].keypoints.transpose(1, 2), raw["kpts"], "kpts")
    ref_sd = ref.state_dict()
    ours_sd = to_reference(model, params, new_state)
    stats = [k for k in ref_sd if k.endswith(("running_mean", "running_var"))]
    assert len(stats) == sum(k.endswith("num_batches_tracked") for k in ref_sd) * 2
    for k in stats:
        close(ours_sd[k], ref_sd[k], k)
    # The update really happened (not the init 0 / 1), so the comparison above has teeth.
    assert not torch.equal(ref_sd["model.0.bn.running_mean"], torch.zeros(16))
    return new_state


def compare_eval(model, params, state, ref, x) -> None:
    ref.eval()
    with torch.no_grad():
        out, _raw = ref(x)
    ours = model.predict(params, state, x)
    if model.task == "segment":
        y, proto = out
        close(ours.protos, proto, "eval proto")
    else:
        y = out
        assert ours.protos is None
    close(ours.y, y, "eval y")


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[2]}x{s[3]}")
@pytest.mark.parametrize("task", TASKS)
def test_our_init_in_the_reference(task, shape):
    model = yolov8("n", task=task)
    params, state = model.init(torch.Generator().manual_seed(0))
    ref = reference_model(task, model.num_classes)
    ref.load_state_dict(to_reference(model, params, state), strict=True)
    x = images(shape)
    compare_eval(model, params, state, ref, x)  # init statistics
    new_state = compare_train(model, params, state, ref, x)
    compare_eval(model, params, new_state, ref, x)  # statistics after one train forward


@pytest.mark.parametrize("task", TASKS)
def test_reference_init_read_back(task):
    torch.manual_seed(1234)
    ref = reference_model(task, 1 if task == "pose" else 80)
    x = images(SHAPES[1])
    ref.train()
    with torch.no_grad():
        ref(x * 0.5 + 0.25)  # non-trivial running statistics in the state dict
    model = yolov8("n", task=task)
    params, state = from_reference(model, ref.state_dict())
    # the reference init differs from our seed-0 init: this really is the reference's weights
    ours0, _ = model.init(torch.Generator().manual_seed(0))
    assert not torch.equal(params["network"]["backbone"]["stem"]["conv"]["weight"], ours0["network"]["backbone"]["stem"]["conv"]["weight"])
    compare_eval(model, params, state, ref, x)
    new_state = compare_train(model, params, state, ref, x)
    compare_eval(model, params, new_state, ref, x)


@pytest.mark.parametrize("task", ["detect", "segment", "pose"])
def test_official_format_checkpoint(task, tmp_path):
    torch.manual_seed(7)
    nc = 1 if task == "pose" else 80
    ref_model, ref_ema = reference_model(task, nc), reference_model(task, nc)
    ref_ema.train()
    with torch.no_grad():
        ref_ema(images(SHAPES[0]))
    torch.save({"epoch": -1, "best_fitness": None, "model": copy.deepcopy(ref_model).half(), "ema": None,
                "updates": None, "optimizer": None, "train_args": {"imgsz": 640}}, tmp_path / "model.pt")
    torch.save({"epoch": 9, "model": copy.deepcopy(ref_model).half(), "ema": copy.deepcopy(ref_ema).half(),
                "updates": 100}, tmp_path / "ema.pt")
    model = yolov8("n", task=task)
    for name, ref in (("model.pt", ref_model), ("ema.pt", ref_ema)):
        sd = load_reference_checkpoint(tmp_path / name)
        want = {k: (v.half() if v.is_floating_point() else v) for k, v in ref.state_dict().items()}
        assert list(sd) == list(want)
        for k, v in want.items():
            assert sd[k].dtype == v.dtype and torch.equal(sd[k], v), k
        params, state = from_reference(model, sd)
        back = to_reference(model, params, state)
        for k, v in want.items():
            if not k.endswith("num_batches_tracked"):
                assert torch.equal(back[k], v.float()), k
        # and the fp16-rounded weights give the reference's outputs (reference run in fp32 on the same weights)
        ref16 = reference_model(task, nc)
        ref16.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in want.items()})
        compare_eval(model, params, state, ref16, images(SHAPES[0]))
