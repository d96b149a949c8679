"""Heads are values: ``Head(init, apply, loss, decode)``. A model carries a ``dict[str, Head]``."""

from yolo_func.heads.base import LEVELS, Head, branch, flatten_levels, multi_level
from yolo_func.heads.detect import decode_detect, detect_channels, detect_head
from yolo_func.heads.pose import decode_keypoints, pose_head
from yolo_func.heads.segment import proto, segment_head

__all__ = [
    "Head",
    "LEVELS",
    "branch",
    "multi_level",
    "flatten_levels",
    "detect_head",
    "detect_channels",
    "decode_detect",
    "segment_head",
    "proto",
    "pose_head",
    "decode_keypoints",
]
