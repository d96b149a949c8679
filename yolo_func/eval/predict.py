"""Prediction on image files: sources, per-image letterbox, NMS in predict mode, original pixels.

``predict`` reads an image path, a folder, a glob or a list of them, letterboxes each image on its
own (long side ``image_size``, the short side padded to the next multiple of 32, pad 114, centred:
the reference's minimal-padding predict letterbox), runs ``Model.predict`` and
:func:`~yolo_func.eval.postprocess` (conf 0.25, best class per anchor, masks by the ``"native"``
method), and returns the detections in original-image pixels. Files that cannot be read are
reported, not raised: each :class:`Prediction` carries its error.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from yolo_func import tree as T
from yolo_func.eval.evaluate import model_kpt_shape, resolve_device
from yolo_func.eval.postprocess import Detections, Letterbox, postprocess

__all__ = ["IMAGE_SUFFIXES", "Prediction", "predict", "find_images", "predict_letterbox", "draw_prediction"]

#: File suffixes read as images (lower case).
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".tif", ".tiff", ".webp")


class Prediction(NamedTuple):
    """The result for one source file.

    Attributes:
      path: the file.
      detections: :class:`Detections` in original-image pixels (masks bool[N, h0, w0]), or None when
        the file could not be read.
      image: the decoded RGB uint8[h0, w0, 3] image, or None.
      error: why the file was skipped (a message naming it), or None.

    Example:
      >>> import torch
      >>> from yolo_func import yolov8
      >>> from yolo_func.data import builtin_dataset
      >>> from yolo_func.eval import predict
      >>> model = yolov8("n", task="detect", num_classes=5)
      >>> params, state = model.init(torch.Generator().manual_seed(0))
      >>> p = predict(model, params, state, builtin_dataset("detect", "val", num_images=2).image_path(0), image_size=64, device="cpu")[0]
      >>> p._fields, p.error is None, p.image.dtype
      (('path', 'detections', 'image', 'error'), True, dtype('uint8'))
    """

    path: Path
    detections: Detections | None
    image: np.ndarray | None
    error: str | None = None


def find_images(source: str | os.PathLike | Sequence[str | os.PathLike]) -> tuple[list[Path], list[str]]:
    """Expand a source into image files.

    Args:
      source: an image path, a folder (its files, sorted, not recursive), a glob pattern
        (``"data/*.jpg"``), or a list of these.

    Returns:
      ``(files, problems)``: the files to read, in order, and one message per entry that gave
      nothing (a missing path, an empty folder, a glob without matches, a file whose suffix is not
      an image suffix).
    """
    items = [source] if isinstance(source, (str, os.PathLike)) else list(source)
    files: list[Path] = []
    problems: list[str] = []
    for item in items:
        text = str(item)
        path = Path(text)
        if path.is_dir():
            entries = sorted(p for p in path.iterdir() if p.is_file())
            images = [p for p in entries if p.suffix.lower() in IMAGE_SUFFIXES]
            for p in entries:
                if p.suffix.lower() not in IMAGE_SUFFIXES:
                    problems.append(f"[yolo_func] skipped {p}: suffix {p.suffix or '(none)'!r} is not an image suffix "
                                    f"{list(IMAGE_SUFFIXES)}")
            if not entries:
                problems.append(f"[yolo_func] folder {path} is empty; expected image files {list(IMAGE_SUFFIXES)}")
            files.extend(images)
        elif path.is_file():
            if path.suffix.lower() in IMAGE_SUFFIXES:
                files.append(path)
            else:
                problems.append(f"[yolo_func] skipped {path}: suffix {path.suffix or '(none)'!r} is not an image suffix "
                                f"{list(IMAGE_SUFFIXES)}")
        elif glob.has_magic(text):
            matches = sorted(Path(p) for p in glob.glob(text) if Path(p).is_file())
            if not matches:
                problems.append(f"[yolo_func] the pattern {text!r} matches no file")
            for p in matches:
                if p.suffix.lower() in IMAGE_SUFFIXES:
                    files.append(p)
                else:
                    problems.append(f"[yolo_func] skipped {p}: suffix {p.suffix or '(none)'!r} is not an image suffix "
                                    f"{list(IMAGE_SUFFIXES)}")
        else:
            problems.append(f"[yolo_func] source {text!r} does not exist; pass an image, a folder, a glob or a list")
    return files, problems


def predict_letterbox(image: np.ndarray, image_size: int, *, stride: int = 32) -> tuple[np.ndarray, Letterbox]:
    """The predict letterbox of one image: long side resized to ``image_size`` (up or down, linear),
    the short side padded to the next multiple of ``stride`` (centred, value 114).

    Args:
      image: RGB uint8[h0, w0, 3].
      image_size: a multiple of ``stride``.

    Returns:
      ``(uint8[H, W, 3], Letterbox)``: ``(h', w') = round(r * (h0, w0))`` (at least 1) with
      ``r = image_size / max(h0, w0)``, ``H, W`` their multiples of ``stride`` above, padding
      ``left = round((W - w') / 2 - 0.1)``, ``top`` alike; ``gain = (h' / h0, w' / w0)``.
    """
    import cv2

    from yolo_func.data.augment import PAD_VALUE

    h0, w0 = image.shape[:2]
    r = min(image_size / h0, image_size / w0)
    # at least one pixel per side (a 1 x 64 strip at 32 px would round to 0 rows)
    nh, nw = max(1, int(round(h0 * r))), max(1, int(round(w0 * r)))
    H, W = -(-nh // stride) * stride, -(-nw // stride) * stride
    left, top = int(round((W - nw) / 2 - 0.1)), int(round((H - nh) / 2 - 0.1))
    resized = image if (nh, nw) == (h0, w0) else cv2.resize(image, (nw, nh), interpolation=cv2.INTER_LINEAR)
    out = np.full((H, W, 3), PAD_VALUE, np.uint8)
    out[top:top + nh, left:left + nw] = resized
    return out, Letterbox((h0, w0), (nh / h0, nw / w0), (float(left), float(top)))


def predict(
    model: Any,
    params: dict,
    state: dict,
    source: str | os.PathLike | Sequence[str | os.PathLike],
    *,
    conf: float = 0.25,
    iou: float = 0.7,
    image_size: int = 640,
    device: str | torch.device | None = None,
    names: Sequence[str] | dict | None = None,
    max_det: int = 300,
    kpt_shape: Sequence[int] | None = None,
    on_problem: Any = None,
    precision: str = "auto",
) -> list[Prediction]:
    """Detections for image files, in original pixels.

    Args:
      model: a :class:`~yolo_func.models.Model`.
      params, state: its trees (moved to ``device``).
      source: an image path, a folder, a glob or a list of these (see :func:`find_images`).
      conf: class-score threshold (0.25; best class per anchor).
      iou: NMS IoU threshold.
      image_size: long side of the network input (a multiple of 32).
      device: ``"cpu"``, ``"cuda"``, ``"0"``; None: CUDA when available.
      names: class names (a list or ``{index: name}``); checked against the model's class count.
      max_det: detections per image.
      kpt_shape: (P, D) for pose models (default: from the head's channels).
      on_problem: called with each message about a skipped entry or file (default: ignored; the
        messages are also in each :class:`Prediction`'s ``error``).
      precision: the network's autocast, as :func:`yolo_func.eval.evaluate`'s (``"auto"``: FP16 on
        CUDA, float32 on the CPU; ``"bf16"``, ``"fp16"``, ``"fp32"``).

    Returns:
      One :class:`Prediction` per image file found, in source order; unreadable files have
      ``detections=None`` and an ``error``.

    Raises:
      ValueError: ``image_size`` not a positive multiple of 32, or ``names`` of the wrong length.

    Example:
      >>> import torch
      >>> from yolo_func import yolov8
      >>> from yolo_func.data import builtin_dataset
      >>> from yolo_func.eval import predict
      >>> ds = builtin_dataset("detect", "val", num_images=2)
      >>> model = yolov8("n", task="detect", num_classes=5)
      >>> params, state = model.init(torch.Generator().manual_seed(0))
      >>> preds = predict(model, params, state, [ds.image_path(0), ds.image_path(1)], conf=0.0, image_size=64, device="cpu")
      >>> [p.path.name for p in preds], preds[0].detections.boxes.shape[-1]     # boxes in original pixels
      (['000001.png', '000002.png'], 4)
    """
    if not isinstance(image_size, int) or image_size < 32 or image_size % 32:
        raise ValueError(f"[yolo_func] predict: image_size must be a positive multiple of 32, got {image_size!r}")
    if names is not None and len(names) != model.num_classes:
        raise ValueError(f"[yolo_func] predict: {len(names)} names for a model of {model.num_classes} classes; "
                         "pass one name per class")
    from yolo_func.data.images import read_image
    from yolo_func.func import autocast

    dev = resolve_device(device)
    kpts = model_kpt_shape(model, params, kpt_shape)
    params, state = T.tree_to(params, dev), T.tree_to(state, dev)
    files, problems = find_images(source)
    for msg in problems:
        if on_problem is not None:
            on_problem(msg)
    out = []
    from yolo_func.eval.evaluate import _autocast_dtype

    amp = _autocast_dtype(precision, dev)
    for path in files:
        try:
            image = read_image(path)
        except ValueError as e:
            msg = str(e)
            if on_problem is not None:
                on_problem(msg)
            out.append(Prediction(path, None, None, msg))
            continue
        boxed, lb = predict_letterbox(image, image_size)
        x = torch.from_numpy(np.ascontiguousarray(boxed.transpose(2, 0, 1)))[None].to(dev).float() / 255
        with torch.no_grad(), autocast(dev, amp):
            inference = model.predict(params, state, x)
        with torch.no_grad():
            det = postprocess(inference, conf=conf, iou=iou, max_det=max_det, num_classes=model.num_classes,
                              kpt_shape=kpts, mask_method="native", letterbox=[lb])[0]
        out.append(Prediction(path, det, image, None))
    return out


def draw_prediction(prediction: Prediction, names: Sequence[str] | dict | None = None) -> np.ndarray:
    """The picture of one :class:`Prediction` (boxes, labels, masks, skeletons; see
    :func:`yolo_func.eval.draw.draw_detections`).

    Raises:
      ValueError: the prediction has no image (its file could not be read).
    """
    from yolo_func.eval.draw import draw_detections

    if prediction.image is None or prediction.detections is None:
        raise ValueError(f"[yolo_func] draw_prediction: {prediction.path} has no image ({prediction.error}); "
                         "draw only predictions without an error")
    return draw_detections(prediction.image, prediction.detections, class_names=names)
