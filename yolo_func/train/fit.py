"""The fit loop: a :class:`yolo_func.configs.Config` in, a trained run folder out.

``fit(config)`` is the only place where data, the training step, evaluation and the run folder
meet (DESIGN.md §7)::

    datasets (config.data) -> TrainLoader (close_mosaic) --Batch--> ReplayTrainStep (eager on the CPU;
    on CUDA "step" when every head is capturable, else "network") -> every val_every epochs: validate
    on the EMA weights (ValLoader -> Model.predict -> postprocess -> scale_to_original ->
    eval.metrics) -> RunDir: results.csv, events.jsonl, weights/last.pt (and best.pt by fitness)
    -> with val.coco: the validation's COCO result records -> pycocotools in a background thread
    while the next epoch trains (train/coco_background.py) -> coco.csv, events.jsonl "coco",
    FitResult.coco (the last evaluation, waited for at the end)

Stopping: the last epoch, early stopping (``train.patience`` epochs without a better fitness), a
wall-clock limit (``train.time_limit_hours``, this process's time), Ctrl-C (SIGINT: the current
step finishes, ``last.pt`` is saved at the exact data position, ``FitResult.stopped ==
"interrupted"``; a second Ctrl-C stops at once without saving), or a hook raising
:class:`KeyboardInterrupt` after a step (same as Ctrl-C).

Resume: a run folder holding ``weights/last.pt`` (``train.out``, or ``train.resume``) continues
from its :class:`~yolo_func.train.DataPosition`: the loader is set to the epoch and the batch after
the last one trained (``TrainLoader.set_epoch(epoch, start_batch=)``; nothing is loaded for the
batches before), so a resumed run sees the batches an uninterrupted one would and ends with a bitwise equal
:class:`~yolo_func.train.TrainState` (on the CPU; tested).

Host syncs: none per step. Every ``log_every`` steps the progress bar's metrics are copied to
pinned host memory without waiting (:class:`yolo_func.train.metrics.MetricsReader`) and shown
from the previous log step's copy once it has landed; the epoch's mean loss parts are summed on
the device and read once per epoch (after its validation). Checkpoint tensors go to reused pinned buffers without a sync
(:class:`yolo_func.io.checkpoint.HostStaging`), written on a thread.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import math
import os
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch

from yolo_func import tree as T
from yolo_func.configs import Config, config_diff
from yolo_func.data import CocoDataset, TrainLoader, ValLoader, YoloDataset, builtin_dataset
from yolo_func.data.augment import AugmentConfig as LoaderAugment
from yolo_func.data.loader import ValBatch, val_boxes_to_original
from yolo_func.eval.coco_eval import CocoEvaluator, category_groups, load_coco
from yolo_func.eval.evaluate import _images_to
from yolo_func.eval.gt_masks import val_gt_masks
from yolo_func.eval.metrics import GroundTruth, MetricAccumulator
from yolo_func.eval.postprocess import Letterbox, clip_detections, postprocess, postprocess_with_coco, scale_to_original
from yolo_func.func import autocast_dtype, eval_autocast_dtype
from yolo_func.models.yolov8 import Model, yolov8
from yolo_func.optim import ema as make_ema
from yolo_func.structures.records import Targets
from yolo_func.train import coco_background
from yolo_func.train import distributed as D
from yolo_func.train.compiled import compile_times_event
from yolo_func.train.checkpoint import DataPosition, capture_rng, read_training_checkpoint, restore_rng
from yolo_func.train.cuda_warm import start_cuda_warmup
from yolo_func.train.host_memory import keep_freed_host_memory
from yolo_func.train.metrics import MetricsReader
from yolo_func.train.optimizer import YoloOptimizer, yolo_sgd
from yolo_func.train.replay import ReplayTrainStep
from yolo_func.train.run_dir import RunDir
from yolo_func.train.state import Batch, TrainState
from yolo_func.train.step import init_train_state

__all__ = ["fit", "FitResult", "StepInfo", "load_datasets", "resolve_device", "resolve_capture", "resolve_vjp",
           "resolve_compile", "validate", "build_model"]

_KINDS = {"detect": ("box",), "segment": ("box", "mask"), "pose": ("box", "pose")}
#: The step's loss metrics per task (``loss/<head>/<part>``), in results.csv's order.
_PARTS = {"detect": ("detect/box", "detect/cls", "detect/dfl"),
          "segment": ("detect/box", "detect/cls", "detect/dfl", "segment/seg"),
          "pose": ("detect/box", "detect/cls", "detect/dfl", "pose/pose", "pose/kobj")}


class FitResult(NamedTuple):
    """What :func:`fit` returns.

    Attributes:
      run_dir: the run folder (``Path``).
      train_state: the final :class:`TrainState` (on the training device).
      epochs_done: completed epochs (a run stopped mid-epoch counts the epochs before it).
      steps: micro-batches trained in total (``TrainState.step``), resumed ones included.
      stopped: why the loop ended: ``"completed"``, ``"early_stop"``, ``"time_limit"`` or
        ``"interrupted"`` (Ctrl-C or a hook's ``KeyboardInterrupt``; ``last.pt`` is resumable).
      best: the ``results.csv`` row of the best fitness, or None (no validation yet).
      metrics: the last validation's metrics (``{"box": {"P", "R", "mAP50", "mAP50-95"}, ...}``), or None.
      coco: pycocotools' numbers of the latest validation whose background evaluation finished
        (``{"bbox": {"AP", "AP50", ...}[, "segm"][, "keypoints"]}``, as :func:`yolo_func.eval.evaluate`
        gives them; after a completed run: the last epoch's), or None (``val.coco`` off, or none finished).

    Example:
      >>> from yolo_func.train import FitResult
      >>> FitResult._fields                                 # result = fit(config); result.run_dir, result.best, ...
      ('run_dir', 'train_state', 'epochs_done', 'steps', 'stopped', 'best', 'metrics', 'coco')
    """

    run_dir: Path
    train_state: TrainState
    epochs_done: int
    steps: int
    stopped: str
    best: dict | None
    metrics: dict | None
    coco: dict | None = None


class StepInfo(NamedTuple):
    """What an ``on_step`` hook receives after each training step.

    Attributes:
      step: micro-batches trained so far, this one included (the run's, resumed ones included).
      epoch: the epoch in progress (0-based).
      batch_index: the batch's index in the epoch (0-based).
      train_state: the new :class:`TrainState` (at replay levels: static buffers; read, do not keep).
      batch: the host :class:`Batch` that was trained on (uint8 images, targets).
      metrics: the step's device metrics (fetch or clone them before the next step).

    Example:
      >>> from yolo_func.train import StepInfo
      >>> StepInfo._fields                                  # what fit(on_step=...) passes after every step
      ('step', 'epoch', 'batch_index', 'train_state', 'batch', 'metrics')
      >>> def stop_after_3(info):
      ...     if info.step >= 3:
      ...         raise KeyboardInterrupt                   # stops fit() as Ctrl-C does (last.pt saved)
    """

    step: int
    epoch: int
    batch_index: int
    train_state: TrainState
    batch: Batch
    metrics: dict


# ------------------------------------------------------------------------------------------- devices


def resolve_device(device: str) -> torch.device:
    """``train.device`` as a torch device: ``"auto"`` is CUDA when available, else the CPU.

    Raises:
      ValueError: CUDA was asked for and is not available.
    """
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"[yolo_func] train.device={device!r} but CUDA is not available here; "
                         "use --device cpu (or --device auto)")
    return dev


def resolve_vjp(asked: str, device: torch.device) -> str:
    """The differentiation backend a run uses (``train.vjp``): ``"auto"`` is ``"autograd"`` on the
    CPU (no ``torch._dynamo`` import: ~1.5 s less start-up on the 2-core development VM, less host
    time per op; ``docs/performance.md``) and ``"func"`` on CUDA; ``"func"`` and ``"autograd"`` are
    kept as asked.

    Example:
      >>> import torch
      >>> resolve_vjp("auto", torch.device("cpu")), resolve_vjp("auto", torch.device("cuda")), resolve_vjp("func", torch.device("cpu"))
      ('autograd', 'func', 'func')
    """
    if asked == "auto":
        return "autograd" if torch.device(device).type == "cpu" else "func"
    return asked


def resolve_capture(capture: str, model: Model, device: torch.device) -> str:
    """The replay level a run uses: ``"none"`` on the CPU whatever was asked; on CUDA ``"auto"``
    is ``"step"`` when every head is capturable, else ``"network"``; other values as given."""
    if device.type != "cuda":
        return "none"
    if capture == "auto":
        return "step" if all(h.capturable for h in model.heads.values()) else "network"
    return capture


def resolve_compile(compile: str, device: torch.device) -> str:
    """The ``compile=`` mode a run uses (``train.compile``): ``"auto"`` is ``"default"`` on CUDA
    and ``"none"`` elsewhere; other values as given (the CPU compiles too when asked: inductor
    generates C++ there, slow to compile).

    Example:
      >>> import torch
      >>> from yolo_func.train.fit import resolve_compile
      >>> resolve_compile("auto", torch.device("cpu")), resolve_compile("auto", torch.device("cuda"))
      ('none', 'default')
    """
    if compile == "auto":
        return "default" if device.type == "cuda" else "none"
    return compile


# ---------------------------------------------------------------------------------------------- data


def _coco_split(folder: Path, split: str, task: str) -> tuple[Path, Path] | None:
    """(annotations JSON, image folder) of one split of a COCO-style folder, or None."""
    prefix = "person_keypoints" if task == "pose" else "instances"
    for ann in sorted((folder / "annotations").glob(f"{prefix}_{split}*.json")):
        stem = ann.stem.removeprefix(f"{prefix}_")  # train2017
        for images in (folder / stem, folder / "images" / stem, folder / "images"):
            if images.is_dir():
                return ann, images
    sub = folder / split
    if (sub / "annotations.json").is_file():
        return sub / "annotations.json", sub / "images"
    return None


def load_datasets(config: Config, *, builtin_root: str | os.PathLike | None = None) -> tuple[Any, Any]:
    """The training and validation datasets ``config.data.path`` names.

    - ``"builtin"``: :func:`yolo_func.data.builtin_dataset` (task, ``"train"`` / ``"val"``).
    - a COCO folder: ``annotations/instances_train*.json`` and ``instances_val*.json`` (pose:
      ``person_keypoints_*``) with images in ``<folder>/train2017`` (the JSON's suffix),
      ``<folder>/images/train2017`` or ``<folder>/images``; or ``train/annotations.json`` and
      ``val/annotations.json`` with ``images/`` beside each; or one ``annotations.json`` with
      ``images/`` (then the one split is trained and validated on, e.g. ``coco-tiny`` overfitting).
    - a COCO JSON: its images in ``data.images`` (default ``images/`` beside the JSON, else the
      JSON's folder); trained and validated on.
    - a YOLO ``data.yaml``: its ``train`` and ``val`` splits.

    Returns:
      ``(train_dataset, val_dataset)``.

    Raises:
      ValueError: the path does not exist or is none of these (the message says what was looked for).
    """
    task, path = config.model.task, config.data.path
    if path == "builtin":
        return (builtin_dataset(task, "train", root=builtin_root, seed=0),
                builtin_dataset(task, "val", root=builtin_root, seed=0))
    p = Path(path)
    if not p.exists():
        raise ValueError(f"[yolo_func] data.path {path!r} does not exist; give 'builtin', a COCO folder, a COCO JSON "
                         "(with data.images) or a YOLO data.yaml")
    if p.is_file() and p.suffix in (".yaml", ".yml"):
        return YoloDataset(p, "train", task=task), YoloDataset(p, "val", task=task)
    if p.is_file() and p.suffix == ".json":
        images = Path(config.data.images) if config.data.images else (p.parent / "images" if (p.parent / "images").is_dir() else p.parent)
        ds = CocoDataset(p, images, task=task)
        return ds, ds
    if p.is_dir():
        train, val = _coco_split(p, "train", task), _coco_split(p, "val", task)
        if train and val:
            return CocoDataset(*train, task=task), CocoDataset(*val, task=task)
        if (p / "annotations.json").is_file():
            images = Path(config.data.images) if config.data.images else p / "images"
            ds = CocoDataset(p / "annotations.json", images, task=task)
            return ds, ds
        if (p / "data.yaml").is_file():
            return YoloDataset(p / "data.yaml", "train", task=task), YoloDataset(p / "data.yaml", "val", task=task)
    raise ValueError(f"[yolo_func] data.path {path!r} is not a dataset: expected a folder with annotations/"
                     f"{'person_keypoints' if task == 'pose' else 'instances'}_{{train,val}}*.json, train/ and val/ "
                     "folders with annotations.json, one annotations.json with images/, a data.yaml; or a COCO "
                     ".json file or a YOLO .yaml file")


def _resolve_model_config(config: Config, train_ds: Any) -> Config:
    """``model.num_classes`` and (pose) ``model.kpt_shape`` filled from the data (checked when given)."""
    k_data = len(train_ds.names)
    k = config.model.num_classes
    if k is not None and k < k_data:
        raise ValueError(f"[yolo_func] model.num_classes={k} but the data has {k_data} classes ({list(train_ds.names)[:5]}...); "
                         f"set model.num_classes={k_data} or leave it none")
    changes: dict[str, Any] = {"num_classes": k if k is not None else k_data}
    kpt = getattr(train_ds, "kpt_shape", None)
    if config.model.task == "pose" and kpt is not None and tuple(kpt) != tuple(config.model.kpt_shape):
        changes["kpt_shape"] = tuple(int(v) for v in kpt)
    return dataclasses.replace(config, model=dataclasses.replace(config.model, **changes))


# --------------------------------------------------------------------------------------------- model


def _items(tree: Any) -> dict[str, tuple]:
    return {p: tuple(x.shape) for p, x in T.tree_items(tree)}


def _sub(flat: dict[str, torch.Tensor], prefix: str) -> dict:
    """The nested tree under ``prefix/`` of a ``{path: tensor}`` table."""
    return T.tree_from_flat_dict({p[len(prefix) + 1:]: v for p, v in flat.items() if p.startswith(prefix + "/")})


def _weights_from_file(path: str) -> tuple[dict, dict, str]:
    """(params, state, description) from our checkpoint (training: the EMA weights; weights-only:
    its params and state) or a reference ``.pt``."""
    from yolo_func.io.checkpoint import read_checkpoint
    from yolo_func.io.ultralytics import load_reference_model

    p = Path(path)
    if not p.is_file():
        raise ValueError(f"[yolo_func] model.weights {path!r} is not a file; give our checkpoint (weights/best.pt) or a reference .pt")
    try:
        payload = read_checkpoint(p)
    except ValueError:
        ref = load_reference_model(p)  # raises a ValueError naming the file when it is neither
        return ref.params, ref.state, f"reference weights {p.name} (yolov8{ref.model.scale} {ref.model.task}, {ref.model.num_classes} classes)"
    flat = payload["tensors"]
    if any(k.startswith("ema/ema/params/") for k in flat):
        return _sub(flat, "ema/ema/params"), _sub(flat, "ema/ema/state"), f"the EMA weights of {p}"
    if any(k.startswith("params/") for k in flat):
        return _sub(flat, "params"), _sub(flat, "state"), f"the weights of {p}"
    raise ValueError(f"[yolo_func] model.weights {path!r} is a yolo_func checkpoint without params/ or ema/ tensors; "
                     "give a training checkpoint (weights/last.pt, best.pt) or a reference .pt")


def build_model(config: Config, gen: torch.Generator, *, log: Callable[[str], None] = print) -> tuple[Model, dict, dict]:
    """The model of ``config.model`` and its starting params and BN statistics (CPU, float32).

    Without ``model.weights``: the seeded init (``gen``). With it: the network from the file (its
    scale must match) and each head from the file when the file has it with the same shapes, else
    re-initialised from ``gen`` (another class count, another task), which ``log`` reports.

    Raises:
      ValueError: unreadable weights, or a network of another scale.
    """
    m = config.model
    model = yolov8(m.scale, task=m.task, num_classes=m.num_classes, kpt_shape=m.kpt_shape)
    params, state = model.init(gen)
    if m.weights is None:
        return model, params, state
    w_params, w_state, what = _weights_from_file(m.weights)
    net_p, net_s = w_params.get("network"), w_state.get("network")
    if net_p is None or _items(net_p) != _items(params["network"]) or _items(net_s) != _items(state["network"]):
        raise ValueError(f"[yolo_func] model.weights: {what} do not fit the yolov8{m.scale} network "
                         f"({T.tree_diff(params['network'], net_p or {}, names=('model', 'weights')).splitlines()[:3]}); "
                         "pick the recipe of the weights' scale (--model)")
    params = {"network": net_p, "heads": dict(params["heads"])}
    state = {"network": net_s, "heads": dict(state["heads"])}
    fresh = []
    for name in model.heads:
        hp, hs = w_params.get("heads", {}).get(name), w_state.get("heads", {}).get(name)
        if hp is not None and hs is not None and _items(hp) == _items(params["heads"][name]) and _items(hs) == _items(state["heads"][name]):
            params["heads"][name], state["heads"][name] = hp, hs
        else:
            fresh.append(name)
    msg = f"starting from {what}"
    if fresh:
        msg += (f"; head(s) {fresh} re-initialised (the weights' heads do not fit {m.num_classes} classes"
                f"{', ' + str(m.kpt_shape) + ' keypoints' if m.task == 'pose' else ''} or are missing)")
    log(msg)
    params = T.tree_map(lambda x: x.float().contiguous(), params)
    state = T.tree_map(lambda x: x.float().contiguous(), state)
    return model, params, state


# ------------------------------------------------------------------------------------------ validate


def validate(model: Model, params: dict, state: dict, loader: ValLoader, dataset: Any, *, config: Config,
             device: torch.device, autocast_dtype: torch.dtype | None = None, progress: bool = True,
             desc: str = "val", coco: CocoEvaluator | None = None, gather: bool = False,
             gt_cache: dict | None = None) -> dict:
    """The reference's per-epoch validation (REFERENCE.md §3.1, §3.6) on given weights.

    Rect batches (``loader``) -> ``model.predict`` (eval mode) -> :func:`postprocess` (multi-label,
    ``val.conf`` / ``val.iou`` / ``val.max_det``; masks at the prototype resolution) -> boxes and
    keypoints back to original pixels (:func:`scale_to_original`; the ground truth through
    :func:`yolo_func.data.loader.val_boxes_to_original`) -> :class:`MetricAccumulator` (masks
    compared at a quarter of the letterboxed input against the reference's overlap-form ground
    truth, :func:`yolo_func.eval.gt_masks.val_gt_masks`).

    With ``coco``, each image's detections in original pixels also go to ``coco.process`` (COCO
    result records; the metric is unchanged): the same detections the metric scores for detect and
    pose; for segment the same NMS's detections with masks assembled at the original size from the
    coefficients (:func:`~yolo_func.eval.postprocess.postprocess_with_coco`, as
    :func:`yolo_func.eval.evaluate` does), only for the first ``coco.max_per_category`` (100) of
    each image and category: all ``COCOeval`` reads.

    Args:
      model: the :class:`Model`.
      params, state: the weights (the EMA's during training).
      loader: a :class:`ValLoader` over ``dataset``.
      dataset: the validation dataset (segment: read again for the ground-truth masks).
      config: the run's config (``val.*``, ``model.kpt_shape``).
      device: where to run.
      autocast_dtype: e.g. ``torch.bfloat16`` on CUDA.
      progress: show a tqdm bar.
      coco: a :class:`~yolo_func.eval.CocoEvaluator` to feed (its ``category_ids`` map the model's
        classes), or None.
      gather: data-parallel validation: ``loader`` is this rank's shard (``ValLoader(shard=)``);
        every rank's accumulated matches (and COCO records) are gathered, so every rank returns
        the metrics of the whole validation set (and ``coco`` holds every rank's records).
      gt_cache: a dict kept across calls on the same data (the fit keeps one for the run): the
        ground-truth masks of each image (rasterised from the annotations and warped into the
        letterbox: the same at every epoch) are computed once and reused.

    Returns:
      :meth:`MetricAccumulator.compute`'s dict (``box`` and ``mask`` / ``pose``: P, R, mAP50, mAP50-95; ``fitness``).
    """
    from tqdm.auto import tqdm

    acc = MetricAccumulator()
    task = model.task
    index_of = {int(i): k for k, i in enumerate(getattr(dataset, "image_ids", range(len(dataset))))}
    kpt_shape = tuple(config.model.kpt_shape) if task == "pose" else None
    for vb in tqdm(loader, desc=desc, leave=False, disable=not progress, dynamic_ncols=True):
        vb: ValBatch
        x = _images_to(vb.images, device).float() / 255  # channels-last on a GPU, as evaluate
        if autocast_dtype is not None:
            with torch.autocast(device.type, dtype=autocast_dtype):
                inf = model.predict(params, state, x)
        else:
            inf = model.predict(params, state, x)
        inf = type(inf)(*(None if t is None else t.float() for t in inf))
        post = dict(conf=config.val.conf, iou=config.val.iou, max_det=config.val.max_det, multi_label=True, kpt_shape=kpt_shape)
        native = None
        if coco is not None and inf.protos is not None:  # COCO masks at the original size (evaluate's path)
            letterboxes = [Letterbox((int(h), int(w)), (float(gy), float(gx)), (float(px), float(py))) for (h, w), (gx, gy), (px, py)
                           in zip(vb.orig_shapes.tolist(), vb.gains.tolist(), vb.pads.tolist())]
            # one NMS for both; native masks only for the detections COCOeval can read (the first
            # coco.max_per_category of each image and category)
            dets, native = postprocess_with_coco(
                inf, **post, mask_method="val", coco_letterbox=letterboxes, max_per_category=coco.max_per_category,
                category_of=None if coco.category_ids is None else category_groups(coco.category_ids))
        else:
            dets = postprocess(inf, **post, mask_method="val")
        t = vb.targets
        gts, outs = [], []
        for b, det in enumerate(_dets_to_host(dets)):
            gx, gy = (float(v) for v in vb.gains[b])
            pad = tuple(float(v) for v in vb.pads[b])
            orig = tuple(int(v) for v in vb.orig_shapes[b])
            masks = det.masks
            # unclipped, as the reference's metric scores them (clipping lifts border boxes' IoU)
            det = scale_to_original(det._replace(masks=None), orig_shape=orig, gain=(gy, gx), pad=pad, clip=False)
            outs.append(det._replace(masks=masks))
            keep = t.valid[b]
            boxes = val_boxes_to_original(t.boxes[b][keep].float(), vb.gains[b], vb.pads[b], vb.orig_shapes[b])
            kp = None
            if t.keypoints is not None:
                k = t.keypoints[b][keep].float()
                kx = ((k[..., 0] - pad[0]) / gx).clamp(0, orig[1])
                ky = ((k[..., 1] - pad[1]) / gy).clamp(0, orig[0])
                kp = torch.stack((kx, ky, k[..., 2]), -1)
            gm = None
            if masks is not None:
                key = (int(vb.image_ids[b]), tuple(vb.images.shape[-2:]), (gx, gy), pad)
                gm = gt_cache.get(key) if gt_cache is not None else None
                if gm is None:  # rasterised once per image and letterbox, kept across the fit's validations
                    gm = val_gt_masks(dataset, index_of[int(vb.image_ids[b])], orig_shape=orig, gain=(gx, gy),
                                      pad=pad, shape=tuple(vb.images.shape[-2:]))
                    if gt_cache is not None:
                        gt_cache[key] = gm
            gts.append(GroundTruth(boxes, t.classes[b][keep], gm, kp))
        acc.process(outs, gts)
        if coco is not None:
            coco.process([int(i) for i in vb.image_ids], native if native is not None else
                         [clip_detections(d, o) for d, o in zip(outs, vb.orig_shapes.tolist())])
    if gather:
        _gather_validation(acc, coco)
    return acc.compute()


def _dets_to_host(dets: list) -> list:
    """The batch's :class:`Detections` on the host: one copy per field for the whole batch (the
    images concatenated, copied ``non_blocking``, one wait), then split per image, instead of a
    blocking copy per image and field."""
    if not dets or dets[0].boxes.device.type == "cpu":
        return dets
    counts = [int(d.boxes.shape[0]) for d in dets]
    fields = [None if getattr(dets[0], f) is None else torch.cat([getattr(d, f) for d in dets]).to("cpu", non_blocking=True)
              for f in type(dets[0])._fields]
    torch.cuda.current_stream(dets[0].boxes.device).synchronize()  # the copies have landed
    parts = [None if v is None else v.split(counts) for v in fields]
    return [type(dets[0])(*(None if p is None else p[i] for p in parts)) for i in range(len(dets))]


def _gather_validation(acc: MetricAccumulator, coco: CocoEvaluator | None) -> None:
    """Merge every rank's accumulated validation into ``acc`` (and ``coco``), in rank order, on
    every rank (one ``all_gather_object``: numpy arrays and COCO record dicts)."""
    mine = {"tp": acc._tp, "conf": acc._conf, "cls": acc._cls, "target_cls": acc._target_cls}
    if coco is not None:
        mine["coco"] = (coco._results, coco._image_ids, coco._has_masks, coco._has_kpts)
    parts = D.gather_objects(mine)
    acc.reset()
    if coco is not None:
        coco.reset()
    for part in parts:
        for kind, arrays in part["tp"].items():
            acc._tp.setdefault(kind, []).extend(arrays)
        acc._conf.extend(part["conf"])
        acc._cls.extend(part["cls"])
        acc._target_cls.extend(part["target_cls"])
        if coco is not None:
            results, ids, has_masks, has_kpts = part["coco"]
            coco._results.extend(results)
            coco._image_ids.extend(ids)
            coco._has_masks |= has_masks
            coco._has_kpts |= has_kpts


# ------------------------------------------------------------------------------------------- the loop


def _to_device(batch: Batch, device: torch.device) -> Batch:
    if device.type == "cpu":  # NCHW memory on the CPU (the loader's is NHWC: the CUDA network's layout)
        return batch._replace(images=batch.images.contiguous())
    t = batch.targets
    return Batch(batch.images.to(device, non_blocking=True),
                 Targets(*(None if v is None else v.to(device, non_blocking=True) for v in t)))


def _loader_augment(config: Config) -> LoaderAugment:
    a = config.data.augment
    return LoaderAugment(**{f.name: getattr(a, f.name) for f in dataclasses.fields(LoaderAugment) if hasattr(a, f.name)})


def _optimizer(config: Config, batches_per_epoch: int, world_size: int = 1) -> YoloOptimizer:
    # data-parallel: the nominal batch (accumulation, weight-decay scaling) is the global batch
    o = config.optim
    return yolo_sgd(batch_size=config.data.batch_size * world_size, batches_per_epoch=batches_per_epoch, epochs=config.train.epochs,
                    lr0=o.lr0, lrf=o.lrf, momentum=o.momentum, weight_decay=o.weight_decay, warmup_epochs=o.warmup_epochs,
                    warmup_bias_lr=o.warmup_bias_lr, warmup_momentum=o.warmup_momentum, cos_lr=o.cos_lr, nbs=o.nbs,
                    max_norm=o.max_norm)


class _Interrupt:
    """SIGINT while training: the first sets a flag (the loop saves and stops after the current
    step), a second raises KeyboardInterrupt at once."""

    def __init__(self) -> None:
        self.requested = False
        self._previous = None

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __enter__(self) -> "_Interrupt":
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


def _coco_setup(config: Config, val_data: Any, rd: RunDir) -> tuple[Any, list[int], coco_background.BackgroundCoco] | None:
    """``(ground truth COCO, category id of each model class, the background evaluator)`` when
    ``val.coco`` is on for ``val_data`` (:func:`~yolo_func.train.coco_background.resolve_coco`), else None."""
    if not coco_background.resolve_coco(config.val.coco, val_data):
        return None
    from yolo_func.eval.evaluate import dataset_categories

    gt, category_ids = dataset_categories(val_data)
    gt = load_coco(gt)  # a CocoDataset's own COCO as is; a built dict indexed once, not per epoch
    # a model with more classes than the data (model.num_classes): ids no ground truth has, never matched
    category_ids = list(category_ids) + [-1 - k for k in range(max(config.model.num_classes - len(category_ids), 0))]
    return gt, category_ids, coco_background.BackgroundCoco(gt, run_dir=rd)


def _gpu_mem(device: torch.device) -> str:
    if device.type != "cuda":
        return "-"
    return f"{torch.cuda.memory_reserved(device) / 2**30:.1f}G"


_IMPORT_SWITCH_INTERVAL_S = 2e-4


def _warm_imports(module: str = "torch._dynamo") -> None:
    """Import ``module`` on a thread while the data and the model are set up, instead of at the
    first differentiated step: ``torch._dynamo`` for the ``"func"`` backend (``torch.func``'s first
    backward imports it: 4.9-5.1 s on the H200 host), ``torch.fx.experimental.symbolic_shapes``
    (with sympy) for ``"autograd"`` (``torch.autograd.grad`` with explicit output gradients imports
    it: 0.7 s on a 2-core CPU). The set-up waits on the GIL-free CUDA context, worker start-up
    and file reads meanwhile."""

    # While the import runs, the main thread's torch calls (each releases and retakes the GIL) would
    # wait up to the 5 ms switch interval for the importing thread at every op: thousands of ops in
    # init_train_state and the first warm-up (seconds on the H200 host). A short interval bounds that.
    interval = sys.getswitchinterval()
    sys.setswitchinterval(min(interval, _IMPORT_SWITCH_INTERVAL_S))

    def run() -> None:
        try:
            importlib.import_module(module)
        except Exception:  # noqa: BLE001 -- only a head start; the step imports it again if this failed
            return
        finally:
            sys.setswitchinterval(interval)

    threading.Thread(target=run, name="yolo_func-imports", daemon=True).start()


class _FollowerRunDir:
    """A rank > 0's view of the run folder: reads it (resume, best row), writes nothing (rank 0
    owns results.csv, events.jsonl, the checkpoints and the plots)."""

    def __init__(self, rd: RunDir):
        self._rd = rd

    def __getattr__(self, name: str):
        return getattr(self._rd, name)

    def begin(self, *args, **kwargs) -> None:
        """Rank 0 writes the run's header."""

    def save(self, *args, **kwargs) -> None:
        """Rank 0 writes the checkpoints."""

    def wait(self) -> None:
        """No checkpoint write of this rank to wait for."""

    def event(self, *args, **kwargs) -> None:
        """Rank 0 writes events.jsonl."""

    def log_epoch(self, row: dict, **kwargs) -> bool:
        return False  # rank 0's verdict is broadcast

    def summary(self) -> str:
        return ""


def _capture_for_ranks(level: str, asked: str, model: Model, sync_bn: bool, say) -> str:
    """The replay level of a data-parallel rank: the gradient all-reduce runs between the replayed
    backward and the update, so ``"step"`` (one graph holding both) becomes ``"network+heads"``;
    with SyncBN the network's forward and backward hold collectives: eager."""
    if level == "none":
        return level
    if sync_bn:
        say("train.sync_bn: the network runs eagerly (its BN layers all-reduce inside forward and backward)")
        return "none"
    if level == "step":
        if asked == "step":
            say("capture 'step' holds backward and update in one graph; data-parallel runs use 'network+heads' "
                "(the all-reduce runs between them)")
        return "network+heads" if all(h.capturable for h in model.heads.values()) else "network"
    return level


def fit(config: Config, *, train_data: Any = None, val_data: Any = None, root: str | os.PathLike = "runs",
        on_step: Callable[[StepInfo], None] | None = None, progress: bool = True, log_every: int = 10,
        builtin_root: str | os.PathLike | None = None) -> FitResult:
    """Train a model as ``config`` says, in a run folder (see the module docstring).

    Args:
      config: the :class:`Config` (``configs.build_config`` / a recipe's ``get_config()``).
      train_data, val_data: datasets to use instead of ``config.data.path`` (random-access sources
        of :class:`yolo_func.data.Sample` with ``names``; e.g. ``builtin_dataset(..., num_images=8)``);
        give both or neither.
      root: where ``runs/<task>/<name>`` folders go when ``train.out`` is not set.
      on_step: called after every step with a :class:`StepInfo`; raising :class:`KeyboardInterrupt`
        there stops the run as Ctrl-C does (``last.pt`` saved at the next batch's position).
      progress: tqdm bars (training and validation) and the final summary on stdout.
      log_every: steps between two metric reads for the progress bar (copied without a host sync,
        shown one log step late on CUDA; :class:`yolo_func.train.metrics.MetricsReader`).
      builtin_root: the built-in data's cache folder (default ``~/.cache/yolo_func``).

    Returns:
      :class:`FitResult`.

    Raises:
      ValueError: a bad data path, weights file or device; a run folder of another run; a
        checkpoint that does not fit the config (each message names the file or key).

    Example:
      >>> import tempfile
      >>> from yolo_func.configs import build_config
      >>> from yolo_func.data import builtin_dataset
      >>> tmp = tempfile.mkdtemp()
      >>> config = build_config("builtin-cpu", flags={"epochs": 1, "imgsz": 64, "batch": 4, "out": f"{tmp}/run"},
      ...                       overrides=["data.workers=0", "train.plots=false", "val.coco=off"])
      >>> result = fit(config, train_data=builtin_dataset("detect", "train", num_images=8, root=tmp),
      ...              val_data=builtin_dataset("detect", "val", num_images=4, root=tmp), progress=False)
      >>> result.stopped, result.epochs_done, result.steps, sorted(p.name for p in (result.run_dir / "weights").iterdir())
      ('completed', 1, 2, ['best.pt', 'last.pt'])
    """
    from tqdm.auto import tqdm

    if not isinstance(config, Config):
        raise TypeError(f"[yolo_func] fit expects a Config (yolo_func.configs.build_config); got {type(config).__name__}")
    if (train_data is None) != (val_data is None):
        raise ValueError("[yolo_func] fit: give both train_data and val_data, or neither (then config.data.path is read)")
    t_start = time.monotonic()
    # data-parallel (started by torchrun / --devices): join the process group; rank 0 alone
    # shows progress and writes the run folder (docs/distributed.md)
    created_group = D.env_world() is not None and not torch.distributed.is_initialized()
    ctx = D.init_distributed(config.train.device) if D.env_world() is not None else None
    world, rank = (ctx.world_size, ctx.rank) if ctx is not None else (1, 0)
    progress = progress and rank == 0
    say = print if progress else (lambda *a, **k: None)
    if ctx is None:
        rd = RunDir.for_config(config, root=root)
    else:  # rank 0 picks the folder (exp, exp2, ...); the others follow it
        path = D.broadcast_object(str(RunDir.for_config(config, root=root).path) if rank == 0 else None)
        rd = RunDir(path, task=config.model.task)
        if rank != 0:
            rd = _FollowerRunDir(rd)
    position, elapsed_before = None, 0.0
    if rd.resumable:
        saved, position, meta = read_training_checkpoint(rd.last)
        # The checkpoint's config rules (model, data, optimizer, schedule length): resuming must
        # continue the same run. Options of this process apply: device, time limit, plots, val.coco.
        now = {"device": config.train.device, "time_limit_hours": config.train.time_limit_hours,
               "plots": config.train.plots, "out": str(rd.path), "resume": config.train.resume}
        resumed = dataclasses.replace(saved, train=dataclasses.replace(saved.train, **now),
                                      val=dataclasses.replace(saved.val, coco=config.val.coco))
        ignored = sorted(k for k in config_diff(resumed, config)
                         if k not in ("model.num_classes", "model.kpt_shape", "train.out", "train.name"))
        if ignored:
            warnings.warn(f"[yolo_func] resuming {str(rd.path)!r} with its own config; these options differ from it and "
                          f"are ignored: {ignored} (start a new run in another folder to change them)", UserWarning,
                          stacklevel=2)
        config = resumed
        elapsed_before = float(meta.get("elapsed", 0.0))
    if train_data is None:
        train_data, val_data = load_datasets(config, builtin_root=builtin_root)
    config = _resolve_model_config(config, train_data)
    device = ctx.device if ctx is not None else resolve_device(config.train.device)
    if device.type == "cpu":  # the functional step's fresh allocations reuse freed pages (host_memory.py)
        keep_freed_host_memory()
    gen = torch.Generator().manual_seed(config.train.seed)
    # a resumed run takes its weights from last.pt (model.weights only shapes the start of a run)
    start = config if position is None else dataclasses.replace(config, model=dataclasses.replace(config.model, weights=None))
    model, params, state = build_model(start, gen, log=say)
    level = resolve_capture(config.train.capture, model, device)
    sync_bn = ctx is not None and config.train.sync_bn
    if ctx is not None:
        level = _capture_for_ranks(level, config.train.capture, model, sync_bn, say)
    dtype = autocast_dtype(config.train.autocast, device)
    val_dtype = eval_autocast_dtype(config.val.precision, device)  # FP16 on CUDA: BF16 blurs high-IoU boxes
    compile_mode = resolve_compile(config.train.compile, device)
    if sync_bn and compile_mode != "none":
        say("train.sync_bn: the network runs uncompiled (SyncBN's all-reduce is not traced by torch.compile)")
        compile_mode = "none"
    workers = config.data.workers
    loader = TrainLoader(train_data, batch_size=config.data.batch_size, image_size=config.data.image_size,
                         workers=workers, cache=config.data.cache, seed=config.train.seed, task=config.model.task,
                         augment=_loader_augment(config), epochs=config.train.epochs, max_boxes=config.data.max_boxes,
                         mask_source=config.data.mask_source, prefetch_factor=config.data.prefetch, rank=rank,
                         world_size=world)
    # the workers load the first batches while the model state, optimizer and captures are set up
    first = position if position is not None else DataPosition(0, 0, config.train.seed)
    if first.epoch < config.train.epochs:
        loader.set_epoch(first.epoch, start_batch=first.batch)
        loader.start()
    # after the workers' fork: no child forked while a thread holds an import lock
    vjp = resolve_vjp(config.train.vjp, device)
    _warm_imports("torch._dynamo" if vjp == "func" or compile_mode != "none"
                  else "torch.fx.experimental.symbolic_shapes")
    nb = len(loader)
    val_batch = config.val.batch_size or 2 * config.data.batch_size
    # a small validation set needs no more workers than it has batches (each is a fork of this process)
    val_workers = min(workers, 4, math.ceil(len(val_data) / (val_batch * world)))
    val_loader = ValLoader(val_data, batch_size=val_batch, image_size=config.data.image_size, workers=val_workers,
                           task=config.model.task, shapes=getattr(val_data, "image_sizes", None), shard=(rank, world),
                           producer=device.type != "cpu")  # batches built ahead on a thread beside a GPU
    coco = _coco_setup(config, val_data, rd)
    if coco is not None and rank == 0:
        coco[2].start()  # the scoring interpreter imports while the fit starts and trains its first epoch
    opt = _optimizer(config, nb, world)
    ema = make_ema(config.optim.ema_decay, config.optim.ema_tau)
    # the lazy CUDA set-up (kernel modules, cuDNN, cuBLAS) on a thread while init_train_state runs;
    # joined before the first step (opt-in: YOLO_FUNC_CUDA_WARM=1; see yolo_func.train.cuda_warm)
    warm = start_cuda_warmup(model, opt.tx, device=device, autocast_dtype=dtype, ema=ema) if ctx is None else None
    ts = init_train_state(model, opt.tx, gen, device=device, ema=ema, params=params, state=state)
    # at "step" the targets' bucket (boxes per image, a power of two) is part of the capture key
    # one eager warm-up run per capture: the first sets up every lazy CUDA state (kernels, cuDNN plans,
    # cuBLAS handles); more only add ~0.1 s per target bucket to a fit's start-up
    step_fn = ReplayTrainStep(model, opt.tx, ema=ema, capture=level, autocast_dtype=dtype, max_captures=8, warmup=1,
                              grad_reduce=D.GradReducer() if ctx is not None else None, compile=compile_mode,
                              vjp=vjp)
    compile_reported = 0.0  # compile seconds already written to events.jsonl
    if sync_bn:
        from yolo_func.nn import sync_batchnorm

        def bn_context():
            return sync_batchnorm(D.differentiable_all_reduce)
    else:
        bn_context = contextlib.nullcontext
    generators = {"init": gen}
    if position is not None:
        ck = rd.load_last(ts, config=config)
        ts = ck.train_state
        restore_rng(ck.rng, generators)
        say(f"resuming {rd.path} at epoch {position.epoch + 1}, batch {position.batch} (step {int(ts.step)})")
    else:
        position = DataPosition(0, 0, config.train.seed)
    rd.begin(config, position=position if rd.resumable else None)
    names = list(getattr(train_data, "names", [])) or None
    task = config.model.task
    parts_keys = [f"loss/{p}" for p in _PARTS[task]]
    epochs = config.train.epochs
    limit_s = config.train.time_limit_hours * 3600 if config.train.time_limit_hours else None
    best_row = rd.best_row()
    best_epoch = best_row["epoch"] if best_row else 0
    last_metrics = None
    stopped = "completed"
    epoch = position.epoch
    start_batch = position.batch
    steps = int(ts.step) if device.type == "cpu" else int(ts.step.item())  # once, before the loop
    plots = config.train.plots
    say(f"training yolov8{config.model.scale} {task} ({config.model.num_classes} classes) on {device} "
        f"(capture {level!r}{', ' + str(dtype).removeprefix('torch.') if dtype else ''}"
        f"{', compile ' + repr(compile_mode) if compile_mode != 'none' else ''}"
        f"{', vjp ' + repr(vjp) if vjp != 'func' else ''}), {len(train_data)} train / "
        f"{len(val_data)} val images, {nb} batches of {config.data.batch_size} per epoch, run folder {rd.path}")
    if ctx is not None:
        say(f"data-parallel: {world} processes ({ctx.backend}), global batch {world * config.data.batch_size} "
            f"({config.data.batch_size} per rank), BN statistics {'synchronised (sync_bn)' if sync_bn else 'per rank'}")

    def sync_ranks() -> None:
        # before a validation or a checkpoint: per-rank BN statistics (no sync_bn) averaged over the
        # ranks (the EMA's too), and a check that the parameters are still the same everywhere
        if ctx is None:
            return
        if not sync_bn:
            trees = {"state": ts.state}
            if ts.ema is not None:
                trees["ema"] = ts.ema.ema["state"]
            D.all_reduce_tree_(trees, op="mean")
        D.check_in_sync(ts.params, device=device)

    def vote(interrupted: bool, timed_out: bool) -> tuple[bool, bool]:
        # every rank stops after the same step: the local flags are OR-ed over the ranks
        if ctx is None:
            return interrupted, timed_out
        t = torch.tensor([int(interrupted), int(timed_out)], dtype=torch.int32, device=device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        a, b = t.tolist()
        return bool(a), bool(b)

    def save(pos: DataPosition, *, best: bool = False, extra_meta: dict | None = None, background: bool = True) -> None:
        # the epoch's checkpoint is written on a thread while the next epoch trains (RunDir.save)
        meta = {"elapsed": elapsed_before + time.monotonic() - t_start, "steps": steps, **(extra_meta or {})}
        rd.save(ts, config=config, position=pos, rng=capture_rng(generators), meta=meta, best=best,
                background=background)

    def row_for(epoch_done: int, sums: torch.Tensor | None, count: int, metrics: dict | None) -> dict:
        row: dict[str, Any] = {"epoch": epoch_done, "time": round(elapsed_before + time.monotonic() - t_start, 3)}
        if sums is not None and count:
            means = (sums / count).tolist()
            for key, v in zip(parts_keys, means):
                row[f"loss/{key.rsplit('/', 1)[-1]}"] = v
        ni = torch.tensor(max(steps - 1, 0), dtype=torch.int64)
        for g in ("decay", "no_decay", "bias"):
            row[f"lr/{g}"] = float(opt.schedules.lr[g](ni))
        if metrics is not None:
            for k in _KINDS[task]:
                row[f"{k}/mAP50"] = metrics.get(k, {}).get("mAP50", 0.0)
                row[f"{k}/mAP50-95"] = metrics.get(k, {}).get("mAP50-95", 0.0)
        return row

    gt_cache: dict = {}  # the validation images' ground-truth masks, rasterised at the first validation

    def run_validation(epoch_index: int) -> tuple[dict, CocoEvaluator | None]:
        e_params, e_state = ts.ema.ema["params"], ts.ema.ema["state"]
        records = None
        if coco is not None:
            gt, category_ids, background = coco
            records = CocoEvaluator(gt, category_ids=category_ids, verbose=False)
        metrics_v = validate(model, e_params, e_state, val_loader, val_data, config=config, device=device,
                             autocast_dtype=val_dtype, progress=progress, desc=f"val {epoch_index + 1}/{epochs}", coco=records,
                             gather=ctx is not None, gt_cache=gt_cache)
        return metrics_v, records

    def submit_coco(epoch_index: int, records: CocoEvaluator | None) -> None:
        # scored by pycocotools while the next epoch trains; submitted after the epoch's row so that its
        # "coco" event always follows the epoch's "epoch" event
        if records is not None and rank == 0:
            coco[2].submit(epoch_index + 1, records.results, image_ids=records.image_ids, iou_types=records.iou_types)

    if warm is not None:
        warm.join()  # no capture runs beside it
        if warm.error is not None:
            say(f"the CUDA warm-up thread failed ({type(warm.error).__name__}: {warm.error}); the first step sets up CUDA instead")
    finished_cleanly = False
    try:
        with _Interrupt() as interrupt:
            while epoch < epochs and stopped == "completed":
                loader.set_epoch(epoch, start_batch=start_batch)  # resumed mid-epoch: from the next batch
                sums = torch.zeros(len(parts_keys), dtype=torch.float64, device=device)
                count = 0
                bar = tqdm(total=nb, initial=start_batch, desc=f"epoch {epoch + 1}/{epochs}", leave=True,
                           disable=not progress, dynamic_ncols=True, file=sys.stderr)
                t_epoch, imgs_epoch, shown = time.monotonic(), 0, {}
                reader = MetricsReader()
                b = -1
                t_first = None
                for b, host_batch in enumerate(loader, start=start_batch):
                    if t_first is None:
                        t_first = time.monotonic() - t_epoch  # the wait for the epoch's first batch
                    if plots and epoch == 0 and b == 0 and rank == 0:
                        from yolo_func.train.plots import plot_batch
                        plot_batch(host_batch.images, host_batch.targets, names, rd.path / "train_batch0.png")
                    batch = _to_device(host_batch, device)
                    with bn_context():
                        ts, metrics = step_fn(ts, batch)
                    if step_fn.compile_seconds > compile_reported:  # a first call per shape compiled
                        compile_reported = step_fn.compile_seconds
                        rd.event("compile", step=steps, **compile_times_event(step_fn.compiled))
                        say(f"compiled the network and heads ({compile_mode}) in {compile_reported:.1f} s")
                    steps += 1
                    count += 1
                    sums.add_(torch.stack([metrics[k].detach() for k in parts_keys]))  # 2 kernels (float64 += float32 exact)
                    imgs_epoch += batch.images.shape[0]
                    if on_step is not None:
                        try:
                            on_step(StepInfo(steps, epoch, b, ts, host_batch, metrics))
                        except KeyboardInterrupt:
                            interrupt.requested = True
                    if count % log_every == 0 or b == nb - 1:  # no host sync: the previous log step's values
                        reader.poll()  # the values posted log_every steps ago, if their copy has landed
                        reader.post({k: metrics[k] for k in parts_keys} | {"finite": metrics["finite"], "step": metrics["step"]})
                        m = reader.poll()  # on the CPU: this step's values
                        if m is not None:
                            shown = {k.rsplit("/", 1)[-1]: f"{m[k]:.3f}" for k in parts_keys}
                        rate = imgs_epoch / max(time.monotonic() - t_epoch, 1e-9)
                        bar.set_postfix(shown | {"inst": int(host_batch.targets.valid.sum()),
                                                  "size": config.data.image_size, "img/s": f"{rate:.1f}",
                                                  "mem": _gpu_mem(device)}, refresh=False)
                    bar.update(1)
                    interrupted = interrupt.requested
                    timed_out = limit_s is not None and time.monotonic() - t_start >= limit_s
                    if ctx is not None:  # decided together, at the log steps (the ranks' steps stay in lockstep)
                        at_vote = count % log_every == 0 or b == nb - 1
                        interrupted, timed_out = vote(interrupted, timed_out) if at_vote else (False, False)
                    if interrupted:
                        stopped = "interrupted"
                    elif timed_out:
                        stopped = "time_limit"
                    if stopped != "completed":
                        break
                bar.close()
                start_batch = 0
                if stopped == "interrupted":
                    pos = DataPosition(epoch, b + 1, config.train.seed) if b + 1 < nb else DataPosition(epoch + 1, 0, config.train.seed)
                    rd.wait()
                    sync_ranks()
                    if pos.batch == 0:  # the epoch's last batch was trained: close the epoch first
                        rd.log_epoch(row_for(epoch + 1, sums, count, None))
                    save(pos, background=False)
                    rd.event("interrupt", epoch=pos.epoch, batch=pos.batch, step=steps)
                    epoch = pos.epoch
                    break
                finished = b == nb - 1  # the epoch's last batch was trained (a time limit may coincide)
                last = epoch + 1 == epochs
                do_val = (epoch + 1) % config.train.val_every == 0 or last or stopped == "time_limit"
                sync_ranks()
                t_val = time.monotonic()
                metrics_v, records = run_validation(epoch) if do_val else (None, None)
                if metrics_v is not None:
                    last_metrics = metrics_v
                t_wait = time.monotonic()
                # the previous epoch's checkpoint (written while this epoch trained) is on disk before this
                # epoch's row: events.jsonl keeps epoch, checkpoint, epoch, checkpoint ... in order
                rd.wait()
                t_coco = time.monotonic()
                if records is not None and rank == 0:
                    coco[2].collect(wait=True)  # the previous evaluation, if still running (submit waits for it)
                timing = {"first_batch": t_first or 0.0, "train": t_val - t_epoch, "val": t_wait - t_val,
                          "checkpoint_wait": t_coco - t_wait, "coco_wait": time.monotonic() - t_coco}
                is_best = rd.log_epoch(row_for(epoch + 1, sums, count, metrics_v), timing=timing)
                if ctx is not None:
                    is_best = bool(D.broadcast_object(is_best))
                submit_coco(epoch, records)
                if is_best:
                    best_epoch = epoch + 1
                pos = DataPosition(epoch + 1, 0, config.train.seed) if finished else DataPosition(epoch, b + 1, config.train.seed)
                save(pos, best=is_best)
                if metrics_v is not None:
                    say("  " + ", ".join(f"{k} mAP50 {metrics_v[k]['mAP50']:.4f} mAP50-95 {metrics_v[k]['mAP50-95']:.4f}"
                                         for k in _KINDS[task] if k in metrics_v))
                epoch = pos.epoch
                if stopped == "completed" and config.train.patience and epoch - best_epoch >= config.train.patience \
                        and epoch < epochs:
                    stopped = "early_stop"
                    say(f"early stopping: no better fitness in the last {config.train.patience} epochs (best: epoch {best_epoch})")
                if coco is not None:
                    coco[2].collect()  # a finished evaluation's numbers (or its failure, warned about) now
        finished_cleanly = True
    finally:
        loader.close()
        rd.wait()  # the last checkpoint write, if one is in flight
        if coco is not None and not finished_cleanly:  # an exception: never wait for pycocotools
            coco[2].abandon()
    if stopped == "time_limit" and epoch >= epochs:
        stopped = "completed"  # the limit struck on the very last batch
    if stopped == "time_limit":
        say(f"time limit of {config.train.time_limit_hours} h reached; stopped at step {steps}")
    if stopped == "interrupted":
        say(f"interrupted: saved {rd.last} (resume with the same command or --out {rd.path})")
    try:
        if plots and rank == 0:  # while the last COCO evaluation runs
            _final_plots(rd, model, ts, val_loader, names, device, val_dtype, config)
    except BaseException:
        if coco is not None:
            coco[2].abandon()
        raise
    coco_final = None
    if coco is not None:  # the last evaluation's numbers are waited for (briefly when interrupted)
        background = coco[2]
        if background.in_flight is not None and stopped != "interrupted":
            say(f"waiting for the COCO evaluation of epoch {background.in_flight}")
        coco_final = background.finish(timeout=coco_background.INTERRUPT_WAIT_S if stopped == "interrupted" else None)
    rd.event("end", stopped=stopped, steps=steps, epochs=epoch)
    say(rd.summary())
    if created_group:  # every rank is done (rank 0's files are written) before the group goes
        D.barrier(device)
        D.shutdown()
    return FitResult(rd.path, ts, epoch, steps, stopped, rd.best_row(), last_metrics, coco_final)


@torch.no_grad()
def _final_plots(rd: RunDir, model: Model, ts: TrainState, val_loader: ValLoader, names, device, dtype, config) -> None:
    """``results.png`` and one validation image's predictions beside its ground truth."""
    from yolo_func.train.plots import plot_predictions, plot_results

    if rd.results_path.is_file():
        plot_results(rd.results_path, rd.path / "results.png")
    vb = next(iter(val_loader), None)
    if vb is None:
        return
    x = vb.images[:1].to(device).float() / 255
    if dtype is not None:
        with torch.autocast(device.type, dtype=dtype):
            inf = model.predict(ts.ema.ema["params"], ts.ema.ema["state"], x)
    else:
        inf = model.predict(ts.ema.ema["params"], ts.ema.ema["state"], x)
    inf = type(inf)(*(None if t is None else t.float() for t in inf))
    kpt = tuple(config.model.kpt_shape) if model.task == "pose" else None
    det = postprocess(inf, conf=0.25, iou=config.val.iou, max_det=config.val.max_det, kpt_shape=kpt)[0]
    t = vb.targets
    keep = t.valid[0]
    plot_predictions(vb.images[0], t.boxes[0][keep], t.classes[0][keep], det.boxes.cpu(), det.classes.cpu(),
                     det.scores.cpu(), names, rd.path / "val_predictions.png")
