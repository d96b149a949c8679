"""Training configs: a frozen-dataclass tree with the reference's defaults, one ``get_config()``
per recipe (``yolov8{n,s,m,l,x}_{detect,segment,pose}.py``, ``builtin_cpu.py``,
``builtin_gpu.py``), strict ``key=value`` overrides and the JSON round trip of ``config.json``.

Example:
  >>> from yolo_func.configs import get_recipe, apply_overrides
  >>> cfg = apply_overrides(get_recipe("yolov8s-seg"), ["optim.lr0=0.02", "data.path=/data/coco"])
  >>> cfg.model.task, cfg.optim.lr0
  ('segment', 0.02)
"""

from yolo_func.configs.base import (
    SCALES,
    TASKS,
    AugmentConfig,
    Config,
    DataConfig,
    FieldInfo,
    LossConfig,
    ModelConfig,
    OptimConfig,
    TrainConfig,
    ValConfig,
    config_keys,
    field_info,
    recipe,
    recipe_name,
)
from yolo_func.configs.overrides import (
    apply_overrides,
    config_diff,
    config_from_dict,
    config_from_json,
    config_to_dict,
    config_to_json,
    did_you_mean,
    format_value,
    parse_value,
)
from yolo_func.configs.registry import FLAGS, RECIPES, build_config, default_config, get_recipe, load_config_file

__all__ = [
    "Config",
    "ModelConfig",
    "DataConfig",
    "AugmentConfig",
    "OptimConfig",
    "LossConfig",
    "ValConfig",
    "TrainConfig",
    "FieldInfo",
    "SCALES",
    "TASKS",
    "RECIPES",
    "FLAGS",
    "recipe",
    "recipe_name",
    "get_recipe",
    "default_config",
    "build_config",
    "load_config_file",
    "apply_overrides",
    "parse_value",
    "format_value",
    "did_you_mean",
    "config_keys",
    "field_info",
    "config_to_dict",
    "config_from_dict",
    "config_to_json",
    "config_from_json",
    "config_diff",
]
