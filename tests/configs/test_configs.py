"""Configs: recipes, the reference defaults, strict overrides, the JSON round trip."""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
import re
from typing import Literal, get_args, get_origin

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from yolo_func.configs import (
    FLAGS,
    RECIPES,
    Config,
    ModelConfig,
    apply_overrides,
    build_config,
    config_diff,
    config_from_dict,
    config_from_json,
    config_keys,
    config_to_dict,
    config_to_json,
    default_config,
    field_info,
    format_value,
    get_recipe,
    parse_value,
)
from yolo_func.configs.base import _is_optional

# REFERENCE.md §4.1-4.6 and §3.1, typed out by hand (an independent copy of the defaults).
REFERENCE_DEFAULTS = {
    "data.image_size": 640, "data.batch_size": 16, "train.epochs": 100, "train.seed": 0, "train.patience": 100,
    "optim.lr0": 0.01, "optim.lrf": 0.01, "optim.momentum": 0.937, "optim.weight_decay": 5e-4,
    "optim.warmup_epochs": 3.0, "optim.warmup_momentum": 0.8, "optim.warmup_bias_lr": 0.1, "optim.nbs": 64,
    "optim.cos_lr": False, "optim.optimizer": "SGD", "optim.max_norm": 10.0, "optim.ema_decay": 0.9999, "optim.ema_tau": 2000.0,
    "loss.box": 7.5, "loss.cls": 0.5, "loss.dfl": 1.5, "loss.pose": 12.0, "loss.kobj": 1.0,
    "data.augment.mosaic": 1.0, "data.augment.translate": 0.1, "data.augment.scale": 0.5, "data.augment.degrees": 0.0,
    "data.augment.shear": 0.0, "data.augment.perspective": 0.0, "data.augment.hsv_h": 0.015, "data.augment.hsv_s": 0.7,
    "data.augment.hsv_v": 0.4, "data.augment.fliplr": 0.5, "data.augment.flipud": 0.0, "data.augment.close_mosaic": 10,
    "val.conf": 0.001, "val.iou": 0.7, "val.max_det": 300,
}


def _get(config, key):
    for part in key.split("."):
        config = getattr(config, part)
    return config


def test_defaults_are_the_reference_defaults():
    cfg = Config()
    got = {k: _get(cfg, k) for k in REFERENCE_DEFAULTS}
    assert got == REFERENCE_DEFAULTS
    assert {type(v) for k, v in got.items()} == {type(v) for v in REFERENCE_DEFAULTS.values()}


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_every_recipe_builds_and_documents_its_command(name):
    cfg = get_recipe(name)
    assert isinstance(cfg, Config)
    doc = importlib.import_module(RECIPES[name]).__doc__
    assert "yolo-func train" in doc
    m = re.fullmatch(r"yolov8([nsmlx])(-seg|-pose)?", name)
    if m is None:  # the built-in defaults: yolov8n detection on the built-in data
        assert (cfg.model.scale, cfg.model.task, cfg.data.path) == ("n", "detect", "builtin")
        return
    task = {None: "detect", "-seg": "segment", "-pose": "pose"}[m.group(2)]
    assert (cfg.model.scale, cfg.model.task) == (m.group(1), task)
    assert f"--model {name} " in doc
    # A recipe is the reference's default.yaml with its model: nothing else differs.
    assert set(config_diff(Config(), cfg)) <= {"model.scale", "model.task"}


def test_builtin_defaults_cpu_is_small_gpu_is_640_with_replay():
    cpu, gpu = get_recipe("builtin-cpu"), get_recipe("builtin-gpu")
    assert cpu.train.device == "cpu" and cpu.train.capture == "none" and cpu.data.image_size < 640
    assert cpu.train.time_limit_hours is not None and cpu.train.time_limit_hours * 60 < 10  # the 10-minute budget
    assert gpu.train.device == "cuda" and gpu.data.image_size == 640 and gpu.train.capture == "auto"
    assert default_config("cpu") == cpu
    assert default_config("cuda:1").train.device == "cuda:1" and default_config("cuda:1").data.image_size == 640


def test_recipe_names_accept_the_yaml_spelling_and_suggest_close_names():
    assert get_recipe("yolov8m-pose.yaml") == get_recipe("yolov8m-pose")
    with pytest.raises(ValueError, match=r"unknown recipe 'yolov8s_seg'; did you mean 'yolov8s-seg'"):
        get_recipe("yolov8s_seg")
    with pytest.raises(ValueError, match=r"a \.pt file is weights"):
        get_recipe("yolov8n.pt")


def test_did_you_mean_for_unknown_keys():
    cfg = Config()
    with pytest.raises(ValueError) as e:
        apply_overrides(cfg, ["optim.lrr=0.02"])
    assert str(e.value) == "[yolo_func] unknown config key 'optim.lrr'; did you mean 'optim.lr0'?"
    for typo, meant in [("lr0", "optim.lr0"), ("mosiac", "data.augment.mosaic"), ("train.epoch", "train.epochs"),
                        ("data.agument.fliplr", "data.augment.fliplr")]:
        with pytest.raises(ValueError, match=re.escape(f"unknown config key {typo!r}; did you mean {meant!r}?")):
            apply_overrides(cfg, [f"{typo}=1"])
    with pytest.raises(ValueError, match=r"unknown config key 'zzz'; the keys are listed"):
        apply_overrides(cfg, ["zzz=1"])
    with pytest.raises(ValueError, match=r"'optim' is a section, not an option; set one of its keys \(optim.optimizer, optim.lr0"):
        apply_overrides(cfg, ["optim=1"])
    with pytest.raises(ValueError, match=r"'optim.lr0' is not 'key=value'"):
        apply_overrides(cfg, ["optim.lr0"])
    with pytest.raises(TypeError, match=r"expects a list of 'key=value' strings; got the string 'optim.lr0=1': wrap it in a list"):
        apply_overrides(cfg, "optim.lr0=1")


@pytest.mark.parametrize("override, key, expected", [
    ("train.epochs=300", "train.epochs", 300),                         # int
    ("optim.lr0=0.02", "optim.lr0", 0.02),                             # float
    ("optim.lr0=1", "optim.lr0", 1.0),                                  # an int for a float
    ("optim.weight_decay=1e-4", "optim.weight_decay", 1e-4),
    ("optim.cos_lr=true", "optim.cos_lr", True),                        # bool
    ("train.plots=No", "train.plots", False),
    ("data.path=/data/coco", "data.path", "/data/coco"),               # str
    ("data.path='/data/my coco'", "data.path", "/data/my coco"),
    ("model.num_classes=3", "model.num_classes", 3),                   # Optional[int]
    ("model.weights=none", "model.weights", None),                      # Optional[str]
    ("train.time_limit_hours=0.5", "train.time_limit_hours", 0.5),      # Optional[float]
    ("model.kpt_shape=5,2", "model.kpt_shape", (5, 2)),                 # tuple
    ("model.kpt_shape=[4, 3]", "model.kpt_shape", (4, 3)),
    ("model.kpt_shape=(17,3)", "model.kpt_shape", (17, 3)),
    ("model.task=segment", "model.task", "segment"),                    # Literal
    ("train.capture=network+heads", "train.capture", "network+heads"),
    ("val.precision=fp16", "val.precision", "fp16"),
    ("train.device=cuda:1", "train.device", "cuda:1"),                  # str with a pattern
])
def test_overrides_of_every_type(override, key, expected):
    cfg = apply_overrides(Config(), [override])
    value = _get(cfg, key)
    assert value == expected and type(value) is type(expected)
    assert set(config_diff(Config(), cfg)) <= {key}


def test_overrides_from_a_mapping_and_last_one_wins():
    cfg = apply_overrides(Config(), {"data.batch_size": 4, "optim.lr0": "0.5", "model.weights": None})
    assert (cfg.data.batch_size, cfg.optim.lr0, cfg.model.weights) == (4, 0.5, None)
    assert apply_overrides(Config(), ["train.epochs=3", "train.epochs=5"]).train.epochs == 5


@pytest.mark.parametrize("override, error, message", [
    ("data.batch_size=16.5", ValueError, "config key 'data.batch_size' expects int; got '16.5'"),
    ("data.batch_size=abc", ValueError, "config key 'data.batch_size' expects int; got 'abc'"),
    ("optim.lr0=fast", ValueError, "config key 'optim.lr0' expects float; got 'fast'"),
    ("optim.cos_lr=maybe", ValueError, "config key 'optim.cos_lr' expects bool (true/false); got 'maybe'"),
    ("model.scale=q", ValueError, "config key 'model.scale' expects one of 'n', 's', 'm', 'l', 'x'; got 'q'"),
    ("model.task=segmnet", ValueError, "got 'segmnet'; did you mean 'segment'?"),
    ("model.kpt_shape=17", ValueError, "expects tuple[int, int] (2 comma-separated items); got '17'"),
    ("model.kpt_shape=17,4", ValueError, "expects (P, D) with D 2 or 3; got (17, 4)"),
    ("data.image_size=100", ValueError, "config key 'data.image_size' expects a multiple of 32; got 100"),
    ("data.augment.fliplr=1.5", ValueError, "config key 'data.augment.fliplr' expects a value <= 1.0; got 1.5"),
    ("optim.lr0=nan", ValueError, "config key 'optim.lr0' expects a finite number; got nan"),
    ("train.device=gpu", ValueError, "config key 'train.device' expects a string matching"),
    ("train.epochs=none", ValueError, "config key 'train.epochs' expects int; got 'none'"),
])
def test_type_and_bound_violations_are_rejected(override, error, message):
    with pytest.raises(error, match=re.escape("[yolo_func] " + message) if message.startswith("config") else re.escape(message)):
        apply_overrides(Config(), [override])


def test_python_values_of_the_wrong_type_are_rejected():
    with pytest.raises(TypeError, match=r"config key 'data.batch_size' expects int; got True \(bool\)"):
        apply_overrides(Config(), {"data.batch_size": True})
    with pytest.raises(TypeError, match=r"config key 'optim.lr0' expects float; got \[0.1\] \(list\)"):
        apply_overrides(Config(), {"optim.lr0": [0.1]})
    with pytest.raises(ValueError, match=r"config key 'model.scale' expects one of"):
        ModelConfig(scale="q")
    with pytest.raises(TypeError, match=r"config key 'train.epochs' expects int; got None"):
        apply_overrides(Config(), {"train.epochs": None})
    with pytest.raises(dataclasses.FrozenInstanceError):
        Config().optim.lr0 = 0.1  # type: ignore[misc]


def test_config_from_dict_names_the_file_and_fills_missing_keys():
    data = config_to_dict(Config())
    data["optim"]["lrr"] = 0.1
    with pytest.raises(ValueError, match=r"^\[yolo_func\] runs/x/config.json: unknown config key 'optim.lrr'; did you mean 'optim.lr0'\?"):
        config_from_dict(data, source="runs/x/config.json")
    with pytest.raises(TypeError, match=r"runs/x/config.json: config section 'optim' must be a JSON object; got list"):
        config_from_dict({"optim": [1]}, source="runs/x/config.json")
    with pytest.raises(TypeError, match=r"c.json: config key 'train.epochs' expects int; got '3' \(str\)"):
        config_from_dict({"train": {"epochs": "3"}}, source="c.json")
    with pytest.raises(ValueError, match=r"c.json: config key 'model.kpt_shape' expects \(P, D\) with D 2 or 3"):
        config_from_dict({"model": {"kpt_shape": [17, 5]}}, source="c.json")
    with pytest.raises(ValueError, match=r"c.json is not valid JSON"):
        config_from_json("{", source="c.json")
    partial = config_from_dict({"optim": {"lr0": 0.5}})  # an older config.json: the rest takes defaults
    assert partial == apply_overrides(Config(), ["optim.lr0=0.5"])


def test_json_is_plain_and_round_trips():
    cfg = apply_overrides(get_recipe("yolov8s-pose"), ["model.kpt_shape=5,2", "train.out=/tmp/r"])
    text = config_to_json(cfg)
    data = json.loads(text)
    assert data["model"]["kpt_shape"] == [5, 2] and data["data"]["augment"]["mosaic"] == 1.0
    assert config_from_json(text) == cfg


def test_flags_map_to_keys_and_unknown_flags_are_named():
    cfg = build_config("yolov8s-seg", flags={"data": "/data/coco", "epochs": 7, "batch": 8, "imgsz": 320, "device": "cpu",
                                              "weights": "w.pt", "out": "runs/o", "images": None},
                       overrides=["optim.lr0=0.02"])
    assert (cfg.model.scale, cfg.model.task, cfg.data.path, cfg.train.epochs, cfg.data.batch_size, cfg.data.image_size,
            cfg.train.device, cfg.model.weights, cfg.train.out, cfg.optim.lr0) == (
        "s", "segment", "/data/coco", 7, 8, 320, "cpu", "w.pt", "runs/o", 0.02)
    assert set(FLAGS.values()) <= set(config_keys())
    assert build_config(flags={"device": "cpu"}) == get_recipe("builtin-cpu")
    with pytest.raises(ValueError, match=r"unknown flag '--imgs'; did you mean '--imgsz'\?"):
        build_config(flags={"imgs": 320})


# ---------------------------------------------------------------------------------------- properties


def _values(info) -> st.SearchStrategy:
    """Valid values of one option, from its type and bounds (independent of the parser)."""
    optional, tp = _is_optional(info.type)
    meta = info.meta
    if info.key == "model.kpt_shape":
        inner = st.tuples(st.integers(1, 64), st.sampled_from([2, 3]))
    elif get_origin(tp) is Literal:
        inner = st.sampled_from(get_args(tp))
    elif tp is bool:
        inner = st.booleans()
    elif tp is int:
        lo = meta["ge"] if meta["ge"] is not None else (meta["gt"] + 1 if meta["gt"] is not None else -1000)
        m = meta["multiple_of"] or 1
        inner = st.integers(math.ceil(lo / m), 10_000 // m).map(lambda k: k * m)
    elif tp is float:
        lo = meta["ge"] if meta["ge"] is not None else meta["gt"]
        hi = meta["le"] if meta["le"] is not None else (meta["lt"] if meta["lt"] is not None else 1e6)
        inner = st.floats(lo if lo is not None else -1e6, hi, exclude_min=meta["gt"] is not None,
                          exclude_max=meta["lt"] is not None and meta["le"] is None, allow_nan=False)
    elif info.key == "train.device":
        inner = st.sampled_from(["auto", "cpu", "cuda", "cuda:0", "cuda:3"])
    elif tp is str and meta["pattern"] is not None:  # e.g. train.name: no "/" or spaces
        inner = st.from_regex(r"[A-Za-z0-9_.+-]{1,22}", fullmatch=True).filter(meta["pattern"].match)
    elif tp is str:
        inner = st.from_regex(r"[A-Za-z0-9_.+-][A-Za-z0-9_./+ -]{0,20}[A-Za-z0-9_.+-]", fullmatch=True)
    else:
        raise AssertionError(f"no strategy for {info.key}: {info.type}")
    return st.one_of(st.none(), inner) if optional else inner


_INFOS = {i.key: i for i in field_info()}


@st.composite
def _overrides(draw):
    keys = draw(st.lists(st.sampled_from(sorted(_INFOS)), unique=True, max_size=8))
    return {k: draw(_values(_INFOS[k])) for k in keys}


@settings(parent=settings.get_profile("ci"))
@given(values=_overrides())
def test_overrides_parse_back_what_was_formatted_and_json_round_trips(values):
    cfg = apply_overrides(Config(), [f"{k}={format_value(v)}" for k, v in values.items()])
    for k, v in values.items():
        got = _get(cfg, k)
        assert got == v and type(got) is type(v), (k, v, got)
    assert set(config_diff(Config(), cfg)) <= set(values)
    assert apply_overrides(Config(), values) == cfg  # typed values give the same config
    assert config_from_json(config_to_json(cfg)) == cfg
    assert config_from_dict(json.loads(json.dumps(config_to_dict(cfg)))) == cfg


@settings(parent=settings.get_profile("ci"))
@given(key=st.sampled_from(sorted(_INFOS)), text=st.text(min_size=1, max_size=12))
def test_parsing_either_gives_a_valid_value_or_a_message_naming_the_key(key, text):
    info = _INFOS[key]
    try:
        cfg = apply_overrides(Config(), [f"{key}={text}"])
    except (ValueError, TypeError) as e:
        assert str(e).startswith("[yolo_func] ") and repr(key) in str(e)
        return
    value = _get(cfg, key)
    assert parse_value(key, info.type, format_value(value)) == value


def test_config_file_py_and_json_then_flags_and_overrides(tmp_path):
    """``--config``: a Python file with get_config() or a run's config.json replaces the recipe;
    flags and overrides still apply on top; bad files are named."""
    from yolo_func.configs import build_config, config_to_json, get_recipe, load_config_file

    py = tmp_path / "my_recipe.py"
    py.write_text("from yolo_func.configs import apply_overrides, get_recipe\n"
                  "def get_config():\n    return apply_overrides(get_recipe('yolov8s-seg'), ['optim.lr0=0.02'])\n")
    cfg = build_config(config_file=py, flags={"epochs": 3}, overrides=["optim.momentum=0.9"])
    assert (cfg.model.scale, cfg.model.task) == ("s", "segment")
    assert (cfg.optim.lr0, cfg.optim.momentum, cfg.train.epochs) == (0.02, 0.9, 3)
    js = tmp_path / "config.json"
    js.write_text(config_to_json(cfg))
    assert load_config_file(js) == cfg
    assert load_config_file(js) != get_recipe("yolov8s-seg")
    with pytest.raises(ValueError, match="not both"):
        build_config("yolov8n", config_file=py)
    with pytest.raises(FileNotFoundError, match="missing.py"):
        load_config_file(tmp_path / "missing.py")
    (tmp_path / "c.yaml").write_text("a: 1")
    with pytest.raises(ValueError, match=r"c\.yaml.*expected a \.py file"):
        load_config_file(tmp_path / "c.yaml")
    (tmp_path / "nothing.py").write_text("x = 1\n")
    with pytest.raises(ValueError, match=r"nothing\.py' defines no get_config"):
        load_config_file(tmp_path / "nothing.py")
