"""Combinators: :func:`chain` (sequential) and :func:`partition` (parameter groups by label)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

from yolo_func import tree as T
from yolo_func.optim.base import GradientTransformation, Updates, _reject_unknown

__all__ = ["chain", "partition", "PartitionState"]


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Apply transforms one after the other; the state is the tuple of their states.

    ``update``'s ``iteration`` keyword reaches every transform; any other keyword raises
    ``TypeError``.

    Args:
      *transforms: :class:`GradientTransformation` values.

    Returns:
      A :class:`GradientTransformation` whose state is ``tuple(state_i)``.

    >>> import torch
    >>> from yolo_func.optim import scale
    >>> tx = chain(scale(2.0), scale(3.0))
    >>> u, _ = tx.update({"w": torch.ones(1)}, tx.init({"w": torch.ones(1)}))
    >>> u["w"].item()
    6.0
    """
    for i, tx in enumerate(transforms):
        if not isinstance(tx, GradientTransformation):
            raise TypeError(f"[yolo_func] chain argument {i} must be a GradientTransformation, got {type(tx).__name__}")

    def init(params: Any) -> tuple:
        return tuple(tx.init(params) for tx in transforms)

    def update(updates: Updates, state: tuple, params: Any = None, *, iteration=None,
               **unknown) -> tuple[Updates, tuple]:
        _reject_unknown("chain", unknown)
        if not isinstance(state, tuple) or len(state) != len(transforms):
            raise ValueError(
                f"[yolo_func] chain of {len(transforms)} transforms got a state of "
                f"{len(state) if isinstance(state, tuple) else type(state).__name__}; was it made by this chain's init?"
            )
        new_states = []
        for tx, s in zip(transforms, state):
            updates, s = tx.update(updates, s, params, iteration=iteration)
            new_states.append(s)
        return updates, tuple(new_states)

    return GradientTransformation(init, update)


class PartitionState(NamedTuple):
    """State of :func:`partition`.

    Attributes:
      inner_states: ``{label: state}``; each inner transform sees a flat ``{path: leaf}`` dict of
        its own leaves (paths as in :func:`yolo_func.tree.tree_paths`).

    Example:
      >>> import torch
      >>> from yolo_func import optim
      >>> p = {"w": torch.ones(2)}
      >>> tx = optim.partition({"a": optim.sgd(0.1), "b": optim.sgd(0.2)}, {"w": "a"})
      >>> sorted(tx.init(p).inner_states)
      ['a', 'b']
    """

    inner_states: dict


Labels = Any  # a tree of str with the structure of params, or a callable params -> that tree


def _resolve_labels(labels: Labels, tree: Any, transforms: Mapping[str, GradientTransformation]) -> tuple[list, list, Any]:
    leaves, treedef = T.tree_flatten(tree)
    paths = T.tree_paths(tree)
    lab = labels(tree) if callable(labels) else labels
    lab_leaves, lab_def = T.tree_flatten(lab)
    if lab_def.num_leaves != treedef.num_leaves or T.tree_paths(lab) != paths:
        raise ValueError(
            "[yolo_func] partition: the labels tree must have the structure of the params/updates; differences:\n"
            + T.tree_diff(lab, tree, names=("labels", "params"))
        )
    unknown = sorted({str(x) for x in lab_leaves if x not in transforms})
    if unknown:
        raise ValueError(
            f"[yolo_func] partition: labels {unknown} have no transform; transforms are given for {sorted(transforms)}"
        )
    return paths, lab_leaves, treedef


def _split(paths: list[str], leaves: list, labels: list, label: str) -> dict:
    return {p: x for p, x, lab in zip(paths, leaves, labels) if lab == label}


def partition(transforms: Mapping[str, GradientTransformation], labels: Labels) -> GradientTransformation:
    """Route each leaf to the transform of its label (torch's parameter groups, by name).

    Args:
      transforms: ``{label: tx}``.
      labels: a tree of labels with the structure of params, or a callable
        ``params -> labels tree`` (e.g. :func:`yolo_func.optim.yolo_param_labels`); a callable is
        also applied to the updates tree in ``update`` (same structure and shapes); its result is
        memoised per tree structure and leaf ranks, so it must depend on paths and ranks only.

    Returns:
      A :class:`GradientTransformation` with :class:`PartitionState`. A label with no leaves gets
      the state of an empty tree. ``update`` forwards ``iteration`` to every group and raises
      ``TypeError`` on any other keyword.

    Raises:
      ValueError: a label has no transform, or the labels tree does not match the params.

    >>> import torch
    >>> from yolo_func.optim import scale
    >>> tx = partition({"a": scale(2.0), "b": scale(0.0)}, {"x": "a", "y": "b"})
    >>> p = {"x": torch.ones(1), "y": torch.ones(1)}
    >>> u, _ = tx.update(p, tx.init(p))
    >>> (u["x"].item(), u["y"].item())
    (2.0, 0.0)
    """
    if not isinstance(transforms, Mapping) or not transforms:
        raise TypeError(f"[yolo_func] partition(transforms) must be a non-empty dict {{label: tx}}, got {transforms!r}")
    transforms = dict(transforms)
    # Labels are a function of the tree's paths and leaf ranks (yolo_param_labels is), so they are
    # resolved once per (structure, ranks) instead of walking every path on every update.
    memo: dict = {}

    def resolve(tree: Any) -> tuple[list, list, Any, list]:
        """``(paths, labels, treedef, leaves)`` of ``tree`` (its one flatten per call)."""
        leaves, treedef = T.tree_flatten(tree)
        key = (treedef, tuple(getattr(x, "ndim", -1) for x in leaves))
        hit = memo.get(key)
        if hit is None:
            hit = memo[key] = _resolve_labels(labels, tree, transforms)
        return (*hit, leaves)

    def init(params: Any) -> PartitionState:
        paths, lab, _, leaves = resolve(params)
        return PartitionState({k: tx.init(_split(paths, leaves, lab, k)) for k, tx in transforms.items()})

    def update(updates: Updates, state: PartitionState, params: Any = None, *, iteration=None,
               **unknown) -> tuple[Updates, PartitionState]:
        _reject_unknown("partition", unknown)
        paths, lab, treedef, u_leaves = resolve(updates)
        p_leaves = T.tree_leaves(params) if params is not None else None
        if p_leaves is not None and len(p_leaves) != len(u_leaves):
            raise ValueError("[yolo_func] partition: params and updates differ in structure:\n" + T.tree_diff(params, updates))
        out: dict[str, Any] = {}
        new_states = {}
        for k, tx in transforms.items():
            sub_p = _split(paths, p_leaves, lab, k) if p_leaves is not None else None
            sub_u, new_states[k] = tx.update(_split(paths, u_leaves, lab, k), state.inner_states[k], sub_p,
                                                iteration=iteration)
            out.update(sub_u)
        return T.tree_unflatten(treedef, [out[p] for p in paths]), PartitionState(new_states)

    return GradientTransformation(init, update)
