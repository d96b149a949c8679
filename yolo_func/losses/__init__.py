"""Loss terms: IoU family and box codecs, DFL, classification, masks, keypoints."""

from yolo_func.losses.box import bbox2dist, dist2bbox
from yolo_func.losses.dfl import dfl_expectation

__all__ = ["dist2bbox", "bbox2dist", "dfl_expectation"]
