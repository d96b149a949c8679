"""COCO results JSON and pycocotools evaluation (REFERENCE.md §3.5, §3.6).

- :func:`to_coco_results`: one image's detections (original-image pixels) as COCO result records:
  ``bbox`` = [x, y, w, h] rounded to 3 decimals, ``score`` rounded to 5, the dataset's
  ``category_id``, ``segmentation`` = compressed RLE (``pycocotools.mask.encode`` of a
  Fortran-ordered uint8 mask, ``counts`` decoded to ``str`` for JSON), ``keypoints`` = flat
  [x1, y1, c1, x2, ...] list.
- :func:`evaluate`: pycocotools' ``COCOeval`` for ``bbox``, ``segm`` and ``keypoints`` returning
  ``{"bbox": {"AP", "AP50", "AP75", "APs", "APm", "APl", "AR1", "AR10", "AR100"}, "segm": {...same},
  "keypoints": {"AP", "AP50", "AP75", "APm", "APl", "AR", "AR50", "AR75", "ARm", "ARl"}}`` (the
  keypoint evaluation has no small-object or 1/10/100-detection breakdown in pycocotools) and
  printing a table. Annotation files without ``info`` / ``licenses`` work (pycocotools 2.0.10's
  ``loadRes`` needs them: they are set to empty); an empty result list gives zeros.
- :class:`CocoEvaluator`: detectron2-style ``reset()`` / ``process(...)`` / ``evaluate()``.
- :func:`quiet_stdout`: pycocotools prints progress lines and tables; they are dropped for the
  calling thread only, so an evaluation running in a background thread (the fit loop's,
  :mod:`yolo_func.train.coco_background`) does not swallow what the main thread prints meanwhile.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from yolo_func.eval.postprocess import COCO_MAX_DETS, Detections, Letterbox, scale_to_original, top_per_category

__all__ = [
    "COCO80_TO_91",
    "BOX_KEYS",
    "KEYPOINT_KEYS",
    "IOU_TYPES",
    "load_coco",
    "category_ids_for",
    "encode_mask",
    "encode_masks",
    "rle_counts",
    "to_coco_results",
    "evaluate",
    "coco_workers",
    "MIN_IMAGES_PER_CHUNK",
    "MAX_AUTO_WORKERS",
    "format_table",
    "CocoEvaluator",
    "category_groups",
    "quiet_stdout",
]

#: COCO's 80 training classes -> the 91-id category ids of the official annotation files.
COCO80_TO_91 = (
    1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 27, 28,
    31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55,
    56, 57, 58, 59, 60, 61, 62, 63, 64, 65, 67, 70, 72, 73, 74, 75, 76, 77, 78, 79, 80, 81, 82, 84,
    85, 86, 87, 88, 89, 90,
)  # fmt: skip

#: Result keys of the bbox and segm evaluations (COCOeval.stats order).
BOX_KEYS = ("AP", "AP50", "AP75", "APs", "APm", "APl", "AR1", "AR10", "AR100")
#: Result keys of the keypoint evaluation (COCOeval.stats order for iouType "keypoints").
KEYPOINT_KEYS = ("AP", "AP50", "AP75", "APm", "APl", "AR", "AR50", "AR75", "ARm", "ARl")
IOU_TYPES = ("bbox", "segm", "keypoints")


class _MutedThreads:
    """A ``sys.stdout`` stand-in that drops what the muted threads write and passes the rest on."""

    def __init__(self, target: Any):
        self.target = target
        self.muted: set[int] = set()

    def write(self, text: str) -> int:
        if threading.get_ident() in self.muted:
            return len(text)
        return self.target.write(text)

    def flush(self) -> None:
        self.target.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.target, name)


_MUTE_LOCK = threading.Lock()


@contextlib.contextmanager
def quiet_stdout():
    """Drop what this thread prints to ``sys.stdout`` (pycocotools' progress lines and tables);
    other threads keep printing. ``contextlib.redirect_stdout`` would swap the stream for every
    thread, hiding the training loop's lines while a background evaluation runs."""
    ident = threading.get_ident()
    with _MUTE_LOCK:
        proxy = sys.stdout if isinstance(sys.stdout, _MutedThreads) else _MutedThreads(sys.stdout)
        sys.stdout = proxy
        proxy.muted.add(ident)
    try:
        yield
    finally:
        with _MUTE_LOCK:
            proxy.muted.discard(ident)
            if not proxy.muted and sys.stdout is proxy:  # nobody replaced it meanwhile
                sys.stdout = proxy.target


def _coco_api():
    try:
        from pycocotools.coco import COCO
        from pycocotools.cocoeval import COCOeval
    except ImportError as e:  # pragma: no cover - pycocotools is a dependency
        raise ImportError("[yolo_func] COCO evaluation needs pycocotools: pip install pycocotools") from e
    return COCO, COCOeval


def load_coco(annotations: Any):
    """A pycocotools ``COCO`` from a path, a dict or a ``COCO``, with ``info`` / ``licenses`` set.

    Args:
      annotations: path to an instances / person-keypoints JSON, its parsed dict, or a ``COCO``.

    Returns:
      ``pycocotools.coco.COCO`` (a dict is indexed through a shallow copy: new top-level and
      per-annotation dicts, the values shared, so what ``COCOeval`` writes into the ground truth
      (``ignore``, polygons turned into RLE) never reaches the caller's dict, and nothing big is
      copied; a ``COCO`` is returned as is, with ``info`` and ``licenses`` added when missing).

    Raises:
      TypeError: another type. ValueError: a dict without ``images`` / ``annotations`` / ``categories``.
    """
    COCO, _ = _coco_api()
    if isinstance(annotations, COCO):
        coco = annotations
    else:
        if isinstance(annotations, (str, Path)):
            path = Path(annotations)
            if not path.is_file():
                raise ValueError(f"[yolo_func] annotations file {str(path)!r} does not exist; pass a COCO JSON path")
            data = json.loads(path.read_text())
        elif isinstance(annotations, Mapping):
            data = _shallow_copy(annotations)
        else:
            raise TypeError(
                f"[yolo_func] annotations must be a path, a dict or a pycocotools COCO, got {type(annotations).__name__}"
            )
        missing = [k for k in ("images", "annotations", "categories") if k not in data]
        if missing:
            raise ValueError(f"[yolo_func] annotations lack {missing}; expected a COCO instances / keypoints JSON")
        coco = COCO()
        coco.dataset = data
        with quiet_stdout():
            coco.createIndex()
    coco.dataset.setdefault("info", {})
    coco.dataset.setdefault("licenses", [])
    return coco


def _shallow_copy(annotations: Mapping) -> dict:
    """A COCO dict whose top level and annotation entries are new dicts (values shared): what
    pycocotools assigns to ground-truth annotations (``ignore``, ``segmentation`` as RLE) lands in
    the copy; lists and coordinates are not copied."""
    data = dict(annotations)
    if isinstance(data.get("annotations"), list):
        data["annotations"] = [dict(a) if isinstance(a, Mapping) else a for a in data["annotations"]]
    return data


def category_ids_for(coco, num_classes: int) -> list[int]:
    """Class index -> category id: the dataset's category ids in increasing order (class i -> the
    i-th category), which for the official 80-class COCO files equals :data:`COCO80_TO_91`.

    Raises:
      ValueError: the dataset has a different number of categories.
    """
    ids = sorted(coco.getCatIds())
    if len(ids) != num_classes:
        raise ValueError(
            f"[yolo_func] the model has {num_classes} classes but the annotations have {len(ids)} categories; "
            f"pass category_ids=[...] (one id per class) explicitly"
        )
    return ids


def category_groups(category_ids: Sequence[int]) -> list[int]:
    """Class index -> a group index shared by the classes that map to the same category id (for
    :func:`~yolo_func.eval.postprocess.top_per_category`: COCOeval caps detections per category).

    Example:
      >>> category_groups([1, 3, 1, 7])
      [0, 1, 0, 2]
    """
    first: dict[int, int] = {}
    return [first.setdefault(int(c), len(first)) for c in category_ids]


def encode_mask(mask: np.ndarray) -> dict:
    """Compressed RLE of one binary mask, JSON-ready (``counts`` as str).

    Args:
      mask: bool or uint8[h, w].

    Returns:
      ``{"size": [h, w], "counts": str}``.
    """
    return encode_masks(np.asarray(mask)[None])[0]


def encode_masks(masks: np.ndarray | torch.Tensor) -> list[dict]:
    """Compressed RLEs of N binary masks, JSON-ready; equal to :func:`encode_mask` of each.

    A NumPy array (or a CPU tensor) goes to one ``pycocotools.mask.encode`` call (a
    Fortran-ordered uint8[h, w, N] array). A CUDA tensor is run-length encoded where it is
    (:func:`rle_counts`): only the run boundaries come to the host, not N x h x w bytes of masks
    at the original image size, and pycocotools compresses the runs (``frPyObjects``).

    Args:
      masks: bool or uint8[N, h, w] (NumPy or torch, any device).

    Returns:
      N ``{"size": [h, w], "counts": str}``.

    Example:
      >>> rles = encode_masks(np.ones((2, 3, 4), bool))
      >>> rles[0]["size"], len(rles)
      ([3, 4], 2)
      >>> encode_masks(torch.ones(2, 3, 4, dtype=torch.bool)) == rles
      True
    """
    from pycocotools import mask as mask_utils

    if isinstance(masks, torch.Tensor) and masks.device.type != "cpu":
        if masks.ndim != 3:
            raise ValueError(f"[yolo_func] encode_masks: expected masks bool[N, h, w], got shape {tuple(masks.shape)}")
        if masks.shape[0] == 0:
            return []
        h, w = int(masks.shape[1]), int(masks.shape[2])
        counts, lengths = rle_counts(masks)
        counts = counts.to(torch.int32 if h * w < 2**31 else torch.int64)  # half the bytes to copy
        counts, lengths = counts.cpu().numpy(), lengths.cpu().numpy()
        split = np.split(counts, np.cumsum(lengths)[:-1])
        rles = mask_utils.frPyObjects([{"counts": c, "size": [h, w]} for c in split], h, w)
    else:
        masks = masks.detach().numpy() if isinstance(masks, torch.Tensor) else np.asarray(masks)
        if masks.ndim != 3:
            raise ValueError(f"[yolo_func] encode_masks: expected masks bool[N, h, w], got shape {masks.shape}")
        if masks.shape[0] == 0:
            return []
        # [N, h, w] C-order viewed as [h, w, N] is already Fortran-ordered: no copy beyond the uint8 cast.
        rles = mask_utils.encode(np.asfortranarray(masks.astype(np.uint8, copy=False).transpose(1, 2, 0)))
    out = []
    for rle in rles:
        counts = rle["counts"]
        out.append({"size": [int(rle["size"][0]), int(rle["size"][1])],
                    "counts": counts.decode("utf-8") if isinstance(counts, bytes) else counts})
    return out


def rle_counts(masks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """COCO's uncompressed RLE counts of N binary masks, vectorised where the masks are (no per-mask loop).

    Each mask is read in column-major (Fortran) order and cut into alternating runs of 0s and 1s,
    starting with a run of 0s (of length 0 when the first pixel is 1): pycocotools' uncompressed
    ``counts``, summing to h * w. All masks' counts are returned in one flat tensor, so that only
    they (a few per mask column) cross to the host instead of N x h x w bytes.

    Args:
      masks: bool or uint8[N, h, w] (any device), h * w >= 1.

    Returns:
      ``(counts int64[S], lengths int64[N])`` on ``masks``' device: mask i's counts are
      ``counts[sum(lengths[:i]) : sum(lengths[:i + 1])]``.

    Example:
      >>> counts, lengths = rle_counts(torch.tensor([[[0, 1], [1, 1]], [[1, 1], [1, 1]]], dtype=torch.bool))
      >>> counts.tolist(), lengths.tolist()            # column-major 0,1,1,1 -> [1, 3]; all ones -> [0, 4]
      ([1, 3, 0, 4], [2, 2])
    """
    if masks.ndim != 3 or masks.shape[1] * masks.shape[2] == 0:
        raise ValueError(f"[yolo_func] rle_counts: expected masks bool[N, h, w] with h, w >= 1, got shape {tuple(masks.shape)}")
    n, h, w = masks.shape
    total = h * w
    dev = masks.device
    flat = masks.bool().transpose(1, 2).reshape(n, total)  # column-major, as COCO's RLE
    rows, cols = (flat[:, 1:] != flat[:, :-1]).nonzero(as_tuple=True)  # row-major: each mask's in order
    ends = cols + 1  # a run ends (and the next starts) before pixel `ends`
    k = torch.bincount(rows, minlength=n)  # transitions per mask
    lead = flat[:, 0].long()  # a first pixel of 1: an empty run of 0s first
    lengths = lead + k + 1
    offsets = lengths.cumsum(0) - lengths  # where each mask's counts start
    first_t = k.cumsum(0) - k  # index (in rows / ends) of each mask's first transition
    j = torch.arange(rows.shape[0], device=dev) - first_t[rows]  # transition index inside its mask
    prev = torch.zeros_like(ends)
    prev[1:] = ends[:-1]
    prev = torch.where(j == 0, torch.zeros_like(prev), prev)
    counts = torch.zeros(int(lengths.sum()), dtype=torch.int64, device=dev)
    counts[offsets[rows] + lead[rows] + j] = ends - prev  # the runs that end at a transition
    last_end = torch.zeros(n, dtype=torch.int64, device=dev)
    has = k > 0
    last_end[has] = ends[(first_t + k - 1)[has]]
    counts[offsets + lead + k] = total - last_end  # each mask's final run
    return counts, lengths


def to_coco_results(detections: Detections, *, image_id: int, category_ids: Sequence[int]) -> list[dict]:
    """COCO result records of one image.

    Args:
      detections: in original-image pixels (see :func:`yolo_func.eval.scale_to_original`); masks, if
        any, bool[N, h0, w0].
      image_id: the dataset's image id.
      category_ids: category id of each class index.

    Returns:
      A list of ``{"image_id", "category_id", "bbox", "score"[, "segmentation"][, "keypoints"]}``:
      bbox ``[x, y, w, h]`` (w = x2 - x1 in float64) rounded to 3 decimals and the score to 5 with
      Python's ``round``; the arrays are converted with one ``tolist`` each and the masks encoded
      with one :func:`encode_masks` call.

    Raises:
      ValueError: a class index outside ``category_ids``.
    """
    boxes = detections.boxes.detach().double().cpu().numpy()
    scores = detections.scores.detach().double().cpu().numpy()
    classes = detections.classes.detach().cpu().numpy().astype(np.int64)
    if len(classes) and (classes.min() < 0 or classes.max() >= len(category_ids)):
        raise ValueError(
            f"[yolo_func] to_coco_results: class index {int(classes.max())} has no category id "
            f"({len(category_ids)} given); pass one category id per model class"
        )
    n = len(scores)
    xywh = np.concatenate([boxes[:, :2], boxes[:, 2:] - boxes[:, :2]], 1).tolist() if n else []
    cats = np.asarray(category_ids, dtype=np.int64)[classes].tolist() if n else []
    image_id = int(image_id)
    out = [
        {"image_id": image_id, "category_id": c, "bbox": [round(x, 3), round(y, 3), round(w, 3), round(h, 3)],
         "score": round(sc, 5)}
        for (x, y, w, h), sc, c in zip(xywh, scores.tolist(), cats)
    ]
    if detections.masks is not None and n:
        for rec, rle in zip(out, encode_masks(detections.masks.detach())):
            rec["segmentation"] = rle
    if detections.keypoints is not None and n:
        kpts = detections.keypoints.detach().double().cpu().numpy().reshape(n, -1).tolist()
        for rec, k in zip(out, kpts):
            rec["keypoints"] = k
    return out


def _zeros(iou_type: str) -> dict[str, float]:
    return {k: 0.0 for k in (KEYPOINT_KEYS if iou_type == "keypoints" else BOX_KEYS)}


def _cocoeval(coco, dt, iou_type: str, image_ids, kpt_sigmas, num_kpts: int | None):
    """A configured ``COCOeval`` (image ids, OKS sigmas)."""
    _, COCOeval = _coco_api()
    ev = COCOeval(coco, dt, iou_type)
    if image_ids is not None:
        ev.params.imgIds = sorted(int(i) for i in image_ids)
    if iou_type == "keypoints":
        if kpt_sigmas is not None:
            ev.params.kpt_oks_sigmas = np.asarray(kpt_sigmas, dtype=np.float64)
        elif num_kpts != 17:
            ev.params.kpt_oks_sigmas = np.full(num_kpts, 1.0 / num_kpts)
    return ev


def _num_kpts(coco, results: list[dict]) -> int:
    cats = coco.loadCats(coco.getCatIds())
    return len(cats[0].get("keypoints", [])) or len(results[0]["keypoints"]) // 3


def _summarize(ev, iou_type: str) -> dict[str, float]:
    ev.accumulate()
    ev.summarize()
    keys = KEYPOINT_KEYS if iou_type == "keypoints" else BOX_KEYS
    return {k: max(float(v), 0.0) for k, v in zip(keys, ev.stats)}


def _evaluate_type(coco, results: list[dict], iou_type: str, image_ids, kpt_sigmas) -> dict[str, float]:
    """One pycocotools evaluation (``loadRes`` of per-record copies: it writes ``area``, ``id`` and,
    for keypoints, ``bbox`` into the records, which must not leak into another type or the caller)."""
    num_kpts = _num_kpts(coco, results) if iou_type == "keypoints" else None
    with quiet_stdout():
        dt = coco.loadRes([dict(r) for r in results])
        ev = _cocoeval(coco, dt, iou_type, image_ids, kpt_sigmas, num_kpts)
        ev.evaluate()
        return _summarize(ev, iou_type)


def _evaluate_images(coco, results: list[dict], iou_type: str, image_ids: list[int], kpt_sigmas, num_kpts) -> list:
    """``COCOeval.evaluate`` on some images only: its ``evalImgs`` (ordered category, area range,
    image), the per-image part of an evaluation."""
    with quiet_stdout():
        dt = coco.loadRes([dict(r) for r in results])
        ev = _cocoeval(coco, dt, iou_type, image_ids, kpt_sigmas, num_kpts)
        ev.evaluate()
    return ev.evalImgs


#: What forked workers evaluate (set in the parent just before the fork, so nothing is pickled).
_FORK_JOB: tuple | None = None


def _forked_job(iou_type: str, image_ids: list[int] | None, num_kpts):
    coco, results, all_ids, kpt_sigmas = _FORK_JOB  # type: ignore[misc]
    if image_ids is None:  # the whole type here
        return _evaluate_type(coco, results, iou_type, all_ids, kpt_sigmas)
    return _evaluate_images(coco, results, iou_type, image_ids, kpt_sigmas, num_kpts)


#: Fewest images per chunk when one iou type is split over processes (below, the fork costs more).
MIN_IMAGES_PER_CHUNK = 16


#: Most worker processes the auto rule forks.
MAX_AUTO_WORKERS = 8


def coco_workers(workers: int | None, jobs: int, images: int = 0) -> int:
    """Worker processes for ``jobs`` pycocotools evaluations (iou types) of ``images`` images.

    Useful processes: one per iou type, times the image chunks of :data:`MIN_IMAGES_PER_CHUNK`
    images each one type can be split into. ``workers`` None (auto): that many, at most the number
    of cores and :data:`MAX_AUTO_WORKERS`, and 0 (serial, in this process) unless this is the main
    thread of a Linux process (the workers are forked: a fork from a background thread, e.g. the
    fit loop's COCO thread, could inherit locks other threads hold). An explicit number is capped
    at the useful count; 0 or a single useful process gives 0.

    Example:
      >>> coco_workers(0, 3)
      0
      >>> coco_workers(8, 1, images=64)   # one iou type, 4 chunks of 16 images
      4
    """
    useful = jobs * max(1, images // MIN_IMAGES_PER_CHUNK)
    if workers is not None:
        if int(workers) < 0:
            raise ValueError(f"[yolo_func] coco_workers must be >= 0 (0: serial) or None (auto), got {workers!r}")
        n = min(int(workers), useful)
    elif sys.platform != "linux" or threading.current_thread() is not threading.main_thread():
        n = 0
    else:
        n = min(useful, os.cpu_count() or 1, MAX_AUTO_WORKERS)
    return 0 if jobs == 0 or n <= 1 else n


def evaluate(
    annotations: Any,
    results: Sequence[dict],
    *,
    iou_types: Sequence[str] | None = None,
    kpt_sigmas: Sequence[float] | None = None,
    image_ids: Sequence[int] | None = None,
    verbose: bool = True,
    workers: int | None = None,
) -> dict[str, dict[str, float]]:
    """pycocotools evaluation of COCO result records.

    Args:
      annotations: the ground truth (path, dict or ``COCO``; see :func:`load_coco`).
      results: records as :func:`to_coco_results` makes them (a list of dicts); not modified.
      iou_types: subset of ``("bbox", "segm", "keypoints")``; default: ``bbox`` plus ``segm`` /
        ``keypoints`` when the records carry ``segmentation`` / ``keypoints``.
      kpt_sigmas: OKS sigmas (P values); default pycocotools' COCO sigmas for 17 keypoints, else
        ``1 / P`` each.
      image_ids: evaluate on these images only (default: every image of the annotations).
      verbose: print the table (pycocotools' own printing is silenced).
      workers: processes running the iou types side by side, and with more processes than types
        each type's images split over them (forked, so the ground truth and the records are not
        pickled; each returns its numbers, or its images' ``evalImgs`` that this process
        accumulates); 0 = serial in this process; None = auto (:func:`coco_workers`: on Linux from
        the main thread, up to one per type and chunk of 16 images, the cores and 8). The numbers
        do not depend on it.

    Returns:
      ``{iou_type: {key: value}}`` with the keys of :data:`BOX_KEYS` / :data:`KEYPOINT_KEYS`; stats
      pycocotools reports as -1 (no GT in a bucket) become 0.0; empty ``results`` give zeros.

    Raises:
      ValueError: an unknown iou type, a records list that lacks what an iou type needs, or a
        negative ``workers``.
    """
    _coco_api()  # imported before any fork (the children must not import)
    coco = load_coco(annotations)
    results = list(results)
    if iou_types is None:
        iou_types = ["bbox"]
        if results and "segmentation" in results[0]:
            iou_types.append("segm")
        if results and "keypoints" in results[0]:
            iou_types.append("keypoints")
    for t in iou_types:
        if t not in IOU_TYPES:
            raise ValueError(f"[yolo_func] evaluate: unknown iou type {t!r}; expected a subset of {list(IOU_TYPES)}")
        need = {"segm": "segmentation", "keypoints": "keypoints"}.get(t)
        if need and results and any(need not in r for r in results):
            raise ValueError(f"[yolo_func] evaluate: iou type {t!r} needs {need!r} in every result record")
    out: dict[str, dict[str, float]] = {t: _zeros(t) for t in iou_types}
    todo = list(iou_types) if results else []
    n_images = len(set(image_ids)) if image_ids is not None else len(coco.getImgIds())
    n = coco_workers(workers, len(todo), n_images)
    done: dict[str, dict[str, float]] = {}
    if n > 1:
        done = _evaluate_forked(coco, results, todo, image_ids, kpt_sigmas, n)
    for t in todo:
        if t not in done:
            done[t] = _evaluate_type(coco, results, t, image_ids, kpt_sigmas)
    out.update(done)
    if verbose:
        print(format_table(out))
    return out


def _evaluate_forked(coco, results, iou_types, image_ids, kpt_sigmas, workers: int) -> dict[str, dict[str, float]]:
    """The iou types in forked worker processes; {} when processes cannot be started (the caller
    then runs them here). Errors inside an evaluation propagate.

    With more workers than iou types, each type's images are split into contiguous chunks (at
    least :data:`MIN_IMAGES_PER_CHUNK` images each): the workers run ``COCOeval.evaluate`` (IoUs and
    per-image matching, the costly part) on their chunk and return its ``evalImgs``; this process
    puts them back in pycocotools' (category, area range, image) order and runs ``accumulate`` and
    ``summarize`` on the whole: the numbers of one serial evaluation."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    global _FORK_JOB
    ids = sorted({int(i) for i in (image_ids if image_ids is not None else coco.getImgIds())})
    per_type = max(1, workers // len(iou_types))
    chunks = max(1, min(per_type, len(ids) // MIN_IMAGES_PER_CHUNK))
    _FORK_JOB = (coco, results, image_ids, kpt_sigmas)
    try:
        with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("fork")) as ex:
            futures = {}
            for t in iou_types:
                nk = _num_kpts(coco, results) if t == "keypoints" else None
                if chunks == 1:
                    futures[t] = ex.submit(_forked_job, t, None, nk)
                else:
                    bounds = np.linspace(0, len(ids), chunks + 1).round().astype(int)
                    futures[t] = [(ids[a:b], ex.submit(_forked_job, t, ids[a:b], nk)) for a, b in zip(bounds[:-1], bounds[1:])]
            out = {}
            for t, f in futures.items():
                if not isinstance(f, list):
                    out[t] = f.result()
                    continue
                parts = [(len(c), fut.result()) for c, fut in f]
                nk = _num_kpts(coco, results) if t == "keypoints" else None
                with quiet_stdout():
                    ev = _cocoeval(coco, None, t, ids, kpt_sigmas, nk)
                    p = ev.params
                    p.imgIds = list(np.unique(p.imgIds))  # as COCOeval.evaluate sets them
                    p.maxDets = sorted(p.maxDets)
                    n_cats = len(p.catIds) if p.useCats else 1
                    groups = n_cats * len(p.areaRng)
                    ev.evalImgs = [e for g in range(groups) for n, imgs in parts for e in imgs[g * n:(g + 1) * n]]
                    ev._paramsEval = copy.deepcopy(p)
                    out[t] = _summarize(ev, t)
            return out
    except (OSError, BrokenProcessPool) as e:  # no fork here (limits, memory): evaluate in this process
        import warnings

        warnings.warn(f"[yolo_func] COCO evaluation: worker processes failed ({type(e).__name__}: {e}); "
                      "evaluating in this process", stacklevel=3)
        return {}
    finally:
        _FORK_JOB = None


def format_table(metrics: Mapping[str, Mapping[str, float]]) -> str:
    """A plain-text table: one row per iou type, one column per key (values x 100, one decimal)."""
    lines = []
    for t, vals in metrics.items():
        keys = list(vals)
        lines.append(f"{'':10s}" + "".join(f"{k:>7s}" for k in keys))
        lines.append(f"{t:10s}" + "".join(f"{100 * vals[k]:7.1f}" for k in keys))
    return "\n".join(lines)


def _to_host(parts: list, counts: list[int]) -> list:
    """Per-image tensors moved to the CPU with one transfer (one ``cat``) when their trailing shapes
    agree (masks of differently sized original images go one by one)."""
    if all(p is None for p in parts):
        return [None] * len(parts)
    if any(p is None for p in parts):
        return [None if p is None else p.detach().cpu() for p in parts]
    if all(p.device.type == "cpu" for p in parts):  # already moved (evaluate's one copy per batch): no cat
        return [p.detach() for p in parts]
    if all(p.shape[1:] == parts[0].shape[1:] for p in parts):
        return list(torch.cat([p.detach() for p in parts]).cpu().split(counts))
    return [p.detach().cpu() for p in parts]


class CocoEvaluator:
    """Accumulates detections batch by batch, evaluates with pycocotools once at the end.

    Args:
      annotations: the ground truth (path, dict or ``COCO``).
      category_ids: category id of each class index (default: the dataset's ids in increasing
        order, see :func:`category_ids_for`; checked against the classes seen).
      kpt_sigmas: OKS sigmas for keypoints (see :func:`evaluate`).
      verbose: print the table in :meth:`evaluate`.
      workers: processes for the iou types in :meth:`evaluate` (see :func:`evaluate`; None = auto,
        0 = serial in this process).
      max_per_category: records kept per (image, category): the first ones of each image's
        detections (descending scores), as many as ``COCOeval`` reads (``maxDets[-1]``, 100 for
        bbox / segm, 20 for keypoints: :data:`~yolo_func.eval.postprocess.COCO_MAX_DETS` = 100
        covers every iou type), so the numbers equal those of every record; the rest are never
        built. None keeps every detection. An image whose scores are not in descending order is
        kept whole.

    Example:
      >>> ev = CocoEvaluator("annotations.json")          # doctest: +SKIP
      >>> for images, image_ids, letterboxes in loader:   # doctest: +SKIP
      ...     ev.process(image_ids, postprocess(model.predict(p, s, images), conf=0.001,
      ...                multi_label=True, mask_method="val"), letterbox=letterboxes)
      >>> metrics = ev.evaluate()                         # doctest: +SKIP
    """

    def __init__(
        self,
        annotations: Any,
        *,
        category_ids: Sequence[int] | None = None,
        kpt_sigmas: Sequence[float] | None = None,
        verbose: bool = True,
        workers: int | None = None,
        max_per_category: int | None = COCO_MAX_DETS,
    ):
        if max_per_category is not None and (not isinstance(max_per_category, int) or max_per_category < 1):
            raise ValueError(f"[yolo_func] CocoEvaluator: max_per_category must be a positive int or None, got {max_per_category!r}")
        self.coco = load_coco(annotations)
        self.workers = workers
        self.max_per_category = max_per_category
        self.category_ids = None if category_ids is None else [int(c) for c in category_ids]
        self.kpt_sigmas = kpt_sigmas
        self.verbose = verbose
        self.reset()

    def reset(self) -> None:
        """Forget every processed batch."""
        self._results: list[dict] = []
        self._image_ids: list[int] = []
        self._has_masks = self._has_kpts = False

    def process(
        self,
        image_ids: Sequence[int],
        detections: Sequence[Detections],
        *,
        letterbox: Sequence[Letterbox] | None = None,
        input_shape: tuple[int, int] | None = None,
    ) -> None:
        """Add one batch.

        Args:
          image_ids: the dataset's image id of each image.
          detections: per image, in original-image pixels, or in network-input pixels when
            ``letterbox`` is given (then mapped with :func:`scale_to_original`).
          letterbox: per image :class:`Letterbox`, or None.
          input_shape: (H, W) of the network input, used to rescale masks with ``letterbox``.

        Raises:
          ValueError: lists of different lengths.
        """
        if len(image_ids) != len(detections) or (letterbox is not None and len(letterbox) != len(detections)):
            raise ValueError(
                f"[yolo_func] CocoEvaluator.process: {len(image_ids)} image ids, {len(detections)} detections"
                f"{'' if letterbox is None else f', {len(letterbox)} letterboxes'}; pass one of each per image"
            )
        if letterbox is not None:
            detections = [
                scale_to_original(d, orig_shape=lb.orig_shape, gain=lb.gain, pad=lb.pad, input_shape=input_shape)
                for d, lb in zip(detections, letterbox)
            ]
        # One move to the host per batch and field (concatenated), then split per image; masks stay
        # where they are: encode_masks run-length encodes a CUDA tensor on the GPU (at the original
        # image size they are N x h0 x w0 bytes per image, the runs a small fraction of that).
        counts = [int(d.scores.shape[0]) for d in detections]
        host = [[d.masks for d in detections] if name == "masks" else _to_host([d[f] for d in detections], counts)
                for f, name in enumerate(Detections._fields)]
        if self.category_ids is None:
            # Without explicit ids every category of the dataset is a class, in id order.
            self.category_ids = sorted(self.coco.getCatIds())
        for i, image_id in enumerate(image_ids):
            det = self._cap(Detections(*(h[i] for h in host)))
            self._has_masks |= det.masks is not None
            self._has_kpts |= det.keypoints is not None
            self._results.extend(to_coco_results(det, image_id=int(image_id), category_ids=self.category_ids))
            self._image_ids.append(int(image_id))

    def _cap(self, det: Detections) -> Detections:
        """The first :attr:`max_per_category` detections of each category (all when the scores are
        not in descending order: then the first ones need not be those ``COCOeval`` keeps)."""
        n = int(det.scores.shape[0])
        k = self.max_per_category
        if k is None or n <= k:
            return det
        scores = det.scores.detach()
        if bool((scores[1:] > scores[:-1]).any()):
            return det
        classes = det.classes.detach()
        groups = None
        if len(self.category_ids) and int(classes.max()) < len(self.category_ids) and int(classes.min()) >= 0:
            groups = category_groups(self.category_ids)
        keep = top_per_category(classes[None], torch.ones(1, n, dtype=torch.bool, device=classes.device), k,
                                category_of=groups)[0]
        if bool(keep.all()):
            return det
        return Detections(*(None if t is None else t[keep.to(t.device)] for t in det))

    @property
    def results(self) -> list[dict]:
        """The COCO result records gathered so far (JSON-ready)."""
        return self._results

    @property
    def image_ids(self) -> list[int] | None:
        """The processed images' ids, sorted, each once (None before any batch: every image)."""
        return sorted(set(self._image_ids)) or None

    @property
    def iou_types(self) -> list[str]:
        """``bbox``, plus ``segm`` / ``keypoints`` when the processed detections carried masks / keypoints."""
        return ["bbox"] + (["segm"] if self._has_masks else []) + (["keypoints"] if self._has_kpts else [])

    def evaluate(self, *, iou_types: Sequence[str] | None = None) -> dict[str, dict[str, float]]:
        """pycocotools evaluation of everything processed, on the processed images only.

        Returns:
          As :func:`evaluate`; zeros (and no crash) when nothing was detected.
        """
        return evaluate(
            self.coco, self._results, iou_types=self.iou_types if iou_types is None else iou_types,
            kpt_sigmas=self.kpt_sigmas, image_ids=self.image_ids, verbose=self.verbose, workers=self.workers,
        )
