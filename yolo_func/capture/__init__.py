"""CUDA-graph capture of pure functions and their ``torch.func.vjp`` (:mod:`yolo_func.capture.cuda_graph`)
and of whole pure steps (:mod:`yolo_func.capture.whole_step`)."""

from yolo_func.capture.cuda_graph import (
    CaptureCache,
    CaptureCacheFull,
    Captured,
    CaptureMismatch,
    CaptureSignature,
    CaptureStats,
    CaptureUnavailable,
    StaticBuffers,
    TensorSpec,
    capture_vjp,
    memory_format_of,
    num_captures,
    signature_of,
)
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
    "memory_format_of",
    "num_captures",
    "signature_of",
]
