"""Host-side cost of whole validation beside a GPU (issue 13), measured on the CPU without a network.

Two parts of ``yolo_func.eval.evaluate``'s main thread, each timed on its own:

* ``loader``: iterate ``ValLoader`` over ``coco-tiny`` cycled to ``--images`` images while the
  consumer "computes" each batch for ``--forward-ms`` (a sleep: the main thread waiting for the
  GPU releases the GIL). Reports the wall seconds, the seconds the consumer spent waiting for
  batches (inside ``next``) and the CPU seconds the consumer's own thread spent there (work the
  loader does on the main thread, serially with the GPU; on a 2-core machine the readers bound
  the wall time).
* ``metric``: ``MetricAccumulator.process`` on batches of ``--batch`` images whose detections look
  like a trained model's at ``conf=0.001`` (for every label 1-4 jittered copies of its box, most
  with its class, plus random boxes up to ``--dets`` per image, scores descending) against
  coco-tiny's labels. Reports ms per batch.

It imports ``yolo_func`` from ``sys.path`` (``PYTHONPATH``), so one copy of the script times two
checkouts:

    PYTHONPATH=$PWD python benchmarks/eval_host.py --repeats 5
    PYTHONPATH=/path/to/other/checkout python benchmarks/eval_host.py --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from eval import repeated_coco  # noqa: E402  (benchmarks/eval.py)

import yolo_func  # noqa: E402
from yolo_func.data import ValLoader  # noqa: E402
from yolo_func.eval import Detections  # noqa: E402
from yolo_func.eval.metrics import GroundTruth, MetricAccumulator  # noqa: E402


def time_loader(ds, args) -> tuple[float, float, float]:
    """(wall s, s spent waiting for batches, CPU s of this thread inside ``next``) of one pass with a
    ``forward_ms`` sleep per batch."""
    loader = ValLoader(ds, batch_size=args.batch, image_size=args.imgsz, workers=args.workers, task="detect",
                       pin_memory=False)
    t0 = time.perf_counter()
    waited = cpu = 0.0
    it = iter(loader)
    while True:
        t, c = time.perf_counter(), time.thread_time()
        try:
            batch = next(it)
        except StopIteration:
            break
        waited += time.perf_counter() - t
        cpu += time.thread_time() - c
        assert batch.images.dtype == torch.uint8
        time.sleep(args.forward_ms / 1000)
    return time.perf_counter() - t0, waited, cpu


def metric_batches(ds, args) -> list[tuple[list, list]]:
    rng = np.random.default_rng(0)
    batches, dets, gts = [], [], []
    K = len(ds.names)
    for i in range(args.images):
        s = ds[i % len(ds)]
        boxes = torch.as_tensor(s.boxes, dtype=torch.float32).reshape(-1, 4)
        cls = torch.as_tensor(s.classes, dtype=torch.int64).reshape(-1)
        gts.append(GroundTruth(boxes, cls))
        h, w = s.image.shape[:2]
        rows, classes = [], []
        for b, c in zip(boxes.numpy(), cls.numpy()):
            for _ in range(int(rng.integers(1, 5))):
                size = np.r_[b[2:] - b[:2], b[2:] - b[:2]]
                rows.append(b + rng.normal(0, 0.08, 4) * size)
                classes.append(c if rng.random() < 0.8 else rng.integers(0, K))
        n_rand = max(0, args.dets - len(rows))
        xy = rng.uniform(0, 1, (n_rand, 2)) * [w, h]
        wh = rng.uniform(0.02, 0.5, (n_rand, 2)) * [w, h]
        rows += list(np.concatenate([xy, xy + wh], 1))
        classes += list(rng.integers(0, K, n_rand))
        det_boxes = torch.tensor(np.array(rows, np.float32).reshape(-1, 4))
        det_boxes[:, 2:] = torch.maximum(det_boxes[:, 2:], det_boxes[:, :2])
        scores = torch.tensor(np.sort(rng.uniform(0.001, 1, len(rows)))[::-1].copy(), dtype=torch.float32)
        dets.append(Detections(det_boxes, scores, torch.tensor(np.array(classes, np.int64)), None, None))
        if len(dets) == args.batch:
            batches.append((dets, gts))
            dets, gts = [], []
    if dets:
        batches.append((dets, gts))
    return batches


def time_metric(batches) -> float:
    """ms per batch of one accumulation pass (``process`` only)."""
    acc = MetricAccumulator()
    t = time.perf_counter()
    for dets, gts in batches:
        acc.process(dets, gts)
    s = time.perf_counter() - t
    out = acc.compute()
    time_metric.last = out["box"]["mAP50-95"]
    return 1000 * s / len(batches)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=512)
    ap.add_argument("--imgsz", type=int, default=640)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--forward-ms", type=float, default=30.0)
    ap.add_argument("--dets", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--only", choices=["loader", "metric"], default=None)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="eval_host_"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ds = repeated_coco("detect", args.images, tmp / "detect")
    print(f"yolo_func from {Path(yolo_func.__file__).parent}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    if args.only in (None, "loader"):
        runs = [time_loader(ds, args) for _ in range(args.repeats + 1)][1:]  # the first warms the page cache
        walls, waits, cpus = [r[0] for r in runs], [r[1] for r in runs], [r[2] for r in runs]
        print(f"loader: {args.images} images at {args.imgsz}, batch {args.batch}, workers {args.workers}, forward sleep "
              f"{args.forward_ms} ms/batch: wall median {statistics.median(walls):.3f} s (runs "
              f"{', '.join(f'{x:.3f}' for x in walls)}), consumer waiting median {statistics.median(waits):.3f} s "
              f"(runs {', '.join(f'{x:.3f}' for x in waits)}), consumer thread CPU in next() median "
              f"{statistics.median(cpus):.3f} s (runs {', '.join(f'{x:.3f}' for x in cpus)})", flush=True)
    if args.only in (None, "metric"):
        batches = metric_batches(ds, args)
        ms = [time_metric(batches) for _ in range(args.repeats)]
        n = sum(len(d.scores) for dets, _ in batches for d in dets)
        print(f"metric: {len(batches)} batches of {args.batch}, {n} detections: process median "
              f"{statistics.median(ms):.2f} ms/batch (runs {', '.join(f'{x:.2f}' for x in ms)}), box mAP50-95 "
              f"{time_metric.last:.6f}", flush=True)


if __name__ == "__main__":
    main()
