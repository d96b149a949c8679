"""Re-export of the fused CIoU, which lives in :mod:`yolo_func.structures.ciou` (the assigner
uses it too, so it belongs below ``losses/``)."""

from yolo_func.structures.ciou import ciou

__all__ = ["ciou"]
