"""YOLOv8m (medium) instance segmentation: the reference recipe ``yolov8m-seg``.

The reference's ``default.yaml``: 640 px, batch 16, 100 epochs, SGD lr0 0.01 with warmup,
accumulation to the nominal batch 64, EMA, mosaic closed for the last 10 epochs.
``model.num_classes`` comes from the data.

    yolo-func train --model yolov8m-seg --data /data/coco
    yolo-func train --model yolov8m-seg --data /data/coco optim.lr0=0.02 train.epochs=300
"""

from yolo_func.configs.base import Config, recipe


def get_config() -> Config:
    """The ``yolov8m-seg`` recipe (see the module docstring for the command)."""
    return recipe("m", "segment")
