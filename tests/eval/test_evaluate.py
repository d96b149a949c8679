"""``yolo_func.eval.evaluate``: the plumbing from rect val batches to pycocotools and the internal metric.

The perfect-prediction check uses a stand-in model whose ``predict`` returns each val batch's ground
truth in the letterboxed frame (taken from a second ``ValLoader`` with the same settings): AP = 1
then proves that the letterbox is undone correctly end to end (gain order, pad, clip), since the
COCO ground truth comes from the JSON in original pixels.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from yolo_func import yolov8
from yolo_func.data import CocoDataset, ValLoader
from yolo_func.data.yolo import YoloDataset, write_yolo_dataset
from yolo_func.eval import evaluate
from yolo_func.eval.coco_eval import BOX_KEYS, KEYPOINT_KEYS
from yolo_func.eval.evaluate import coco_ground_truth, evaluate_with_records, model_kpt_shape
from yolo_func.models.yolov8 import Inference

IMAGE_SIZE, BATCH = 160, 8


class GroundTruthModel:
    """Stand-in for a Model: ``predict`` returns the next val batch's labels as raw inference rows
    ((cx, cy, w, h) letterboxed pixels, one-hot class scores 0.9, keypoints (x, y, 1.0))."""

    def __init__(self, dataset, *, task: str, num_classes: int, kpt_shape=None):
        self.task, self.num_classes = task, num_classes
        self.heads = {"detect": None, **({"pose": None} if task == "pose" else {})}
        self.batches = iter(list(ValLoader(dataset, batch_size=BATCH, image_size=IMAGE_SIZE, workers=0)))
        self.kpt_shape = kpt_shape

    def predict(self, params, state, images):
        t = next(self.batches).targets
        B, M = t.classes.shape
        assert images.shape[0] == B
        xyxy = t.boxes.float()
        box = torch.cat([(xyxy[..., :2] + xyxy[..., 2:]) / 2, xyxy[..., 2:] - xyxy[..., :2]], -1)
        scores = torch.nn.functional.one_hot(t.classes, self.num_classes).float() * 0.9 * t.valid[..., None]
        parts = [box, scores]
        if self.task == "pose":
            k = t.keypoints.float().clone()
            # Persons without labelled keypoints: every point at the box centre, inside the region
            # pycocotools matches such (ignored) labels by, so they are neither hits nor misses.
            unlabelled = (t.keypoints[..., 2] == 0).all(-1)
            centre = box[..., None, :2].expand_as(k[..., :2])
            k[..., :2] = torch.where(unlabelled[..., None, None], centre, k[..., :2])
            k[..., 2] = 1.0
            parts.append(k.flatten(2))
        return Inference(torch.cat(parts, -1).transpose(1, 2).contiguous(), None)


@pytest.fixture(scope="module")
def coco_tiny(shared_data: Path) -> CocoDataset:
    d = shared_data / "coco-tiny"
    return CocoDataset(d / "annotations.json", d / "images", task="detect")


def test_ground_truth_as_predictions_gives_ap_1_in_original_pixels(coco_tiny):
    model = GroundTruthModel(coco_tiny, task="detect", num_classes=len(coco_tiny.names))
    # iou=1.0: nothing is suppressed (overlapping GT of one class stay), so every label is predicted.
    metrics, records = evaluate_with_records(model, {}, {}, coco_tiny, image_size=IMAGE_SIZE, batch_size=BATCH,
                                             device="cpu", iou=1.0, workers=0, progress=False, verbose=False)
    assert set(metrics) == {"bbox", "internal"}
    assert set(metrics["bbox"]) == set(BOX_KEYS)
    assert metrics["bbox"]["AP"] > 0.99
    assert metrics["bbox"]["AP50"] > 0.99
    assert metrics["internal"]["box"]["mAP50-95"] > 0.99
    assert metrics["internal"]["fitness"] == metrics["internal"]["box"]["mAP50-95"]
    # one record per labelled box, with the JSON's image and category ids
    labels = sum(len(coco_tiny.labels(i)[1]) for i in range(len(coco_tiny)))
    assert len(records) == labels
    assert {r["image_id"] for r in records} <= set(coco_tiny.image_ids.tolist())
    assert {r["category_id"] for r in records} <= set(coco_tiny.category_ids)
    json.dumps(metrics)  # JSON-ready


def test_pose_ground_truth_gives_keypoint_ap_1(shared_data: Path):
    d = shared_data / "coco-pose-tiny"
    ds = CocoDataset(d / "annotations.json", d / "images", task="pose")
    model = GroundTruthModel(ds, task="pose", num_classes=1)
    metrics = evaluate(model, {}, {}, ds, image_size=IMAGE_SIZE, batch_size=BATCH, device="cpu", iou=1.0,
                       workers=0, progress=False, verbose=False)
    assert set(metrics["keypoints"]) == set(KEYPOINT_KEYS)
    assert metrics["keypoints"]["AP"] > 0.99
    assert metrics["internal"]["box"]["mAP50-95"] > 0.99
    # the internal OKS of a label without visible keypoints is 0 (no hit), so pose recall < 1 there
    assert 0.3 < metrics["internal"]["pose"]["mAP50-95"] < 1.0
    assert metrics["internal"]["fitness"] == pytest.approx(
        metrics["internal"]["box"]["mAP50-95"] + metrics["internal"]["pose"]["mAP50-95"])


def test_a_shifted_prediction_is_not_ap_1(coco_tiny):
    """The AP = 1 check can fail: boxes shifted by a quarter of their size lose the high thresholds."""

    class Shifted(GroundTruthModel):
        def predict(self, params, state, images):
            inf = super().predict(params, state, images)
            y = inf.y.clone()
            y[:, 0] += y[:, 2] / 4
            return Inference(y, None)

    model = Shifted(coco_tiny, task="detect", num_classes=len(coco_tiny.names))
    m = evaluate(model, {}, {}, coco_tiny, image_size=IMAGE_SIZE, batch_size=BATCH, device="cpu", iou=1.0, workers=0,
                 progress=False, verbose=False)
    assert m["bbox"]["AP75"] < 0.5 < m["bbox"]["AP50"]


def test_internal_metric_scores_boxes_unclipped_as_the_reference(coco_tiny):
    """Each prediction is its label widened leftwards by half its width (IoU 2/3 with its label
    when nothing is clipped: the thresholds 0.50-0.65 hit, so box mAP50-95 is about 0.4). The
    reference's metric scores boxes as the network placed them, past the image border too; the
    expectation is the metric computed straight from the labels in original pixels (no letterbox,
    no clipping), and the same computation with clipped boxes, which lifts the IoU of labels near the
    left border, must differ. pycocotools still scores clipped records."""
    from yolo_func.eval.metrics import GroundTruth, MetricAccumulator
    from yolo_func.eval.postprocess import Detections

    def widen(xyxy):  # x1 moves left by half the width
        return torch.cat([xyxy[:, :1] - (xyxy[:, 2:3] - xyxy[:, :1]) / 2, xyxy[:, 1:]], 1)

    class WidenedLeft(GroundTruthModel):
        def predict(self, params, state, images):
            inf = super().predict(params, state, images)
            y = inf.y.clone()  # (cx, cy, w, h) rows
            y[:, 0] -= y[:, 2] / 4
            y[:, 2] *= 1.5
            y[:, 4:] *= 1 - 1e-3 * torch.arange(y.shape[2])  # distinct scores: the order is the label order
            return Inference(y, None)

    model = WidenedLeft(coco_tiny, task="detect", num_classes=len(coco_tiny.names))
    m, records = evaluate_with_records(model, {}, {}, coco_tiny, image_size=IMAGE_SIZE, batch_size=BATCH, device="cpu",
                                       iou=1.0, workers=0, progress=False, verbose=False)
    want = {}
    for clip in (False, True):
        acc = MetricAccumulator()
        for i in range(len(coco_tiny)):
            boxes, classes, _ = coco_tiny.labels(i)
            b = torch.from_numpy(boxes).double()
            p = widen(b)
            if clip:
                p = p.clamp(min=0)
            scores = 0.9 * (1 - 1e-3 * torch.arange(len(b), dtype=torch.float64))
            acc.process([Detections(p, scores, torch.from_numpy(classes))], [GroundTruth(b, torch.from_numpy(classes))])
        want[clip] = acc.compute()["box"]
    assert want[False]["mAP50-95"] == pytest.approx(0.4, abs=0.02)
    assert want[True]["mAP50-95"] > want[False]["mAP50-95"] + 0.005  # the check can fail
    for k in ("mAP50", "mAP50-95"):
        assert m["internal"]["box"][k] == pytest.approx(want[False][k], abs=1e-4), k  # float32 letterbox round trip
    assert min(r["bbox"][0] for r in records) == 0.0  # the COCO records are clipped


def test_random_nano_model_runs_and_returns_every_key(coco_tiny, capsys):
    model = yolov8("n", task="detect", num_classes=len(coco_tiny.names))
    params, state = model.init(torch.Generator().manual_seed(0))
    m = evaluate(model, params, state, coco_tiny, image_size=128, batch_size=16, device="cpu", workers=0)
    assert set(m["bbox"]) == set(BOX_KEYS)
    assert set(m["internal"]) >= {"box", "fitness", "per_class"}
    assert all(0.0 <= v <= 1.0 for v in m["bbox"].values())
    assert "AP50" in capsys.readouterr().out  # the table is printed


def test_class_count_mismatch_names_both(coco_tiny):
    model = yolov8("n", task="detect", num_classes=3)
    params, state = model.abstract_init()
    with pytest.raises(ValueError, match=r"the model has 3 classes but the dataset has 80"):
        evaluate(model, params, state, coco_tiny, device="cpu", workers=0)


def test_task_mismatch_is_an_error(coco_tiny):
    model = yolov8("n", task="pose")
    params, state = model.abstract_init()
    with pytest.raises(ValueError, match=r"task is 'detect' but the model's is 'pose'"):
        evaluate(model, params, state, coco_tiny, device="cpu", workers=0)


def test_yolo_dataset_ground_truth_matches_the_coco_json(coco_tiny, tmp_path):
    """coco_ground_truth of the YOLO copy holds the JSON's boxes (to the label files' precision)."""
    yaml = write_yolo_dataset({"val": coco_tiny}, tmp_path)
    yds = YoloDataset(yaml, "val", task="detect")
    gt = coco_ground_truth(yds)
    assert len(gt["images"]) == len(coco_tiny)
    assert [c["name"] for c in gt["categories"]] == coco_tiny.names
    by_file = {}
    for a in gt["annotations"]:
        by_file.setdefault(gt["images"][[im["id"] for im in gt["images"]].index(a["image_id"])]["file_name"], []).append(a)
    for i in range(len(coco_tiny)):
        boxes, classes, _ = coco_tiny.labels(i)
        name = Path(coco_tiny.file_names[i]).name
        anns = [a for f, v in by_file.items() if Path(f).name == name for a in v]
        got = np.array([a["bbox"] for a in anns]).reshape(-1, 4)
        want = np.array([[x1, y1, x2 - x1, y2 - y1] for x1, y1, x2, y2 in boxes.tolist()]).reshape(-1, 4)
        assert len(got) == len(want)
        if len(want):  # every label has a twin (the label files hold 6 decimals of the normalised values)
            dist = np.abs(want[:, None] - got[None]).max(-1)
            assert dist.min(1).max() < 0.05


def test_model_kpt_shape_from_the_head_channels():
    model = yolov8("n", task="pose", kpt_shape=(5, 2))
    params, _ = model.abstract_init()
    assert model_kpt_shape(model, params) == (5, 2)
    assert model_kpt_shape(model, params, (4, 3)) == (4, 3)
    assert model_kpt_shape(yolov8("n"), yolov8("n").abstract_init()[0]) is None


def test_val_replay_falls_back_with_the_reason_off_cuda():
    """ValReplay on CPU tensors cannot capture: it returns None (run eagerly) and warns once, naming why."""
    from yolo_func.eval.evaluate import ValReplay

    model = yolov8("n", task="detect", num_classes=2)
    params, state = model.init(torch.Generator().manual_seed(0))
    rep = ValReplay(model, params, state, batch_size=2, conf=0.001, iou=0.7, max_det=300, num_classes=2, kpt_shape=None)
    images = torch.zeros(1, 3, 64, 64, dtype=torch.uint8)
    with pytest.warns(UserWarning, match=r"val batches run eagerly: .*not a CUDA device.*shape \[2, 3, 64, 64\]"):
        assert rep(images) is None
    assert rep(images) is None  # the same reason is not warned twice
    assert len(rep.reasons) == 1 and rep.replays == 0


def test_replay_step_function_of_a_segmentation_model_runs_on_the_cpu():
    """The function ValReplay captures, run plainly on the CPU for a segmentation model: boxes-only
    static detections (no masks), the raw output and the prototypes for an eager redo; equal to
    the eager postprocess wherever certified."""
    from yolo_func.eval import postprocess
    from yolo_func.eval.evaluate import ValReplay

    model = yolov8("n", task="segment", num_classes=3)
    params, state = model.init(torch.Generator().manual_seed(0))
    rep = ValReplay(model, params, state, batch_size=2, conf=0.001, iou=0.7, max_det=30, num_classes=3, kpt_shape=None,
                    autocast_dtype=None, candidates=256)
    images = torch.randint(0, 255, (2, 3, 64, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    _, out = rep._fn(None, {"params": params, "state": state, "images": images})
    padded = out["detections"]
    assert padded.masks is None and padded.keypoints is None and out["protos"].shape[:2] == (2, 32)
    eager = postprocess(Inference(out["y"], out["protos"]), conf=0.001, iou=0.7, max_det=30, multi_label=True, masks=False)
    assert bool(padded.converged.any())
    for e, s, ok in zip(eager, padded.unpad(), padded.converged.tolist()):
        if ok:
            assert torch.equal(e.boxes, s.boxes) and torch.equal(e.scores, s.scores) and torch.equal(e.classes, s.classes)


@pytest.mark.cuda
@pytest.mark.parametrize("task", ["detect", "pose"])
def test_cuda_replayed_validation_equals_eager(shared_data: Path, task):
    """Forward + decode + static NMS replayed as CUDA graphs (one per rect shape) give the eager
    path's records and metrics. coco-tiny at batch 8 has only full batches, which replay the eager
    kernels: the records are equal. A short last batch (batch 12; coco-pose-tiny's 30 images at
    batch 8) is padded into its shape's graph and runs the convolutions at another batch size, so
    there only the record count and the metrics (to 1e-3) are compared."""
    import warnings as _w

    from yolo_func.capture import num_captures

    d = shared_data / ("coco-tiny" if task == "detect" else "coco-pose-tiny")
    ds = CocoDataset(d / "annotations.json", d / "images", task=task)
    model = yolov8("n", task=task, num_classes=len(ds.names))
    params, state = model.init(torch.Generator().manual_seed(0))
    for batch_size, exact in ((8, task == "detect"), (12, False)):
        kw = dict(image_size=IMAGE_SIZE, batch_size=batch_size, device="cuda", conf=0.0, workers=0, progress=False,
                  verbose=False)
        eager, eager_records = evaluate_with_records(model, params, state, ds, replay=False, **kw)
        before = num_captures()
        with _w.catch_warnings(record=True) as caught:
            _w.simplefilter("always")
            replayed, records = evaluate_with_records(model, params, state, ds, replay=True, **kw)
        assert num_captures() > before
        assert not [w for w in caught if "capture failed" in str(w.message)]
        assert len(records) == len(eager_records) > 0
        if exact:
            assert records == eager_records
        for kind in ("bbox", "keypoints"):
            for k, v in eager.get(kind, {}).items():
                assert replayed[kind][k] == pytest.approx(v, abs=1e-3), (batch_size, kind, k)


@pytest.mark.cuda
def test_cuda_replayed_segment_validation_without_coco_equals_eager(shared_data: Path):
    """A segmentation model with ``coco=False`` (no masks needed: the internal metric scores boxes)
    replays too, and gives the eager path's internal metric (full batches of 8: exactly)."""
    import warnings as _w

    from yolo_func.capture import num_captures

    d = shared_data / "coco-tiny"
    ds = CocoDataset(d / "annotations.json", d / "images", task="segment")
    model = yolov8("n", task="segment", num_classes=len(ds.names))
    params, state = model.init(torch.Generator().manual_seed(0))
    kw = dict(image_size=IMAGE_SIZE, batch_size=8, device="cuda", conf=0.0, workers=0, progress=False, verbose=False,
              coco=False)
    eager = evaluate(model, params, state, ds, replay=False, **kw)
    before = num_captures()
    with _w.catch_warnings(record=True) as caught:
        _w.simplefilter("always")
        replayed = evaluate(model, params, state, ds, replay=True, **kw)
    assert num_captures() > before
    assert not [w for w in caught if "capture failed" in str(w.message) or "segmentation" in str(w.message)]
    assert replayed == eager


def test_precision_picks_the_autocast_of_the_network_forward(monkeypatch):
    """``precision=`` is the autocast the network runs under (seen from inside ``predict``): fp32
    on the CPU by default, bf16 / fp16 when asked; "auto" and "fp32" give identical metrics on the
    CPU; a bad value names the choices."""
    from yolo_func.data import builtin_dataset

    model = yolov8("n", task="detect", num_classes=5)
    params, state = model.init(torch.Generator().manual_seed(0))
    data = builtin_dataset("detect", "val", num_images=2)
    seen = []
    real = type(model).predict

    def spy(self, p, s, x):
        seen.append(torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None)
        return real(self, p, s, x)

    monkeypatch.setattr(type(model), "predict", spy)
    kw = dict(image_size=64, batch_size=2, device="cpu", workers=0, progress=False, verbose=False, coco=False)
    results = {}
    for precision, expected in (("auto", None), ("fp32", None), ("bf16", torch.bfloat16), ("fp16", torch.float16)):
        seen.clear()
        results[precision] = evaluate(model, params, state, data, precision=precision, **kw)
        assert seen and set(seen) == {expected}, (precision, seen)
    assert results["auto"] == results["fp32"]
    with pytest.raises(ValueError, match=r"precision must be one of \('auto', 'bf16', 'fp16', 'fp32'\)"):
        evaluate(model, params, state, data, precision="fp64", **kw)


@pytest.mark.parametrize("background", [False, True])
def test_metric_calls_run_in_order_and_raise(background):
    # evaluate's per-batch metric work (a background thread on a GPU): submission order, every call,
    # ground truth built in the call, an error raised to the caller
    from yolo_func.eval.evaluate import _InOrder

    seen = []

    def work(dets, gt):
        time.sleep(0.002 * (dets % 3))  # uneven durations
        seen.append((dets, gt))

    with _InOrder(background) as q:
        for i in range(20):
            q.submit(work, i, lambda i=i: -i)
        q.finish()
    assert seen == [(i, -i) for i in range(20)]

    def bad(dets, gt):
        raise ValueError(f"batch {dets}")

    with pytest.raises(ValueError, match="batch 0"), _InOrder(background) as q:
        for i in range(5):
            q.submit(bad, i, lambda: None)
        q.finish()


def test_threaded_validation_paths_give_the_inline_metrics(coco_tiny, monkeypatch):
    # On a GPU evaluate builds batches on the loader's producer thread and runs the metric on a
    # background thread; the CPU runs both inline. Forced on here, the whole evaluate gives the same
    # numbers, and the metric really ran off the main thread (a fallback would not).
    import sys
    import threading

    from yolo_func.data import loader as loader_mod
    from yolo_func.eval.metrics import MetricAccumulator

    ev_mod = sys.modules["yolo_func.eval.evaluate"]  # the module (the package exports the function by that name)

    class Shifted(GroundTruthModel):  # non-trivial metrics: some thresholds hit, some missed
        def predict(self, params, state, images):
            inf = super().predict(params, state, images)
            y = inf.y.clone()
            y[:, 0] += y[:, 2] / 6
            return Inference(y, None)

    def run():
        model = Shifted(coco_tiny, task="detect", num_classes=len(coco_tiny.names))
        return evaluate(model, {}, {}, coco_tiny, image_size=IMAGE_SIZE, batch_size=BATCH, device="cpu", iou=1.0,
                        workers=2, progress=False, verbose=False, coco=False)

    inline = run()
    threads: list[str] = []
    producers: list[bool] = []
    real_process, real_in_order, real_loader = MetricAccumulator.process, ev_mod._InOrder, loader_mod.ValLoader
    monkeypatch.setattr(MetricAccumulator, "process",
                        lambda self, *a: threads.append(threading.current_thread().name) or real_process(self, *a))
    monkeypatch.setattr(ev_mod, "_InOrder", lambda background, **k: real_in_order(True, **k))

    def producing_loader(*a, **k):
        producers.append(any(t.name == "yolo_func-val-batches" for t in threading.enumerate()))
        return real_loader(*a, **{**k, "producer": True})

    monkeypatch.setattr(loader_mod, "ValLoader", producing_loader)
    real_submit = real_in_order.submit

    def submit(self, *a, **k):  # the producer thread is alive while evaluate consumes its batches
        producers.append(any(t.name == "yolo_func-val-batches" for t in threading.enumerate()))
        return real_submit(self, *a, **k)

    monkeypatch.setattr(real_in_order, "submit", submit)
    threaded = run()
    assert threads and all(t.startswith("yolo_func-metric") for t in threads), threads
    assert producers[0] is False and any(producers[1:]), producers
    assert 0.05 < inline["internal"]["box"]["mAP50-95"] < 0.95
    assert json.dumps(threaded, sort_keys=True) == json.dumps(inline, sort_keys=True)


def test_loader_backends_give_the_same_metrics_and_auto_picks_by_device_and_length(coco_tiny, monkeypatch):
    from yolo_func.data import loader as loader_mod

    backends: list[str] = []
    real_loader = loader_mod.ValLoader
    monkeypatch.setattr(loader_mod, "ValLoader", lambda *a, **k: backends.append(k["backend"]) or real_loader(*a, **k))

    def run(**kw):
        model = GroundTruthModel(coco_tiny, task="detect", num_classes=len(coco_tiny.names))
        return evaluate(model, {}, {}, coco_tiny, image_size=IMAGE_SIZE, batch_size=BATCH, device="cpu", iou=1.0,
                        progress=False, verbose=False, coco=False, **kw)

    threads = run(workers=2, loader_backend="threads")
    processes = run(workers=2, loader_backend="processes")
    assert processes == threads and backends == ["threads", "processes"]
    run(workers=2)  # auto on the CPU: threads (worker processes only beside a GPU, for long validations)
    assert backends[-1] == "threads"
    with pytest.raises(ValueError, match="loader_backend must be"):
        run(workers=2, loader_backend="fork")
