"""TrainLoader / ValLoader: determinism across workers and the cache, epochs, bad samples, rect val."""

from __future__ import annotations

import math
import threading
import warnings

import numpy as np
import pytest
import torch

from loader_fixtures import coco_tiny_samples, ellipse_dataset, ListDataset
from yolo_func.data import TrainLoader, ValLoader
from yolo_func.data.loader import val_batch_shapes, val_boxes_to_original
from yolo_func.structures.targets import validate_targets
from yolo_func.testing import assert_shape, assert_trees_all_equal


def _epoch(loader):
    return [b for b in loader]


@pytest.mark.slow
@pytest.mark.parametrize("task", ["detect", "segment", "pose"])
def test_same_seed_same_batches_for_any_workers_and_cache(task):
    ds = ellipse_dataset(10, task, keypoints=5 if task == "pose" else 0)
    ref = None
    for workers, cache in [(0, False), (1, False), (2, False), (2, "ram"), (0, True)]:
        loader = TrainLoader(ds, batch_size=3, image_size=64, workers=workers, cache=cache, seed=7)
        got = _epoch(loader) + _epoch(loader)  # two epochs: the second must use epoch 1
        assert len(got) == 2 * (10 // 3)
        if ref is None:
            ref = got
        else:
            assert_trees_all_equal(got, ref, strict=True)


def test_epochs_and_seeds_differ_and_set_epoch_replays():
    ds = ellipse_dataset(8, "detect")
    loader = TrainLoader(ds, batch_size=4, image_size=64, workers=0, seed=1)
    e0, e1 = _epoch(loader), _epoch(loader)
    assert loader.epoch == 2
    assert not torch.equal(e0[0].images, e1[0].images)
    loader.set_epoch(0)
    assert_trees_all_equal(_epoch(loader), e0)
    other = TrainLoader(ds, batch_size=4, image_size=64, workers=0, seed=2)
    assert not torch.equal(_epoch(other)[0].images, e0[0].images)


def test_batches_are_static_valid_and_drop_last():
    ds = ellipse_dataset(11, "segment")
    loader = TrainLoader(ds, batch_size=4, image_size=96, workers=0, seed=0)
    batches = _epoch(loader)
    assert len(loader) == len(batches) == 2  # 11 // 4: the tail of 3 is dropped
    for b in batches:
        assert_shape(b.images, (4, 3, 96, 96))
        assert b.images.dtype == torch.uint8
        assert_shape(b.targets.masks, (4, 24, 24))
        M = b.targets.boxes.shape[1]
        assert M >= 8 and M & (M - 1) == 0
        validate_targets(b.targets, (96, 96))
        # every mask value points at a valid slot
        for i in range(4):
            vals = torch.unique(b.targets.masks[i])
            vals = vals[vals > 0] - 1
            assert b.targets.valid[i, vals].all()


def test_close_mosaic_turns_mosaic_off_for_the_last_epochs():
    from yolo_func.data.augment import AugmentConfig

    ds = ellipse_dataset(4, "detect", size=(48, 160))  # wide images: loaded height <= 38 of 64
    cfg = AugmentConfig(close_mosaic=1, translate=0.0, scale=0.0, hsv_h=0, hsv_s=0, hsv_v=0, fliplr=0.0)
    loader = TrainLoader(ds, batch_size=4, image_size=64, workers=0, seed=0, augment=cfg, epochs=2, shuffle=False)
    on, off = _epoch(loader)[0], _epoch(loader)[0]
    # Mosaic off, s = 1, no translation: each image sits centred on 114 padding (top rows all 114)
    # and holds only its own instances; with mosaic the partners fill the frame.
    assert (off.images[:, :, :8] == 114).all()
    assert not (on.images[:, :, :8] == 114).all()
    own = torch.tensor([len(ds.samples[i].boxes) for i in range(4)])
    assert (off.targets.valid.sum(1) <= own).all()


@pytest.mark.parametrize("workers,cache", [(0, False), (2, False), (0, "ram")])
def test_bad_samples_are_skipped_counted_and_named_once(workers, cache):
    ds = ellipse_dataset(8, "detect", bad=(2, 5))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        loader = TrainLoader(ds, batch_size=4, image_size=64, workers=workers, cache=cache, seed=0)
        batches = _epoch(loader) + _epoch(loader)
    assert len(batches) == 4 and all(b.images.shape[0] == 4 for b in batches)
    assert sorted(loader.skipped) == [2, 5]
    assert "synthetic_0002.png" in loader.skipped[2] and "synthetic_0005.png" in loader.skipped[5]
    msgs = [str(x.message) for x in w if "skipped" in str(x.message)]
    assert sum("synthetic_0002.png" in m for m in msgs) == 1 and sum("synthetic_0005.png" in m for m in msgs) == 1
    # deterministic replacement: the same as a dataset where 2 and 5 are copies of 3 and 6
    good = ListDataset([ds.samples[{2: 3, 5: 6}.get(i, i)] for i in range(8)], "detect")
    same = _epoch(TrainLoader(good, batch_size=4, image_size=64, workers=0, seed=0))
    assert_trees_all_equal(batches[:2], same)


def test_argument_errors():
    ds = ellipse_dataset(4, "detect")
    with pytest.raises(ValueError, match=r"\[yolo_func\] image_size"):
        TrainLoader(ds, batch_size=2, image_size=100, workers=0)
    with pytest.raises(ValueError, match=r"\[yolo_func\] batch_size"):
        TrainLoader(ds, batch_size=5, image_size=64, workers=0)
    with pytest.raises(ValueError, match=r"\[yolo_func\] task"):
        TrainLoader(ListDataset(ds.samples, None), batch_size=2, image_size=64, workers=0)
    with pytest.raises(ValueError, match=r"\[yolo_func\] cache"):
        TrainLoader(ds, batch_size=2, image_size=64, workers=0, cache="disk")


# -------------------------------------------------------------------------------------- validation
def test_val_batch_shapes_hand_computed():
    shapes = np.array([[480, 640], [640, 480], [300, 600], [500, 500], [200, 800]])
    order, bs = val_batch_shapes(shapes, 2, 640)
    # ratios h/w: 0.75, 1.333, 0.5, 1.0, 0.25 -> sorted 0.25 (4), 0.5 (2), 0.75 (0), 1.0 (3), 1.333 (1)
    assert order.tolist() == [4, 2, 0, 3, 1]
    # batch 0: all < 1, max 0.5 -> (0.5, 1): ceil(0.5*20 + 0.5)*32 = 11*32, ceil(20.5)*32 = 21*32
    # batch 1: 0.75, 1.0 (mixed) -> (1, 1) -> 672 x 672; batch 2: 1.333 > 1 -> (1, 0.75) -> 672, 512
    assert bs.tolist() == [[352, 672], [672, 672], [672, 512]]


def test_val_loader_maps_boxes_back_to_original_pixels():
    ds = ellipse_dataset(7, "detect", size=(150, 90))
    loader = ValLoader(ds, batch_size=3, image_size=64, workers=0)
    seen = []
    for vb in loader:
        H, W = vb.images.shape[-2:]
        assert H % 32 == 0 and W % 32 == 0 and vb.images.dtype == torch.uint8
        for i in range(vb.images.shape[0]):
            s = ds.samples[int(vb.image_ids[i])]
            assert vb.file_names[i] == s.file_name and tuple(vb.orig_shapes[i].tolist()) == s.image.shape[:2]
            n = len(s.boxes)
            back = val_boxes_to_original(vb.targets.boxes[i, :n], vb.gains[i], vb.pads[i], vb.orig_shapes[i])
            np.testing.assert_allclose(back.numpy(), s.boxes, atol=1.0)
            # padding is 114 outside the letterboxed image
            left, top = (int(v) for v in vb.pads[i])
            img = vb.images[i]
            assert (img[:, :, :left] == 114).all() and (img[:, :top, :] == 114).all()
            seen.append(int(vb.image_ids[i]))
    assert sorted(seen) == list(range(7))


@pytest.mark.slow
def test_coco_tiny_through_the_loader(shared_data):
    samples = coco_tiny_samples(shared_data / "coco-tiny", limit=8)
    ds = ListDataset(samples, "segment")
    a = _epoch(TrainLoader(ds, batch_size=4, image_size=256, workers=0, seed=3))
    b = _epoch(TrainLoader(ds, batch_size=4, image_size=256, workers=2, cache="ram", seed=3))
    assert_trees_all_equal(a, b, strict=True)
    for batch in a:
        validate_targets(batch.targets, (256, 256))
        assert batch.targets.valid.any()
        # each valid slot with mask pixels has its box around them (mask at H/4: 4-px cells)
        for i in range(4):
            for j in torch.nonzero(batch.targets.valid[i]).flatten().tolist():
                ys, xs = torch.nonzero(batch.targets.masks[i] == j + 1, as_tuple=True)
                if len(xs):
                    x1, y1, x2, y2 = batch.targets.boxes[i, j].tolist()
                    assert xs.min() * 4 >= math.floor(x1) - 4 and (xs.max() + 1) * 4 <= math.ceil(x2) + 4
                    assert ys.min() * 4 >= math.floor(y1) - 4 and (ys.max() + 1) * 4 <= math.ceil(y2) + 4


class _DenseOnly:
    """A dataset seen only through ``len`` and ``[i]`` (hides CocoDataset's mask-crop fast path)."""

    def __init__(self, ds):
        self.ds, self.task, self.names = ds, ds.task, ds.names

    def __len__(self):
        return len(self.ds)

    def __getitem__(self, i):
        return self.ds[i]


def test_coco_mask_crop_fast_path_gives_the_same_batches(shared_data):
    from yolo_func.data import CocoDataset

    ds = CocoDataset(shared_data / "coco-tiny" / "annotations.json", shared_data / "coco-tiny" / "images",
                     task="segment")
    fast = TrainLoader(ds, batch_size=4, image_size=128, workers=0, seed=5, mask_source="bitmaps")
    dense = TrainLoader(_DenseOnly(ds), batch_size=4, image_size=128, workers=0, seed=5)
    a, b = _epoch(fast)[:3], _epoch(dense)[:3]
    assert_trees_all_equal(a, b, strict=True)
    assert all(int(x.targets.masks.max()) > 0 for x in a)


def test_batch_images_are_nhwc_in_memory_and_equal_to_the_records():
    """images: [B, 3, H, W] with channels_last strides (no transpose on the host)."""
    ds = ellipse_dataset(6, "detect")
    batch = next(iter(TrainLoader(ds, batch_size=3, image_size=64, workers=0, seed=0)))
    assert batch.images.shape == (3, 3, 64, 64) and batch.images.dtype == torch.uint8
    assert batch.images.is_contiguous(memory_format=torch.channels_last)
    nchw = batch.images.contiguous()
    assert torch.equal(nchw, batch.images) and torch.equal(nchw.permute(0, 2, 3, 1), batch.images.permute(0, 2, 3, 1))


@pytest.mark.cuda
def test_pinned_batches_reach_the_device_unchanged():
    ds = ellipse_dataset(8, "segment")
    pinned = _epoch(TrainLoader(ds, batch_size=4, image_size=64, workers=2, seed=0, pin_memory=True))
    plain = _epoch(TrainLoader(ds, batch_size=4, image_size=64, workers=0, seed=0, pin_memory=False))
    for a, b in zip(pinned, plain):
        assert all(v.is_pinned() for v in (a.images, *a.targets) if v is not None)  # small targets too (wire form)
        assert a.images.is_contiguous(memory_format=torch.channels_last)  # pinning keeps the NHWC layout
        dev = a.images.to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        assert dev.is_contiguous(memory_format=torch.channels_last)
        assert torch.equal(dev.cpu(), b.images)
    assert_trees_all_equal(pinned, plain)


@pytest.mark.cuda
def test_pinned_val_batches_are_letterboxed_into_page_locked_buffers():
    ds = ellipse_dataset(10, "detect")
    plain = list(ValLoader(ds, batch_size=3, image_size=64, workers=0, pin_memory=False))
    for kw in (dict(workers=0), dict(workers=3)):
        pinned = list(ValLoader(ds, batch_size=3, image_size=64, pin_memory=True, **kw))
        for a, b in zip(pinned, plain):
            assert a.images.is_pinned() and a.images.is_contiguous(memory_format=torch.channels_last)
            assert all(v.is_pinned() for v in a.targets if v is not None)
            dev = a.images.to("cuda", non_blocking=True)
            torch.cuda.synchronize()
            assert torch.equal(dev.cpu(), b.images)
        _assert_val_batches_equal(pinned, plain)


def _main_process_and_ring(ds, device: str) -> tuple[list, ValLoader]:
    """The batches of ``ds`` read in the main process, and a shared-ring loader (2 workers) of the
    same data delivering to ``device`` (batch 2 at 64 px, warnings of bad files silenced)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = list(ValLoader(ds, batch_size=2, image_size=64, workers=0, pin_memory=False))
        return want, ValLoader(ds, batch_size=2, image_size=64, workers=2, backend="processes", device=device)


@pytest.mark.cuda
def test_ring_val_batches_arrive_on_the_gpu_from_a_page_locked_ring_unchanged():
    # worker processes letterbox into the shared ring, page-locked after they fork; each batch is
    # copied to the GPU asynchronously from its slot, and the slots rotate several times a pass
    plain, loader = _main_process_and_ring(ellipse_dataset(31, "pose", keypoints=5, bad=(6,)), "cuda")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(2):
            got = list(loader)
            assert loader._ring.pinned and loader._ring.flat.is_pinned()  # else the copies are synchronous
            assert all(vb.images.is_cuda and vb.images.is_contiguous(memory_format=torch.channels_last) for vb in got)
            _assert_val_batches_equal([vb._replace(images=vb.images.cpu()) for vb in got], plain)
    assert len(loader) > loader._ring.slots


def test_worker_batches_send_small_targets_inline_and_arrive_unchanged():
    # a worker's batch crosses the pipe with its small target arrays pickled inline (no shared-memory
    # segment and file descriptor each); what the main process gets back is the same Batch
    import pickle
    from multiprocessing.reduction import ForkingPickler

    from yolo_func.data.loader import _WireBatch

    ds = ellipse_dataset(8, "pose", keypoints=5)
    batch = next(iter(TrainLoader(ds, batch_size=4, image_size=64, workers=0, seed=0)))
    wire = _WireBatch(batch)
    assert all(isinstance(v, np.ndarray) for v in (wire.boxes, wire.classes, wire.valid, wire.keypoints))
    data = bytes(ForkingPickler.dumps(wire))
    assert wire.boxes.tobytes() in data and wire.keypoints.tobytes() in data  # inline, by value
    assert_trees_all_equal(pickle.loads(data).unwire(), batch)


def test_an_epoch_left_half_way_restarts_and_workers_run_across_epochs():
    ds = ellipse_dataset(12, "detect")
    full = TrainLoader(ds, batch_size=3, image_size=64, workers=2, seed=5)
    e0, e1 = _epoch(full), _epoch(full)
    loader = TrainLoader(ds, batch_size=3, image_size=64, workers=2, seed=5)
    it = iter(loader)
    first = next(it)
    it.close()  # leave epoch 0 after one batch
    assert loader.epoch == 0
    assert_trees_all_equal(first, e0[0])
    assert_trees_all_equal(_epoch(loader), e0)  # restarted from its first batch
    assert_trees_all_equal(_epoch(loader), e1)
    loader.close()  # workers stopped; the next iteration starts new ones at epoch 2
    loader.set_epoch(1)
    assert_trees_all_equal(_epoch(loader), e1)


def test_deleting_a_loader_stops_its_workers_promptly():
    import gc
    import multiprocessing as mp
    import time

    before = set(mp.active_children())
    loader = TrainLoader(ellipse_dataset(10, "detect"), batch_size=3, image_size=64, workers=2, seed=0)
    _epoch(loader)  # the workers are now prefetching epoch 1
    procs = set(mp.active_children()) - before
    assert len(procs) == 2
    t = time.perf_counter()
    del loader
    gc.collect()
    assert time.perf_counter() - t < 4.0, "worker shutdown fell back to the 5-s join timeouts (a reference cycle?)"
    assert not any(p.is_alive() for p in procs)


def test_val_loader_leaves_bad_images_out():
    ds = ellipse_dataset(6, "detect", bad=(1, 4))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        loader = ValLoader(ds, batch_size=2, image_size=64, workers=0)
        ids = [int(i) for vb in loader for i in vb.image_ids]
    assert sorted(ids) == [0, 2, 3, 5]  # each good image once, no replacement
    assert sorted(loader.skipped) == [1, 4]
    assert sum("synthetic_0001.png" in str(x.message) for x in w) == 1


def _assert_val_batches_equal(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.file_names == y.file_names
        assert_trees_all_equal(x._replace(file_names=None), y._replace(file_names=None))


@pytest.mark.parametrize("task", ["segment", "pose"])
def test_val_loader_backends_give_the_same_batches_and_skips(task):
    # threads (the default), worker processes and the main process: the same ValBatches, the same
    # bad images left out and counted; shapes from reading (no dataset.image_shapes here)
    ds = ellipse_dataset(11, task, keypoints=5 if task == "pose" else 0, bad=(3, 7))
    got = {}
    for name, kw in {"main": dict(workers=0), "threads": dict(workers=3), "threads1": dict(workers=1),
                     "consumer": dict(workers=2, producer=False),
                     "processes": dict(workers=2, backend="processes"),
                     "ring": dict(workers=2, backend="processes", device="cpu")}.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loader = ValLoader(ds, batch_size=3, image_size=64, pin_memory=False, **kw)
            assert (loader._ring is not None) == (name == "ring")  # the shared ring only where asked for
            got[name] = (list(loader), sorted(loader.skipped))
    assert got["main"][1] == [3, 7]
    for name in ("threads", "threads1", "consumer", "processes", "ring"):
        assert got[name][1] == got["main"][1], name
        _assert_val_batches_equal(got[name][0], got["main"][0])


@pytest.mark.parametrize("kw", [dict(workers=0), dict(workers=3), dict(workers=2, producer=False)])
def test_val_images_letterboxed_into_the_batch_buffer_equal_the_stacked_ones(kw):
    # the GPU path (pinned batches): readers letterbox straight into one NHWC buffer per batch; here
    # switched on without pinning, against the stacking path, bad images (a slot left out) included
    ds = ellipse_dataset(11, "pose", keypoints=5, bad=(3, 7))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = list(ValLoader(ds, batch_size=3, image_size=64, pin_memory=False, workers=0))
        loader = ValLoader(ds, batch_size=3, image_size=64, pin_memory=False, **kw)
        loader._batches.direct = True
        got = list(loader)
    assert sorted(loader.skipped) == [3, 7]
    assert all(vb.images.is_contiguous(memory_format=torch.channels_last) for vb in got)
    assert any(vb.images.shape[0] < 3 for vb in got)  # a batch that lost a slot
    _assert_val_batches_equal(got, want)


def test_letterbox_into_a_given_array_fills_every_pixel():
    from yolo_func.data.augment import letterbox

    rng = np.random.default_rng(0)
    for (h, w), shape in [((40, 64), (64, 64)), ((64, 30), (64, 96)), ((50, 50), (64, 64)), ((64, 64), (64, 64)),
                          ((100, 80), (64, 64))]:
        img = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        want, p = letterbox(img, shape, scaleup=False)
        out = rng.integers(0, 256, (*shape, 3), dtype=np.uint8)  # garbage: every pixel must be written
        got, q = letterbox(img, shape, scaleup=False, out=out)
        assert got is out and q == p
        np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match=r"out must be uint8\[64, 64, 3\]"):
        letterbox(img, (64, 64), out=np.zeros((64, 32, 3), np.uint8))


def test_ring_val_loader_keeps_every_batch_through_many_slot_rotations_and_an_abandoned_pass():
    # 2 workers: 6 slots for 13 batches, so every slot is written more than twice per pass; a pass
    # left after two batches (work still in flight in the workers) must not leak into the next one
    want, loader = _main_process_and_ring(ellipse_dataset(25, "pose", keypoints=5, bad=(4,)), "cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert loader._ring.slots == 6 < len(loader) == 13
        it = iter(loader)
        early = [next(it), next(it)]
        del it
        again, third = list(loader), list(loader)
    _assert_val_batches_equal(early, want[:2])
    _assert_val_batches_equal(again, want)
    _assert_val_batches_equal(third, want)
    assert all(vb.images.is_contiguous(memory_format=torch.channels_last) for vb in again)


def test_ring_of_fewer_slots_than_in_flight_batches_when_the_loader_has_few_batches():
    # 3 batches, 2 workers: 3 slots (not 6); passes one after another, one left early, stay right
    want, loader = _main_process_and_ring(ellipse_dataset(6, "detect"), "cpu")
    assert loader._ring.slots == len(loader) == 3
    _assert_val_batches_equal(list(loader), want)
    it = iter(loader)
    _assert_val_batches_equal([next(it)], want[:1])
    del it
    for _ in range(2):
        _assert_val_batches_equal(list(loader), want)


def test_ring_val_loader_leaves_pinning_to_the_ring(monkeypatch):
    # beside a GPU (pin_memory's default True) the ring is the page-locked memory: the DataLoader
    # must not start its own pinning thread for the ring's small wire batches
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    ds = ellipse_dataset(6, "detect")
    ring = ValLoader(ds, batch_size=2, image_size=64, workers=2, backend="processes", device="cpu")
    plain = ValLoader(ds, batch_size=2, image_size=64, workers=2, backend="processes")
    assert ring.pin_memory and ring._loader.pin_memory is False
    assert plain._loader.pin_memory is True


def test_val_loader_names_a_bad_device():
    with pytest.raises(ValueError, match=r"ValLoader: device must be a torch device .* got 'cdua'"):
        ValLoader(ellipse_dataset(2, "detect"), batch_size=2, image_size=64, workers=0, device="cdua")


def test_shared_ring_views_rotation_and_bounds():
    from yolo_func.data.shared_ring import SharedRing, ring_slots

    assert ring_slots(8, 2) == 18
    ring = SharedRing(3, 24)
    a = ring.view(1, (2, 2, 2, 3))
    a.fill_(7)
    assert int(ring.flat[24:48].sum()) == 7 * 24 and int(ring.flat.sum()) == 7 * 24  # slot 1 only
    assert [ring.claim() for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    copy = ring.to_device(1, a, torch.device("cpu"))
    a.fill_(0)
    assert int(copy.sum()) == 7 * 24  # off the host ring, a batch is a copy: the slot may be rewritten
    with pytest.raises(ValueError, match="slot 3 of 3"):
        ring.view(3, (1,))
    with pytest.raises(ValueError, match="cannot hold"):
        ring.view(0, (25,))
    with pytest.raises(ValueError, match="slots and slot_bytes"):
        SharedRing(0, 8)


def test_threaded_val_loader_can_be_left_early_and_iterated_again():
    ds = ellipse_dataset(10, "detect")
    loader = ValLoader(ds, batch_size=2, image_size=64, workers=4, pin_memory=False)
    first = next(iter(loader))  # the generator is dropped with work in flight
    again = list(loader)
    assert len(again) == len(loader) == 5
    _assert_val_batches_equal([first], again[:1])
    with pytest.raises(ValueError, match="backend"):
        ValLoader(ds, batch_size=2, image_size=64, backend="fork")


def _val_threads():
    return {t for t in threading.enumerate() if t.name.startswith("yolo_func-val")}


@pytest.mark.parametrize("producer", [True, False])
def test_threaded_val_loader_leaves_no_thread_behind_and_raises_in_place(producer):
    # a consumer that stops early: the producer and the readers are gone when the generator closes
    ds = ellipse_dataset(12, "detect")
    loader = ValLoader(ds, batch_size=2, image_size=64, workers=3, pin_memory=False, producer=producer)
    it = iter(loader)
    next(it)
    assert _val_threads()  # started: the producer and the pool
    it.close()
    assert not _val_threads()
    # a batch without any readable image: its error comes after the batches before it, and the
    # threads are gone after it too (the sizes came before, so only the reads fail)
    ds.bad = {int(i) for i in loader.order[4:6]}  # rect batch 2
    got = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match="no image of validation batch 2 could be read"):
            for vb in loader:
                got.append(vb)
    assert len(got) == 2 and not _val_threads()
    ref = list(ValLoader(ellipse_dataset(12, "detect"), batch_size=2, image_size=64, workers=0, pin_memory=False))
    _assert_val_batches_equal(got, ref[:2])


def test_pose_flip_index_comes_from_the_dataset_or_coco():
    from yolo_func.data.augment import COCO_FLIP_INDEX

    ds = ellipse_dataset(4, "pose", keypoints=5)
    assert TrainLoader(ds, batch_size=2, image_size=64, workers=0).config.flip_index == (0, 2, 1, 4, 3)
    coco = ellipse_dataset(4, "pose", keypoints=17)
    coco.flip_index = None
    assert TrainLoader(coco, batch_size=2, image_size=64, workers=0).config.flip_index == COCO_FLIP_INDEX


@pytest.mark.parametrize("workers", [0, 2])
def test_set_epoch_start_batch_yields_the_rest_of_the_epoch_then_whole_epochs(workers):
    """``set_epoch(e, start_batch=k)`` (a mid-epoch resume) yields batches k.. of epoch e, equal to
    an uninterrupted run's, then the next epoch from its first batch; bad ``start_batch`` names
    the range."""
    ds = ellipse_dataset(12, "detect")
    full = TrainLoader(ds, batch_size=3, image_size=64, workers=0, seed=5)
    e0, e1 = _epoch(full), _epoch(full)  # 4 batches each
    loader = TrainLoader(ds, batch_size=3, image_size=64, workers=workers, seed=5)
    loader.set_epoch(0, start_batch=2)
    assert_trees_all_equal(_epoch(loader), e0[2:], strict=True)
    assert loader.epoch == 1
    assert_trees_all_equal(_epoch(loader), e1, strict=True)
    with pytest.raises(ValueError, match=r"start_batch must be in \[0, 4\), got 4"):
        loader.set_epoch(0, start_batch=4)
    loader.close()


def test_start_loads_ahead_and_the_iteration_continues_from_there(tmp_path):
    """``TrainLoader.start`` (the fit calls it before building its model) begins the iteration at
    the ``set_epoch`` position; the batches are those of a loader that was never started early."""
    from yolo_func.data import TrainLoader, builtin_dataset

    ds = builtin_dataset("detect", "train", root=tmp_path, num_images=8)
    kw = dict(batch_size=2, image_size=64, seed=3, epochs=3)
    plain = TrainLoader(ds, workers=0, **kw)
    plain.set_epoch(1, start_batch=1)
    expected = [b.images.clone() for b in plain] + [b.images.clone() for b in plain]  # epoch 1 from batch 1, epoch 2
    early = TrainLoader(ds, workers=1, **kw)
    early.set_epoch(1, start_batch=1)
    early.start()
    it = early._it
    early.set_epoch(1, start_batch=1)  # the fit's loop sets the same position again: no restart
    got = [b.images.clone() for b in early]
    assert early._it is it
    got += [b.images.clone() for b in early]
    early.close()
    assert len(got) == len(expected) == 3 + 4 and all(torch.equal(a, b) for a, b in zip(got, expected))


class _NoSizes:
    """A dataset view without ``image_sizes`` (header sizes via ``image_path``) or without both (decode)."""

    def __init__(self, ds, with_paths: bool):
        self.ds, self.task, self.names = ds, ds.task, ds.names
        if with_paths:
            self.image_path = ds.image_path

    def __len__(self):
        return len(self.ds)

    def __getitem__(self, i):
        return self.ds[i]


@pytest.mark.parametrize("task", ["detect", "segment"])
def test_val_loader_takes_sizes_without_decoding(task, tmp_path, monkeypatch):
    # CocoDataset.image_sizes (the JSON's, checked when read) and the files' headers give the rect
    # shapes; no image is decoded at construction (it was decoded twice per validation before:
    # once for its shape, once for the batch), and the batches equal those of decoded shapes.
    from yolo_func.data import builtin_dataset, coco

    ds = builtin_dataset(task, "val", root=tmp_path / "data", num_images=7)
    decoded = np.asarray([ds[i].image.shape[:2] for i in range(len(ds))])
    assert len({tuple(s) for s in decoded}) > 1, "the fixture should have images of several shapes"
    want = list(ValLoader(ds, batch_size=3, image_size=64, workers=0, shapes=decoded, pin_memory=False))
    calls = []
    real = coco.read_image
    monkeypatch.setattr(coco, "read_image", lambda p: calls.append(p) or real(p))
    for source in (ds, _NoSizes(ds, with_paths=True)):
        loader = ValLoader(source, batch_size=3, image_size=64, workers=2, pin_memory=False)
        assert calls == [], f"{type(source).__name__}: images decoded at construction"
        np.testing.assert_array_equal(loader.batch_shapes, want_shapes := ValLoader(
            ds, batch_size=3, image_size=64, workers=0, shapes=decoded, pin_memory=False).batch_shapes)
        _assert_val_batches_equal(list(loader), want)
        calls.clear()
    # no sizes and no paths: each image decoded once for its shape, the same batches
    loader = ValLoader(_NoSizes(ds, with_paths=False), batch_size=3, image_size=64, workers=0, pin_memory=False)
    assert len(calls) == len(ds)
    np.testing.assert_array_equal(loader.batch_shapes, want_shapes)
    _assert_val_batches_equal(list(loader), want)
