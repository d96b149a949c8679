"""``yolo_func.eval.predict``: sources, per-image letterbox, original pixels, bad files reported."""

from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from yolo_func import yolov8
from yolo_func.eval import Prediction, predict
from yolo_func.eval.predict import draw_prediction, find_images, predict_letterbox
from yolo_func.models.yolov8 import Inference


def _write_image(path: Path, h: int, w: int, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    cv2.imwrite(str(path), rng.integers(0, 255, (h, w, 3), dtype=np.uint8))
    return path


class OneBox:
    """Stand-in model: one detection of class 1 at a fixed box (x1, y1, x2, y2) in input pixels."""

    task, num_classes, heads = "detect", 3, {"detect": None}

    def __init__(self, box):
        self.box = box
        self.shapes = []

    def predict(self, params, state, images):
        self.shapes.append(tuple(images.shape))
        x1, y1, x2, y2 = self.box
        y = torch.zeros(images.shape[0], 4 + 3, 2)
        y[:, :4, 0] = torch.tensor([(x1 + x2) / 2, (y1 + y2) / 2, x2 - x1, y2 - y1])
        y[:, 5, 0] = 0.8
        return Inference(y, None)


def test_predict_letterbox_pads_the_short_side_to_32():
    img = np.zeros((90, 200, 3), np.uint8)
    out, lb = predict_letterbox(img, 64)
    # r = 0.32: 200 -> 64, 90 -> round(28.8) = 29, padded to 32 with top = round(1.5 - 0.1) = 1
    assert out.shape == (32, 64, 3)
    assert lb.orig_shape == (90, 200)
    assert lb.gain == pytest.approx((29 / 90, 64 / 200))
    assert lb.pad == (0.0, 1.0)


@settings(parent=settings.get_profile("ci"))
@given(h=st.integers(1, 700), w=st.integers(1, 700), size=st.sampled_from([32, 64, 160, 320]))
def test_predict_letterbox_invariants(h, w, size):
    """Long side = size, both sides multiples of 32 with less than 32 px of padding, the image
    centred, and an original corner maps to the resized image's corner."""
    img = np.full((h, w, 3), 7, np.uint8)
    out, lb = predict_letterbox(img, size)
    H, W = out.shape[:2]
    assert H % 32 == 0 and W % 32 == 0 and max(H, W) == size
    gy, gx = lb.gain
    nh, nw = round(h * gy), round(w * gx)
    assert max(nh, nw) == size and 0 <= H - nh < 32 and 0 <= W - nw < 32
    left, top = lb.pad
    assert abs(2 * left - (W - nw)) <= 1 and abs(2 * top - (H - nh)) <= 1
    assert (out[int(top):int(top) + nh, int(left):int(left) + nw] == 7).all()
    assert (w * gx + left, h * gy + top) == pytest.approx((left + nw, top + nh))


def test_boxes_come_back_in_original_pixels(tmp_path):
    path = _write_image(tmp_path / "a.png", 90, 200)
    model = OneBox((10.0, 5.0, 30.0, 20.0))
    (p,) = predict(model, {}, {}, path, image_size=64, device="cpu")
    assert model.shapes == [(1, 3, 32, 64)]
    assert p.error is None and p.image.shape == (90, 200, 3)
    gx, gy = 64 / 200, 29 / 90
    want = [10 / gx, (5 - 1) / gy, 30 / gx, (20 - 1) / gy]  # (xy - pad) / gain, hand-computed
    torch.testing.assert_close(p.detections.boxes, torch.tensor([want]), rtol=0, atol=1e-4)
    assert p.detections.classes.tolist() == [1]
    assert p.detections.scores.tolist() == pytest.approx([0.8])


def test_folder_with_a_corrupt_file_and_a_text_file_reports_both_and_goes_on(tmp_path):
    _write_image(tmp_path / "good1.jpg", 48, 64, 1)
    _write_image(tmp_path / "good2.png", 64, 40, 2)
    (tmp_path / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
    (tmp_path / "notes.txt").write_text("hello")
    problems = []
    model = yolov8("n", task="detect", num_classes=3)
    params, state = model.init(torch.Generator().manual_seed(0))
    preds = predict(model, params, state, tmp_path, image_size=64, device="cpu", on_problem=problems.append)
    assert [p.path.name for p in preds] == ["broken.jpg", "good1.jpg", "good2.png"]
    bad, good1, good2 = preds
    assert bad.detections is None and "broken.jpg" in bad.error
    assert good1.error is None and good1.image.shape == (48, 64, 3)
    assert good2.error is None and good2.image.shape == (64, 40, 3)
    for p in (good1, good2):  # every box inside its original image
        b = p.detections.boxes
        h, w = p.image.shape[:2]
        assert bool(((b >= 0) & (b[:, [0, 2]] <= w).all(1, keepdim=True) & (b[:, [1, 3]] <= h).all(1, keepdim=True)).all())
    assert len(problems) == 2
    assert any("notes.txt" in m and "not an image suffix" in m for m in problems)
    assert any("broken.jpg" in m for m in problems)
    picture = draw_prediction(good1, ["a", "b", "c"])
    assert picture.shape == (48, 64, 3) and picture.dtype == np.uint8
    with pytest.raises(ValueError, match="broken.jpg"):
        draw_prediction(bad)


def test_find_images_glob_list_empty_folder_and_missing(tmp_path):
    _write_image(tmp_path / "x1.jpg", 8, 8)
    _write_image(tmp_path / "x2.jpg", 8, 8)
    (tmp_path / "empty").mkdir()
    files, problems = find_images([str(tmp_path / "x*.jpg"), tmp_path / "empty", tmp_path / "nope.jpg"])
    assert [f.name for f in files] == ["x1.jpg", "x2.jpg"]
    assert len(problems) == 2
    assert "is empty" in problems[0] and "does not exist" in problems[1]
    assert all(m.startswith("[yolo_func] ") for m in problems)


def test_names_of_the_wrong_length_are_refused(tmp_path):
    with pytest.raises(ValueError, match="2 names for a model of 3 classes"):
        predict(OneBox((0, 0, 1, 1)), {}, {}, tmp_path, names=["a", "b"], device="cpu")
