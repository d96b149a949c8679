"""Pytree utilities: the only module in yolo_func that calls optree.

A pytree here is a nested plain ``dict[str, ...]`` (sorted keys, as optree orders them), tuples,
lists and NamedTuples, with ``torch.Tensor`` leaves. ``None`` is structure, not a leaf (optree's
default), so trees with optional fields still line up. Paths are ``"/"``-joined key paths such as
``"network/backbone/stem/conv/weight"``; they are what error messages and regexes see.

Everything except :func:`tree_copy_` (and its list form :func:`foreach_copy_`) is pure. They are
the sanctioned in-place helpers: they write into static buffers (CUDA-graph capture, in-place
optimizer updates).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import optree
import torch

__all__ = [
    "NAMESPACE",
    "tree_map",
    "tree_leaves",
    "tree_first_leaf",
    "tree_structure",
    "tree_flatten",
    "tree_unflatten",
    "tree_paths",
    "tree_items",
    "tree_flat_dict",
    "tree_from_flat_dict",
    "tree_get",
    "tree_add",
    "tree_sub",
    "tree_scale",
    "tree_zeros_like",
    "tree_ravel",
    "tree_count",
    "tree_cast",
    "tree_to",
    "tree_static_like",
    "tree_copy_",
    "foreach_copy_",
    "tree_clone",
    "tree_clone_flat",
    "tree_diff",
    "tree_where",
    "flat_leafwise",
]

#: optree namespace for any registered node types of this package.
NAMESPACE = "yolo_func"

PyTree = Any


def _accessor_str(accessor) -> str:
    # NamedTuple (and dataclass) entries are named by field, dict entries by key, sequences by index.
    return "/".join(str(getattr(e, "field", None) or e.entry) for e in accessor)


def tree_map(fn: Callable[..., Any], tree: PyTree, *rest: PyTree) -> PyTree:
    """Apply ``fn`` leaf-wise over one or more trees of identical structure.

    Example:
      >>> import torch
      >>> from yolo_func import tree
      >>> t = {"w": torch.ones(2, 3), "b": {"x": torch.zeros(2)}}
      >>> tree.tree_map(lambda x: x.shape, t)
      {'w': torch.Size([2, 3]), 'b': {'x': torch.Size([2])}}
      >>> tree.tree_map(torch.add, t, t)["w"][0]
      tensor([2., 2., 2.])
    """
    return optree.tree_map(fn, tree, *rest, namespace=NAMESPACE)


def tree_leaves(tree: PyTree) -> list[Any]:
    """Leaves in optree order (dict keys sorted).

    Example:
      >>> import torch
      >>> from yolo_func import tree
      >>> t = {"w": torch.ones(2, 3), "b": {"x": torch.zeros(2)}}
      >>> [tuple(x.shape) for x in tree.tree_leaves(t)]   # keys sorted: b/x, then w
      [(2,), (2, 3)]
    """
    return optree.tree_leaves(tree, namespace=NAMESPACE)


def tree_first_leaf(tree: PyTree, where: Callable[[Any], bool] | None = None) -> Any:
    """The first leaf in :func:`tree_leaves` order for which ``where(leaf)`` is true (any leaf
    when ``where`` is None), or None.

    Plain dicts (sortable keys), lists and tuples are descended lazily, so a match near the front
    of a large tree costs a few steps instead of flattening every leaf (~0.2 ms for a nano
    network's params on the CPU, once per training step for their dtype); any other node is
    flattened as :func:`tree_leaves` would.

    Example:
      >>> import torch
      >>> from yolo_func import tree
      >>> t = {"w": torch.ones(2), "b": {"n": torch.tensor(3), "x": torch.zeros(2)}}
      >>> tree.tree_first_leaf(t, lambda x: x.is_floating_point())      # b/n is an integer
      tensor([0., 0.])
    """
    if type(tree) is dict:
        try:
            children = [tree[k] for k in sorted(tree)]
        except TypeError:  # keys that do not sort: optree's insertion order, through the flatten
            children = None
    else:
        children = list(tree) if type(tree) in (list, tuple) else None
    if children is None:
        return next((x for x in tree_leaves(tree) if where is None or where(x)), None)
    for child in children:
        found = tree_first_leaf(child, where)
        if found is not None:
            return found
    return None


def tree_structure(tree: PyTree) -> optree.PyTreeSpec:
    """The treedef of ``tree``.

    Example:
      >>> import torch
      >>> from yolo_func import tree
      >>> t = {"w": torch.ones(2, 3), "b": {"x": torch.zeros(2)}}
      >>> tree.tree_structure(t).num_leaves
      2
    """
    return optree.tree_structure(tree, namespace=NAMESPACE)


def tree_flatten(tree: PyTree) -> tuple[list[Any], optree.PyTreeSpec]:
    """``(leaves, treedef)``.

    Example:
      >>> import torch
      >>> from yolo_func import tree
      >>> t = {"w": torch.ones(2, 3), "b": {"x": torch.zeros(2)}}
      >>> leaves, treedef = tree.tree_flatten(t)
      >>> len(leaves), treedef.num_leaves
      (2, 2)
    """
    return optree.tree_flatten(tree, namespace=NAMESPACE)


def tree_unflatten(treedef: optree.PyTreeSpec, leaves: Iterable[Any]) -> PyTree:
    """Inverse of :func:`tree_flatten`.

    Example:
      >>> import torch
      >>> from yolo_func import tree
      >>> t = {"w": torch.ones(2, 3), "b": {"x": torch.zeros(2)}}
      >>> leaves, treedef = tree.tree_flatten(t)
      >>> tree.tree_unflatten(treedef, [x + 1 for x in leaves])["b"]["x"]
      tensor([1., 1.])
    """
    return optree.tree_unflatten(treedef, list(leaves))


def tree_paths(tree: PyTree) -> list[str]:
    """``"/"``-joined paths of every leaf, in leaf order (NamedTuple fields by name, dict entries by
    key, sequence entries by index).

    Example:
      >>> import torch
      >>> from yolo_func import tree
      >>> t = {"w": torch.ones(2, 3), "b": {"x": torch.zeros(2)}}
      >>> tree.tree_paths(t)
      ['b/x', 'w']
    """
    return [_accessor_str(a) for a in optree.tree_accessors(tree, namespace=NAMESPACE)]


def tree_items(tree: PyTree) -> list[tuple[str, Any]]:
    """``[(path, leaf), ...]`` in leaf order.

    Example:
      >>> import torch
      >>> from yolo_func import tree
      >>> t = {"w": torch.ones(2, 3), "b": {"x": torch.zeros(2)}}
      >>> [(p, tuple(x.shape)) for p, x in tree.tree_items(t)]
      [('b/x', (2,)), ('w', (2, 3))]
    """
    return list(zip(tree_paths(tree), tree_leaves(tree)))


def tree_flat_dict(tree: PyTree) -> dict[str, Any]:
    """``{path: leaf}`` for every leaf.

    Example:
      >>> import torch
      >>> from yolo_func import tree
      >>> t = {"w": torch.ones(2, 3), "b": {"x": torch.zeros(2)}}
      >>> {k: tuple(v.shape) for k, v in tree.tree_flat_dict(t).items()}
      {'b/x': (2,), 'w': (2, 3)}
    """
    return dict(tree_items(tree))


def tree_from_flat_dict(flat: Mapping[str, Any]) -> dict:
    """Rebuild a nested plain-dict tree from ``{"a/b/c": leaf}`` (inverse of :func:`tree_flat_dict`
    for dict-only trees).

    Raises:
      ValueError: a path is both a leaf and a prefix of another path.

    Example:
      >>> import torch
      >>> from yolo_func import tree
      >>> t = {"w": torch.ones(2, 3), "b": {"x": torch.zeros(2)}}
      >>> back = tree.tree_from_flat_dict(tree.tree_flat_dict(t))
      >>> sorted(back), sorted(back["b"])
      (['b', 'w'], ['x'])
    """
    out: dict = {}
    for path, leaf in flat.items():
        keys = path.split("/")
        node = out
        for k in keys[:-1]:
            nxt = node.setdefault(k, {})
            if not isinstance(nxt, dict):
                raise ValueError(f"[yolo_func] path {path!r} runs through leaf {k!r}")
            node = nxt
        if keys[-1] in node:
            raise ValueError(f"[yolo_func] path {path!r} is both a leaf and a subtree")
        node[keys[-1]] = leaf
    return out


def tree_get(tree: PyTree, path: str) -> Any:
    """The subtree or leaf of a dict tree at ``"a/b/c"``.

    Raises:
      KeyError: naming the first missing key and the keys available there.

    Example:
      >>> import torch
      >>> from yolo_func import tree
      >>> t = {"w": torch.ones(2, 3), "b": {"x": torch.zeros(2)}}
      >>> tree.tree_get(t, "b/x")
      tensor([0., 0.])
    """
    node = tree
    for k in path.split("/") if path else []:
        if not isinstance(node, Mapping) or k not in node:
            have = sorted(node) if isinstance(node, Mapping) else type(node).__name__
            raise KeyError(f"[yolo_func] no {k!r} on the way to {path!r}; have {have}")
        node = node[k]
    return node


def tree_add(a: PyTree, b: PyTree) -> PyTree:
    """Leaf-wise ``a + b``.

    Example:
      >>> import torch
      >>> from yolo_func import tree
      >>> t = {"w": torch.ones(2, 3), "b": {"x": torch.zeros(2)}}
      >>> tree.tree_add(t, t)["w"].sum().item()
      12.0
    """
    return tree_map(torch.add, a, b)


def tree_sub(a: PyTree, b: PyTree) -> PyTree:
    """Leaf-wise ``a - b``.

    Example:
      >>> import torch
      >>> from yolo_func import tree
      >>> t = {"w": torch.ones(2, 3), "b": {"x": torch.zeros(2)}}
      >>> tree.tree_sub(t, t)["w"].abs().sum().item()
      0.0
    """
    return tree_map(torch.sub, a, b)


def tree_scale(tree: PyTree, scale: float | torch.Tensor) -> PyTree:
    """Leaf-wise ``leaf * scale``.

    Example:
      Leaves keep their shapes and dtypes (``float[...]`` times a Python float or a ``float[]`` tensor).

      >>> import torch
      >>> from yolo_func import tree
      >>> t = {"w": torch.ones(2, 3), "b": {"x": torch.zeros(2)}}
      >>> tree.tree_scale(t, 0.5)["w"][0]
      tensor([0.5000, 0.5000, 0.5000])
    """
    return tree_map(lambda x: x * scale, tree)


def tree_zeros_like(tree: PyTree) -> PyTree:
    """Zeros shaped, typed and placed like every leaf.

    Example:
      >>> import torch
      >>> from yolo_func import tree
      >>> t = {"w": torch.ones(2, 3), "b": {"x": torch.zeros(2)}}
      >>> z = tree.tree_zeros_like(t)
      >>> z["w"].shape, z["w"].sum().item()
      (torch.Size([2, 3]), 0.0)
    """
    return tree_map(torch.zeros_like, tree)


def tree_ravel(tree: PyTree) -> tuple[torch.Tensor, Callable[[torch.Tensor], PyTree]]:
    """Concatenate all leaves into one flat vector; return it and the function that undoes it.

    Leaves must share a dtype and device. Returns ``(flat float[N], unravel)`` where
    ``unravel(flat)`` rebuilds the tree (views into ``flat``, reshaped).

    Example:
      >>> import torch
      >>> from yolo_func import tree
      >>> t = {"w": torch.ones(2, 3), "b": {"x": torch.zeros(2)}}
      >>> flat, unravel = tree.tree_ravel(t)
      >>> flat.shape
      torch.Size([8])
      >>> unravel(flat * 2)["w"][0]
      tensor([2., 2., 2.])
    """
    leaves, treedef = tree_flatten(tree)
    if not leaves:
        return torch.zeros(0), lambda flat: tree_unflatten(treedef, [])
    dtypes = {x.dtype for x in leaves}
    if len(dtypes) > 1:
        raise TypeError(f"[yolo_func] tree_ravel needs one dtype; got {sorted(map(str, dtypes))}")
    shapes = [x.shape for x in leaves]
    sizes = [x.numel() for x in leaves]
    flat = torch.cat([x.reshape(-1) for x in leaves])

    def unravel(vec: torch.Tensor) -> PyTree:
        if vec.numel() != sum(sizes):
            raise ValueError(f"[yolo_func] unravel expected {sum(sizes)} elements, got {vec.numel()}")
        parts = torch.split(vec, sizes)
        return tree_unflatten(treedef, [p.reshape(s) for p, s in zip(parts, shapes)])

    return flat, unravel


def tree_count(tree: PyTree) -> int:
    """Total number of elements over all tensor leaves.

    Example:
      >>> import torch
      >>> from yolo_func import tree
      >>> t = {"w": torch.ones(2, 3), "b": {"x": torch.zeros(2)}}
      >>> tree.tree_count(t)
      8
    """
    return sum(int(x.numel()) for x in tree_leaves(tree))


def tree_cast(tree: PyTree, dtype: torch.dtype) -> PyTree:
    """Cast floating-point leaves to ``dtype``; integer and bool leaves are left alone.

    Example:
      >>> import torch
      >>> from yolo_func import tree
      >>> h = tree.tree_cast({"w": torch.ones(2), "n": torch.ones(2, dtype=torch.int64)}, torch.bfloat16)
      >>> h["w"].dtype, h["n"].dtype
      (torch.bfloat16, torch.int64)
    """
    return tree_map(lambda x: x.to(dtype) if x.is_floating_point() else x, tree)


def tree_to(
    tree: PyTree,
    device: torch.device | str | None = None,
    *,
    dtype: torch.dtype | None = None,
    channels_last: bool = False,
) -> PyTree:
    """Move every leaf to ``device`` (and cast floating leaves to ``dtype`` when given).

    With ``channels_last=True`` 4-D leaves (conv kernels) are laid out NHWC in memory.

    Example:
      >>> import torch
      >>> from yolo_func import tree
      >>> t = {"w": torch.ones(2, 3), "b": {"x": torch.zeros(2)}}
      >>> tree.tree_to(t, "cpu", dtype=torch.float64)["w"].dtype
      torch.float64
    """

    def move(x: torch.Tensor) -> torch.Tensor:
        y = x.to(device=device, dtype=dtype if (dtype is not None and x.is_floating_point()) else None)
        if channels_last and y.dim() == 4:
            y = y.contiguous(memory_format=torch.channels_last)
        return y

    return tree_map(move, tree)


def tree_static_like(tree: PyTree) -> PyTree:
    """Fresh buffers with each leaf's shape, dtype, device and memory layout, holding a copy of it.

    These are the static buffers a CUDA graph reads and writes; update them with :func:`tree_copy_`.

    Example:
      >>> import torch
      >>> from yolo_func import tree
      >>> t = {"w": torch.ones(2, 3), "b": {"x": torch.zeros(2)}}
      >>> s = tree.tree_static_like(t)
      >>> torch.equal(s["w"], t["w"]), s["w"].data_ptr() != t["w"].data_ptr()
      (True, True)
    """
    return tree_clone(tree)


def tree_where(flag: torch.Tensor, new: PyTree, old: PyTree | float, *, fused: bool = True) -> PyTree:
    """Leaf-wise ``torch.where(flag, new, old)`` with a device ``bool[]`` flag: choose a whole tree
    on the device without a host sync (e.g. skip a non-finite step). NaN in the unchosen tree does
    not leak through.

    Args:
      flag: bool[] on the leaves' device.
      new: pytree of tensors.
      old: a tree like ``new`` or a Python number (e.g. ``0.0`` to zero a tree).
      fused: select the dense leaves of one dtype together (see :func:`flat_leafwise`): a few
        kernels instead of one per leaf, for some host time spent building flat views. The values
        are the same either way.

    Example:
      >>> import torch
      >>> from yolo_func import tree
      >>> t = {"w": torch.ones(2, 3), "b": {"x": torch.zeros(2)}}
      >>> new = tree.tree_scale(t, 2.0)
      >>> tree.tree_where(torch.tensor(False), new, t)["w"][0]     # keep the old tree
      tensor([1., 1., 1.])
    """
    n_leaves, treedef = tree_flatten(new)
    if isinstance(old, (int, float, bool)):
        return tree_unflatten(treedef, flat_leafwise(lambda n: torch.where(flag, n, old), n_leaves, fused=fused))
    o_leaves, o_def = tree_flatten(old)
    if o_def != treedef:
        raise ValueError("[yolo_func] tree_where: structures differ\n" + tree_diff(new, old, names=("new", "old")))
    return tree_unflatten(treedef, flat_leafwise(lambda n, o: torch.where(flag, n, o), n_leaves, o_leaves, fused=fused))


def flat_leafwise(fn: Callable[..., torch.Tensor], *lists: list[torch.Tensor], fused: bool = True) -> list[torch.Tensor]:
    """``[fn(*xs) for xs in zip(*lists)]`` for an *elementwise* ``fn``, in a few kernels.

    Leaves that are contiguous or 4-D channels_last, and whose partners in the other lists have the
    same shape, strides, dtype and device, are concatenated per (dtype, device) into one flat
    buffer each; ``fn`` runs once per group and the results come back as views with each leaf's
    own shape and strides. Other leaves get ``fn`` one by one. The values equal the per-leaf
    results (an elementwise op does not depend on layout); one kernel replaces one per leaf
    (host time in an eager step, launches in a captured one).

    Args:
      fn: elementwise, returning a tensor of its first argument's shape.
      lists: equally long lists of tensors.
      fused: False applies ``fn`` leaf by leaf (one kernel per leaf, less host work per leaf).

    Returns:
      list of tensors, one per position.

    Example:
      >>> import torch
      >>> from yolo_func.tree import flat_leafwise
      >>> flat_leafwise(torch.mul, [torch.ones(2), torch.ones(3)], [torch.full((2,), 2.0), torch.full((3,), 3.0)])
      [tensor([2., 2.]), tensor([3., 3., 3.])]
    """
    first = lists[0]
    if not fused:
        return [fn(*xs) for xs in zip(*lists)]
    # Host time matters here (it runs on every eager step): each leaf's flat view is built once.
    views = [_flat_view(x) for x in first]
    for other in lists[1:]:
        for i, (v, x, y) in enumerate(zip(views, first, other)):
            if v is not None and not (isinstance(y, torch.Tensor) and y.dtype == x.dtype and y.stride() == x.stride()
                                      and y.shape == x.shape and y.get_device() == x.get_device()):
                views[i] = None
    out: list[Any] = [None] * len(first)
    for i, v in enumerate(views):
        if v is None:
            out[i] = fn(*(l[i] for l in lists))
    for idx in _flat_groups(first, views):
        flats = [torch.cat([views[i] for i in idx])]
        flats += [torch.cat([_flat_view(l[i]) for i in idx]) for l in lists[1:]]
        _scatter_views(fn(*flats), idx, first, out)
    return out


def tree_clone_flat(tree: PyTree, *, fused: bool = True) -> PyTree:
    """Like :func:`tree_clone` (detached copies, same shapes and strides); when ``fused`` (default)
    the contiguous and channels_last leaves of each dtype are copied by one concatenation and
    returned as views of it: a couple of kernels instead of one copy per leaf (e.g. the BN
    statistics a training step updates).

    Example:
      >>> import torch
      >>> from yolo_func import tree
      >>> t = {"w": torch.ones(2, 3), "b": {"x": torch.zeros(2)}}
      >>> c = tree.tree_clone_flat(t)
      >>> torch.equal(c["w"], t["w"]), c["w"].data_ptr() != t["w"].data_ptr()
      (True, True)
    """
    if not fused:
        return tree_clone(tree)
    leaves, treedef = tree_flatten(tree)
    views = [_flat_view(x) for x in leaves]
    out: list[Any] = [x.detach().clone(memory_format=torch.preserve_format) if v is None else None
                      for x, v in zip(leaves, views)]
    for idx in _flat_groups(leaves, views):
        with torch.no_grad():
            flat = torch.cat([views[i] for i in idx])
        _scatter_views(flat, idx, leaves, out)
    return tree_unflatten(treedef, out)


def _flat_groups(leaves: list[Any], views: list[torch.Tensor | None]) -> list[list[int]]:
    """Indices of the leaves that have a flat view, grouped by (dtype, device)."""
    groups: dict[tuple, list[int]] = {}
    for i, (x, v) in enumerate(zip(leaves, views)):
        if v is not None:
            groups.setdefault((x.dtype, x.device), []).append(i)
    return list(groups.values())


def _scatter_views(flat: torch.Tensor, idx: list[int], like: list[Any], out: list[Any]) -> None:
    """``out[i]`` = the chunk of ``flat`` for leaf ``i``, viewed with ``like[i]``'s shape and strides."""
    for i, chunk in zip(idx, flat.split([like[i].numel() for i in idx])):
        out[i] = _unflat_view(chunk, like[i])


def _flat_view(x: Any) -> torch.Tensor | None:
    """A 1-D view of ``x`` in its memory order (contiguous, or 4-D channels_last), else None."""
    if not isinstance(x, torch.Tensor) or x.dim() == 0:
        return None
    if x.dim() == 1 and x.is_contiguous():
        return x  # already flat: no view op (host time in an eager step)
    if x.is_contiguous():
        return x.view(-1)
    if x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last):
        return x.permute(0, 2, 3, 1).reshape(-1)
    return None


def _unflat_view(chunk: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Invert :func:`_flat_view`: ``chunk`` viewed with ``like``'s shape and strides."""
    if like.dim() == 1:
        return chunk
    if like.is_contiguous():
        return chunk.view(like.shape)
    n, c, h, w = like.shape
    return chunk.view(n, h, w, c).permute(0, 3, 1, 2)


def tree_clone(tree: PyTree) -> PyTree:
    """Detached copies of every leaf (same layout).

    Example:
      >>> import torch
      >>> from yolo_func import tree
      >>> t = {"w": torch.ones(2, 3), "b": {"x": torch.zeros(2)}}
      >>> c = tree.tree_clone(t)
      >>> c["w"].add_(1); t["w"][0, 0].item()      # the original is untouched
      tensor([[2., 2., 2.],
              [2., 2., 2.]])
      1.0
    """
    return tree_map(lambda x: x.detach().clone(memory_format=torch.preserve_format), tree)


def tree_copy_(dst: PyTree, src: PyTree) -> PyTree:
    """Copy ``src`` into ``dst`` in place, leaf by leaf, with one fused multi-tensor copy.

    The one sanctioned in-place tree operation. Structures must match.

    Raises:
      ValueError: the structures differ (message lists the differing paths).

    Example:
      >>> import torch
      >>> from yolo_func import tree
      >>> t = {"w": torch.ones(2, 3), "b": {"x": torch.zeros(2)}}
      >>> dst = tree.tree_zeros_like(t)
      >>> _ = tree.tree_copy_(dst, t)
      >>> dst["w"].sum().item()
      6.0
    """
    d_leaves, d_def = tree_flatten(dst)
    s_leaves, s_def = tree_flatten(src)
    if d_def != s_def:
        raise ValueError("[yolo_func] tree_copy_: structures differ\n" + tree_diff(dst, src, names=("dst", "src")))
    foreach_copy_(d_leaves, s_leaves)
    return dst


def foreach_copy_(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """``dst[i].copy_(src[i])`` for every i, as one multi-tensor copy per (dtype, device).

    ``torch._foreach_copy_`` takes its fused path only when every tensor shares one dtype and
    device; a mixed list (float parameters with int64 counters, say) would fall back to one copy
    kernel per leaf.

    Example:
      >>> import torch
      >>> from yolo_func.tree import foreach_copy_
      >>> dst, src = [torch.zeros(2), torch.zeros(3)], [torch.ones(2), torch.full((3,), 2.0)]
      >>> foreach_copy_(dst, src)
      >>> dst[1]
      tensor([2., 2., 2.])
    """
    groups: dict[tuple, list[int]] = {}
    for i, (d, s_) in enumerate(zip(dst, src)):
        groups.setdefault((d.dtype, d.device, s_.dtype, s_.device), []).append(i)
    for idx in groups.values():
        torch._foreach_copy_([dst[i] for i in idx], [src[i] for i in idx])


def tree_diff(a: PyTree, b: PyTree, *, names: tuple[str, str] = ("a", "b")) -> str:
    """Human-readable difference of two trees' paths and leaf shapes.

    Lines start with `` - `` (only in ``a``), `` + `` (only in ``b``) or `` ~ `` (shape differs).
    Empty string if paths and shapes agree.

    Example:
      >>> import torch
      >>> from yolo_func import tree
      >>> print(tree.tree_diff({"w": torch.ones(2), "b": torch.ones(1)}, {"w": torch.ones(3)}))
       - b (only in a)
       ~ w: a [2] != b [3]
    """
    fa = tree_flat_dict(a)
    fb = tree_flat_dict(b)
    lines = []
    for p in sorted(set(fa) - set(fb)):
        lines.append(f" - {p} (only in {names[0]})")
    for p in sorted(set(fb) - set(fa)):
        lines.append(f" + {p} (only in {names[1]})")
    for p in sorted(set(fa) & set(fb)):
        sa = tuple(getattr(fa[p], "shape", ()))
        sb = tuple(getattr(fb[p], "shape", ()))
        if sa != sb:
            lines.append(f" ~ {p}: {names[0]} {list(sa)} != {names[1]} {list(sb)}")
    return "\n".join(lines)
