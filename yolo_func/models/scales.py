"""YOLOv8 scale table and the channel / repeat arithmetic (REFERENCE.md §1.1-1.2)."""

from __future__ import annotations

import math
from typing import NamedTuple

__all__ = ["Scale", "SCALES", "get_scale", "channels", "repeats"]


class Scale(NamedTuple):
    """Depth multiple, width multiple and channel cap of one YOLOv8 scale.

    Example:
      >>> from yolo_func.models import get_scale
      >>> get_scale("n")
      Scale(name='n', depth=0.33, width=0.25, max_channels=1024)
    """

    name: str
    depth: float
    width: float
    max_channels: int


SCALES: dict[str, Scale] = {
    "n": Scale("n", 0.33, 0.25, 1024),
    "s": Scale("s", 0.33, 0.50, 1024),
    "m": Scale("m", 0.67, 0.75, 768),
    "l": Scale("l", 1.00, 1.00, 512),
    "x": Scale("x", 1.00, 1.25, 512),
}


def get_scale(scale: str | Scale) -> Scale:
    """Look up a scale by name.

    Raises:
      ValueError: unknown name (lists the known ones).

    Example:
      >>> from yolo_func.models import get_scale
      >>> get_scale("s").width, get_scale(get_scale("x")).name
      (0.5, 'x')
    """
    if isinstance(scale, Scale):
        return scale
    if not isinstance(scale, str) or scale not in SCALES:
        raise ValueError(f"[yolo_func] unknown scale {scale!r}; expected one of {sorted(SCALES)}")
    return SCALES[scale]


def channels(c_yaml: int, scale: Scale) -> int:
    """``ceil(min(c, max_channels) * width / 8) * 8`` (make-divisible by 8, rounding up).

    Example:
      >>> from yolo_func.models import channels, get_scale
      >>> channels(1024, get_scale("n")), channels(1024, get_scale("x"))
      (256, 640)
    """
    return int(math.ceil(min(c_yaml, scale.max_channels) * scale.width / 8) * 8)


def repeats(n_yaml: int, scale: Scale) -> int:
    """``max(round(n * depth), 1)`` for ``n > 1`` (Python round, half to even), else ``n``.

    Example:
      >>> from yolo_func.models import get_scale, repeats
      >>> repeats(6, get_scale("n")), repeats(6, get_scale("x")), repeats(1, get_scale("n"))
      (2, 6, 1)
    """
    return max(round(n_yaml * scale.depth), 1) if n_yaml > 1 else n_yaml
