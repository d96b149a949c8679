"""The process-wide count of CUDA-graph captures (for "captured once" asserts).

Every capture function of this package (:func:`yolo_func.capture.capture_vjp`,
:func:`yolo_func.capture.capture_step`) calls :func:`count_capture` once after it recorded its
graphs; :func:`num_captures` reads the total. :func:`yolo_func.testing.assert_max_captures` is built
on it.

Example:
  >>> before = num_captures()
  >>> index = count_capture()   # what a capture function does once its graphs are recorded
  >>> num_captures() - before, index == num_captures()
  (1, True)
"""

from __future__ import annotations

import threading

__all__ = ["count_capture", "num_captures"]

_lock = threading.Lock()
_count = 0


def num_captures() -> int:
    """How many captures (:func:`~yolo_func.capture.capture_vjp` and
    :func:`~yolo_func.capture.capture_step` calls that recorded their graphs) completed in this
    process. A capture that failed or was refused (e.g. :class:`~yolo_func.capture.CaptureUnavailable`)
    does not count.

    Example:
      >>> from yolo_func.capture import num_captures
      >>> isinstance(num_captures(), int)                  # testing.assert_max_captures reads it
      True
    """
    return _count


def count_capture() -> int:
    """Record one completed capture; returns its process-wide index (1, 2, ...).

    Capture functions call this once their graphs are recorded; a stand-in capture in a test may
    call it to simulate one.

    Example:
      >>> from yolo_func.capture import count_capture, num_captures
      >>> before = num_captures()
      >>> count_capture() == before + 1, num_captures() == before + 1    # what the capture functions call
      (True, True)
    """
    global _count
    with _lock:
        _count += 1
        return _count
