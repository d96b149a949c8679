"""``benchmarks/to_reference_pt.py`` against the reference package (black-box oracle; marker ``parity``).

The converted file must be read back by the reference as the task it holds: ``YOLO(path).task``
decides which validator ``YOLO(path).val`` runs, and a segmentation checkpoint it took for a
detection one failed inside its detection NMS (``'tuple' object has no attribute 'shape'``).
CPU, random weights, a few coco-tiny images at 64 px.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import math
import os
import tempfile
from pathlib import Path

import pytest
import torch

from yolo_func.io import to_reference
from yolo_func.models import yolov8

pytestmark = pytest.mark.parity

os.environ.setdefault("YOLO_OFFLINE", "1")
os.environ.setdefault("YOLO_CONFIG_DIR", os.path.join(tempfile.gettempdir(), "yolo_func_ycfg"))

ROOT = Path(__file__).resolve().parents[2]
CLASS = {"detect": "DetectionModel", "segment": "SegmentationModel"}


def _converter():
    spec = importlib.util.spec_from_file_location("to_reference_pt", ROOT / "benchmarks" / "to_reference_pt.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.convert


def _ours_as_reference(tmp_path: Path, task: str, nc: int) -> Path:
    """Our seeded yolov8n of ``task`` converted by the benchmark script; returns the written ``.pt``."""
    model = yolov8("n", task=task, num_classes=nc)
    params, state = model.init(torch.Generator().manual_seed(0))
    src = tmp_path / f"ours-{task}.pt"
    torch.save({"model": to_reference(model, params, state)}, src)
    with contextlib.redirect_stdout(io.StringIO()):
        return _converter()(src, tmp_path / f"ref-{task}.pt")


@pytest.mark.parametrize("task", ["detect", "segment"])
def test_reference_reads_the_converted_task(tmp_path, task):
    from ultralytics import YOLO

    pt = _ours_as_reference(tmp_path, task, nc=3)
    with contextlib.redirect_stdout(io.StringIO()):
        ref = YOLO(str(pt))
    assert ref.task == task
    assert type(ref.model).__name__ == CLASS[task]
    assert ref.model.args["task"] == task
    assert ref.model.names == {0: "0", 1: "1", 2: "2"}


def _few_coco(shared: Path, n: int, out: Path):
    """The first ``n`` coco-tiny images and their annotations as a COCO folder of our reader."""
    from yolo_func.data import CocoDataset

    src = json.loads((shared / "coco-tiny" / "annotations.json").read_text())
    images = sorted(src["images"], key=lambda im: im["id"])[:n]
    ids = {im["id"] for im in images}
    anns = [a for a in src["annotations"] if a["image_id"] in ids]
    (out / "annotations.json").write_text(json.dumps({**src, "images": images, "annotations": anns}))
    return CocoDataset(out / "annotations.json", shared / "coco-tiny" / "images", task="segment")


@pytest.mark.slow
def test_reference_segment_val_runs_on_the_converted_file(tmp_path, shared_data):
    """The reference's own segmentation val on our converted weights gives box and mask metrics, and
    our ``evaluate`` on the same file gives a comparable box mAP (random weights: both ~0)."""
    from ultralytics import YOLO

    from yolo_func.cli_eval import load_weights
    from yolo_func.data.yolo import write_yolo_dataset
    from yolo_func.eval.evaluate import evaluate

    pt = _ours_as_reference(tmp_path, "segment", nc=80)
    ds = _few_coco(shared_data, 4, tmp_path)
    data = write_yolo_dataset(ds, tmp_path / "yolo")
    with contextlib.redirect_stdout(io.StringIO()):
        ref = YOLO(str(pt))
        m = ref.val(data=str(data), imgsz=64, batch=2, conf=0.001, iou=0.7, plots=False, device="cpu", workers=0,
                    rect=True, verbose=False, save_json=False, project=str(tmp_path / "runs"), name="val")
    ref_box, ref_mask = float(m.box.map), float(m.seg.map)
    assert 0.0 <= ref_box <= 1.0 and 0.0 <= ref_mask <= 1.0

    w = load_weights(pt)
    assert w.model.task == "segment"
    ours = evaluate(w.model, w.params, w.state, ds, image_size=64, batch_size=2, device=torch.device("cpu"), workers=0,
                    progress=False, verbose=False, coco=False)
    ours_box = ours["internal"]["box"]["mAP50-95"]
    assert math.isfinite(ours_box) and abs(ours_box - ref_box) < 0.01
