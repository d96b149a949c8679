"""``yolo-func train``: flags and overrides reach the config, bad configs are one line and exit 2,
Ctrl-C exits 130, no argument runs the built-in default recipe."""

from __future__ import annotations

import importlib
import json

import pytest

from yolo_func.cli import main
from yolo_func.configs import config_from_json, default_config
from yolo_func.data import builtin_dataset

fit_module = importlib.import_module("yolo_func.train.fit")  # the module (yolo_func.train.fit is the function)


@pytest.fixture
def captured(monkeypatch):
    """Replace fit with a recorder: the CLI's config without training."""
    seen = []

    def fake_fit(config, **kw):
        seen.append(config)
        return fit_module.FitResult(None, None, 0, 0, "completed", None, None)

    monkeypatch.setattr(fit_module, "fit", fake_fit)
    return seen


def test_train_without_arguments_runs_the_default_recipe(captured):
    assert main(["train"]) == 0
    assert captured == [default_config()]  # builtin-cpu here (no CUDA), builtin-gpu with CUDA


def test_flags_and_overrides_build_the_config(captured):
    argv = ["train", "--model", "yolov8s-seg", "--data", "/data/coco", "--epochs", "3", "--batch", "8", "--imgsz", "320",
            "--device", "cpu", "--out", "/tmp/x", "optim.lr0=0.02", "data.augment.mosaic=0.5", "--resume"]
    assert main(argv) == 0
    (cfg,) = captured
    got = (cfg.model.scale, cfg.model.task, cfg.data.path, cfg.train.epochs, cfg.data.batch_size, cfg.data.image_size,
           cfg.train.device, cfg.train.out, cfg.optim.lr0, cfg.data.augment.mosaic, cfg.train.resume)
    assert got == ("s", "segment", "/data/coco", 3, 8, 320, "cpu", "/tmp/x", 0.02, 0.5, True)


def test_overrides_between_and_after_flags(captured, capsys):
    assert main(["train", "optim.lr0=0.02", "--epochs", "3", "data.workers=0", "--out", "/tmp/x", "train.seed=4"]) == 0
    (cfg,) = captured
    assert (cfg.optim.lr0, cfg.train.epochs, cfg.data.workers, cfg.train.out, cfg.train.seed) == (0.02, 3, 0, "/tmp/x", 4)
    assert main(["train", "--epochs", "3", "--bogus"]) == 2  # an unknown flag is still a usage error
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "message"), [
    (["optim.lrr=0.1"], "error: [yolo_func] unknown config key 'optim.lrr'; did you mean 'optim.lr0'?"),
    (["mosiac=0.5"], "error: [yolo_func] unknown config key 'mosiac'; did you mean 'data.augment.mosaic'?"),
    (["train.epochs=1.5"], "error: [yolo_func] config key 'train.epochs' expects int; got '1.5'"),
])
def test_a_bad_config_is_one_line_and_exit_2(argv, message, captured, capsys):
    assert main(["train", *argv]) == 2
    out, err = capsys.readouterr()
    assert err.splitlines() == [message]
    assert captured == []


def test_ctrl_c_exits_130(monkeypatch):
    monkeypatch.setattr(fit_module, "fit", lambda config, **kw: fit_module.FitResult(None, None, 0, 1, "interrupted", None, None))
    assert main(["train", "--device", "cpu"]) == 130


@pytest.mark.slow
def test_train_on_a_coco_json_writes_the_run_folder(tmp_path, capsys):
    ds = builtin_dataset("detect", "train", root=tmp_path / "data", num_images=4)
    out = tmp_path / "run"
    argv = ["train", "--data", str(ds.annotations_path), "--imgsz", "64", "--batch", "2", "--epochs", "1",
            "--device", "cpu", "--out", str(out), "data.workers=0", "train.plots=false", "optim.lr0=0.02"]
    assert main(argv) == 0
    cfg = config_from_json((out / "config.json").read_text())
    assert (cfg.data.image_size, cfg.data.batch_size, cfg.optim.lr0, cfg.model.num_classes) == (64, 2, 0.02, 5)
    assert (out / "weights" / "last.pt").is_file()
    assert [json.loads(line)["event"] for line in (out / "events.jsonl").read_text().splitlines()][-1] == "end"
    assert f"Run folder: {out}" in capsys.readouterr().out


def test_a_second_ctrl_c_exits_130_without_a_traceback(monkeypatch, capsys):
    def raise_interrupt(config, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(fit_module, "fit", raise_interrupt)
    assert main(["train", "--device", "cpu"]) == 130
    assert "stopped without saving" in capsys.readouterr().err
