"""Training: state, the eager step (and replay levels), the optimizer recipe, the run folder and
resumable checkpoints."""

from yolo_func.train.checkpoint import (
    DataPosition,
    TrainingCheckpoint,
    capture_rng,
    load_training_checkpoint,
    read_training_checkpoint,
    restore_rng,
    save_training_checkpoint,
)
from yolo_func.train.optimizer import YoloOptimizer, yolo_sgd
from yolo_func.train.run_dir import RunDir
from yolo_func.train.state import Batch, TrainState
from yolo_func.train.step import init_train_state, train_step

__all__ = ["TrainState", "Batch", "train_step", "init_train_state", "yolo_sgd", "YoloOptimizer",
           "RunDir", "DataPosition", "TrainingCheckpoint", "save_training_checkpoint", "load_training_checkpoint",
           "read_training_checkpoint", "capture_rng", "restore_rng"]
from yolo_func.train.fit import FitResult, StepInfo, fit  # noqa: E402  (fit imports the modules above)

__all__ += ["fit", "FitResult", "StepInfo"]
