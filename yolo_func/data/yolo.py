"""Ultralytics-format ("YOLO") datasets: a ``data.yaml`` beside ``images/`` and ``labels/`` folders.

``data.yaml`` keys: ``path`` (the dataset root; relative paths are relative to the yaml's folder;
default: the yaml's folder), one key per split (``train``, ``val``, ``test``) whose value is a
folder of images, a ``.txt`` file listing image paths, or a list of those (relative to ``path``;
lines of a ``.txt`` list that start with ``./`` are relative to the list's folder, as in the
reference), ``names`` (a list, or a dict ``{0: name, ...}`` with keys 0..K-1), and for pose
``kpt_shape: [P, D]`` (D 2 or 3) and ``flip_idx`` (a permutation of the P keypoints).

Each image ``.../images/.../x.jpg`` has its labels in ``.../labels/.../x.txt`` (the last
``images`` folder of the path replaced by ``labels``), one instance per line, coordinates
normalised to [0, 1]:

* detect: ``cls cx cy w h`` (a polygon line, or a pose line when ``kpt_shape`` is given, is read
  for its box);
* segment: ``cls x1 y1 x2 y2 ...`` (a polygon of at least 3 points; the box is its extent);
* pose: ``cls cx cy w h`` followed by P·D keypoint values (with D = 2 the visibility is 2 for
  keypoints with a non-zero coordinate, else 0).

An image without a label file is a background image (no instances), as in the reference.
Masks are rasterised from the polygons with pycocotools (``frPyObjects`` + ``decode``), the same
rasteriser as :class:`yolo_func.data.CocoDataset` and ``COCO.annToMask``, so a COCO dataset and
its YOLO-format conversion give the same masks up to the coordinates' rounding (OpenCV's
``fillPoly`` snaps vertices to the pixel grid and fills boundary pixels differently).

Bad input policy:

* **Raised at construction** (``ValueError`` naming the file): a missing or unparsable
  ``data.yaml``, a missing key (``names``, the requested split; ``kpt_shape`` and ``flip_idx`` for
  pose), a malformed ``names`` / ``kpt_shape`` / ``flip_idx``, a split folder or list that does
  not exist, a split without images.
* **Skipped and counted** in ``ds.skipped`` with one warning naming the first few files:
  ``missing_image`` / ``corrupt_image`` (images listed in a ``.txt`` that do not exist, or that fail
  the header check; removed from the dataset), ``bad_label_line`` (wrong number of columns for the
  task, a non-numeric value, a class outside ``names``, coordinates not normalised, a polygon with
  an odd number of values or fewer than 3 points; the line is dropped), ``empty_box`` (zero-size
  box; dropped).
* **Raised at ``ds[i]``**: an image that cannot be decoded when loaded raises a ``ValueError``
  naming the file; the loader counts and skips it.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import yaml

from yolo_func.data.coco import CocoDataset, check_task, segmentations_to_masks, warn_skipped
from yolo_func.data.images import check_image, read_image
from yolo_func.data.polygons import segmentation_to_polygon
from yolo_func.data.sample import Sample, dataset_index

__all__ = ["YoloDataset", "write_yolo_dataset", "IMAGE_SUFFIXES"]

#: Image file suffixes found in split folders.
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".tif", ".tiff", ".webp")
#: Normalised coordinates may overshoot [0, 1] by this much (rounding in converters); they are clipped.
_SLACK = 0.01


def label_path(image: Path) -> Path:
    """``.../images/.../x.jpg`` -> ``.../labels/.../x.txt`` (the last ``images`` component replaced)."""
    parts = list(image.parts)
    for k in range(len(parts) - 2, -1, -1):
        if parts[k] == "images":
            parts[k] = "labels"
            break
    return Path(*parts).with_suffix(".txt")


def _check(f: Path):
    """(size (H, W) or None, skip reason, example) of one image file."""
    if not f.is_file():
        return None, "missing_image", f"{f} (missing_image)"
    try:
        size = check_image(f)
        return (size if size is not None else read_image(f).shape[:2]), None, None
    except ValueError as err:
        return None, "corrupt_image", f"{f} (corrupt_image: {str(err).removeprefix('[yolo_func] ')})"


class YoloDataset:
    """One split of an Ultralytics-format dataset, as raw :class:`Sample` records.

    Args:
      data_yaml: the dataset's ``data.yaml``.
      split: the split key to read (``"train"``, ``"val"``, ``"test"``).
      task: ``"detect"``, ``"segment"`` or ``"pose"``.
      workers: threads for reading the label files and checking the image headers.

    Attributes:
      task: the task.
      root: the dataset root (``path``).
      names: list[str] class names.
      kpt_shape: ``(P, D)`` from the yaml (None when absent).
      flip_idx: list[int] keypoint flip permutation (None when absent).
      image_files: list[Path] every image of the split, sorted.
      file_names: list[str] each image's path relative to ``root`` (or absolute when outside it).
      image_ids: int64[len] the index of each image (YOLO data has no ids).
      image_sizes: int64[len, 2] each image's (height, width) after EXIF orientation, read from
        the file header at construction (decoded for formats without a parsed header).
      skipped: dict reason -> count (see the module docstring).

    Raises:
      ValueError: structural problems (see the module docstring), naming the file.

    Example:
      >>> from yolo_func.data import builtin_dataset
      >>> import tempfile
      >>> from yolo_func.data import YoloDataset
      >>> from yolo_func.data.yolo import write_yolo_dataset
      >>> yaml = write_yolo_dataset(builtin_dataset("detect", "val", num_images=2), tempfile.mkdtemp())
      >>> ds = YoloDataset(yaml, "val", task="detect")
      >>> len(ds), ds[0].boxes.shape[1]
      (2, 4)
    """

    def __init__(self, data_yaml: str | os.PathLike, split: str, *, task: str, workers: int = 8):
        self.task = check_task(task)
        self.data_yaml = Path(data_yaml)
        self.split = split
        config = self._read_yaml()
        self.names = self._names(config)
        self.kpt_shape, self.flip_idx = self._keypoint_spec(config)
        self.root = self._root(config)
        self.skipped: dict[str, int] = {k: 0 for k in ("missing_image", "corrupt_image", "bad_label_line", "empty_box")}
        self._examples: list[str] = []
        files = self._split_files(config)
        if not files:
            raise self._fail(f"split {split!r} has no images ({config[split]!r}, suffixes {IMAGE_SUFFIXES}); "
                             "check the split's folder or list")
        with ThreadPoolExecutor(max(1, workers)) as pool:
            checked = list(pool.map(_check, files))
            keep = []
            for f, (size, reason, example) in zip(files, checked):
                if size is None:
                    self.skipped[reason] += 1
                    self._examples.append(example)
                else:
                    keep.append((f, size))
            labels = list(pool.map(lambda f: self._parse_labels(f), [f for f, _ in keep]))
        self.image_files = [f for f, _ in keep]
        n = len(self.image_files)
        self.image_sizes = np.asarray([size for _, size in keep], np.int64).reshape(n, 2)
        self.image_ids = np.arange(n, dtype=np.int64)
        self.file_names = [self._relative(f) for f in self.image_files]
        self._labels = []
        for result in labels:
            self._labels.append(result[0])
            for reason, example in result[1]:
                self.skipped[reason] += 1
                self._examples.append(example)
        warn_skipped(self.data_yaml, self.skipped, self._examples)

    # ------------------------------------------------------------------ the yaml
    def _fail(self, what: str) -> ValueError:
        return ValueError(f"[yolo_func] data_yaml={str(self.data_yaml)!r}: {what}")

    def _read_yaml(self) -> dict:
        if not self.data_yaml.is_file():
            raise ValueError(f"[yolo_func] data_yaml={str(self.data_yaml)!r}: no such file; expected an "
                             "Ultralytics data.yaml (path, train, val, names); check the path")
        try:
            config = yaml.safe_load(self.data_yaml.read_text())
        except yaml.YAMLError as err:
            raise self._fail(f"not valid YAML ({err}); fix the file") from None
        if not isinstance(config, dict):
            raise self._fail(f"expected a mapping with path, train, val, names, got {type(config).__name__}")
        missing = [k for k in ("names", self.split) if config.get(k) is None]
        if self.task == "pose":
            missing += [k for k in ("kpt_shape", "flip_idx") if config.get(k) is None]
        if missing:
            hint = {"names": "names: [cat, dog] or {0: cat, 1: dog}", self.split: f"{self.split}: images/{self.split}",
                    "kpt_shape": "kpt_shape: [17, 3]", "flip_idx": "flip_idx: [0, 2, 1, 4, 3, ...] (COCO persons)"}
            raise self._fail(f"missing key(s) {missing}; add e.g. " + "; ".join(hint[k] for k in missing))
        return config

    def _names(self, config: dict) -> list[str]:
        names = config["names"]
        if isinstance(names, dict):
            keys = sorted(names)
            if keys != list(range(len(keys))):
                raise self._fail(f"names keys must be 0..K-1, got {keys[:10]}; renumber the classes")
            return [str(names[k]) for k in keys]
        if isinstance(names, list) and names:
            return [str(n) for n in names]
        raise self._fail(f"names must be a non-empty list or a dict {{0: name, ...}}, got {names!r}")

    def _keypoint_spec(self, config: dict):
        shape, flip = config.get("kpt_shape"), config.get("flip_idx")
        if shape is not None:
            if not (isinstance(shape, list) and len(shape) == 2 and all(isinstance(v, int) for v in shape)
                    and shape[0] > 0 and shape[1] in (2, 3)):
                raise self._fail(f"kpt_shape must be [P, D] with P > 0 and D in (2, 3), got {shape!r}")
            shape = (shape[0], shape[1])
        if flip is not None:
            p = shape[0] if shape else len(flip)
            if not isinstance(flip, list) or sorted(flip) != list(range(p)):
                raise self._fail(f"flip_idx must be a permutation of 0..{p - 1} (kpt_shape {shape}), got {flip!r}")
            flip = [int(v) for v in flip]
        return shape, flip

    def _root(self, config: dict) -> Path:
        root = Path(config.get("path") or ".")
        return root if root.is_absolute() else (self.data_yaml.parent / root).resolve()

    def _split_files(self, config: dict) -> list[Path]:
        entries = config[self.split]
        entries = entries if isinstance(entries, list) else [entries]
        files: list[Path] = []
        for entry in entries:
            p = Path(str(entry))
            p = p if p.is_absolute() else self.root / p
            if p.is_dir():
                files += [f for f in p.rglob("*") if f.suffix.lower() in IMAGE_SUFFIXES and f.is_file()]
            elif p.is_file() and p.suffix == ".txt":
                for line in p.read_text().splitlines():
                    line = line.strip()
                    if not line:
                        continue
                    f = Path(line)
                    if line.startswith("./"):
                        f = p.parent / line[2:]
                    elif not f.is_absolute():
                        f = self.root / f
                    files.append(f)
            elif p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES:
                files.append(p)
            else:
                raise self._fail(f"split {self.split!r} entry {str(entry)!r} resolves to {p}, which is neither a "
                                 "folder, a .txt list nor an image; check path and the split key")
        return sorted({Path(os.path.normpath(f)) for f in files})

    def _relative(self, f: Path) -> str:
        try:
            return f.relative_to(self.root).as_posix()
        except ValueError:
            return f.as_posix()

    # ------------------------------------------------------------------ files
    def _parse_labels(self, image: Path):
        """Parses one label file -> ((classes, boxes_n, polygons_n, keypoints_n), [(reason, example)])."""
        path = label_path(image)
        bad: list[tuple[str, str]] = []
        classes, boxes, polygons, kpts = [], [], [], []
        text = path.read_text() if path.is_file() else ""
        k_classes = len(self.names)
        pose_cols = 5 + self.kpt_shape[0] * self.kpt_shape[1] if self.kpt_shape else None
        for lineno, line in enumerate(text.splitlines(), 1):
            fields = line.split()
            if not fields:
                continue

            def reject(why: str):
                bad.append(("bad_label_line", f"{path}:{lineno} ({why})"))

            try:
                values = np.asarray([float(v) for v in fields], np.float64)
            except ValueError:
                reject("non-numeric value")
                continue
            n = len(values)
            cls = values[0]
            if not np.isfinite(values).all() or cls != int(cls) or not 0 <= cls < k_classes:
                reject(f"class {fields[0]} not in 0..{k_classes - 1} or non-finite value")
                continue
            coords = values[1:]
            xy = coords
            if pose_cols is not None and n == pose_cols:
                xy = np.concatenate([coords[:4], coords[4:].reshape(self.kpt_shape)[:, :2].ravel()])
            if xy.min() < -_SLACK or xy.max() > 1 + _SLACK:
                reject("coordinates not normalised to [0, 1]")
                continue
            is_polygon = n >= 7 and n % 2 == 1
            polygon, kp = None, None
            if self.task == "pose":
                if n != pose_cols:
                    reject(f"{n} columns, expected {pose_cols} for kpt_shape {list(self.kpt_shape)}")
                    continue
                box = coords[:4]
                kp = coords[4:].reshape(self.kpt_shape)
            elif self.task == "segment":
                if not is_polygon:
                    reject(f"{n} columns, expected a class and a polygon (an even number >= 6 of coordinates)")
                    continue
                polygon = coords
                box = None
            else:
                if n == 5 or (pose_cols is not None and n == pose_cols):
                    box = coords[:4]
                elif is_polygon:
                    polygon = coords
                    box = None
                else:
                    reject(f"{n} columns, expected 5 (cls cx cy w h) or a polygon")
                    continue
            if box is None:
                xy = polygon.reshape(-1, 2).clip(0, 1)
                x1, y1 = xy.min(0)
                x2, y2 = xy.max(0)
            else:
                cx, cy, w, h = box
                x1, y1, x2, y2 = np.clip([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], 0, 1)
            if x2 <= x1 or y2 <= y1:
                bad.append(("empty_box", f"{path}:{lineno} (empty_box)"))
                continue
            classes.append(int(cls))
            boxes.append((x1, y1, x2, y2))
            polygons.append(polygon)
            kpts.append(kp)
        n = len(classes)
        keypoints = None
        if self.task == "pose":
            keypoints = np.asarray(kpts, np.float64).reshape(n, *self.kpt_shape)
        return (np.asarray(classes, np.int64).reshape(n), np.asarray(boxes, np.float64).reshape(n, 4),
                polygons, keypoints), bad

    # ------------------------------------------------------------------ access
    def labels(self, index: int, size: tuple[int, int] | None = None):
        """The targets of ``index`` in pixels, without decoding the image.

        Args:
          index: the image index.
          size: (H, W) to scale the normalised labels to; default ``image_sizes[index]``.

        Returns:
          (boxes float32[N, 4] xyxy pixels, classes int64[N], keypoints float32[N, P, 3] or None).
        """
        h, w = size if size is not None else self.image_sizes[index]
        classes, boxes_n, _, kpts_n = self._labels[index]
        boxes = (boxes_n * [w, h, w, h]).astype(np.float32)
        keypoints = None
        if kpts_n is not None:
            p = kpts_n.shape[1]
            keypoints = np.zeros((len(classes), p, 3), np.float32)
            keypoints[..., 0] = kpts_n[..., 0] * w
            keypoints[..., 1] = kpts_n[..., 1] * h
            if kpts_n.shape[2] == 3:
                keypoints[..., 2] = kpts_n[..., 2]
            else:
                keypoints[..., 2] = np.where((kpts_n[..., 0] != 0) | (kpts_n[..., 1] != 0), 2.0, 0.0)
        return boxes, classes.copy(), keypoints

    def polygons(self, index: int, size: tuple[int, int] | None = None) -> list[np.ndarray]:
        """Each instance's polygon in pixels (task ``segment``), in Sample order.

        Args:
          index: the image index.
          size: (H, W) to scale the normalised polygons to; default ``image_sizes[index]``.

        Returns:
          N float32[K_j, 2] (x, y) vertex arrays; ``[]`` for the other tasks.
        """
        if self.task != "segment":
            return []
        h, w = size if size is not None else self.image_sizes[index]
        return [(p.reshape(-1, 2) * [w, h]).astype(np.float32) for p in self._labels[index][2]]

    def image_path(self, index: int) -> Path:
        """The image file of ``index``."""
        return self.image_files[index]

    def read_image(self, index: int) -> np.ndarray:
        """Decodes only the image of ``index``: uint8[H, W, 3] RGB, EXIF orientation applied.

        Raises:
          ValueError: the file cannot be read or decoded, naming it.
        """
        return read_image(self.image_files[index])

    def __len__(self) -> int:
        return len(self.image_files)

    def __getitem__(self, index: int) -> Sample:
        """The raw sample of ``index`` (see :class:`Sample`); ``image_id`` is the index.

        Raises:
          IndexError: ``index`` out of range.
          ValueError: the image cannot be read or decoded, naming the file.
        """
        index = dataset_index(index, len(self))
        image = self.read_image(index)
        h, w = image.shape[:2]
        boxes, classes, keypoints = self.labels(index, (h, w))
        masks = None
        if self.task == "segment":
            scale = np.asarray([w, h], np.float64)
            polys = [[(p.reshape(-1, 2) * scale).ravel().tolist()] for p in self._labels[index][2]]
            masks = segmentations_to_masks(polys, h, w)
        return Sample(image=image, boxes=boxes, classes=classes, masks=masks, keypoints=keypoints,
                      image_id=index, file_name=self.file_names[index])

    def __repr__(self) -> str:
        return (f"YoloDataset({str(self.data_yaml)!r}, {self.split!r}, task={self.task!r}, images={len(self)}, "
                f"classes={len(self.names)}, skipped={sum(self.skipped.values())})")


# ---------------------------------------------------------------------- conversion
def _link_or_copy(src: Path, dst: Path) -> None:
    if dst.exists():
        dst.unlink()
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


def write_yolo_dataset(datasets: CocoDataset | Mapping[str, CocoDataset], out_dir: str | os.PathLike) -> Path:
    """Writes COCO-format datasets in the Ultralytics format (for :class:`YoloDataset` and the reference trainer).

    Each split goes to ``out_dir/images/<split>/`` (hard links to the original images, copies
    across file systems) and ``out_dir/labels/<split>/*.txt``; ``out_dir/data.yaml`` lists the
    splits, names and, for pose, ``kpt_shape`` and ``flip_idx``. Boxes become ``cls cx cy w h``
    (detect), polygons ``cls x1 y1 ...`` (segment; multi-part polygons joined by
    :func:`~yolo_func.data.polygons.merge_polygon_parts`, RLE masks outlined from OpenCV contours), keypoints
    ``cls cx cy w h x y v ...`` (pose); all normalised by the image size, 6 decimals.

    Args:
      datasets: ``{"train": ds, "val": ds2, ...}``; a single dataset is written as both ``train``
        and ``val``. All must share task and category order.
      out_dir: the dataset root to create (existing files of the same names are overwritten).

    Returns:
      The path of the written ``data.yaml``.

    Raises:
      ValueError: the datasets disagree on task or names, or the mapping is empty.
    """
    if isinstance(datasets, CocoDataset):
        datasets = {"train": datasets, "val": datasets}
    if not datasets:
        raise ValueError("[yolo_func] write_yolo_dataset(datasets=...) got no dataset; pass a CocoDataset or "
                         "a {'train': ds, 'val': ds} mapping")
    first = next(iter(datasets.values()))
    for split, ds in datasets.items():
        if ds.task != first.task or ds.names != first.names:
            raise ValueError(f"[yolo_func] write_yolo_dataset: split {split!r} has task {ds.task!r} and "
                             f"{len(ds.names)} names, the first split {first.task!r} and {len(first.names)}; "
                             "build every split with the same task and categories")
    out = Path(out_dir)
    for split, ds in datasets.items():
        img_dir, lbl_dir = out / "images" / split, out / "labels" / split
        img_dir.mkdir(parents=True, exist_ok=True)
        lbl_dir.mkdir(parents=True, exist_ok=True)
        for i in range(len(ds)):
            name = Path(ds.file_names[i])
            stem = "__".join(name.with_suffix("").parts)
            _link_or_copy(ds.image_path(i), img_dir / (stem + name.suffix))
            (lbl_dir / (stem + ".txt")).write_text(_label_text(ds, i))
    config = {"path": str(out.resolve()), **{split: f"images/{split}" for split in datasets},
              "names": {k: n for k, n in enumerate(first.names)}}
    if first.task == "pose":
        config["kpt_shape"] = [int(first.kpt_shape[0]), int(first.kpt_shape[1])]
        config["flip_idx"] = [int(v) for v in first.flip_idx]
    path = out / "data.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def _label_text(ds: CocoDataset, index: int) -> str:
    h, w = (int(v) for v in ds.image_sizes[index])
    boxes, classes, keypoints = ds.labels(index)
    scale = np.asarray([w, h], np.float64)
    lines = []
    segms = ds.segmentations(index) if ds.task == "segment" else [None] * len(classes)
    for k in range(len(classes)):
        x1, y1, x2, y2 = boxes[k].astype(np.float64)
        fields = [f"{int(classes[k])}"]
        if ds.task == "segment":
            segm = segms[k]
            path = segmentation_to_polygon(segm, h, w)
            if path is None:
                continue
            fields += [f"{v:.6f}" for v in (path / scale).clip(0, 1).ravel()]
        else:
            fields += [f"{v:.6f}" for v in ((x1 + x2) / 2 / w, (y1 + y2) / 2 / h, (x2 - x1) / w, (y2 - y1) / h)]
            if keypoints is not None:
                kp = keypoints[k].astype(np.float64)
                for x, y, v in kp:
                    fields += [f"{x / w:.6f}", f"{y / h:.6f}", f"{int(v)}"]
        lines.append(" ".join(fields))
    return "".join(line + "\n" for line in lines)
