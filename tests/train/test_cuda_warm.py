"""The CUDA warm-up thread of a fit (``yolo_func.train.cuda_warm``): off the CPU and when switched
off, errors kept rather than raised; on the GPU it touches neither RNG and a fit with it ends with
the same bytes as one without (see also ``test_fit.py``)."""

import pytest
import torch

from yolo_func import yolov8
from yolo_func.optim import sgd
from yolo_func.train.cuda_warm import ENV, CudaWarmup, start_cuda_warmup


def test_no_thread_on_the_cpu_or_when_switched_off(monkeypatch):
    model, tx = yolov8("n", num_classes=3), sgd(0.01)
    monkeypatch.setenv(ENV, "1")
    assert start_cuda_warmup(model, tx, device=torch.device("cpu"), autocast_dtype=None) is None
    monkeypatch.setenv(ENV, "0")  # the switch is read before any CUDA call: no GPU needed here
    assert start_cuda_warmup(model, tx, device=torch.device("cuda"), autocast_dtype=torch.bfloat16) is None
    assert start_cuda_warmup(model, tx, device=torch.device("cuda"), autocast_dtype=None, enabled=False) is None


def test_a_failing_warmup_is_recorded_not_raised():
    def boom():
        raise RuntimeError("no GPU here")

    w = CudaWarmup(boom)
    assert w.join() >= 0.0
    assert isinstance(w.error, RuntimeError) and w.seconds is not None

    ran = []
    w = CudaWarmup(lambda: ran.append(1))
    w.join()
    assert ran == [1] and w.error is None


@pytest.mark.cuda
@pytest.mark.parametrize("task", ["detect", "segment", "pose"])
def test_the_warmup_step_runs_and_leaves_both_rngs_alone(task):
    from yolo_func.optim import ema as make_ema

    model = yolov8("n", task=task, num_classes=3)
    cpu_rng, cuda_rng = torch.get_rng_state(), torch.cuda.get_rng_state()
    w = start_cuda_warmup(model, sgd(0.01, momentum=0.9), device=torch.device("cuda"), autocast_dtype=torch.bfloat16,
                          ema=make_ema(), enabled=True)
    assert w is not None
    w.join()
    assert w.error is None, w.error
    assert torch.equal(torch.get_rng_state(), cpu_rng) and torch.equal(torch.cuda.get_rng_state(), cuda_rng)
