"""A CUDA warm-up on a thread while a fit sets itself up (issue 14: a short fit's start-up).

A process's first CUDA training step pays for the lazy CUDA set-up: kernel modules loaded on first
launch, cuDNN's libraries and plans, cuBLAS handles. In :func:`yolo_func.train.fit` that cost lands
on the first capture's eager warm-up (2.5-2.9 s of a segmentation fit's first step at batch 16 on
the H200 host, against ~0.07 s for a warm step), after ``init_train_state`` and the loaders'
set-up. :func:`start_cuda_warmup` runs one training step of the same model, optimizer and
precision on a tiny synthetic batch (its own parameters, its results discarded) on a thread
instead, so that most of that set-up overlaps with the main thread's.

The warm-up touches nothing of the fit: its own ``TrainState`` drawn from its own generator, its
own synthetic batch (a seeded CPU generator: the global RNG is not used), autograd for the
differentiation (``vjp="autograd"``, thread-local: it never imports
``torch._dynamo``, which another thread may be importing), the thread's own default stream. The
fit joins it before its first step, so no capture ever runs beside it.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import torch

__all__ = ["CudaWarmup", "start_cuda_warmup", "ENV"]

#: environment switch: ``YOLO_FUNC_CUDA_WARM=1`` turns the warm-up thread on (opt-in until the
#: start-up benchmark shows it shortening a fit on the GPU host)
ENV = "YOLO_FUNC_CUDA_WARM"


class CudaWarmup:
    """A running (or finished) warm-up thread; :meth:`join` waits for it.

    Attributes:
      seconds: the warm-up's own duration once finished (None before).
      error: the exception it raised, if any (a warm-up never fails the fit: the first real step
        then pays the set-up as it would have without it).
    """

    def __init__(self, target) -> None:
        self.seconds: float | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(target,), name="yolo_func-cuda-warm", daemon=True)
        self._thread.start()

    def _run(self, target) -> None:
        t = time.perf_counter()
        try:
            target()
        except BaseException as e:  # noqa: BLE001 -- only a head start
            self.error = e
        finally:
            self.seconds = time.perf_counter() - t

    def join(self) -> float:
        """Wait for the thread; returns the seconds spent waiting."""
        t = time.perf_counter()
        self._thread.join()
        return time.perf_counter() - t


def start_cuda_warmup(model: Any, tx: Any, *, device: torch.device, autocast_dtype: torch.dtype | None, ema: Any = None,
                      image_size: int = 64, batch_size: int = 2, enabled: bool | None = None) -> CudaWarmup | None:
    """Start one throw-away training step of ``model`` on a ``float[batch_size, 3, image_size,
    image_size]`` synthetic batch on a thread; None when off or not on CUDA.

    Args:
      model: the fit's :class:`~yolo_func.models.Model` (its structure; the warm-up draws its own
        parameters).
      tx: the fit's optimizer (a pure transformation; the warm-up initialises its own state).
      device: a CUDA device.
      autocast_dtype: the fit's training autocast dtype (None: float32).
      ema: the fit's EMA transformation, so that its update kernels load too.
      image_size, batch_size: the synthetic batch (small: only the kernels matter, not the shapes).
      enabled: default: on when the environment sets ``YOLO_FUNC_CUDA_WARM=1``.

    Example:
      >>> import torch
      >>> from yolo_func import yolov8
      >>> from yolo_func.optim import sgd
      >>> from yolo_func.train.cuda_warm import start_cuda_warmup
      >>> start_cuda_warmup(yolov8("n"), sgd(0.01), device=torch.device("cpu"), autocast_dtype=None) is None
      True
    """
    if enabled is None:
        enabled = os.environ.get(ENV, "0") == "1"
    if not enabled or device.type != "cuda":
        return None

    def run() -> None:
        from yolo_func.testing.synthetic import synthetic_batch
        from yolo_func.train.replay import ReplayTrainStep
        from yolo_func.train.step import init_train_state

        with torch.cuda.device(device):
            ts = init_train_state(model, tx, torch.Generator().manual_seed(0), device=device, ema=ema)
            kpt = None
            if "pose" in model.heads:
                from yolo_func.eval.evaluate import model_kpt_shape

                kpt = model_kpt_shape(model, ts.params)
            kw = {"kpt_shape": kpt} if kpt is not None else {}
            batch = synthetic_batch(model.task, batch_size, image_size, num_classes=model.num_classes, max_boxes=4,
                                    device=device, **kw)
            batch = batch._replace(images=(batch.images * 255).to(torch.uint8))
            # the fit's eager path (uint8 -> normalised NHWC images, autocast, the guard, the EMA)
            step = ReplayTrainStep(model, tx, ema=ema, capture="none", autocast_dtype=autocast_dtype, vjp="autograd")
            step(ts, batch)
            torch.cuda.current_stream(device).synchronize()

    return CudaWarmup(run)
