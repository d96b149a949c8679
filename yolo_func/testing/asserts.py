"""chex-shaped assertions over pytrees of tensors, for tests.

Every assertion raises ``AssertionError`` whose message starts with ``[yolo_func] `` and names each
failing leaf by its ``/``-path (:func:`yolo_func.tree.tree_items`), with its shapes, dtypes and, for
numeric comparisons, the number of differing elements and the max absolute / relative error. The
``assert_trees_*`` functions are variadic: tree 0 is compared with trees 1..n-1 and every failing
leaf of every pair is reported, not just the first. Misuse (fewer than two trees, in particular
``assert_trees_all_close([a, b])`` with one list argument) raises ``ValueError`` instead, because it
is a bug in the test rather than a failed check.

Tensors are compared on the CPU after ``.detach()``; non-tensor leaves (Python numbers, numpy
arrays) go through ``torch.as_tensor``. With ``strict=True`` leaves must also agree in dtype and
device; without it values are compared after promotion to float64 (complex128 for complex).

Example:
  >>> import torch
  >>> a = {"conv": {"weight": torch.ones(2, 3)}}
  >>> assert_trees_all_close(a, {"conv": {"weight": torch.ones(2, 3) + 1e-8}}, atol=1e-6)
  >>> assert_shape(a["conv"]["weight"], (None, {3, 4}))
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from yolo_func.tree import tree_diff, tree_items, tree_structure

__all__ = [
    "assert_trees_all_close",
    "assert_trees_all_equal",
    "assert_trees_all_equal_structs",
    "assert_trees_all_equal_shapes",
    "assert_trees_all_equal_dtypes",
    "assert_tree_all_finite",
    "assert_tree_no_nones",
    "assert_shape",
    "Dimensions",
]

PyTree = Any
_PREFIX = "[yolo_func] "
#: Cap on the number of leaves listed in one message (the count of the rest is still given).
_MAX_LISTED = 20


# ----------------------------------------------------------------------------------------------
# helpers


def _n(k: int, one: str, many: str) -> str:
    return f"{k} {one if k == 1 else many}"


def _fail(fn: str, header: str, lines: Sequence[str]) -> None:
    """Raise one AssertionError with a single ``str`` message (never a tuple: equinox's bug)."""
    shown = list(lines[:_MAX_LISTED])
    if len(lines) > _MAX_LISTED:
        shown.append(f"  ... and {len(lines) - _MAX_LISTED} more")
    body = "\n".join(shown)
    raise AssertionError(f"{_PREFIX}{fn}: {header}" + (f"\n{body}" if body else ""))


def _check_num_trees(fn: str, trees: tuple) -> None:
    """Reject the ``assert_trees_x([a, b])`` misuse and calls with fewer than two trees."""
    if len(trees) >= 2:
        return
    if len(trees) == 1 and isinstance(trees[0], (list, tuple)) and not hasattr(trees[0], "_fields"):
        raise ValueError(
            f"{_PREFIX}{fn} got a single {type(trees[0]).__name__} of {len(trees[0])} items; it compares "
            f"trees passed as separate arguments. Did you mean {fn}(*trees) instead of {fn}(trees)? "
            f"(To compare one list-shaped tree with another, pass both: {fn}(a, b).)"
        )
    raise ValueError(f"{_PREFIX}{fn} needs at least 2 trees to compare, got {len(trees)}")


def _as_tensor(x: Any) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x
    try:
        return torch.as_tensor(x)
    except (TypeError, ValueError, RuntimeError) as e:
        raise TypeError(f"{_PREFIX}cannot compare leaf of type {type(x).__name__}: {e}") from None


def _desc(x: torch.Tensor) -> str:
    return f"{tuple(x.shape)} {str(x.dtype).removeprefix('torch.')} on {x.device}"


def _check_structs(fn: str, trees: tuple) -> None:
    """Raise with the tree diff of every tree whose structure differs from tree 0."""
    ref = tree_structure(trees[0])
    lines = []
    for i, t in enumerate(trees[1:], start=1):
        s = tree_structure(t)
        if s != ref:
            diff = tree_diff(trees[0], t, names=("tree 0", f"tree {i}"))
            # tree_diff only sees paths and shapes; node-type changes (tuple vs list) need the specs.
            lines.append(f"  tree 0 vs tree {i}:")
            lines.append(diff if diff else f"   tree 0: {ref}\n   tree {i}: {s}")
    if lines:
        _fail(fn, "tree structures differ", lines)


def _pairs(trees: tuple) -> Iterable[tuple[int, str, torch.Tensor, torch.Tensor]]:
    """``(tree index i, path, leaf of tree 0, leaf of tree i)`` for every leaf; structures must match."""
    ref = tree_items(trees[0])
    for i, t in enumerate(trees[1:], start=1):
        for (path, a), (_, b) in zip(ref, tree_items(t)):
            yield i, path, _as_tensor(a), _as_tensor(b)


def _strict_mismatch(a: torch.Tensor, b: torch.Tensor) -> str | None:
    if a.dtype != b.dtype:
        return f"dtype {a.dtype} != {b.dtype} (strict)"
    if a.device != b.device:
        return f"device {a.device} != {b.device} (strict)"
    return None


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, device and values, checked where the tensors live (``torch.equal``: NaN is never
    equal). The fast path: a GPU training state has millions of elements, and the float64 CPU copies
    of :func:`_common` are only needed to describe a difference (or to compare across dtypes)."""
    return a.dtype == b.dtype and a.device == b.device and bool(torch.equal(a, b))


def _common(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Detached CPU copies in a dtype wide enough for both (float64, or complex128)."""
    dt = torch.complex128 if (a.is_complex() or b.is_complex()) else torch.float64
    return a.detach().cpu().to(dt), b.detach().cpu().to(dt)


def _fmt(v: float) -> str:
    return f"{v:.6g}"


def _error_stats(a: torch.Tensor, b: torch.Tensor, bad: torch.Tensor) -> str:
    """``n/N differ; max abs err ... at index ...; max rel err ...`` for promoted tensors a, b."""
    n_bad, n = int(bad.sum()), bad.numel()
    err = (a - b).abs()
    rel = err / b.abs()
    # NaN/inf errors would hide the finite ones; report them separately, and only where they fail.
    fin = torch.isfinite(err)
    parts = [f"{n_bad}/{n} elements differ"]
    nonfin = ~fin & bad
    if bool((fin & bad).any()):
        e = torch.where(fin, err, torch.zeros_like(err))
        flat = int(e.reshape(-1).argmax())
        idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), a.shape)) if a.dim() else ()
        av, bv = a.reshape(-1)[flat], b.reshape(-1)[flat]
        parts.append(f"max abs err {_fmt(float(e.max()))} at {idx} ({_fmt_val(av)} vs {_fmt_val(bv)})")
        rfin = torch.isfinite(rel)
        if bool(rfin.any()):
            parts.append(f"max rel err {_fmt(float(torch.where(rfin, rel, torch.zeros_like(rel)).max()))}")
    if bool(nonfin.any()):
        first = tuple(torch.nonzero(nonfin)[0].tolist()) if a.dim() else ()
        av, bv = a[first], b[first]
        parts.append(
            f"{int(nonfin.sum())} with NaN/inf involved, first at {first} ({_fmt_val(av)} vs {_fmt_val(bv)})"
        )
    return "; ".join(parts)


def _fmt_val(v: torch.Tensor) -> str:
    return str(complex(v)) if v.is_complex() else _fmt(float(v.real))


# ----------------------------------------------------------------------------------------------
# tree comparisons


def assert_trees_all_close(
    *trees: PyTree,
    rtol: float = 1e-6,
    atol: float = 0.0,
    strict: bool = False,
    equal_nan: bool = False,
) -> None:
    """Assert that all trees have one structure and leaf-wise close values.

    Closeness is ``|a - b| <= atol + rtol * |b|`` element-wise (``torch.isclose``, tree 0 as ``a``),
    computed in float64 on the CPU. Shapes must be equal (no broadcasting). Infinities are close only
    to the same infinity; NaN is close to nothing unless ``equal_nan=True``.

    Args:
      *trees: two or more pytrees with tensor (or number / array) leaves of any shape ``(...)``.
      rtol: relative tolerance.
      atol: absolute tolerance.
      strict: also require equal dtypes and devices.
      equal_nan: treat NaNs in the same position as equal.

    Raises:
      AssertionError: structures differ (message is the tree diff), or leaves differ in shape, in
        dtype/device (``strict``) or in value; the message lists every failing leaf by path with
        shapes, dtypes and the max abs / rel error.
      ValueError: fewer than two trees (e.g. ``assert_trees_all_close([a, b])``).

    Example:
      >>> import torch
      >>> from yolo_func.testing import assert_trees_all_close
      >>> assert_trees_all_close({"w": torch.ones(2)}, {"w": torch.ones(2) + 1e-7}, rtol=1e-6)
      >>> try:
      ...     assert_trees_all_close({"w": torch.ones(2)}, {"w": torch.zeros(2)})
      ... except AssertionError as e:
      ...     print(str(e)[:11])
      [yolo_func]
    """
    fn = "assert_trees_all_close"
    _check_num_trees(fn, trees)
    _check_structs(fn, trees)
    lines = []
    for i, path, a, b in _pairs(trees):
        where = f"  tree {i} leaf '{path}'"
        if a.shape != b.shape:
            lines.append(f"{where}: shape {tuple(a.shape)} != {tuple(b.shape)}")
            continue
        if strict and (why := _strict_mismatch(a, b)):
            lines.append(f"{where}: {why}")
            continue
        if _same_bits(a, b):
            continue
        x, y = _common(a, b)
        ok = torch.isclose(x, y, rtol=rtol, atol=atol, equal_nan=equal_nan)
        if not bool(ok.all()):
            lines.append(f"{where}: {_error_stats(x, y, ~ok)}; [{_desc(a)} vs {_desc(b)}]")
    if lines:
        head = f"{_n(len(lines), 'leaf', 'leaves')} not close (rtol={rtol}, atol={atol}; tree 0 vs tree i)"
        _fail(fn, head, lines)


def assert_trees_all_equal(*trees: PyTree, strict: bool = False) -> None:
    """Assert that all trees have one structure and leaf-wise equal values (``torch.equal`` semantics).

    Shapes must be equal and every element equal; NaN is never equal (not even to NaN), as in
    ``torch.equal``. Without ``strict`` values are compared after promotion, so ``int64 1 == float32 1.``.

    Args:
      *trees: two or more pytrees with tensor (or number / array) leaves of any shape ``(...)``.
      strict: also require equal dtypes and devices.

    Raises:
      AssertionError: structures, shapes, dtypes/devices (``strict``) or values differ; every failing
        leaf is named by path with the count of differing elements and the max abs difference.
      ValueError: fewer than two trees (e.g. ``assert_trees_all_equal([a, b])``).

    Example:
      >>> import torch
      >>> from yolo_func.testing import assert_trees_all_equal
      >>> assert_trees_all_equal({"w": torch.ones(2)}, {"w": torch.ones(2)}, {"w": torch.ones(2)})
      >>> try:
      ...     assert_trees_all_equal({"w": torch.ones(2)}, {"w": torch.ones(2) * 2})
      ... except AssertionError as e:
      ...     print("w" in str(e))
      True
    """
    fn = "assert_trees_all_equal"
    _check_num_trees(fn, trees)
    _check_structs(fn, trees)
    lines = []
    for i, path, a, b in _pairs(trees):
        where = f"  tree {i} leaf '{path}'"
        if a.shape != b.shape:
            lines.append(f"{where}: shape {tuple(a.shape)} != {tuple(b.shape)}")
            continue
        if strict and (why := _strict_mismatch(a, b)):
            lines.append(f"{where}: {why}")
            continue
        if _same_bits(a, b):
            continue
        x, y = _common(a, b)
        ok = x == y  # NaN != NaN, as torch.equal
        if not bool(ok.all()):
            lines.append(f"{where}: {_error_stats(x, y, ~ok)}; [{_desc(a)} vs {_desc(b)}]")
    if lines:
        _fail(fn, f"{_n(len(lines), 'leaf', 'leaves')} not equal (tree 0 vs tree i)", lines)


def assert_trees_all_equal_structs(*trees: PyTree) -> None:
    """Assert that all trees have the same structure (treedef: node types, dict keys, ``None`` slots).

    Raises:
      AssertionError: with the tree diff (`` - `` only in tree 0, `` + `` only in tree i) per tree.
      ValueError: fewer than two trees.

    Example:
      >>> import torch
      >>> from yolo_func.testing import assert_trees_all_equal_structs
      >>> assert_trees_all_equal_structs({"w": torch.ones(2)}, {"w": torch.zeros(7)})
      >>> try:
      ...     assert_trees_all_equal_structs({"w": torch.ones(2)}, {"v": torch.ones(2)})
      ... except AssertionError as e:
      ...     print(str(e)[:11])
      [yolo_func]
    """
    fn = "assert_trees_all_equal_structs"
    _check_num_trees(fn, trees)
    _check_structs(fn, trees)


def assert_trees_all_equal_shapes(*trees: PyTree) -> None:
    """Assert one structure and leaf-wise equal shapes (dtypes and values may differ).

    Raises:
      AssertionError: structures differ (tree diff) or leaves differ in shape (each named by path).
      ValueError: fewer than two trees.

    Example:
      Leaves are tensors of any dtype; their ``shape`` is compared.

      >>> import torch
      >>> from yolo_func.testing import assert_trees_all_equal_shapes
      >>> assert_trees_all_equal_shapes({"w": torch.ones(2)}, {"w": torch.zeros(2, dtype=torch.int64)})
      >>> try:
      ...     assert_trees_all_equal_shapes({"w": torch.ones(2)}, {"w": torch.ones(3)})
      ... except AssertionError as e:
      ...     print(str(e)[:11])
      [yolo_func]
    """
    fn = "assert_trees_all_equal_shapes"
    _check_num_trees(fn, trees)
    _check_structs(fn, trees)
    lines = [
        f"  tree {i} leaf '{p}': shape {tuple(a.shape)} != {tuple(b.shape)}"
        for i, p, a, b in _pairs(trees)
        if a.shape != b.shape
    ]
    if lines:
        _fail(fn, f"{_n(len(lines), 'leaf differs', 'leaves differ')} in shape (tree 0 vs tree i)", lines)


def assert_trees_all_equal_dtypes(*trees: PyTree) -> None:
    """Assert one structure and leaf-wise equal dtypes (shapes and values may differ).

    Raises:
      AssertionError: structures differ (tree diff) or leaves differ in dtype (each named by path).
      ValueError: fewer than two trees.

    Example:
      >>> import torch
      >>> from yolo_func.testing import assert_trees_all_equal_dtypes
      >>> assert_trees_all_equal_dtypes({"w": torch.ones(2)}, {"w": torch.zeros(5)})    # shapes may differ
      >>> try:
      ...     assert_trees_all_equal_dtypes({"w": torch.ones(2)}, {"w": torch.ones(2).double()})
      ... except AssertionError as e:
      ...     print("float64" in str(e))
      True
    """
    fn = "assert_trees_all_equal_dtypes"
    _check_num_trees(fn, trees)
    _check_structs(fn, trees)
    lines = [
        f"  tree {i} leaf '{p}': dtype {a.dtype} != {b.dtype} (shapes {tuple(a.shape)}, {tuple(b.shape)})"
        for i, p, a, b in _pairs(trees)
        if a.dtype != b.dtype
    ]
    if lines:
        _fail(fn, f"{_n(len(lines), 'leaf differs', 'leaves differ')} in dtype (tree 0 vs tree i)", lines)


def assert_tree_all_finite(tree: PyTree) -> None:
    """Assert that every element of every leaf is finite (no NaN, no +-inf).

    Integer and bool leaves are always finite.

    Raises:
      AssertionError: naming each leaf with non-finite values, with counts of NaN / +inf / -inf, the
        index of the first one, and the leaf's shape and dtype.

    Example:
      >>> import torch
      >>> from yolo_func.testing import assert_tree_all_finite
      >>> assert_tree_all_finite({"w": torch.ones(2)})
      >>> try:
      ...     assert_tree_all_finite({"w": torch.tensor([1.0, float("nan")])})
      ... except AssertionError as e:
      ...     print("w" in str(e))
      True
    """
    lines = []
    for path, leaf in tree_items(tree):
        x = _as_tensor(leaf).detach().cpu()
        if not (x.is_floating_point() or x.is_complex()):
            continue
        fin = torch.isfinite(x)
        if bool(fin.all()):
            continue
        nan = int(torch.isnan(x).sum())
        xr = x.real if x.is_complex() else x
        pinf, ninf = int(torch.isposinf(xr).sum()), int(torch.isneginf(xr).sum())
        first = tuple(torch.nonzero(~fin)[0].tolist()) if x.dim() else ()
        lines.append(
            f"  leaf '{path}': {int((~fin).sum())}/{x.numel()} non-finite "
            f"(nan={nan}, +inf={pinf}, -inf={ninf}), first at {first}; [{_desc(_as_tensor(leaf))}]"
        )
    if lines:
        _fail("assert_tree_all_finite", f"{_n(len(lines), 'leaf has', 'leaves have')} non-finite values", lines)


def _none_paths(node: Any, path: tuple) -> list[str]:
    # optree treats None as an empty node, so tree_items cannot see it; walk the built-in containers
    # ourselves with the same path convention as tree_items (dict keys sorted, NamedTuple by field).
    if node is None:
        return ["/".join(map(str, path)) or "<root>"]
    if isinstance(node, Mapping):
        return [p for k in sorted(node, key=str) for p in _none_paths(node[k], path + (k,))]
    if isinstance(node, tuple) and hasattr(node, "_fields"):
        return [p for f, v in zip(node._fields, node) for p in _none_paths(v, path + (f,))]
    if isinstance(node, (list, tuple)):
        return [p for i, v in enumerate(node) for p in _none_paths(v, path + (i,))]
    return []


def assert_tree_no_nones(tree: PyTree) -> None:
    """Assert that the tree holds no ``None`` (which optree drops silently, misaligning trees).

    Nested ``dict`` / ``list`` / ``tuple`` / ``NamedTuple`` nodes are searched; paths follow
    :func:`yolo_func.tree.tree_items` (dict keys sorted, NamedTuple fields by name).

    Raises:
      AssertionError: naming every path that holds ``None``.

    Example:
      >>> import torch
      >>> from yolo_func.testing import assert_tree_no_nones
      >>> assert_tree_no_nones({"w": torch.ones(2)})
      >>> try:
      ...     assert_tree_no_nones({"w": torch.ones(2), "b": None})
      ... except AssertionError as e:
      ...     print("b" in str(e))
      True
    """
    paths = _none_paths(tree, ())
    if paths:
        lines = [f"  '{p}' is None" for p in paths]
        _fail("assert_tree_no_nones", _n(len(paths), "None entry", "None entries"), lines)


# ----------------------------------------------------------------------------------------------
# shapes

ShapeEntry = Any  # int | None | set[int] | frozenset[int] | Ellipsis


def _validate_expected(expected: Sequence[ShapeEntry]) -> tuple:
    exp = tuple(expected)
    if sum(e is Ellipsis for e in exp) > 1:
        raise ValueError(f"{_PREFIX}assert_shape: expected shape {exp} has more than one '...'")
    for e in exp:
        ok = (
            e is None
            or e is Ellipsis
            or (isinstance(e, int) and not isinstance(e, bool))
            or (isinstance(e, (set, frozenset)) and all(isinstance(v, int) for v in e))
        )
        if not ok:
            raise TypeError(
                f"{_PREFIX}assert_shape: expected entries are int, None, a set of ints or one '...'; "
                f"got {e!r} ({type(e).__name__}) in {exp}"
            )
    return exp


def _fmt_shape(exp: tuple) -> str:
    inner = ", ".join("..." if e is Ellipsis else repr(e) for e in exp)
    return f"({inner},)" if len(exp) == 1 else f"({inner})"


def _dim_matches(d: int, e: ShapeEntry) -> bool:
    return e is None or (d in e if isinstance(e, (set, frozenset)) else d == e)


def _shape_problem(shape: tuple[int, ...], exp: tuple) -> str | None:
    """Why ``shape`` does not match ``exp``, or None if it matches."""
    if Ellipsis in exp:
        k = exp.index(Ellipsis)
        head, tail = exp[:k], exp[k + 1 :]
        if len(shape) < len(head) + len(tail):
            return f"rank {len(shape)} < {len(head) + len(tail)} (the dims around '...')"
        pairs = list(zip(range(k), shape[:k], head))
        off = len(shape) - len(tail)
        pairs += list(zip(range(off, len(shape)), shape[off:], tail))
    else:
        if len(shape) != len(exp):
            return f"rank {len(shape)} != {len(exp)}"
        pairs = list(zip(range(len(shape)), shape, exp))
    bad = [f"dim {i} is {d}, expected {'one of ' + str(sorted(e)) if isinstance(e, (set, frozenset)) else e}"
           for i, d, e in pairs if not _dim_matches(d, e)]
    return "; ".join(bad) if bad else None


def _is_shape_like(x: Any) -> bool:
    return isinstance(x, (tuple, list, torch.Size)) and all(
        e is None or e is Ellipsis or isinstance(e, (int, set, frozenset)) for e in x
    )


def assert_shape(
    x: torch.Tensor | Sequence[torch.Tensor],
    expected: Sequence[ShapeEntry] | Sequence[Sequence[ShapeEntry]],
) -> None:
    """Assert the shape of a tensor (or of each tensor in a list) against a pattern with wildcards.

    Pattern entries: an ``int`` (that size), ``None`` (any size), a ``set`` of ints (any of them), and at
    most one ``...`` (any number of dims, including none). ``Dimensions`` lookups build patterns:
    ``assert_shape(boxes, dims["BM4"])``.

    Args:
      x: a tensor (anything with ``.shape``), or a list/tuple of them.
      expected: one pattern, e.g. ``(B, None, 4)`` or ``(..., {3, 4})``; with a list ``x`` either one
        pattern for all tensors or a list of patterns, one per tensor.

    Raises:
      AssertionError: naming each mismatching input (``x[i]`` for lists), its shape, the pattern and
        the failing dims.
      ValueError / TypeError: a malformed pattern, or a list of patterns of the wrong length.

    Example:
      >>> import torch
      >>> from yolo_func.testing import assert_shape
      >>> assert_shape(torch.zeros(2, 84, 4), (2, None, 4))           # None: any size
      >>> assert_shape([torch.zeros(3, 4), torch.zeros(5, 4)], (..., 4))   # ...: any leading dims
      >>> try:
      ...     assert_shape(torch.zeros(2, 3), (2, 4))
      ... except AssertionError as e:
      ...     print(str(e)[:11])
      [yolo_func]
    """
    if isinstance(x, (list, tuple)):
        items = [(f"x[{i}]", t) for i, t in enumerate(x)]
        if _is_shape_like(expected):
            pats = [_validate_expected(expected)] * len(items)
        else:
            pats = [_validate_expected(e) for e in expected]
            if len(pats) != len(items):
                raise ValueError(
                    f"{_PREFIX}assert_shape: got {len(items)} inputs but {len(pats)} expected shapes; "
                    "pass one pattern for all or one per input"
                )
    else:
        if not isinstance(expected, (tuple, list, torch.Size)):
            raise TypeError(f"{_PREFIX}assert_shape: expected must be a shape pattern (tuple), got {expected!r}")
        items, pats = [("x", x)], [_validate_expected(expected)]
    lines = []
    for (name, t), pat in zip(items, pats):
        if not hasattr(t, "shape"):
            raise TypeError(f"{_PREFIX}assert_shape: {name} has no shape (got {type(t).__name__})")
        shape = tuple(int(d) for d in t.shape)
        why = _shape_problem(shape, pat)
        if why:
            lines.append(f"  {name}: shape {shape} does not match {_fmt_shape(pat)}: {why}")
    if lines:
        _fail("assert_shape", f"{_n(len(lines), 'shape mismatch', 'shape mismatches')}", lines)


class Dimensions:
    """Named dimension sizes for building shape patterns, after ``chex.Dimensions``.

    ``dims = Dimensions(B=2, A=8400, M=7, K=80, NM=32)``; then

    - ``dims.B`` -> ``2``;
    - ``dims["BA4"]`` -> ``(2, 8400, 4)``. String lookup reads one character per dimension: each
      letter is a single-letter name; a run of digits is one literal size (``"B16"`` -> ``(2, 16)``);
      ``*`` is a wildcard (``None``); ``...`` is ``Ellipsis``. Spaces are ignored.
    - ``dims["B", "NM", 4]`` -> ``(2, 32, 4)``. Tuple lookup takes whole names (so multi-letter names
      such as ``NM`` work), ints as literal sizes, and ``None`` / ``...`` as themselves.

    A name set to ``None`` acts as a wildcard. Unknown names raise ``KeyError`` listing the known ones.

    Example:
      >>> import torch
      >>> from yolo_func.testing import Dimensions, assert_shape
      >>> dims = Dimensions(B=2, A=84, K=5)
      >>> dims["BAK"]
      (2, 84, 5)
      >>> assert_shape(torch.zeros(2, 84, 5), dims["BAK"])
    """

    def __init__(self, **sizes: int | None) -> None:
        for k, v in sizes.items():
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise TypeError(f"{_PREFIX}Dimensions: {k} must be a non-negative int or None, got {v!r}")
        object.__setattr__(self, "_sizes", dict(sizes))

    def __getattr__(self, name: str) -> int | None:
        sizes = object.__getattribute__(self, "_sizes")
        if name in sizes:
            return sizes[name]
        raise AttributeError(f"{_PREFIX}Dimensions has no {name!r}; known: {sorted(sizes)}")

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"{_PREFIX}Dimensions is immutable; use dims.replace({name}=...)")

    def replace(self, **sizes: int | None) -> Dimensions:
        """A copy with some sizes changed or added."""
        return Dimensions(**{**self._sizes, **sizes})

    def _lookup(self, name: str) -> int | None:
        if name not in self._sizes:
            raise KeyError(f"{_PREFIX}Dimensions has no {name!r}; known: {sorted(self._sizes)}")
        return self._sizes[name]

    def __getitem__(self, key: str | tuple) -> tuple:
        if isinstance(key, tuple):
            out = []
            for k in key:
                if isinstance(k, str):
                    out.append(self._lookup(k))
                elif k is None or k is Ellipsis or (isinstance(k, int) and not isinstance(k, bool)):
                    out.append(k)
                else:
                    raise TypeError(f"{_PREFIX}Dimensions[...] entries are names, ints, None or ...; got {k!r}")
            return tuple(out)
        if not isinstance(key, str):
            raise TypeError(
                f"{_PREFIX}Dimensions[...] takes a str like 'BA4' or a tuple, got {type(key).__name__}"
            )
        out, i, s = [], 0, key.replace(" ", "")
        while i < len(s):
            c = s[i]
            if s.startswith("...", i):
                out.append(Ellipsis)
                i += 3
            elif c.isdigit():
                j = i
                while j < len(s) and s[j].isdigit():
                    j += 1
                out.append(int(s[i:j]))
                i = j
            elif c == "*":
                out.append(None)
                i += 1
            elif c.isalpha():
                out.append(self._lookup(c))
                i += 1
            else:
                raise ValueError(f"{_PREFIX}Dimensions[{key!r}]: unexpected character {c!r}")
        return tuple(out)

    def __repr__(self) -> str:
        return "Dimensions(" + ", ".join(f"{k}={v}" for k, v in self._sizes.items()) + ")"

