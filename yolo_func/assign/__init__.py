"""Anchors and target assignment."""

from yolo_func.assign.anchors import anchors_for_feats, make_anchors
from yolo_func.assign.tal import assign, assign_from_detect

__all__ = ["make_anchors", "anchors_for_feats", "assign", "assign_from_detect"]
