"""Boxes (layouts, codecs, the IoU family), padded static-shape targets, the batch record and
the step's input checks."""

from yolo_func.structures.records import Batch, Targets

from yolo_func.structures.boxes import (
    bbox2dist,
    bbox_iou,
    box_area,
    clip_boxes,
    dfl_expectation,
    dist2bbox,
    xywh_to_xyxy,
    xyxy_to_xywh,
)
from yolo_func.structures.checks import check_batch, check_targets
from yolo_func.structures.ciou import ciou
from yolo_func.structures.targets import (
    TargetsReport,
    bucket_size,
    check_finite,
    pad_targets,
    targets_from_flat,
    targets_from_lists,
    validate_preds,
    validate_targets,
)

__all__ = [
    "Targets",
    "Batch",
    "xyxy_to_xywh",
    "xywh_to_xyxy",
    "clip_boxes",
    "box_area",
    "dist2bbox",
    "bbox2dist",
    "dfl_expectation",
    "bbox_iou",
    "ciou",
    "bucket_size",
    "targets_from_flat",
    "targets_from_lists",
    "TargetsReport",
    "pad_targets",
    "check_batch",
    "check_targets",
    "validate_targets",
    "validate_preds",
    "check_finite",
]
