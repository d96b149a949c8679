"""The built-in default dataset: procedurally generated shapes (detect, segment) and stick figures (pose).

``builtin_dataset(task, split)`` generates its split once (numpy + OpenCV drawing, a few seconds),
writes it as COCO JSON + PNG images to a cache folder and returns a :class:`CocoDataset` over it.

* **shapes** (tasks ``detect`` and ``segment``): five classes with distinct shapes *and* colours —
  ``ellipse`` (red), ``rectangle`` (green), ``triangle`` (blue), ``star`` (yellow), ``ring``
  (magenta; a hole in its mask) — stretched (aspect ratios 1:2.5 to 2.5:1), rotated, 10 px to half
  the image, 1 to 14 per image, over textured backgrounds (colour blobs, gradients, stripes,
  pixel noise). Later shapes occlude earlier ones: masks and boxes are the *visible* pixels, and an
  instance with less than 20 % of its area visible (or under 16 pixels) is not annotated.
* **figures** (task ``pose``): frontal stick figures (head, torso, limbs) with COCO's 17 keypoint
  names (so ``flip_idx`` is COCO's ``[0, 2, 1, 4, 3, ...]``: a frontal figure's ``left_*`` joints
  are on the image's right), random limb angles, 40 px to 90 % of the image tall, 1 to 4 per image,
  plus unannotated shapes that occlude them. Visibility: 2 visible, 1 inside the image but covered
  by a later figure or shape, 0 (with x = y = 0) outside the image.

Images are 320-640 px a side (multiples of 32), PNG. Every image is drawn from a numpy generator
seeded by ``(seed, split, index)``, so the same seed gives the same bytes (OpenCV's PNG encoder is
deterministic), and train and val never share images.

Cache: ``root`` or ``$XDG_CACHE_HOME/yolo_func`` or ``~/.cache/yolo_func``; one folder per
(generator version, kind, seed, split, size) such as ``builtin-v1/shapes-seed0-train-256``. A split
is generated into a temporary sibling folder and renamed into place, so an interrupted generation
never leaves a partial dataset; a folder whose ``manifest.json`` (written last: every file with its
size) is missing or does not match the files is regenerated. Bump :data:`GENERATOR_VERSION` when
the drawing changes, so old caches are never read.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import cv2
import numpy as np
from pycocotools import mask as mask_utils

from yolo_func.data.coco import CocoDataset, check_task

__all__ = ["builtin_dataset", "generate_builtin", "builtin_root", "GENERATOR_VERSION", "SHAPE_CLASSES",
           "KEYPOINT_NAMES", "DEFAULT_SIZES"]

#: Bumped whenever the generator's output changes; part of the cache folder name.
GENERATOR_VERSION = 1
#: Class names of the shapes data and their RGB colours.
SHAPE_CLASSES = {"ellipse": (220, 45, 45), "rectangle": (40, 175, 60), "triangle": (45, 85, 225),
                 "star": (235, 200, 35), "ring": (195, 55, 205)}
#: COCO's 17 person keypoints, in order.
KEYPOINT_NAMES = ["nose", "left_eye", "right_eye", "left_ear", "right_ear", "left_shoulder", "right_shoulder",
                  "left_elbow", "right_elbow", "left_wrist", "right_wrist", "left_hip", "right_hip", "left_knee",
                  "right_knee", "left_ankle", "right_ankle"]
_SKELETON = [[16, 14], [14, 12], [17, 15], [15, 13], [12, 13], [6, 12], [7, 13], [6, 7], [6, 8], [7, 9], [8, 10],
             [9, 11], [2, 3], [1, 2], [1, 3], [2, 4], [3, 5], [4, 6], [5, 7]]
#: Images per split when ``num_images`` is not given.
DEFAULT_SIZES = {"train": 256, "val": 64}
_SPLIT_STREAM = {"train": 0, "val": 1}
_MIN_VISIBLE_FRACTION = 0.2
_MIN_VISIBLE_PIXELS = 16


def builtin_root(root: str | os.PathLike | None = None) -> Path:
    """The cache folder: ``root``, else ``$XDG_CACHE_HOME/yolo_func``, else ``~/.cache/yolo_func``."""
    if root is not None:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "yolo_func"


def builtin_dataset(task: str, split: str, *, root: str | os.PathLike | None = None, seed: int = 0,
                    num_images: int | None = None) -> CocoDataset:
    """The built-in default dataset, generated into the cache on first use.

    Args:
      task: ``"detect"`` or ``"segment"`` (the shapes data) or ``"pose"`` (the figures data).
      split: ``"train"`` or ``"val"``.
      root: the cache folder (default ``$XDG_CACHE_HOME/yolo_func`` or ``~/.cache/yolo_func``).
      seed: the generator seed; the same seed gives the same files, byte for byte.
      num_images: images in the split (default 256 train, 64 val; tests use fewer).

    Returns:
      A :class:`CocoDataset` over the split (shapes: 5 classes; figures: 1 class with 17
      keypoints and COCO's flip index).

    Raises:
      ValueError: unknown task or split, a negative or non-integer seed, or ``num_images`` < 1.

    Example:
      >>> from yolo_func.data import builtin_dataset
      >>> ds = builtin_dataset("detect", "val", num_images=2)     # generated into ~/.cache/yolo_func once
      >>> len(ds), ds.names
      (2, ['ellipse', 'rectangle', 'triangle', 'star', 'ring'])
    """
    check_task(task)
    if split not in _SPLIT_STREAM:
        raise ValueError(f"[yolo_func] builtin_dataset(split={split!r}): expected 'train' or 'val'")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"[yolo_func] builtin_dataset(seed={seed!r}): expected an int >= 0")
    n = DEFAULT_SIZES[split] if num_images is None else int(num_images)
    if n < 1:
        raise ValueError(f"[yolo_func] builtin_dataset(num_images={num_images!r}): expected at least 1 image")
    kind = "figures" if task == "pose" else "shapes"
    folder = generate_builtin(kind, split, root=root, seed=seed, num_images=n)
    return CocoDataset(folder / "annotations.json", folder / "images", task=task)


def _complete(folder: Path) -> bool:
    manifest = folder / "manifest.json"
    try:
        listed = json.loads(manifest.read_text())
        return bool(listed) and all((folder / name).stat().st_size == size for name, size in listed.items())
    except (OSError, ValueError, AttributeError):
        return False


def generate_builtin(kind: str, split: str, *, root: str | os.PathLike | None = None, seed: int = 0,
                     num_images: int) -> Path:
    """Generates one split into the cache (atomically) unless a complete copy is there.

    Args:
      kind: ``"shapes"`` or ``"figures"``.
      split: ``"train"`` or ``"val"``.
      root: the cache folder (see :func:`builtin_root`).
      seed: the generator seed.
      num_images: images in the split.

    Returns:
      The split's folder, holding ``annotations.json``, ``images/*.png`` and ``manifest.json``.
    """
    base = builtin_root(root) / f"builtin-v{GENERATOR_VERSION}"
    folder = base / f"{kind}-seed{seed}-{split}-{num_images}"
    if _complete(folder):
        return folder
    base.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=base))
    try:
        _write_split(tmp, kind, split, seed, num_images)
        if _complete(folder):  # another process finished the same split meanwhile: keep its copy
            return folder
        if folder.exists():  # incomplete or corrupt: replace it
            shutil.rmtree(folder, ignore_errors=True)
        try:
            os.rename(tmp, folder)
        except OSError:
            if not _complete(folder):  # another process won the race with a complete copy, else fail
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _write_split(out: Path, kind: str, split: str, seed: int, n: int) -> None:
    (out / "images").mkdir()
    draw = _draw_figures if kind == "figures" else _draw_shapes

    def one(i: int):
        # Each image has its own generator, so threads cannot change the bytes.
        rng = np.random.default_rng([GENERATOR_VERSION, seed, _SPLIT_STREAM[split], i])
        image, instances = draw(rng)
        ok, png = cv2.imencode(".png", image[:, :, ::-1], [cv2.IMWRITE_PNG_COMPRESSION, 3])
        if not ok:
            raise RuntimeError(f"[yolo_func] OpenCV could not encode builtin image {i + 1}")
        (out / "images" / f"{i + 1:06d}.png").write_bytes(png.tobytes())
        return image.shape[:2], instances

    images, annotations = [], []
    with ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
        drawn = list(pool.map(one, range(n)))
    for i, ((h, w), instances) in enumerate(drawn):
        name = f"{i + 1:06d}.png"
        images.append({"id": i + 1, "file_name": name, "height": h, "width": w})
        for inst in instances:
            mask = inst["mask"]
            ys, xs = np.nonzero(mask)
            x1, y1, x2, y2 = int(xs.min()), int(ys.min()), int(xs.max()) + 1, int(ys.max()) + 1
            rle = mask_utils.encode(np.asfortranarray(mask))
            ann = {"id": len(annotations) + 1, "image_id": i + 1, "category_id": inst["category"] + 1,
                   "bbox": [x1, y1, x2 - x1, y2 - y1], "area": int(mask.sum()), "iscrowd": 0,
                   "segmentation": {"size": [h, w], "counts": rle["counts"].decode("ascii")}}
            if "keypoints" in inst:
                kp = inst["keypoints"]
                ann["keypoints"] = [round(float(v), 2) for v in kp.ravel()]
                ann["num_keypoints"] = int((kp[:, 2] > 0).sum())
            annotations.append(ann)
    if kind == "figures":
        categories = [{"id": 1, "name": "figure", "supercategory": "figure", "keypoints": KEYPOINT_NAMES,
                       "skeleton": _SKELETON}]
    else:
        categories = [{"id": k + 1, "name": name, "supercategory": "shape"} for k, name in enumerate(SHAPE_CLASSES)]
    dataset = {"info": {"description": f"yolo_func built-in {kind} ({split}), generator v{GENERATOR_VERSION}, "
                                       f"seed {seed}", "version": str(GENERATOR_VERSION)},
               "licenses": [], "images": images, "annotations": annotations, "categories": categories}
    (out / "annotations.json").write_text(json.dumps(dataset, separators=(",", ":")))
    manifest = {p.relative_to(out).as_posix(): p.stat().st_size for p in sorted(out.rglob("*")) if p.is_file()}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=0, sort_keys=True))


# ---------------------------------------------------------------------- drawing
def _image_size(rng: np.random.Generator) -> tuple[int, int]:
    return int(rng.integers(10, 21)) * 32, int(rng.integers(10, 21)) * 32


def _background(rng: np.random.Generator, h: int, w: int) -> np.ndarray:
    """float32[H, W, 3] textured background in 0..255: colour blobs, a gradient or stripes, plus noise."""
    def muted(k=1):
        grey = rng.uniform(40, 215, (k, 1))
        return grey + rng.uniform(-45, 45, (k, 3))

    style = rng.integers(3)
    if style == 0:  # low-frequency colour blobs
        gh, gw = int(rng.integers(2, 9)), int(rng.integers(2, 9))
        grid = muted(gh * gw).reshape(gh, gw, 3).astype(np.float32)
        bg = cv2.resize(grid, (w, h), interpolation=cv2.INTER_CUBIC)
    else:
        angle = rng.uniform(0, math.pi)
        xx, yy = np.arange(w, dtype=np.float32)[None, :], np.arange(h, dtype=np.float32)[:, None]
        t = (xx * math.cos(angle) + yy * math.sin(angle)) / max(h, w)
        if style == 1:  # gradient
            t = (t - t.min()) / max(float(t.max() - t.min()), 1e-6)
        else:  # stripes
            t = 0.5 + 0.5 * np.sin(t * rng.uniform(6, 40) * math.pi)
        c0, c1 = muted(2).astype(np.float32)
        bg = c0 + t[..., None] * (c1 - c0)
    return bg.astype(np.float32)


def _shape_mask(rng: np.random.Generator, cls: int, h: int, w: int) -> np.ndarray:
    """uint8[H, W] mask of one random shape of class ``cls`` (order of SHAPE_CLASSES)."""
    mask = np.zeros((h, w), np.uint8)
    # Log-uniform size; the smallest stay >= ~10 px when the image is shrunk to 320 for training.
    size = math.exp(rng.uniform(math.log(max(10.0, 0.03 * min(h, w))), math.log(0.5 * min(h, w))))
    aspect = math.exp(rng.uniform(-math.log(2.5), math.log(2.5)))
    sx, sy = size * math.sqrt(aspect) / 2, size / math.sqrt(aspect) / 2
    cx, cy = rng.uniform(0.05 * w, 0.95 * w), rng.uniform(0.05 * h, 0.95 * h)
    angle = rng.uniform(0, 360)
    if cls in (0, 4):  # ellipse, ring
        cv2.ellipse(mask, ((cx, cy), (2 * sx, 2 * sy), angle), 1, -1)
        if cls == 4:
            r = rng.uniform(0.45, 0.7)
            cv2.ellipse(mask, ((cx, cy), (2 * sx * r, 2 * sy * r), angle), 0, -1)
        return mask
    if cls == 1:  # rectangle
        pts = np.array([[-1, -1], [1, -1], [1, 1], [-1, 1]], np.float64)
    elif cls == 2:  # triangle
        pts = np.array([[math.cos(a), math.sin(a)] for a in (-math.pi / 2, math.pi / 6, 5 * math.pi / 6)])
    else:  # star: 5 points, inner radius 0.45
        pts = np.array([[math.cos(-math.pi / 2 + k * math.pi / 5) * (1 if k % 2 == 0 else 0.45),
                         math.sin(-math.pi / 2 + k * math.pi / 5) * (1 if k % 2 == 0 else 0.45)] for k in range(10)])
    pts = pts * [sx, sy]
    c, s = math.cos(math.radians(angle)), math.sin(math.radians(angle))
    pts = pts @ np.array([[c, s], [-s, c]]) + [cx, cy]
    cv2.fillPoly(mask, [np.round(pts * 16).astype(np.int32)], 1, lineType=cv2.LINE_8, shift=4)
    return mask


def _paint(canvas: np.ndarray, mask: np.ndarray, rgb, rng: np.random.Generator) -> None:
    """Paints ``rgb`` (jittered, with a soft shading gradient) over ``mask``, in place."""
    colour = np.clip(np.asarray(rgb, np.float32) + rng.uniform(-25, 25, 3), 0, 255)
    angle, strength = rng.uniform(0, 2 * math.pi), rng.uniform(0.05, 0.25)
    x, y, bw, bh = cv2.boundingRect(mask)
    if bw == 0:
        return
    yy, xx = np.mgrid[0:bh, 0:bw].astype(np.float32)
    t = (xx - bw / 2) * math.cos(angle) + (yy - bh / 2) * math.sin(angle)
    shade = 1.0 + strength * t / max(float(np.abs(t).max()), 1.0)
    roi = canvas[y:y + bh, x:x + bw]
    inside = mask[y:y + bh, x:x + bw] > 0
    roi[inside] = np.clip(colour[None, :] * shade[inside][:, None], 0, 255)


def _visible(owner: np.ndarray, masks: list[np.ndarray]) -> list[tuple[int, np.ndarray]]:
    """(index, visible mask) of each drawn instance that is visible enough to annotate."""
    out = []
    for k, mask in enumerate(masks):
        vis = (owner == k).astype(np.uint8)
        area, full = cv2.countNonZero(vis), cv2.countNonZero(mask)
        if area >= _MIN_VISIBLE_PIXELS and area >= _MIN_VISIBLE_FRACTION * full:
            out.append((k, vis))
    return out


def _finish(canvas: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Adds film grain to 30 % of the images (a 64 px noise tile repeated, cheap to draw) -> uint8.

    Grain is rare because noisy PNGs are 3-4x larger and slower to encode and decode.
    """
    h, w = canvas.shape[:2]
    if rng.random() >= 0.3:
        return np.clip(np.rint(canvas), 0, 255).astype(np.uint8)
    sigma = rng.uniform(1, 5)
    tile = rng.normal(0, sigma, (64, 64, 3)).astype(np.float32)
    grain = np.tile(tile, (h // 64 + 1, w // 64 + 1, 1))[:h, :w]
    return np.clip(np.rint(canvas + grain), 0, 255).astype(np.uint8)


def _draw_shapes(rng: np.random.Generator):
    h, w = _image_size(rng)
    canvas = _background(rng, h, w)
    owner = np.full((h, w), -1, np.int32)
    crowded = rng.random() < 0.2
    n = int(rng.integers(6, 15)) if crowded else int(rng.integers(1, 8))
    colours = list(SHAPE_CLASSES.values())
    masks, classes = [], []
    for k in range(n):
        cls = int(rng.integers(len(SHAPE_CLASSES)))
        mask = _shape_mask(rng, cls, h, w)
        if not mask.any():
            continue
        _paint(canvas, mask, colours[cls], rng)
        owner[mask > 0] = len(masks)
        masks.append(mask)
        classes.append(cls)
    instances = [{"category": classes[k], "mask": vis} for k, vis in _visible(owner, masks)]
    return _finish(canvas, rng), instances


def _skeleton_points(rng: np.random.Generator, height: float, cx: float, top: float) -> np.ndarray:
    """float[17, 2] joint positions of a frontal figure (its left side on the image's right)."""
    u = height
    hw = rng.uniform(0.85, 1.2)  # width jitter
    p = np.zeros((17, 2))
    p[0] = (0, 0.085)
    p[1], p[2] = (0.024, 0.065), (-0.024, 0.065)
    p[3], p[4] = (0.05, 0.08), (-0.05, 0.08)
    p[5], p[6] = (0.11, 0.2), (-0.11, 0.2)
    p[11], p[12] = (0.075, 0.52), (-0.075, 0.52)
    p[:, 0] *= hw

    def limb(start, length, degrees):  # degrees from straight down, positive towards +x
        a = math.radians(degrees)
        return start + length * np.array([math.sin(a), math.cos(a)])

    for side, sign in ((0, 1), (1, -1)):  # left (+x), right (-x)
        shoulder, hip = 5 + side, 11 + side
        upper = sign * rng.uniform(-20, 150)
        p[7 + side] = limb(p[shoulder], 0.16, upper)
        p[9 + side] = limb(p[7 + side], 0.15, upper + sign * rng.uniform(-30, 100))
        thigh = sign * rng.uniform(-15, 45)
        p[13 + side] = limb(p[hip], 0.23, thigh)
        p[15 + side] = limb(p[13 + side], 0.22, thigh + sign * rng.uniform(-50, 20))
    tilt = math.radians(rng.uniform(-15, 15))
    c, s = math.cos(tilt), math.sin(tilt)
    centre = np.array([0, 0.5])
    p = (p - centre) @ np.array([[c, s], [-s, c]]) + centre
    return p * u + [cx, top]


def _figure_masks(points: np.ndarray, height: float, h: int, w: int):
    """(body mask uint8[H, W], face-dots mask uint8[H, W]) of a stick figure."""
    body = np.zeros((h, w), np.uint8)
    t = max(2, int(round(height * 0.035)))
    q = np.round(points * 16).astype(np.int32)
    for a, b in ((5, 7), (7, 9), (6, 8), (8, 10), (11, 13), (13, 15), (12, 14), (14, 16)):
        cv2.line(body, tuple(int(v) for v in q[a]), tuple(int(v) for v in q[b]), 1, t, cv2.LINE_8, shift=4)
    cv2.fillPoly(body, [q[[5, 6, 12, 11]]], 1, cv2.LINE_8, shift=4)
    head_c = (points[1] + points[2]) / 2 + [0, 0.005 * height]
    cv2.circle(body, tuple(int(v) for v in np.round(head_c * 16)), int(round(0.065 * height * 16)), 1, -1,
               cv2.LINE_8, shift=4)
    face = np.zeros((h, w), np.uint8)
    r = max(1, int(round(height * 0.009)))
    for k in (0, 1, 2):
        cv2.circle(face, tuple(int(v) for v in np.round(points[k])), r, 1, -1)
    for k in (3, 4):
        cv2.circle(face, tuple(int(v) for v in np.round(points[k])), max(1, r // 2 + 1), 1, -1)
    return body, face & body


def _draw_figures(rng: np.random.Generator):
    h, w = _image_size(rng)
    canvas = _background(rng, h, w)
    owner = np.full((h, w), -1, np.int32)
    n = int(rng.integers(1, 5))
    n_occluders = int(rng.integers(0, 4))
    order = rng.permutation(n + n_occluders)  # figures (< n) and unannotated shapes interleaved
    masks, points = [], []
    for item in order:
        if item >= n:
            cls = int(rng.integers(len(SHAPE_CLASSES)))
            mask = _shape_mask(rng, cls, h, w)
            _paint(canvas, mask, list(SHAPE_CLASSES.values())[cls], rng)
            owner[mask > 0] = -2
            continue
        height = math.exp(rng.uniform(math.log(40), math.log(0.9 * h)))
        cx = rng.uniform(0.05 * w, 0.95 * w)
        top = rng.uniform(-0.1 * height, h - 0.6 * height)
        pts = _skeleton_points(rng, height, cx, top)
        body, face = _figure_masks(pts, height, h, w)
        if not body.any():
            continue
        hue = rng.uniform(0, 180)
        rgb = cv2.cvtColor(np.uint8([[[hue, rng.uniform(150, 255), rng.uniform(150, 255)]]]), cv2.COLOR_HSV2RGB)[0, 0]
        _paint(canvas, body, rgb, rng)
        canvas[face > 0] = rng.uniform(0, 40)
        owner[body > 0] = len(masks)
        masks.append(body)
        points.append(pts)
    instances = []
    for k, vis in _visible(owner, masks):
        pts = points[k]
        kp = np.zeros((17, 3))
        for j, (x, y) in enumerate(pts):
            xi, yi = int(math.floor(x)), int(math.floor(y))
            if not (0 <= x < w and 0 <= y < h):
                continue
            kp[j] = (x, y, 2 if owner[yi, xi] == k else 1)
        instances.append({"category": 0, "mask": vis, "keypoints": kp})
    return _finish(canvas, rng), instances
