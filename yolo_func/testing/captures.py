"""``assert_max_captures``: the CUDA-graph analogue of chex's ``assert_max_traces``.

A replayed step that silently re-captures (or falls back and captures nothing) can still pass a
numeric comparison; counting captures makes such a test fail for the right reason. The count is
:func:`yolo_func.capture.num_captures`, which every capture function advances once per recorded
capture (:func:`yolo_func.capture.count_capture`).

Example:
  >>> from yolo_func.capture import count_capture
  >>> with assert_max_captures(n=2) as made:
  ...     _ = count_capture(), count_capture()   # two captures (stand-ins for capture_vjp calls)
  >>> made.count
  2
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from yolo_func.capture.counter import num_captures

__all__ = ["CaptureCount", "assert_max_captures"]


class CaptureCount:
    """The captures made since a block began (live while inside it, final after it).

    Attributes:
      start: :func:`yolo_func.capture.num_captures` when the block began.

    Example:
      >>> from yolo_func.testing import assert_max_captures
      >>> with assert_max_captures(1) as c:
      ...     pass                                            # no CUDA graph captured here
      >>> c.count, c
      (0, CaptureCount(0))
    """

    def __init__(self, start: int):
        self.start = start
        self._end: int | None = None

    @property
    def count(self) -> int:
        """Captures made inside the block so far (all of them once it has ended)."""
        return (num_captures() if self._end is None else self._end) - self.start

    def __repr__(self) -> str:
        return f"CaptureCount({self.count})"


@contextlib.contextmanager
def assert_max_captures(n: int) -> Iterator[CaptureCount]:
    """Fail if more than ``n`` CUDA-graph captures happen inside the block.

    Args:
      n: the most captures allowed (an int >= 0). Use ``made.count == n`` on the yielded
        :class:`CaptureCount` after the block to require exactly ``n``.

    Yields:
      :class:`CaptureCount`.

    Raises:
      AssertionError: more than ``n`` captures happened (``[yolo_func] ...``, with the count). The
        block's own exception, if any, propagates unchanged instead.
      ValueError: ``n`` is not an int >= 0.

    Example:
      >>> from yolo_func.testing import assert_max_captures
      >>> with assert_max_captures(0) as c:                  # fails at the end of the block past 0 captures
      ...     pass
      >>> c.count
      0
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"[yolo_func] assert_max_captures: n must be an int >= 0, got {n!r}")
    made = CaptureCount(num_captures())
    try:
        yield made
    finally:
        made._end = num_captures()
    if made.count > n:
        raise AssertionError(
            f"[yolo_func] assert_max_captures: {made.count} CUDA-graph captures happened inside the block, "
            f"at most {n} expected (a step re-captured: a changing input shape, dtype or layout, or a cache "
            f"that does not hold the capture)"
        )
