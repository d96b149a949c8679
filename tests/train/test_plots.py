"""Plots: valid PNGs of the expected size, deterministic, changed by their inputs; a clear single
warning (and no file) without matplotlib."""

from __future__ import annotations

import sys
import warnings

import pytest
import torch

from yolo_func.configs import get_recipe
from yolo_func.testing.synthetic import synthetic_batch
from yolo_func.train import plots
from yolo_func.train.plots import PlotsUnavailableWarning, plot_batch, plot_predictions, plot_results
from yolo_func.train.run_dir import RunDir

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
NAMES = [f"class{i}" for i in range(80)]


def _pixels(path):
    image = pytest.importorskip("matplotlib.image")
    assert path.read_bytes()[:8] == PNG_MAGIC
    return image.imread(path)


@pytest.fixture
def mpl():
    return pytest.importorskip("matplotlib")


def _uint8(batch):
    return (batch.images * 255).round().to(torch.uint8)


def test_batch_mosaic_size_and_changes(tmp_path, mpl):
    batch = synthetic_batch("detect", 4, 64, seed=1)
    a = plot_batch(_uint8(batch), batch.targets, NAMES, tmp_path / "a.png")
    px = _pixels(a)
    assert px.shape[:2] == (128, 128)  # 4 images of 64 px on a 2 x 2 grid
    b = plot_batch(_uint8(batch), batch.targets, NAMES, tmp_path / "b.png")
    assert (px == _pixels(b)).all()  # deterministic
    moved = batch.targets._replace(boxes=batch.targets.boxes + 5 * batch.targets.valid[..., None])
    assert not (px == _pixels(plot_batch(_uint8(batch), moved, NAMES, tmp_path / "c.png"))).all()
    # float images in [0, 1] draw like their uint8 version
    assert (px == _pixels(plot_batch(_uint8(batch).float() / 255, batch.targets, NAMES, tmp_path / "d.png"))).all()
    # 9 images of 64 px, capped at 96 px: a 3 x 3 grid of 32-px tiles
    nine = synthetic_batch("detect", 9, 64, seed=2)
    assert _pixels(plot_batch(_uint8(nine), nine.targets, None, tmp_path / "e.png", max_size=96)).shape[:2] == (96, 96)
    assert _pixels(plot_batch(_uint8(nine), nine.targets, None, tmp_path / "f.png", max_images=4)).shape[:2] == (128, 128)


def test_batch_draws_masks_and_keypoints(tmp_path, mpl):
    seg = synthetic_batch("segment", 2, 64, seed=3)
    with_masks = _pixels(plot_batch(_uint8(seg), seg.targets, NAMES, tmp_path / "m.png"))
    without = _pixels(plot_batch(_uint8(seg), seg.targets._replace(masks=None), NAMES, tmp_path / "n.png"))
    assert not (with_masks == without).all()
    per_instance = seg.targets.masks[:, None] == torch.arange(1, seg.targets.boxes.shape[1] + 1)[None, :, None, None]
    same = _pixels(plot_batch(_uint8(seg), seg.targets._replace(masks=per_instance.float()), NAMES, tmp_path / "p.png"))
    assert (same == with_masks).all()  # both mask layouts draw the same picture
    pose = synthetic_batch("pose", 2, 64, seed=4, num_classes=1)
    with_kpts = _pixels(plot_batch(_uint8(pose), pose.targets, ["person"], tmp_path / "k.png"))
    no_kpts = _pixels(plot_batch(_uint8(pose), pose.targets._replace(keypoints=None), ["person"], tmp_path / "l.png"))
    assert not (with_kpts == no_kpts).all()


def test_shape_errors_name_the_argument(tmp_path, mpl):
    batch = synthetic_batch("detect", 2, 64)
    with pytest.raises(ValueError, match=r"images must be uint8\[B, 3, H, W\] .*; got \(2, 64, 64\)"):
        plot_batch(batch.images[:, 0], batch.targets, NAMES, tmp_path / "x.png")
    with pytest.raises(ValueError, match=r"targets.boxes must be float\[B=1, M, 4\]; got \(2, 8, 4\)"):
        plot_batch(batch.images[:1], batch.targets, NAMES, tmp_path / "x.png")
    with pytest.raises(ValueError, match=r"pred_boxes must be float\[N, 4\] with pred_classes int\[N\]; got \(3, 4\) and \(2,\)"):
        plot_predictions(batch.images[0], torch.zeros(0, 4), torch.zeros(0), torch.zeros(3, 4), torch.zeros(2), torch.zeros(2), NAMES, tmp_path / "x.png")


def test_predictions_beside_ground_truth(tmp_path, mpl):
    batch = synthetic_batch("detect", 1, 96, seed=5)
    keep = batch.targets.valid[0]
    gt_b, gt_c = batch.targets.boxes[0][keep], batch.targets.classes[0][keep]
    image = _uint8(batch)[0]
    base = _pixels(plot_predictions(image, gt_b, gt_c, gt_b + 2, gt_c, torch.full(gt_c.shape, 0.8), NAMES, tmp_path / "a.png"))
    assert base.shape[1] >= 2 * 96 * 0.9  # two panels side by side
    low = torch.tensor([[10.0, 10.0, 50.0, 50.0]])
    hidden = plot_predictions(image, gt_b, gt_c, torch.cat([gt_b + 2, low]), torch.cat([gt_c, torch.tensor([3])]),
                              torch.cat([torch.full(gt_c.shape, 0.8), torch.tensor([0.1])]), NAMES, tmp_path / "b.png", conf=0.25)
    assert (_pixels(hidden) == base).all()  # a prediction below conf is not drawn
    shown = plot_predictions(image, gt_b, gt_c, torch.cat([gt_b + 2, low]), torch.cat([gt_c, torch.tensor([3])]),
                             torch.cat([torch.full(gt_c.shape, 0.8), torch.tensor([0.9])]), NAMES, tmp_path / "c.png", conf=0.25)
    assert not (_pixels(shown) == base).all()


def test_results_curves_from_the_run_folder(tmp_path, mpl):
    run = RunDir(tmp_path / "run", task="detect")
    run.begin(get_recipe("yolov8n"))
    (tmp_path / "header.csv").write_text("epoch,time\n")
    assert plot_results(tmp_path / "header.csv") is None  # no rows: nothing to draw
    for e in range(1, 6):
        run.log_epoch({"epoch": e, "time": 10.0 * e, "loss/box": 2.0 / e, "loss/cls": 1.0, "loss/dfl": 1.0, "lr/decay": 0.01,
                       "lr/no_decay": 0.01, "lr/bias": 0.01, **({"box/mAP50": 0.1 * e, "box/mAP50-95": 0.05 * e} if e != 3 else {})})
    out = plot_results(run.results_path)
    assert out == run.path / "results.png"
    px = _pixels(out)
    assert px.shape[:2] == (2 * 260, 5 * 320)  # 10 curves on a 5-column grid of 3.2 x 2.6 inch panels at 100 dpi
    run.truncate_results(4)
    assert not (_pixels(plot_results(run.results_path, tmp_path / "r4.png")) == px).all()
    (tmp_path / "bad.csv").write_text("step,loss\n1,2\n")
    with pytest.raises(ValueError, match=r"bad.csv' has no 'epoch' column"):
        plot_results(tmp_path / "bad.csv")


def test_without_matplotlib_functions_skip_and_say_so_once(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    monkeypatch.setattr(plots, "_warned", False)
    batch = synthetic_batch("detect", 1, 64)
    with pytest.warns(PlotsUnavailableWarning, match=r"^\[yolo_func\] plots need matplotlib: pip install 'yolo_func\[plots\]'$"):
        assert plot_batch(batch.images, batch.targets, NAMES, tmp_path / "a.png") is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second warning would raise
        assert plot_predictions(batch.images[0], torch.zeros(0, 4), torch.zeros(0), torch.zeros(0, 4), torch.zeros(0),
                                torch.zeros(0), NAMES, tmp_path / "b.png") is None
        (tmp_path / "r.csv").write_text("epoch,loss\n1,2\n")
        assert plot_results(tmp_path / "r.csv") is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.csv"]
    assert not plots.plots_available()
