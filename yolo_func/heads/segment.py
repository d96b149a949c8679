"""The YOLOv8 segment head: prototypes from P3 and per-anchor mask coefficients (REFERENCE.md §1.7).

It owns only the reference's ``proto`` and ``cv4``; boxes and classes come from the detect head
that a segmentation model carries beside it. Tree keys: ``proto/{cv1,upsample,cv2,cv3}`` and
``coeff/{p3,p4,p5}/{conv1,conv2,pred}``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from yolo_func._types import Anchors, Feats, SegmentPreds
from yolo_func.heads.base import Head, flatten_levels, multi_level
from yolo_func.losses.heads import segment_loss
from yolo_func.nn import Layer, conv_bn_act, conv_transpose2d

__all__ = ["segment_head", "proto"]


def proto(c_in: int, c_mid: int, num_masks: int) -> Layer:
    """Mask prototypes: ``Conv(c_in, c_mid, 3) -> ConvTranspose2d(c_mid, c_mid, 2, 2, bias) ->
    Conv(c_mid, c_mid, 3) -> Conv(c_mid, num_masks, 1)`` (all Conv blocks with BN + SiLU, so the
    output is post-SiLU).

    Apply: ``float[B, c_in, H, W] -> float[B, num_masks, 2H, 2W]``.

    Example:
      >>> import torch
      >>> from yolo_func.heads import proto
      >>> pr = proto(64, 64, 32)
      >>> p, s = pr.init(torch.Generator().manual_seed(0))
      >>> y, _ = pr.apply(p, s, torch.rand(1, 64, 8, 8), train=False)
      >>> tuple(y.shape)
      (1, 32, 16, 16)
    """
    layers = {
        "cv1": conv_bn_act(c_in, c_mid, 3),
        "upsample": conv_transpose2d(c_mid, c_mid, 2, 2),
        "cv2": conv_bn_act(c_mid, c_mid, 3),
        "cv3": conv_bn_act(c_mid, num_masks, 1),
    }

    def init(gen: torch.Generator):
        params, state = {}, {}
        for name, layer in layers.items():
            params[name], state[name] = layer.init(gen)
        state.pop("upsample")
        return params, state

    def apply(params, state, x, *, train: bool):
        new = {}
        x, new["cv1"] = layers["cv1"].apply(params["cv1"], state["cv1"], x, train=train)
        x, _ = layers["upsample"].apply(params["upsample"], {}, x, train=train)
        x, new["cv2"] = layers["cv2"].apply(params["cv2"], state["cv2"], x, train=train)
        x, new["cv3"] = layers["cv3"].apply(params["cv3"], state["cv3"], x, train=train)
        return x, (new if train else state)

    return Layer(init, apply)


def segment_head(
    *, channels: Sequence[int], num_masks: int = 32, proto_channels: int = 256, loss_fn=None
) -> Head:
    """Build the segment head.

    Args:
      channels: input channels of (P3, P4, P5).
      num_masks: NM mask coefficients (reference ``nm`` = 32).
      proto_channels: hidden width of the prototype branch (reference ``npr``; width-scaled by
        :func:`yolo_func.models.yolov8`: n 64, s 128, m 192, l 256, x 320).
      loss_fn: the mask loss ``(preds, targets, assignment) -> (scalar, parts)``; default
        :func:`yolo_func.losses.segment_loss` (gain 7.5, the box gain).

    Returns:
      ``Head`` whose apply maps ``Feats`` to ``SegmentPreds(coeffs float[B, A, NM],
      protos float[B, NM, H/4, W/4])``; its ``decode`` returns ``(coeffs float[B, NM, A], protos)``.

    Example:
      >>> import torch
      >>> from yolo_func import segment_head
      >>> head = segment_head(channels=(64, 128, 256))
      >>> params, state = head.init(torch.Generator().manual_seed(0))
      >>> feats = (torch.rand(1, 64, 8, 8), torch.rand(1, 128, 4, 4), torch.rand(1, 256, 2, 2))
      >>> preds, _ = head.apply(params, state, feats, train=True)
      >>> tuple(preds.coeffs.shape), tuple(preds.protos.shape)
      ((1, 84, 32), (1, 32, 16, 16))
    """
    if num_masks < 1 or proto_channels < 1:
        raise ValueError(f"[yolo_func] segment_head: num_masks and proto_channels must be >= 1, got {num_masks}, {proto_channels}")
    c4 = max(channels[0] // 4, num_masks)
    protos = proto(channels[0], proto_channels, num_masks)
    coeff = multi_level(channels, c4, num_masks)

    def init(gen: torch.Generator):
        proto_p, proto_s = protos.init(gen)
        coeff_p, coeff_s = coeff.init(gen)
        return {"proto": proto_p, "coeff": coeff_p}, {"proto": proto_s, "coeff": coeff_s}

    def apply(params, state, feats: Feats, *, train: bool):
        p, proto_s = protos.apply(params["proto"], state["proto"], feats[0], train=train)
        maps, coeff_s = coeff.apply(params["coeff"], state["coeff"], feats, train=train)
        return SegmentPreds(flatten_levels(maps), p), ({"proto": proto_s, "coeff": coeff_s} if train else state)

    def decode(preds: SegmentPreds, anchors: Anchors):
        del anchors
        return preds.coeffs.transpose(1, 2), preds.protos

    if loss_fn is None:
        loss_fn = segment_loss()

    def loss(preds, targets, assignment):
        return loss_fn(preds, targets, assignment)

    return Head(init, apply, loss, decode)
