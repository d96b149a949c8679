"""COCO-format datasets (instances and person-keypoints JSON), read with pycocotools.

``CocoDataset(annotations, images, task=...)[i]`` is the raw, unaugmented :class:`Sample` of the
i-th image of the JSON's ``images`` list (images without annotations included).

What becomes a training target (the reference's rule): every annotation of a selected category
that is not a crowd (``iscrowd`` 1) and whose box has a positive width and height. Boxes are
``xywh`` -> ``xyxy`` clipped to the image (an instance whose clipped box is empty is dropped).
Masks (task ``segment``) decode polygons and RLE exactly as ``COCO.annToMask`` does. Keypoints
(task ``pose``) are the JSON's ``(x, y, v)`` triplets unchanged, visibility kept; an annotation of
a keypoint category without a ``keypoints`` field gets all-zero (invisible) keypoints.

Bad input policy:

* **Raised at construction** (``ValueError`` naming the file and what is wrong): a missing or
  unparsable JSON, a JSON without ``images`` / ``annotations`` / ``categories``, a duplicate image
  id, an annotation whose ``image_id`` is not an image of the JSON, an annotation whose
  ``category_id`` is not a category of the JSON, an annotation without ``bbox``, an unknown name or
  id in ``categories=``, a ``pose`` task on a JSON without keypoint categories.
* **Skipped and counted** in ``ds.skipped`` (a dict reason -> count), with one warning at
  construction naming the first few files: ``missing_image`` / ``corrupt_image`` (found by the
  header check of :meth:`CocoDataset.verify`, run at construction unless ``verify=False``; the
  image is removed from the dataset), ``size_mismatch`` (the image's size is not the JSON's
  ``height``/``width``; removed), ``empty_box`` (zero-size box, the instance is dropped),
  ``bad_polygon`` (a polygon part with an odd number of coordinates or fewer than 3 points; the part
  is dropped, and in task ``segment`` an instance left without any valid part is dropped),
  ``bad_rle`` (an RLE whose size is not the image's; the instance is dropped in task ``segment``),
  ``bad_keypoints`` (a keypoint list whose length is not 3·P; the instance is dropped in ``pose``).
* **Raised at ``ds[i]``**: an image that cannot be read or decoded when it is loaded (for example
  with ``verify=False``, or a file that changed since construction) raises a ``ValueError`` naming
  the file; the loader counts and skips it.

Crowd annotations are not counted as skipped: they are valid COCO data that is not trained on.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import warnings
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from pycocotools import mask as mask_utils
from pycocotools.coco import COCO

from yolo_func.data.images import check_image, read_image
from yolo_func.data.polygons import segmentation_to_polygon
from yolo_func.data.sample import Sample, dataset_index

__all__ = ["CocoDataset", "TASKS", "flip_index_from_names", "segmentations_to_mask_crops", "segmentations_to_masks",
           "warn_skipped"]

#: The tasks every dataset accepts.
TASKS = ("detect", "segment", "pose")
_WARN_FIRST = 5


def check_task(task: str) -> str:
    """Returns ``task`` or raises the library's error for an unknown one."""
    if task not in TASKS:
        raise ValueError(f"[yolo_func] task must be one of {TASKS}, got {task!r}; "
                         "pass task='detect', 'segment' or 'pose'")
    return task


def flip_index_from_names(names: Sequence[str]) -> list[int]:
    """The horizontal-flip permutation of keypoints from their names (``left_*`` <-> ``right_*``).

    Args:
      names: P keypoint names, e.g. COCO's ``nose, left_eye, right_eye, ...``.

    Returns:
      P indices: ``flip[k]`` is the keypoint that ``k`` becomes after a left-right flip (itself
      when its name has no left/right partner). COCO's 17 names give
      ``[0, 2, 1, 4, 3, 6, 5, 8, 7, 10, 9, 12, 11, 14, 13, 16, 15]``.

    >>> flip_index_from_names(["nose", "left_eye", "right_eye"])
    [0, 2, 1]
    """
    index = {n: k for k, n in enumerate(names)}

    def partner(name: str) -> str:
        for a, b in (("left", "right"), ("right", "left"), ("Left", "Right"), ("Right", "Left")):
            if a in name:
                return name.replace(a, b)
        return name

    return [index.get(partner(n), k) for k, n in enumerate(names)]


def warn_skipped(source: str | os.PathLike, skipped: dict[str, int], examples: list[str]) -> None:
    """One warning summarising what a dataset skipped at construction (nothing when nothing was)."""
    counts = {k: v for k, v in skipped.items() if v}
    if not counts:
        return
    shown = "; ".join(examples[:_WARN_FIRST]) + (" ..." if len(examples) > _WARN_FIRST else "")
    warnings.warn(f"[yolo_func] {source}: skipped {counts} (see the dataset's .skipped); first: {shown}", stacklevel=3)


def segmentations_to_masks(segmentations: Sequence, height: int, width: int) -> np.ndarray:
    """Rasterises COCO segmentations as ``COCO.annToMask`` does (pycocotools RLE, polygons merged).

    Args:
      segmentations: N entries, each a list of polygon parts (flat ``[x0, y0, x1, y1, ...]`` in
        pixels) or an RLE dict (compressed or not) of size ``[height, width]``.
      height: image height H.
      width: image width W.

    Returns:
      uint8[N, H, W] 0/1 masks.
    """
    if not segmentations:
        return np.zeros((0, height, width), np.uint8)
    return np.ascontiguousarray(mask_utils.decode(_rles(segmentations, height, width)).transpose(2, 0, 1))


def _rles(segmentations: Sequence, height: int, width: int) -> list:
    rles = []
    for segm in segmentations:
        if isinstance(segm, dict):
            rles.append(mask_utils.frPyObjects(segm, height, width) if isinstance(segm["counts"], list) else segm)
        else:
            rles.append(mask_utils.merge(mask_utils.frPyObjects([list(p) for p in segm], height, width)))
    return rles


def segmentations_to_mask_crops(segmentations: Sequence, height: int,
                                width: int) -> tuple[np.ndarray, tuple[np.ndarray, ...]]:
    """The masks of :func:`segmentations_to_masks` as tight crops, without the full-size copies.

    The training loader only needs each mask inside its pixel bounding box; cropping the decoded
    (column-major) masks before making them C-contiguous avoids the full ``[N, H, W]`` transpose.

    Args:
      segmentations, height, width: as :func:`segmentations_to_masks`.

    Returns:
      ``(offsets int64[N, 2] (x0, y0), crops)`` with ``crops[i]`` uint8[h_i, w_i] 0/1, tight around
      the mask's pixels (a 0x0 crop at (0, 0) for an empty mask): equal to
      ``yolo_func.data.augment.RoiMasks.from_dense(segmentations_to_masks(...))``.
    """
    n = len(segmentations)
    offsets = np.zeros((n, 2), np.int64)
    if not n:
        return offsets, ()
    rles = _rles(segmentations, height, width)
    boxes = mask_utils.toBbox(rles).astype(np.int64)  # x, y, w, h of the pixels (exact for RLEs)
    by_column = mask_utils.decode(rles).T  # uint8[N, W, H] C-contiguous view of the Fortran [H, W, N]
    crops = []
    for i, (x, y, w, h) in enumerate(boxes):
        if w <= 0 or h <= 0:
            crops.append(np.zeros((0, 0), np.uint8))
            continue
        offsets[i] = (x, y)
        crops.append(np.ascontiguousarray(by_column[i, x:x + w, y:y + h].T))
    return offsets, tuple(crops)


def _polygon_ok(part) -> bool:
    return isinstance(part, (list, tuple)) and len(part) >= 6 and len(part) % 2 == 0


class CocoDataset:
    """A COCO instances / person-keypoints JSON and its image folder, as raw :class:`Sample` records.

    Args:
      annotations: the COCO JSON file (instances or person-keypoints format).
      images: the folder holding the images; each image is ``images / file_name``.
      task: ``"detect"`` (boxes, classes), ``"segment"`` (+ ``masks``) or ``"pose"`` (+
        ``keypoints``; only categories with a ``keypoints`` list, e.g. COCO's person).
      categories: optional selection and order of categories, as original ids (``int``) or names
        (``str``); contiguous class ``k`` is ``categories[k]`` and annotations of other categories
        are ignored. Default: every category of the JSON (for ``pose``, every keypoint category) in
        ascending id order, so COCO's 80 categories map to 0..79 as the reference's 91 -> 80 map.
      verify: run :meth:`verify` at construction (a header check of every image in a thread pool;
        missing, truncated and wrongly sized images are removed and counted in ``skipped``).
      workers: threads for the verification.

    Attributes:
      task: the task.
      annotations_path: the JSON path (for ``COCOeval`` later); ``coco`` is its pycocotools
        ``COCO`` object (built on first use after unpickling).
      image_dir: the image folder.
      category_ids: list[int], contiguous index -> original category id.
      names: list[str], contiguous index -> category name.
      kpt_shape: ``(P, 3)`` for ``pose``, else None.
      flip_idx: list[int] keypoint flip permutation for ``pose`` (from the keypoint names), else None.
      image_ids: int64[len] the JSON image id of each index.
      image_sizes: int64[len, 2] the original ``(height, width)`` of each index, from the JSON.
      file_names: list[str] each index's ``file_name``.
      skipped: dict reason -> count of what was skipped (see the module docstring).

    Raises:
      ValueError: structural problems (see the module docstring), naming the file.

    Example:
      >>> from yolo_func.data import builtin_dataset
      >>> from yolo_func.data import CocoDataset
      >>> val = builtin_dataset("pose", "val", num_images=2)
      >>> ds = CocoDataset(val.annotations_path, val.image_dir, task="pose")   # any COCO JSON and its images
      >>> ds.kpt_shape, ds[0].keypoints.shape[1:], ds.names
      ((17, 3), (17, 3), ['figure'])
    """

    def __init__(self, annotations: str | os.PathLike, images: str | os.PathLike, *, task: str,
                 categories: Sequence[int | str] | None = None, verify: bool = True, workers: int = 8):
        self.task = check_task(task)
        self.annotations_path = Path(annotations)
        self.image_dir = Path(images)
        if not self.annotations_path.is_file():
            raise ValueError(f"[yolo_func] annotations={str(annotations)!r}: no such file; expected a COCO JSON "
                             "(instances or person_keypoints); check the path")
        if not self.image_dir.is_dir():
            raise ValueError(f"[yolo_func] images={str(images)!r}: no such folder; expected the folder that holds "
                             "the JSON's file_name entries; check the path")
        self._coco = self._load_coco()
        self.skipped: dict[str, int] = {k: 0 for k in ("missing_image", "corrupt_image", "size_mismatch",
                                                       "empty_box", "bad_polygon", "bad_rle", "bad_keypoints")}
        self._examples: list[str] = []
        self._select_categories(categories)
        self._index_images()
        self._index_annotations()
        self._freeze()
        if verify:
            self.verify(workers=workers)
        warn_skipped(self.annotations_path, self.skipped, self._examples)

    # ------------------------------------------------------------------ construction
    def _load_coco(self) -> COCO:
        path = self.annotations_path
        try:
            dataset = json.loads(path.read_bytes())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ValueError(f"[yolo_func] annotations={str(path)!r} is not valid JSON ({err}); "
                             "expected a COCO annotation file") from None
        if not isinstance(dataset, dict):
            raise ValueError(f"[yolo_func] annotations={str(path)!r}: expected a JSON object with images, "
                             f"annotations and categories, got a {type(dataset).__name__}")
        missing = [k for k in ("images", "annotations", "categories") if not isinstance(dataset.get(k), list)]
        if missing:
            raise ValueError(f"[yolo_func] annotations={str(path)!r}: missing or non-list keys {missing}; a COCO "
                             "instances / person_keypoints JSON has images, annotations and categories lists")
        # pycocotools 2.0.10's loadRes (COCOeval of predictions) raises KeyError without these.
        dataset.setdefault("info", {})
        dataset.setdefault("licenses", [])
        coco = COCO()
        coco.dataset = dataset
        try:
            with contextlib.redirect_stdout(io.StringIO()):  # pycocotools prints progress lines
                coco.createIndex()
        except (KeyError, TypeError) as err:
            raise ValueError(f"[yolo_func] annotations={str(path)!r}: an image, annotation or category entry lacks "
                             f"the key {err}; every COCO entry needs an id (annotations also image_id and "
                             "category_id)") from None
        return coco

    def _fail(self, what: str) -> ValueError:
        return ValueError(f"[yolo_func] annotations={str(self.annotations_path)!r}: {what}")

    def _select_categories(self, categories: Sequence[int | str] | None) -> None:
        cats = sorted(self._coco.dataset["categories"], key=lambda c: c["id"])
        by_id = {c["id"]: c for c in cats}
        if len(by_id) != len(cats):
            raise self._fail("duplicate category ids; each category needs its own id")
        if categories is None:
            chosen = [c for c in cats if self.task != "pose" or c.get("keypoints")]
        else:
            by_name = {c["name"]: c for c in cats}
            chosen = []
            for c in categories:
                found = by_id.get(c) if isinstance(c, (int, np.integer)) and not isinstance(c, bool) else by_name.get(c)
                if found is None:
                    raise self._fail(f"categories= names {c!r}, which is not a category id or name of the JSON "
                                     f"(ids {sorted(by_id)[:10]}..., names {sorted(by_name)[:5]}...); fix the selection")
                chosen.append(found)
            if len({c['id'] for c in chosen}) != len(chosen):
                raise self._fail(f"categories={list(categories)!r} selects a category twice; list each once")
        if not chosen:
            raise self._fail(f"no category to train on for task={self.task!r}"
                             + ("; a pose JSON needs categories with a 'keypoints' list (person_keypoints format)"
                                if self.task == "pose" else "; the JSON's categories list is empty"))
        self.category_ids = [int(c["id"]) for c in chosen]
        self.names = [str(c["name"]) for c in chosen]
        self._class_of = {cid: k for k, cid in enumerate(self.category_ids)}
        self._known_categories = set(by_id)
        self.kpt_shape, self.flip_idx, self.keypoint_names = None, None, None
        if self.task == "pose":
            lengths = {len(c.get("keypoints") or []) for c in chosen}
            if 0 in lengths or len(lengths) != 1:
                raise self._fail(f"task='pose' needs every selected category to have the same non-empty 'keypoints' "
                                 f"list, got lengths {sorted(lengths)} for {self.names}; select keypoint categories only")
            self.keypoint_names = list(chosen[0]["keypoints"])
            self.kpt_shape = (len(self.keypoint_names), 3)
            self.flip_idx = flip_index_from_names(self.keypoint_names)

    def _index_images(self) -> None:
        images = self._coco.dataset["images"]
        ids = [img.get("id") for img in images]
        if len(set(ids)) != len(ids):
            dup = next(i for i in ids if ids.count(i) > 1)
            raise self._fail(f"image id {dup} appears more than once in images; image ids must be unique")
        for img in images:
            if not all(k in img for k in ("id", "file_name", "height", "width")):
                raise self._fail(f"image entry {str(img)[:120]} lacks one of id, file_name, height, width; "
                                 "every COCO image entry needs them")
        self._images = list(images)

    def _index_annotations(self) -> None:
        known_images = {img["id"]: img for img in self._images}
        per_image: dict[int, list] = {i: [] for i in known_images}
        for ann in self._coco.dataset["annotations"]:
            if ann.get("image_id") not in known_images:
                raise self._fail(f"annotation id {ann.get('id')} points to image_id {ann.get('image_id')}, which is "
                                 "not in images; remove the annotation or add its image")
            if ann.get("category_id") not in self._known_categories:
                raise self._fail(f"annotation id {ann.get('id')} has category_id {ann.get('category_id')}, which is "
                                 f"not in categories {sorted(self._known_categories)[:10]}...; fix the annotation")
            if not isinstance(ann.get("bbox"), (list, tuple)) or len(ann["bbox"]) != 4:
                raise self._fail(f"annotation id {ann.get('id')} has no 4-number bbox (got {ann.get('bbox')!r}); "
                                 "every COCO annotation needs bbox [x, y, w, h]")
            per_image[ann["image_id"]].append(ann)
        self._targets = [self._targets_of(img, per_image[img["id"]]) for img in self._images]

    def _count(self, reason: str, img: dict, detail: str = "") -> None:
        self.skipped[reason] += 1
        self._examples.append(f"{img['file_name']} ({reason}{': ' + detail if detail else ''})")

    def _targets_of(self, img: dict, anns: list) -> tuple:
        h, w = int(img["height"]), int(img["width"])
        boxes, classes, kpts, segms = [], [], [], []
        for ann in anns:
            k = self._class_of.get(ann["category_id"])
            if k is None or ann.get("iscrowd", 0):
                continue
            x, y, bw, bh = ann["bbox"]  # plain Python: this loop runs once per annotation of the JSON
            box = (min(max(x, 0.0), w), min(max(y, 0.0), h), min(max(x + bw, 0.0), w), min(max(y + bh, 0.0), h))
            if not (bw > 0 and bh > 0 and box[2] > box[0] and box[3] > box[1]):
                self._count("empty_box", img, f"annotation {ann.get('id')}")
                continue
            if self.task == "segment":
                segm = self._segmentation(ann, img)
                if segm is None:
                    continue
                segms.append(segm)
            if self.task == "pose":
                p = self.kpt_shape[0]
                raw = ann.get("keypoints")
                if raw is None:
                    raw = [0.0] * (3 * p)
                if len(raw) != 3 * p:
                    self._count("bad_keypoints", img,
                                f"annotation {ann.get('id')} has {len(raw)} values, expected {3 * p}")
                    continue
                kpts.append(np.asarray(raw, np.float32).reshape(p, 3))
            boxes.append(box)
            classes.append(k)
        n = len(boxes)
        boxes = np.asarray(boxes, np.float32).reshape(n, 4)
        classes = np.asarray(classes, np.int64).reshape(n)
        keypoints = None
        if self.task == "pose":
            keypoints = np.asarray(kpts, np.float32).reshape(n, *self.kpt_shape)
        return boxes, classes, keypoints, segms

    def _segmentation(self, ann: dict, img: dict):
        """The annotation's usable segmentation: valid polygon parts (list of float lists) or an RLE
        dict; None when unusable (counted)."""
        h, w = int(img["height"]), int(img["width"])
        segm = ann.get("segmentation")
        if isinstance(segm, dict):
            size = segm.get("size")
            if "counts" not in segm or list(size or []) != [h, w]:
                self._count("bad_rle", img, f"annotation {ann.get('id')} RLE size {size}, image {[h, w]}")
                return None
            return mask_utils.frPyObjects(segm, h, w) if isinstance(segm["counts"], list) else segm
        parts = segm if isinstance(segm, list) else []
        good = [p for p in parts if _polygon_ok(p)]
        if len(good) != len(parts) or not good:
            self._count("bad_polygon", img, f"annotation {ann.get('id')}")
        return good or None

    # ------------------------------------------------------------------ verification
    def verify(self, workers: int = 8) -> dict[str, int]:
        """Header-checks every image (no decode) and removes the missing, corrupt or mis-sized ones.

        Each file's signature, end marker (truncation) and header size (after EXIF orientation)
        are checked with :func:`yolo_func.data.images.check_image` in a thread pool. Removed
        images are counted in ``skipped`` under ``missing_image``, ``corrupt_image`` and
        ``size_mismatch``.

        Args:
          workers: threads.

        Returns:
          ``self.skipped``.
        """
        def check(img: dict):
            path = self.image_dir / img["file_name"]
            if not path.is_file():
                return "missing_image", "no such file"
            try:
                size = check_image(path)
            except ValueError as err:
                return "corrupt_image", str(err).removeprefix("[yolo_func] ")
            if size is not None and tuple(size) != (int(img["height"]), int(img["width"])):
                return "size_mismatch", f"file is {size[0]}x{size[1]}, JSON says {img['height']}x{img['width']}"
            return None

        with ThreadPoolExecutor(max(1, workers)) as pool:
            results = list(pool.map(check, self._images))
        keep = []
        for k, (img, res) in enumerate(zip(self._images, results)):
            if res is None:
                keep.append(k)
            else:
                self.skipped[res[0]] += 1
                self._examples.append(f"{img['file_name']} ({res[0]}: {res[1]})")
        self._images = [self._images[k] for k in keep]
        self._targets = [self._targets[k] for k in keep]
        self._freeze()
        return self.skipped

    def _freeze(self) -> None:
        n = len(self._images)
        self.image_ids = np.asarray([img["id"] for img in self._images], np.int64).reshape(n)
        self.image_sizes = np.asarray([(img["height"], img["width"]) for img in self._images], np.int64).reshape(n, 2)
        self.file_names = [str(img["file_name"]) for img in self._images]

    # ------------------------------------------------------------------ access
    @property
    def coco(self) -> COCO:
        """The pycocotools ``COCO`` object of the JSON (for ``COCOeval``); rebuilt after unpickling."""
        if self._coco is None:
            self._coco = self._load_coco()
        return self._coco

    def image_path(self, index: int) -> Path:
        """The image file of ``index``."""
        return self.image_dir / self._images[index]["file_name"]

    def labels(self, index: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """The targets of ``index`` without decoding anything.

        Returns:
          (boxes float32[N, 4] xyxy pixels, classes int64[N], keypoints float32[N, P, 3] or None),
          in the order of ``ds[index]``.
        """
        boxes, classes, keypoints, _ = self._targets[index]
        return boxes.copy(), classes.copy(), None if keypoints is None else keypoints.copy()

    def segmentations(self, index: int) -> list:
        """The raw segmentation of each target of ``index`` (task ``segment``), in Sample order.

        Returns:
          N entries, each a list of valid polygon parts (flat pixel coordinates) or an RLE dict;
          ``[]`` for the other tasks.
        """
        return list(self._targets[index][3])

    def polygons(self, index: int) -> list[np.ndarray]:
        """Each target's segmentation as one polygon in pixels (task ``segment``), in Sample order.

        Multi-part polygons are joined into one path and RLE masks outlined
        (:func:`yolo_func.data.polygons.segmentation_to_polygon`), so the even-odd fill of each
        path gives the instance's mask: the form the reference's augmentation transforms.

        Returns:
          N float32[K_j, 2] (x, y) vertex arrays; ``[]`` for the other tasks.
        """
        h, w = (int(v) for v in self.image_sizes[index])
        out = []
        for segm in self._targets[index][3]:
            path = segmentation_to_polygon(segm, h, w)
            out.append(np.zeros((0, 2), np.float32) if path is None else path.astype(np.float32))
        return out

    def read_image(self, index: int) -> np.ndarray:
        """Decodes only the image of ``index``: uint8[H, W, 3] RGB, EXIF orientation applied.

        Raises:
          ValueError: the file is missing, truncated or undecodable, or its size is not the JSON's.
        """
        img = self._images[index]
        image = read_image(self.image_dir / img["file_name"])
        if image.shape[:2] != (int(img["height"]), int(img["width"])):
            raise ValueError(f"[yolo_func] image file {self.image_dir / img['file_name']} is {image.shape[0]}x"
                             f"{image.shape[1]} but {self.annotations_path} says {img['height']}x{img['width']}; "
                             "fix the JSON's height/width or the file")
        return image

    def __len__(self) -> int:
        return len(self._images)

    def __getitem__(self, index: int) -> Sample:
        """The raw sample of ``index`` (see :class:`Sample` for shapes and dtypes).

        Raises:
          IndexError: ``index`` out of range.
          ValueError: the image cannot be read or decoded, naming the file.
        """
        index = dataset_index(index, len(self))
        img = self._images[index]
        boxes, classes, keypoints, segms = self._targets[index]
        image = self.read_image(index)
        masks = None
        if self.task == "segment":
            h, w = image.shape[:2]
            masks = segmentations_to_masks(segms, h, w)
        return Sample(image=image, boxes=boxes.copy(), classes=classes.copy(), masks=masks,
                      keypoints=None if keypoints is None else keypoints.copy(),
                      image_id=int(img["id"]), file_name=str(img["file_name"]))

    def sample_with_mask_crops(self, index: int) -> tuple[Sample, tuple[np.ndarray, tuple[np.ndarray, ...]] | None]:
        """``self[index]`` with ``masks=None`` plus, for segmentation, the masks as tight crops
        (:func:`segmentations_to_mask_crops`): what the training loader reads, without rasterising
        full-size masks only to crop them.

        Returns:
          ``(sample, (offsets int64[N, 2], crops) | None)``.
        """
        index = dataset_index(index, len(self))
        img = self._images[index]
        boxes, classes, keypoints, segms = self._targets[index]
        image = self.read_image(index)
        crops = segmentations_to_mask_crops(segms, *image.shape[:2]) if self.task == "segment" else None
        return Sample(image=image, boxes=boxes.copy(), classes=classes.copy(), masks=None,
                      keypoints=None if keypoints is None else keypoints.copy(),
                      image_id=int(img["id"]), file_name=str(img["file_name"])), crops

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_coco"] = None  # workers need only the index; the COCO object is rebuilt on demand
        return state

    def __repr__(self) -> str:
        return (f"CocoDataset({str(self.annotations_path)!r}, task={self.task!r}, images={len(self)}, "
                f"classes={len(self.names)}, skipped={sum(self.skipped.values())})")
