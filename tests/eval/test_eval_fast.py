"""The fast paths of the validation path equal the plain ones they replace.

- ``evaluate(coco=False)`` returns exactly the default call's internal metric, and nothing else;
- pycocotools iou types in forked workers (``coco_workers`` / ``workers``) give the serial numbers,
  never modify the caller's records or ground-truth dict, and the auto rule stays serial off the
  main thread;
- COCO records built with ``tolist`` and one batched RLE call equal a per-record implementation;
- eager candidate selection without top-k, the batched letterbox undo and the eager NMS that skips
  finished images and empty rows equal the top-k path, ``scale_to_original`` and brute-force greedy
  NMS on batches where images have very different candidate counts;
- the val loader reads segment samples without masks and yields the same batches.
"""

from __future__ import annotations

import copy
import sys
import threading
from pathlib import Path

import hypothesis.strategies as st
import numpy as np
import pytest
import torch
from hypothesis import given, settings

from yolo_func.data import CocoDataset, ValLoader
from yolo_func.eval import Detections, Letterbox, clip_detections, postprocess, scale_to_original
from yolo_func.eval import coco_eval as CE
from yolo_func.eval.evaluate import _detections_to_host, evaluate_with_records
from yolo_func.eval.nms import nms_sorted
from yolo_func.eval.postprocess import _layout, _rows
from yolo_func.models import Inference

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_eval_nms import greedy  # noqa: E402
from test_evaluate import BATCH, IMAGE_SIZE, GroundTruthModel  # noqa: E402


@pytest.fixture(scope="module")
def coco_tiny(shared_data: Path) -> CocoDataset:
    d = shared_data / "coco-tiny"
    return CocoDataset(d / "annotations.json", d / "images", task="detect")


@pytest.fixture(scope="module")
def coco_pose(shared_data: Path) -> CocoDataset:
    d = shared_data / "coco-pose-tiny"
    return CocoDataset(d / "annotations.json", d / "images", task="pose")


# -- evaluate(coco=False), coco_workers ----------------------------------------------------------


def test_coco_false_is_the_default_internal_metric_only(coco_pose):
    kw = dict(image_size=IMAGE_SIZE, batch_size=BATCH, device="cpu", iou=1.0, workers=0, progress=False, verbose=False)
    P = coco_pose.kpt_shape
    full, records = evaluate_with_records(GroundTruthModel(coco_pose, task="pose", num_classes=1, kpt_shape=P), {}, {},
                                          coco_pose, **kw)
    fast, none = evaluate_with_records(GroundTruthModel(coco_pose, task="pose", num_classes=1, kpt_shape=P), {}, {},
                                       coco_pose, coco=False, **kw)
    assert set(full) == {"bbox", "keypoints", "internal"} and len(records) > 0
    assert set(fast) == {"internal"} and none == []
    assert fast["internal"] == full["internal"]
    assert fast["internal"]["box"]["mAP50-95"] > 0.9 and fast["internal"]["pose"]["mAP50-95"] > 0  # a real score


def test_coco_workers_serial_and_forked_agree(coco_pose):
    kw = dict(image_size=IMAGE_SIZE, batch_size=BATCH, device="cpu", iou=1.0, workers=0, progress=False, verbose=False)
    P = coco_pose.kpt_shape
    serial = evaluate_with_records(GroundTruthModel(coco_pose, task="pose", num_classes=1, kpt_shape=P), {}, {},
                                   coco_pose, coco_workers=0, **kw)[0]
    forked = evaluate_with_records(GroundTruthModel(coco_pose, task="pose", num_classes=1, kpt_shape=P), {}, {},
                                   coco_pose, coco_workers=2, **kw)[0]
    assert serial == forked
    assert serial["keypoints"]["AP"] > 0.9


def _noisy_records(coco, seed: int) -> list[dict]:
    """Ground truth fed back with jitter, random scores and dropped boxes: non-trivial AP."""
    rng = np.random.default_rng(seed)
    out = []
    for a in coco.dataset["annotations"]:
        if rng.random() < 0.2:
            continue
        x, y, w, h = a["bbox"]
        j = rng.normal(0, 0.05 * max(w, h, 1), 4)
        rec = {"image_id": a["image_id"], "category_id": a["category_id"], "score": float(rng.random()),
               "bbox": [x + j[0], y + j[1], max(w + j[2], 1.0), max(h + j[3], 1.0)]}
        if "keypoints" in a:
            k = np.asarray(a["keypoints"], float).reshape(-1, 3)
            k[:, :2] += rng.normal(0, 2, (len(k), 2))
            rec["keypoints"] = k.reshape(-1).tolist()
        out.append(rec)
    return out


def test_coco_eval_workers_give_the_serial_numbers_and_leave_inputs_alone(shared_data):
    import json

    gt = json.loads((shared_data / "coco-pose-tiny" / "annotations.json").read_text())
    gt.pop("info", None)
    gt.pop("licenses", None)  # the pycocotools 2.0.10 loadRes case
    gt_before = copy.deepcopy(gt)
    coco = CE.load_coco(gt)
    records = _noisy_records(coco, 0)
    records_before = copy.deepcopy(records)
    serial = CE.evaluate(gt, records, workers=0, verbose=False)
    forked = CE.evaluate(gt, records, workers=2, verbose=False)  # one process per type
    chunked = CE.evaluate(gt, records, workers=4, verbose=False)  # and each type's 32 images in two
    assert chunked == serial
    assert set(serial) == {"bbox", "keypoints"}
    assert serial == forked
    assert 0.1 < serial["bbox"]["AP"] < 0.99 and 0.1 < serial["keypoints"]["AP"] < 0.99
    assert records == records_before  # loadRes wrote into per-record copies only
    assert gt == gt_before  # the caller's dict: no info/licenses added, no 'ignore' / RLE written
    assert coco.dataset["images"] is gt["images"]  # shallow: the lists are shared, not copied


def test_coco_workers_rule():
    assert CE.coco_workers(0, 3, 1000) == 0
    assert CE.coco_workers(4, 2) == 2  # one chunk per type below 32 images
    assert CE.coco_workers(8, 1, images=64) == 4  # 4 chunks of 16 images
    assert CE.coco_workers(8, 1, images=20) == 0  # one useful process: serial
    assert CE.coco_workers(None, 0, 100) == 0
    with pytest.raises(ValueError, match="coco_workers must be >= 0"):
        CE.coco_workers(-1, 2)
    got = []
    t = threading.Thread(target=lambda: got.append(CE.coco_workers(None, 3, 1000)))
    t.start()
    t.join()
    assert got == [0]  # never fork from a background thread (the fit loop's COCO thread)
    if sys.platform == "linux" and threading.current_thread() is threading.main_thread():
        import os

        want = min(3 * 62, os.cpu_count(), CE.MAX_AUTO_WORKERS)
        assert CE.coco_workers(None, 3, 1000) == (want if want > 1 else 0)


def test_one_iou_type_split_over_image_chunks_gives_the_serial_numbers(shared_data, monkeypatch):
    import json

    gt = json.loads((shared_data / "coco-tiny" / "annotations.json").read_text())
    coco = CE.load_coco(gt)
    records = _noisy_records(coco, 1)
    serial = CE.evaluate(coco, records, iou_types=["bbox"], workers=0, verbose=False)
    assert CE.coco_workers(2, 1, len(coco.getImgIds())) == 2  # 32 images: two chunks of 16
    split = CE.evaluate(coco, records, iou_types=["bbox"], workers=2, verbose=False)
    assert split == serial
    assert 0.1 < serial["bbox"]["AP"] < 0.99
    ids = sorted(coco.getImgIds())[:5] + sorted(coco.getImgIds())[-20:]  # a subset, uneven chunks
    monkeypatch.setattr(CE, "MIN_IMAGES_PER_CHUNK", 5)  # 25 images: chunks of 8, 9 and 8
    assert CE.coco_workers(3, 1, len(ids)) == 3
    assert CE.evaluate(coco, records, iou_types=["bbox"], image_ids=ids, workers=0, verbose=False) == \
        CE.evaluate(coco, records, iou_types=["bbox"], image_ids=ids, workers=3, verbose=False)


# -- records and RLE --------------------------------------------------------------------------------


def _records_plain(det: Detections, image_id: int, category_ids) -> list[dict]:
    """The per-record construction the vectorised one replaced (one RLE call per mask)."""
    from pycocotools import mask as mask_utils

    out = []
    for i in range(len(det.scores)):
        x1, y1, x2, y2 = det.boxes[i].double().numpy()
        rec = {"image_id": image_id, "category_id": int(category_ids[int(det.classes[i])]),
               "bbox": [round(float(x1), 3), round(float(y1), 3), round(float(x2 - x1), 3), round(float(y2 - y1), 3)],
               "score": round(float(det.scores[i].double()), 5)}
        if det.masks is not None:
            rle = mask_utils.encode(np.asfortranarray(det.masks[i].numpy().astype(np.uint8)[:, :, None]))[0]
            rle["counts"] = rle["counts"].decode("utf-8")
            rec["segmentation"] = rle
        if det.keypoints is not None:
            rec["keypoints"] = [float(v) for v in det.keypoints[i].double().numpy().reshape(-1)]
        out.append(rec)
    return out


@pytest.mark.parametrize("n", [0, 1, 17])
def test_to_coco_results_equals_the_per_record_construction(n):
    g = torch.Generator().manual_seed(n)
    xy = torch.rand(n, 2, generator=g) * 300
    boxes = torch.cat([xy, xy + 1 + torch.rand(n, 2, generator=g) * 100], 1)
    det = Detections(boxes, torch.rand(n, generator=g), torch.randint(0, 5, (n,), generator=g),
                     torch.rand(n, 31, 45, generator=g) > 0.6, torch.rand(n, 4, 3, generator=g) * 50)
    cats = [3, 9, 11, 40, 90]
    assert CE.to_coco_results(det, image_id=7, category_ids=cats) == _records_plain(det, 7, cats)


def test_encode_masks_equals_encode_mask_each():
    rng = np.random.default_rng(1)
    masks = rng.random((6, 23, 37)) > 0.5
    masks[2] = False
    masks[3] = True
    assert CE.encode_masks(masks) == [CE.encode_mask(m) for m in masks]
    assert CE.encode_masks(np.zeros((0, 5, 5), bool)) == []
    with pytest.raises(ValueError, match="bool\\[N, h, w\\]"):
        CE.encode_masks(masks[0])


# -- postprocess fast paths -------------------------------------------------------------------------


def _raw(B, A, K, *, seed, extra=0, dtype=torch.float32, counts=None):
    """Raw output with very different candidate counts per image, duplicate boxes and tied scores."""
    g = torch.Generator().manual_seed(seed)
    xy = torch.randint(0, 40, (B, A, 2), generator=g).to(dtype) * 4
    wh = torch.randint(2, 30, (B, A, 2), generator=g).to(dtype) * 2
    scores = (torch.randint(0, 6, (B, A, K), generator=g).to(dtype) / 10)  # ties; 0 is below conf
    if counts is not None:  # image b keeps only its first counts[b] anchors above conf
        for b, c in enumerate(counts):
            scores[b, c:] = 0
    ex = torch.rand(B, A, extra, generator=g, dtype=dtype) * 100
    return torch.cat([xy, wh, scores, ex], -1).transpose(1, 2).contiguous()


@pytest.mark.parametrize("multi_label", [True, False])
def test_eager_candidates_without_top_k_equal_the_top_k_path(multi_label):
    y = _raw(5, 120, 4, seed=2, counts=[120, 3, 0, 60, 17])
    inf = Inference(y, None)
    K, _ = _layout(inf, 4, None)
    fast = _rows(inf, K, conf=0.05, multi_label=multi_label, n_cand=None, max_candidates=30000)
    n = fast[4].shape[1]  # the largest candidate count: what the top-k path selects
    topk = _rows(inf, K, conf=0.05, multi_label=multi_label, n_cand=n, max_candidates=30000)
    valid = fast[4]
    assert torch.equal(valid, topk[4])
    for a, b in zip(fast[:4], topk[:4]):
        assert torch.equal(a[valid], b[valid])  # the padding slots differ (never kept)


@pytest.mark.parametrize("task", ["detect", "pose", "segment"])
def test_batched_letterbox_undo_equals_scale_to_original(task):
    kpts = (3, 3) if task == "pose" else None
    extra = 9 if task == "pose" else (8 if task == "segment" else 0)
    y = _raw(4, 200, 3, seed=3, extra=extra, counts=[200, 40, 0, 7])
    protos = torch.randn(4, 8, 16, 20, generator=torch.Generator().manual_seed(4)) if task == "segment" else None
    inf = Inference(y, protos)
    lbs = [Letterbox((101, 160), 0.5, (0.0, 14.75)), Letterbox((60, 80), (1.0, 1.0), (0.0, 2.0)),
           Letterbox((64, 80), 1.0, (0.0, 0.0)), Letterbox((30, 81), (2.0, 0.9876), (0.5, 18.0))]
    kw = dict(conf=0.05, iou=0.6, max_det=50, multi_label=True, kpt_shape=kpts)
    for method in (["val", "predict"] if task == "segment" else ["val"]):
        plain = postprocess(inf, **kw, mask_method=method)
        batched = postprocess(inf, **kw, mask_method=method, letterbox=lbs)
        input_shape = (64, 80) if task == "segment" else None
        for d, b, lb in zip(plain, batched, lbs):
            want = scale_to_original(d, orig_shape=lb.orig_shape, gain=lb.gain, pad=lb.pad, input_shape=input_shape)
            for f in Detections._fields:
                u, v = getattr(want, f), getattr(b, f)
                assert (u is None) == (v is None), f
                assert u is None or (u.dtype == v.dtype and torch.equal(u, v)), f
    no_masks = postprocess(inf, **kw, masks=False, letterbox=lbs)
    assert all(d.masks is None for d in no_masks)
    # clip=False: scale_to_original(clip=False) of each image, and clipping that gives the default
    unclipped = postprocess(inf, **kw, masks=False, letterbox=lbs, clip=False)
    plain = postprocess(inf, **kw, masks=False)
    clipped = postprocess(inf, **kw, masks=False, letterbox=lbs)
    crossed = 0
    for d, u, c, lb in zip(plain, unclipped, clipped, lbs):
        want = scale_to_original(d, orig_shape=lb.orig_shape, gain=lb.gain, pad=lb.pad, clip=False)
        back = clip_detections(u, lb.orig_shape)
        for f in ("boxes", "scores", "classes", "keypoints"):
            a, b, x, y = getattr(want, f), getattr(u, f), getattr(back, f), getattr(c, f)
            assert a is None or (torch.equal(a, b) and torch.equal(x, y)), f
        crossed += int((u.boxes != c.boxes).any(1).sum())
    assert crossed > 0  # some boxes do cross the border, so the two forms differ


@settings(parent=settings.get_profile("ci"))
@given(data=st.data(), B=st.integers(1, 4), n=st.integers(0, 30), thr=st.sampled_from([0.0, 0.3, 0.7]),
       max_det=st.integers(1, 8), block=st.sampled_from([1, 4, 16]))
def test_eager_nms_of_a_batch_equals_greedy_per_image(data, B, n, thr, max_det, block):
    coord, size = st.integers(0, 10), st.integers(1, 6)
    boxes, valid = [], []
    for _ in range(B):  # each image its own boxes and an arbitrary (not prefix) valid mask
        bx = data.draw(st.lists(st.tuples(coord, coord, size, size), min_size=n, max_size=n))
        boxes.append([(x, y, x + w, y + h) for x, y, w, h in bx])
        valid.append(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)))
    bt = torch.tensor(boxes, dtype=torch.float64).reshape(B, n, 4)
    vt = torch.tensor(valid, dtype=torch.bool).reshape(B, n)
    res = nms_sorted(bt, vt, iou=thr, max_det=max_det, block=block)
    for b in range(B):
        want = greedy(boxes[b], [i for i in range(n) if valid[b][i]], thr, max_det)
        assert res.index[b, : int(res.count[b])].tolist() == want
        assert int(res.count[b]) == len(want)


# -- loader, host copies ----------------------------------------------------------------------------


class _NoFastRead:
    """A dataset exposing only ``__getitem__`` / ``__len__`` / ``task`` / ``image_shapes``: the plain path."""

    def __init__(self, ds):
        self.ds, self.task = ds, ds.task
        self.image_shapes = ds.image_sizes

    def __len__(self):
        return len(self.ds)

    def __getitem__(self, i):
        return self.ds[i]


def test_val_loader_segment_batches_equal_without_rasterised_masks(shared_data):
    d = shared_data / "coco-tiny"
    ds = CocoDataset(d / "annotations.json", d / "images", task="segment")
    fast = list(ValLoader(ds, batch_size=8, image_size=160, workers=0, shapes=ds.image_sizes))
    plain = list(ValLoader(_NoFastRead(ds), batch_size=8, image_size=160, workers=0))
    assert len(fast) == len(plain)
    for a, b in zip(fast, plain):
        assert torch.equal(a.images, b.images) and torch.equal(a.image_ids, b.image_ids)
        assert torch.equal(a.targets.boxes, b.targets.boxes) and torch.equal(a.targets.classes, b.targets.classes)
        assert torch.equal(a.gains, b.gains) and torch.equal(a.pads, b.pads)


def test_detections_to_host_on_cpu_is_the_identity():
    d = [Detections(torch.rand(3, 4), torch.rand(3), torch.tensor([0, 2, 1]))]
    out = _detections_to_host(d)
    assert out[0] is d[0]


@pytest.mark.cuda
def test_detections_to_host_one_copy_equals_per_tensor_copies():
    g = torch.Generator().manual_seed(0)
    dets = [Detections(torch.rand(n, 4, generator=g), torch.rand(n, generator=g), torch.randint(0, 80, (n,), generator=g),
                       None, torch.rand(n, 17, 3, generator=g)) for n in (0, 5, 300)]
    cuda = [Detections(*(None if t is None else t.cuda() for t in d)) for d in dets]
    for want, got in zip(dets, _detections_to_host(cuda)):
        for f in Detections._fields:
            u, v = getattr(want, f), getattr(got, f)
            assert (u is None) == (v is None)
            assert u is None or (u.dtype == v.dtype and v.device.type == "cpu" and torch.equal(u, v))


# ------------------------------------------------------------------ RLE on the masks' device


@settings(max_examples=80, deadline=None)
@given(n=st.integers(1, 5), h=st.integers(1, 13), w=st.integers(1, 13), p=st.sampled_from([0.0, 0.1, 0.5, 0.9, 1.0]),
       special=st.sampled_from(["none", "empty", "full", "pixel", "last"]), seed=st.integers(0, 2**31 - 1))
def test_rle_counts_compress_to_pycocotools_encode(n, h, w, p, special, seed):
    """The vectorised run lengths (what a CUDA tensor's masks go through), compressed by
    pycocotools, are byte-equal to ``pycocotools.mask.encode`` of the Fortran-ordered masks: empty,
    full, a single pixel (first, last or anywhere), 1-row / 1-column and odd sizes, several masks
    at once (masks starting with a 1 get a leading 0 run)."""
    from pycocotools import mask as mask_utils

    from yolo_func.eval.coco_eval import rle_counts

    rng = np.random.default_rng(seed)
    m = rng.random((n, h, w)) < p
    if special == "empty":
        m[0] = False
    elif special == "full":
        m[0] = True
    elif special == "pixel":
        m[0] = False
        m[0, rng.integers(h), rng.integers(w)] = True
    elif special == "last":
        m[-1] = False
        m[-1, -1, -1] = True
    counts, lengths = rle_counts(torch.from_numpy(m))
    assert counts.dtype == torch.int64 and lengths.shape == (n,) and int(lengths.sum()) == counts.numel()
    parts = np.split(counts.numpy(), np.cumsum(lengths.numpy())[:-1])
    for c in parts:  # runs alternate from 0s: a sum of h * w, only the first may be empty
        assert c.sum() == h * w and (c[1:] > 0).all()
    ours = mask_utils.frPyObjects([{"counts": c, "size": [h, w]} for c in parts], h, w)
    want = [mask_utils.encode(np.asfortranarray(x.astype(np.uint8)))["counts"] for x in m]
    assert [r["counts"] for r in ours] == want


def test_rle_counts_rejects_a_bad_shape():
    from yolo_func.eval.coco_eval import rle_counts

    with pytest.raises(ValueError, match=r"bool\[N, h, w\]"):
        rle_counts(torch.zeros(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="h, w >= 1"):
        rle_counts(torch.zeros(2, 0, 3, dtype=torch.bool))


@pytest.mark.cuda
def test_encode_masks_of_a_cuda_tensor_equals_the_host_encoding():
    """A CUDA tensor is run-length encoded on the GPU: the same records as the NumPy path, on
    blob-shaped masks at an original-image size."""
    from yolo_func.eval.coco_eval import encode_masks

    gen = torch.Generator().manual_seed(0)
    coarse = torch.rand(37, 1, 15, 20, generator=gen) < 0.4
    masks = torch.nn.functional.interpolate(coarse.float(), size=(427, 640)).bool()[:, 0]
    masks[0] = False
    masks[1] = True
    assert encode_masks(masks.cuda()) == encode_masks(masks.numpy())
