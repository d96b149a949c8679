"""Tree utilities: structure, paths, arithmetic, ravel, static buffers and the one in-place copy."""

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given

from yolo_func import tree as T
from yolo_func.testing import assert_trees_all_equal


def _tree(gen: torch.Generator):
    return {
        "b": {"weight": torch.randn(3, 2, generator=gen), "bias": torch.randn(3, generator=gen)},
        "a": (torch.randn(4, generator=gen), {"z": torch.randn(1, 1, 2, 2, generator=gen)}),
    }


@st.composite
def trees(draw):
    seed = draw(st.integers(0, 2**31 - 1))
    n = draw(st.integers(1, 5))
    g = torch.Generator().manual_seed(seed)
    shapes = [tuple(draw(st.lists(st.integers(1, 4), min_size=0, max_size=3))) for _ in range(n)]
    return {f"k{i}": {"leaf": torch.randn(s, generator=g)} for i, s in enumerate(shapes)}


def test_paths_are_slash_joined_and_sorted(gen):
    paths = T.tree_paths(_tree(gen))
    # optree sorts dict keys; tuples keep their order and show indices
    assert paths == ["a/0", "a/1/z", "b/bias", "b/weight"]


def test_named_tuple_fields_are_named_in_paths():
    from yolo_func._types import Anchors

    t = {"anchors": Anchors(torch.zeros(2, 2), torch.ones(2, 1)), "seq": [torch.zeros(1)]}
    assert T.tree_paths(t) == ["anchors/points", "anchors/strides", "seq/0"]


@given(trees())
def test_flat_dict_round_trip(t):
    flat = T.tree_flat_dict(t)
    back = T.tree_from_flat_dict(flat)
    assert_trees_all_equal(back, t, strict=True)


@given(trees())
def test_ravel_round_trip_and_count(t):
    flat, unravel = T.tree_ravel(t)
    assert flat.shape == (T.tree_count(t),)
    back = unravel(flat)
    assert_trees_all_equal(back, t, strict=True)


@given(trees(), st.floats(-3, 3, allow_nan=False))
def test_arithmetic(t, s):
    doubled = T.tree_add(t, t)
    assert_trees_all_equal(doubled, T.tree_map(lambda x: x + x, t), strict=True)
    zero = T.tree_sub(t, t)
    assert all(torch.count_nonzero(z) == 0 for z in T.tree_leaves(zero))
    scaled = T.tree_scale(t, s)
    assert_trees_all_equal(scaled, T.tree_map(lambda x: x * s, t), strict=True)
    assert T.tree_structure(T.tree_zeros_like(t)) == T.tree_structure(t)


def test_copy_in_place_writes_into_the_same_storage(gen):
    src, dst = _tree(gen), T.tree_zeros_like(_tree(gen))
    ptrs = [x.data_ptr() for x in T.tree_leaves(dst)]
    T.tree_copy_(dst, src)
    assert [x.data_ptr() for x in T.tree_leaves(dst)] == ptrs
    assert_trees_all_equal(dst, src, strict=True)


def test_copy_rejects_other_structures_with_a_diff(gen):
    src = _tree(gen)
    dst = T.tree_zeros_like(src)
    del dst["b"]["bias"]
    with pytest.raises(ValueError, match=r"\+ b/bias \(only in src\)"):
        T.tree_copy_(dst, src)


def test_static_like_is_a_fresh_copy_with_the_same_layout(gen):
    t = {"w": torch.randn(2, 3, 4, 5, generator=gen).contiguous(memory_format=torch.channels_last)}
    s = T.tree_static_like(t)
    assert s["w"].data_ptr() != t["w"].data_ptr() and torch.equal(s["w"], t["w"])
    assert s["w"].is_contiguous(memory_format=torch.channels_last)


def test_to_channels_last_only_touches_4d(gen):
    t = T.tree_to(_tree(gen), "cpu", channels_last=True)
    assert t["a"][1]["z"].is_contiguous(memory_format=torch.channels_last)
    assert t["b"]["weight"].is_contiguous()


def test_cast_leaves_integers_alone():
    t = T.tree_cast({"f": torch.zeros(2), "i": torch.zeros(2, dtype=torch.int64)}, torch.float16)
    assert t["f"].dtype == torch.float16 and t["i"].dtype == torch.int64


def test_diff_lists_missing_extra_and_reshaped():
    a = {"x": torch.zeros(2), "y": torch.zeros(3)}
    b = {"x": torch.zeros(4), "z": torch.zeros(1)}
    d = T.tree_diff(a, b)
    assert " - y (only in a)" in d and " + z (only in b)" in d and " ~ x: a [2] != b [4]" in d
    assert T.tree_diff(a, a) == ""


def test_get_names_the_missing_key(gen):
    t = _tree(gen)
    assert T.tree_get(t, "b/bias") is t["b"]["bias"]
    with pytest.raises(KeyError, match="no 'nope'"):
        T.tree_get(t, "b/nope")


def test_from_flat_dict_rejects_leaf_prefix_clash():
    with pytest.raises(ValueError, match="runs through leaf"):
        T.tree_from_flat_dict({"a/b": 1, "a/b/c": 2})
    with pytest.raises(ValueError, match="both a leaf"):
        T.tree_from_flat_dict({"a/b/c": 2, "a/b": 1})


_LAYOUTS = st.sampled_from(["contiguous", "channels_last", "transposed", "scalar"])


def _leaf(layout: str, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if layout == "scalar":
        x = torch.randn((), generator=g)
    elif layout == "channels_last":
        x = torch.randn(2, 3, 4, 5, generator=g).contiguous(memory_format=torch.channels_last)
    elif layout == "transposed":  # dense but neither contiguous nor channels_last: the per-leaf path
        x = torch.randn(4, 3, generator=g).t()
    else:
        x = torch.randn(3, 7, generator=g)
    return x.to(dtype) if dtype != torch.bool else x > 0


@given(st.lists(st.tuples(_LAYOUTS, st.sampled_from([torch.float32, torch.float64, torch.int64, torch.bool])),
                min_size=1, max_size=8), st.booleans(), st.integers(0, 1000), st.booleans())
def test_where_equals_per_leaf_where_and_keeps_layouts(specs, flag, seed, fused):
    new = {f"k{i}": _leaf(lay, dt, seed + i) for i, (lay, dt) in enumerate(specs)}
    old = {f"k{i}": _leaf(lay, dt, seed + 100 + i) for i, (lay, dt) in enumerate(specs)}
    for k, v in new.items():  # NaN in the unchosen tree must not leak through
        if v.is_floating_point() and v.dim() > 0:
            (old[k] if flag else v)[(0,) * v.dim()] = float("nan")
    f = torch.tensor(flag)
    out = T.tree_where(f, new, old, fused=fused)
    for k in new:
        want = torch.where(f, new[k], old[k])
        assert torch.equal(out[k], want)  # the NaN sits in the unchosen tree only
        assert out[k].dtype == want.dtype and out[k].shape == want.shape
        assert out[k].stride() == new[k].stride(), k  # each leaf keeps its layout


@given(st.lists(st.tuples(_LAYOUTS, st.sampled_from([torch.float32, torch.float64])), min_size=1, max_size=6),
       st.integers(0, 1000), st.booleans())
def test_where_with_a_scalar_zeroes_a_non_finite_tree(specs, seed, fused):
    tree = [_leaf(lay, dt, seed + i) / 0.0 for i, (lay, dt) in enumerate(specs)]  # inf / nan everywhere
    out = T.tree_where(torch.tensor(False), tree, 0.0, fused=fused)
    for x, y in zip(tree, out, strict=True):
        assert torch.equal(y, torch.zeros_like(x)) and y.stride() == x.stride()
    kept = T.tree_where(torch.tensor(True), tree, 0.0, fused=fused)
    for x, y in zip(tree, kept, strict=True):
        assert torch.equal(x.nan_to_num(), y.nan_to_num())


def test_foreach_copy_groups_mixed_dtypes():
    dst = [torch.zeros(3), torch.zeros((), dtype=torch.int64), torch.zeros(2, dtype=torch.float64),
           torch.zeros(2, 3, 4, 5).contiguous(memory_format=torch.channels_last), torch.zeros(2, dtype=torch.bool)]
    src = [torch.arange(3.0), torch.tensor(7), torch.tensor([1.5, 2.5], dtype=torch.float64),
           torch.randn(2, 3, 4, 5).contiguous(memory_format=torch.channels_last), torch.tensor([True, False])]
    ptrs = [d.data_ptr() for d in dst]
    T.foreach_copy_(dst, src)
    for d, s, p in zip(dst, src, ptrs, strict=True):
        assert torch.equal(d, s) and d.data_ptr() == p


@given(st.lists(st.tuples(_LAYOUTS, st.sampled_from([torch.float32, torch.float64, torch.int64])), min_size=1, max_size=8),
       st.integers(0, 1000))
def test_clone_flat_copies_values_and_layouts_into_fresh_memory(specs, seed):
    tree = {f"k{i}": _leaf(lay, dt, seed + i) for i, (lay, dt) in enumerate(specs)}
    for fused in (False, True):
        out = T.tree_clone_flat(tree, fused=fused)
        for k, x in tree.items():
            y = out[k]
            assert torch.equal(x, y) and y.stride() == x.stride() and y.dtype == x.dtype
            assert y.data_ptr() != x.data_ptr()
        y0 = out["k0"].clone()
        tree["k0"].add_(1) if tree["k0"].dtype != torch.bool else None
        assert torch.equal(out["k0"], y0)  # the copy does not alias its source


@given(st.lists(_LAYOUTS, min_size=1, max_size=6), st.floats(0.0, 1.0), st.integers(0, 1000))
def test_fused_lerp_equals_the_foreach_lerp(layouts, w, seed):
    """The fused EMA lerp (one lerp per flat group) equals the per-leaf foreach lerp."""
    e = [_leaf(lay, torch.float32, seed + i) for i, lay in enumerate(layouts)]
    m = [_leaf(lay, torch.float32, seed + 50 + i) for i, lay in enumerate(layouts)]
    wt = torch.tensor(w, dtype=torch.float32)
    fused = T.flat_leafwise(lambda a, b: torch.lerp(a, b, wt), e, m, fused=True)
    per_leaf = torch._foreach_lerp(e, m, [wt] * len(e))
    for a, b, x in zip(fused, per_leaf, e, strict=True):
        assert torch.equal(a, b) and a.stride() == x.stride()

