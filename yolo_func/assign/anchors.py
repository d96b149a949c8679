"""Anchor points and strides over the detection levels (REFERENCE.md §1.5)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from yolo_func._types import Anchors

__all__ = ["make_anchors", "anchors_for_feats"]


def make_anchors(
    sizes: Sequence[tuple[int, int]],
    strides: Sequence[int],
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
    offset: float = 0.5,
) -> Anchors:
    """Anchor points at cell centres, level-major then row-major (y outer, x inner).

    Args:
      sizes: ``[(H_l, W_l), ...]`` feature sizes per level (Python ints: no host sync).
      strides: stride in pixels per level, e.g. ``(8, 16, 32)``.
      device, dtype: placement of the outputs.
      offset: cell-centre offset (0.5).

    Returns:
      ``Anchors(points float[A, 2] grid units, strides float[A, 1])`` with ``A = sum(H_l * W_l)``.

    Raises:
      ValueError: ``sizes`` and ``strides`` differ in length, or a size is not positive.

    Example:
      >>> import torch
      >>> from yolo_func.assign import make_anchors
      >>> a = make_anchors([(2, 2), (1, 1)], (8, 16))
      >>> a.points.tolist(), a.strides.flatten().tolist()
      ([[0.5, 0.5], [1.5, 0.5], [0.5, 1.5], [1.5, 1.5], [0.5, 0.5]], [8.0, 8.0, 8.0, 8.0, 16.0])
    """
    if len(sizes) != len(strides):
        raise ValueError(f"[yolo_func] make_anchors: {len(sizes)} sizes but {len(strides)} strides")
    # One integer index per anchor and level; column = i % W, row = i // W (row-major), then a single
    # cast + offset over all levels: 4 ops a level + 5, where a meshgrid per level took 11 (the
    # training step builds the anchors every step). Same values as ``arange(W, dtype) + offset`` on a
    # meshgrid: both are ``cast(integer) + offset`` in ``dtype``.
    cols_rows, stride_list = [], []
    for (h, w), s in zip(sizes, strides):
        if h <= 0 or w <= 0:
            raise ValueError(f"[yolo_func] make_anchors: level size must be positive, got {(h, w)}")
        i = torch.arange(h * w, device=device)
        cols_rows.append(torch.stack((i % w, torch.div(i, w, rounding_mode="floor")), -1))
        stride_list.append(torch.full((h * w, 1), float(s), device=device, dtype=dtype))
    points = torch.cat(cols_rows).to(dtype) + offset
    return Anchors(points, torch.cat(stride_list))


def anchors_for_feats(feats: Sequence[torch.Tensor], strides: Sequence[int]) -> Anchors:
    """:func:`make_anchors` for a sequence of ``float[B, C, H_l, W_l]`` feature maps (their device
    and dtype).

    The result is memoised per (sizes, strides, device, dtype, inference mode): a training step
    reads the anchors of the same shapes every step, and building them is 19 small ops. The
    returned tensors are shared constants: never write them in place. Built afresh (not memoised)
    inside ``torch.compile``, during a CUDA graph capture and for fake / meta / wrapped tensors.

    Example:
      >>> import torch
      >>> from yolo_func.assign import anchors_for_feats
      >>> a = anchors_for_feats([torch.rand(1, 64, 8, 8), torch.rand(1, 128, 4, 4), torch.rand(1, 256, 2, 2)], (8, 16, 32))
      >>> a.points.shape, a.points.dtype
      (torch.Size([84, 2]), torch.float32)
    """
    sizes = [(int(f.shape[-2]), int(f.shape[-1])) for f in feats]
    device, dtype = feats[0].device, feats[0].dtype
    if not _memo_allowed(feats[0]):
        return make_anchors(sizes, strides, device=device, dtype=dtype)
    key = (tuple(sizes), tuple(int(s) for s in strides), device, dtype, torch.is_inference_mode_enabled())
    hit = _MEMO.get(key)
    if hit is None:
        hit = make_anchors(sizes, strides, device=device, dtype=dtype)
        if len(_MEMO) >= _MEMO_SIZE:
            _MEMO.pop(next(iter(_MEMO)))  # oldest first
        _MEMO[key] = hit
    return hit


# (sizes, strides, device, dtype, inference mode) -> Anchors. The training step needs the anchors of
# the same shapes every step: built once, 19 ops a step fewer. The entries are constants that no
# caller writes. Never filled or read while a CUDA graph is being captured (a graph then allocates
# its own, as before, so no graph ever reads an entry that could be evicted), nor while tracing
# (torch.compile, fake or meta tensors). Inference-mode tensors are kept apart (they cannot enter
# autograd outside inference mode).
_MEMO: dict = {}
_MEMO_SIZE = 8
_MEMO_ENABLED = True  # tests switch it off to compare with fresh anchors


def _memo_allowed(x: torch.Tensor) -> bool:
    if not _MEMO_ENABLED or torch.compiler.is_compiling() or x.device.type == "meta":
        return False
    if type(x) is not torch.Tensor and not isinstance(x, torch.nn.Parameter):  # fake / functorch wrappers
        return False
    return not (x.device.type == "cuda" and torch.cuda.is_current_stream_capturing())
