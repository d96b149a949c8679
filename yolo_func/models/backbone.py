"""The YOLOv8 backbone (reference layers 0-9).

Tree keys (params and state): ``stem`` (0), ``stage1/{conv,c2f}`` (1, 2), ``stage2/{conv,c2f}``
(3, 4: P3), ``stage3/{conv,c2f}`` (5, 6: P4), ``stage4/{conv,c2f}`` (7, 8), ``sppf`` (9: P5).
"""

from __future__ import annotations

import torch

from yolo_func.models.scales import Scale, channels, repeats
from yolo_func.nn import Layer, c2f, conv_bn_act, sppf

__all__ = ["backbone"]


def backbone(scale: Scale) -> Layer:
    """Build the backbone for ``scale``.

    Apply: ``images float[B, 3, H, W] -> ((c3 float[B, C3, H/8, W/8], c4 float[B, C4, H/16, W/16],
    c5 float[B, C5, H/32, W/32]), state)``.

    Example:
      >>> import torch
      >>> from yolo_func.models import backbone, get_scale
      >>> bb = backbone(get_scale("n"))
      >>> p, s = bb.init(torch.Generator().manual_seed(0))
      >>> c, _ = bb.apply(p, s, torch.rand(1, 3, 64, 64), train=False)
      >>> [tuple(x.shape) for x in c]             # strides 8, 16, 32
      [(1, 64, 8, 8), (1, 128, 4, 4), (1, 256, 2, 2)]
    """
    c = lambda v: channels(v, scale)  # noqa: E731
    r = lambda v: repeats(v, scale)  # noqa: E731
    layers: dict[str, dict[str, Layer] | Layer] = {
        "stem": conv_bn_act(3, c(64), 3, 2),
        "stage1": {"conv": conv_bn_act(c(64), c(128), 3, 2), "c2f": c2f(c(128), c(128), r(3), shortcut=True)},
        "stage2": {"conv": conv_bn_act(c(128), c(256), 3, 2), "c2f": c2f(c(256), c(256), r(6), shortcut=True)},
        "stage3": {"conv": conv_bn_act(c(256), c(512), 3, 2), "c2f": c2f(c(512), c(512), r(6), shortcut=True)},
        "stage4": {"conv": conv_bn_act(c(512), c(1024), 3, 2), "c2f": c2f(c(1024), c(1024), r(3), shortcut=True)},
        "sppf": sppf(c(1024), c(1024), 5),
    }
    stages = ("stage1", "stage2", "stage3", "stage4")

    def init(gen: torch.Generator):
        params, state = {}, {}
        params["stem"], state["stem"] = layers["stem"].init(gen)
        for name in stages:
            params[name], state[name] = {}, {}
            for sub in ("conv", "c2f"):  # reference order: strided conv, then C2f
                params[name][sub], state[name][sub] = layers[name][sub].init(gen)
        params["sppf"], state["sppf"] = layers["sppf"].init(gen)
        return params, state

    def apply(params, state, x, *, train: bool):
        new = {}
        x, new["stem"] = layers["stem"].apply(params["stem"], state["stem"], x, train=train)
        outs = []
        for name in stages:
            new[name] = {}
            for sub in ("conv", "c2f"):
                x, new[name][sub] = layers[name][sub].apply(params[name][sub], state[name][sub], x, train=train)
            outs.append(x)
        x, new["sppf"] = layers["sppf"].apply(params["sppf"], state["sppf"], x, train=train)
        return (outs[1], outs[2], x), (new if train else state)

    return Layer(init, apply)
