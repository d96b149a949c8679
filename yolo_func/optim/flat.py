"""Flat buffers for the optimizer, the non-finite guard and the EMA: elementwise tree ops as one
kernel per flat buffer, with no copy when the leaves already live in one.

The state a training step carries — the guard's inner optimizer state (momenta, accumulated
gradients, Adam moments), the BN statistics and the EMA — comes out of :func:`leafwise` as *views
into one flat buffer per (dtype, device)*: each leaf is a chunk of the buffer in its own memory
order (contiguous, or NHWC for a channels_last 4-D leaf), in tree order. :func:`flat_base`
recognises such a list on the host from tensor metadata alone (``_base``, storage offsets,
strides; no aten op), so on the next step :func:`leafwise` runs the op on the buffer itself:
no per-leaf ``view``, no ``cat`` copying the whole model, one kernel. Leaves that do not tile a
buffer (e.g. fresh gradients) are concatenated once per group as before (:func:`yolo_func.tree.
flat_leafwise`), and the result is again a flat buffer with views.

Numerics: ``fn`` is elementwise and sees the same elements at the same positions of a buffer laid
out the same way (one group per (dtype, device), leaves in tree order) whether the buffer was
recognised or concatenated, so the results are bitwise equal to :func:`yolo_func.tree.flat_leafwise`
(and to the per-leaf op for exact ops such as ``where``).

The tree API is unchanged: trees keep their structure, shapes, strides and dtypes; only where
their memory lives changes. Views into a buffer stay valid as long as the leaves do (nothing is
reallocated under them); a captured step copies its new carry into its static buffers with
``tree_copy_`` as before.

Example:
  >>> import torch
  >>> a = [torch.ones(2, 3), torch.zeros(4)]
  >>> out = leafwise(lambda x: x * 2, a)            # concatenated once, views of one buffer
  >>> flat_base(out).shape, [tuple(x.shape) for x in out]
  (torch.Size([10]), [(2, 3), (4,)])
  >>> again = leafwise(lambda x: x + 1, out)         # recognised: no view, no cat
  >>> again[0].tolist()
  [[3.0, 3.0, 3.0], [3.0, 3.0, 3.0]]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from yolo_func import tree as T
from yolo_func.optim.base import host_flag
from yolo_func.tree import _flat_groups, _flat_view, _scatter_views

__all__ = ["flat_base", "leafwise", "tree_where", "set_enabled", "enabled"]

_ENABLED = True


def set_enabled(on: bool) -> bool:
    """Turn the recognition of flat-backed leaves on or off (process-wide); returns the old value.

    Off, :func:`leafwise` is :func:`yolo_func.tree.flat_leafwise` (always concatenates). For
    parity tests and benchmarks: the values are the same either way.
    """
    global _ENABLED
    old, _ENABLED = _ENABLED, bool(on)
    return old


def enabled() -> bool:
    """Whether :func:`leafwise` recognises flat-backed leaves."""
    return _ENABLED


def _dense_in_memory_order(x: torch.Tensor) -> bool:
    return x.is_contiguous() or (x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last))


def flat_base(leaves: list[Any]) -> torch.Tensor | None:
    """The 1-D buffer that ``leaves`` tile exactly, in order, each in its memory order; else None.

    Host metadata only (no aten op is dispatched): every leaf is a view whose ``_base`` is the same
    contiguous 1-D tensor of the leaves' dtype, the leaves are dense (contiguous, or channels_last
    4-D), start where the previous one ended, and together cover the whole buffer.

    Args:
      leaves: a list of tensors (any shapes, one dtype).

    Returns:
      ``float[N]`` (the leaves' dtype) with ``N = sum(numel)``, or None.
    """
    if not leaves:
        return None
    first = leaves[0]
    if not isinstance(first, torch.Tensor):
        return None
    base = first._base
    if base is None or base.dim() != 1 or base.dtype != first.dtype or not base.is_contiguous():
        return None
    offset = base.storage_offset()
    for x in leaves:
        if (not isinstance(x, torch.Tensor) or x._base is not base or x.dim() == 0
                or x.storage_offset() != offset or not _dense_in_memory_order(x)):
            return None
        offset += x.numel()
    if offset - base.storage_offset() != base.numel():
        return None
    return base


def leafwise(fn: Callable[..., torch.Tensor], *lists: list[torch.Tensor],
             fn_out: Callable[..., Any] | None = None) -> list[torch.Tensor]:
    """``[fn(*xs) for xs in zip(*lists)]`` for an elementwise ``fn``, one call per flat buffer.

    The leaves of ``lists[0]`` are grouped by (dtype, device) as
    :func:`yolo_func.tree.flat_leafwise` groups them; a group whose leaves (in every list) tile a
    buffer (:func:`flat_base`) passes that buffer to ``fn`` as it is, any other group is
    concatenated. Results are views into ``fn``'s output, one buffer per group, with each leaf's
    shape and strides (so they tile it, and the next call recognises them). Leaves without a flat
    view (0-dim, non-dense) or whose partners differ in shape, strides or dtype get ``fn`` one by
    one.

    With ``fn_out`` (``fn``'s ``out=`` form, e.g. ``torch.where(flag, a, b, out=out)``), a
    floating group with a list to concatenate does it differently: that list is copied (one
    ``_foreach_copy_``) into views of a buffer allocated here, and ``fn_out`` writes the result into
    that same buffer, whose views are the results. The same bytes move as with ``torch.cat``, but
    the leaves are viewed once instead of twice (in and out). ``out`` aliases one of the inputs
    exactly (same elements, same positions), which elementwise ops allow; the buffer is never
    visible outside this call before it holds the result.

    Args:
      fn: elementwise, returning a tensor shaped like its first argument.
      lists: equally long lists of tensors.
      fn_out: optional ``(*flats, out) -> None``, the same values as ``fn`` written into ``out``.

    Returns:
      list of tensors, one per position.
    """
    if not _ENABLED:
        return T.flat_leafwise(fn, *lists)
    first = lists[0]
    # Metadata only: which leaves can join a flat group. The per-leaf 1-D views (one aten op each)
    # are built only for the groups that are not recognised as tiling a buffer already.
    ok = [_has_flat_view(x) for x in first]
    for other in lists[1:]:
        for i, (v, x, y) in enumerate(zip(ok, first, other)):
            if v and not (isinstance(y, torch.Tensor) and y.dtype == x.dtype and y.stride() == x.stride()
                          and y.shape == x.shape and y.get_device() == x.get_device()):
                ok[i] = False
    out: list[Any] = [None] * len(first)
    for i, v in enumerate(ok):
        if not v:
            out[i] = fn(*(l[i] for l in lists))
    for idx in _flat_groups(first, [x if v else None for x, v in zip(first, ok)]):
        flats, owned = [], None
        floating = first[idx[0]].is_floating_point()
        for l in lists:
            sub = [l[i] for i in idx]
            base = flat_base(sub)
            if base is None:
                if fn_out is not None and owned is None and floating:
                    # Copy this list into our own buffer, viewed like the results will be; the
                    # result is written there (fn_out), so these views are the results.
                    base = torch.empty(sum(x.numel() for x in sub), dtype=sub[0].dtype, device=sub[0].device)
                    _scatter_views(base, idx, first, out)
                    torch._foreach_copy_([out[i] for i in idx], sub)
                    owned = base
                else:
                    base = torch.cat([_flat_view(x) for x in sub])
            flats.append(base)
        if owned is not None:
            fn_out(*flats, out=owned)
        else:
            _scatter_views(fn(*flats), idx, first, out)
    return out


def _has_flat_view(x: Any) -> bool:
    """Whether :func:`yolo_func.tree._flat_view` gives ``x`` a flat view (host metadata only)."""
    return isinstance(x, torch.Tensor) and x.dim() > 0 and _dense_in_memory_order(x)


def tree_where(flag: torch.Tensor, new: Any, old: Any) -> Any:
    """:func:`yolo_func.tree.tree_where` through :func:`leafwise` (flat-backed leaves are not
    copied; the result is flat-backed). Same values, bit for bit.

    On the CPU in eager mode (:func:`yolo_func.optim.base.host_flag`) the flag is read on the host
    and ``new`` or ``old`` is returned as it is: the same tensors, no pass over them (with a
    number ``old``: ``new`` when the flag is true and every leaf is floating; a false flag still
    builds the filled tree).

    Args:
      flag: bool[] on the leaves' device.
      new: pytree of tensors.
      old: a tree like ``new`` or a Python number.
    """
    known = host_flag(flag)
    number = isinstance(old, (int, float, bool))
    if known is not None and not number:  # CPU, read on the host: where(flag, new, old) is new or old, whole
        if T.tree_structure(old) != T.tree_structure(new):
            raise ValueError("[yolo_func] tree_where: structures differ\n" + T.tree_diff(new, old, names=("new", "old")))
        return new if known else old
    n_leaves, treedef = T.tree_flatten(new)
    if known is True and all(x.is_floating_point() for x in n_leaves):
        return new  # where(True, x, number) is x for a floating x (an integer x would be promoted)
    if number:
        def where_scalar_out(n, out):  # floating groups only (leafwise): the scalar in n's dtype, as promotion gives
            torch.where(flag, n, torch.full((), old, dtype=n.dtype, device=n.device), out=out)

        return T.tree_unflatten(treedef, leafwise(lambda n: torch.where(flag, n, old), n_leaves, fn_out=where_scalar_out))
    o_leaves, o_def = T.tree_flatten(old)
    if o_def != treedef:
        raise ValueError("[yolo_func] tree_where: structures differ\n" + T.tree_diff(new, old, names=("new", "old")))
    return T.tree_unflatten(treedef, leafwise(lambda n, o: torch.where(flag, n, o), n_leaves, o_leaves,
                                              fn_out=lambda n, o, out: torch.where(flag, n, o, out=out)))
