"""Hypothesis strategies for detection tests: generators, images, boxes and padded targets.

Every strategy is deterministic given hypothesis' draws: it draws a seed and samples with a CPU
``torch.Generator`` seeded from it (so large tensors cost one draw, and ``derandomize=True`` in the
``ci`` profile gives the same examples on every machine). Size arguments take an ``int`` or a
hypothesis strategy of ints.

Box coordinates are multiples of 1/16 px: exactly representable in float32 for images below 2**19 px,
so ``x1 + w`` never rounds past the image border and the invariants below hold exactly, and no
extreme floats (1e308, subnormals) appear.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import hypothesis.strategies as st
import torch

from yolo_func.structures import Targets

__all__ = ["generators", "images", "boxes_xyxy", "padded_targets"]

_PREFIX = "[yolo_func] "
_SEED = st.integers(0, 2**63 - 1)
#: Box coordinates are drawn on this sub-pixel grid (see the module docstring).
_GRID = 16

IntOrStrategy = int | st.SearchStrategy


def _draw_int(draw, name: str, value: IntOrStrategy, *, min_value: int = 0) -> int:
    v = draw(value) if isinstance(value, st.SearchStrategy) else value
    if not isinstance(v, int) or isinstance(v, bool) or v < min_value:
        raise ValueError(f"{_PREFIX}{name} must be an int >= {min_value} (or a strategy of them), got {v!r}")
    return v


def _draw_size(draw, image_size) -> tuple[int, int]:
    hw = draw(image_size) if isinstance(image_size, st.SearchStrategy) else image_size
    if not (isinstance(hw, Sequence) and len(hw) == 2 and all(isinstance(v, int) and v > 0 for v in hw)):
        raise ValueError(f"{_PREFIX}image_size must be (H, W) positive ints, got {hw!r}")
    if max(hw) >= 2**19:
        raise ValueError(f"{_PREFIX}image_size {hw} too large for exact float32 box coordinates (< 2**19)")
    return int(hw[0]), int(hw[1])


def generators() -> st.SearchStrategy[torch.Generator]:
    """Seeded CPU ``torch.Generator``s (a fresh one per draw; the seed is a hypothesis draw).

    Example:
      >>> import torch
      >>> from hypothesis import given, settings
      >>> from yolo_func.testing import generators
      >>> @settings(max_examples=3, database=None)
      ... @given(generators())
      ... def test(gen):
      ...     assert isinstance(gen, torch.Generator) and gen.device.type == "cpu"
      >>> test()
    """
    return _SEED.map(lambda s: torch.Generator().manual_seed(s))


@st.composite
def images(
    draw,
    batch: IntOrStrategy = st.integers(1, 2),
    height: IntOrStrategy = st.sampled_from([32, 64, 96]),
    width: IntOrStrategy = st.sampled_from([32, 64, 96]),
    channels: IntOrStrategy = 3,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Image batches ``float[B, C, H, W]`` with values in ``[0, 1)`` and H, W multiples of 32.

    Args:
      batch: ``B`` (int or strategy).
      height: ``H``, a positive multiple of 32 (int or strategy).
      width: ``W``, a positive multiple of 32 (int or strategy).
      channels: ``C`` (3 for RGB).
      dtype: floating dtype of the result.

    Raises:
      ValueError: a drawn ``H`` or ``W`` is not a positive multiple of 32 (YOLOv8's largest stride).

    Example:
      >>> from hypothesis import given, settings
      >>> from yolo_func.testing import images
      >>> @settings(max_examples=3, database=None)
      ... @given(images(batch=2, height=64, width=32))
      ... def test(x):                                        # float[B, 3, H, W] in [0, 1)
      ...     assert x.shape == (2, 3, 64, 32) and bool((x >= 0).all() and (x < 1).all())
      >>> test()
    """
    b = _draw_int(draw, "batch", batch, min_value=1)
    h = _draw_int(draw, "height", height, min_value=1)
    w = _draw_int(draw, "width", width, min_value=1)
    c = _draw_int(draw, "channels", channels, min_value=1)
    if h % 32 or w % 32:
        raise ValueError(f"{_PREFIX}images: height and width must be multiples of 32, got H={h}, W={w}")
    g = torch.Generator().manual_seed(draw(_SEED))
    return torch.rand(b, c, h, w, generator=g, dtype=dtype)


def _sample_boxes(
    g: torch.Generator, shape: tuple[int, ...], hw: tuple[int, int], min_size: float
) -> torch.Tensor:
    """float32[*shape, 4] xyxy boxes on the 1/16 px grid with min_size <= w <= W, inside [0, W] x [0, H]."""
    lo = math.ceil(min_size * _GRID)
    out = []
    for extent in (hw[1], hw[0]):  # x (width) then y (height)
        hi = extent * _GRID
        u_size, u_pos = torch.rand((2, *shape), generator=g, dtype=torch.float64)
        # Integer grid units: size in [lo, hi], start in [0, hi - size]; floor(u * n) < n since u < 1.
        size = lo + torch.floor(u_size * (hi - lo + 1))
        start = torch.floor(u_pos * (hi - size + 1))
        out.append((start, start + size))
    (x1, x2), (y1, y2) = out
    return (torch.stack([x1, y1, x2, y2], dim=-1) / _GRID).to(torch.float32)


def _check_min_size(min_size: float, hw: tuple[int, int]) -> None:
    if not (0 < min_size <= min(hw)):
        raise ValueError(f"{_PREFIX}min_size must be in (0, min(H, W)] = (0, {min(hw)}], got {min_size}")


@st.composite
def boxes_xyxy(
    draw,
    n: IntOrStrategy = st.integers(0, 8),
    image_size: tuple[int, int] | st.SearchStrategy = (640, 640),
    min_size: float = 1.0,
) -> torch.Tensor:
    """Boxes ``float32[n, 4]`` as ``(x1, y1, x2, y2)`` pixels inside an ``(H, W)`` image.

    Invariants (exact, no rounding slack): ``0 <= x1 < x2 <= W``, ``0 <= y1 < y2 <= H``,
    ``x2 - x1 >= min_size``, ``y2 - y1 >= min_size``; coordinates are multiples of 1/16.

    Args:
      n: number of boxes (int or strategy; 0 gives ``float32[0, 4]``).
      image_size: ``(H, W)`` in pixels, or a strategy of such tuples.
      min_size: smallest width and height in pixels, in ``(0, min(H, W)]``.

    Example:
      >>> from hypothesis import given, settings
      >>> from yolo_func.testing import boxes_xyxy
      >>> @settings(max_examples=5, database=None)
      ... @given(boxes_xyxy(n=3, image_size=(64, 64)))
      ... def test(boxes):                                    # float32[3, 4], x2 > x1, y2 > y1, inside the image
      ...     assert boxes.shape == (3, 4) and bool((boxes[:, 2:] > boxes[:, :2]).all()) and bool((boxes <= 64).all())
      >>> test()
    """
    k = _draw_int(draw, "n", n)
    hw = _draw_size(draw, image_size)
    _check_min_size(min_size, hw)
    g = torch.Generator().manual_seed(draw(_SEED))
    return _sample_boxes(g, (k,), hw, min_size)


@st.composite
def padded_targets(
    draw,
    batch: IntOrStrategy = 2,
    max_boxes: IntOrStrategy = 8,
    num_classes: IntOrStrategy = 80,
    image_size: tuple[int, int] | st.SearchStrategy = (640, 640),
    keypoints: int | None = None,
    counts: Sequence[int] | st.SearchStrategy | None = None,
    min_size: float = 1.0,
) -> Targets:
    """Padded ground truth :class:`yolo_func._types.Targets` with random valid counts per image.

    Valid rows come first in each image (rows ``0 .. count-1``); padding rows have zero boxes, class 0,
    ``valid=False`` and zero keypoints. Counts include zero (empty images, detectron2's empty-GT case):
    by default each image's count is drawn from ``0..M``.

    Args:
      batch: ``B`` (int or strategy).
      max_boxes: ``M``, the padded number of rows per image (int or strategy; may be 0).
      num_classes: ``K``; classes are drawn from ``0..K-1`` (``nc`` in the reference).
      image_size: ``(H, W)`` pixels (or a strategy), the frame boxes and keypoints live in.
      keypoints: ``P`` keypoints per target, or None for no keypoints.
      counts: valid rows per image: a sequence of ``B`` ints, a strategy of ints drawn per image (use
        ``st.just(0)`` to force empty images), or None for ``st.integers(0, M)``.
      min_size: smallest box width/height in pixels.

    Returns:
      ``Targets(boxes float32[B, M, 4] xyxy px, classes int64[B, M], valid bool[B, M],
      masks=None, keypoints float32[B, M, P, 3] or None)``. Keypoints lie inside their box; visibility
      is in ``{0, 1, 2}`` and, following COCO, ``x = y = 0`` where visibility is 0.

    Raises:
      ValueError: counts outside ``0..M`` or of the wrong length, bad sizes.

    Example:
      >>> from hypothesis import given, settings
      >>> from yolo_func.testing import padded_targets
      >>> @settings(max_examples=3, database=None)
      ... @given(padded_targets(batch=2, max_boxes=4, num_classes=5, image_size=(64, 64)))
      ... def test(t):                                        # Targets: boxes float[2, 4, 4], classes int64[2, 4], valid bool[2, 4]
      ...     assert t.boxes.shape == (2, 4, 4) and int(t.classes.max()) < 5
      >>> test()
    """
    b = _draw_int(draw, "batch", batch, min_value=1)
    m = _draw_int(draw, "max_boxes", max_boxes)
    k = _draw_int(draw, "num_classes", num_classes, min_value=1)
    hw = _draw_size(draw, image_size)
    _check_min_size(min_size, hw)
    if keypoints is not None and (not isinstance(keypoints, int) or keypoints < 1):
        raise ValueError(f"{_PREFIX}keypoints must be None or an int >= 1, got {keypoints!r}")
    if counts is None:
        per_image = [draw(st.integers(0, m)) for _ in range(b)]
    elif isinstance(counts, st.SearchStrategy):
        per_image = [draw(counts) for _ in range(b)]
    else:
        per_image = list(counts)
        if len(per_image) != b:
            raise ValueError(f"{_PREFIX}counts has {len(per_image)} entries, expected batch={b}")
    if any(not isinstance(c, int) or not 0 <= c <= m for c in per_image):
        raise ValueError(f"{_PREFIX}counts must be ints in 0..max_boxes={m}, got {per_image}")

    g = torch.Generator().manual_seed(draw(_SEED))
    valid = torch.arange(m).unsqueeze(0) < torch.tensor(per_image, dtype=torch.int64).unsqueeze(1)  # [B, M]
    boxes = torch.where(valid.unsqueeze(-1), _sample_boxes(g, (b, m), hw, min_size), 0.0)
    classes = torch.where(valid, torch.randint(0, k, (b, m), generator=g), 0)
    kpts = None
    if keypoints is not None:
        u = torch.rand(b, m, keypoints, 2, generator=g)
        lo, hi = boxes[..., None, :2], boxes[..., None, 2:]  # [B, M, 1, 2]
        xy = lo + u * (hi - lo)  # inside the box (convex combination; hi <= image size)
        xy = torch.minimum(torch.maximum(xy, lo), hi)  # guard float rounding at the edges
        vis = torch.randint(0, 3, (b, m, keypoints, 1), generator=g).to(torch.float32)
        vis = torch.where(valid[..., None, None], vis, 0.0)
        xy = torch.where(vis > 0, xy, 0.0)
        kpts = torch.cat([xy, vis], dim=-1)
    return Targets(boxes=boxes, classes=classes, valid=valid, keypoints=kpts)
