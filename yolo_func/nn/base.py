"""The layer protocol and deterministic initialisers.

A layer is a factory returning ``Layer(init, apply)``:

- ``init(gen: torch.Generator) -> (params, state)`` draws from a **CPU** generator, so a seed gives
  identical weights on any device (move the trees afterwards with ``tree.tree_to``).
- ``apply(params, state, x, *, train: bool) -> (y, new_state)`` is pure; stateless layers return
  ``{}`` as state.

Initialisers follow PyTorch's defaults for ``nn.Conv2d`` / ``nn.ConvTranspose2d`` (REFERENCE.md §1.9):
weight ~ U(-b, b) with b from ``kaiming_uniform(a=sqrt(5))`` (= 1/sqrt(fan_in)), bias ~ U(-1/sqrt(fan_in),
1/sqrt(fan_in)); weight drawn before bias, in construction order, so replaying the reference's
registration order with the same seed reproduces its weights bit for bit.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch

__all__ = ["Layer", "split", "uniform", "conv_weight", "conv_bias", "abstract_init"]

_ABSTRACT = contextvars.ContextVar("yolo_func_abstract_init", default=False)


class Layer(NamedTuple):
    """A pure layer: ``init(gen) -> (params, state)``, ``apply(params, state, x, *, train) -> (y, state)``."""

    init: Callable[[torch.Generator], tuple[dict, dict]]
    apply: Callable[..., tuple[Any, dict]]


@contextlib.contextmanager
def abstract_init() -> Iterator[None]:
    """Within this context initialisers allocate on the ``meta`` device: shapes without memory.

    Used to validate parameter trees against a model's expected shapes cheaply. Meta tensors draw
    nothing, so the generator is not advanced: never mix abstract and real draws from one generator.
    """
    token = _ABSTRACT.set(True)
    try:
        yield
    finally:
        _ABSTRACT.reset(token)


def _empty(shape: tuple[int, ...]) -> torch.Tensor:
    return torch.empty(shape, device="meta" if _ABSTRACT.get() else "cpu", dtype=torch.float32)


def split(gen: torch.Generator, n: int) -> list[torch.Generator]:
    """Derive ``n`` independent child generators by drawing their seeds from ``gen``."""
    seeds = torch.randint(0, 2**62, (n,), generator=gen, dtype=torch.int64)
    return [torch.Generator().manual_seed(int(s)) for s in seeds]


def uniform(gen: torch.Generator, shape: tuple[int, ...], bound: float) -> torch.Tensor:
    """float32[shape] ~ U(-bound, bound), drawn from ``gen`` (CPU)."""
    return _empty(shape).uniform_(-bound, bound, generator=gen)


def conv_weight(gen: torch.Generator, shape: tuple[int, ...], fan_in: int) -> torch.Tensor:
    """PyTorch's default conv kernel init: ``kaiming_uniform_(w, a=sqrt(5))``.

    The bound is computed with the same float operations as ``torch.nn.init`` so the values match
    bit for bit.
    """
    a = math.sqrt(5)
    gain = math.sqrt(2.0 / (1 + a**2))
    std = gain / math.sqrt(fan_in)
    return uniform(gen, shape, math.sqrt(3.0) * std)


def conv_bias(gen: torch.Generator, c_out: int, fan_in: int) -> torch.Tensor:
    """PyTorch's default conv bias init: U(-1/sqrt(fan_in), 1/sqrt(fan_in))."""
    bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0.0
    return uniform(gen, (c_out,), bound)
