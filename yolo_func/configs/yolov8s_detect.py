"""YOLOv8s (small) detection: the reference recipe ``yolov8s``.

The reference's ``default.yaml``: 640 px, batch 16, 100 epochs, SGD lr0 0.01 with warmup,
accumulation to the nominal batch 64, EMA, mosaic closed for the last 10 epochs.
``model.num_classes`` comes from the data.

    yolo-func train --model yolov8s --data /data/coco
    yolo-func train --model yolov8s --data /data/coco optim.lr0=0.02 train.epochs=300
"""

from yolo_func.configs.base import Config, recipe


def get_config() -> Config:
    """The ``yolov8s`` recipe (see the module docstring for the command)."""
    return recipe("s", "detect")
