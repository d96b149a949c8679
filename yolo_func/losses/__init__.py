"""Loss terms: DFL, classification, masks, keypoints, and the head-level losses
``(preds, targets, assignment) -> (scalar, parts)``.

The box codecs, the IoU family, the fused CIoU and the DFL decode live in
:mod:`yolo_func.structures` (the assigner and the heads use them too); they are re-exported here
so ``from yolo_func.losses import bbox_iou, ciou, ...`` keeps working.
"""

from yolo_func.losses.box import bbox2dist, bbox_iou, dist2bbox
from yolo_func.losses.ciou import ciou  # via the submodule, so the package attribute is the function
from yolo_func.losses.cls import cls_loss
from yolo_func.losses.dfl import dfl_expectation, dfl_loss
from yolo_func.losses.heads import LossFn, LossGains, detect_loss, pose_loss, segment_loss
from yolo_func.losses.keypoint import COCO_SIGMAS, keypoint_losses, keypoint_sigmas
from yolo_func.losses.mask import gather_positive_slots, mask_loss
from yolo_func.losses.precision import at_least_f32

__all__ = [
    "dist2bbox",
    "bbox2dist",
    "bbox_iou",
    "ciou",
    "dfl_expectation",
    "dfl_loss",
    "cls_loss",
    "mask_loss",
    "gather_positive_slots",
    "keypoint_losses",
    "keypoint_sigmas",
    "COCO_SIGMAS",
    "LossGains",
    "LossFn",
    "detect_loss",
    "segment_loss",
    "pose_loss",
    "at_least_f32",
]
