"""Where one loader process spends its time: cProfile of our training pipeline plus micro-timings of
its OpenCV stages, on this machine (its OpenCV build and CPU; single thread, as in a worker).

    python benchmarks/profile_loader.py --task detect --batches 8 --top 25

Also times the stages the reference pipeline is known to use differently (BGR decode), and pinning
a batch of NHWC images against NCHW (on CUDA hosts), so the per-core gap between two machines can
be traced to a stage.
"""

from __future__ import annotations

import argparse
import cProfile
import glob
import io
import os
import pstats
import sys
import time
from pathlib import Path

import cv2
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from loader import SHARED, Repeat  # noqa: E402
from yolo_func.data import CocoDataset, TrainLoader  # noqa: E402


def best_ms(fn, n: int = 5, per: int = 1) -> float:
    best = 1e9
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return round(best / per * 1e3, 3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--task", default="detect")
    ap.add_argument("--batches", type=int, default=8)
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    cv2.setNumThreads(0)
    print(f"OpenCV {cv2.__version__}, numpy {np.__version__}, torch {torch.__version__}, cpus {os.cpu_count()}")
    files = sorted(glob.glob(str(SHARED / "coco-tiny" / "images" / "*")))[:16]
    datas = [Path(f).read_bytes() for f in files]
    stages = {
        "decode BGR": lambda: [cv2.imdecode(np.frombuffer(d, np.uint8), cv2.IMREAD_COLOR) for d in datas],
        "decode RGB flag": lambda: [cv2.imdecode(np.frombuffer(d, np.uint8), getattr(cv2, "IMREAD_COLOR_RGB", 1)) for d in datas],
        "decode BGR + cvtColor in place": lambda: [cv2.cvtColor(x, cv2.COLOR_BGR2RGB, dst=x) for x in
                                                  (cv2.imdecode(np.frombuffer(d, np.uint8), cv2.IMREAD_COLOR) for d in datas)],
    }
    try:  # optional: the libjpeg-turbo binding, for comparison only (not a dependency)
        import simplejpeg

        stages["decode simplejpeg RGB"] = lambda: [simplejpeg.decode_jpeg(d, colorspace="RGB") for d in datas]
    except ImportError:
        print("simplejpeg not installed: its decode row is skipped")
    for k, f in stages.items():
        print(f"{k:36s} {best_ms(f, per=len(datas))} ms/image")
    img = cv2.imdecode(np.frombuffer(datas[0], np.uint8), cv2.IMREAD_COLOR)
    img = cv2.resize(img, (640, 640))
    hsv = cv2.cvtColor(img, cv2.COLOR_RGB2HSV)
    lut = np.stack([np.arange(256, dtype=np.uint8)] * 3)
    lut3 = np.ascontiguousarray(lut.T.reshape(256, 1, 3))
    canvas = np.full((1280, 1280, 3), 114, np.uint8)
    M_aa = np.float32([[0.9, 0, -270], [0, 0.9, -270]])
    from yolo_func.data.augment import HSVTransform

    hsv_t, img_copy = HSVTransform(np.array([0.01, -0.3, 0.2])), img.copy()
    M = np.float32([[0.9, 0.05, -300], [0.05, 0.9, -300]])
    micro = {
        "RGB2HSV 640": lambda: cv2.cvtColor(img, cv2.COLOR_RGB2HSV),
        "HSV2RGB 640": lambda: cv2.cvtColor(hsv, cv2.COLOR_HSV2RGB),
        "LUT 3-channel 640": lambda: cv2.LUT(hsv, lut3),
        "split + 3 LUT + merge 640": lambda: cv2.merge([cv2.LUT(p, t) for p, t in zip(cv2.split(hsv), lut)]),
        "warpAffine 1280 -> 640": lambda: cv2.warpAffine(canvas, M, (640, 640), borderValue=(114, 114, 114)),
        "warpAffine axis-aligned s=0.9": lambda: cv2.warpAffine(canvas, M_aa, (640, 640), borderValue=(114, 114, 114)),
        "resize crop 711 -> 640 (fast path)": lambda: cv2.resize(canvas[300:1011, 300:1011], (640, 640)),
        "HSV pipeline (scratch buffers)": lambda: hsv_t.apply_image(img),
        "HSV pipeline in place": lambda: hsv_t.apply_image(img_copy, out=img_copy),
        "full canvas 1280": lambda: np.full((1280, 1280, 3), 114, np.uint8),
        "copy 640 HWC": lambda: img.copy(),
    }
    for k, f in micro.items():
        print(f"{k:36s} {best_ms(f, n=20)} ms")
    if torch.cuda.is_available():
        x = torch.from_numpy(np.random.randint(0, 255, (16, 640, 640, 3), np.uint8))
        nhwc, nchw = x.permute(0, 3, 1, 2), x.permute(0, 3, 1, 2).contiguous()
        for _ in range(3):
            nhwc.pin_memory(), nchw.pin_memory()
        print(f"{'pin batch16 NHWC view':36s} {best_ms(lambda: nhwc.pin_memory(), n=10)} ms "
              f"(keeps channels_last: {nhwc.pin_memory().is_contiguous(memory_format=torch.channels_last)})")
        print(f"{'pin batch16 NCHW':36s} {best_ms(lambda: nchw.pin_memory(), n=10)} ms")
    ds = Repeat(CocoDataset(SHARED / "coco-tiny" / "annotations.json", SHARED / "coco-tiny" / "images", task=a.task),
                16 * (a.batches + 1))
    for pin in (False, True) if torch.cuda.is_available() else (False,):
        ld = TrainLoader(ds, batch_size=16, image_size=640, workers=0, seed=0, pin_memory=pin)
        it = iter(ld)
        next(it)
        t0, c0 = time.perf_counter(), time.process_time()
        n = sum(16 for _ in it)
        print(f"TrainLoader workers=0 pin={pin}: {n / (time.perf_counter() - t0):.1f} images/s, "
              f"{n / (time.process_time() - c0):.1f} images/CPU-s")
    ld = TrainLoader(ds, batch_size=16, image_size=640, workers=0, seed=0, pin_memory=False)
    it = iter(ld)
    next(it)
    pr = cProfile.Profile()
    pr.enable()
    for _ in it:
        pass
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(a.top)
    print(s.getvalue())


if __name__ == "__main__":
    main()
