"""The examples in ``examples/`` run on the CPU at tiny sizes and do what they say: the training
scripts train (finite losses, moved weights, an exact checkpoint round trip, validation metrics),
the custom head learns through the shared step, the parity tests pass and can fail, and the
notebook executes cell by cell with its figures."""

from __future__ import annotations

import importlib
import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch

from yolo_func import Anchors, Assignment
from yolo_func.io import load_checkpoint
from yolo_func.testing import assert_trees_all_close
from yolo_func.tree import tree_leaves

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
TINY = ["--device", "cpu", "--images", "8", "--imgsz", "64", "--batch", "2"]


@pytest.fixture(scope="module", autouse=True)
def builtin_cache(tmp_path_factory):
    """The built-in data is generated into a temporary cache (never the user's ~/.cache)."""
    old = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("xdg"))
    sys.path.insert(0, str(EXAMPLES))
    yield
    sys.path.remove(str(EXAMPLES))
    if old is None:
        os.environ.pop("XDG_CACHE_HOME", None)
    else:
        os.environ["XDG_CACHE_HOME"] = old


def _example(name: str):
    return importlib.import_module(name)


@pytest.mark.slow
@pytest.mark.parametrize("script", ["train_detect", "train_segment", "train_pose"])
def test_training_script_trains_evaluates_and_checkpoints(script, tmp_path):
    mod = _example(script)
    result = mod.main(TINY + ["--steps", "2", "--out", str(tmp_path)])
    assert len(result["loss"]) == 2 and all(math.isfinite(v) and v > 0 for v in result["loss"])
    kinds = {"detect": {"bbox"}, "segment": {"bbox", "segm"}, "pose": {"bbox", "keypoints"}}[mod.TASK]
    assert kinds <= set(result["val"]) and 0.0 <= result["val"]["bbox"]["AP"] <= 1.0
    saved = json.loads((tmp_path / "metrics.json").read_text())
    assert saved["loss"] == result["loss"]
    # the checkpoint holds trained EMA weights: they load into a fresh template and differ from init
    from yolo_func import yolov8

    kw = {"kpt_shape": (17, 3)} if mod.TASK == "pose" else {}
    model = yolov8("n", task=mod.TASK, num_classes=1 if mod.TASK == "pose" else 5, **kw)
    init = dict(zip(("params", "state"), model.init(torch.Generator().manual_seed(0))))
    loaded, config, meta = load_checkpoint(tmp_path / "last.pt", init)
    assert config["task"] == mod.TASK and meta["steps"] == 2
    moved = [not torch.equal(a, b) for a, b in zip(tree_leaves(loaded["params"]), tree_leaves(init["params"]))]
    assert sum(moved) > len(moved) // 2, "most parameters should have moved after two steps"


def test_centerness_targets_by_hand():
    from custom_head import centerness_targets

    # anchor centres (12, 12) and (20, 12) px (stride 8); target box x 8..24, y 8..16 for both
    anchors = Anchors(torch.tensor([[1.5, 1.5], [2.5, 1.5], [0.5, 0.5]]), torch.full((3, 1), 8.0))
    boxes = torch.tensor([[[8.0, 8, 24, 16]] * 3])
    a = Assignment(torch.tensor([[True, True, False]]), torch.zeros(1, 3, dtype=torch.int64), boxes,
                   torch.zeros(1, 3, 5), anchors)
    # (12, 12): l=4 r=12 t=4 b=4 -> sqrt(4/12 * 1); (20, 12): l=12 r=4 -> the same; background -> 0
    want = torch.tensor([[math.sqrt(1 / 3), math.sqrt(1 / 3), 0.0]])
    assert_trees_all_close(centerness_targets(a), want, rtol=1e-6, atol=1e-7)


@pytest.mark.slow
def test_custom_head_trains_through_the_shared_step(tmp_path):
    mod = _example("custom_head")
    result = mod.main(TINY + ["--steps", "3", "--out", str(tmp_path)])
    hist, ts, model = result["history"], result["train_state"], result["model"]
    assert list(model.heads) == ["detect", "centerness"]
    assert all(h["finite"] == 1.0 and math.isfinite(h["loss/centerness/bce"]) for h in hist)
    assert all(h["feat_grad_norm/centerness"] > 0 for h in hist), "the new head's gradient reaches the network"
    init, _ = model.init(torch.Generator().manual_seed(0))
    w0 = init["heads"]["centerness"]["p3"]["pred"]["weight"]
    assert not torch.equal(ts.params["heads"]["centerness"]["p3"]["pred"]["weight"], w0), "the new head trained"
    assert result["checkpoint"].is_file()
    d = result["detections"]
    assert d.boxes.shape[1:] == (4,) and len(d.scores) == len(d.boxes)


def test_parity_examples_pass_and_can_fail(monkeypatch):
    pt = _example("parity_test")
    pt.test_bbox_iou_matches_the_textbook_formula()
    pt.test_centerness_targets_match_a_loop()
    pt.test_batched_predict_equals_per_image_predict()
    # the IoU property catches a wrong implementation (GIoU is not IoU)
    import yolo_func.structures.boxes as boxes

    monkeypatch.setattr(pt, "bbox_iou", lambda a, b, **kw: boxes.bbox_iou(a, b, **{**kw, "kind": "giou"}))
    with pytest.raises(AssertionError):
        pt.test_bbox_iou_matches_the_textbook_formula()


def test_run_notebook_records_errors_and_stops(tmp_path):
    from run_notebook import main as run_main

    cells = [{"cell_type": "code", "metadata": {}, "outputs": [], "execution_count": None, "source": src}
             for src in (["x = 2\n", "print(x)\n", "x * 21"], "1 / 0", "print('never')")]
    (tmp_path / "nb.ipynb").write_text(json.dumps({"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    assert run_main([str(tmp_path / "nb.ipynb"), "--out", str(tmp_path / "out.ipynb"), "--quiet"]) == 1
    out = json.loads((tmp_path / "out.ipynb").read_text())["cells"]
    assert out[0]["execution_count"] == 1 and out[0]["outputs"][0]["text"] == ["2\n"]
    assert out[0]["outputs"][1] == {"output_type": "execute_result", "execution_count": 1, "metadata": {},
                                    "data": {"text/plain": ["42"]}}
    assert out[1]["outputs"][-1]["ename"] == "ZeroDivisionError"
    assert out[2]["execution_count"] is None and out[2]["outputs"] == []


@pytest.mark.slow
def test_swap_heads_notebook_runs_on_the_cpu(tmp_path, monkeypatch):
    from run_notebook import run_notebook

    for k, v in {"STEPS": "2", "IMGSZ": "64", "BATCH": "2", "IMAGES": "8", "DEVICE": "cpu"}.items():
        monkeypatch.setenv(f"SWAP_HEADS_{k}", v)
    nb = run_notebook(EXAMPLES / "swap_heads.ipynb", out=tmp_path / "out.ipynb", echo=False)
    assert nb["metadata"]["run_notebook"]["ok"], nb["metadata"]["run_notebook"]
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert [c["execution_count"] for c in code] == list(range(1, len(code) + 1))
    assert not [o for c in code for o in c["outputs"] if o["output_type"] == "error"]
    pngs = [o for c in code for o in c["outputs"] if "image/png" in o.get("data", {})]
    assert len(pngs) >= 3 and all(o["data"]["image/png"].startswith("iVBOR") for o in pngs)  # PNG magic, base64
    text = "".join("".join(o.get("text", [])) for o in code[0]["outputs"])
    assert "outputs produced on: cpu" in text and "2 steps, 64 px, batch 2" in text
    assert json.loads((tmp_path / "out.ipynb").read_text())["nbformat"] == 4


def test_committed_notebook_carries_outputs():
    nb = json.loads((EXAMPLES / "swap_heads.ipynb").read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert all(c["execution_count"] for c in code), "commit the notebook executed (examples/run_notebook.py)"
    first = "".join("".join(o.get("text", [])) for o in code[0]["outputs"])
    assert "outputs produced on:" in first
    assert sum("image/png" in o.get("data", {}) for c in code for o in c["outputs"]) >= 3
