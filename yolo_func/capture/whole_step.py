"""Replay a whole pure step ``fn(carry, inputs) -> (new_carry, aux)`` as one CUDA graph.

:func:`capture_step` records ``fn`` on static buffers and, inside the same graph, copies
``new_carry`` back into the static ``carry`` buffers. One replay is therefore one complete step:
the caller copies a new batch into the static inputs (or passes them), replays, and reads the
updated carry and the ``aux`` outputs from static buffers. Because the graph runs exactly the
kernels the eager call runs, in the same order, on the same values, a replayed step is bitwise equal
to the eager one (with the same deterministic flags; see :mod:`yolo_func.capture.vjp`).

``fn`` must be capturable: static shapes, no host synchronisation (``.item()``, Python branches
on tensor values, boolean-mask indexing), no CPU tensors created inside. Warm-up runs ``fn`` on a
side stream on the static buffers without writing them back (``fn`` is pure), so it leaves no trace;
the default CUDA generator's state is restored afterwards.

Aliasing: the returned carry *is* the static carry (updated in place by every replay) and ``aux``
the static outputs (overwritten by every replay). Clone what you keep across steps. With
``donate_carry=True`` the static carry is the caller's own carry tensors (no second copy of the
training state in memory); the ``persistent=`` inputs are read where they live (e.g. the static
gradients of a captured network), never copied.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from yolo_func import tree as T
from yolo_func.capture.binder import CAPTURE_ERROR_MODE, Binder, check_available, gc_paused
from yolo_func.capture.counter import count_capture
from yolo_func.capture.signature import CaptureSignature

__all__ = ["CapturedStep", "StepBuffers", "StepStats", "capture_step"]

PyTree = Any


class StepBuffers(NamedTuple):
    """The static tensors of a captured step: ``carry`` (read and written), ``inputs`` (read),
    ``aux`` (written).

    Example:
      >>> from yolo_func.capture import StepBuffers
      >>> StepBuffers._fields                              # CapturedStep.static
      ('carry', 'inputs', 'aux')
    """

    carry: PyTree
    inputs: PyTree
    aux: PyTree


@dataclasses.dataclass
class StepStats:
    """Counters: replays so far and input leaves copied by the last call.

    Example:
      >>> from yolo_func.capture import StepStats
      >>> StepStats()                                      # CapturedStep.stats
      StepStats(replays=0, leaves_copied=0)
    """

    replays: int = 0
    leaves_copied: int = 0


class CapturedStep(NamedTuple):
    """A captured step.

    Attributes:
      step: ``(carry, inputs) -> (carry, aux)``: copies arguments into the static buffers (skipped
        for leaves that already are the static ones), replays, returns the static carry and aux.
        Raises :class:`yolo_func.capture.CaptureMismatch` for arguments of another signature.
      signature: the captured :class:`yolo_func.capture.CaptureSignature` of ``(carry, inputs)``.
      static: :class:`StepBuffers`.
      stats: :class:`StepStats`.
      pool: the graph's memory pool handle.

    Example:
      >>> from yolo_func.capture import CapturedStep
      >>> CapturedStep._fields                             # what capture_step returns (CUDA)
      ('step', 'signature', 'static', 'stats', 'pool')
    """

    step: Callable[[PyTree, PyTree], tuple[PyTree, PyTree]]
    signature: CaptureSignature
    static: StepBuffers
    stats: StepStats
    pool: Any


def _static_tree(tree: PyTree, keep: set[int], used: set[int] | None = None) -> PyTree:
    """``tree`` with every leaf cloned except those whose ``id`` is in ``keep``.

    With ``used`` (the carry): a kept tensor is kept the first time it is met and cloned on later
    meetings, so no two static carry leaves share memory; the ids of kept leaves are added to
    ``used``. Without (the inputs, only read): a kept tensor is kept wherever it appears."""
    def one(x):
        if id(x) in keep and (used is None or id(x) not in used):
            if used is not None:
                used.add(id(x))
            return x
        return x.detach().clone(memory_format=torch.preserve_format)

    return T.tree_map(one, tree)


def capture_step(fn: Callable[[PyTree, PyTree], tuple[PyTree, PyTree]], carry: PyTree, inputs: PyTree, *,
                 warmup: int = 2, pool: Any = None, donate_carry: bool = False,
                 persistent: Sequence[torch.Tensor] = ()) -> CapturedStep:
    """Capture ``fn(carry, inputs) -> (new_carry, aux)`` and the write-back ``carry <- new_carry``.

    Args:
      fn: pure; ``new_carry`` has ``carry``'s structure, shapes and dtypes.
      carry: pytree of CUDA tensors (e.g. a ``TrainState``); cloned into static buffers, unless
        ``donate_carry``.
      inputs: pytree of CUDA tensors (e.g. a ``Batch``); cloned into static buffers, except the
        leaves listed in ``persistent`` (and, with ``donate_carry``, leaves that are carry leaves).
      warmup: eager runs on a side stream before capture (cuDNN/cuBLAS set-up), >= 1.
      pool: a memory pool handle to share, or None for a private one.
      donate_carry: use ``carry``'s own tensors as the static carry (no clone: one copy of the
        state less in memory). The caller must not use them as anything but this step's carry
        afterwards: every replay overwrites them.
      persistent: input tensors that outlive every call and are updated in place between calls
        (e.g. another graph's static outputs): read where they are, never copied.

    Returns:
      :class:`CapturedStep`.

    Raises:
      CaptureUnavailable: a tensor is not on a CUDA device, or CUDA is unavailable.
      ValueError: ``new_carry`` does not match ``carry``.

    Example:
      >>> import torch
      >>> from yolo_func.capture import CaptureUnavailable, capture_step
      >>> def step(carry, inputs):                          # (new_carry, aux)
      ...     return {"w": carry["w"] - 0.1 * inputs}, {"norm": carry["w"].norm()}
      >>> # on CUDA: cs = capture_step(step, carry, inputs, donate_carry=True); aux = cs.step(carry, inputs)
      >>> try:
      ...     capture_step(step, {"w": torch.ones(2)}, torch.ones(2))
      ... except CaptureUnavailable as e:
      ...     print(e.reason)
      inputs are on cpu, not a CUDA device (first: carry/w)
    """
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
        raise ValueError(f"[yolo_func] capture_step: warmup must be an int >= 1, got {warmup!r}")
    device = check_available({"carry": carry, "inputs": inputs}, (), caller="capture_step")
    carry_ids = {id(x) for x in T.tree_leaves(carry)} if donate_carry else set()
    used: set[int] = set()
    static_carry = _static_tree(carry, carry_ids, used)
    # inputs may read a carry buffer (read before the write-back, inside the graph) or a persistent one
    static_inputs = _static_tree(inputs, {id(x) for x in persistent} | used)
    binder = Binder({"carry": static_carry, "inputs": static_inputs}, None, what="step inputs")

    with torch.cuda.device(device):
        gen = torch.cuda.default_generators[device.index]
        gen_state = gen.get_state()
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(warmup):
                new_carry, aux = fn(static_carry, static_inputs)
                if T.tree_structure(new_carry) != T.tree_structure(static_carry):
                    raise ValueError("[yolo_func] capture_step: fn's new carry differs from the carry:\n"
                                     + T.tree_diff(static_carry, new_carry, names=("carry", "new carry")))
                del new_carry, aux  # before the next run: one run's outputs alive at a time
        torch.cuda.current_stream(device).wait_stream(side)
        gen.set_state(gen_state)
        graph = torch.cuda.CUDAGraph()
        pool = torch.cuda.graph_pool_handle() if pool is None else pool
        # thread_local capture: helper threads cannot abort it (binder.CAPTURE_ERROR_MODE)
        with gc_paused(), torch.cuda.graph(graph, pool=pool, capture_error_mode=CAPTURE_ERROR_MODE):
            new_carry, aux = fn(static_carry, static_inputs)
            T.tree_copy_(static_carry, new_carry)
        del new_carry
    count_capture()

    stats = StepStats()

    def step(carry_: PyTree, inputs_: PyTree):
        stats.leaves_copied = binder.load(carry_, inputs_)
        graph.replay()
        stats.replays += 1
        return static_carry, aux

    return CapturedStep(step, binder.signature, StepBuffers(static_carry, static_inputs, aux), stats, pool)

