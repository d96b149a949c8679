"""The fit loop on the CPU: the run folder, bitwise resume, Ctrl-C, the time limit, early stopping.

Tiny runs: 8 built-in training images (4 validation), 64 px, batch 4 (2 steps per epoch),
loading in the main process.
"""

from __future__ import annotations

import csv
import hashlib
import importlib
import json
import os
import signal

import pytest
import torch

from yolo_func.configs import build_config, config_from_json
from yolo_func.data import builtin_dataset
from yolo_func.testing import assert_trees_all_equal
from yolo_func.train import DataPosition, fit, load_training_checkpoint, read_training_checkpoint
from yolo_func.train.run_dir import results_columns

N_TRAIN, N_VAL, BATCH, IMGSZ = 8, 4, 4, 64
STEPS_PER_EPOCH = N_TRAIN // BATCH


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("builtin")
    return (builtin_dataset("detect", "train", root=root, num_images=N_TRAIN),
            builtin_dataset("detect", "val", root=root, num_images=N_VAL))


def _config(out, *, epochs=2, extra=()):
    return build_config("yolov8n", flags={"imgsz": IMGSZ, "batch": BATCH, "epochs": epochs, "out": str(out), "device": "cpu"},
                        overrides=["data.workers=0", "train.plots=false", *extra])


def _digest(batch) -> str:
    h = hashlib.sha256(batch.images.numpy().tobytes())
    for t in batch.targets:
        if t is not None:
            h.update(t.numpy().tobytes())
    return h.hexdigest()


def _fit(cfg, data, **kw):
    return fit(cfg, train_data=data[0], val_data=data[1], progress=False, **kw)


@pytest.mark.slow
def test_fit_writes_the_run_folder(tmp_path, data):
    out = tmp_path / "run"
    cfg = _config(out, extra=["train.plots=true"])
    seen = []
    result = _fit(cfg, data, on_step=lambda info: seen.append((info.epoch, info.batch_index, info.step)))
    assert result.stopped == "completed" and result.epochs_done == 2
    assert seen == [(e, b, e * STEPS_PER_EPOCH + b + 1) for e in range(2) for b in range(STEPS_PER_EPOCH)]
    assert result.steps == int(result.train_state.step) == 2 * STEPS_PER_EPOCH
    for name in ("config.json", "results.csv", "events.jsonl", "weights/last.pt", "weights/best.pt",
                 "results.png", "train_batch0.png", "val_predictions.png"):
        assert (out / name).is_file(), name
    saved = config_from_json((out / "config.json").read_text())
    assert (saved.model.num_classes, saved.data.image_size, saved.data.batch_size) == (5, IMGSZ, BATCH)  # 5 shapes
    with open(out / "results.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert tuple(rows[0]) == results_columns("detect")
    assert [r["epoch"] for r in rows] == ["1", "2"]
    for r in rows:  # every cell known: validation ran each epoch (val_every 1)
        assert all(v != "" for v in r.values()), r
        assert float(r["fitness"]) == float(r["box/mAP50-95"])
    kinds = [json.loads(line)["event"] for line in (out / "events.jsonl").read_text().splitlines()]
    # the background pycocotools evaluations (val.coco auto: built-in data) log "coco" when they end: after
    # their epoch's "epoch" event, before "end"
    assert [k for k in kinds if k != "coco"] == ["start", "epoch", "checkpoint", "epoch", "checkpoint", "end"]
    epoch_at = [i for i, k in enumerate(kinds) if k == "epoch"]
    coco_at = [i for i, k in enumerate(kinds) if k == "coco"]
    assert len(coco_at) == 2 and epoch_at[0] < coco_at[0] and epoch_at[1] < coco_at[1] < len(kinds) - 1
    assert (out / "coco.csv").is_file()
    # last.pt holds the final state and the position of the next epoch
    ck = load_training_checkpoint(out / "weights" / "last.pt", result.train_state)
    assert ck.position == DataPosition(2, 0, 0)
    assert_trees_all_equal(ck.train_state, result.train_state)


@pytest.mark.slow
def test_ctrl_c_saves_and_a_resumed_run_equals_an_uninterrupted_one(tmp_path, data):
    k = 3  # interrupt after step 3: in the middle of epoch 2 (2 steps per epoch)
    whole = []
    a = _fit(_config(tmp_path / "a"), data, on_step=lambda i: whole.append(_digest(i.batch)))

    def ctrl_c(info):
        if info.step == k:
            os.kill(os.getpid(), signal.SIGINT)  # a real SIGINT: the step finishes, last.pt is saved

    b1 = _fit(_config(tmp_path / "b"), data, on_step=ctrl_c)
    assert b1.stopped == "interrupted" and b1.steps == k
    _, position, _ = read_training_checkpoint(tmp_path / "b" / "weights" / "last.pt")
    assert position == DataPosition(1, 1, 0)
    events = [json.loads(line) for line in (tmp_path / "b" / "events.jsonl").read_text().splitlines()]
    interrupts = [e for e in events if e["event"] == "interrupt"]  # epoch 1's COCO score may land after it
    assert len(interrupts) == 1 and (interrupts[0]["epoch"], interrupts[0]["batch"]) == (1, 1)
    assert events[-1]["event"] == "end" and events[-1]["stopped"] == "interrupted"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handler restored

    rest = []
    b2 = _fit(_config(tmp_path / "b"), data, on_step=lambda i: rest.append(_digest(i.batch)))
    assert b2.stopped == "completed" and b2.steps == a.steps == 2 * STEPS_PER_EPOCH
    assert rest == whole[k:]  # the next batches are the uninterrupted run's
    assert_trees_all_equal(b2.train_state, a.train_state)  # every leaf, bitwise
    with open(tmp_path / "b" / "results.csv", newline="") as f:
        assert [r["epoch"] for r in csv.DictReader(f)] == ["1", "2"]


def test_a_hook_raising_keyboard_interrupt_leaves_a_resumable_checkpoint(tmp_path, data):
    def stop(info):
        if info.step == 1:
            raise KeyboardInterrupt

    r = _fit(_config(tmp_path / "run"), data, on_step=stop)
    assert r.stopped == "interrupted" and r.steps == 1
    template = r.train_state
    ck = load_training_checkpoint(tmp_path / "run" / "weights" / "last.pt", template)
    assert ck.position == DataPosition(0, 1, 0)
    assert int(ck.train_state.step) == 1
    assert_trees_all_equal(ck.train_state, r.train_state)


def test_time_limit_stops_saves_and_validates(tmp_path, data):
    r = _fit(_config(tmp_path / "run", epochs=3, extra=["train.time_limit_hours=1e-9"]), data)
    assert r.stopped == "time_limit" and r.steps == 1 and r.epochs_done == 0
    with open(tmp_path / "run" / "results.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 1 and rows[0]["box/mAP50"] != ""  # the partial epoch was validated
    _, position, _ = read_training_checkpoint(tmp_path / "run" / "weights" / "last.pt")
    assert position == DataPosition(0, 1, 0)


def test_early_stopping_after_patience_epochs_without_a_better_fitness(tmp_path, data):
    # val.conf = 0.99999: no detection of a barely trained model passes, every fitness is exactly 0, so epoch 1 stays the best
    # (the first fitness is a best; equal ones are not) and patience 1 stops after epoch 2.
    r = _fit(_config(tmp_path / "run", epochs=5, extra=["train.patience=1", "val.conf=0.99999"]), data)
    assert r.stopped == "early_stop" and r.epochs_done == 2 and r.steps == 2 * STEPS_PER_EPOCH
    assert r.best["epoch"] == 1 and r.best["fitness"] == 0.0
    with open(tmp_path / "run" / "results.csv", newline="") as f:
        assert [float(x["fitness"]) for x in csv.DictReader(f)] == [0.0, 0.0]


def test_weights_with_another_class_count_reinitialise_the_heads(tmp_path, data, capsys):
    first = _fit(_config(tmp_path / "a", epochs=1), data)
    best = tmp_path / "a" / "weights" / "best.pt"
    from yolo_func.train.fit import build_model

    cfg = build_config("yolov8n", overrides=[f"model.weights={best}", "model.num_classes=7"])
    gen = torch.Generator().manual_seed(0)
    model, params, state = build_model(cfg, gen)
    assert "head(s) ['detect'] re-initialised" in capsys.readouterr().out
    ema = first.train_state.ema.ema
    assert_trees_all_equal(params["network"], ema["params"]["network"])  # the EMA weights of best.pt
    assert_trees_all_equal(state["network"], ema["state"]["network"])
    fresh, _ = model.init(torch.Generator().manual_seed(0))
    assert_trees_all_equal(params["heads"], fresh["heads"])


# ------------------------------------------------------------------------------------------ CUDA


def test_the_cpu_is_always_eager_and_cuda_auto_picks_step():
    from yolo_func import yolov8
    from yolo_func.train.fit import resolve_capture

    model = yolov8("n", task="segment")
    assert resolve_capture("step", model, torch.device("cpu")) == "none"
    assert resolve_capture("auto", model, torch.device("cuda")) == "step"  # every built-in head is capturable
    assert resolve_capture("network", model, torch.device("cuda")) == "network"
    heads = dict(model.heads)
    heads["segment"] = heads["segment"]._replace(capturable=False)
    assert resolve_capture("auto", model.with_heads(heads), torch.device("cuda")) == "network"


@pytest.mark.cuda
@pytest.mark.parametrize("capture", ["auto", "network"])
def test_fit_on_cuda_replays_without_falling_back(tmp_path, data, capture):
    import warnings

    from yolo_func.train.replay import CaptureFallbackWarning

    cfg = build_config("yolov8n", flags={"imgsz": IMGSZ, "batch": BATCH, "epochs": 2, "out": str(tmp_path / "run"),
                                         "device": "cuda"}, overrides=["data.workers=0", f"train.capture={capture}"])
    with warnings.catch_warnings():
        warnings.simplefilter("error", CaptureFallbackWarning)  # a fallback to eager fails the test
        r = _fit(cfg, data)
    assert r.stopped == "completed" and r.steps == 2 * STEPS_PER_EPOCH
    assert r.train_state.step.device.type == "cuda" and int(r.train_state.step) == r.steps
    assert r.metrics is not None and 0.0 <= r.metrics["box"]["mAP50"] <= 1.0
    assert (tmp_path / "run" / "weights" / "best.pt").is_file() and (tmp_path / "run" / "results.png").is_file()


@pytest.mark.cuda
def test_fit_on_cuda_resumed_equals_uninterrupted(tmp_path, data):
    def cfg(name):
        return build_config("yolov8n", flags={"imgsz": IMGSZ, "batch": BATCH, "epochs": 2, "out": str(tmp_path / name),
                                              "device": "cuda"}, overrides=["data.workers=0", "train.plots=false"])

    a = _fit(cfg("a"), data)

    def stop(info):
        if info.step == 3:
            raise KeyboardInterrupt

    assert _fit(cfg("b"), data, on_step=stop).stopped == "interrupted"
    b = _fit(cfg("b"), data)
    assert b.stopped == "completed" and b.steps == a.steps
    assert_trees_all_equal(b.train_state, a.train_state)


@pytest.mark.cuda
def test_fit_on_cuda_with_the_warmup_thread_equals_one_without(tmp_path, data, monkeypatch):
    from yolo_func.train.cuda_warm import ENV, start_cuda_warmup

    fit_module = importlib.import_module("yolo_func.train.fit")  # the module, not the package's fit function

    started = []

    def recording(*a, **k):
        w = start_cuda_warmup(*a, **k)
        started.append(w)
        return w

    monkeypatch.setattr(fit_module, "start_cuda_warmup", recording)

    def run(name, on):
        monkeypatch.setenv(ENV, "1" if on else "0")
        cfg = build_config("yolov8n", flags={"imgsz": IMGSZ, "batch": BATCH, "epochs": 1, "out": str(tmp_path / name),
                                             "device": "cuda"}, overrides=["data.workers=0", "train.plots=false"])
        return _fit(cfg, data)

    off, on = run("off", False), run("on", True)
    assert started[0] is None  # switched off: no thread
    assert started[1] is not None and started[1].seconds is not None and started[1].error is None  # it really ran
    assert_trees_all_equal(on.train_state, off.train_state)


def test_load_datasets_reads_every_data_layout(tmp_path, data):
    import shutil

    from yolo_func.data.yolo import write_yolo_dataset
    from yolo_func.train.fit import load_datasets

    train, val = data
    split_dir = {"train": train.annotations_path.parent, "val": val.annotations_path.parent}

    def sizes(path, images=None):
        cfg = build_config("yolov8n", flags={"data": str(path), "images": images})
        a, b = load_datasets(cfg)
        return len(a), len(b)

    # one annotations.json + images/ (a folder, or the JSON itself): trained and validated on
    assert sizes(split_dir["train"]) == (N_TRAIN, N_TRAIN)
    assert sizes(train.annotations_path) == (N_TRAIN, N_TRAIN)
    assert sizes(train.annotations_path, images=str(split_dir["train"] / "images")) == (N_TRAIN, N_TRAIN)
    # train/ and val/ folders
    two = tmp_path / "two"
    for s, d in split_dir.items():
        shutil.copytree(d, two / s)
    assert sizes(two) == (N_TRAIN, N_VAL)
    # COCO's own layout: annotations/instances_{train,val}2017.json and train2017/, val2017/
    coco = tmp_path / "coco"
    (coco / "annotations").mkdir(parents=True)
    for s, d in split_dir.items():
        shutil.copy(d / "annotations.json", coco / "annotations" / f"instances_{s}2017.json")
        shutil.copytree(d / "images", coco / f"{s}2017")
    assert sizes(coco) == (N_TRAIN, N_VAL)
    # a YOLO data.yaml (the file or its folder)
    yaml = write_yolo_dataset({"train": train, "val": val}, tmp_path / "yolo")
    assert sizes(yaml) == (N_TRAIN, N_VAL)
    assert sizes(yaml.parent) == (N_TRAIN, N_VAL)
    with pytest.raises(ValueError, match=r"\[yolo_func\] data.path '.*nowhere' does not exist"):
        sizes(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"is not a dataset: expected a folder with annotations/instances_"):
        sizes(tmp_path / "empty")


class _Oracle:
    """A stand-in model whose ``predict`` returns each validation batch's ground truth as the
    inference output (score 0.9, keypoint confidence 1): validation must then score the metric's
    maximum, 0.995 (the reference's AP: the trapezoid over 101 recall points of a precision
    envelope that is 1 up to recall 1 and drops to 0 at the sentinel, i.e. 1 - 0.01 / 2)."""

    def __init__(self, task, loader, num_classes):
        self.task, self.num_classes = task, num_classes
        self.batches = [vb.targets for vb in loader]  # the loader's order is fixed (aspect ratios)

    def predict(self, params, state, images):
        from yolo_func.models.yolov8 import Inference

        t = self.batches.pop(0)
        B, M = t.valid.shape
        xy = (t.boxes[..., :2] + t.boxes[..., 2:]) / 2
        wh = t.boxes[..., 2:] - t.boxes[..., :2]
        scores = torch.nn.functional.one_hot(t.classes, self.num_classes).float() * 0.9 * t.valid[..., None]
        chans = [xy, wh, scores]
        if t.keypoints is not None:
            k = t.keypoints.clone()
            k[..., 2] = 1.0
            chans.append(k.flatten(2))
        return Inference(torch.cat(chans, -1).transpose(1, 2).contiguous())


@pytest.mark.parametrize("task", ["detect", "pose"])
def test_validate_scores_the_ground_truth_as_perfect(tmp_path, task):
    from yolo_func.data import ValLoader
    from yolo_func.train.fit import validate

    ds = builtin_dataset(task, "val", root=tmp_path, num_images=6)
    loader = ValLoader(ds, batch_size=4, image_size=IMGSZ * 2, workers=0, shapes=ds.image_sizes)
    cfg = build_config(f"yolov8n{'-pose' if task == 'pose' else ''}", flags={"imgsz": IMGSZ * 2})
    m = validate(_Oracle(task, loader, len(ds.names)), None, None, loader, ds, config=cfg, device=torch.device("cpu"),
                 progress=False)
    assert m["box"]["mAP50"] == pytest.approx(0.995) and m["box"]["mAP50-95"] == pytest.approx(0.995)
    if task == "pose":
        assert m["pose"]["mAP50"] == pytest.approx(0.995) and m["pose"]["mAP50-95"] == pytest.approx(0.995)
        assert m["fitness"] == pytest.approx(2 * 0.995)


def test_reference_weights_start_the_network_and_the_matching_heads(tmp_path, capsys):
    import importlib.util
    from pathlib import Path

    from yolo_func import yolov8
    from yolo_func.io import to_reference
    from yolo_func.train.fit import build_model

    spec = importlib.util.spec_from_file_location("reference_files", Path(__file__).parents[1] / "io" / "reference_files.py")
    ref_files = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ref_files)
    src = yolov8("n", task="segment", num_classes=5)
    params, state = src.init(torch.Generator().manual_seed(7))
    pt = ref_files.write_reference_checkpoint(tmp_path / "ref.pt", to_reference(src, params, state), task="segment",
                                              names=[f"c{i}" for i in range(5)], half=False)
    # same classes: every head from the file
    cfg = build_config("yolov8n-seg", overrides=[f"model.weights={pt}", "model.num_classes=5"])
    _, p, s = build_model(cfg, torch.Generator().manual_seed(0))
    assert "re-initialised" not in capsys.readouterr().out
    assert_trees_all_equal(p, params)
    assert_trees_all_equal(s, state)
    # 3 classes: the detect head is re-initialised, the segment head (no class channels) kept
    cfg = build_config("yolov8n-seg", overrides=[f"model.weights={pt}", "model.num_classes=3"])
    model, p, s = build_model(cfg, torch.Generator().manual_seed(0))
    assert "head(s) ['detect'] re-initialised" in capsys.readouterr().out
    fresh, _ = model.init(torch.Generator().manual_seed(0))
    assert_trees_all_equal(p["network"], params["network"])
    assert_trees_all_equal(p["heads"]["segment"], params["heads"]["segment"])
    assert_trees_all_equal(p["heads"]["detect"], fresh["heads"]["detect"])


@pytest.mark.parametrize("task", ["segment", "pose"])
def test_segment_and_pose_fits_validate_their_own_metric(tmp_path, task):
    root = tmp_path / "data"
    tr, va = (builtin_dataset(task, "train", root=root, num_images=N_TRAIN),
              builtin_dataset(task, "val", root=root, num_images=N_VAL))
    name = {"segment": "yolov8n-seg", "pose": "yolov8n-pose"}[task]
    cfg = build_config(name, flags={"imgsz": IMGSZ, "batch": BATCH, "epochs": 1, "out": str(tmp_path / "run"), "device": "cpu"},
                       overrides=["data.workers=0", "train.plots=false"])
    r = fit(cfg, train_data=tr, val_data=va, progress=False)
    kind = {"segment": "mask", "pose": "pose"}[task]
    assert r.stopped == "completed" and set(r.metrics) >= {"box", kind, "fitness"}
    assert r.metrics["fitness"] == pytest.approx(r.metrics["box"]["mAP50-95"] + r.metrics[kind]["mAP50-95"])
    with open(tmp_path / "run" / "results.csv", newline="") as f:
        (row,) = list(csv.DictReader(f))
    assert tuple(row) == results_columns(task)
    assert float(row[f"{kind}/mAP50"]) == pytest.approx(r.metrics[kind]["mAP50"])
    assert all(v != "" for v in row.values())


def test_validation_runs_under_val_precision_not_the_training_autocast(tmp_path, data, monkeypatch):
    """``val.precision`` picks the validation autocast (FP16 on CUDA by 'auto'; BF16 blurs high-IoU
    boxes), independently of ``train.autocast``: the spy sees it inside every validation."""
    fit_module = importlib.import_module("yolo_func.train.fit")  # the module, not the package's fit function
    seen = []
    real = fit_module.validate

    def spy(*args, autocast_dtype=None, **kw):
        seen.append(autocast_dtype)
        return real(*args, autocast_dtype=autocast_dtype, **kw)

    monkeypatch.setattr(fit_module, "validate", spy)
    _fit(_config(tmp_path / "bf16", epochs=1, extra=["val.precision=bf16", "val.coco=off"]), data)
    assert seen == [torch.bfloat16]
    seen.clear()
    _fit(_config(tmp_path / "auto", epochs=1, extra=["val.coco=off"]), data)
    assert seen == [None]  # 'auto' on the CPU: float32


def test_eval_autocast_rule_is_fp16_on_cuda_and_training_keeps_bf16():
    from yolo_func.func import autocast_dtype, eval_autocast_dtype

    assert eval_autocast_dtype("auto", "cuda") is torch.float16 and autocast_dtype("auto", "cuda") is torch.bfloat16
    assert eval_autocast_dtype("auto", torch.device("cpu")) is None
    assert [eval_autocast_dtype(n, "cuda") for n in ("bf16", "fp16", "fp32")] == [torch.bfloat16, torch.float16, None]
    with pytest.raises(ValueError, match="unknown precision 'half'"):
        eval_autocast_dtype("half", "cuda")
