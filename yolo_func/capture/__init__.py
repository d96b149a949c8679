"""CUDA-graph capture of pure functions and their ``torch.func.vjp`` (see :mod:`yolo_func.capture.cuda_graph`)."""

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

__all__ = [
    "capture_vjp",
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
