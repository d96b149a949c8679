"""``yolo-func val`` and ``yolo-func predict`` on small real data (random nano weights, 128 px)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch

from yolo_func import yolov8
from yolo_func.cli import main
from yolo_func.data import CocoDataset
from yolo_func.data.yolo import write_yolo_dataset
from yolo_func.eval.coco_eval import BOX_KEYS
from yolo_func.io import to_reference

ROOT = Path(__file__).resolve().parents[1]


def _reference_files():
    # tests/io/reference_files.py under a unique module name (it is not on this folder's path).
    spec = importlib.util.spec_from_file_location("cli_eval_reference_files", ROOT / "tests" / "io" / "reference_files.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _reference_weights(path: Path, task: str, names: list[str], seed: int = 0) -> Path:
    model = yolov8("n", task=task, num_classes=len(names))
    params, state = model.init(torch.Generator().manual_seed(seed))
    return _reference_files().write_reference_checkpoint(path, to_reference(model, params, state), task=task, names=names)


@pytest.fixture(scope="module")
def coco_tiny(shared_data: Path) -> Path:
    return shared_data / "coco-tiny"


@pytest.fixture(scope="module")
def tiny_names(coco_tiny: Path) -> list[str]:
    return CocoDataset(coco_tiny / "annotations.json", coco_tiny / "images", task="detect", verify=False).names


@pytest.mark.parametrize("command", ["val", "predict"])
def test_help_lists_every_default(command, capsys):
    assert main([command, "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    defaults = {"val": ["(default: 640)", "(default: 32)", "(default: 0.001)", "(default: 0.7)", "(default: None)"],
                "predict": ["(default: 640)", "(default: 0.25)", "(default: 0.7)", "(default: None)"]}[command]
    for d in defaults:
        assert d in out, d


@pytest.mark.slow
def test_val_on_a_coco_folder_with_reference_weights(coco_tiny, tiny_names, tmp_path, capsys):
    weights = _reference_weights(tmp_path / "w.pt", "detect", tiny_names)
    out = tmp_path / "out"
    rc = main(["val", "--weights", str(weights), "--data", str(coco_tiny), "--out", str(out), "--imgsz", "128",
               "--batch", "16", "--device", "cpu", "--workers", "0", "--conf", "0"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "classes mapped by name" in text and "AP50" in text
    metrics = json.loads((out / "metrics.json").read_text())
    assert set(metrics) == {"bbox", "internal"} and set(metrics["bbox"]) == set(BOX_KEYS)
    preds = json.loads((out / "predictions.json").read_text())
    gt = json.loads((coco_tiny / "annotations.json").read_text())
    assert len(preds) > 0
    assert {p["image_id"] for p in preds} <= {im["id"] for im in gt["images"]}
    assert {p["category_id"] for p in preds} <= {c["id"] for c in gt["categories"]}
    assert all(set(p) == {"image_id", "category_id", "bbox", "score"} for p in preds)


@pytest.mark.slow
def test_val_on_a_yolo_yaml_with_our_checkpoint_maps_by_order(coco_tiny, tmp_path, capsys):
    from yolo_func.configs import default_config
    from yolo_func.optim import sgd
    from yolo_func.train import init_train_state
    from yolo_func.train.checkpoint import DataPosition, save_training_checkpoint

    ds = CocoDataset(coco_tiny / "annotations.json", coco_tiny / "images", task="detect", verify=False)
    yaml = write_yolo_dataset({"val": ds}, tmp_path / "yolo")
    model = yolov8("n", task="detect", num_classes=80)
    ts = init_train_state(model, sgd(0.01), torch.Generator().manual_seed(0))
    ck = save_training_checkpoint(tmp_path / "last.pt", ts, config=default_config("cpu"), position=DataPosition(1, 0, 0))
    out = tmp_path / "out"
    rc = main(["val", "--weights", str(ck), "--data", str(yaml), "--out", str(out), "--imgsz", "128", "--batch", "16",
               "--device", "cpu", "--workers", "0", "--conf", "0"])
    assert rc == 0
    assert "classes mapped by order" in capsys.readouterr().out
    preds = json.loads((out / "predictions.json").read_text())
    assert len(preds) > 0
    assert {p["image_id"] for p in preds} <= set(range(len(ds)))  # YOLO data: the index is the id
    assert {p["category_id"] for p in preds} <= set(range(80))
    assert "bbox" in json.loads((out / "metrics.json").read_text())


def test_val_class_count_mismatch_names_both(coco_tiny, tmp_path, capsys):
    weights = _reference_weights(tmp_path / "w3.pt", "detect", ["apple", "pear", "plum"])
    rc = main(["val", "--weights", str(weights), "--data", str(coco_tiny), "--out", str(tmp_path / "o"),
               "--device", "cpu", "--workers", "0"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "the weights have 3 classes" in err and "the dataset has 80 categories" in err
    assert not (tmp_path / "o" / "metrics.json").exists()


def test_val_bad_data_path_is_one_error_line(tmp_path, capsys):
    weights = _reference_weights(tmp_path / "w.pt", "detect", ["a", "b"])
    rc = main(["val", "--weights", str(weights), "--data", str(tmp_path / "nothing"), "--out", str(tmp_path / "o")])
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: [yolo_func] --data {str(tmp_path / 'nothing')!r}: expected a COCO folder (annotations.json + "
                   "images/), a COCO JSON (with --images), a YOLO data.yaml or 'builtin'"]


def _images(folder: Path, n: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for i in range(n):
        cv2.imwrite(str(folder / f"img{i}.jpg"), rng.integers(0, 255, (60 + 10 * i, 80, 3), dtype=np.uint8))


def test_predict_writes_records_and_pictures_and_reports_bad_files(tmp_path, capsys):
    weights = _reference_weights(tmp_path / "seg.pt", "segment", ["a", "b"])
    src = tmp_path / "src"
    _images(src, 2)
    (src / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 garbage")
    (src / "readme.txt").write_text("not an image")
    out = tmp_path / "out"
    rc = main(["predict", "--weights", str(weights), "--source", str(src), "--out", str(out), "--imgsz", "64",
               "--conf", "0", "--device", "cpu"])
    assert rc == 0
    err = capsys.readouterr().err
    assert "readme.txt" in err and "broken.jpg" in err
    preds = json.loads((out / "predictions.json").read_text())
    assert {Path(p["file_name"]).name for p in preds} == {"img0.jpg", "img1.jpg"}
    assert all(set(p) == {"file_name", "category_id", "bbox", "score", "segmentation"} for p in preds)
    assert {p["category_id"] for p in preds} <= {0, 1}
    shapes = {"img0.jpg": (60, 80), "img1.jpg": (70, 80)}
    for p in preds:
        h, w = shapes[Path(p["file_name"]).name]
        assert p["segmentation"]["size"] == [h, w]  # RLE of the original image size
        x, y, bw, bh = p["bbox"]
        assert 0 <= x and 0 <= y and x + bw <= w + 1e-3 and y + bh <= h + 1e-3
    pictures = sorted(f.name for f in out.iterdir() if f.suffix == ".jpg")
    assert pictures == ["img0.jpg", "img1.jpg"]
    assert cv2.imread(str(out / "img1.jpg")).shape == (70, 80, 3)


def test_predict_exit_code_is_1_when_nothing_could_be_read(tmp_path, capsys):
    weights = _reference_weights(tmp_path / "w.pt", "detect", ["a", "b"])
    src = tmp_path / "src"
    src.mkdir()
    (src / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n truncated")
    rc = main(["predict", "--weights", str(weights), "--source", str(src), str(tmp_path / "empty*"), "--out",
               str(tmp_path / "out"), "--imgsz", "64", "--device", "cpu"])
    assert rc == 1
    err = capsys.readouterr().err
    assert "broken.png" in err and "matches no file" in err and "no image could be read" in err
    assert json.loads((tmp_path / "out" / "predictions.json").read_text()) == []


def test_open_dataset_builtin_is_the_fits_val_split(tmp_path, monkeypatch):
    """``--data builtin`` names the val split the default fit validates on (same images and boxes)."""
    from yolo_func.cli_eval import open_dataset
    from yolo_func.data import builtin_dataset

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    ds = open_dataset("builtin", task="detect")
    ref = builtin_dataset("detect", "val", root=tmp_path / "cache" / "yolo_func", seed=0)
    assert len(ds) == len(ref) > 0
    for i in (0, len(ds) - 1):
        a, b = ds[i], ref[i]
        assert np.array_equal(a.image, b.image)
        assert torch.equal(torch.as_tensor(a.boxes), torch.as_tensor(b.boxes))
    with pytest.raises(ValueError, match="'builtin'"):
        open_dataset(tmp_path / "nothing-here", task="detect")
