"""Only the COCO records ``COCOeval`` can read are built: the first 100 per (image, category).

Independent expectations: pycocotools run on every record (no cap) against the capped records on
the shared COCO subsets (more than 100 detections per class and image, score ties at the cut,
scores that tie only after COCO's 5-decimal rounding); a brute-force Python count for
:func:`top_per_category`; plain :func:`postprocess` for :func:`postprocess_with_coco`.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from yolo_func import Inference
from yolo_func.eval import CocoEvaluator, Detections, Letterbox, coco_eval, postprocess
from yolo_func.eval.postprocess import COCO_MAX_DETS, postprocess_with_coco, top_per_category


def _brute_top(classes, valid, k, category_of=None):
    out = np.zeros(classes.shape, bool)
    for b in range(classes.shape[0]):
        seen: dict[int, int] = {}
        for i in range(classes.shape[1]):
            if not valid[b, i]:
                continue
            g = int(classes[b, i]) if category_of is None else int(category_of[int(classes[b, i])])
            seen[g] = seen.get(g, 0) + 1
            out[b, i] = seen[g] <= k
    return out


@settings(max_examples=60, deadline=None)
@given(B=st.integers(1, 3), D=st.integers(0, 40), K=st.integers(1, 5), k=st.integers(1, 6), merge=st.booleans(),
       seed=st.integers(0, 2**31 - 1))
def test_top_per_category_equals_a_brute_force_count(B, D, K, k, merge, seed):
    rng = np.random.default_rng(seed)
    classes = rng.integers(0, K, (B, D))
    valid = np.arange(D)[None] < rng.integers(0, D + 1, (B, 1))  # a prefix, as NMS output
    valid &= rng.random((B, D)) < 0.9  # and holes, which must not count
    category_of = rng.integers(0, max(1, K - 1), K).tolist() if merge else None
    got = top_per_category(torch.from_numpy(classes), torch.from_numpy(valid), k, category_of=category_of)
    assert got.dtype == torch.bool and np.array_equal(got.numpy(), _brute_top(classes, valid, k, category_of))


def test_top_per_category_rejects_bad_input():
    with pytest.raises(ValueError, match="positive int"):
        top_per_category(torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 3, dtype=torch.bool), 0)
    with pytest.raises(ValueError, match=r"int64\[B, D\]"):
        top_per_category(torch.zeros(3, dtype=torch.long), torch.ones(3, dtype=torch.bool), 2)


# ------------------------------------------------------------------ COCOeval's numbers, real data


def _crowded(coco, image_ids, *, per_class, seed, with_masks=False, with_kpts=False):
    """Per image: ``per_class`` detections for each of up to 3 categories present (jittered copies
    of its boxes, a few exact ones at random ranks) and one absent category (when there is one); scores from a coarse
    grid (ties everywhere, at the 100th rank too) plus pairs that differ in float32 but round to
    the same 5 decimals; sorted by descending score with a stable sort, as postprocess outputs them."""
    rng = np.random.default_rng(seed)
    cat_ids = sorted(coco.getCatIds())
    out = []
    for image_id in image_ids:
        img = coco.loadImgs(image_id)[0]
        h0, w0 = img["height"], img["width"]
        anns = [a for a in coco.loadAnns(coco.getAnnIds(imgIds=image_id)) if not a["iscrowd"]]
        present = sorted({cat_ids.index(a["category_id"]) for a in anns})[:3]
        absent = [c for c in range(len(cat_ids)) if c not in present][:1]  # none with a single category
        boxes, scores, classes, kpts = [], [], [], []
        for c in [*present, *absent]:
            mine = [a for a in anns if cat_ids.index(a["category_id"]) == c] or anns[:1]
            for j in range(per_class):
                a = mine[j % len(mine)]
                x, y, w, h = a["bbox"]
                jit = 0.0 if rng.random() < 0.1 else 0.15
                dx, dy = rng.normal(0, jit * w), rng.normal(0, jit * h)
                sw, sh = np.exp(rng.normal(0, jit, 2))
                boxes.append([x + dx, y + dy, x + dx + w * sw, y + dy + h * sh])
                s = rng.integers(1, 40) / 40  # ties
                if rng.random() < 0.2:  # differs from s in float32, equal after round(., 5)
                    s = float(np.float32(s) + np.float32(2e-7))
                scores.append(s)
                classes.append(c)
                if with_kpts:
                    k = np.asarray(a.get("keypoints", [0] * 51), np.float64).reshape(-1, 3).copy()
                    k[:, :2] += rng.normal(0, 3, (len(k), 2))
                    kpts.append(k)
        scores_t = torch.tensor(scores, dtype=torch.float32)
        order = torch.sort(scores_t, descending=True, stable=True).indices
        b = torch.tensor(boxes, dtype=torch.float64)[order]
        b[:, 0::2] = b[:, 0::2].clamp(0, w0)
        b[:, 1::2] = b[:, 1::2].clamp(0, h0)
        masks = None
        if with_masks:  # box-shaped blobs, cut by a random half-plane
            cols, rows = torch.arange(w0), torch.arange(h0)
            inside = ((cols >= b[:, 0:1].floor()) & (cols < b[:, 2:3].ceil()))[:, None, :] & \
                     ((rows >= b[:, 1:2].floor()) & (rows < b[:, 3:4].ceil()))[:, :, None]
            cut = torch.from_numpy(rng.random(len(b)) * 1.5).to(torch.float64)
            masks = inside & (rows[None, :, None] + cols[None, None, :] * 0.3 > cut[:, None, None] * (b[:, 1:2, None]))
        kp = torch.tensor(np.stack(kpts))[order] if with_kpts else None
        out.append(Detections(b, scores_t[order], torch.tensor(classes)[order], masks, kp))
    return out


def _ids(coco, n=None):
    """Images with at least one non-crowd annotation (the first ``n``)."""
    ids = [i for i in sorted(coco.getImgIds()) if any(not a["iscrowd"] for a in coco.loadAnns(coco.getAnnIds(imgIds=i)))]
    return ids[:n]


def _evaluate(coco, image_ids, dets, cap, iou_types=None):
    ev = CocoEvaluator(coco, verbose=False, max_per_category=cap, workers=0)
    for i in range(0, len(image_ids), 4):
        ev.process(image_ids[i:i + 4], dets[i:i + 4])
    return ev.evaluate(iou_types=iou_types), ev.results


def test_the_cap_leaves_cocoeval_bbox_numbers_unchanged(shared_data):
    coco = coco_eval.load_coco(shared_data / "coco-tiny" / "annotations.json")
    ids = _ids(coco)
    dets = _crowded(coco, ids, per_class=130, seed=0)
    want, every = _evaluate(coco, ids, dets, None)
    got, capped = _evaluate(coco, ids, dets, COCO_MAX_DETS)
    assert len(every) == 130 * sum(len({int(c) for c in d.classes}) for d in dets)  # nothing capped without a cap
    assert len(capped) == 100 * len(every) // 130  # 100 per (image, category) kept
    assert got == want
    assert want["bbox"]["AP"] > 0.05 and want["bbox"]["AR100"] > 0.2  # a real matching, not zeros
    # the test can tell: a tighter cut changes the numbers
    assert _evaluate(coco, ids, dets, 30)[0] != want


def test_the_cap_leaves_cocoeval_segm_numbers_unchanged(shared_data):
    coco = coco_eval.load_coco(shared_data / "coco-tiny" / "annotations.json")
    ids = _ids(coco, 4)
    dets = _crowded(coco, ids, per_class=110, seed=1, with_masks=True)
    want, every = _evaluate(coco, ids, dets, None)
    got, capped = _evaluate(coco, ids, dets, COCO_MAX_DETS)
    assert set(want) == {"bbox", "segm"} and len(capped) < len(every)
    assert got == want and want["segm"]["AR100"] > 0.1


def test_the_cap_leaves_cocoeval_keypoint_numbers_unchanged(shared_data):
    coco = coco_eval.load_coco(shared_data / "coco-pose-tiny" / "annotations.json")
    ids = _ids(coco)
    dets = _crowded(coco, ids, per_class=120, seed=2, with_kpts=True)
    want, every = _evaluate(coco, ids, dets, None)
    got, capped = _evaluate(coco, ids, dets, COCO_MAX_DETS)
    assert set(want) == {"bbox", "keypoints"} and len(capped) < len(every)
    assert got == want and want["keypoints"]["AR"] > 0.05
    # keypoints alone read 20 per (image, category): a cap of 20 is exact for them
    assert _evaluate(coco, ids, dets, 20, ["keypoints"])[0] == _evaluate(coco, ids, dets, None, ["keypoints"])[0]


def test_unsorted_detections_are_not_capped(shared_data):
    coco = coco_eval.load_coco(shared_data / "coco-tiny" / "annotations.json")
    image_id = _ids(coco, 1)[0]
    d = _crowded(coco, [image_id], per_class=130, seed=3)[0]
    flipped = Detections(*(None if t is None else t.flip(0) for t in d))  # ascending scores
    ev = CocoEvaluator(coco, verbose=False)
    ev.process([image_id], [flipped])
    assert len(ev.results) == len(d.scores)


# ------------------------------------------------------------------ one NMS for both outputs


def _segment_inference(seed, B=2, K=3, A=400, H=64, W=96):
    g = torch.Generator().manual_seed(seed)
    xy = torch.rand(B, 2, A, generator=g) * torch.tensor([W, H])[None, :, None]
    wh = 4 + torch.rand(B, 2, A, generator=g) * 20
    scores = torch.rand(B, K, A, generator=g)
    scores[:, 0] = scores[:, 0] * 0.2 + 0.8  # class 0 dominates (well over 100 per image survive NMS)
    scores[:, :, ::7] = 0.5  # ties
    coeffs = torch.randn(B, 32, A, generator=g)
    protos = torch.randn(B, 32, H // 4, W // 4, generator=g)
    return Inference(torch.cat([xy, wh, scores, coeffs], 1), protos)


@pytest.mark.parametrize("mask_method,metric_letterbox", [("val", False), ("native", True)])
def test_postprocess_with_coco_equals_postprocess_then_the_cap(mask_method, metric_letterbox):
    inf = _segment_inference(0)
    lbs = [Letterbox((50, 80), (0.8, 1.2), (0.0, 2.0)), Letterbox((64, 96), 1.0, (0.0, 0.0))]
    kw = dict(conf=0.001, iou=0.7, max_det=300, multi_label=True, mask_method=mask_method,
              letterbox=lbs if metric_letterbox else None)
    dets, coco = postprocess_with_coco(inf, **kw, coco_letterbox=lbs, max_per_category=100, category_of=[0, 1, 1])
    want = postprocess(inf, **kw)
    native = postprocess(inf, **{**kw, "mask_method": "native", "letterbox": lbs})
    for d, w in zip(dets, want):
        for f in Detections._fields:
            a, b = getattr(d, f), getattr(w, f)
            assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), f
    capped = 0
    for c, n in zip(coco, native):
        keep = top_per_category(n.classes[None], torch.ones(1, len(n.classes), dtype=torch.bool), 100,
                                category_of=[0, 1, 1])[0]
        capped += int((~keep).sum())
        for f in ("boxes", "scores", "classes", "masks"):
            assert torch.equal(getattr(c, f), getattr(n, f)[keep]), f
        assert c.masks.shape[1:] == n.masks.shape[1:]
    assert capped > 0  # the cap did drop rows here


def test_postprocess_with_coco_checks_its_arguments():
    inf = _segment_inference(1)
    lb = [Letterbox((64, 96), 1.0, (0.0, 0.0))] * 2
    with pytest.raises(ValueError, match="one Letterbox per image"):
        postprocess_with_coco(inf, coco_letterbox=lb[:1])
    with pytest.raises(ValueError, match="max_per_category"):
        postprocess_with_coco(inf, coco_letterbox=lb, max_per_category=0)
    with pytest.raises(ValueError, match="max_per_category"):
        CocoEvaluator({"images": [], "annotations": [], "categories": []}, max_per_category=-1)


# ------------------------------------------------------------------ end to end: the fit's validate


def test_validate_with_capped_records_scores_as_with_every_record(shared_data, tmp_path):
    """A segmentation model whose class 0 fires everywhere (at 224 px, over 100 class-0 detections
    per image survive NMS; 200 per image in all): the fit's ``validate`` fed a capped ``CocoEvaluator`` (the default) and an uncapped
    one returns the same metric, and pycocotools gives the same numbers on both record sets."""
    import json

    from yolo_func import tree as T
    from yolo_func import yolov8
    from yolo_func.configs import build_config
    from yolo_func.data import CocoDataset, ValLoader
    from yolo_func.eval.evaluate import dataset_categories
    from yolo_func.train.fit import validate

    root = shared_data / "coco-tiny"
    data = json.loads((root / "annotations.json").read_text())
    images = data["images"][:2]
    ids = {im["id"] for im in images}
    data = {**data, "images": images, "annotations": [a for a in data["annotations"] if a["image_id"] in ids]}
    (tmp_path / "a.json").write_text(json.dumps(data))
    dataset = CocoDataset(tmp_path / "a.json", root / "images", task="segment")
    model = yolov8("n", task="segment", num_classes=len(dataset.names))
    params, state = model.init(torch.Generator().manual_seed(0))
    for path, leaf in T.tree_items(params):
        if path.startswith("heads/detect/cls/") and path.endswith("pred/bias"):
            leaf.fill_(-5.0)
            leaf[0] = -1.0
    config = build_config("yolov8n-seg", flags={"imgsz": 224, "device": "cpu"},
                          overrides=["val.batch_size=2", "val.max_det=200"])
    loader = ValLoader(dataset, batch_size=2, image_size=224, workers=0, task="segment")
    gt, category_ids = dataset_categories(dataset)
    out = {}
    with torch.no_grad():
        for cap in (None, COCO_MAX_DETS):
            ev = CocoEvaluator(gt, category_ids=category_ids, verbose=False, max_per_category=cap, workers=0)
            metric = validate(model, params, state, loader, dataset, config=config, device=torch.device("cpu"),
                              progress=False, coco=ev)
            out[cap] = (metric, ev.results, ev.evaluate())
    (m_all, r_all, c_all), (m_cap, r_cap, c_cap) = out[None], out[COCO_MAX_DETS]
    assert len(r_all) == 200 * len(images) and len(r_cap) < len(r_all)
    assert sum(r["category_id"] == category_ids[0] for r in r_cap) == 100 * len(images)  # capped
    assert sum(r["category_id"] == category_ids[0] for r in r_all) > 100 * len(images)
    assert set(c_all) == {"bbox", "segm"} and c_cap == c_all
    assert json.dumps(m_cap, sort_keys=True, default=str) == json.dumps(m_all, sort_keys=True, default=str)
    kept = {(r["image_id"], r["category_id"], r["score"], tuple(r["bbox"])) for r in r_cap}
    assert kept <= {(r["image_id"], r["category_id"], r["score"], tuple(r["bbox"])) for r in r_all}
    segm_all = {(r["image_id"], tuple(r["bbox"])): r["segmentation"] for r in r_all}
    assert all(segm_all[(r["image_id"], tuple(r["bbox"]))] == r["segmentation"] for r in r_cap)
