"""yolo_func.testing.asserts: chex-style pass/fail pairs, leaf paths in messages, wildcards, misuse."""

from __future__ import annotations

import re

import pytest
import torch

from yolo_func._types import Targets
from yolo_func.testing import (
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

NAN, INF = float("nan"), float("inf")


def _tree(scale: float = 1.0):
    return {
        "backbone": {"stem": {"conv": {"weight": torch.arange(6.0).reshape(2, 3) * scale}}},
        "head": {"bias": torch.tensor([1.0, 2.0]) * scale, "count": torch.tensor(3)},
    }


def _with(tree, path: str, value):
    """A copy of a nested dict tree with the leaf at ``a/b/c`` replaced (the input is untouched)."""
    head, _, rest = path.partition("/")
    return {**tree, head: _with(tree[head], rest, value) if rest else value}


def _raises(fn, *args, match: str | None = None, **kw) -> str:
    with pytest.raises(AssertionError) as info:
        fn(*args, **kw)
    msg = str(info.value)
    assert isinstance(info.value.args[0], str) and len(info.value.args) == 1
    assert msg.startswith("[yolo_func] ")
    if match is not None:
        assert match in msg, msg
    return msg


# ---------------------------------------------------------------- all_close


def test_all_close_passes_within_tolerance_and_is_variadic():
    a = _tree()
    b = _with(a, "backbone/stem/conv/weight", a["backbone"]["stem"]["conv"]["weight"] + 1e-4)
    assert_trees_all_close(a, b, a, atol=1e-3)
    assert_trees_all_close(a, _tree(1 + 1e-7))  # within the default rtol=1e-6


def test_all_close_fails_naming_path_and_errors():
    a = _tree()
    w = a["backbone"]["stem"]["conv"]["weight"]
    b = _with(a, "backbone/stem/conv/weight", w + torch.tensor([[0.0, 0.5, 0.0], [0.0, 0.0, 0.0]]))
    msg = _raises(assert_trees_all_close, a, b, atol=1e-3, match="'backbone/stem/conv/weight'")
    # hand-computed: one element off by 0.5 at (0, 1) where tree 0 holds 1.0 -> rel err 0.5 / 1.5
    assert "1/6 elements differ" in msg
    assert "max abs err 0.5 at (0, 1)" in msg
    assert "max rel err 0.333333" in msg
    assert "(2, 3) float32" in msg
    assert "head/bias" not in msg  # only failing leaves are named


def test_all_close_variadic_reports_every_failing_tree_and_leaf():
    a = _tree()
    b = _with(a, "head/bias", torch.tensor([1.0, 2.5]))
    c = _with(a, "head/count", torch.tensor(4))
    msg = _raises(assert_trees_all_close, a, a, b, c)
    assert "tree 2 leaf 'head/bias'" in msg
    assert "tree 3 leaf 'head/count'" in msg
    assert "tree 1" not in msg


def test_all_close_shape_mismatch_is_not_broadcast():
    a = {"x": torch.zeros(3)}
    msg = _raises(assert_trees_all_close, a, {"x": torch.zeros(1, 3)}, match="'x'")
    assert "shape (3,) != (1, 3)" in msg


def test_all_close_strict_checks_dtype_and_nonstrict_promotes():
    a = {"p": {"w": torch.ones(2)}}
    b = {"p": {"w": torch.ones(2, dtype=torch.float64)}}
    assert_trees_all_close(a, b)
    msg = _raises(assert_trees_all_close, a, b, strict=True, match="'p/w'")
    assert "float32" in msg and "float64" in msg


def test_all_close_nan_handling():
    a = {"x": torch.tensor([1.0, NAN])}
    msg = _raises(assert_trees_all_close, a, a, match="'x'")  # NaN is close to nothing by default
    assert "NaN/inf involved, first at (1,)" in msg
    assert_trees_all_close(a, {"x": torch.tensor([1.0, NAN])}, equal_nan=True)
    # infinities: close only to the same infinity
    assert_trees_all_close({"x": torch.tensor([INF, -INF])}, {"x": torch.tensor([INF, -INF])})
    _raises(assert_trees_all_close, {"x": torch.tensor([INF])}, {"x": torch.tensor([-INF])}, match="'x'")


def test_all_close_structure_mismatch_gives_tree_diff():
    a = {"a": {"w": torch.zeros(1)}, "b": torch.zeros(2)}
    b = {"a": {"w": torch.zeros(1), "extra": torch.zeros(1)}}
    msg = _raises(assert_trees_all_close, a, b, match="structures differ")
    assert " - b (only in tree 0)" in msg
    assert " + a/extra (only in tree 1)" in msg


def test_all_close_detaches_and_accepts_namedtuples_and_numbers():
    x = torch.ones(3, requires_grad=True)
    assert_trees_all_close({"x": x * 2}, {"x": torch.full((3,), 2.0)})
    t = Targets(torch.zeros(1, 2, 4), torch.zeros(1, 2, dtype=torch.int64), torch.zeros(1, 2, dtype=torch.bool))
    assert_trees_all_close(t, t)
    assert_trees_all_close({"lr": 0.1}, {"lr": 0.1})
    # NamedTuple fields are named by field in paths (tree_items' convention)
    _raises(assert_trees_all_close, t, t._replace(boxes=torch.ones(1, 2, 4)), match="leaf 'boxes'")


# ---------------------------------------------------------------- misuse


@pytest.mark.parametrize(
    "fn",
    [
        assert_trees_all_close,
        assert_trees_all_equal,
        assert_trees_all_equal_structs,
        assert_trees_all_equal_shapes,
        assert_trees_all_equal_dtypes,
    ],
)
def test_single_list_argument_is_detected(fn):
    a, b = _tree(), _tree()
    with pytest.raises(ValueError, match=re.escape(f"{fn.__name__}(*trees)")) as info:
        fn([a, b])
    assert str(info.value).startswith("[yolo_func] ")
    with pytest.raises(ValueError, match="at least 2 trees"):
        fn(a)


# ---------------------------------------------------------------- all_equal


def test_all_equal_pass_and_fail():
    a = _tree()
    assert_trees_all_equal(a, _tree(), _tree())
    b = _with(a, "head/count", torch.tensor(5))
    msg = _raises(assert_trees_all_equal, a, b, match="'head/count'")
    assert "max abs err 2 at ()" in msg  # 3 vs 5
    assert "backbone" not in msg


def test_all_equal_nan_never_equal_and_tiny_difference_fails():
    x = torch.tensor([0.0, NAN])
    _raises(assert_trees_all_equal, {"x": x}, {"x": x.clone()}, match="'x'")  # torch.equal semantics
    assert not torch.equal(x, x.clone())
    _raises(assert_trees_all_equal, {"y": torch.tensor(1.0)}, {"y": torch.tensor(1.0 + 1e-6)}, match="'y'")


def test_all_equal_strict_dtype():
    a, b = {"c": torch.tensor([1, 2])}, {"c": torch.tensor([1.0, 2.0])}
    assert_trees_all_equal(a, b)  # values equal after promotion
    _raises(assert_trees_all_equal, a, b, strict=True, match="'c'")
    assert_trees_all_equal(a, {"c": torch.tensor([1, 2])}, strict=True)


# ---------------------------------------------------------------- structs / shapes / dtypes


def test_equal_structs():
    assert_trees_all_equal_structs(_tree(), _tree(2.0), _tree(3.0))
    # None slots are structure: Targets with and without keypoints differ
    t = Targets(torch.zeros(1), torch.zeros(1), torch.zeros(1))
    msg = _raises(assert_trees_all_equal_structs, t, t._replace(keypoints=torch.zeros(1)))
    assert " + keypoints (only in tree 1)" in msg
    # node type change (tuple vs list): same paths, so the specs are printed
    msg = _raises(assert_trees_all_equal_structs, (torch.zeros(1),), [torch.zeros(1)])
    assert "tree 0: PyTreeSpec" in msg


def test_equal_shapes():
    a = {"w": torch.zeros(2, 3), "b": torch.zeros(3)}
    assert_trees_all_equal_shapes(a, {"w": torch.ones(2, 3, dtype=torch.int64), "b": torch.ones(3)})
    msg = _raises(assert_trees_all_equal_shapes, a, {"w": torch.zeros(3, 2), "b": torch.zeros(3)}, match="'w'")
    assert "shape (2, 3) != (3, 2)" in msg and "'b'" not in msg


def test_equal_dtypes():
    a = {"w": torch.zeros(2), "n": torch.zeros(1, dtype=torch.int64)}
    assert_trees_all_equal_dtypes(a, {"w": torch.ones(5), "n": torch.ones(3, dtype=torch.int64)})
    msg = _raises(assert_trees_all_equal_dtypes, a, {"w": torch.zeros(2).half(), "n": a["n"]}, match="'w'")
    assert "torch.float32 != torch.float16" in msg


# ---------------------------------------------------------------- finite / nones


def test_all_finite():
    assert_tree_all_finite({"a": torch.ones(3), "i": torch.tensor([1, 2]), "n": 2.0})
    bad = {"ok": torch.ones(2), "m": {"x": torch.tensor([[0.0, NAN], [INF, -INF]])}}
    msg = _raises(assert_tree_all_finite, bad, match="'m/x'")
    assert "3/4 non-finite (nan=1, +inf=1, -inf=1), first at (0, 1)" in msg
    assert "'ok'" not in msg


def test_no_nones():
    assert_tree_no_nones({"a": torch.ones(1), "b": [torch.ones(1)]})
    t = Targets(torch.zeros(1), torch.zeros(1), torch.zeros(1))
    msg = _raises(assert_tree_no_nones, {"t": t, "l": [1, None]})
    # same path convention as tree_items: sorted keys, list indices, NamedTuple fields by name
    assert "'l/1' is None" in msg and "'t/masks' is None" in msg and "'t/keypoints' is None" in msg
    _raises(assert_tree_no_nones, None, match="'<root>' is None")


# ---------------------------------------------------------------- assert_shape


@pytest.mark.parametrize(
    "shape, expected",
    [
        ((2, 3), (2, 3)),
        ((2, 3), (None, 3)),
        ((2, 3), ({1, 2}, {3, 4})),
        ((2, 3, 4), (...,)),
        ((), (...,)),
        ((2, 3, 4), (2, ...)),
        ((2, 3, 4), (..., 4)),
        ((2, 3, 4), (2, ..., 4)),
        ((2, 4), (2, ..., 4)),  # ... matches zero dims
        ((2, 3, 4), [2, None, 4]),
        ((2, 3, 4), torch.Size([2, 3, 4])),
        ((), ()),
    ],
)
def test_assert_shape_passes(shape, expected):
    assert_shape(torch.zeros(shape), expected)


@pytest.mark.parametrize(
    "shape, expected, why",
    [
        ((2, 3), (2, 4), "dim 1 is 3, expected 4"),
        ((2, 3), (2, 3, 1), "rank 2 != 3"),
        ((2, 3), ({1, 4}, 3), "dim 0 is 2, expected one of [1, 4]"),
        ((2,), (2, ..., 4), "rank 1 < 2"),
        ((2, 3, 5), (..., 4), "dim 2 is 5, expected 4"),
        ((), (1,), "rank 0 != 1"),
    ],
)
def test_assert_shape_fails(shape, expected, why):
    _raises(assert_shape, torch.zeros(shape), expected, match=why)


def test_assert_shape_lists():
    xs = [torch.zeros(2, 4), torch.zeros(3, 4)]
    assert_shape(xs, (None, 4))
    assert_shape(xs, [(2, 4), (3, ...)])
    msg = _raises(assert_shape, xs, (2, 4), match="x[1]: shape (3, 4)")
    assert "x[0]" not in msg
    with pytest.raises(ValueError, match="2 inputs but 3 expected shapes"):
        assert_shape(xs, [(2, 4), (3, 4), (1,)])


def test_assert_shape_bad_patterns():
    with pytest.raises(ValueError, match="more than one"):
        assert_shape(torch.zeros(1), (..., ...))
    with pytest.raises(TypeError, match="expected entries"):
        assert_shape(torch.zeros(1), (1.5,))


# ---------------------------------------------------------------- Dimensions


def test_dimensions_lookups():
    dims = Dimensions(B=2, A=8400, M=7, K=80, NM=32, X=None)
    assert dims.B == 2 and dims.NM == 32
    assert dims["BA4"] == (2, 8400, 4)
    assert dims["BM4"] == (2, 7, 4)
    assert dims["B16"] == (2, 16)  # a run of digits is one size
    assert dims["B*K"] == (2, None, 80)
    assert dims["B...4"] == (2, ..., 4)
    assert dims["B", "NM", 4] == (2, 32, 4)
    assert dims["B", None, ...] == (2, None, ...)
    assert dims["BX"] == (2, None)  # a None size is a wildcard
    assert dims.replace(B=4)["BA"] == (4, 8400) and dims.B == 2
    with pytest.raises(KeyError, match="no 'Q'"):
        dims["BQ"]
    with pytest.raises(AttributeError, match="immutable"):
        dims.B = 3
    assert_shape(torch.zeros(2, 8400, 4), dims["BA4"])
    assert_shape(torch.zeros(2, 5, 4), dims["BX4"])
    _raises(assert_shape, torch.zeros(3, 8400, 4), dims["BA4"], match="dim 0 is 3, expected 2")


# ---------------------------------------------------------------- messages are strings


def test_no_message_is_a_tuple():
    """Every failing assert raises one str message (equinox once raised a tuple)."""
    a = {"x": torch.tensor([1.0, NAN])}
    b = {"x": torch.tensor([2.0, 1.0])}
    failures = [
        lambda: assert_trees_all_close(a, b),
        lambda: assert_trees_all_close(a, {"y": b["x"]}),
        lambda: assert_trees_all_equal(a, b),
        lambda: assert_trees_all_equal_structs(a, {"y": 1}),
        lambda: assert_trees_all_equal_shapes(a, {"x": torch.zeros(3)}),
        lambda: assert_trees_all_equal_dtypes(a, {"x": torch.zeros(2).double()}),
        lambda: assert_tree_all_finite(a),
        lambda: assert_tree_no_nones({"n": None}),
        lambda: assert_shape(torch.zeros(2), (3,)),
        lambda: assert_trees_all_close([a, b]),
        lambda: assert_shape(torch.zeros(2), (..., ...)),
        lambda: Dimensions(B=2)["C"],
    ]
    for f in failures:
        with pytest.raises((AssertionError, ValueError, TypeError, KeyError)) as info:
            f()
        args = info.value.args
        assert len(args) == 1 and isinstance(args[0], str), args
        assert args[0].startswith("[yolo_func] "), args[0]


def test_long_failure_lists_are_capped():
    a = {f"k{i:02d}": torch.zeros(1) for i in range(30)}
    b = {k: torch.ones(1) for k in a}
    msg = _raises(assert_trees_all_equal, a, b, match="30 leaves not equal")
    assert "... and 10 more" in msg


def test_none_paths_match_tree_items_convention():
    """The None walker names paths as tree_items would once the None is filled in."""
    from yolo_func.tree import tree_paths

    t = {"t": Targets(torch.zeros(1), torch.zeros(1), torch.zeros(1), masks=None, keypoints=torch.zeros(1))}
    msg = _raises(assert_tree_no_nones, t)
    (path,) = [line.split("'")[1] for line in msg.splitlines()[1:]]
    assert path in tree_paths({"t": t["t"]._replace(masks=torch.zeros(1))})


def test_strict_checks_device_before_moving_to_cpu():
    # 'meta' tensors stand in for a second device on a CPU-only machine (they cannot be copied to CPU,
    # so this also shows the device check runs first).
    a, b = {"w": torch.zeros(2)}, {"w": torch.zeros(2, device="meta")}
    msg = _raises(assert_trees_all_close, a, b, strict=True, match="'w': device cpu != meta (strict)")
    assert msg.count("leaf") == 2  # header + the one leaf line
    _raises(assert_trees_all_equal, a, b, strict=True, match="device cpu != meta")
