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

from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["AtenOpCount", "count_aten_ops"]


class AtenOpCount(TorchDispatchMode):
    """A dispatch mode that counts ops by name.

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
    """

    def __init__(self):
        super().__init__()
        self.total = 0
        self.by_op: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.total += 1
        self.by_op[str(func)] += 1
        return func(*args, **(kwargs or {}))


def count_aten_ops() -> AtenOpCount:
    """A fresh :class:`AtenOpCount`; use it as a context manager (``with count_aten_ops() as c``).

    Example:
      >>> import torch
      >>> a, b = torch.ones(2, 2), torch.ones(2, 2)
      >>> with count_aten_ops() as c:
      ...     _ = a @ b + 1
      >>> c.total >= 2, sorted(c.by_op)[:1]
      (True, ['aten.add.Tensor'])
    """
    return AtenOpCount()
