"""Pictures: shape and dtype, pixels change on the boxes, labels, masks and skeletons, not elsewhere."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from yolo_func.eval import Detections
from yolo_func.eval.draw import class_color, draw_detections, save_image


def picture(**kw):
    img = np.full((120, 160, 3), 100, dtype=np.uint8)
    masks = torch.zeros(1, 30, 40, dtype=torch.bool)  # quarter resolution: resized to the image
    masks[0, 10:20, 10:20] = True  # image pixels 40..80 x 40..80
    kp = torch.zeros(1, 17, 3)
    kp[0, 5] = torch.tensor([120.0, 90.0, 0.9])  # left shoulder
    kp[0, 6] = torch.tensor([150.0, 90.0, 0.9])  # right shoulder, joined to the left one
    kp[0, 7] = torch.tensor([130.0, 110.0, 0.1])  # low confidence: not drawn
    det = Detections(torch.tensor([[30.0, 40.0, 90.0, 100.0]]), torch.tensor([0.87]), torch.tensor([2]), masks, kp)
    return img, det, draw_detections(img, det, class_names=["a", "b", "car"], line_width=2, **kw)


def test_shape_dtype_and_input_untouched():
    img, _, out = picture()
    assert out.shape == img.shape and out.dtype == np.uint8
    assert (img == 100).all()


def test_pixels_change_where_drawn_only():
    img, _, out = picture()
    changed = (out != img).any(-1)
    assert changed[40:100, 30].all() and changed[100, 30:90].all()  # left and bottom edges of the box
    assert changed[60, 60]  # mask overlay inside the box
    assert tuple(out[60, 60]) == tuple(np.round(100 * 0.55 + np.array(class_color(2)) * 0.45).astype(np.uint8))
    assert changed[90, 135]  # skeleton segment between the two shoulders
    assert not changed[110, 130]  # the low-confidence keypoint
    assert not changed[:10].any() and not changed[105:, :25].any()  # far from everything
    # The label background is filled with the class colour above the box.
    assert (out[30:38, 32:40] == np.array(class_color(2), np.uint8)).all(-1).mean() > 0.3


def test_no_masks_no_keypoints_and_bad_image(tmp_path):
    img = np.zeros((32, 32, 3), np.uint8)
    det = Detections(torch.tensor([[4.0, 4.0, 20.0, 20.0]]), torch.tensor([0.5]), torch.tensor([0]))
    out = draw_detections(img, det)
    assert out[12, 4].any() and not out[28, 28].any()
    path = save_image(tmp_path / "x.png", out)
    assert path.stat().st_size > 0
    with pytest.raises(ValueError, match=r"^\[yolo_func\] draw_detections: image must be uint8"):
        draw_detections(img.astype(np.float32), det)
