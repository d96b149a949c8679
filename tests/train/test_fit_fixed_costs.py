"""The fit's fixed costs outside the steps (issue 14, item 7): validation reuses its ground-truth
masks across epochs and moves a batch's detections to the host per field, not per image."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch

from yolo_func.configs import build_config
from yolo_func.data import ValLoader, builtin_dataset
from yolo_func.eval.postprocess import Detections

IMGSZ = 64


def test_validate_with_a_ground_truth_cache_scores_the_same_and_rasterises_once(tmp_path, monkeypatch):
    F = importlib.import_module("yolo_func.train.fit")  # the module (yolo_func.train.fit is also the function)

    ds = builtin_dataset("segment", "val", root=tmp_path, num_images=4)
    loader = ValLoader(ds, batch_size=2, image_size=IMGSZ, workers=0, shapes=ds.image_sizes)
    cfg = build_config("yolov8n-seg", flags={"imgsz": IMGSZ}, overrides=[f"model.num_classes={len(ds.names)}"])
    model, params, state = F.build_model(F._resolve_model_config(cfg, ds), torch.Generator().manual_seed(0),
                                         log=lambda *_: None)
    calls = []
    real = F.val_gt_masks
    monkeypatch.setattr(F, "val_gt_masks", lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    kw = dict(config=cfg, device=torch.device("cpu"), progress=False)
    plain = F.validate(model, params, state, loader, ds, **kw)
    assert len(calls) == 4  # once per image without a cache
    cache: dict = {}
    first = F.validate(model, params, state, loader, ds, gt_cache=cache, **kw)
    second = F.validate(model, params, state, loader, ds, gt_cache=cache, **kw)
    assert len(calls) == 8 and len(cache) == 4  # the second validation rasterised nothing
    np.testing.assert_equal(first, plain)  # the same numbers, bit for bit (nested dicts of floats and arrays)
    np.testing.assert_equal(second, plain)
    assert all(v.dtype == torch.bool and v.dim() == 3 for v in cache.values())  # bool[N, H/4, W/4] per image


def test_dets_to_host_on_the_cpu_is_the_identity():
    from yolo_func.train.fit import _dets_to_host

    dets = [Detections(torch.rand(n, 4), torch.rand(n), torch.arange(n)) for n in (3, 0, 2)]
    assert _dets_to_host(dets) is dets and _dets_to_host([]) == []


@pytest.mark.cuda
def test_dets_to_host_splits_one_copy_per_field_back_into_images():
    from yolo_func.train.fit import _dets_to_host

    dev = torch.device("cuda")
    dets = [Detections(torch.rand(n, 4, device=dev), torch.rand(n, device=dev), torch.arange(n, device=dev),
                       torch.rand(n, 5, 6, device=dev) > 0.5, None) for n in (3, 0, 2)]
    host = _dets_to_host(dets)
    assert [h.boxes.shape[0] for h in host] == [3, 0, 2]
    for h, d in zip(host, dets):
        assert h.keypoints is None and h.boxes.device.type == "cpu"
        for a, b in zip(h[:4], d[:4]):
            assert torch.equal(a, b.cpu())
