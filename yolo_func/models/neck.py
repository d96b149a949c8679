"""The YOLOv8 PAN neck (reference layers 10-21).

Tree keys: ``p4_td/c2f`` (12: top-down P4), ``p3_out/c2f`` (15: P3 out), ``p4_out/{down,c2f}``
(16, 18: P4 out), ``p5_out/{down,c2f}`` (19, 21: P5 out). Upsample and concat hold no parameters.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from yolo_func._types import Feats
from yolo_func.func import cat
from yolo_func.models.scales import Scale, channels, repeats
from yolo_func.nn import Layer, c2f, conv_bn_act

__all__ = ["neck", "neck_channels"]


def neck_channels(scale: Scale) -> tuple[int, int, int]:
    """Output channels of the neck's (P3, P4, P5): the heads' input channels.

    Example:
      >>> from yolo_func.models import get_scale, neck_channels
      >>> neck_channels(get_scale("n")), neck_channels(get_scale("s"))
      ((64, 128, 256), (128, 256, 512))
    """
    return channels(256, scale), channels(512, scale), channels(1024, scale)


def neck(scale: Scale) -> Layer:
    """Build the neck for ``scale``.

    Apply: ``(c3, c4, c5)`` from the backbone -> ``(Feats(p3, p4, p5), state)`` with
    p3 float[B, C3, H/8, W/8], p4 float[B, C4, H/16, W/16], p5 float[B, C5, H/32, W/32].

    Example:
      >>> import torch
      >>> from yolo_func.models import backbone, get_scale, neck
      >>> sc = get_scale("n")
      >>> bb, nk = backbone(sc), neck(sc)
      >>> (pb, sb), (pn, sn) = bb.init(torch.Generator().manual_seed(0)), nk.init(torch.Generator().manual_seed(1))
      >>> c, _ = bb.apply(pb, sb, torch.rand(1, 3, 64, 64), train=False)
      >>> feats, _ = nk.apply(pn, sn, c, train=False)
      >>> [tuple(f.shape) for f in feats]
      [(1, 64, 8, 8), (1, 128, 4, 4), (1, 256, 2, 2)]
    """
    c = lambda v: channels(v, scale)  # noqa: E731
    n = repeats(3, scale)
    blocks: dict[str, dict[str, Layer]] = {
        "p4_td": {"c2f": c2f(c(1024) + c(512), c(512), n, shortcut=False)},
        "p3_out": {"c2f": c2f(c(512) + c(256), c(256), n, shortcut=False)},
        "p4_out": {"down": conv_bn_act(c(256), c(256), 3, 2), "c2f": c2f(c(256) + c(512), c(512), n, shortcut=False)},
        "p5_out": {"down": conv_bn_act(c(512), c(512), 3, 2), "c2f": c2f(c(512) + c(1024), c(1024), n, shortcut=False)},
    }

    def init(gen: torch.Generator):
        params, state = {}, {}
        for name, subs in blocks.items():  # reference order 12, 15, 16, 18, 19, 21
            params[name], state[name] = {}, {}
            for sub, layer in subs.items():
                params[name][sub], state[name][sub] = layer.init(gen)
        return params, state

    def run(name, sub, params, state, new, x, train):
        y, s = blocks[name][sub].apply(params[name][sub], state[name][sub], x, train=train)
        new.setdefault(name, {})[sub] = s
        return y

    def apply(params, state, inputs, *, train: bool):
        c3, c4, c5 = inputs
        new: dict = {}
        up = lambda t: F.interpolate(t, scale_factor=2, mode="nearest")  # noqa: E731
        p4_td = run("p4_td", "c2f", params, state, new, cat((up(c5), c4), 1), train)
        p3 = run("p3_out", "c2f", params, state, new, cat((up(p4_td), c3), 1), train)
        d = run("p4_out", "down", params, state, new, p3, train)
        p4 = run("p4_out", "c2f", params, state, new, cat((d, p4_td), 1), train)
        d = run("p5_out", "down", params, state, new, p4, train)
        p5 = run("p5_out", "c2f", params, state, new, cat((d, c5), 1), train)
        return Feats(p3, p4, p5), (new if train else state)

    return Layer(init, apply)
