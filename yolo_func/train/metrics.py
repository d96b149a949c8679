"""Host-side reading of the device metrics a training step returns (the only place that syncs)."""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping

import torch

__all__ = ["NonFiniteLossWarning", "fetch_metrics", "MetricsReader"]


class NonFiniteLossWarning(RuntimeWarning):
    """A step saw a non-finite loss or gradient and was skipped (see :mod:`yolo_func.train.step`)."""


def fetch_metrics(metrics: Mapping[str, torch.Tensor], *, warn: bool = True) -> dict[str, float]:
    """Copy a step's device metrics to Python floats (one host sync), and report a skipped step.

    When ``metrics["finite"]`` is False, a :class:`NonFiniteLossWarning` names the step and every
    loss part that was not finite (or says the gradients were the culprit), e.g.
    ``step 41: non-finite loss/segment/seg=nan; the step was skipped (params, optimizer state,
    BN statistics and EMA unchanged)``.

    Returns:
      ``{name: float}``.
    """
    names, values = _stacked(metrics)  # one stack on the device, one copy to the host
    return _checked(dict(zip(names, values.cpu().tolist())), warn)


def _stacked(metrics: Mapping[str, torch.Tensor]) -> tuple[list[str], torch.Tensor]:
    """The names and the float64[len(metrics)] stack of scalar tensors ``metrics`` (one device)."""
    names = list(metrics)
    return names, torch.stack([metrics[k].detach().double().reshape(()) for k in names])


def _checked(out: dict[str, float], warn: bool) -> dict[str, float]:
    names = list(out)
    if warn and "finite" in out and not out["finite"]:
        bad = [f"{k}={out[k]}" for k in names if k.startswith("loss") and not math.isfinite(out[k])]
        what = ", ".join(bad) if bad else f"gradients (grad_norm={out.get('grad_norm')})"
        step = int(out["step"]) if "step" in out else "?"
        warnings.warn(
            f"[yolo_func] step {step}: non-finite {what}; the step was skipped "
            "(params, optimizer state, BN statistics and EMA unchanged)",
            NonFiniteLossWarning,
            stacklevel=3,
        )
    return out


class MetricsReader:
    """The progress bar's view of a step's device metrics, without waiting for the device.

    :func:`fetch_metrics` copies to the host with a blocking ``.cpu()``: the host waits for every
    queued kernel, and the GPU then idles until the host has queued the next step. Here
    :meth:`post` queues a ``non_blocking`` copy into pinned host memory and records a CUDA event;
    :meth:`poll` takes the values of the last posted copy once its event has completed (or waits
    for it with ``wait=True``, e.g. at the end of an epoch). Called at a log step before the next
    :meth:`post`, the bar shows the metrics of the previous log step (``log_every`` steps late),
    read without a sync. A posted copy not yet landed at the next :meth:`post` is dropped (the
    pinned block stays reserved by PyTorch's host allocator until the copy is done). On the CPU
    the values are read at once (no device to wait for). A step that was skipped (non-finite) is
    reported as :func:`fetch_metrics` does, when its values are read.

    Example:
      >>> import torch
      >>> from yolo_func.train.metrics import MetricsReader
      >>> reader = MetricsReader()
      >>> reader.post({"loss": torch.tensor(0.5), "finite": torch.tensor(True)})
      >>> reader.poll(wait=True)
      {'loss': 0.5, 'finite': 1.0}
      >>> reader.poll() == reader.latest                    # nothing new posted: the last values
      True
    """

    def __init__(self, *, warn: bool = True) -> None:
        self.warn = warn
        self.latest: dict[str, float] | None = None  # the newest values read
        self._pending: tuple[list[str], torch.Tensor, object] | None = None

    def post(self, metrics: Mapping[str, torch.Tensor]) -> None:
        """Queue the host copy of ``metrics`` (scalar tensors, one device); replaces a copy not yet read."""
        names, values = _stacked(metrics)
        if values.is_cuda:
            host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            host.copy_(values, non_blocking=True)
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(values.device))
            self._pending = (names, host, event)
        else:
            self._pending = (names, values, None)

    def poll(self, *, wait: bool = False) -> dict[str, float] | None:
        """The newest values whose copy has landed (``wait``: the last posted, waited for), or
        the previous ones (None before any)."""
        if self._pending is not None:
            names, host, event = self._pending
            if event is not None and not wait and not event.query():
                return self.latest
            if event is not None:
                event.synchronize()
            self._pending = None
            self.latest = _checked(dict(zip(names, host.tolist())), self.warn)
        return self.latest
