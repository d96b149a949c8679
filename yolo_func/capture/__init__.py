"""CUDA-graph capture of pure functions, of their ``torch.func.vjp`` and of whole pure steps.

Modules (one owner each): :mod:`~yolo_func.capture.signature` (what a capture depends on, the
errors), :mod:`~yolo_func.capture.binder` (static input buffers and the copy-in),
:mod:`~yolo_func.capture.vjp` (:func:`capture_vjp`: a forward and its pullback as two graphs),
:mod:`~yolo_func.capture.whole_step` (:func:`capture_step`: a whole step as one graph),
:mod:`~yolo_func.capture.cache` (:class:`CaptureCache`, bounded by key),
:mod:`~yolo_func.capture.counter` (:func:`num_captures`).

This package knows only "a function of (params, state, x) returning a tuple of tensors": it imports
:mod:`yolo_func.tree` and :mod:`yolo_func.func`, never the layers (a caller that wants BatchNorm
statistics written in place passes ``forward_context=yolo_func.nn.update_stats_in_place``).
"""

from yolo_func.capture.cache import CaptureCache
from yolo_func.capture.counter import count_capture, num_captures
from yolo_func.capture.signature import (
    CaptureCacheFull,
    CaptureMismatch,
    CaptureSignature,
    CaptureUnavailable,
    TensorSpec,
    memory_format_of,
    signature_of,
)
from yolo_func.capture.vjp import Captured, CaptureStats, StaticBuffers, capture_vjp
from yolo_func.capture.whole_step import CapturedStep, StepBuffers, StepStats, capture_step

__all__ = [
    "capture_vjp",
    "capture_step",
    "CapturedStep",
    "StepBuffers",
    "StepStats",
    "Captured",
    "CaptureCache",
    "CaptureCacheFull",
    "CaptureMismatch",
    "CaptureSignature",
    "CaptureStats",
    "CaptureUnavailable",
    "StaticBuffers",
    "TensorSpec",
    "count_capture",
    "memory_format_of",
    "num_captures",
    "signature_of",
]
