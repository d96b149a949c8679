"""Count the aten ops a piece of eager code dispatches (for "the step stays cheap" tests).

:func:`count_aten_ops` is a ``TorchDispatchMode``: every aten op that reaches the Python dispatch
mode is counted once (after functorch's transforms and autograd have decomposed or differentiated
it; a ``_foreach_*`` call over many tensors counts one). It measures host-side work of an eager
step, which on a GPU is also the number of launched kernels to within a small factor.

Example:
  >>> import torch
  >>> with count_aten_ops() as c:
  ...     y = torch.ones(3) * 2 + 1
  >>> c.total, c.by_op["aten.mul.Tensor"]
  (3, 1)
"""

from __future__ import annotations

import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["AtenOpCount", "count_aten_ops"]


class AtenOpCount(TorchDispatchMode):
    """A dispatch mode that counts ops by name.

    Args:
      min_numel: if given, count only the ops that are not views and read or write a tensor of at
        least this many elements (e.g. ``B * M * A``: the passes over the assigner's ``[B, M, A]``
        tensors; views launch no kernel).

    Attributes:
      total: int, ops dispatched inside the ``with`` block.
      by_op: ``{"aten.mul.Tensor": n, ...}`` (overload names as ``str(func)`` spells them).

    Example:
      >>> import torch
      >>> x = torch.ones(3)
      >>> with AtenOpCount() as c:
      ...     y = (x * 2).sum()
      >>> c.total, c.by_op["aten.mul.Tensor"], c.by_op["aten.sum.default"]
      (2, 1, 1)
      >>> with AtenOpCount(min_numel=3) as big:
      ...     y = (x * 2).sum() + 1      # the mul reads 3 elements; the sum reads 3; the add reads 1
      >>> big.total
      2
    """

    def __init__(self, min_numel: int | None = None):
        super().__init__()
        self.min_numel = min_numel
        self.total = 0
        self.by_op: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.min_numel is not None:
            if func.is_view:
                return out
            sizes = [t.numel() for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
            if max(sizes, default=0) < self.min_numel:
                return out
        self.total += 1
        self.by_op[str(func)] += 1
        return out


def count_aten_ops(min_numel: int | None = None) -> AtenOpCount:
    """A fresh :class:`AtenOpCount`; use it as a context manager (``with count_aten_ops() as c``).

    ``min_numel``: count only non-view ops touching a tensor of at least that many elements.

    Example:
      >>> import torch
      >>> a, b = torch.ones(2, 2), torch.ones(2, 2)
      >>> with count_aten_ops() as c:
      ...     _ = a @ b + 1
      >>> c.total >= 2, sorted(c.by_op)[:1]
      (True, ['aten.add.Tensor'])
    """
    return AtenOpCount(min_numel)
