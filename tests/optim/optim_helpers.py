"""Shared fixtures for the optimizer tests: a small YOLO-shaped tree and random gradients."""

from __future__ import annotations

import math

import torch

from yolo_func import tree as T


def small_params(seed: int = 0, dtype: torch.dtype = torch.float32) -> dict:
    """A tree with the three YOLO groups: conv kernels, BN gammas/betas and a head bias."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=dtype)

    return {
        "stem": {"conv": {"weight": r(8, 3, 3, 3)}, "bn": {"weight": 1 + 0.1 * r(8), "bias": 0.1 * r(8)}},
        "block": {"cv1": {"conv": {"weight": r(16, 8, 1, 1)}, "bn": {"weight": 1 + 0.1 * r(16), "bias": 0.1 * r(16)}}},
        "head": {"pred": {"weight": r(5, 16, 1, 1), "bias": r(5)}},
    }


def random_grads(params: dict, gen: torch.Generator, scale: float = 1.0) -> dict:
    """Gradients shaped like ``params`` drawn from ``gen``."""
    return T.tree_map(lambda p: scale * torch.randn(p.shape, generator=gen, dtype=p.dtype), params)


def torch_params(params: dict) -> tuple[list[str], list[torch.nn.Parameter]]:
    """Paths and ``nn.Parameter`` copies of every leaf, in leaf order."""
    items = T.tree_items(params)
    return [p for p, _ in items], [torch.nn.Parameter(x.detach().clone()) for _, x in items]


def as_tree(params: dict, tensors: list[torch.Tensor]) -> dict:
    """Rebuild a tree shaped like ``params`` from a leaf list."""
    return T.tree_unflatten(T.tree_structure(params), [t.detach() for t in tensors])


def ref_lf(e: float, lrf: float, epochs: int, cos: bool) -> float:
    """REFERENCE.md §4.3 lf(e) in plain Python (linear floored at lrf, or cosine)."""
    if cos:
        return max((1 - math.cos(e * math.pi / epochs)) / 2, 0) * (lrf - 1) + 1
    return max(1 - e / epochs, 0) * (1.0 - lrf) + lrf


def yolo_recipe():
    """The YOLOv8 SGD recipe at toy size: warmup-varying accumulation, clip 10, three groups."""
    from yolo_func.optim import multi_steps, yolo_schedules

    s = yolo_schedules(0.01, 0.01, epochs=3, batches_per_epoch=4, nominal_accumulate=2)
    return multi_steps(yolo_recipe_inner(s), every=s.accumulate)


def yolo_recipe_inner(s=None):
    """The recipe's inner transform (what ``multi_steps`` wraps): clip 10, then three groups of
    Nesterov SGD on the schedules ``s`` (the toy schedules of :func:`yolo_recipe` by default)."""
    from yolo_func.optim import chain, clip_by_global_norm, partition, sgd, yolo_param_labels, yolo_schedules

    if s is None:
        s = yolo_schedules(0.01, 0.01, epochs=3, batches_per_epoch=4, nominal_accumulate=2)
    inner = partition(
        {
            "decay": sgd(s.lr["decay"], momentum=s.momentum, nesterov=True, weight_decay=5e-4),
            "no_decay": sgd(s.lr["no_decay"], momentum=s.momentum, nesterov=True),
            "bias": sgd(s.lr["bias"], momentum=s.momentum, nesterov=True),
        },
        yolo_param_labels,
    )
    return chain(clip_by_global_norm(10.0), inner)
