"""Datasets, augmentation and loaders: raw :class:`Sample` records in, static-shape batches out."""

from yolo_func.data import augment
from yolo_func.data.builtin import builtin_dataset
from yolo_func.data.coco import CocoDataset
from yolo_func.data.loader import TrainLoader, ValBatch, ValLoader
from yolo_func.data.sample import Sample
from yolo_func.data.yolo import YoloDataset

__all__ = ["Sample", "CocoDataset", "YoloDataset", "builtin_dataset", "augment", "TrainLoader", "ValLoader",
           "ValBatch"]
