"""Anchors and target assignment."""

from yolo_func.assign.anchors import anchors_for_feats, make_anchors

__all__ = ["make_anchors", "anchors_for_feats"]
