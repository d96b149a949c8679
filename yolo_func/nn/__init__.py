"""Pure layers: each factory returns ``Layer(init, apply)`` (see :mod:`yolo_func.nn.base`)."""

from yolo_func.nn.base import Layer, abstract_init, conv_bias, conv_weight, split, uniform
from yolo_func.nn.batchnorm import (
    BN_EPS,
    BN_MOMENTUM,
    batchnorm,
    batchnorm_apply,
    batchnorm_init,
    update_stats_in_place, sync_batchnorm,
)
from yolo_func.nn.blocks import bottleneck, c2f, concat, sppf, upsample
from yolo_func.nn.conv import conv2d, conv_bn_act, conv_transpose2d

__all__ = [
    "Layer",
    "abstract_init",
    "split",
    "uniform",
    "conv_weight",
    "conv_bias",
    "BN_EPS",
    "BN_MOMENTUM",
    "batchnorm",
    "batchnorm_apply",
    "batchnorm_init",
    "update_stats_in_place",
    "sync_batchnorm",
    "bottleneck",
    "c2f",
    "sppf",
    "upsample",
    "concat",
    "conv2d",
    "conv_bn_act",
    "conv_transpose2d",
]
