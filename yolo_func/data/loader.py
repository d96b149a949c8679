"""Training and validation loaders over any random-access dataset of :class:`yolo_func.data.Sample`.

Both wrap a torch ``DataLoader`` whose items are whole batches: the main process hands a worker
``(epoch, batch number)``; the worker derives the epoch's permutation from ``(seed, epoch)``,
loads the batch's images (each decoded once), augments every record with the generator of
``(seed, epoch, dataset index)`` (:func:`yolo_func.data.augment.record_rng`) and collates.
Nothing depends on which worker runs a batch, so the batches are bitwise the same for any number
of workers, and with or without the RAM cache (the cache holds exactly what loading produces).

Bad samples (policy): a sample whose reading raises (the datasets raise ``ValueError`` naming the
file) is skipped and replaced by the next dataset index (wrapping around), so a batch keeps its
size and the replacement is deterministic. Each skipped index is counted in ``loader.skipped``
(index -> message) and warned about once, in the main process, with the dataset's message.
"""

from __future__ import annotations

import collections
import dataclasses
import inspect
import math
import queue
import threading
import warnings
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import cv2
import numpy as np
import torch
from torch.utils.data import DataLoader, Sampler, get_worker_info

from yolo_func.data.augment import (
    PAD_VALUE,
    Annotated,
    AugmentConfig,
    PolygonMasks,
    RoiMasks,
    annotated_from_sample,
    augment,
    letterbox,
    letterbox_boxes,
    load_resized,
    mosaic_enabled,
    mosaic_partners,
    record_rng,
)
from yolo_func.data.collate import batch_images, collate, format_record
from yolo_func.data.images import image_size as image_size_of
from yolo_func.data.shared_ring import SharedRing, ring_slots
from yolo_func.structures.records import Batch, Targets
from yolo_func.structures.targets import targets_from_lists

__all__ = ["TrainLoader", "ValLoader", "ValBatch", "val_batch_shapes", "val_boxes_to_original"]

_TASKS = ("detect", "segment", "pose")
#: How many following indices are tried before giving up on a run of unreadable samples.
_MAX_REPLACEMENTS = 64


def _resolve_task(dataset: Any, task: str | None) -> str:
    task = task if task is not None else getattr(dataset, "task", None)
    if task not in _TASKS:
        raise ValueError(f"[yolo_func] task: expected one of {_TASKS} (or a dataset with a .task attribute), "
                         f"got {task!r}; pass task='detect' | 'segment' | 'pose'")
    return task


def _worker_init(_: int) -> None:
    cv2.setNumThreads(0)  # one thread per worker process: the workers are the parallelism


def _identity(x: Any) -> Any:
    return x


class _Source:
    """Loads records by dataset index (with the RAM cache and the bad-sample rule)."""

    def __init__(self, dataset: Any, task: str, image_size: int, mask_source: str = "bitmaps"):
        self.dataset, self.task, self.image_size = dataset, task, image_size
        self.cache: list[Annotated | None] | None = None
        self.errors: dict[int, str] = {}
        if mask_source not in MASK_SOURCES:  # checked for every task: a typo should not wait for a segment run
            raise ValueError(f"[yolo_func] mask_source: expected one of {MASK_SOURCES}, got {mask_source!r}")
        self.polygons = task == "segment" and _use_polygons(dataset, mask_source)
        # YoloDataset.polygons takes the decoded image's size (its labels are normalised)
        self._polygons_take_size = self.polygons and "size" in inspect.signature(dataset.polygons).parameters

    def read(self, index: int) -> Annotated:
        """Decode and resize one record; raises what the dataset raises."""
        crops_of = getattr(self.dataset, "sample_with_mask_crops", None)
        if self.polygons:  # the reference's form: polygons, filled after augmentation
            without = getattr(self.dataset, "sample_without_masks", None)
            s = without(index) if without is not None else self.dataset[index]
            rec = annotated_from_sample(s._replace(masks=None, keypoints=None))
            polys = self.dataset.polygons(index, s.image.shape[:2]) if self._polygons_take_size \
                else self.dataset.polygons(index)
            if len(polys) != len(rec.boxes):
                raise ValueError(f"[yolo_func] {s.file_name!r}: {len(polys)} polygons for {len(rec.boxes)} instances; "
                                 "the dataset's polygons(index) must list one polygon per instance, in sample order")
            rec = rec._replace(masks=PolygonMasks.from_polygons(polys))
        elif self.task == "segment" and crops_of is not None:  # a CocoDataset: masks cropped as decoded
            s, crops = crops_of(index)
            rec = annotated_from_sample(s._replace(keypoints=None))
            if crops is not None:
                rec = rec._replace(masks=RoiMasks(*crops))
        else:
            s = self.dataset[index]
            rec = annotated_from_sample(s._replace(masks=s.masks if self.task == "segment" else None,
                                                   keypoints=s.keypoints if self.task == "pose" else None))
        if self.task == "segment" and rec.masks is None:
            raise ValueError(f"[yolo_func] {s.file_name!r}: task 'segment' needs masks but the sample has none")
        if self.task == "pose" and rec.keypoints is None:
            raise ValueError(f"[yolo_func] {s.file_name!r}: task 'pose' needs keypoints but the sample has none")
        return load_resized(rec, self.image_size)

    def _try(self, index: int) -> Annotated | None:
        if self.cache is not None:
            return self.cache[index]
        if index in self.errors:
            return None
        try:
            return self.read(index)
        except Exception as e:  # noqa: BLE001 -- any reading error is a bad sample (module docstring)
            self.errors[index] = f"{type(e).__name__}: {e}"
            return None

    def load(self, index: int) -> tuple[int, Annotated]:
        """The record of ``index`` or of the next readable index; returns (index used, record)."""
        n = len(self.dataset)
        for k in range(min(n, _MAX_REPLACEMENTS)):
            j = (index + k) % n
            rec = self._try(j)
            if rec is not None:
                return j, rec
        raise ValueError(f"[yolo_func] dataset: {min(n, _MAX_REPLACEMENTS)} consecutive samples from index {index} "
                         f"could not be read (first: {self.errors.get(index, '?')}); check the image files")

    def fill_cache(self, threads: int) -> None:
        """Read every record once (threads; OpenCV releases the GIL) and keep them in RAM."""
        n = len(self.dataset)
        with ThreadPoolExecutor(max(1, threads)) as ex:
            recs = list(ex.map(self._try, range(n)))
        self.cache = recs


MASK_SOURCES = ("auto", "polygons", "bitmaps")


def _use_polygons(dataset: Any, mask_source: str) -> bool:
    """Whether training masks travel as polygons (see :class:`TrainLoader`'s ``mask_source``)."""
    has = callable(getattr(dataset, "polygons", None))
    if mask_source == "polygons" and not has:
        raise ValueError(f"[yolo_func] mask_source='polygons': {type(dataset).__name__} has no polygons(index) "
                         "method (COCO and YOLO-format datasets have one); use mask_source='bitmaps' or 'auto'")
    return mask_source == "polygons" or (mask_source == "auto" and has)


def _report(skipped: dict[int, str], new: dict[int, str]) -> None:
    fresh = {i: m for i, m in new.items() if i not in skipped}
    if fresh:
        skipped.update(fresh)
        shown = "; ".join(f"index {i}: {m}" for i, m in list(fresh.items())[:3])
        more = f" (+{len(fresh) - 3} more)" if len(fresh) > 3 else ""
        warnings.warn(f"[yolo_func] skipped {len(fresh)} unreadable sample(s), replaced by the next index: "
                      f"{shown}{more}", RuntimeWarning, stacklevel=3)


class _TrainBatches:
    """Map-style source whose item ``(epoch, b)`` is the b-th batch of that epoch (runs in workers)."""

    def __init__(self, source: _Source, *, batch_size: int, image_size: int, seed: int, epochs: int | None,
                 cfg: AugmentConfig, shuffle: bool, max_boxes: int | None, mask_ratio: int, rank: int = 0,
                 world_size: int = 1):
        self.source, self.batch_size, self.image_size, self.seed = source, batch_size, image_size, seed
        self.epochs, self.cfg, self.shuffle, self.max_boxes, self.mask_ratio = epochs, cfg, shuffle, max_boxes, mask_ratio
        self.rank, self.world_size = rank, world_size
        self._perm: tuple[int, np.ndarray] | None = None

    def permutation(self, epoch: int) -> np.ndarray:
        """The epoch's order of dataset indices (int64[N])."""
        if self._perm is None or self._perm[0] != epoch:
            n = len(self.source.dataset)
            perm = np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)
            self._perm = (epoch, perm)
        return self._perm[1]

    def __getitem__(self, key: tuple[int, int]) -> tuple[Batch, dict[int, str]]:
        epoch, b = key
        # global batch b is perm[b*W*B:(b+1)*W*B]; this rank trains its r-th slice of B indices
        first = (b * self.world_size + self.rank) * self.batch_size
        idxs = self.permutation(epoch)[first:first + self.batch_size]
        before = dict(self.source.errors)
        loaded = {}
        for i in idxs:
            loaded.setdefault(int(i), self.source.load(int(i))[1])
        use_mosaic = mosaic_enabled(epoch, self.epochs, self.cfg)
        s = self.image_size
        images = batch_images(len(idxs), s, s)  # each record is augmented in its own slot: no copy
        slots = images.numpy()
        items = []
        for pos, i in enumerate(idxs):
            rng = record_rng(self.seed, epoch, int(i))
            partners = mosaic_partners(rng, pos, idxs)
            recs = [loaded[int(i)]] + [loaded[j] for j in partners]
            rec = augment(rng, recs, s, self.cfg, use_mosaic=use_mosaic, out=slots[pos])
            items.append(format_record(rec, mask_ratio=self.mask_ratio))
        new = {i: m for i, m in self.source.errors.items() if i not in before}
        batch = collate(items, max_boxes=self.max_boxes, images=images)
        return (_WireBatch(batch) if get_worker_info() is not None else batch), new

    def __len__(self) -> int:
        return len(self.source.dataset) // (self.batch_size * self.world_size)


class _Wire:
    """Pickles a wire object's slots as one tuple; carries a :class:`Targets`' small arrays as numpy
    (inline in the pickle, no shared-memory segment per tensor) and rebuilds it over them."""

    __slots__ = ()

    def __getstate__(self):
        return tuple(getattr(self, k) for k in self.__slots__)

    def __setstate__(self, state) -> None:
        for k, v in zip(self.__slots__, state):
            setattr(self, k, v)

    def _wire_targets(self, t: Targets) -> None:
        self.boxes, self.classes, self.valid = t.boxes.numpy(), t.classes.numpy(), t.valid.numpy()
        self.keypoints = None if t.keypoints is None else t.keypoints.numpy()

    def _targets(self, masks: torch.Tensor | None) -> Targets:
        kp = None if self.keypoints is None else torch.from_numpy(self.keypoints)
        return Targets(torch.from_numpy(self.boxes), torch.from_numpy(self.classes), torch.from_numpy(self.valid),
                       masks, kp)


class _WireBatch(_Wire):
    """A :class:`Batch` on its way from a loader worker to the main process.

    The images (and a segment batch's overlap masks) are shared-memory tensors already (collate's
    :func:`~yolo_func.data.collate.batch_images`): one file descriptor each. The small target
    arrays (boxes, classes, valid, keypoints: a few KiB) travel inline as numpy arrays instead:
    as tensors each would get a shared-memory segment of its own in the worker and a file
    descriptor round trip through the worker's resource sharer in the main process, ~5 per batch
    that the main process (its pin-memory thread, holding the GIL the training loop needs) paid
    for every batch.

    The DataLoader's pin-memory thread calls :meth:`pin_memory` (a pinned :class:`Batch`); without
    pinning, :meth:`unwire` gives the :class:`Batch` (zero-copy tensors over the arrays).
    """

    __slots__ = ("images", "masks", "boxes", "classes", "valid", "keypoints")

    def __init__(self, batch: Batch):
        self.images, self.masks = batch.images, batch.targets.masks
        self._wire_targets(batch.targets)

    def unwire(self) -> Batch:
        """The batch: uint8 images as sent, targets as tensors over the received arrays (no copy)."""
        return Batch(self.images, self._targets(self.masks))

    def pin_memory(self, device: Any = None) -> Batch:
        """The batch in page-locked memory (called by the DataLoader's pin-memory thread), so that
        ``.to("cuda", non_blocking=True)`` is an asynchronous copy for every field."""
        b = self.unwire()
        return Batch(b.images.pin_memory(), _pin_targets(b.targets))


def _unwire(batch: Any) -> Batch:
    return batch.unwire() if isinstance(batch, _WireBatch) else batch


class _Epoch:
    """The epoch counter shared by a loader and its sampler (the sampler must not hold the loader:
    a reference cycle would leave the workers' shutdown to the garbage collector, in any order)."""

    def __init__(self) -> None:
        self.value = 0
        self.start = 0  # the first batch of epoch ``value`` to yield (a resumed run skips the rest)


class _EpochSampler(Sampler):
    """Yields ``(epoch, b)`` from the loader's current epoch (read in the main process); with
    ``endless`` it goes on into the following epochs, so the workers prefetch across epoch ends."""

    def __init__(self, epoch: _Epoch, n_batches: int, endless: bool = False, shard: tuple[int, int] = (0, 1)):
        self.epoch, self.n_batches, self.endless = epoch, n_batches, endless
        self.shard = shard  # (rank, world): yield only the batches b with b % world == rank

    def __iter__(self) -> Iterator[tuple[int, int]]:
        e, first = self.epoch.value, self.epoch.start
        rank, world = self.shard
        while True:
            for b in range(first, self.n_batches):
                if b % world == rank:
                    yield e, b
            if not self.endless:
                return
            e, first = e + 1, 0

    def __len__(self) -> int:
        rank, world = self.shard
        return len(range(rank, self.n_batches, world))


class _RingSampler(Sampler):
    """``(epoch, b, slot)``: the keys of ``keys`` (an :class:`_EpochSampler`) with the ring slot
    each batch is written into, claimed in the main process when the DataLoader hands the key to a
    worker."""

    def __init__(self, keys: _EpochSampler, ring: SharedRing):
        self.keys, self.ring = keys, ring

    def __iter__(self) -> Iterator[tuple[int, int, int]]:
        for e, b in self.keys:
            yield e, b, self.ring.claim()

    def __len__(self) -> int:
        return len(self.keys)


def _dataloader(source: Any, sampler: Sampler, *, workers: int, pin_memory: bool | None, prefetch_factor: int,
                persistent_workers: bool) -> DataLoader:
    pin = torch.cuda.is_available() if pin_memory is None else pin_memory
    kw: dict[str, Any] = {}
    if workers > 0:
        kw = dict(prefetch_factor=prefetch_factor, persistent_workers=persistent_workers, worker_init_fn=_worker_init)
    return DataLoader(source, batch_size=None, sampler=sampler, num_workers=workers, collate_fn=_identity,
                      pin_memory=pin, **kw)


class TrainLoader:
    """Augmented training batches: mosaic -> affine -> HSV -> flips -> static-shape :class:`Batch`.

    ``for batch in loader`` yields one epoch: ``len(loader)`` batches (``drop_last``: the tail of
    the permutation that does not fill a batch is left out), then advances ``loader.epoch``;
    :meth:`set_epoch` sets it explicitly (e.g. when resuming). The workers run on into the next
    epoch while the current one is consumed; an epoch left half-way is restarted from its start. The same seed gives the same batches,
    bitwise, for any ``workers`` and with or without ``cache``.

    Mosaic partners: the reference draws the three partners of a mosaic from a buffer of the images
    its worker loaded recently (min(N, 8·batch, 1000)); here they are drawn by the record's
    generator from the images of the same batch (module :mod:`yolo_func.data.augment`,
    :func:`~yolo_func.data.augment.mosaic_partners`), which keeps every image decoded once per epoch
    and the result independent of the workers.

    Args:
      dataset: random access (``len``, ``[i]``) source of :class:`yolo_func.data.Sample`.
      batch_size: B.
      image_size: square training size s (multiple of 32; 640).
      workers: DataLoader worker processes (0: load in the main process).
      cache: ``"ram"`` / True reads every image once at construction (resized uint8, threads) and
        keeps it; False / None / "none" reads on demand.
      seed: the run's seed.
      task: "detect" | "segment" | "pose"; default ``dataset.task``.
      augment: :class:`AugmentConfig` (defaults of REFERENCE.md §4.6); for pose the flip index
        defaults to ``dataset.flip_index`` (or ``dataset.flip_idx``), else
        :data:`~yolo_func.data.augment.COCO_FLIP_INDEX` for 17 keypoints.
      epochs: the run length (for ``close_mosaic``); None keeps mosaic on.
      shuffle: a new permutation per epoch (True).
      max_boxes: fixed target slots M; default bucketed per batch.
      mask_ratio: overlap-map downsampling (4).
      mask_source: how segmentation masks travel through the augmentation: ``"polygons"`` (the
        reference's form, REFERENCE.md §4.6: each instance's polygon from ``dataset.polygons(index)``
        resampled to 1000 points, transformed, filled at the end with integer-truncated vertices),
        ``"bitmaps"`` (the dataset's masks warped as crops), or ``"auto"`` (default: polygons when
        the dataset has ``polygons``, as :class:`~yolo_func.data.CocoDataset` and
        :class:`~yolo_func.data.YoloDataset` do; bitmaps for the built-in data).
      pin_memory: default True when CUDA is available.
      prefetch_factor: batches prefetched per worker (2).
      persistent_workers: keep the workers between epochs (True).
      rank, world_size: data-parallel training (:mod:`yolo_func.train.distributed`): the epoch's
        permutation (from ``(seed, epoch)``, the same on every rank) is cut into global batches of
        ``world_size * batch_size`` indices and this rank yields the ``rank``-th slice of
        ``batch_size`` of each, so ``len(loader) = len(dataset) // (world_size * batch_size)`` on
        every rank and the ranks' batches together are the one-process loader's batches of
        ``world_size * batch_size`` (same indices in the same order). Each record's augmentation is
        drawn from ``(seed, epoch, index)`` whatever the rank, so a record gets the same pixels on
        any number of ranks; only mosaic partners (drawn from the rank's own ``batch_size``
        images) depend on the split. Defaults ``(0, 1)``: one process.

    Attributes:
      epoch: the epoch the next iteration yields.
      skipped: dict index -> message of every unreadable sample seen so far.

    Example:
      >>> from yolo_func.data import builtin_dataset
      >>> from yolo_func.data import TrainLoader
      >>> loader = TrainLoader(builtin_dataset("detect", "train", num_images=4), batch_size=2, image_size=64, workers=0)
      >>> batch = next(iter(loader))                       # a Batch with static shapes
      >>> batch.images.dtype, tuple(batch.images.shape), batch.targets.boxes.shape[-1], len(loader)
      (torch.uint8, (2, 3, 64, 64), 4, 2)
    """

    def __init__(self, dataset: Any, *, batch_size: int, image_size: int = 640, workers: int = 8,
                 cache: bool | str | None = False, seed: int = 0, task: str | None = None,
                 augment: AugmentConfig | None = None, epochs: int | None = None, shuffle: bool = True,
                 max_boxes: int | None = None, mask_ratio: int = 4, mask_source: str = "auto",
                 pin_memory: bool | None = None, prefetch_factor: int = 2, persistent_workers: bool = True,
                 rank: int = 0, world_size: int = 1):
        if image_size % 32 or image_size <= 0:
            raise ValueError(f"[yolo_func] image_size: expected a positive multiple of 32, got {image_size}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"[yolo_func] TrainLoader: expected 0 <= rank < world_size, got rank={rank}, "
                             f"world_size={world_size}")
        if batch_size < 1 or len(dataset) < batch_size * world_size:
            raise ValueError(f"[yolo_func] batch_size: expected 1 <= batch_size * world_size <= len(dataset)={len(dataset)} "
                             f"(drop_last needs one full global batch), got batch_size={batch_size}, world_size={world_size}")
        if workers < 0:
            raise ValueError(f"[yolo_func] workers: expected >= 0, got {workers}")
        self.task = _resolve_task(dataset, task)
        cfg = augment or AugmentConfig()
        if self.task == "pose" and cfg.flip_index is None:
            flip = getattr(dataset, "flip_index", None)
            if flip is None:
                flip = getattr(dataset, "flip_idx", None)  # the Ultralytics data.yaml key
            if flip is None:
                flip = _default_flip_index(dataset)
            cfg = dataclasses.replace(cfg, flip_index=tuple(flip) if flip is not None else None)
        self.config = cfg
        self.dataset, self.batch_size, self.image_size, self.seed = dataset, batch_size, image_size, seed
        self._epoch = _Epoch()
        self.skipped: dict[int, str] = {}
        self._source = _Source(dataset, self.task, image_size, mask_source)
        if _cache_on(cache):
            self._source.fill_cache(threads=max(workers, 1))
            _report(self.skipped, self._source.errors)
        self._batches = _TrainBatches(self._source, batch_size=batch_size, image_size=image_size, seed=seed,
                                      epochs=epochs, cfg=cfg, shuffle=shuffle, max_boxes=max_boxes,
                                      mask_ratio=mask_ratio, rank=rank, world_size=world_size)
        self.rank, self.world_size = rank, world_size
        batches, sampler = self._batches, _EpochSampler(self._epoch, len(self._batches), endless=True)
        # (no reference to self in here: a cycle would leave the workers' shutdown to the collector)
        self._new_loader = lambda: _dataloader(batches, sampler, workers=workers, pin_memory=pin_memory,
                                               prefetch_factor=prefetch_factor, persistent_workers=persistent_workers)
        self._loader = self._new_loader()
        # One DataLoader iterator runs on across epochs (like the reference's infinite loader): no
        # drained prefetch queue at each epoch end. (_it_epoch, _pos) say where it stands.
        self._it: Iterator | None = None
        self._it_epoch, self._pos = -1, 0

    @property
    def epoch(self) -> int:
        """The epoch the next iteration yields."""
        return self._epoch.value

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        """Make the next iteration yield ``epoch`` (its permutation, its augmentations), from its
        batch ``start_batch`` on: a run resumed mid-epoch gets the batches an uninterrupted run
        would see next, and nothing is loaded for the ones before (a batch is a pure function of
        ``(seed, epoch, batch index)``).

        Raises:
          ValueError: ``start_batch`` outside ``[0, len(self))``.
        """
        if not 0 <= int(start_batch) < max(len(self), 1):
            raise ValueError(f"[yolo_func] TrainLoader.set_epoch: start_batch must be in [0, {len(self)}), "
                             f"got {start_batch}")
        self._epoch.value, self._epoch.start = int(epoch), int(start_batch)

    def start(self) -> None:
        """Start the workers on the next iteration's batches now (the epoch and batch of the last
        :meth:`set_epoch`), so they load while the caller does other work (e.g. a fit building
        its model and captures); the next ``for batch in loader`` continues from there. Nothing
        changes when an iteration is already under way at that position.

        Example:
          >>> from yolo_func.data import builtin_dataset
          >>> from yolo_func.data import TrainLoader
          >>> loader = TrainLoader(builtin_dataset("detect", "train", num_images=4), batch_size=2, image_size=64, workers=0)
          >>> loader.set_epoch(0, start_batch=1); loader.start()    # loading begins (workers > 0: in the background)
          >>> len(list(loader))                                     # the rest of epoch 0: batch 1
          1
        """
        start = self._epoch.start
        if self._it is None or self._it_epoch != self.epoch or self._pos != start:
            self._it, self._it_epoch, self._pos = iter(self._loader), self.epoch, start

    def close(self) -> None:
        """Stop the worker processes now (they also stop when the loader is deleted)."""
        self._it = None
        self._loader = self._new_loader()  # the old DataLoader (and its persistent workers) goes away

    def __len__(self) -> int:
        return len(self._batches)

    def __iter__(self) -> Iterator[Batch]:
        n = len(self)
        # first use, set_epoch() to another epoch or batch, or an epoch left half-way: restart there
        self.start()
        while self._pos < n:
            batch, new = next(self._it)
            self._pos += 1
            _report(self.skipped, new)
            yield _unwire(batch)
        self._pos = 0
        self._it_epoch += 1
        self._epoch.value += 1
        self._epoch.start = 0


def _cache_on(cache: bool | str | None) -> bool:
    if cache in (True, "ram"):
        return True
    if cache in (False, None, "none", ""):
        return False
    raise ValueError(f"[yolo_func] cache: expected 'ram', True, False or None, got {cache!r}")


def _default_flip_index(dataset: Any) -> tuple[int, ...] | None:
    from yolo_func.data.augment import COCO_FLIP_INDEX

    s = dataset[0]
    if s.keypoints is not None and s.keypoints.shape[1] == len(COCO_FLIP_INDEX):
        return COCO_FLIP_INDEX
    return None


# --------------------------------------------------------------------------------------- validation
class ValBatch(NamedTuple):
    """One rectangular validation batch and what maps predictions back to original pixels.

    Attributes:
      images: uint8[B, 3, H, W] (the batch's rect shape) with channels-last strides (an NHWC
        buffer viewed as NCHW: what a GPU forward wants; page-locked batches are the buffer the
        readers letterbox into): ``.contiguous()`` gives a dense NCHW copy.
      targets: :class:`Targets` in letterboxed pixels (boxes, classes, keypoints; no masks).
      image_ids: int64[B].
      file_names: B strings.
      orig_shapes: int64[B, 2] original (h, w).
      gains: float32[B, 2] (gx, gy): letterboxed = original * gain + pad.
      pads: float32[B, 2] (left, top).

    Example:
      >>> from yolo_func.data import builtin_dataset
      >>> from yolo_func.data import ValLoader
      >>> b = next(iter(ValLoader(builtin_dataset("detect", "val", num_images=2), batch_size=2, image_size=64, workers=0)))
      >>> b._fields
      ('images', 'targets', 'image_ids', 'file_names', 'orig_shapes', 'gains', 'pads')
    """

    images: torch.Tensor
    targets: Targets
    image_ids: torch.Tensor
    file_names: tuple[str, ...]
    orig_shapes: torch.Tensor
    gains: torch.Tensor
    pads: torch.Tensor


def val_boxes_to_original(boxes: torch.Tensor, gain: torch.Tensor, pad: torch.Tensor,
                          orig_shape: torch.Tensor) -> torch.Tensor:
    """Map xyxy boxes ``float[N, 4]`` of one letterboxed image back to original pixels (clipped).

    Args:
      boxes: float[N, 4] in the batch image's pixels.
      gain: float[2] (gx, gy) of that image (``ValBatch.gains[i]``).
      pad: float[2] (left, top) (``ValBatch.pads[i]``).
      orig_shape: int[2] (h, w) (``ValBatch.orig_shapes[i]``).

    Returns:
      float[N, 4].
    """
    g = gain.to(boxes).repeat(2)
    out = (boxes - pad.to(boxes).repeat(2)) / g
    h, w = (float(v) for v in orig_shape)
    return torch.stack([out[:, 0].clamp(0, w), out[:, 1].clamp(0, h), out[:, 2].clamp(0, w), out[:, 3].clamp(0, h)], 1)


def val_batch_shapes(shapes: np.ndarray, batch_size: int, image_size: int, *, stride: int = 32,
                     pad: float = 0.5) -> tuple[np.ndarray, np.ndarray]:
    """The reference's rectangular val batches (REFERENCE.md §3.1).

    Images are sorted by aspect ratio r = h / w and cut into batches; a batch whose r are all < 1
    gets the (h, w) ratio (max r, 1), all > 1 gets (1, 1 / min r), otherwise (1, 1); its shape is
    ``ceil(ratio * image_size / stride + pad) * stride`` per side.

    Args:
      shapes: int[N, 2] (h, w) of every image.
      batch_size: B.
      image_size: long side.
      stride: 32.
      pad: 0.5.

    Returns:
      (order int64[N]: dataset indices in batch order, batch_shapes int64[ceil(N / B), 2] (H, W)).
    """
    shapes = np.asarray(shapes, np.float64).reshape(-1, 2)
    ar = shapes[:, 0] / shapes[:, 1]
    order = np.argsort(ar, kind="stable")
    ar = ar[order]
    nb = math.ceil(len(order) / batch_size)
    out = np.zeros((nb, 2), np.int64)
    for i in range(nb):
        a = ar[i * batch_size:(i + 1) * batch_size]
        lo, hi = a.min(), a.max()
        ratio = (hi, 1.0) if hi < 1 else (1.0, 1.0 / lo) if lo > 1 else (1.0, 1.0)
        out[i] = np.ceil(np.array(ratio) * image_size / stride + pad).astype(np.int64) * stride
    return order, out


class _WireValBatch(_Wire):
    """A :class:`ValBatch` on its way from a worker process whose images are in a
    :class:`~yolo_func.data.shared_ring.SharedRing` slot: the slot and the images' shape instead
    of the pixels, every other field as numpy arrays inline in the pickle (no shared-memory
    segment, no file descriptor per tensor)."""

    __slots__ = ("slot", "shape", "boxes", "classes", "valid", "keypoints", "image_ids", "file_names",
                 "orig_shapes", "gains", "pads")

    def __init__(self, batch: ValBatch, slot: int):
        self.slot, self.shape = slot, tuple(batch.images.permute(0, 2, 3, 1).shape)
        self._wire_targets(batch.targets)
        self.image_ids, self.file_names = batch.image_ids.numpy(), batch.file_names
        self.orig_shapes, self.gains, self.pads = batch.orig_shapes.numpy(), batch.gains.numpy(), batch.pads.numpy()

    def unwire(self, ring: SharedRing, device: torch.device) -> ValBatch:
        """The batch, its images copied from the ring slot to ``device`` (NCHW, channels-last strides)."""
        images = ring.to_device(self.slot, ring.view(self.slot, self.shape).permute(0, 3, 1, 2), device)
        return ValBatch(images, self._targets(None), torch.from_numpy(self.image_ids), self.file_names,
                        torch.from_numpy(self.orig_shapes), torch.from_numpy(self.gains), torch.from_numpy(self.pads))


class _ValBatches:
    def __init__(self, source: _Source, order: np.ndarray, shapes: np.ndarray, batch_size: int, pin_memory: bool = False,
                 ring: SharedRing | None = None):
        self.source, self.order, self.shapes, self.batch_size = source, order, shapes, batch_size
        self.pin_memory = pin_memory  # page-locked batches (threads / main process; a DataLoader pins its own)
        self.direct = pin_memory  # readers letterbox into a batch buffer (see buffer(); tests switch it on the CPU)
        self.ring = ring  # worker processes letterbox into its slots: keys are (epoch, b, slot)

    def indices(self, b: int) -> list[int]:
        """The dataset indices of rect batch ``b``, in order."""
        return [int(i) for i in self.order[b * self.batch_size:(b + 1) * self.batch_size]]

    def errors_of(self, b: int) -> dict[int, str]:
        """The reading errors of batch ``b``'s images (index -> message)."""
        errors = self.source.errors
        return {i: errors[i] for i in self.indices(b) if i in errors}

    def __getitem__(self, key: tuple[int, ...]) -> tuple[Any, dict[int, str]]:
        b = key[1]
        if len(key) == 3:
            return self._into_slot(b, key[2]), self.errors_of(b)
        H, W = (int(v) for v in self.shapes[b])
        buffer, slots = self.buffer(b)
        return self.assemble(b, [self.one(i, H, W, slot) for i, slot in zip(self.indices(b), slots)],
                             buffer), self.errors_of(b)

    def _into_slot(self, b: int, slot: int) -> _WireValBatch:
        # the images letterboxed into ring slot `slot` (the ones read, moved to its front), the
        # rest of the batch as inline arrays
        H, W = (int(v) for v in self.shapes[b])
        indices = self.indices(b)
        buffer = self.ring.view(slot, (len(indices), H, W, 3))
        arr = buffer.numpy()
        parts = [self.one(i, H, W, arr[k]) for k, i in enumerate(indices)]
        kept = [k for k, x in enumerate(parts) if x is not None]
        if kept and len(kept) < len(parts):
            arr[:len(kept)] = arr[kept]
        return _WireValBatch(self.assemble(b, [parts[k] for k in kept], buffer[:len(kept)]), slot)

    def buffer(self, b: int) -> tuple[torch.Tensor | None, list[np.ndarray | None]]:
        """A page-locked ``uint8[n, H, W, 3]`` for rect batch ``b``'s images, which the readers
        letterbox straight into (no stacking, no pinning copy: the two copies of a whole batch that
        would otherwise run on one thread), with its ``n`` uint8[H, W, 3] slot views; ``(None, [None]
        * n)`` when batches are not pinned here (the CPU; a DataLoader pins its own). The host
        allocator's cache recycles the buffer once its copy is done."""
        n = len(self.indices(b))
        if not self.direct:
            return None, [None] * n
        H, W = (int(v) for v in self.shapes[b])
        buffer = torch.empty((n, H, W, 3), dtype=torch.uint8, pin_memory=self.pin_memory)
        arr = buffer.numpy()
        return buffer, [arr[k] for k in range(n)]

    def one(self, index: int, H: int, W: int, out: np.ndarray | None = None) -> tuple | None:
        """Image ``index`` read, resized and letterboxed into (H, W) with its labels moved along;
        None when it cannot be read (counted in ``source.errors``). ``out``: a uint8[H, W, 3] slot
        to letterbox into (then the result's image is None). Thread-safe."""
        got = self._read(index)
        if got is None:  # skipped (counted); not replaced: a copy would be evaluated twice
            return None
        rec, s = got
        h0, w0 = s.image.shape[:2]
        img, p = letterbox(rec.image, (H, W), scaleup=False, center=True, pad_value=PAD_VALUE, out=out)
        gx, gy = p.gain[0] * rec.image.shape[1] / w0, p.gain[1] * rec.image.shape[0] / h0
        k = None
        if rec.keypoints is not None:
            k = rec.keypoints.copy()
            k[..., 0] = k[..., 0] * p.gain[0] + p.pad[0]
            k[..., 1] = k[..., 1] * p.gain[1] + p.pad[1]
        return (None if out is not None else img.transpose(2, 0, 1), letterbox_boxes(rec.boxes, p), rec.classes, k,
                int(s.image_id), str(s.file_name), (h0, w0), (gx, gy), p.pad)

    def assemble(self, b: int, parts: Sequence[tuple | None], buffer: torch.Tensor | None = None) -> ValBatch:
        """The :class:`ValBatch` of rect batch ``b`` from its images' :meth:`one` results (page-locked
        when ``pin_memory``). ``buffer``: the :meth:`buffer` the images were letterboxed into; the
        batch's images are then its NCHW view (channels-last strides)."""
        H, W = (int(v) for v in self.shapes[b])
        kept = [k for k, x in enumerate(parts) if x is not None]
        parts = [parts[k] for k in kept]
        if not parts:
            bad = [self.source.errors.get(i, "?") for i in self.indices(b)]
            raise ValueError(f"[yolo_func] ValLoader: no image of validation batch {b} could be read: {bad[:3]}; "
                             "fix or remove these files")
        images, boxes, classes, kpts, ids, names, orig, gains, pads = zip(*parts)
        if buffer is not None:
            if len(kept) < buffer.shape[0]:  # a skipped image: its slot left out (rare; one more copy)
                buffer = buffer[kept].pin_memory() if self.pin_memory else buffer[kept]
            images = buffer.permute(0, 3, 1, 2)
        else:
            images = torch.from_numpy(np.stack(images))
            if self.pin_memory:
                images = images.pin_memory()
        kpts = [k for k in kpts if k is not None]
        t = targets_from_lists([torch.from_numpy(x) for x in boxes], [torch.from_numpy(c) for c in classes],
                               image_size=(H, W),
                               keypoints_list=[torch.from_numpy(k) for k in kpts] if kpts else None)
        if self.pin_memory:
            t = _pin_targets(t)
        return ValBatch(images, t, torch.tensor(ids, dtype=torch.int64), tuple(names),
                        torch.tensor(orig, dtype=torch.int64), torch.tensor(gains, dtype=torch.float32),
                        torch.tensor(pads, dtype=torch.float32))

    def _read(self, index: int) -> tuple[Annotated, Any] | None:
        if index in self.source.errors:
            return None
        try:
            # validation batches carry no mask labels: skip rasterising them where the dataset can
            read = getattr(self.source.dataset, "sample_without_masks", None)
            s = read(index) if read is not None else self.source.dataset[index]
            rec = annotated_from_sample(s._replace(masks=None, keypoints=s.keypoints if self.source.task == "pose" else None))
            return load_resized(rec, self.source.image_size), s
        except Exception as e:  # noqa: BLE001 -- bad sample policy (ValLoader docstring)
            self.source.errors[index] = f"{type(e).__name__}: {e}"
            return None

    def __len__(self) -> int:
        return len(self.shapes)


def _pin_targets(t: Targets) -> Targets:
    """Every tensor field of ``t`` in page-locked memory."""
    return Targets(*(None if v is None else v.pin_memory() for v in t))


class _Raised(NamedTuple):
    error: BaseException


_DONE = object()


class ValLoader:
    """Rectangular validation batches (REFERENCE.md §3.1), in aspect-ratio order, last batch kept.

    Each image's long side is resized to ``image_size`` (linear), then letterboxed without
    upscaling, centred, pad 114, into its batch's shape (:func:`val_batch_shapes`). A
    :class:`ValBatch` carries the image ids, file names, original shapes, gains and pads that
    :func:`val_boxes_to_original` needs.

    Args:
      dataset: random access source of :class:`yolo_func.data.Sample`.
      batch_size: B.
      image_size: long side (640).
      workers: parallel readers: threads (``backend="threads"``) or DataLoader worker processes.
      task: default ``dataset.task``.
      shapes: int[N, 2] (h, w) of every original image; default ``dataset.image_sizes`` when the
        dataset has it (:class:`CocoDataset`: the JSON's sizes, which reading checks;
        :class:`YoloDataset`: the image headers), else each file's header size when the dataset
        has ``image_path(i)`` (:func:`yolo_func.data.images.image_size`), else every image is
        decoded once at construction (``workers`` threads).
      stride, pad: rect batch rounding (32, 0.5).
      pin_memory: default True when CUDA is available.
      backend: ``"threads"`` (default): the images of the next batches are read by a pool of
        ``workers`` threads of this process (decoding and resizing release the GIL), started at
        each iteration in microseconds; ``"processes"``: DataLoader worker processes (forked at the
        first iteration: a process holding a CUDA context forks in tenths of a second per worker,
        a fixed cost a short validation cannot amortise). The batches are the same either way.
      producer: ``backend="threads"`` with ``workers > 0``: a background thread builds whole batches
        ahead (their targets, the pinned tensors), so that the consuming thread only takes them:
        what a GPU validation wants, whose main thread would otherwise do that work serially with
        the GPU's. False: the consuming thread stacks each batch's images and builds its targets
        when it takes it, as a CPU forward that keeps every core busy prefers. The batches are the
        same either way.
      device: where each batch's images are delivered (default None: on the host, page-locked
        when ``pin_memory``; the targets and the rest of the batch stay on the host either way).
        With ``backend="processes"`` and ``workers > 0`` the workers then letterbox straight into
        a ring of buffers shared with this process (page-locked on a GPU,
        :mod:`yolo_func.data.shared_ring`) and each batch is copied to ``device`` from its buffer:
        no per-batch shared-memory segment and no pinning copy on the way. The ring holds
        ``min(2 * workers + 2, batches)`` of the largest batch (``batch_size * H * W * 3`` bytes
        each: 18 x 39 MB for 8 workers at 640), page-locked once per loader (a fixed cost of
        about a tenth of a second: short validations read faster with threads).
      shard: ``(rank, world_size)``: iterate only the rect batches ``b`` with ``b % world_size ==
        rank`` (validation sharded over data-parallel ranks; ``len`` counts this shard's batches).
        Default ``(0, 1)``: every batch.

    Bad samples: an image whose reading raises is left out of its batch (not replaced: a copy would
    be evaluated twice), counted in ``skipped`` and warned about once with the dataset's message.

    Example:
      >>> from yolo_func.data import builtin_dataset
      >>> from yolo_func.data import ValLoader
      >>> loader = ValLoader(builtin_dataset("detect", "val", num_images=2), batch_size=2, image_size=64, workers=0)
      >>> b = next(iter(loader))                           # a ValBatch: rect shape, multiples of 32 (ceil(r * 64 / 32 + 0.5) * 32)
      >>> b.images.dtype, max(b.images.shape[-2:]), b.orig_shapes.shape
      (torch.uint8, 96, torch.Size([2, 2]))
    """

    def __init__(self, dataset: Any, *, batch_size: int, image_size: int = 640, workers: int = 4,
                 task: str | None = None, shapes: Sequence[tuple[int, int]] | np.ndarray | None = None,
                 stride: int = 32, pad: float = 0.5, pin_memory: bool | None = None, shard: tuple[int, int] = (0, 1),
                 backend: str = "threads", producer: bool = True, device: str | torch.device | None = None):
        if backend not in ("threads", "processes"):
            raise ValueError(f"[yolo_func] ValLoader: backend must be 'threads' or 'processes', got {backend!r}")
        if workers < 0:
            raise ValueError(f"[yolo_func] ValLoader: workers must be >= 0, got {workers}")
        self.task = _resolve_task(dataset, task)
        self.backend, self.workers, self.producer = backend, int(workers), bool(producer)
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else bool(pin_memory)
        rank, world = shard
        if world < 1 or not 0 <= rank < world:
            raise ValueError(f"[yolo_func] ValLoader: shard must be (rank, world_size) with 0 <= rank < world_size, got {shard}")
        self.shard = (int(rank), int(world))
        if shapes is None:
            shapes = getattr(dataset, "image_sizes", None)
        self._source = _Source(dataset, self.task, image_size)
        if shapes is None:  # header sizes, else decode every image once (threads: OpenCV releases the GIL)
            with ThreadPoolExecutor(max(workers, 1)) as ex:
                shapes = list(ex.map(lambda i: self._shape(i, image_size), range(len(dataset))))
        shapes = np.asarray(shapes, np.int64).reshape(-1, 2)
        if len(shapes) != len(dataset):
            raise ValueError(f"[yolo_func] shapes: expected {len(dataset)} (h, w) rows, got {len(shapes)}")
        self.order, self.batch_shapes = val_batch_shapes(shapes, batch_size, image_size, stride=stride, pad=pad)
        self.skipped: dict[int, str] = {}
        _report(self.skipped, self._source.errors)
        try:
            self.device = None if device is None else torch.device(device)
        except (RuntimeError, TypeError) as e:
            raise ValueError(f"[yolo_func] ValLoader: device must be a torch device such as 'cuda' or 'cpu', "
                             f"got {device!r}") from e
        keys = _EpochSampler(_Epoch(), len(self.batch_shapes), shard=self.shard)
        self._ring: SharedRing | None = None
        prefetch = 2
        if backend == "processes" and workers > 0 and self.device is not None and len(keys):
            # the workers letterbox into slots of one shared mapping made before they fork; each
            # batch goes to the device from its slot (shared_ring's docstring). Never more slots
            # than this shard has batches: within a pass no slot is then reused, and the next pass
            # starts only after the DataLoader drained the last one's work.
            H, W = (int(v) for v in self.batch_shapes.max(0))
            self._ring = SharedRing(min(ring_slots(workers, prefetch), len(keys)), batch_size * H * W * 3)
        self._batches = _ValBatches(self._source, self.order, self.batch_shapes, batch_size,
                                   pin_memory=self.pin_memory and backend == "threads", ring=self._ring)
        self._sampler = keys if self._ring is None else _RingSampler(keys, self._ring)
        self._loader = None
        if backend == "processes":
            self._loader = _dataloader(self._batches, self._sampler, workers=workers,
                                       pin_memory=self.pin_memory and self._ring is None, prefetch_factor=prefetch,
                                       persistent_workers=workers > 0)

    def _shape(self, index: int, image_size: int) -> tuple[int, int]:
        path_of = getattr(self._source.dataset, "image_path", None)
        try:
            if path_of is not None:  # the header alone (a decode only for formats without a readable header)
                return image_size_of(path_of(index))
            return self._source.dataset[index].image.shape[:2]
        except Exception as e:  # noqa: BLE001 -- bad sample policy (class docstring)
            self._source.errors[index] = f"{type(e).__name__}: {e}"
            return image_size, image_size

    def __len__(self) -> int:
        return len(self._sampler)

    def __iter__(self) -> Iterator[ValBatch]:
        if self._loader is not None:
            yield from self._from_processes()
            return
        batches = [b for _, b in self._sampler]
        if self.workers == 0:
            for b in batches:
                batch, new = self._batches[(0, b)]
                _report(self.skipped, new)
                yield self._to_device(batch)
            return
        for batch in self._threaded(batches):
            yield self._to_device(batch)

    def _to_device(self, batch: ValBatch) -> ValBatch:
        if self.device is None:
            return batch
        return batch._replace(images=batch.images.to(self.device, non_blocking=True))

    def _from_processes(self) -> Iterator[ValBatch]:
        it = iter(self._loader)
        if self._ring is None:
            for batch, new in it:
                _report(self.skipped, new)
                yield self._to_device(batch)
            return
        # page-locked once the workers have forked (the first iter() forks them; they persist)
        if self.device.type == "cuda":
            self._ring.pin()
        for wire, new in it:
            _report(self.skipped, new)
            yield wire.unwire(self._ring, self.device)

    def _in_order(self, batches: list[int], ex: ThreadPoolExecutor, stop: threading.Event | None = None
                  ) -> Iterator[tuple[ValBatch, dict[int, str]]]:
        # the images of the next `ahead` batches in flight on the pool; whole batches out, in order
        vb, ahead = self._batches, 2
        pending: collections.deque = collections.deque()

        def submit(b: int) -> None:
            H, W = (int(v) for v in vb.shapes[b])
            buffer, slots = vb.buffer(b)
            pending.append((b, buffer, [ex.submit(vb.one, i, H, W, slot) for i, slot in zip(vb.indices(b), slots)]))

        try:
            for b in batches[:ahead]:
                submit(b)
            nxt = ahead
            while pending and not (stop is not None and stop.is_set()):
                b, buffer, futures = pending.popleft()
                if nxt < len(batches):
                    submit(batches[nxt])
                    nxt += 1
                yield vb.assemble(b, [f.result() for f in futures], buffer), vb.errors_of(b)
        finally:
            for _, _, futures in pending:  # stopped early: nothing left queued on the pool
                for f in futures:
                    f.cancel()

    def _threaded(self, batches: list[int]) -> Iterator[ValBatch]:
        ex = ThreadPoolExecutor(self.workers, thread_name_prefix="yolo_func-val")
        try:
            if not self.producer:  # each batch stacked and its targets built on this thread, between its work
                for batch, new in self._in_order(batches, ex):
                    _report(self.skipped, new)
                    yield batch
                return
            yield from self._produced(batches, ex)
        finally:  # also when the consumer stops early: no thread left running
            ex.shutdown(wait=True, cancel_futures=True)

    def _produced(self, batches: list[int], ex: ThreadPoolExecutor) -> Iterator[ValBatch]:
        # A producer thread runs _in_order and queues whole batches, at most `ahead` of them; this
        # thread only takes them. Anything the producer raises is raised here, in its place.
        done: queue.Queue = queue.Queue(maxsize=2)
        stop = threading.Event()

        def put(item: Any) -> bool:
            while not stop.is_set():
                try:
                    done.put(item, timeout=0.05)
                    return True
                except queue.Full:
                    continue
            return False

        def produce() -> None:
            try:
                for item in self._in_order(batches, ex, stop):
                    if not put(item):
                        return
                put(_DONE)
            except BaseException as e:  # noqa: BLE001 -- handed to the consumer, raised there
                put(_Raised(e))

        producer = threading.Thread(target=produce, name="yolo_func-val-batches", daemon=True)
        producer.start()
        try:
            while True:
                item = done.get()
                if item is _DONE:
                    return
                if isinstance(item, _Raised):
                    raise item.error
                batch, new = item
                _report(self.skipped, new)
                yield batch
        finally:
            stop.set()
            producer.join()
