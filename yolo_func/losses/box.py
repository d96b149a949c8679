"""Re-exports of the box codecs and the IoU family, which live in :mod:`yolo_func.structures.boxes`
(the assigner and the heads use them too, so they belong below ``losses/``)."""

from yolo_func.structures.boxes import bbox2dist, bbox_iou, dist2bbox

__all__ = ["dist2bbox", "bbox2dist", "bbox_iou"]
