"""Validation benchmark: decode + NMS + masks per batch (eager, static, replayed) and whole-validation
images/s, ours and (when importable) the reference package's own ``val``, on the same images and weights.

    # the GPU host (H200, 16 cores; carry .whl, shared/data travels with the checkout):
    pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
    PYTHONPATH=/tmp/site YOLO_OFFLINE=1 YOLO_CONFIG_DIR=/tmp/ycfg timeout 570 python3 benchmarks/eval.py \
        --out $OUT --device cuda --images 512 --imgsz 640 --batch 32 --workers 8 --reps 20 \
        --val-runs 2 --cls-bias stock 0
    # a CPU smoke run (every row but the replayed ones, which need CUDA):
    python benchmarks/eval.py --device cpu --images 16 --imgsz 320 --reps 3 --out /tmp/eval_bench

Weights (the same file for both sides). With ``ultralytics`` importable: the reference builds
``yolov8n.yaml`` / ``yolov8n-seg.yaml`` after ``torch.manual_seed(--seed)`` (its default random
initialisation), ``YOLO.save`` writes a ``.pt`` (fp16 storage, as every reference checkpoint), the
reference reloads it with ``YOLO(path)`` and we load the same file with
:func:`yolo_func.io.load_reference_model`. Without it: our own initialisation (the same
distribution, bit for bit under the same seed), saved in the reference layout and loaded the same
way. ``--weights PATH ...`` uses given reference ``.pt`` files instead (the tasks of both parts
are then those of the files; ``--cls-bias`` does not apply). A given file must be seen as the same
task by both sides (the reference takes it from the saved model's ``task`` attribute, which
``benchmarks/to_reference_pt.py`` writes); a file it reads as another task gives an error row.

``--cls-bias``: which weights per task. ``stock`` keeps the default initialisation; its class
scores are ~1e-4, below conf 0.001 everywhere, so validation has **no detection at all** (the rows
measure loader + forward + an empty post-processing + COCO evaluation). A number (e.g. ``0``)
overwrites the class-branch output biases with it: with random weights every (anchor, class) row
then scores ~sigmoid(bias) with tiny spread, so all of them pass conf 0.001, the NMS gets the
30 000-row cap of near-tied, grid-aligned boxes and every image ends with 300 detections: the
worst case for NMS and for pycocotools (trained weights at conf 0.001 also give ~300 per image,
from far fewer candidates). Every row reports the detections and candidates per image it saw.

Part ``post`` (per task, per input; ``--post-batch`` images, square ``--imgsz``, conf 0.001,
IoU 0.7, max_det 300, multi_label; masks at prototype resolution, the validation method). Inputs:

- ``model:<cls-bias>``: the raw inference (FP16 autocast on CUDA, cast to float32) of the weights
  above on coco-tiny images letterboxed to ``--imgsz`` (cycled to the batch size);
- ``synthetic``: a trained-model-like raw output (``synthetic_inference``): 20 objects per image,
  anchors inside an object predict jittered copies of its box with its class at 0.05-0.9, every
  other (anchor, class) score log-normal with ~0.7 % of them above 0.001; random mask coefficients
  and prototypes.

Variants, each timed ``--reps`` times after ``--warmup`` runs (CUDA events on CUDA, the wall clock
on CPU; median and min in ms per batch):

- ``eager``: :func:`yolo_func.eval.postprocess` (``mask_method="val"``): a list of variable-length
  detections (host reads of the candidate and kept counts);
- ``static``: :func:`yolo_func.eval.postprocess_static` run eagerly (fixed shapes: the
  ``--candidates`` highest-ranked rows per image, their ``[B, N, N]`` suppression matrix built
  ``--block`` rows per IoU step, ``--iters`` Jacobi passes, batched masks), one row per
  ``--candidates`` value;
- ``replayed`` (CUDA only): the same ``postprocess_static`` call captured once in a
  ``torch.cuda.CUDAGraph`` and replayed on the static input.

``static`` and ``replayed`` report ``equal`` (their unpadded detections equal ``eager``'s: same
counts and classes, scores exactly, boxes to 1e-4, masks to 0.1 % of pixels; an image whose
``converged`` is False may differ) and ``converged`` (the fraction of images whose static result is
certified exact: settled passes and ``max_det`` boxes kept within the N ranks, or no more valid rows
than N; where it is not, validation redoes that batch eagerly). ``ops`` counts the aten ops the
static form dispatches once (views included; on a GPU roughly its kernel launches).

Part ``val`` (``--val-tasks``; each ``--cls-bias`` weight): whole validation, wall-clock
from the call to the metrics (loader start-up, reading and letterboxing, forward, NMS, masks,
pycocotools and the internal metric; model loading excluded), ``--val-runs`` times each, variants
alternating run by run; images/s from the fastest run (the first one also pays CUDA warm-up and
graph captures; every run's seconds are in the JSON). Data: ``coco-tiny`` (32 images) as a
temporary COCO JSON of ``--images`` entries cycling over its images (each a new image id, its
annotations copied, the file a symlink), read by :class:`yolo_func.data.CocoDataset`, and the
same images written in the reference's YOLO format by :func:`yolo_func.data.write_yolo_dataset`.

- ``ours``: :func:`yolo_func.eval.evaluate` (``replay=False``): ValLoader rect batches, FP16
  autocast on CUDA (``--precision``), eager post-processing with masks at the original size, pycocotools;
- ``ours-internal``: the same with ``coco=False``: only the internal metric (REFERENCE.md §3.6), no
  pycocotools, no COCO records, no masks at the original size: what the reference's own ``val``
  (``save_json=False``) computes, so the like-for-like row against ``ref``;
- ``ours-replay`` (CUDA, detect): the same with ``replay=True`` (forward + decode + static NMS
  replayed per batch shape, captured anew by every ``evaluate`` call; segmentation models fall
  back to eager, so it is not run for them);
- ``ours-internal-replay`` (CUDA; detect and segment): ``coco=False`` and ``replay=True`` (no mask
  is needed, so segmentation models replay too, boxes only);
- ``ref``: ``YOLO(pt).val(data=yaml, imgsz, batch, conf=0.001, iou=0.7, plots=False, device,
  workers, rect=True)`` (plus ``half=True`` with ``--ref-half``: by default it runs FP32 where ours
  runs FP16 autocast), the reference's own validator (its own metric, no pycocotools), timed around
  the ``.val`` call (its model loaded before the timer; its label-cache scan inside it).

Each row gives images/s, the ratio ours / ref, box mAP50-95 from pycocotools (ours) and from each
side's internal metric, so a reader sees both evaluated the same thing (random weights score ~0).
Same ``--workers`` for both sides (each caps it at the number of cores).

Both sides run in this one process (the reference imported first, as a library). Writes
``eval_<UTC stamp>.json`` (meta: command, host, versions; rows, including one ``val-run`` row per
validation run so a timeout still leaves its numbers) after every row and ``eval_<UTC stamp>.md``.
A failing row records its error and the run goes on.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import io
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

import cv2
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from yolo_func import tree as T  # noqa: E402
from yolo_func.data import CocoDataset  # noqa: E402
from yolo_func.data.yolo import write_yolo_dataset  # noqa: E402
from yolo_func.data.augment import letterbox  # noqa: E402
from yolo_func.eval import postprocess, postprocess_static  # noqa: E402
from yolo_func.eval.evaluate import evaluate  # noqa: E402
from yolo_func.func import autocast  # noqa: E402
from yolo_func.io import load_reference_model, to_reference  # noqa: E402
from yolo_func.models.yolov8 import Inference  # noqa: E402

_REPO = Path(__file__).resolve().parents[1]
#: ../shared/data beside the checkout, or shared/data inside it (the device copy), or $YOLO_FUNC_SHARED_DATA
SHARED = next((p for p in (Path(os.environ.get("YOLO_FUNC_SHARED_DATA", "/nonexistent")), _REPO.parent / "shared" / "data",
                            _REPO / "shared" / "data") if p.is_dir()), _REPO.parent / "shared" / "data")

VAL = dict(conf=0.001, iou=0.7, max_det=300, multi_label=True)
YAMLS = {"detect": "yolov8n.yaml", "segment": "yolov8n-seg.yaml"}
CLS_BIAS_PATHS = [f"heads/detect/cls/{s}/pred/bias" for s in ("p3", "p4", "p5")]


# -- weights --------------------------------------------------------------------------------------


def _bias_value(cls_bias: str) -> float | None:
    return None if cls_bias == "stock" else float(cls_bias)


def make_weights(task: str, cls_bias: str, seed: int, out: Path, has_ref: bool) -> tuple[Path, str]:
    """Write a reference-layout ``.pt`` of random yolov8n weights; returns (path, how it was made)."""
    from yolo_func.io import reference_key

    bias = _bias_value(cls_bias)
    path = out / f"yolov8n-{task}-bias_{cls_bias}-seed{seed}.pt"
    if has_ref:
        from ultralytics import YOLO

        torch.manual_seed(seed)
        with contextlib.redirect_stdout(io.StringIO()):
            model = YOLO(YAMLS[task])
        if bias is not None:
            sd = model.model.state_dict()
            keys = [reference_key(p, kind="params") for p in CLS_BIAS_PATHS]
            with torch.no_grad():
                for k in keys:
                    sd[k].fill_(bias)
        model.save(str(path))
        how = f"ultralytics YOLO({YAMLS[task]!r}) after torch.manual_seed({seed}), YOLO.save"
    else:
        from yolo_func import yolov8

        model = yolov8("n", task=task)
        params, state = model.init(torch.Generator().manual_seed(seed))
        if bias is not None:
            flat = dict(T.tree_items(params))
            for p in CLS_BIAS_PATHS:
                flat[p].fill_(bias)
        sd = {k: v.clone() for k, v in to_reference(model, params, state).items()}
        torch.save({"model": sd}, path)
        how = f"yolo_func yolov8('n', task={task!r}).init(Generator().manual_seed({seed})), saved in the reference layout"
    if bias is not None:
        how += f"; class-branch output biases set to {bias}"
    return path, how


# -- inputs of the post part ----------------------------------------------------------------------


def coco_tiny(task: str) -> CocoDataset:
    root = SHARED / "coco-tiny"
    if not root.is_dir():
        raise RuntimeError(f"coco-tiny not found at {root} (set YOLO_FUNC_SHARED_DATA or carry shared/data)")
    return CocoDataset(root / "annotations.json", root / "images", task=task)


def model_inference(loaded, images: torch.Tensor, dev: torch.device) -> Inference:
    """Raw inference of uint8[B, 3, S, S] images (FP16 autocast on CUDA, as validation), float32."""
    with torch.no_grad(), autocast(dev, torch.float16 if dev.type == "cuda" else None):
        inf = loaded.model.predict(loaded.params, loaded.state, images.to(dev).float() / 255)
    return Inference(inf.y.float().contiguous(), None if inf.protos is None else inf.protos.float().contiguous())


def letterboxed_batch(ds: CocoDataset, n: int, size: int) -> torch.Tensor:
    ims = [letterbox(ds[i % len(ds)].image, (size, size))[0] for i in range(n)]
    return torch.from_numpy(np.stack(ims)).permute(0, 3, 1, 2).contiguous()


def synthetic_inference(task: str, batch: int, size: int, *, num_classes: int = 80, objects: int = 20, seed: int = 0,
                        device: torch.device | str = "cpu") -> Inference:
    """A trained-model-like raw output float[B, 4 + K (+ 32), A] (and protos for segment): see the module docstring."""
    g = torch.Generator().manual_seed(seed)
    pts = []
    for s in (8, 16, 32):
        n = size // s
        yy, xx = torch.meshgrid(torch.arange(n), torch.arange(n), indexing="ij")
        pts.append(torch.stack([(xx.reshape(-1) + 0.5) * s, (yy.reshape(-1) + 0.5) * s, torch.full((n * n,), float(s))], 1))
    anchors = torch.cat(pts)  # [A, 3] (x, y, stride)
    A = anchors.shape[0]
    B, K = batch, num_classes
    obj_c = torch.rand(B, objects, 2, generator=g) * size
    obj_wh = 16 + torch.rand(B, objects, 2, generator=g) * (size / 2 - 16)
    obj_cls = torch.randint(0, K, (B, objects), generator=g)
    d = (anchors[None, :, None, :2] - obj_c[:, None]).abs() / (obj_wh[:, None] / 2)  # [B, A, O, 2]
    inside = (d < 1).all(-1)
    closeness = torch.where(inside, 1 - d.max(-1).values, torch.full_like(inside, -1, dtype=torch.float32))
    best, j = closeness.max(-1)  # [B, A]
    pos = best > 0
    jitter = 1 + 0.1 * torch.randn(B, A, 4, generator=g)
    obj_box = torch.cat([obj_c, obj_wh], -1).gather(1, j[..., None].expand(-1, -1, 4))  # [B, A, 4] cxcywh
    bg_box = torch.cat([anchors[None, :, :2].expand(B, -1, -1),
                        anchors[None, :, 2:3].expand(B, -1, 2) * (1 + 7 * torch.rand(B, A, 2, generator=g))], -1)
    boxes = torch.where(pos[..., None], obj_box * jitter, bg_box)
    scores = torch.exp(-10.6 + 1.5 * torch.randn(B, A, K, generator=g)).clamp(max=1)
    hit = (0.05 + 0.85 * torch.rand(B, A, generator=g)) * best.clamp(min=0)
    cls = obj_cls.gather(1, j)
    scores.scatter_(2, cls[..., None], torch.where(pos, hit, scores.gather(2, cls[..., None])[..., 0])[..., None])
    parts = [boxes, scores]
    protos = None
    if task == "segment":
        parts.append(torch.randn(B, A, 32, generator=g))
        protos = torch.randn(B, 32, size // 4, size // 4, generator=g).to(device)
    y = torch.cat(parts, -1).transpose(1, 2).contiguous().to(device)
    return Inference(y, protos)


# -- timing ---------------------------------------------------------------------------------------


def time_fn(fn, dev: torch.device, warmup: int, reps: int) -> list[float]:
    """ms per call: CUDA events on CUDA, the wall clock on CPU."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        if dev.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn()
            out.append(1e3 * (time.perf_counter() - t))
    return out


def _stats(ms: list[float]) -> dict:
    return dict(median_ms=statistics.median(ms), min_ms=min(ms), reps=len(ms))


def same_detections(eager, other) -> tuple[bool, str]:
    """Eager detections vs unpadded static ones (the tolerances of tests/eval/test_eval_cuda.py)."""
    for b, (x, y) in enumerate(zip(eager, other)):
        if len(x.boxes) != len(y.boxes):
            return False, f"image {b}: {len(x.boxes)} vs {len(y.boxes)} detections"
        if not torch.equal(x.classes.cpu(), y.classes.cpu()):
            return False, f"image {b}: classes differ"
        if not torch.equal(x.scores.cpu(), y.scores.cpu()):
            return False, f"image {b}: scores differ (max {float((x.scores.cpu() - y.scores.cpu()).abs().max()):.3g})"
        if len(x.boxes) and float((x.boxes.cpu() - y.boxes.cpu()).abs().max()) > 1e-4:
            return False, f"image {b}: boxes differ by {float((x.boxes.cpu() - y.boxes.cpu()).abs().max()):.3g}"
        if x.masks is not None and len(x.masks):
            frac = float((x.masks.cpu() ^ y.masks.cpu()).float().mean())
            if frac >= 1e-3:
                return False, f"image {b}: {frac:.2%} of mask pixels differ"
    return True, ""


def bench_post(inf: Inference, dev: torch.device, args) -> list[dict]:
    """Rows eager / static / replayed for one raw inference."""
    rows = []
    with torch.no_grad():
        eager = postprocess(inf, **VAL, mask_method="val")
        K = inf.y.shape[1] - 4 - (0 if inf.protos is None else inf.protos.shape[1])
        scores = inf.y[:, 4:4 + K]
        info = dict(detections_per_image=sum(len(d.boxes) for d in eager) / len(eager),
                    candidates_per_image=float((scores > VAL["conf"]).sum((1, 2)).clamp(max=30000).float().mean()))
        ms = time_fn(lambda: postprocess(inf, **VAL, mask_method="val"), dev, args.warmup, args.reps)
        rows.append(dict(variant="eager", **_stats(ms), **info))

        for cands in args.candidates:
            rows += _bench_static(inf, eager, info, dev, args,
                                  dict(**VAL, iters=args.iters, candidates=cands, block=args.block))
    return rows


def _certified_equal(eager, padded) -> tuple[bool | None, str]:
    """``same_detections`` on the images whose ``converged`` is True (the others are redone eagerly)."""
    conv = padded.converged.tolist()
    if not any(conv):
        return None, "no image certified"
    got = padded.unpad()
    return same_detections([e for e, c in zip(eager, conv) if c], [g for g, c in zip(got, conv) if c])


def _bench_static(inf: Inference, eager, info: dict, dev: torch.device, args, static_kw: dict) -> list[dict]:
    """Rows static / replayed of one ``postprocess_static`` setting."""
    from yolo_func.testing import count_aten_ops

    rows = []
    extra = dict(candidates=static_kw["candidates"], iters=static_kw["iters"], block=static_kw["block"])
    with torch.no_grad():
        padded = postprocess_static(inf, **static_kw)
        eq, why = _certified_equal(eager, padded)
        with count_aten_ops() as c:
            postprocess_static(inf, **static_kw)
        ms = time_fn(lambda: postprocess_static(inf, **static_kw), dev, args.warmup, args.reps)
        rows.append(dict(variant="static", **extra, **_stats(ms), **info, equal=eq, why=why, ops=c.total,
                         converged=float(padded.converged.float().mean())))

        if dev.type != "cuda":
            rows.append(dict(variant="replayed", **extra, skipped="CUDA graphs need a CUDA device", **info))
            return rows
        static_in = Inference(inf.y.clone(), None if inf.protos is None else inf.protos.clone())
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                postprocess_static(static_in, **static_kw)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = postprocess_static(static_in, **static_kw)
        graph.replay()
        torch.cuda.synchronize()
        eq, why = _certified_equal(eager, out)
        ms = time_fn(graph.replay, dev, args.warmup, args.reps)
        rows.append(dict(variant="replayed", **extra, **_stats(ms), **info, equal=eq, why=why,
                         converged=float(out.converged.float().mean())))
        del graph, out, static_in
    return rows


# -- the val part ---------------------------------------------------------------------------------


def repeated_coco(task: str, n: int, out: Path) -> CocoDataset:
    """A COCO JSON of ``n`` image entries cycling over coco-tiny (new ids, annotations copied, symlinked files)."""
    root = SHARED / "coco-tiny"
    src = json.loads((root / "annotations.json").read_text())
    by_image: dict[int, list] = {}
    for a in src["annotations"]:
        by_image.setdefault(a["image_id"], []).append(a)
    images_in = sorted(src["images"], key=lambda im: im["id"])
    img_dir = out / "images"
    img_dir.mkdir(parents=True, exist_ok=True)
    images, anns = [], []
    for i in range(n):
        im = images_in[i % len(images_in)]
        name = f"{i:06d}_{im['file_name']}"
        link = img_dir / name
        if not link.exists():
            os.symlink((root / "images" / im["file_name"]).resolve(), link)
        images.append({**im, "id": i + 1, "file_name": name})
        for a in by_image.get(im["id"], []):
            anns.append({**a, "id": len(anns) + 1, "image_id": i + 1})
    (out / "annotations.json").write_text(json.dumps({**src, "images": images, "annotations": anns}))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return CocoDataset(out / "annotations.json", img_dir, task=task)


def run_ours(loaded, ds, dev, replay: bool, args, coco: bool = True) -> dict:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t = time.perf_counter()
        m = evaluate(loaded.model, loaded.params, loaded.state, ds, image_size=args.imgsz, batch_size=args.batch,
                     device=dev, workers=args.workers, progress=False, verbose=False, replay=replay, coco=coco,
                     coco_workers=args.coco_workers, precision=args.precision)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        s = time.perf_counter() - t
    r = dict(seconds=s, box_map_coco=m["bbox"]["AP"] if "bbox" in m else None,
             box_map_internal=m["internal"]["box"]["mAP50-95"])
    if "segm" in m:
        r["mask_map_coco"] = m["segm"]["AP"]
    notes = sorted({str(w.message)[:300] for w in caught if "yolo_func" in str(w.message)})
    if notes:
        r["warnings"] = notes
    return r


def run_ref(pt: Path, yaml: Path, dev, args, project: Path, task: str) -> dict:
    from ultralytics import YOLO

    with contextlib.redirect_stdout(io.StringIO()):
        model = YOLO(str(pt))
    if model.task != task:  # it would run that task's validator (detect on a segment head: a tuple in its NMS)
        raise ValueError(f"{pt}: the reference reads this file as task {model.task!r}, ours as {task!r} (the saved "
                         "model lacks its 'task' attribute); rewrite it with benchmarks/to_reference_pt.py")
    kw = dict(data=str(yaml), imgsz=args.imgsz, batch=args.batch, conf=VAL["conf"], iou=VAL["iou"], plots=False,
              device=0 if dev.type == "cuda" else "cpu", workers=args.workers, rect=True, verbose=False,
              save_json=False, project=str(project), name="val", exist_ok=True)
    if args.ref_half:  # passed only when asked: this version warns that the argument is deprecated
        kw["half"] = True
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        t = time.perf_counter()
        m = model.val(**kw)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        s = time.perf_counter() - t
    r = dict(seconds=s, box_map_internal=float(m.box.map), ref_speed_ms_per_image=dict(m.speed))
    if hasattr(m, "seg"):
        r["mask_map_internal"] = float(m.seg.map)
    return r


# -- main -----------------------------------------------------------------------------------------


def _git() -> str | None:
    try:
        return subprocess.run(["git", "-C", str(_REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=10).stdout.strip() or None
    except Exception:  # noqa: BLE001 -- not a git checkout on the device
        return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parts", nargs="+", default=["post", "val"], choices=["post", "val"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--post-tasks", nargs="+", default=["detect", "segment"], choices=list(YAMLS))
    ap.add_argument("--post-inputs", nargs="+", default=["model", "synthetic"], choices=["model", "synthetic"])
    ap.add_argument("--post-batch", type=int, default=None, help="images per post batch (default min(32, --images))")
    ap.add_argument("--val-tasks", nargs="+", default=["detect"], choices=list(YAMLS))
    ap.add_argument("--impl", nargs="+", default=["ours", "ours-internal", "ours-replay", "ours-internal-replay", "ref"],
                    choices=["ours", "ours-internal", "ours-replay", "ours-internal-replay", "ref"])
    ap.add_argument("--precision", default="auto", choices=["auto", "bf16", "fp16", "fp32"],
                    help="our network's autocast in the whole-validation rows (auto: fp16 on CUDA)")
    ap.add_argument("--coco-workers", type=int, default=None,
                    help="processes for the pycocotools iou types (default auto: one per type; 0: serial)")
    ap.add_argument("--cls-bias", nargs="+", default=["stock", "0"],
                    help="random weights per task: 'stock' init, or the class-branch output biases set to this number")
    ap.add_argument("--weights", nargs="+", default=None, help="reference .pt files to use instead of random weights")
    ap.add_argument("--images", type=int, default=512, help="coco-tiny cycled to this many val images")
    ap.add_argument("--imgsz", type=int, default=640)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=None, help="untimed runs before timing (default 3 on CUDA, 1 on CPU)")
    ap.add_argument("--iters", type=int, default=16, help="Jacobi passes of the static NMS (postprocess_static(iters=))")
    ap.add_argument("--candidates", type=int, nargs="+", default=[1024],
                    help="rows per image ranked by the static form (postprocess_static(candidates=)); one row each")
    ap.add_argument("--block", type=int, default=256, help="suppression-matrix rows per IoU step (postprocess_static(block=))")
    ap.add_argument("--val-runs", type=int, default=2)
    ap.add_argument("--ref-half", action="store_true", help="the reference val with half=True (FP16; its default is FP32)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    args = ap.parse_args()
    dev = torch.device(args.device)
    if args.post_batch is None:
        args.post_batch = min(32, args.images)
    if args.warmup is None:
        args.warmup = 3 if dev.type == "cuda" else 1
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    t_start = time.perf_counter()
    try:
        os.environ.setdefault("YOLO_OFFLINE", "1")
        import ultralytics

        ref_version = ultralytics.__version__
    except Exception as e:  # noqa: BLE001 -- the reference is optional
        ref_version = None
        print(f"reference rows skipped: ultralytics is not importable ({type(e).__name__}: {e})", flush=True)
    meta = dict(command="python " + " ".join(sys.argv), date=stamp, host=platform.node(), cpus=os.cpu_count(),
                git=_git(), torch=torch.__version__, opencv=cv2.__version__, numpy=np.__version__, ultralytics=ref_version,
                gpu=torch.cuda.get_device_name(dev) if dev.type == "cuda" else None, device=str(dev),
                settings=dict(imgsz=args.imgsz, batch=args.batch, post_batch=args.post_batch, images=args.images,
                              workers=args.workers, coco_workers=args.coco_workers, reps=args.reps, warmup=args.warmup, iters=args.iters,
                              candidates=args.candidates, block=args.block,
                              val_runs=args.val_runs, ref_half=args.ref_half, seed=args.seed, **VAL),
                weights={})
    results: list[dict] = []

    def emit(row: dict) -> None:
        results.append(row)
        print(json.dumps(row), flush=True)
        meta["elapsed_s"] = time.perf_counter() - t_start
        (out / f"eval_{stamp}.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
        _markdown(out / f"eval_{stamp}.md", meta, results)

    tmp = tempfile.TemporaryDirectory(prefix="yolo_func_eval_bench_")
    tmp_dir = Path(tmp.name)

    # weights: {(task, label): path}
    weights: dict[tuple[str, str], Path] = {}
    if args.weights:
        for w in args.weights:
            try:
                task = load_reference_model(w).model.task
                weights[(task, Path(w).name)] = Path(w)
                meta["weights"][f"{task}/{Path(w).name}"] = f"given: {w}"
            except Exception as e:  # noqa: BLE001
                emit(dict(part="weights", weights=w, error=f"{type(e).__name__}: {e}"))
        given = sorted({k[0] for k in weights})  # the tasks come from the files
        # post: every given task; val: the given tasks that --val-tasks names (default detect)
        args.post_tasks, args.val_tasks = given, [t for t in given if t in YAMLS and t in args.val_tasks]
    else:
        tasks = sorted(set(args.val_tasks if "val" in args.parts else []) | set(args.post_tasks if "post" in args.parts else []))
        for task in tasks:
            for cb in args.cls_bias:
                try:
                    path, how = make_weights(task, cb, args.seed, tmp_dir, ref_version is not None)
                    weights[(task, f"bias_{cb}")] = path
                    meta["weights"][f"{task}/bias_{cb}"] = how
                    print(f"weights {task}/bias_{cb}: {how}", flush=True)
                except Exception as e:  # noqa: BLE001
                    traceback.print_exc()
                    emit(dict(part="weights", task=task, cls_bias=cb, error=f"{type(e).__name__}: {e}"))
    loaded_cache: dict[tuple[str, str], object] = {}

    def loaded(key):  # the model with its trees on the device (moved once, outside every timer)
        if key not in loaded_cache:
            r = load_reference_model(weights[key])
            loaded_cache[key] = r._replace(params=T.tree_to(r.params, dev), state=T.tree_to(r.state, dev))
        return loaded_cache[key]

    # -- part post
    if "post" in args.parts:
        for task in args.post_tasks:
            inputs = []
            if "model" in args.post_inputs:
                inputs += [(f"model:{label}", key) for key in weights if key[0] == task for label in [key[1]]]
            if "synthetic" in args.post_inputs:
                inputs.append(("synthetic", None))
            for name, key in inputs:
                base = dict(part="post", task=task, input=name, batch=args.post_batch, imgsz=args.imgsz)
                print(f"post {task} {name} ...", flush=True)
                try:
                    if key is None:
                        inf = synthetic_inference(task, args.post_batch, args.imgsz, seed=args.seed, device=dev)
                    else:
                        images = letterboxed_batch(coco_tiny(task), args.post_batch, args.imgsz)
                        inf = model_inference(loaded(key), images, dev)
                    for r in bench_post(inf, dev, args):
                        emit({**base, **r})
                    del inf
                except Exception as e:  # noqa: BLE001 -- one failing row must not end the run
                    traceback.print_exc()
                    emit({**base, "error": f"{type(e).__name__}: {e}"[:1000]})
                if dev.type == "cuda":
                    torch.cuda.empty_cache()

    # -- part val
    if "val" in args.parts:
        for task in args.val_tasks:
            try:
                ds = repeated_coco(task, args.images, tmp_dir / f"coco-{task}")
                yaml = None
                if "ref" in args.impl and ref_version is not None:
                    yaml = write_yolo_dataset(ds, tmp_dir / f"yolo-{task}")
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                emit(dict(part="val", task=task, error=f"data: {type(e).__name__}: {e}"))
                continue
            for key in [k for k in weights if k[0] == task]:
                impls = []
                for impl in args.impl:
                    if impl == "ref" and ref_version is None:
                        print("val ref skipped: ultralytics is not importable", flush=True)
                    elif impl in ("ours-replay", "ours-internal-replay") and dev.type != "cuda":
                        emit(dict(part="val", task=task, weights=key[1], impl=impl, skipped="replay needs CUDA"))
                    elif impl == "ours-replay" and task == "segment":
                        emit(dict(part="val", task=task, weights=key[1], impl=impl,
                                  skipped="segmentation models validate eagerly (masks at the original size)"))
                    else:
                        impls.append(impl)
                runs: dict[str, list[dict]] = {i: [] for i in impls}
                errors: dict[str, str] = {}
                for run in range(args.val_runs):
                    for impl in impls:
                        if impl in errors:
                            continue
                        print(f"val {task} {key[1]} {impl} run {run + 1}/{args.val_runs} ...", flush=True)
                        try:
                            if impl == "ref":
                                r = run_ref(weights[key], yaml, dev, args, tmp_dir / "ref_runs", task)
                            else:
                                r = run_ours(loaded(key), ds, dev, impl.endswith("-replay"), args,
                                             coco=not impl.startswith("ours-internal"))
                            runs[impl].append(r)
                            emit(dict(part="val-run", task=task, weights=key[1], impl=impl, run=run + 1,
                                      images_per_s=len(ds) / r["seconds"], **r))
                            print(f"  {r['seconds']:.2f} s, {len(ds) / r['seconds']:.1f} images/s, box mAP50-95 "
                                  f"{r['box_map_internal']:.4f}", flush=True)
                        except Exception as e:  # noqa: BLE001
                            traceback.print_exc()
                            errors[impl] = f"{type(e).__name__}: {e}"[:1000]
                ref_ips = None
                if runs.get("ref"):
                    ref_ips = len(ds) / min(r["seconds"] for r in runs["ref"])
                for impl in impls:
                    row = dict(part="val", task=task, weights=key[1], impl=impl, images=len(ds), batch=args.batch,
                               imgsz=args.imgsz, workers=args.workers)
                    if impl in errors:
                        row["error"] = errors[impl]
                    if runs[impl]:
                        best = min(runs[impl], key=lambda r: r["seconds"])
                        row.update(images_per_s=len(ds) / best["seconds"], seconds=[r["seconds"] for r in runs[impl]],
                                   **{k: v for k, v in best.items() if k != "seconds"})
                        if ref_ips and impl != "ref":
                            row["ratio_vs_ref"] = row["images_per_s"] / ref_ips
                    emit(row)
    meta["elapsed_s"] = time.perf_counter() - t_start
    (out / f"eval_{stamp}.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    _markdown(out / f"eval_{stamp}.md", meta, results)
    tmp.cleanup()
    print(f"wrote {out / f'eval_{stamp}.json'} and .md; total {meta['elapsed_s']:.0f} s", flush=True)
    return 1 if any("error" in r for r in results) else 0


def _f(v, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def _markdown(path: Path, meta: dict, results: list) -> None:
    s = meta["settings"]
    lines = [f"# Validation benchmark {meta['date']}", "", f"`{meta['command']}`", "",
             f"host {meta['host']} ({meta['cpus']} CPUs), GPU {meta['gpu']}, device {meta['device']}, git {meta['git']}, "
             f"torch {meta['torch']}, OpenCV {meta['opencv']}, ultralytics {meta['ultralytics']}; conf {s['conf']}, "
             f"IoU {s['iou']}, max_det {s['max_det']}, multi_label; elapsed {meta.get('elapsed_s', 0):.0f} s", "",
             "Weights:", ""] + [f"- `{k}`: {v}" for k, v in meta["weights"].items()]
    post = [r for r in results if r.get("part") == "post"]
    if post:
        lines += ["", f"## Decode + NMS + masks, batch {s['post_batch']} at {s['imgsz']} (ms per batch)", "",
                  "| task | input | variant | median ms | min ms | dets/image | candidates/image | equal | converged | note |",
                  "|---|---|---|--:|--:|--:|--:|---|--:|---|"]
        for r in post:
            variant = r.get("variant", "") + (f" N={r['candidates']}" if "candidates" in r else "")
            lines.append(f"| {r['task']} | {r['input']} | {variant} | {_f(r.get('median_ms'), '.2f')} | "
                         f"{_f(r.get('min_ms'), '.2f')} | {_f(r.get('detections_per_image'), '.0f')} | "
                         f"{_f(r.get('candidates_per_image'), '.0f')} | {'-' if r.get('equal', '') is None else r.get('equal', '')} | "
                         f"{_f(r.get('converged'), '.2f')} | {r.get('error') or r.get('skipped') or r.get('why') or ''} |")
    val = [r for r in results if r.get("part") == "val"]
    if val:
        lines += ["", f"## Whole validation, {s['images']} images, batch {s['batch']} at {s['imgsz']}, "
                  f"workers {s['workers']}, best of {s['val_runs']} runs", "",
                  "| task | weights | impl | images/s | ours / ref | runs s | box mAP50-95 internal | box mAP50-95 COCO | note |",
                  "|---|---|---|--:|--:|---|--:|--:|---|"]
        for r in val:
            runs = ", ".join(f"{x:.1f}" for x in r.get("seconds", []))
            lines.append(f"| {r['task']} | {r.get('weights', '')} | {r.get('impl', '')} | {_f(r.get('images_per_s'), '.1f')} | "
                         f"{_f(r.get('ratio_vs_ref'), '.2f')} | {runs} | {_f(r.get('box_map_internal'), '.4f')} | "
                         f"{_f(r.get('box_map_coco'), '.4f')} | {r.get('error') or r.get('skipped') or ''} |")
    errs = [r for r in results if r.get("part") == "weights"]
    if errs:
        lines += ["", "Errors:"] + [f"- {r}" for r in errs]
    path.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
