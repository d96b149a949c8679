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
    """A pure layer: ``init(gen) -> (params, state)``, ``apply(params, state, x, *, train) -> (y, state)``.

    Example:
      >>> import torch
      >>> from yolo_func.nn import Layer
      >>> def scale_init(gen):
      ...     return {"s": torch.ones(1)}, {}
      >>> def scale_apply(params, state, x, *, train):
      ...     return x * params["s"], state
      >>> layer = Layer(scale_init, scale_apply)            # a layer is two functions
      >>> p, s = layer.init(torch.Generator())
      >>> layer.apply(p, s, torch.full((2,), 3.0), train=False)
      (tensor([3., 3.]), {})
    """

    init: Callable[[torch.Generator], tuple[dict, dict]]
    apply: Callable[..., tuple[Any, dict]]


@contextlib.contextmanager
def abstract_init() -> Iterator[None]:
    """Within this context initialisers allocate on the ``meta`` device: shapes without memory.

    Used to validate parameter trees against a model's expected shapes cheaply. Meta tensors draw
    nothing, so the generator is not advanced: never mix abstract and real draws from one generator.

    Example:
      >>> import torch
      >>> from yolo_func.nn import abstract_init, conv_bn_act
      >>> with abstract_init():
      ...     p, s = conv_bn_act(3, 16, 3).init(torch.Generator())
      >>> p["conv"]["weight"].device.type, tuple(p["conv"]["weight"].shape)
      ('meta', (16, 3, 3, 3))
    """
    token = _ABSTRACT.set(True)
    try:
        yield
    finally:
        _ABSTRACT.reset(token)


def _empty(shape: tuple[int, ...]) -> torch.Tensor:
    return torch.empty(shape, device="meta" if _ABSTRACT.get() else "cpu", dtype=torch.float32)


def split(gen: torch.Generator, n: int) -> list[torch.Generator]:
    """Derive ``n`` independent child generators by drawing their seeds from ``gen``.

    Example:
      >>> import torch
      >>> from yolo_func.nn import split
      >>> a, b = split(torch.Generator().manual_seed(0), 2)
      >>> a2, b2 = split(torch.Generator().manual_seed(0), 2)
      >>> torch.equal(torch.rand(3, generator=a), torch.rand(3, generator=a2))   # same seed, same children
      True
    """
    seeds = torch.randint(0, 2**62, (n,), generator=gen, dtype=torch.int64)
    return [torch.Generator().manual_seed(int(s)) for s in seeds]


def uniform(gen: torch.Generator, shape: tuple[int, ...], bound: float) -> torch.Tensor:
    """float32[shape] ~ U(-bound, bound), drawn from ``gen`` (CPU).

    Example:
      >>> import torch
      >>> from yolo_func.nn import uniform
      >>> w = uniform(torch.Generator().manual_seed(0), (64, 3), 0.5)
      >>> w.dtype, tuple(w.shape), bool(w.abs().max() <= 0.5)
      (torch.float32, (64, 3), True)
    """
    return _empty(shape).uniform_(-bound, bound, generator=gen)


def conv_weight(gen: torch.Generator, shape: tuple[int, ...], fan_in: int) -> torch.Tensor:
    """PyTorch's default conv kernel init: ``kaiming_uniform_(w, a=sqrt(5))``.

    The bound is computed with the same float operations as ``torch.nn.init`` so the values match
    bit for bit.

    Example:
      Returns ``float32[shape]`` ~ U(-1/sqrt(fan_in), 1/sqrt(fan_in)) (torch's default Conv2d init).

      >>> import torch
      >>> from yolo_func.nn import conv_weight
      >>> w = conv_weight(torch.Generator().manual_seed(0), (16, 3, 3, 3), fan_in=27)
      >>> w.dtype, tuple(w.shape), bool(w.abs().max() <= 27 ** -0.5)
      (torch.float32, (16, 3, 3, 3), True)
    """
    a = math.sqrt(5)
    gain = math.sqrt(2.0 / (1 + a**2))
    std = gain / math.sqrt(fan_in)
    return uniform(gen, shape, math.sqrt(3.0) * std)


def conv_bias(gen: torch.Generator, c_out: int, fan_in: int) -> torch.Tensor:
    """PyTorch's default conv bias init: U(-1/sqrt(fan_in), 1/sqrt(fan_in)).

    Example:
      Returns ``float32[c_out]`` ~ U(-1/sqrt(fan_in), 1/sqrt(fan_in)) (torch's default Conv2d bias).

      >>> import torch
      >>> from yolo_func.nn import conv_bias
      >>> b = conv_bias(torch.Generator().manual_seed(0), 16, fan_in=27)
      >>> b.dtype, tuple(b.shape)
      (torch.float32, (16,))
    """
    bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0.0
    return uniform(gen, (c_out,), bound)
