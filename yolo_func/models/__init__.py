"""YOLOv8 network (backbone + neck) and models."""

from yolo_func.models.backbone import backbone
from yolo_func.models.neck import neck, neck_channels
from yolo_func.models.scales import SCALES, Scale, channels, get_scale, repeats
from yolo_func.models.yolov8 import TASKS, Inference, Model, check_images, network, yolov8

__all__ = [
    "SCALES",
    "Scale",
    "get_scale",
    "channels",
    "repeats",
    "backbone",
    "neck",
    "neck_channels",
    "network",
    "Model",
    "Inference",
    "TASKS",
    "yolov8",
    "check_images",
]
