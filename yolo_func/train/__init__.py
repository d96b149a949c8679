"""Training: state, the eager step (and replay levels), the optimizer recipe."""

from yolo_func.train.optimizer import YoloOptimizer, yolo_sgd
from yolo_func.train.state import Batch, TrainState
from yolo_func.train.step import init_train_state, train_step

__all__ = ["TrainState", "Batch", "train_step", "init_train_state", "yolo_sgd", "YoloOptimizer"]
