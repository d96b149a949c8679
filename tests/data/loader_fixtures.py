"""Small in-memory datasets for the augmentation / loader tests (no files, or coco-tiny decoded here).

Until the datasets of ``yolo_func.data`` are merged, the loader tests read through these: a list of
:class:`yolo_func.data.Sample` with ``__len__`` / ``__getitem__``, the same random-access contract.
"""

from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np

from yolo_func.data import Sample


class ListDataset:
    """Random access over a list of samples; ``bad`` indices raise ValueError naming the file."""

    def __init__(self, samples, task, bad=(), flip_index=None):
        self.samples, self.task, self.bad, self.flip_index = list(samples), task, set(bad), flip_index
        self.reads = 0

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        self.reads += 1
        s = self.samples[i]
        if i in self.bad:
            raise ValueError(f"[yolo_func] {s.file_name!r}: cannot decode the image (truncated file)")
        return s


def ellipse_sample(rng: np.random.Generator, h: int, w: int, n: int, *, keypoints: int = 0, index: int = 0) -> Sample:
    """A textured image with ``n`` filled ellipses (masks), their tight boxes and optional keypoints.

    Keypoints lie inside each ellipse: keypoint 0 at the centre, pairs (2k-1, 2k) mirrored left/right
    of it, so a horizontal flip with the COCO-style flip index maps the set onto itself.
    """
    image = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
    image = cv2.GaussianBlur(image, (5, 5), 0)
    masks, boxes, kpts = [], [], []
    for _ in range(n):
        cx, cy = rng.uniform(0.15 * w, 0.85 * w), rng.uniform(0.15 * h, 0.85 * h)
        ax, ay = rng.uniform(0.05 * w, 0.3 * w), rng.uniform(0.05 * h, 0.3 * h)
        m = np.zeros((h, w), np.uint8)
        cv2.ellipse(m, (int(cx), int(cy)), (int(ax), int(ay)), float(rng.uniform(0, 180)), 0, 360, 1, -1)
        color = rng.integers(0, 256, 3).tolist()
        image[m > 0] = color
        x, y, bw, bh = cv2.boundingRect(m)
        masks.append(m)
        boxes.append((x, y, x + bw, y + bh))
        if keypoints:
            k = np.zeros((keypoints, 3), np.float32)
            k[0] = (x + bw / 2, y + bh / 2, 2)
            for j in range(1, keypoints, 2):
                dx, dy = rng.uniform(0, bw / 2), rng.uniform(-bh / 2, bh / 2)
                k[j] = (x + bw / 2 + dx, y + bh / 2 + dy, 2)
                if j + 1 < keypoints:
                    k[j + 1] = (x + bw / 2 - dx, y + bh / 2 + dy, 1)
            kpts.append(k)
    return Sample(
        image=image,
        boxes=np.asarray(boxes, np.float32).reshape(-1, 4),
        classes=rng.integers(0, 3, n).astype(np.int64),
        masks=np.asarray(masks, np.uint8).reshape(n, h, w),
        keypoints=np.asarray(kpts, np.float32).reshape(n, keypoints, 3) if keypoints else None,
        image_id=index,
        file_name=f"synthetic_{index:04d}.png",
    )


def ellipse_dataset(n: int, task: str, *, seed: int = 0, size=(96, 160), keypoints: int = 0, bad=()) -> ListDataset:
    """``n`` synthetic samples of varied sizes around ``size`` (h, w) with 0-4 instances each."""
    rng = np.random.default_rng(seed)
    samples = []
    for i in range(n):
        h = int(rng.integers(size[0] // 2, size[0] + 1))
        w = int(rng.integers(size[1] // 2, size[1] + 1))
        samples.append(ellipse_sample(rng, h, w, int(rng.integers(0, 5)), keypoints=keypoints, index=i))
    flip = (0, *[j for k in range(1, keypoints, 2) for j in (k + 1, k)]) if keypoints else None
    return ListDataset(samples, task, bad=bad, flip_index=flip)


def coco_tiny_samples(root: Path, limit: int | None = None) -> list[Sample]:
    """coco-tiny decoded with pycocotools (non-crowd annotations with a positive box area)."""
    from pycocotools.coco import COCO
    import contextlib, io

    with contextlib.redirect_stdout(io.StringIO()):
        coco = COCO(str(root / "annotations.json"))
    cats = {c: i for i, c in enumerate(sorted(coco.getCatIds()))}
    out = []
    for img_id in sorted(coco.getImgIds())[:limit]:
        info = coco.loadImgs(img_id)[0]
        bgr = cv2.imread(str(root / "images" / info["file_name"]), cv2.IMREAD_COLOR)
        anns = [a for a in coco.loadAnns(coco.getAnnIds(imgIds=img_id)) if not a.get("iscrowd") and a["bbox"][2] > 0 and a["bbox"][3] > 0]
        boxes = np.array([[a["bbox"][0], a["bbox"][1], a["bbox"][0] + a["bbox"][2], a["bbox"][1] + a["bbox"][3]] for a in anns], np.float32).reshape(-1, 4)
        masks = np.array([coco.annToMask(a) for a in anns], np.uint8).reshape(len(anns), info["height"], info["width"])
        out.append(Sample(cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB), boxes, np.array([cats[a["category_id"]] for a in anns], np.int64),
                          masks, None, img_id, info["file_name"]))
    return out
