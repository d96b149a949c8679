"""The default run on the CPU: YOLOv8n detection on the built-in data, small and sensible.

What ``yolo-func train`` with no argument runs on a machine without CUDA (issue 14 item 5: under
10 minutes on a 2-core CPU). Provisional until the fit loop lands and is timed: 320 px (a quarter
of the pixels of 640), batch 16, 30 epochs, mosaic closed for the last 5, eager float32, 2 loader
workers, decoded images cached in RAM, and a 9-minute wall-clock limit so the run ends (saving its
checkpoint and summary) within the budget whatever the machine.

    yolo-func train
    yolo-func train --device cpu --epochs 10 --imgsz 256
"""

import dataclasses

from yolo_func.configs.base import Config, DataConfig, TrainConfig, recipe


def get_config() -> Config:
    """The built-in CPU default (see the module docstring for the command)."""
    base = recipe("n", "detect")
    return dataclasses.replace(
        base,
        data=DataConfig(path="builtin", image_size=320, batch_size=16, workers=2, cache="ram",
                        augment=dataclasses.replace(base.data.augment, close_mosaic=5)),
        train=TrainConfig(epochs=30, device="cpu", capture="none", autocast="none", time_limit_hours=0.15, name="builtin"),
    )
