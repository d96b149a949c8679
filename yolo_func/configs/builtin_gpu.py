"""The default run on CUDA: YOLOv8n detection on the built-in data at 640 px with replay.

What ``yolo-func train`` with no argument runs when CUDA is available (issue 14 item 5: box mAP50
>= 0.85 within 3 minutes). Provisional until the fit loop lands and is timed: 640 px, batch 16,
30 epochs, mosaic closed for the last 5, BF16 autocast, the replay level chosen automatically
('step' where the heads allow it), 8 loader workers and decoded images cached in RAM.

    yolo-func train
    yolo-func train --device cuda:0 --epochs 50 train.capture=network
"""

import dataclasses

from yolo_func.configs.base import Config, DataConfig, TrainConfig, recipe


def get_config() -> Config:
    """The built-in CUDA default (see the module docstring for the command)."""
    base = recipe("n", "detect")
    return dataclasses.replace(
        base,
        data=DataConfig(path="builtin", image_size=640, batch_size=16, workers=8, cache="ram",
                        augment=dataclasses.replace(base.data.augment, close_mosaic=5)),
        train=TrainConfig(epochs=30, device="cuda", capture="auto", autocast="auto", name="builtin"),
    )
