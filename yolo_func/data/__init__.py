"""Datasets, augmentation and loaders: raw :class:`Sample` records in, static-shape batches out."""

from yolo_func.data import augment
from yolo_func.data.loader import TrainLoader, ValBatch, ValLoader
from yolo_func.data.sample import Sample

__all__ = ["Sample", "augment", "TrainLoader", "ValLoader", "ValBatch"]
