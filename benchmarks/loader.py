"""Training-loader benchmark: our TrainLoader and (when importable) the reference's own loader,
side by side on the same images.

    # the GPU host (16 cores): the full table
    python benchmarks/loader.py --workers 1 4 8 15 --tasks detect segment --data builtin coco-tiny \
        --out benchmarks/results --seconds 20
    # a 2-core machine: a short check that every row runs
    python benchmarks/loader.py --workers 1 2 --tasks detect segment --data coco-tiny --seconds 3 \
        --images 64 --out /tmp/loader_bench
    # single-process CPU cost (images per CPU-second, OpenCV on one thread)
    python benchmarks/loader.py --per-core --tasks detect segment --data coco-tiny --seconds 10

Each row: training images/s (mosaic + affine + HSV + flip at ``--imgsz`` 640, batch ``--batch`` 16,
``drop_last``), measured from the end of the first ``max(2, workers)`` batches (worker start-up and
the first batches excluded) until ``--seconds`` have passed (epochs chained); with and without the
RAM cache (the cache fill is reported as ``setup_s``, not timed). Data:

- ``builtin``: ``yolo_func.data.builtin_dataset(task, "train")``;
- ``coco-tiny``: ``../shared/data/coco-tiny`` through ``yolo_func.data.CocoDataset`` (a small
  pycocotools reader here when this checkout has no ``CocoDataset``; the row says which), repeated
  to ``--images`` (512) images.

The reference rows build a YOLO-format copy of the same images (symlinks, or PNGs written from the
samples when the dataset has no image folder; labels from our boxes and, for segment, the largest
outer contour of each mask) and time ``ultralytics.data.build_dataloader(build_yolo_dataset(...))``
with its default augmentation (black box, public calls only). They are skipped with a message when
``ultralytics`` is not importable.

Writes ``loader_<date>.json`` after every row and ``loader_<date>.md`` (the command, host, versions).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import io
import json
import os
import platform
import sys
import tempfile
import time
import traceback
from pathlib import Path

import cv2
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from yolo_func.data import Sample, TrainLoader  # noqa: E402

_REPO = Path(__file__).resolve().parents[1]
#: ../shared/data beside the checkout, or shared/data inside it (the device copy), or $YOLO_FUNC_SHARED_DATA
SHARED = next((p for p in (Path(os.environ.get("YOLO_FUNC_SHARED_DATA", "/nonexistent")), _REPO.parent / "shared" / "data",
                            _REPO / "shared" / "data") if p.is_dir()), _REPO.parent / "shared" / "data")


class Repeat:
    """``n`` indices cycling over ``ds`` (keeps ``task``, ``names``)."""

    def __init__(self, ds, n: int):
        self.ds, self.n = ds, n
        self.task = getattr(ds, "task", None)
        self.names = getattr(ds, "names", None)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Sample:
        return self.ds[i % len(self.ds)]

    def __getattr__(self, name: str):
        # forwards the dataset's optional per-index methods (mask crops, polygons) with the index wrapped
        attr = getattr(self.ds, name)
        if name in ("sample_with_mask_crops", "sample_without_masks", "polygons"):
            return lambda i, *a: attr(i % len(self.ds), *a)
        return attr


class _CocoFallback:
    """Minimal pycocotools reader (only when this checkout has no yolo_func.data.CocoDataset)."""

    def __init__(self, annotations: Path, images: Path, *, task: str):
        from pycocotools.coco import COCO

        with contextlib.redirect_stdout(io.StringIO()):
            self.coco = COCO(str(annotations))
        self.images, self.task = Path(images), task
        self.ids = sorted(self.coco.getImgIds())
        cats = sorted(self.coco.getCatIds())
        self.cat_index = {c: i for i, c in enumerate(cats)}
        self.names = [self.coco.loadCats(c)[0]["name"] for c in cats]

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> Sample:
        info = self.coco.loadImgs(self.ids[i])[0]
        bgr = cv2.imread(str(self.images / info["file_name"]), cv2.IMREAD_COLOR)
        if bgr is None:
            raise ValueError(f"[yolo_func] {info['file_name']!r}: cannot decode the image")
        anns = [a for a in self.coco.loadAnns(self.coco.getAnnIds(imgIds=info["id"]))
                if not a.get("iscrowd") and a["bbox"][2] > 0 and a["bbox"][3] > 0]
        b = np.array([a["bbox"] for a in anns], np.float32).reshape(-1, 4)
        b[:, 2:] += b[:, :2]
        masks = None
        if self.task == "segment":
            masks = np.array([self.coco.annToMask(a) for a in anns], np.uint8).reshape(len(anns), info["height"], info["width"])
        cls = np.array([self.cat_index[a["category_id"]] for a in anns], np.int64)
        return Sample(cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB), b, cls, masks, None, info["id"], info["file_name"])


def make_dataset(data: str, task: str, images: int):
    """(dataset, image folder or None, reader name)."""
    import yolo_func.data as D

    if data == "builtin":
        if not hasattr(D, "builtin_dataset"):
            raise RuntimeError("yolo_func.data.builtin_dataset is not in this checkout")
        ds = D.builtin_dataset(task, "train")
        folder = next((Path(getattr(ds, a)) for a in ("images", "image_dir", "image_root") if isinstance(getattr(ds, a, None), (str, Path))), None)
        return ds, folder, "builtin_dataset"
    root = SHARED / "coco-tiny"
    if not root.is_dir():
        raise RuntimeError(f"coco-tiny not found at {root}")
    if hasattr(D, "CocoDataset"):
        ds, reader = D.CocoDataset(root / "annotations.json", root / "images", task=task), "CocoDataset"
    else:
        ds, reader = _CocoFallback(root / "annotations.json", root / "images", task=task), "pycocotools fallback"
    return Repeat(ds, images), root / "images", reader


def _time_batches(make_iter, batch: int, seconds: float, warm: int) -> dict:
    """Iterate (epochs chained) and time images after ``warm`` batches."""
    n = 0
    t_first = None
    start = time.perf_counter()
    t0 = None
    cpu0 = time.process_time()
    while True:
        for b in make_iter():
            n += 1
            now = time.perf_counter()
            if t_first is None:
                t_first = now - start
            if n == warm:
                t0, cpu0 = now, time.process_time()
            elif n > warm and now - t0 >= seconds:
                timed = n - warm
                return dict(images_per_s=timed * batch / (now - t0), timed_batches=timed, first_batch_s=t_first,
                            main_cpu_per_image_ms=1e3 * (time.process_time() - cpu0) / (timed * batch))
        if n == 0:
            raise RuntimeError("the loader yielded no batch (dataset smaller than a batch?)")


def bench_ours(ds, task, workers, cache, args, mask_source: str = "auto") -> dict:
    t = time.perf_counter()
    loader = TrainLoader(ds, batch_size=args.batch, image_size=args.imgsz, workers=workers, cache=cache, seed=0,
                         task=task, pin_memory=torch.cuda.is_available() and not args.no_pin, mask_source=mask_source)
    setup = time.perf_counter() - t
    r = _time_batches(lambda: iter(loader), args.batch, args.seconds, max(2, workers))
    return dict(setup_s=setup, skipped=len(loader.skipped), pin=torch.cuda.is_available() and not args.no_pin, **r)


def yolo_copy(ds, folder: Path | None, task: str, out: Path) -> Path:
    """Write the same images and labels in the Ultralytics format; returns data.yaml."""
    img_dir, lbl_dir = out / "images" / "train", out / "labels" / "train"
    img_dir.mkdir(parents=True, exist_ok=True)
    lbl_dir.mkdir(parents=True, exist_ok=True)
    base = getattr(ds, "ds", ds)
    seen: dict[int, tuple[Sample, str]] = {}
    for i in range(len(ds)):
        j = i % len(base)
        if j not in seen:
            s = base[j]
            lines = []
            h, w = s.image.shape[:2]
            for k, (b, c) in enumerate(zip(s.boxes, s.classes)):
                if task == "segment" and s.masks is not None:
                    cs, _ = cv2.findContours(s.masks[k], cv2.RETR_EXTERNAL, cv2.CHAIN_APPROX_SIMPLE)
                    if not cs:
                        continue
                    poly = max(cs, key=cv2.contourArea).reshape(-1, 2).astype(np.float64)
                    if len(poly) < 3:
                        continue
                    poly /= (w, h)
                    lines.append(f"{int(c)} " + " ".join(f"{v:.6f}" for v in poly.reshape(-1)))
                else:
                    cx, cy, bw, bh = (b[0] + b[2]) / 2 / w, (b[1] + b[3]) / 2 / h, (b[2] - b[0]) / w, (b[3] - b[1]) / h
                    lines.append(f"{int(c)} {cx:.6f} {cy:.6f} {bw:.6f} {bh:.6f}")
            seen[j] = (s, "\n".join(lines))
        s, text = seen[j]
        stem = f"{i:06d}"
        src = folder / s.file_name if folder is not None else None
        if src is not None and src.is_file():
            os.symlink(src.resolve(), img_dir / (stem + src.suffix))
        else:
            cv2.imwrite(str(img_dir / (stem + ".png")), cv2.cvtColor(s.image, cv2.COLOR_RGB2BGR))
        (lbl_dir / (stem + ".txt")).write_text(text)
    names = getattr(ds, "names", None) or [str(k) for k in range(80)]
    yaml = out / "data.yaml"
    yaml.write_text(f"path: {out}\ntrain: images/train\nval: images/train\nnames:\n"
                    + "".join(f"  {k}: {json.dumps(str(n))}\n" for k, n in enumerate(names)))
    return yaml


def bench_ref(yaml: Path, task: str, workers: int, cache, args) -> dict:
    from ultralytics.cfg import get_cfg
    from ultralytics.data import build_dataloader, build_yolo_dataset
    from ultralytics.data.utils import check_det_dataset

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        data = check_det_dataset(str(yaml))
        cfg = get_cfg(overrides=dict(task=task, imgsz=args.imgsz, cache="ram" if cache else False, workers=workers))
        t = time.perf_counter()
        ds = build_yolo_dataset(cfg, data["train"], args.batch, data, mode="train", rect=False, stride=32)
        dl = build_dataloader(ds, args.batch, workers, shuffle=True, rank=-1)
        setup = time.perf_counter() - t
    r = _time_batches(lambda: iter(dl), args.batch, args.seconds, max(2, workers))
    return dict(setup_s=setup, **r)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", nargs="+", type=int, default=[1, 4, 8, 15])
    ap.add_argument("--tasks", nargs="+", default=["detect", "segment"])
    ap.add_argument("--data", nargs="+", default=["builtin", "coco-tiny"])
    ap.add_argument("--cache", nargs="+", default=["none", "ram"])
    ap.add_argument("--impl", nargs="+", default=["ours", "ref"])
    ap.add_argument("--images", type=int, default=512, help="coco-tiny repeated to this many images")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--imgsz", type=int, default=640)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--no-pin", action="store_true",
                    help="our loader without pinned memory (diagnoses the main process's pinning cost; the fit pins)")
    ap.add_argument("--mask-source", nargs="+", default=["auto"], choices=["auto", "polygons", "bitmaps"],
                    help="our segmentation masks' form (TrainLoader mask_source), one row each")
    ap.add_argument("--per-core", action="store_true", help="single process, OpenCV on one thread: images per CPU-second")
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    try:
        import ultralytics

        ref_version = ultralytics.__version__
    except Exception as e:  # noqa: BLE001 -- the reference is optional
        ref_version = None
        print(f"reference loader rows skipped: ultralytics is not importable ({type(e).__name__}: {e})", flush=True)
    meta = dict(command="python " + " ".join(sys.argv), date=stamp, host=platform.node(), cpus=os.cpu_count(),
                torch=torch.__version__, opencv=cv2.__version__, numpy=np.__version__, ultralytics=ref_version,
                cuda=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
    if args.per_core:
        cv2.setNumThreads(1)
        torch.set_num_threads(1)
        args.workers = [0]
    results = []

    def emit(row):
        results.append(row)
        print(json.dumps(row), flush=True)
        (out / f"loader_{stamp}.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
        _markdown(out / f"loader_{stamp}.md", meta, results, args.per_core)

    tmp = tempfile.TemporaryDirectory(prefix="yolo_func_loader_bench_")
    for data in args.data:
        for task in args.tasks:
            try:
                ds, folder, reader = make_dataset(data, task, args.images)
            except Exception as e:  # noqa: BLE001 -- report and go on
                emit(dict(data=data, task=task, error=f"{type(e).__name__}: {e}"))
                continue
            yaml = None
            for impl in args.impl:
                if impl == "ref" and ref_version is None:
                    continue
                if impl == "ref" and yaml is None:
                    yaml = yolo_copy(ds, folder, task, Path(tmp.name) / f"{data}-{task}")
                sources = args.mask_source if impl == "ours" and task == "segment" else [None]
                for cache, workers, source in [(c, w, m) for c in args.cache for w in args.workers for m in sources]:
                    row = dict(impl=impl, data=data, task=task, reader=reader if impl == "ours" else "ultralytics",
                               images=len(ds), workers=workers, cache=cache, batch=args.batch, imgsz=args.imgsz)
                    if source is not None:
                        row["mask_source"] = source
                    try:
                        c = cache == "ram"
                        r = bench_ours(ds, task, workers, c, args, source or "auto") if impl == "ours" \
                            else bench_ref(yaml, task, workers, c, args)
                        if args.per_core:
                            r["images_per_cpu_s"] = 1e3 / r["main_cpu_per_image_ms"]
                        row.update(r)
                    except Exception as e:  # noqa: BLE001 -- one failing row must not end the run
                        row["error"] = f"{type(e).__name__}: {e}"
                        traceback.print_exc()
                    emit(row)
    tmp.cleanup()


def _markdown(path: Path, meta: dict, results: list, per_core: bool) -> None:
    lines = [f"# Loader benchmark {meta['date']}", "", f"`{meta['command']}`", "",
             f"host {meta['host']} ({meta['cpus']} CPUs), torch {meta['torch']}, OpenCV {meta['opencv']}, "
             f"ultralytics {meta['ultralytics']}, GPU {meta['cuda']}", "",
             "| impl | data | task | cache | workers | images/s | " + ("images/CPU-s | " if per_core else "")
             + "setup s | first batch s | note |",
             "|---|---|---|---|--:|--:|" + ("--:|" if per_core else "") + "--:|--:|---|"]
    for r in results:
        if "images_per_s" in r:
            pc = f"{r.get('images_per_cpu_s', 0):.0f} | " if per_core else ""
            lines.append(f"| {r['impl']} | {r['data']} | {r['task']} | {r['cache']} | {r['workers']} | "
                         f"{r['images_per_s']:.0f} | {pc}{r['setup_s']:.1f} | {r['first_batch_s']:.1f} | {r.get('reader', '')}{' masks ' + r['mask_source'] if 'mask_source' in r else ''} |")
        else:
            lines.append(f"| {r.get('impl', '')} | {r['data']} | {r['task']} | {r.get('cache', '')} | "
                         f"{r.get('workers', '')} | - | " + ("- | " if per_core else "") + f"- | - | {r['error']} |")
    path.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
