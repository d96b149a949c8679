"""yolo_func: functional YOLOv8 (detect, segment, pose) training with torch.func and CUDA-graph replay.

Curated re-exports only; see the subpackages for everything else.
"""

from yolo_func._types import Anchors, Assignment, DetectPreds, Feats, PosePreds, SegmentPreds, Targets
from yolo_func.heads import Head, detect_head, pose_head, segment_head
from yolo_func.models import Inference, Model, yolov8

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "yolov8",
    "Model",
    "Inference",
    "Head",
    "detect_head",
    "segment_head",
    "pose_head",
    "Feats",
    "Anchors",
    "DetectPreds",
    "SegmentPreds",
    "PosePreds",
    "Targets",
    "Assignment",
]
