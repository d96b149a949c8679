"""Postprocessing on the GPU: equal to the CPU, no host sync in the static form, and captured in a
CUDA graph (marker ``cuda``; skipped without a GPU)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from yolo_func.eval import postprocess, postprocess_static
from yolo_func.models import Inference

sys.path.insert(0, str(Path(__file__).resolve().parent))
import eval_cases as cases  # noqa: E402

pytestmark = pytest.mark.cuda

VAL = dict(conf=0.001, iou=0.7, max_det=300, multi_label=True)


def seg_inference(seed: int, device) -> Inference:
    y = torch.from_numpy(cases.raw_output(seed, batch=4, num_classes=3, extra=32))
    return Inference(y.to(device), torch.from_numpy(cases.protos(seed, batch=4)).to(device))


def same(a, b) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.classes.tolist() == y.classes.cpu().tolist()
        torch.testing.assert_close(x.boxes, y.boxes.cpu(), rtol=0, atol=1e-4)
        torch.testing.assert_close(x.scores, y.scores.cpu(), rtol=0, atol=0)
        if x.masks is not None:
            assert (x.masks ^ y.masks.cpu()).float().mean() < 1e-3


@pytest.mark.parametrize("cfg", [dict(conf=0.25), VAL])
def test_gpu_equals_cpu(cfg):
    cpu = postprocess(seg_inference(0, "cpu"), mask_method="val", **cfg)
    gpu = postprocess(seg_inference(0, "cuda"), mask_method="val", **cfg)
    same(cpu, gpu)
    assert gpu[0].boxes.device.type == "cuda"


def test_static_form_does_not_sync():
    inf = seg_inference(1, "cuda")
    postprocess_static(inf, **VAL)  # warm-up (lazy CUDA initialisations may sync)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = postprocess_static(inf, **VAL)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.boxes.shape == (4, 300, 4)


def test_static_form_replays_in_a_cuda_graph():
    static_in = seg_inference(2, "cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            postprocess_static(static_in, **VAL)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = postprocess_static(static_in, **VAL)
    for seed in (3, 4):
        new = seg_inference(seed, "cuda")
        static_in.y.copy_(new.y)
        static_in.protos.copy_(new.protos)
        graph.replay()
        torch.cuda.synchronize()
        assert bool(out.converged.all())
        eager = postprocess(seg_inference(seed, "cpu"), mask_method="val", **VAL)
        same(eager, out.unpad())
