"""pycocotools evaluation during a fit (``val.coco``): in a background thread while the next epoch
trains, equal to ``yolo_func.eval.evaluate`` on the same weights, failures reported, off when asked.

Tiny runs as in test_fit.py: 8 built-in training images (4 validation), 64 px, batch 4 (2 steps
per epoch), 2 epochs, validation after each.
"""

from __future__ import annotations

import csv
import json
import threading
import time

import pytest
import torch

from yolo_func import yolov8
from yolo_func.configs import build_config
from yolo_func.data import ValLoader, builtin_dataset
from yolo_func.eval import CocoEvaluator
from yolo_func.eval.coco_eval import BOX_KEYS, KEYPOINT_KEYS
from yolo_func.eval.evaluate import evaluate_with_records
from yolo_func.train import coco_background, fit
from yolo_func.train.run_dir import COCO_COLUMNS, RunDir

N_TRAIN, N_VAL, BATCH, IMGSZ = 8, 4, 4, 64
RECIPE = {"detect": "yolov8n", "segment": "yolov8n-seg", "pose": "yolov8n-pose"}


def _data(root, task):
    return (builtin_dataset(task, "train", root=root, num_images=N_TRAIN),
            builtin_dataset(task, "val", root=root, num_images=N_VAL))


def _config(out, task="detect", extra=()):
    return build_config(RECIPE[task], flags={"imgsz": IMGSZ, "batch": BATCH, "epochs": 2, "out": str(out), "device": "cpu"},
                        overrides=["data.workers=0", "train.plots=false", *extra])


def _events(out, kind):
    return [e for e in map(json.loads, (out / "events.jsonl").read_text().splitlines()) if e["event"] == kind]


def _zeros(iou_types):
    return {t: {k: 0.0 for k in (KEYPOINT_KEYS if t == "keypoints" else BOX_KEYS)} for t in iou_types}


@pytest.mark.slow
@pytest.mark.parametrize("task", ["detect", "segment", "pose"])
def test_each_validation_is_scored_by_pycocotools_as_evaluate_scores_it(tmp_path, task, monkeypatch):
    seen = []
    real = coco_background.evaluate_records

    def spy(gt, records, **kw):
        seen.append((list(records), kw))
        return real(gt, records, **kw)

    monkeypatch.setattr(coco_background, "evaluate_records", spy)
    train, val = _data(tmp_path / "data", task)
    out = tmp_path / "run"
    r = fit(_config(out, task), train_data=train, val_data=val, progress=False)
    assert r.stopped == "completed" and r.epochs_done == 2
    kinds = ["bbox"] + {"detect": [], "segment": ["segm"], "pose": ["keypoints"]}[task]
    # one coco event per validated epoch, and coco.csv rows for both
    events = _events(out, "coco")
    assert [e["epoch"] for e in events] == [1, 2] and all(set(kinds) <= set(e) for e in events)
    with open(out / "coco.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert tuple(rows[0]) == COCO_COLUMNS
    assert [(int(x["epoch"]), x["kind"]) for x in rows] == [(e, k) for e in (1, 2) for k in kinds]
    # the final EMA weights through yolo_func.eval.evaluate on the same val data: the same records
    # (boxes, scores, category ids, RLE masks, keypoints) and the same numbers. The fit validates
    # at batch 2 * 4 = 8: the 4 images are one rect batch in both.
    ema = r.train_state.ema.ema
    model = yolov8("n", task=task, num_classes=len(train.names))
    metrics, records = evaluate_with_records(model, ema["params"], ema["state"], val, image_size=IMGSZ, batch_size=2 * BATCH,
                                             device="cpu", workers=0, progress=False, verbose=False)
    metrics.pop("internal")
    assert len(records) > 0 and seen[-1][0] == records
    assert seen[-1][1] == {"image_ids": [int(i) for i in sorted(val.image_ids)], "iou_types": kinds}
    assert r.coco == metrics and events[-1][kinds[0]] == metrics[kinds[0]]
    summary = RunDir(out, task=task).summary()
    assert "COCO (pycocotools) of epoch 2" in summary and "coco.csv" in summary


def test_the_next_epoch_trains_while_the_previous_one_is_scored(tmp_path, monkeypatch):
    """Epoch 1's evaluation blocks until epoch 2 has trained a step (deterministic: no sleeps to
    race under load). A fit that waited for the evaluation before training on would never train
    that step: the evaluation's 60-s wait would run out and the overlap would read False."""
    spans = {}
    epoch_2_trained = threading.Event()

    def slow(gt, records, *, image_ids, iou_types):
        overlapped = epoch_2_trained.wait(timeout=60.0) if not spans else None
        spans[len(spans) + 1] = (overlapped, threading.current_thread() is threading.main_thread())
        return _zeros(iou_types)

    def on_step(info):
        if info.epoch == 1:  # 0-based: the second epoch
            epoch_2_trained.set()

    monkeypatch.setattr(coco_background, "evaluate_records", slow)
    train, val = _data(tmp_path / "data", "detect")
    r = fit(_config(tmp_path / "run"), train_data=train, val_data=val, progress=False, on_step=on_step)
    assert sorted(spans) == [1, 2] and not any(main for _, main in spans.values())
    assert spans[1][0] is True  # epoch 2 trained while epoch 1 was being scored
    assert r.coco == _zeros(["bbox"])  # the last one was waited for
    assert [e["epoch"] for e in _events(tmp_path / "run", "coco")] == [1, 2]


def test_a_failing_evaluation_is_reported_and_the_fit_goes_on(tmp_path, monkeypatch):
    calls = []

    def flaky(gt, records, *, image_ids, iou_types):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("boom")
        return _zeros(iou_types)

    monkeypatch.setattr(coco_background, "evaluate_records", flaky)
    train, val = _data(tmp_path / "data", "detect")
    with pytest.warns(UserWarning, match=r"background COCO evaluation of epoch 1 failed \(RuntimeError: boom\)"):
        r = fit(_config(tmp_path / "run"), train_data=train, val_data=val, progress=False)
    assert r.stopped == "completed" and r.epochs_done == 2 and r.coco == _zeros(["bbox"])
    events = _events(tmp_path / "run", "coco")
    assert events[0]["epoch"] == 1 and events[0]["error"] == "RuntimeError: boom"
    assert events[1]["epoch"] == 2 and "error" not in events[1]
    with open(tmp_path / "run" / "coco.csv", newline="") as f:
        assert [x["epoch"] for x in csv.DictReader(f)] == ["2"]


def test_val_coco_off_runs_no_pycocotools(tmp_path, monkeypatch):
    import pycocotools.cocoeval

    def refuse(*a, **k):
        raise AssertionError("pycocotools ran with val.coco=off")

    monkeypatch.setattr(coco_background, "evaluate_records", refuse)
    monkeypatch.setattr(pycocotools.cocoeval.COCOeval, "evaluate", refuse)
    train, val = _data(tmp_path / "data", "detect")
    r = fit(_config(tmp_path / "run", extra=["val.coco=off"]), train_data=train, val_data=val, progress=False)
    assert r.stopped == "completed" and r.coco is None and r.metrics is not None
    assert not (tmp_path / "run" / "coco.csv").exists() and _events(tmp_path / "run", "coco") == []


def test_auto_is_on_for_coco_ground_truth_only(tmp_path):
    from yolo_func.data import YoloDataset
    from yolo_func.data.yolo import write_yolo_dataset

    train, val = _data(tmp_path / "data", "detect")
    yaml = write_yolo_dataset({"train": train, "val": val}, tmp_path / "yolo")
    yolo = YoloDataset(yaml, "val", task="detect")
    assert coco_background.resolve_coco("auto", val) and not coco_background.resolve_coco("auto", yolo)
    assert coco_background.resolve_coco("on", yolo) and not coco_background.resolve_coco("off", val)
    with pytest.raises(ValueError, match=r"val.coco=on but the val data \(list\) has no COCO ground truth"):
        coco_background.resolve_coco("on", [])


class _Oracle:
    """``predict`` returns each val batch's ground truth (score 0.9): pycocotools must then score AP 1."""

    def __init__(self, loader, num_classes):
        self.task, self.num_classes = "detect", num_classes
        self.batches = [vb.targets for vb in loader]

    def predict(self, params, state, images):
        from yolo_func.models.yolov8 import Inference

        t = self.batches.pop(0)
        xy = (t.boxes[..., :2] + t.boxes[..., 2:]) / 2
        wh = t.boxes[..., 2:] - t.boxes[..., :2]
        scores = torch.nn.functional.one_hot(t.classes, self.num_classes).float() * 0.9 * t.valid[..., None]
        return Inference(torch.cat([xy, wh, scores], -1).transpose(1, 2).contiguous())


def test_validate_records_are_in_original_pixels_with_the_dataset_category_ids(tmp_path):
    """The records validate hands to pycocotools score the ground truth as perfect: boxes back in
    original pixels, classes mapped to the JSON's category ids."""
    from yolo_func.eval.coco_eval import evaluate as coco_evaluate
    from yolo_func.train.fit import validate

    ds = builtin_dataset("detect", "val", root=tmp_path, num_images=6)
    loader = ValLoader(ds, batch_size=4, image_size=2 * IMGSZ, workers=0, shapes=ds.image_sizes)
    cfg = build_config("yolov8n", flags={"imgsz": 2 * IMGSZ})
    ev = CocoEvaluator(ds.coco, category_ids=ds.category_ids, verbose=False)
    validate(_Oracle(loader, len(ds.names)), None, None, loader, ds, config=cfg, device=torch.device("cpu"),
             progress=False, coco=ev)
    assert ev.image_ids == sorted(int(i) for i in ds.image_ids)
    got = coco_evaluate(ds.coco.dataset, ev.results, iou_types=ev.iou_types, image_ids=ev.image_ids, verbose=False)
    assert got["bbox"]["AP50"] == pytest.approx(1.0) and got["bbox"]["AP"] > 0.9


def test_the_worker_process_scores_as_the_thread_does_and_stops_with_the_fit(tmp_path):
    """By default the records are scored in a worker interpreter (no GIL shared with training):
    ground truth fed back as predictions scores AP 1.0 there, exactly as on the thread
    (``process=False``), each logged to its run folder; ``finish`` stops the worker."""
    val = builtin_dataset("detect", "val", root=tmp_path / "data", num_images=N_VAL)
    records = [{"image_id": a["image_id"], "category_id": a["category_id"], "bbox": a["bbox"], "score": 1.0}
               for a in val.coco.dataset["annotations"] if not a.get("iscrowd", 0)]
    got = {}
    for process in (True, False):
        rd = RunDir(tmp_path / f"run_{process}", task="detect")
        bg = coco_background.BackgroundCoco(val.coco, run_dir=rd, process=process)
        bg.submit(1, list(records), image_ids=None, iou_types=["bbox"])
        scorer = bg._scorer
        assert (scorer is not None) == process
        got[process] = bg.finish()
        if process:
            assert scorer._proc.poll() is not None  # the worker has exited
        assert [e["epoch"] for e in _events(rd.path, "coco")] == [1]
    assert got[True] == got[False]
    assert got[True]["bbox"]["AP"] == pytest.approx(1.0)


def test_a_worker_started_early_scores_later_or_exits_cleanly_unused(tmp_path):
    """``BackgroundCoco.start`` (the fit calls it at start-up) runs the worker's imports ahead of
    the first evaluation; the first submit uses that worker, and one stopped before any
    evaluation is stopped at once (no 5 s wait for a worker still importing)."""
    val = builtin_dataset("detect", "val", root=tmp_path / "data", num_images=N_VAL)
    records = [{"image_id": a["image_id"], "category_id": a["category_id"], "bbox": a["bbox"], "score": 1.0}
               for a in val.coco.dataset["annotations"] if not a.get("iscrowd", 0)]
    bg = coco_background.BackgroundCoco(val.coco, run_dir=RunDir(tmp_path / "used", task="detect"), process=True)
    scorer = bg.start()
    assert scorer is not None and bg.start() is scorer  # started once
    bg.submit(1, records, image_ids=None, iou_types=["bbox"])
    assert bg._scorer is scorer and bg.finish()["bbox"]["AP"] == pytest.approx(1.0)
    unused = coco_background.BackgroundCoco(val.coco, run_dir=RunDir(tmp_path / "unused", task="detect"), process=True)
    scorer = unused.start()
    t0 = time.monotonic()
    unused.abandon()
    assert scorer._proc.poll() is not None and time.monotonic() - t0 < 4.0
    assert coco_background.BackgroundCoco(val.coco, run_dir=RunDir(tmp_path / "t", task="detect"),
                                          process=False).start() is None  # the thread scorer: nothing to start
