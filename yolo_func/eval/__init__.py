"""Evaluation and prediction: NMS, masks, keypoints, letterbox undo, COCO metrics.

Public names: :func:`postprocess` / :func:`postprocess_static` (raw inference -> detections),
:class:`Detections`, :class:`PaddedDetections`, :class:`Letterbox`, :func:`scale_to_original`,
:func:`clip_detections`,
the :mod:`~yolo_func.eval.coco_eval` module (COCO results JSON, pycocotools evaluation, the
accumulating evaluator), :mod:`~yolo_func.eval.metrics` (the reference's per-epoch metric) and
:mod:`~yolo_func.eval.draw` (pictures), :mod:`~yolo_func.eval.gt_masks` (the ground-truth masks a
segmentation validation scores against); :func:`evaluate` (batched validation of a model on a
dataset) and :func:`predict` (detections for image files).
"""

from yolo_func.eval import coco_eval, draw, gt_masks, masks, metrics, nms
from yolo_func.eval.coco_eval import CocoEvaluator
from yolo_func.eval.evaluate import evaluate
from yolo_func.eval.metrics import fitness
from yolo_func.eval.postprocess import (
    Detections,
    Letterbox,
    PaddedDetections,
    clip_detections,
    postprocess,
    postprocess_static,
    scale_to_original,
    unpad,
)
from yolo_func.eval.predict import Prediction, predict

__all__ = [
    "postprocess",
    "postprocess_static",
    "Detections",
    "PaddedDetections",
    "Letterbox",
    "scale_to_original",
    "clip_detections",
    "unpad",
    "coco_eval",
    "CocoEvaluator",
    "metrics",
    "gt_masks",
    "fitness",
    "masks",
    "nms",
    "draw",
    "evaluate",
    "predict",
    "Prediction",
]
