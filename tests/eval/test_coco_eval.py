"""COCO results and pycocotools evaluation on the shared COCO subsets (skipped when absent).

Independent expectations: ground truth fed back as predictions gives AP = 1; keeping the
predictions of a subset of images gives AR100 = the mean over categories of the kept fraction of
each category's instances (computed here from the JSON); no predictions give zeros.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from pycocotools import mask as mask_utils
from pycocotools.coco import COCO

from yolo_func.eval import CocoEvaluator, Detections, coco_eval, metrics


def gt_detections(coco: COCO, image_id: int, *, keypoints_only: bool = False, with_masks: bool = True) -> Detections:
    """The image's non-crowd annotations as detections (score 1, original pixels)."""
    cat_ids = sorted(coco.getCatIds())
    anns = [a for a in coco.loadAnns(coco.getAnnIds(imgIds=image_id)) if not a["iscrowd"]]
    if keypoints_only:
        anns = [a for a in anns if a.get("num_keypoints", 0) > 0]
    img = coco.loadImgs(image_id)[0]
    b = torch.tensor([a["bbox"] for a in anns], dtype=torch.float64).reshape(-1, 4)
    b[:, 2:] += b[:, :2]
    cls = torch.tensor([cat_ids.index(a["category_id"]) for a in anns], dtype=torch.int64)
    masks = None
    if with_masks:
        masks = torch.zeros(len(anns), img["height"], img["width"], dtype=torch.bool)
        for i, a in enumerate(anns):
            masks[i] = torch.from_numpy(coco.annToMask(a)).bool()
    kp = None
    names = coco.loadCats(coco.getCatIds())[0].get("keypoints")
    if names:
        kp = torch.tensor([a["keypoints"] for a in anns], dtype=torch.float64).reshape(len(anns), len(names), 3)
    return Detections(b, torch.ones(len(anns), dtype=torch.float64), cls, masks, kp)


@pytest.fixture(scope="module")
def tiny(shared_data):
    return coco_eval.load_coco(shared_data / "coco-tiny" / "annotations.json")


@pytest.fixture(scope="module")
def pose_tiny(shared_data):
    return coco_eval.load_coco(shared_data / "coco-pose-tiny" / "annotations.json")


def test_ground_truth_as_predictions_gives_ap_1_bbox(tiny):
    ev = CocoEvaluator(tiny, verbose=False)
    for image_id in tiny.getImgIds():
        ev.process([image_id], [gt_detections(tiny, image_id, with_masks=False)])
    m = ev.evaluate()
    assert set(m) == {"bbox"} and set(m["bbox"]) == set(coco_eval.BOX_KEYS)
    for k in ("AP", "AP50", "AP75", "APs", "APm", "APl", "AR100"):
        assert m["bbox"][k] == pytest.approx(1.0), k


@pytest.mark.slow
def test_ground_truth_as_predictions_gives_ap_1_segm(tiny):
    ev = CocoEvaluator(tiny, verbose=False)
    ids = tiny.getImgIds()
    for i in range(0, len(ids), 8):  # batches of 8 images of different sizes
        ev.process(ids[i : i + 8], [gt_detections(tiny, image_id) for image_id in ids[i : i + 8]])
    m = ev.evaluate()
    assert set(m) == {"bbox", "segm"}
    for t in ("bbox", "segm"):
        assert set(m[t]) == set(coco_eval.BOX_KEYS)
        for k in ("AP", "AP50", "AP75", "AR100"):
            assert m[t][k] == pytest.approx(1.0), (t, k)


def test_ground_truth_as_predictions_gives_ap_1_keypoints(pose_tiny):
    # pycocotools ignores persons without labelled keypoints in the keypoint evaluation. This file
    # has no "info" / "licenses" keys (pycocotools 2.0.10's loadRes needs them).
    ev = CocoEvaluator(pose_tiny, verbose=False)
    ids = pose_tiny.getImgIds()
    ev.process(ids, [gt_detections(pose_tiny, i, keypoints_only=True, with_masks=False) for i in ids])
    m = ev.evaluate(iou_types=["keypoints"])
    assert set(m["keypoints"]) == set(coco_eval.KEYPOINT_KEYS)
    assert m["keypoints"]["AP"] == pytest.approx(1.0) and m["keypoints"]["AR"] == pytest.approx(1.0)


def test_dropping_images_lowers_recall_by_the_kept_fraction(tiny):
    ids = sorted(tiny.getImgIds())
    kept = set(ids[::2])
    ev = CocoEvaluator(tiny, verbose=False)
    for image_id in ids:
        det = gt_detections(tiny, image_id, with_masks=False)
        if image_id not in kept:
            det = Detections(*(t[:0] if t is not None else None for t in det))
        ev.process([image_id], [det])
    m = ev.evaluate(iou_types=["bbox"])
    # Expected: per category, kept instances / all instances (non-crowd), averaged over categories.
    fractions = []
    for c in tiny.getCatIds():
        anns = [a for a in tiny.loadAnns(tiny.getAnnIds(catIds=[c])) if not a["iscrowd"]]
        if anns:
            fractions.append(sum(a["image_id"] in kept for a in anns) / len(anns))
    assert 0.2 < np.mean(fractions) < 0.8
    assert m["bbox"]["AR100"] == pytest.approx(np.mean(fractions), abs=1e-6)
    assert m["bbox"]["AP"] < 0.9


def test_empty_predictions_give_zeros(tiny):
    m = coco_eval.evaluate(tiny, [], iou_types=["bbox", "segm"], verbose=False)
    assert m == {t: {k: 0.0 for k in coco_eval.BOX_KEYS} for t in ("bbox", "segm")}
    ev = CocoEvaluator(tiny, verbose=False)
    ev.process([tiny.getImgIds()[0]], [Detections(torch.zeros(0, 4), torch.zeros(0), torch.zeros(0, dtype=torch.int64))])
    assert ev.evaluate()["bbox"]["AP"] == 0.0


def test_annotations_without_info_and_licenses(tiny):
    data = {k: v for k, v in tiny.dataset.items() if k not in ("info", "licenses")}
    image_id = tiny.getImgIds()[0]
    res = coco_eval.to_coco_results(gt_detections(tiny, image_id, with_masks=False), image_id=image_id, category_ids=sorted(tiny.getCatIds()))
    m = coco_eval.evaluate(data, res, iou_types=["bbox"], image_ids=[image_id], verbose=False)
    assert m["bbox"]["AP"] == pytest.approx(1.0)
    assert "info" not in data  # the caller's dict is not modified


def test_results_format_rle_and_rounding():
    mask = torch.zeros(1, 5, 7, dtype=torch.bool)
    mask[0, 1:4, 2:6] = True
    det = Detections(
        torch.tensor([[1.23456, 2.0, 5.5, 4.0]]), torch.tensor([0.1234567]), torch.tensor([1]), mask,
        torch.tensor([[[1.5, 2.5, 0.9], [3.0, 4.0, 0.1]]]),
    )
    (rec,) = coco_eval.to_coco_results(det, image_id=42, category_ids=[7, 9])
    assert rec["image_id"] == 42 and rec["category_id"] == 9
    assert rec["bbox"] == [1.235, 2.0, 4.265, 2.0] and rec["score"] == 0.12346
    assert isinstance(rec["segmentation"]["counts"], str) and rec["segmentation"]["size"] == [5, 7]
    decoded = mask_utils.decode({"size": [5, 7], "counts": rec["segmentation"]["counts"].encode()})
    assert np.array_equal(decoded.astype(bool), mask[0].numpy())
    assert rec["keypoints"] == pytest.approx([1.5, 2.5, 0.9, 3.0, 4.0, 0.1])
    json.dumps(rec)
    with pytest.raises(ValueError, match="category id"):
        coco_eval.to_coco_results(det, image_id=1, category_ids=[7])


def test_letterboxed_detections_are_mapped_back(tiny):
    image_id = tiny.getImgIds()[0]
    img = tiny.loadImgs(image_id)[0]
    det = gt_detections(tiny, image_id, with_masks=False)
    gain, pad = 0.5, (3.0, 11.0)
    boxed = det._replace(boxes=det.boxes * gain + torch.tensor([pad[0], pad[1]] * 2, dtype=torch.float64), masks=None)
    from yolo_func.eval import Letterbox

    ev = CocoEvaluator(tiny, verbose=False)
    ev.process([image_id], [boxed], letterbox=[Letterbox((img["height"], img["width"]), gain, pad)])
    assert ev.evaluate()["bbox"]["AP"] == pytest.approx(1.0)


def test_internal_metric_close_to_pycocotools(tiny):
    """Same jittered predictions through both: the per-class 101-point AP of the reference's metric
    and pycocotools' AP differ only by their documented rules (crowd / area handling, sampling)."""
    gen = torch.Generator().manual_seed(0)
    cat_ids = sorted(tiny.getCatIds())
    acc = metrics.MetricAccumulator()
    ev = CocoEvaluator(tiny, verbose=False)
    for image_id in tiny.getImgIds():
        gt = gt_detections(tiny, image_id, with_masks=False)
        n = len(gt.scores)
        wh = (gt.boxes[:, 2:] - gt.boxes[:, :2]).repeat(1, 2)
        boxes = gt.boxes + torch.randn(n, 4, generator=gen, dtype=torch.float64) * 0.06 * wh
        scores = torch.rand(n, generator=gen, dtype=torch.float64)
        keep = torch.rand(n, generator=gen) < 0.85
        det = Detections(boxes[keep], scores[keep], gt.classes[keep])
        order = det.scores.argsort(descending=True)
        det = Detections(det.boxes[order], det.scores[order], det.classes[order])
        ev.process([image_id], [det])
        acc.process([det], [metrics.GroundTruth(gt.boxes, gt.classes)])
    coco = ev.evaluate(iou_types=["bbox"])["bbox"]
    ours = acc.compute()
    print(f"pycocotools AP {coco['AP']:.4f} AP50 {coco['AP50']:.4f}; internal mAP50-95 {ours['box']['mAP50-95']:.4f} mAP50 {ours['box']['mAP50']:.4f}")
    assert 0.3 < coco["AP"] < 0.95
    assert ours["box"]["mAP50-95"] == pytest.approx(coco["AP"], abs=0.03)
    assert ours["box"]["mAP50"] == pytest.approx(coco["AP50"], abs=0.03)
    assert ours["fitness"] == ours["box"]["mAP50-95"]
    assert len(cat_ids) == 80


def test_category_ids_are_the_coco_80_to_91_map(tiny):
    # REFERENCE.md §3.5: 1-11, 13-25, 27, 28, 31-44, 46-65, 67, 70, 72-82, 84-90 in class order.
    want = [*range(1, 12), *range(13, 26), 27, 28, *range(31, 45), *range(46, 66), 67, 70, *range(72, 83), *range(84, 91)]
    assert list(coco_eval.COCO80_TO_91) == want
    assert coco_eval.category_ids_for(tiny, 80) == want
    with pytest.raises(ValueError, match="80 categories"):
        coco_eval.category_ids_for(tiny, 3)
