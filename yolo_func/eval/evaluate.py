"""Batched validation of a model on a dataset: rect val batches, NMS, COCO metrics, internal metric.

``evaluate`` runs the reference's validation (REFERENCE.md §3.1): :class:`~yolo_func.data.ValLoader`
rectangular batches, ``Model.predict`` under ``torch.no_grad`` (BF16 autocast on CUDA),
:func:`~yolo_func.eval.postprocess` with the validation settings (conf 0.001, IoU 0.7, multi-label,
300 detections), the letterbox undone per image, then two scorers fed batch by batch:

- :class:`~yolo_func.eval.CocoEvaluator` (pycocotools; the numbers to report);
- :class:`~yolo_func.eval.metrics.MetricAccumulator` (the reference's per-epoch metric, mAP50 /
  mAP50-95 per class and the fitness), boxes and keypoints in original pixels, **not clipped** to
  the image: the reference's metric scores the boxes and keypoints as the network placed them
  (clipping lifts the IoU of every box that crosses the image border: +0.016 box mAP50-95 on a
  pose model of the built-in data, ``benchmarks/val_parity.py``); the COCO records are clipped.

With ``replay=True`` on CUDA (detect and pose models; segmentation models with ``coco=False``) the forward, decode and static-shape NMS
(:func:`~yolo_func.eval.postprocess_static`) of a val batch replay as one CUDA graph per batch shape
(:class:`ValReplay`; a short last batch is padded to the batch size, so it reuses its shape's
graph). Eager fallback, with one warning naming the reason: a segmentation model with ``coco=True``
(its COCO masks are assembled at the original size from the coefficients, eagerly), the capture cache full (more
distinct rect shapes than ``max_captures``), or a capture that fails; a replayed batch whose NMS
could not certify its result (``converged`` False: its Jacobi passes had not settled, or an image
kept fewer than ``max_det`` boxes among more valid rows than the static form ranks) is
post-processed again eagerly from the replayed raw output, so the results never differ from the
eager path's.
The default is ``replay=False`` until the replayed path has run on a GPU (its test,
``tests/eval/test_evaluate.py::test_cuda_replayed_validation_equals_eager``, has not yet).
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from yolo_func import tree as T
from yolo_func.eval.coco_eval import CocoEvaluator, category_groups
from yolo_func.eval.metrics import GroundTruth, MetricAccumulator
from yolo_func.eval.postprocess import (STATIC_CANDIDATES, Detections, Letterbox, clip_detections, postprocess, postprocess_static,
                                        postprocess_with_coco)
from yolo_func.models.yolov8 import Inference

__all__ = ["evaluate", "evaluate_with_records", "coco_ground_truth", "dataset_categories", "model_kpt_shape", "resolve_device", "ValReplay"]


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``device`` as a ``torch.device``; None: ``cuda`` when available, else ``cpu``.

    Raises:
      ValueError: an unknown device string, or CUDA asked for on a machine without it.
    """
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if isinstance(device, str) and device.isdigit():
        device = f"cuda:{device}"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"[yolo_func] device={device!r} is not a torch device ({e}); pass 'cpu', 'cuda' or 'cuda:0'") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"[yolo_func] device={device!r} but CUDA is not available on this machine; pass device='cpu'")
    return dev


def model_kpt_shape(model: Any, params: dict, kpt_shape: Sequence[int] | None = None) -> tuple[int, int] | None:
    """``(P, D)`` of a pose model: the given one, else from the pose head's output channels (P * 3
    when divisible by 3, else P * 2); None for the other tasks.

    Args:
      model: a :class:`~yolo_func.models.Model`.
      params: its params (the pose head's last conv gives the channel count).
      kpt_shape: an explicit (P, D), e.g. the dataset's.
    """
    if "pose" not in model.heads:
        return None
    if kpt_shape is not None:
        return (int(kpt_shape[0]), int(kpt_shape[1]))
    channels = {x.shape[0] for p, x in T.tree_items(params["heads"]["pose"]) if p.endswith("pred/weight")}
    if len(channels) != 1:
        raise ValueError(f"[yolo_func] cannot read the keypoint layout from the pose head (output channels {sorted(channels)}); "
                         "pass kpt_shape=(P, D)")
    nk = channels.pop()
    return (nk // 3, 3) if nk % 3 == 0 else (nk // 2, 2)


def _polygon_area(poly: np.ndarray) -> float:
    x, y = poly[:, 0].astype(np.float64), poly[:, 1].astype(np.float64)
    return float(abs(np.dot(x, np.roll(y, 1)) - np.dot(y, np.roll(x, 1))) / 2)


def coco_ground_truth(dataset: Any) -> dict:
    """A COCO annotation dict built from a dataset's labels (for data without a COCO JSON, e.g.
    :class:`~yolo_func.data.YoloDataset`); no image is decoded.

    Image ids are ``dataset.image_ids``, category ids the class indices (``id = k``, name
    ``dataset.names[k]``); boxes are xywh pixels, areas the polygon area (segment) or the box area,
    no crowd regions; pose categories carry ``keypoints`` (names ``"0".."P-1"`` unless the dataset has
    ``keypoint_names``).

    Args:
      dataset: with ``labels(i) -> (boxes float[N, 4] xyxy, classes int64[N], keypoints float[N, P, 3] | None)``,
        ``image_sizes int[len, 2]``, ``image_ids``, ``file_names``, ``names`` and ``task``
        (``polygons(i)`` for segment).

    Returns:
      ``{"images", "annotations", "categories", "info", "licenses"}``.

    Raises:
      TypeError: the dataset lacks ``labels`` / ``image_sizes``.
    """
    if not hasattr(dataset, "labels") or not hasattr(dataset, "image_sizes"):
        raise TypeError(f"[yolo_func] coco_ground_truth: {type(dataset).__name__} has no labels(i) / image_sizes; "
                        "pass a CocoDataset or a YoloDataset")
    task = getattr(dataset, "task", "detect")
    names = list(getattr(dataset, "names", []))
    kpt_shape = getattr(dataset, "kpt_shape", None)
    images, anns, next_id = [], [], 1
    for i in range(len(dataset)):
        h, w = (int(v) for v in dataset.image_sizes[i])
        image_id = int(dataset.image_ids[i])
        images.append({"id": image_id, "height": h, "width": w, "file_name": str(dataset.file_names[i])})
        boxes, classes, kpts = dataset.labels(i)
        polys = dataset.polygons(i) if task == "segment" else None
        for j in range(len(classes)):
            x1, y1, x2, y2 = (float(v) for v in boxes[j])
            ann = {"id": next_id, "image_id": image_id, "category_id": int(classes[j]), "iscrowd": 0,
                   "bbox": [x1, y1, x2 - x1, y2 - y1], "area": (x2 - x1) * (y2 - y1)}
            if polys is not None:
                p = np.asarray(polys[j], np.float64).reshape(-1, 2)
                ann["segmentation"] = [p.reshape(-1).tolist()] if len(p) >= 3 else []
                if len(p) >= 3:
                    ann["area"] = _polygon_area(p)
            if task == "pose" and kpts is not None:
                ann["keypoints"] = np.asarray(kpts[j], np.float64).reshape(-1).tolist()
                ann["num_keypoints"] = int((kpts[j][:, 2] > 0).sum())
            anns.append(ann)
            next_id += 1
    num_classes = max(len(names), max((a["category_id"] + 1 for a in anns), default=0))
    cats = []
    for k in range(num_classes):
        cat = {"id": k, "name": names[k] if k < len(names) else str(k)}
        if task == "pose":
            P = int(kpt_shape[0]) if kpt_shape is not None else 17
            cat["keypoints"] = list(getattr(dataset, "keypoint_names", None) or [str(p) for p in range(P)])
            cat["skeleton"] = []
        cats.append(cat)
    return {"images": images, "annotations": anns, "categories": cats, "info": {}, "licenses": []}


def dataset_categories(dataset: Any) -> tuple[Any, list[int]]:
    """(COCO ground truth, category id of each dataset class): a :class:`~yolo_func.data.CocoDataset`'s
    own ``coco`` and ``category_ids``, else :func:`coco_ground_truth` of the dataset (ids = class indices)."""
    coco = getattr(dataset, "coco", None)
    if coco is not None and hasattr(dataset, "category_ids"):
        return coco, [int(c) for c in dataset.category_ids]
    gt = coco_ground_truth(dataset)
    return gt, [c["id"] for c in gt["categories"]]


# evaluate(loader_backend="auto"): worker processes from this many val batches on a GPU. Measured on
# one H100 (batch 32, 8 readers): 16 batches threads 1036 vs processes 767 images/s (the forks do not
# pay off), 64 batches 1014-1030 vs 1101-1134 (one host) and 723 vs 958 (another); the fitted
# crossover is ~40 batches (benchmarks/results/diag_eval_host_detect_*_20261206T06*.log).
PROCESS_LOADER_MIN_BATCHES = 48
# worker processes beside a GPU write into a shared page-locked ring and the loader copies each
# batch to the GPU from there (ValLoader(device=...)); False (YOLO_FUNC_VAL_RING=0): the
# DataLoader's own shared-memory tensors and pinning thread. Measured on an H100, 2048 images, 8
# workers: 1390 vs 1210 images/s (benchmarks/results/diag_eval_host_ring_20261206T2303.log).
PROCESS_LOADER_RING = os.environ.get("YOLO_FUNC_VAL_RING", "1") != "0"


def _images_to(images: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A val batch's uint8 images on ``device``: channels-last on a GPU (as training runs, and as a
    pinned :class:`ValBatch` already is); elsewhere as the loader made them (its stacked batches
    are channels-last too). ``evaluate`` and the fit's validation both take them from here, so the
    two give the same numbers."""
    x = images.to(device, non_blocking=True)
    if device.type == "cuda":
        return x.contiguous(memory_format=torch.channels_last)
    return x


def _letterboxes(batch) -> list[Letterbox]:
    out = []
    for (h, w), (gx, gy), (px, py) in zip(batch.orig_shapes.tolist(), batch.gains.tolist(), batch.pads.tolist()):
        out.append(Letterbox((int(h), int(w)), (gy, gx), (px, py)))  # Letterbox.gain is (gain_y, gain_x)
    return out


def _detections_to_host(dets: Sequence[Detections]) -> list[Detections]:
    """A batch's detections on the host with one device-to-host copy: boxes, scores, classes and
    keypoints packed in one float tensor (classes < 2^24 are exact in float32); masks stay on their
    device (COCO's records run-length encode them there, :func:`~yolo_func.eval.coco_eval.encode_masks`:
    at the original image size they are N x h0 x w0 bytes per image); CPU detections are returned as
    they are.

    Args:
      dets: per image :class:`Detections` on one device, the same dtype and fields in each.

    Returns:
      The same detections on the CPU (classes int64; masks where they were), values unchanged.
    """
    if not dets or dets[0].boxes.device.type == "cpu":
        return list(dets)
    dtype = dets[0].boxes.dtype
    counts = [int(d.scores.shape[0]) for d in dets]
    has_kpts = dets[0].keypoints is not None
    cols = [torch.cat([d.boxes for d in dets]), torch.cat([d.scores for d in dets])[:, None].to(dtype),
            torch.cat([d.classes for d in dets])[:, None].to(dtype)]
    if has_kpts:
        kshape = dets[0].keypoints.shape[1:]
        cols.append(torch.cat([d.keypoints.flatten(1) for d in dets]).to(dtype))
    host = torch.cat(cols, 1).cpu().split(counts)
    out = []
    for d, h in zip(dets, host):
        out.append(Detections(h[:, :4], h[:, 4].to(d.scores.dtype), h[:, 5].long(),
                              d.masks,
                              h[:, 6:].reshape(-1, *kshape).to(d.keypoints.dtype) if has_kpts else None))
    return out


def _ground_truth(batch, letterboxes: Sequence[Letterbox]) -> list[GroundTruth]:
    """Each image's labels in original pixels (the letterbox undone, clipped)."""
    t = batch.targets
    out = []
    for b, lb in enumerate(letterboxes):
        keep = t.valid[b]
        (gy, gx), (px, py) = lb.gain, lb.pad
        h0, w0 = lb.orig_shape
        boxes = (t.boxes[b][keep].double() - torch.tensor([px, py, px, py], dtype=torch.float64)) / torch.tensor(
            [gx, gy, gx, gy], dtype=torch.float64)
        boxes = torch.stack([boxes[:, 0].clamp(0, w0), boxes[:, 1].clamp(0, h0), boxes[:, 2].clamp(0, w0),
                             boxes[:, 3].clamp(0, h0)], 1)
        kpts = None
        if t.keypoints is not None:
            k = t.keypoints[b][keep].double()
            kpts = torch.cat([((k[..., :1] - px) / gx), ((k[..., 1:2] - py) / gy), k[..., 2:]], -1)
        out.append(GroundTruth(boxes, t.classes[b][keep], None, kpts))
    return out


class _InOrder:
    """Runs ``fn(detections, ground_truth())`` calls one after another, in submission order, on one
    background thread (``background=True``) or inline; at most ``ahead`` calls wait. An exception of
    a call is raised by a later :meth:`submit` or by :meth:`finish`. A context manager: leaving it
    waits for (or, after an error, cancels) what is queued."""

    def __init__(self, background: bool, ahead: int = 2):
        from concurrent.futures import ThreadPoolExecutor

        self._ex = ThreadPoolExecutor(1, thread_name_prefix="yolo_func-metric") if background else None
        self._pending: list = []
        self._ahead = ahead

    def submit(self, fn, detections, ground_truth) -> None:
        if self._ex is None:
            fn(detections, ground_truth())
            return
        self._pending.append(self._ex.submit(lambda: fn(detections, ground_truth())))
        while len(self._pending) > self._ahead or (self._pending and self._pending[0].done()):
            self._pending.pop(0).result()

    def finish(self) -> None:
        while self._pending:
            self._pending.pop(0).result()

    def __enter__(self) -> "_InOrder":
        return self

    def __exit__(self, *exc) -> None:
        if self._ex is not None:
            for f in self._pending:
                f.cancel()
            self._ex.shutdown(wait=True)


PRECISIONS = ("auto", "bf16", "fp16", "fp32")


def _autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """``precision`` (one of :data:`PRECISIONS`) as an autocast dtype on ``device`` (None: float32):
    :func:`yolo_func.func.eval_autocast_dtype` (``"auto"``: FP16 on CUDA), with this module's choices
    checked first.

    Example:
      >>> _autocast_dtype("auto", torch.device("cpu")) is None, _autocast_dtype("fp16", torch.device("cpu"))
      (True, torch.float16)
    """
    if precision not in PRECISIONS:
        raise ValueError(f"[yolo_func] precision must be one of {PRECISIONS}, got {precision!r}")
    from yolo_func.func import eval_autocast_dtype

    return eval_autocast_dtype(precision, device)


class ValReplay:
    """Forward + decode + static NMS of val batches as CUDA graphs, one per (B, H, W), bounded.

    Args:
      model: the model (detect, pose, or segment: boxes only, no masks assembled).
      params, state: CUDA trees, read where they live by every replay (not copied; they must not be
        rebound while this object is used).
      batch_size: B; shorter batches are padded with blank images to it.
      conf, iou, max_det, num_classes, kpt_shape: the validation settings (see
        :func:`~yolo_func.eval.postprocess_static`).
      max_captures: distinct shapes captured at most; later shapes run eagerly.
      iters: Jacobi passes of the in-graph NMS (see :func:`~yolo_func.eval.postprocess_static`).
      candidates: rows per image given to the in-graph NMS (``postprocess_static(candidates=)``).

    Attributes:
      reasons: fallback reasons seen (each also warned about once).
      replays: batches replayed.
    """

    def __init__(self, model, params, state, *, batch_size: int, conf: float, iou: float, max_det: int,
                 num_classes: int, kpt_shape, max_captures: int = 16, iters: int = 16,
                 autocast_dtype: torch.dtype | None = torch.float16, candidates: int = STATIC_CANDIDATES):
        from yolo_func.capture import CaptureCache

        self.model, self.params, self.state, self.batch_size = model, params, state, batch_size
        self.autocast_dtype = autocast_dtype
        self.settings = dict(conf=conf, iou=iou, max_det=max_det, multi_label=True, num_classes=num_classes,
                             kpt_shape=kpt_shape, iters=iters, candidates=candidates, masks=False)
        self.cache = CaptureCache(max_captures)
        self.reasons: list[str] = []
        self.replays = 0
        self._persistent = T.tree_leaves((params, state))
        self._eager_shapes: set[tuple[int, ...]] = set()  # shapes whose capture failed: not retried

    def _fn(self, carry, inputs):
        from yolo_func.func import autocast

        x = inputs["images"].float() / 255
        with autocast(x.device, self.autocast_dtype):
            inf = self.model.predict(inputs["params"], inputs["state"], x)
        y = inf.y.float()
        out = {"y": y}
        if inf.protos is not None:  # a segmentation model: the coefficients' layout (no masks assembled)
            out["protos"] = inf.protos.float()
        out["detections"] = postprocess_static(Inference(y, out.get("protos")), **self.settings)
        return carry, out

    def _fallback(self, reason: str) -> None:
        if reason not in self.reasons:
            self.reasons.append(reason)
            warnings.warn(f"[yolo_func] evaluate: val batches run eagerly: {reason}", stacklevel=3)

    def __call__(self, images: torch.Tensor) -> tuple[list[Detections], Inference] | None:
        """Replay (capturing on the first batch of a shape) a val batch.

        Args:
          images: uint8[b, 3, H, W] on the CUDA device, b <= batch_size.

        Returns:
          ``(detections in input pixels, one per real image; the raw inference)`` or None when this
          batch must run eagerly (the reason is warned about once).
        """
        from yolo_func.capture import CaptureUnavailable, capture_step
        from yolo_func.capture.binder import check_available

        b = images.shape[0]
        if b < self.batch_size:  # bucket: pad to the batch size with blank (pad-value) images
            pad = torch.full((self.batch_size - b, *images.shape[1:]), 114, dtype=images.dtype, device=images.device)
            images = torch.cat([images, pad])
        key = tuple(images.shape)
        if key in self._eager_shapes:
            return None
        carry = torch.zeros((), device=images.device)
        inputs = {"params": self.params, "state": self.state, "images": images}
        try:
            if key not in self.cache:  # why capture cannot run, before touching CUDA (the shared pool)
                check_available({"inputs": inputs}, caller="evaluate")
            captured = self.cache.get_or_capture(
                key, lambda: capture_step(self._fn, carry, inputs, pool=self.cache.pool, persistent=self._persistent))
        except CaptureUnavailable as e:
            self._fallback(f"{e} (shape {list(key)})")
            return None
        except RuntimeError as e:  # a kernel that cannot be captured: this shape stays eager
            self._eager_shapes.add(key)
            self._fallback(f"capture failed for shape {list(key)}: {type(e).__name__}: {e}")
            return None
        _, aux = captured.step(captured.static.carry, {"params": self.params, "state": self.state, "images": images})
        self.replays += 1
        y = aux["y"][:b].clone()
        protos = aux["protos"][:b].clone() if "protos" in aux else None
        padded = aux["detections"]
        if not bool(padded.converged[:b].all()):
            self._fallback("the in-graph NMS could not certify its result for a batch (its passes had not "
                           "settled, or an image kept fewer than max_det boxes among more valid candidates "
                           "than it ranks); that batch is post-processed again eagerly from the replayed output")
            return None, Inference(y, protos)
        dets = [Detections(*(None if t is None else t.clone() for t in d)) for d in padded.unpad()[:b]]
        return dets, Inference(y, protos)


def _progress(total: int, enabled: bool):
    if not enabled:
        return contextlib.nullcontext(None)
    from tqdm import tqdm

    return tqdm(total=total, desc="val", unit="batch", file=sys.stderr, leave=False)


def _json_ready(internal: dict, names: Sequence[str] | None) -> dict:
    """The accumulator's dict with numpy arrays as lists and per-class rows keyed by class name."""
    out = {k: v for k, v in internal.items() if k != "per_class"}
    per = {}
    for kind, rows in internal.get("per_class", {}).items():
        per[kind] = {}
        for c, ap50, ap in zip(rows["classes"].tolist(), rows["ap50"].tolist(), rows["ap"].tolist()):
            name = names[c] if names is not None and c < len(names) else str(c)
            per[kind][name] = {"class": int(c), "mAP50": float(ap50), "mAP50-95": float(ap)}
    out["per_class"] = per
    return out


def evaluate_with_records(
    model: Any,
    params: dict,
    state: dict,
    dataset: Any,
    *,
    image_size: int = 640,
    batch_size: int = 32,
    device: str | torch.device | None = None,
    conf: float = 0.001,
    iou: float = 0.7,
    max_det: int = 300,
    class_map: Sequence[int] | None = None,
    kpt_shape: Sequence[int] | None = None,
    workers: int = 4,
    progress: bool = True,
    verbose: bool = True,
    replay: bool = False,
    max_captures: int = 16,
    coco: bool = True,
    coco_workers: int | None = None,
    precision: str = "auto",
    loader_backend: str = "auto",
) -> tuple[dict, list[dict]]:
    """:func:`evaluate`, also returning the COCO result records (the dataset's image and category ids).

    Args:
      As :func:`evaluate`.

    Returns:
      ``(metrics, records)``; ``records`` as :func:`yolo_func.eval.coco_eval.to_coco_results` makes them
      (``[]`` with ``coco=False``).
    """
    dev = resolve_device(device)
    from yolo_func.data.loader import ValLoader

    task = getattr(dataset, "task", model.task)
    if task != model.task:
        raise ValueError(f"[yolo_func] evaluate: the dataset's task is {task!r} but the model's is {model.task!r}; "
                         f"load the dataset with task={model.task!r}")
    gt, dataset_cat_ids = dataset_categories(dataset)
    K = model.num_classes
    if class_map is None:
        if len(dataset_cat_ids) != K:
            raise ValueError(f"[yolo_func] evaluate: the model has {K} classes but the dataset has {len(dataset_cat_ids)}; "
                             "pass class_map=[dataset class of each model class]")
        class_map = list(range(K))
    class_map = [int(c) for c in class_map]
    if len(class_map) != K or any(not 0 <= c < len(dataset_cat_ids) for c in class_map):
        raise ValueError(f"[yolo_func] evaluate: class_map must give one dataset class in [0, {len(dataset_cat_ids)}) for "
                         f"each of the model's {K} classes, got {class_map}")
    kpts = model_kpt_shape(model, params, kpt_shape if kpt_shape is not None else getattr(dataset, "kpt_shape", None))
    category_ids = [dataset_cat_ids[c] for c in class_map]
    to_dataset_class = torch.tensor(class_map, dtype=torch.int64)
    coco_ev = CocoEvaluator(gt, category_ids=category_ids, verbose=verbose, workers=coco_workers) if coco else None
    category_of = category_groups(category_ids)  # model classes mapped to one category share its cap
    internal = MetricAccumulator()
    params, state = T.tree_to(params, dev), T.tree_to(state, dev)
    # never more loader processes than cores (torch warns, and they would only contend)
    workers = max(0, min(int(workers), os.cpu_count() or 1))
    # batches built ahead on a thread beside a GPU; on the CPU the forward's threads use every core
    if loader_backend not in ("auto", "threads", "processes"):
        raise ValueError(f"[yolo_func] evaluate: loader_backend must be 'auto', 'threads' or 'processes', got {loader_backend!r}")
    if loader_backend == "auto":
        batches = -(-len(dataset) // max(int(batch_size), 1))
        loader_backend = "processes" if dev.type == "cuda" and workers > 0 and batches >= PROCESS_LOADER_MIN_BATCHES \
            else "threads"
    ring = loader_backend == "processes" and dev.type == "cuda" and PROCESS_LOADER_RING
    loader = ValLoader(dataset, batch_size=batch_size, image_size=image_size, workers=workers, task=task,
                       producer=dev.type != "cpu", backend=loader_backend, device=dev if ring else None)
    amp = _autocast_dtype(precision, dev)
    from yolo_func.func import autocast
    from yolo_func.eval.postprocess import scale_to_original

    replayer = None
    if replay and dev.type == "cuda":
        if model.task == "segment" and coco:
            warnings.warn("[yolo_func] evaluate: val batches run eagerly: a segmentation model's COCO masks are "
                          "assembled at the original image size from the coefficients, which the static NMS does "
                          "not return", stacklevel=2)
        else:
            replayer = ValReplay(model, params, state, batch_size=batch_size, conf=conf, iou=iou, max_det=max_det,
                                 num_classes=K, kpt_shape=kpts, max_captures=max_captures,
                                 autocast_dtype=amp)
    # masks only for COCO's segm (the internal metric scores boxes and keypoints)
    post = dict(conf=conf, iou=iou, max_det=max_det, multi_label=True, num_classes=K, kpt_shape=kpts, masks=coco)

    # the metric's per-batch work beside the next batch's forward on a GPU (one thread, in order:
    # the same results); on the CPU the forward's own threads use the cores, so it runs inline
    metric = _InOrder(background=dev.type != "cpu")
    with _progress(len(loader), progress) as bar, torch.no_grad(), metric:
        for batch in loader:
            letterboxes = _letterboxes(batch)
            coco_dets = None  # COCO's own detections when they differ from the metric's
            got = replayer(_images_to(batch.images, dev)) if replayer is not None else None
            if got is not None and got[0] is not None:
                dets = [scale_to_original(d, orig_shape=lb.orig_shape, gain=lb.gain, pad=lb.pad, clip=False)
                        for d, lb in zip(_detections_to_host(got[0]), letterboxes)]
            else:
                if got is not None:  # replayed, but the static NMS did not converge: redo it eagerly
                    inference = got[1]
                else:
                    images = _images_to(batch.images, dev).float() / 255
                    with autocast(dev, amp):
                        inference = model.predict(params, state, images)
                if coco_ev is not None and inference.protos is not None:
                    # one NMS; masks at the original size only for the detections COCOeval reads
                    # (the first 100 of each image and category), none for the internal metric
                    dets, coco_dets = postprocess_with_coco(
                        inference, **{**post, "masks": False}, coco_letterbox=letterboxes, letterbox=letterboxes,
                        max_per_category=coco_ev.max_per_category, category_of=category_of, clip=False)
                    coco_dets = _detections_to_host(coco_dets)
                else:
                    dets = postprocess(inference, **post, mask_method="native", letterbox=letterboxes, clip=False)
                dets = _detections_to_host(dets)
            if coco_ev is not None:
                coco_ev.process(batch.image_ids.tolist(),
                                coco_dets if coco_dets is not None else [clip_detections(d, lb.orig_shape) for d, lb in zip(dets, letterboxes)])
            metric.submit(internal.process,
                          [Detections(d.boxes, d.scores, to_dataset_class[d.classes], None, d.keypoints) for d in dets],
                          lambda batch=batch, letterboxes=letterboxes: _ground_truth(batch, letterboxes))
            if bar is not None:
                bar.update(1)
        metric.finish()
    metrics = coco_ev.evaluate() if coco_ev is not None else {}
    names = getattr(dataset, "names", None)
    metrics["internal"] = _json_ready(internal.compute(), names)
    return metrics, [] if coco_ev is None else coco_ev.results


def evaluate(
    model: Any,
    params: dict,
    state: dict,
    dataset: Any,
    *,
    image_size: int = 640,
    batch_size: int = 32,
    device: str | torch.device | None = None,
    conf: float = 0.001,
    iou: float = 0.7,
    max_det: int = 300,
    class_map: Sequence[int] | None = None,
    kpt_shape: Sequence[int] | None = None,
    workers: int = 4,
    progress: bool = True,
    verbose: bool = True,
    replay: bool = False,
    max_captures: int = 16,
    coco: bool = True,
    coco_workers: int | None = None,
    precision: str = "auto",
    loader_backend: str = "auto",
) -> dict:
    """Validate ``model`` on ``dataset`` (REFERENCE.md §3.1): pycocotools numbers and the internal metric.

    Args:
      model: a :class:`~yolo_func.models.Model` (its ``task`` must be the dataset's).
      params, state: its trees (any device; moved to ``device``), e.g. the EMA weights.
      dataset: a :class:`~yolo_func.data.CocoDataset` (scored against its JSON) or a
        :class:`~yolo_func.data.YoloDataset` (scored against :func:`coco_ground_truth` of it).
      image_size: long side of the val images (a multiple of 32).
      batch_size: images per rectangular val batch.
      device: ``"cpu"``, ``"cuda"``, ``"cuda:1"``, ``"0"``; None: CUDA when available.
      conf: class-score threshold (0.001 for validation).
      iou: NMS IoU threshold.
      max_det: detections per image.
      class_map: dataset class index of each model class (default: class i -> dataset class i, then
        the model and the dataset must have the same number of classes).
      kpt_shape: (P, D) of a pose model (default: the dataset's, else from the head's channels).
      workers: parallel image readers (0: load in this process; at most the number of cores).
      progress: show a tqdm progress bar on stderr.
      verbose: print the pycocotools table.
      replay: on CUDA, replay forward + decode + NMS as CUDA graphs (:class:`ValReplay`; detect and
        pose models, segment ones with ``coco=False``; see the module docstring for the fallbacks). Off by default until the
        replayed path has run on a GPU.
      max_captures: distinct batch shapes captured at most.
      coco: run pycocotools (``bbox`` / ``segm`` / ``keypoints``); False: only the internal metric
        (REFERENCE.md §3.6, the per-epoch table and the fitness), no COCO records and no masks at
        the original size: what the reference's own ``val`` computes.
      coco_workers: forked processes for pycocotools (the iou types side by side, each type's images
        split in chunks of >= 16; None: auto, on Linux from the main thread, at most the cores and
        8; 0: serial in this process; see :func:`yolo_func.eval.coco_eval.evaluate`). Same numbers.
      precision: the network's autocast: ``"auto"`` (FP16 on CUDA, float32 on the CPU; see
        :func:`yolo_func.func.eval_autocast_dtype` for why not BF16), ``"bf16"``, ``"fp16"`` (the
        reference's validation during training) or ``"fp32"``; decode and NMS run in float32 either way.
      loader_backend: how the ``workers`` read (:class:`~yolo_func.data.ValLoader`'s ``backend``):
        ``"threads"``, ``"processes"`` or ``"auto"`` (default): worker processes on a GPU when there
        are at least :data:`PROCESS_LOADER_MIN_BATCHES` (48) batches, else threads. Reader threads
        share the GIL with this thread's thousands of short kernel launches per batch and slow both
        (2048 images on an H100: 723-1030 images/s with 8 threads, 958-1134 with 8 processes, 1963
        with the batches read beforehand; ``benchmarks/diag_eval_host.py``); a process costs a
        fork, which a short validation cannot amortise (512 images: 1036 with threads, 767 with
        processes). On a GPU the processes write into a shared page-locked ring of batch buffers
        (:mod:`yolo_func.data.shared_ring`; 2048 images on an H100: 1390 images/s against 1210
        without it; ``YOLO_FUNC_VAL_RING=0`` turns it off). The same batches and numbers either way.

    Returns:
      ``{"bbox": {AP, AP50, AP75, APs, APm, APl, AR1, AR10, AR100}, ["segm": {...},] ["keypoints":
      {AP, AP50, AP75, APm, APl, AR, AR50, AR75, ARm, ARl},] "internal": {"box": {P, R, mAP50,
      mAP50-95}, ["pose": {...},] "fitness": float, "per_class": {kind: {name: {class, mAP50,
      mAP50-95}}}}}`` (JSON-ready floats); with ``coco=False`` only ``{"internal": {...}}``. The internal metric scores boxes and keypoints in
      original pixels; it has no ``"mask"`` entry (the val loader carries no mask labels), so a
      segmentation model's ``fitness`` is its box mAP50-95.

    Raises:
      ValueError: a task or class-count mismatch, a bad ``class_map`` or device, or a val batch with no
        readable image.

    Example:
      >>> import torch
      >>> from yolo_func import yolov8
      >>> from yolo_func.data import builtin_dataset
      >>> from yolo_func.eval import evaluate
      >>> model = yolov8("n", task="detect", num_classes=5)
      >>> params, state = model.init(torch.Generator().manual_seed(0))
      >>> m = evaluate(model, params, state, builtin_dataset("detect", "val", num_images=2), image_size=64, batch_size=2,
      ...              device="cpu", workers=0, progress=False, verbose=False)
      >>> sorted(m), sorted(m["internal"]["box"])
      (['bbox', 'internal'], ['P', 'R', 'mAP50', 'mAP50-95'])
    """
    return evaluate_with_records(
        model, params, state, dataset, image_size=image_size, batch_size=batch_size, device=device, conf=conf,
        iou=iou, max_det=max_det, class_map=class_map, kpt_shape=kpt_shape, workers=workers, progress=progress,
        verbose=verbose, replay=replay, max_captures=max_captures, coco=coco, coco_workers=coco_workers,
        precision=precision, loader_backend=loader_backend,
    )[0]
