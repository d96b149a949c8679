"""Test helpers: chex-shaped pytree asserts and hypothesis strategies.

The asserts need only torch. The strategies need ``hypothesis`` (the ``test`` extra) and are
imported lazily, so ``import yolo_func.testing`` works without it.
"""

from __future__ import annotations

from typing import Any

from yolo_func.testing.asserts import (
    Dimensions,
    assert_shape,
    assert_tree_all_finite,
    assert_tree_no_nones,
    assert_trees_all_close,
    assert_trees_all_equal,
    assert_trees_all_equal_dtypes,
    assert_trees_all_equal_shapes,
    assert_trees_all_equal_structs,
)
from yolo_func.testing.captures import CaptureCount, assert_max_captures
from yolo_func.testing.ops import AtenOpCount, count_aten_ops

_STRATEGIES = ("generators", "images", "boxes_xyxy", "padded_targets")

__all__ = [
    "AtenOpCount",
    "CaptureCount",
    "count_aten_ops",
    "Dimensions",
    "assert_max_captures",
    "assert_shape",
    "assert_tree_all_finite",
    "assert_tree_no_nones",
    "assert_trees_all_close",
    "assert_trees_all_equal",
    "assert_trees_all_equal_dtypes",
    "assert_trees_all_equal_shapes",
    "assert_trees_all_equal_structs",
    *_STRATEGIES,
]


def __getattr__(name: str) -> Any:
    # Lazy: hypothesis is a test-only dependency.
    if name in _STRATEGIES:
        from yolo_func.testing import strategies

        return getattr(strategies, name)
    raise AttributeError(f"module 'yolo_func.testing' has no attribute {name!r}")
