"""Datasets, augmentation and loaders: raw :class:`Sample` records in, static-shape batches out."""

from yolo_func.data.sample import Sample

__all__ = ["Sample"]
