"""Instance masks from prototypes and coefficients (REFERENCE.md §3.3) and their letterbox undo.

Three assembly methods, as in the reference:

- ``"val"``: logits at prototype resolution, boxes scaled to it, binarised (logit > 0), cropped
  with the integer-index rule of §2.6 (a pixel at column c, row r survives iff x1 <= c < x2 and
  y1 <= r < y2). Cheap; what validation uses.
- ``"predict"``: logits upsampled bilinearly (align_corners False) to the network input size,
  binarised, cropped by the input-size boxes.
- ``"native"``: logits upsampled to the input size, the letterbox padding removed, resized to
  the original image, binarised, cropped by the original-image boxes (what the COCO JSON uses).

Binarisation ``logit > 0`` is ``sigmoid > 0.5``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = [
    "MASK_METHODS",
    "mask_logits",
    "crop_masks",
    "masks_val",
    "masks_predict",
    "masks_native",
    "masks_native_from_logits",
    "unpad_region",
    "gains",
    "rescale_masks",
]

MASK_METHODS = ("val", "predict", "native")


def mask_logits(protos: torch.Tensor, coeffs: torch.Tensor) -> torch.Tensor:
    """Linear combination of the prototypes.

    Args:
      protos: float[NM, Hp, Wp] (or float[B, NM, Hp, Wp]).
      coeffs: float[N, NM] (or float[B, N, NM]).

    Returns:
      float[N, Hp, Wp] (or float[B, N, Hp, Wp]) logits, float32 at least.
    """
    if protos.dim() not in (3, 4) or coeffs.dim() != protos.dim() - 1 or coeffs.shape[-1] != protos.shape[-3]:
        raise ValueError(
            f"[yolo_func] mask_logits: expected protos float[(B,) NM, Hp, Wp] and coeffs float[(B,) N, NM], "
            f"got {tuple(protos.shape)} and {tuple(coeffs.shape)}"
        )
    dtype = torch.promote_types(protos.dtype, torch.float32)
    nm, hp, wp = protos.shape[-3:]
    flat = protos.to(dtype).reshape(*protos.shape[:-3], nm, hp * wp)
    return (coeffs.to(dtype) @ flat).reshape(*coeffs.shape[:-1], hp, wp)


def crop_masks(masks: torch.Tensor, boxes: torch.Tensor) -> torch.Tensor:
    """Zero (False) every pixel outside its box, integer-index rule ``x1 <= c < x2, y1 <= r < y2``.

    Args:
      masks: bool or float[..., N, h, w].
      boxes: float[..., N, 4] xyxy in the masks' pixel units.

    Returns:
      Same shape and dtype as ``masks``.
    """
    h, w = masks.shape[-2:]
    cols = torch.arange(w, device=masks.device, dtype=boxes.dtype)
    rows = torch.arange(h, device=masks.device, dtype=boxes.dtype)
    x1, y1, x2, y2 = (boxes[..., i, None] for i in range(4))
    inside_x = (cols >= x1) & (cols < x2)  # [..., N, w]
    inside_y = (rows >= y1) & (rows < y2)  # [..., N, h]
    if masks.dtype == torch.bool:  # two broadcast ANDs, no [..., N, h, w] `inside` (3x faster on the CPU)
        out = masks & inside_y[..., :, None]
        return out.logical_and_(inside_x[..., None, :])
    inside = inside_y[..., :, None] & inside_x[..., None, :]
    return torch.where(inside, masks, torch.zeros((), dtype=masks.dtype, device=masks.device))


def _scale_boxes(boxes: torch.Tensor, sx: float, sy: float) -> torch.Tensor:
    # Python scalars only (no host-to-device copy: this runs inside CUDA-graph captures).
    x1, y1, x2, y2 = boxes.unbind(-1)
    return torch.stack((x1 * sx, y1 * sy, x2 * sx, y2 * sy), -1)


def masks_val(protos: torch.Tensor, coeffs: torch.Tensor, boxes: torch.Tensor, input_shape: tuple[int, int]) -> torch.Tensor:
    """Masks at prototype resolution (the validation fast path).

    Args:
      protos: float[NM, Hp, Wp] (or batched float[B, NM, Hp, Wp]).
      coeffs: float[N, NM] (or float[B, N, NM]).
      boxes: float[N, 4] (or float[B, N, 4]) xyxy in input pixels.
      input_shape: (H, W) of the network input.

    Returns:
      bool[N, Hp, Wp] (or bool[B, N, Hp, Wp]).
    """
    hp, wp = protos.shape[-2:]
    logits = mask_logits(protos, coeffs)
    small = _scale_boxes(boxes.to(logits.dtype), wp / input_shape[1], hp / input_shape[0])
    return crop_masks(logits > 0, small)


def masks_predict(protos: torch.Tensor, coeffs: torch.Tensor, boxes: torch.Tensor, input_shape: tuple[int, int]) -> torch.Tensor:
    """Masks at the network input size (the predict path with retina masks off).

    Args:
      protos: float[NM, Hp, Wp].
      coeffs: float[N, NM].
      boxes: float[N, 4] xyxy in input pixels.
      input_shape: (H, W).

    Returns:
      bool[N, H, W].
    """
    logits = mask_logits(protos, coeffs)
    if logits.shape[0] == 0:
        return torch.zeros(0, *input_shape, dtype=torch.bool, device=logits.device)
    up = F.interpolate(logits[None], size=tuple(input_shape), mode="bilinear", align_corners=False)[0]
    return crop_masks(up > 0, boxes.to(up.dtype))


def gains(gain: float | tuple[float, float]) -> tuple[float, float]:
    """``(gain_y, gain_x)`` from a single gain or the reference's per-axis ``ratio_pad[0]`` pair.

    Raises:
      ValueError: not a positive number or a pair of positive numbers.
    """
    gy, gx = (gain, gain) if isinstance(gain, (int, float)) else tuple(gain)
    if not (gy > 0 and gx > 0):
        raise ValueError(f"[yolo_func] gain must be > 0 or a pair (gain_y, gain_x) of positive numbers, got {gain!r}")
    return float(gy), float(gx)


def unpad_region(
    mask_shape: tuple[int, int],
    input_shape: tuple[int, int],
    orig_shape: tuple[int, int],
    gain: float | tuple[float, float],
    pad: tuple[float, float],
) -> tuple[int, int, int, int]:
    """Rows and columns of a mask (covering the letterboxed input) that hold the image content.

    The content starts at ``pad`` and spans ``orig * gain`` input pixels; in mask pixels the edges
    are rounded inwards by 0.1 as the reference does (``top = round(pad_top - 0.1)``,
    ``bottom = h - round(pad_bottom + 0.1)``, Python rounding).

    Args:
      mask_shape: (h, w) of the mask.
      input_shape: (H, W) of the network input the mask covers.
      orig_shape: (h0, w0) of the original image.
      gain: input pixels per original pixel, or (gain_y, gain_x).
      pad: (left, top) letterbox padding in input pixels.

    Returns:
      ``(top, bottom, left, right)`` slice bounds.
    """
    gy, gx = gains(gain)
    h, w = mask_shape
    sy, sx = h / input_shape[0], w / input_shape[1]
    top, left = pad[1] * sy, pad[0] * sx
    pad_bottom = h - (pad[1] + orig_shape[0] * gy) * sy
    pad_right = w - (pad[0] + orig_shape[1] * gx) * sx
    t, l = int(round(top - 0.1)), int(round(left - 0.1))
    b, r = h - int(round(pad_bottom + 0.1)), w - int(round(pad_right + 0.1))
    return max(t, 0), min(max(b, t + 1), h), max(l, 0), min(max(r, l + 1), w)


def masks_native(
    protos: torch.Tensor,
    coeffs: torch.Tensor,
    boxes_orig: torch.Tensor,
    *,
    input_shape: tuple[int, int],
    orig_shape: tuple[int, int],
    gain: float | tuple[float, float],
    pad: tuple[float, float],
) -> torch.Tensor:
    """Masks at the original image size (the COCO-JSON path).

    Args:
      protos: float[NM, Hp, Wp].
      coeffs: float[N, NM].
      boxes_orig: float[N, 4] xyxy in original-image pixels.
      input_shape: (H, W) of the letterboxed network input.
      orig_shape: (h0, w0) of the original image.
      gain: input pixels per original pixel, or (gain_y, gain_x).
      pad: (left, top) padding in input pixels.

    Returns:
      bool[N, h0, w0].
    """
    return masks_native_from_logits(mask_logits(protos, coeffs), boxes_orig, input_shape=input_shape,
                                    orig_shape=orig_shape, gain=gain, pad=pad)


def masks_native_from_logits(
    logits: torch.Tensor,
    boxes_orig: torch.Tensor,
    *,
    input_shape: tuple[int, int],
    orig_shape: tuple[int, int],
    gain: float | tuple[float, float],
    pad: tuple[float, float],
) -> torch.Tensor:
    """:func:`masks_native` from the prototype-resolution logits (:func:`mask_logits`' output): each
    row's mask depends on its own logits only, so rows can be picked before this (bitwise the same
    masks as :func:`masks_native` of every row, then picked).

    Args:
      logits: float[N, Hp, Wp].
      boxes_orig, input_shape, orig_shape, gain, pad: as in :func:`masks_native`.

    Returns:
      bool[N, h0, w0].

    Example:
      >>> logits = torch.ones(1, 4, 4)                 # a 16x16 input, 4x4 prototypes
      >>> m = masks_native_from_logits(logits, torch.tensor([[0.0, 0.0, 4.0, 8.0]]), input_shape=(16, 16),
      ...                              orig_shape=(8, 8), gain=2.0, pad=(0.0, 0.0))
      >>> m.shape, int(m.sum())                        # the box's 4 x 8 pixels
      (torch.Size([1, 8, 8]), 32)
    """
    if logits.shape[0] == 0:
        return torch.zeros(0, *orig_shape, dtype=torch.bool, device=logits.device)
    # Two bilinear steps, proto -> input size -> (padding removed) original size: this equals the
    # reference exactly whenever the padding is a whole number of prototype pixels, and differs in
    # ~0.1% of pixels otherwise (docs/evaluation.md).
    up = F.interpolate(logits[None], size=tuple(input_shape), mode="bilinear", align_corners=False)
    t, b, l, r = unpad_region(tuple(input_shape), input_shape, orig_shape, gain, pad)
    up = F.interpolate(up[:, :, t:b, l:r], size=tuple(orig_shape), mode="bilinear", align_corners=False)[0]
    return crop_masks(up > 0, boxes_orig.to(up.dtype))


def rescale_masks(
    masks: torch.Tensor,
    *,
    input_shape: tuple[int, int],
    orig_shape: tuple[int, int],
    gain: float | tuple[float, float],
    pad: tuple[float, float],
) -> torch.Tensor:
    """Binary masks covering the letterboxed input, back to the original image: padding cropped,
    bilinear resize (align_corners False) of the 0/1 values, threshold > 0.5.

    Args:
      masks: bool[N, h, w] covering the whole network input (any resolution).
      input_shape: (H, W) of the network input.
      orig_shape: (h0, w0).
      gain, pad: the letterbox (see :func:`unpad_region`).

    Returns:
      bool[N, h0, w0].
    """
    if masks.shape[0] == 0:
        return torch.zeros(0, *orig_shape, dtype=torch.bool, device=masks.device)
    t, b, l, r = unpad_region(tuple(masks.shape[-2:]), input_shape, orig_shape, gain, pad)
    crop = masks[None, :, t:b, l:r].float()
    return F.interpolate(crop, size=tuple(orig_shape), mode="bilinear", align_corners=False)[0] > 0.5
