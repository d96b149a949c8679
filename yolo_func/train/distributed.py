"""Data-parallel training on ``torch.distributed``: one process per GPU (or CPU process), launched
by ``torchrun`` (``torchrun --nproc-per-node N -m yolo_func.cli train ...``, or ``yolo-func train
--devices 0,1`` which starts torchrun through :func:`launch`).

What is synchronised (docs/distributed.md):

- **Gradients**: after each backward (eager, or after the *replayed* backward: outside every CUDA
  graph), the gradient pytree is all-reduced in flat buckets — leaves grouped per (device, dtype),
  concatenated into buckets of at most ``bucket_mb`` MiB, one ``all_reduce`` per bucket, copied
  back in place (:func:`all_reduce_tree_`). The YOLO losses are ``batch size x`` a per-batch mean
  (the sum-over-images convention), so the gradient of the global batch is the **sum** of the
  ranks' gradients: :class:`GradReducer` averages and multiplies by the world size (one SUM).
  The loss values (metrics and the non-finite guard's verdict) are averaged in the same bucket,
  so every rank takes the same skip decision and the parameters stay identical.
- **BN statistics**: with ``train.sync_bn`` the batch mean and variance of every BN layer are the
  global batch's (:func:`yolo_func.nn.sync_batchnorm` with :func:`differentiable_all_reduce`);
  without it each rank normalises with its own batch's statistics and the running statistics
  (and the EMA's) are averaged over the ranks before each validation and checkpoint
  (:func:`all_reduce_tree_` with ``op="mean"``).
- **Stop decisions** (Ctrl-C, time limit, a hook's ``KeyboardInterrupt``): voted at log steps
  (:func:`any_rank`), so every rank stops after the same step.

Failure: the process group's timeout (``YOLO_FUNC_DIST_TIMEOUT`` seconds, default 1800) bounds any
collective a dead peer would leave waiting; torchrun's agent ends the other workers when one
exits with an error and reports that rank's traceback (``torch.distributed.elastic``'s
``@record`` on the CLI's entry).
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from yolo_func import tree as T

__all__ = [
    "DistContext",
    "GradReducer",
    "all_reduce_tree_",
    "any_rank",
    "barrier",
    "broadcast_object",
    "check_in_sync",
    "differentiable_all_reduce",
    "env_world",
    "gather_objects",
    "init_distributed",
    "launch",
    "parse_devices",
    "shutdown",
]

#: Default process-group timeout (seconds); ``YOLO_FUNC_DIST_TIMEOUT`` overrides it.
DEFAULT_TIMEOUT_S = 1800.0


class DistContext(NamedTuple):
    """This process's place in a data-parallel job.

    Attributes:
      rank: global rank (0 logs, checkpoints and shows progress).
      world_size: number of processes.
      local_rank: rank on this host (the CUDA device index it uses).
      device: the device this rank trains on (``cuda:<local_rank>`` or ``cpu``).
      backend: ``"nccl"`` (CUDA) or ``"gloo"`` (CPU).
    """

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        """Whether this is rank 0."""
        return self.rank == 0


def env_world() -> tuple[int, int, int] | None:
    """``(rank, world_size, local_rank)`` from torchrun's environment (``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``), or None when this process was not started as one of several workers."""
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world <= 1 or "RANK" not in os.environ:
        return None
    rank = int(os.environ["RANK"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    return rank, world, local


def _timeout_s(timeout_s: float | None) -> float:
    if timeout_s is not None:
        return float(timeout_s)
    text = os.environ.get("YOLO_FUNC_DIST_TIMEOUT")
    if not text:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"[yolo_func] YOLO_FUNC_DIST_TIMEOUT={text!r} is not a number of seconds (e.g. 600)") from None
    if value <= 0:
        raise ValueError(f"[yolo_func] YOLO_FUNC_DIST_TIMEOUT must be > 0 seconds, got {value}")
    return value


def init_distributed(device: str = "auto", *, timeout_s: float | None = None) -> DistContext | None:
    """Join the data-parallel job torchrun started (``env://`` rendezvous), or None for one process.

    The backend is NCCL when this rank trains on CUDA (``device`` ``"auto"`` with CUDA available,
    or ``"cuda"``; each rank takes ``cuda:<LOCAL_RANK>``), else gloo. An already initialised
    default group is reused.

    Args:
      device: ``train.device`` (``"auto"``, ``"cpu"``, ``"cuda"``; ``"cuda:N"`` is refused: the
        device of a rank is its local rank).
      timeout_s: the process group's timeout for every collective (default
        ``YOLO_FUNC_DIST_TIMEOUT`` or :data:`DEFAULT_TIMEOUT_S`): a rank that dies or hangs ends the
        others' waits with an error after at most this long.

    Returns:
      :class:`DistContext`, or None when ``WORLD_SIZE`` is unset or 1.

    Raises:
      ValueError: ``device`` names one CUDA device, or CUDA is asked for and this host has fewer
        devices than ``LOCAL_RANK + 1``.

    Example:
      >>> init_distributed("cpu") is None  # not started by torchrun
      True
    """
    world = env_world()
    if world is None:
        return None
    rank, size, local = world
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if device.startswith("cuda:"):
        raise ValueError(f"[yolo_func] train.device={device!r} with {size} data-parallel processes: each rank uses "
                         "cuda:<LOCAL_RANK>; give --device cuda (or auto) and choose GPUs with --devices 0,1,...")
    if use_cuda:
        if local >= torch.cuda.device_count():
            raise ValueError(f"[yolo_func] LOCAL_RANK={local} but this host has {torch.cuda.device_count()} CUDA "
                             f"device(s); start at most that many processes per node (--nproc-per-node)")
        torch.cuda.set_device(local)
        dev, backend = torch.device("cuda", local), "nccl"
    else:
        dev, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        kw: dict[str, Any] = {}
        if backend == "nccl":
            kw["device_id"] = dev  # binds the communicator to this rank's GPU (eager NCCL init)
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=_timeout_s(timeout_s)), **kw)
    return DistContext(dist.get_rank(), dist.get_world_size(), local, dev, dist.get_backend())


def shutdown() -> None:
    """Destroy the default process group if there is one (end of a job)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


# -------------------------------------------------------------------------------------- collectives


def _buckets(leaves: Sequence[torch.Tensor], bucket_bytes: int) -> list[list[int]]:
    """Leaf indices grouped per (device, dtype), each group cut into buckets of <= bucket_bytes
    (a leaf larger than a bucket gets one of its own). The order is the leaves' order, so every
    rank builds the same buckets from the same tree."""
    groups: dict[tuple, list[int]] = {}
    for i, x in enumerate(leaves):
        groups.setdefault((x.device, x.dtype), []).append(i)
    out = []
    for idxs in groups.values():
        cur, size = [], 0
        for i in idxs:
            nbytes = leaves[i].numel() * leaves[i].element_size()
            if cur and size + nbytes > bucket_bytes:
                out.append(cur)
                cur, size = [], 0
            cur.append(i)
            size += nbytes
        if cur:
            out.append(cur)
    return out


def all_reduce_tree_(tree: Any, *, op: str = "sum", bucket_mb: float = 25.0, group=None) -> Any:
    """All-reduce every tensor leaf of ``tree`` in place over the ranks, in flat buckets.

    Leaves are grouped per (device, dtype); each group is concatenated into buckets of at most
    ``bucket_mb`` MiB; one ``all_reduce`` runs per bucket; the results are copied back into the
    leaves (their storage and memory format are kept: static replay buffers stay static).

    Args:
      tree: a pytree of tensors, the same structure, shapes and dtypes on every rank.
      op: ``"sum"`` or ``"mean"`` (sum divided by the world size).
      bucket_mb: bucket size in MiB.
      group: the process group (default: the world).

    Returns:
      ``tree`` (its leaves hold the reduced values).

    Raises:
      ValueError: an unknown ``op``.

    Example:
      >>> # in each of N processes (after init_distributed): grads = all_reduce_tree_(grads, op="mean")
    """
    if op not in ("sum", "mean"):
        raise ValueError(f"[yolo_func] all_reduce_tree_: op must be 'sum' or 'mean', got {op!r}")
    leaves = T.tree_leaves(tree)
    if not leaves:
        return tree
    world = dist.get_world_size(group)
    for idxs in _buckets(leaves, int(bucket_mb * 2**20)):
        parts = [leaves[i] for i in idxs]
        flat = torch.cat([x.reshape(-1) for x in parts])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        if op == "mean":
            flat = flat / world
        pieces = torch.split(flat, [x.numel() for x in parts])
        T.foreach_copy_(parts, [p.view(x.shape) for p, x in zip(pieces, parts)])
    return tree


class _AllReduceSum(torch.autograd.Function):
    """``y = sum over ranks of x``; backward: the sum over ranks of the cotangents (each rank's
    loss depends on every rank's ``x`` through ``y``). ``setup_context`` style, so it works inside
    ``torch.func`` transforms."""

    @staticmethod
    def forward(x: torch.Tensor, group) -> torch.Tensor:
        y = x.detach().clone()
        dist.all_reduce(y, op=dist.ReduceOp.SUM, group=group)
        return y

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.group = inputs[1]

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        g = g.detach().clone()
        dist.all_reduce(g, op=dist.ReduceOp.SUM, group=ctx.group)
        return g, None


def differentiable_all_reduce(x: torch.Tensor, group=None) -> torch.Tensor:
    """The sum of ``x`` over the ranks, differentiable (inside ``torch.func.vjp`` too): the
    collective :func:`yolo_func.nn.sync_batchnorm` needs.

    Args:
      x: ``float[...]``, the same shape on every rank.

    Returns:
      ``float[...]``: ``sum_r x_r`` (a new tensor). Its backward sums the cotangents over the ranks.
    """
    return _AllReduceSum.apply(x, group)


class GradReducer:
    """The gradient all-reduce of a data-parallel step: ``(grads, losses, parts) -> (grads,
    losses, parts)`` with the gradients summed over the ranks (in place, flat buckets per dtype)
    and the loss values averaged, all in the same buckets (one collective per (device, dtype)
    bucket).

    Why a sum: every YOLO loss is ``batch size x`` a mean over the batch (the sum-over-images
    convention), so the gradient of a global batch of ``W x B`` images is the sum of the ``W``
    ranks' gradients (averaging them and multiplying by ``W``, as a trainer that scales the loss
    by the world size does).

    Passed to :func:`yolo_func.train.step.finish_step` / :func:`~yolo_func.train.step.train_step`
    / :class:`~yolo_func.train.replay.ReplayTrainStep` as ``grad_reduce``.

    Args:
      bucket_mb: bucket size (MiB).
      group: the process group (default: the world).
    """

    def __init__(self, *, bucket_mb: float = 25.0, group=None):
        self.bucket_mb, self.group = bucket_mb, group

    def __call__(self, grads: Any, losses: Mapping, parts: Mapping) -> tuple[Any, dict, dict]:
        world = dist.get_world_size(self.group)
        # the loss values ride along, divided by W first: the bucket's SUM then gives their mean
        values = {"losses": {k: v.detach().float() / world for k, v in losses.items()},
                  "parts": {k: v.detach().float() / world for k, v in parts.items()}}
        all_reduce_tree_({"grads": grads, "values": values}, op="sum", bucket_mb=self.bucket_mb, group=self.group)
        return grads, values["losses"], values["parts"]

    def __repr__(self) -> str:
        return f"GradReducer(bucket_mb={self.bucket_mb})"


def any_rank(flag: bool, device: torch.device | str = "cpu", group=None) -> bool:
    """Whether ``flag`` is True on any rank (one tiny all-reduce; call it at the same points on
    every rank). One process (no group): ``flag`` itself."""
    if not (dist.is_available() and dist.is_initialized()):
        return bool(flag)
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item())


def barrier(device: torch.device | None = None) -> None:
    """Wait for every rank (no-op without a process group)."""
    if dist.is_available() and dist.is_initialized():
        if device is not None and device.type == "cuda":
            dist.barrier(device_ids=[device.index])
        else:
            dist.barrier()


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s ``obj`` on every rank (picklable objects; no-op without a process group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's ``obj`` (picklable), in rank order, on every rank; ``[obj]`` without a group."""
    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def check_in_sync(tree: Any, *, what: str = "params", device: torch.device | str = "cpu") -> None:
    """Raise when ``tree`` differs between ranks (compares a float64 checksum per leaf: sums of the
    values and of value x position, gathered from every rank).

    Raises:
      RuntimeError: the ranks disagree (names the first differing leaf paths).
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    items = T.tree_items(tree)
    sums = []
    for _, x in items:
        v = x.detach().reshape(-1).double()
        w = torch.arange(1, v.numel() + 1, dtype=torch.float64, device=v.device) / max(v.numel(), 1)
        sums.append(torch.stack([v.sum(), (v * w).sum()]))
    local = torch.stack(sums).to(device) if sums else torch.zeros(0, 2, dtype=torch.float64, device=device)
    table = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(table, local)
    bad = [items[i][0] for i in range(len(items))
           if any(not torch.equal(t[i], table[0][i]) for t in table[1:])]
    if bad:
        raise RuntimeError(f"[yolo_func] data-parallel ranks disagree on {what}: {bad[:5]}{' ...' if len(bad) > 5 else ''} "
                           "(a rank skipped a step the others took, or a non-deterministic all-reduce); "
                           "report this with the run's events.jsonl")


# ----------------------------------------------------------------------------------------- launching


def parse_devices(text: str) -> list[int]:
    """``"0,1,3"`` -> ``[0, 1, 3]`` (``--devices``).

    Raises:
      ValueError: not a comma-separated list of distinct integers >= 0.
    """
    try:
        ids = [int(t) for t in text.split(",") if t.strip() != ""]
    except ValueError:
        raise ValueError(f"[yolo_func] --devices expects comma-separated GPU indices such as 0,1,2,3, got {text!r}") from None
    if not ids or any(i < 0 for i in ids) or len(set(ids)) != len(ids):
        raise ValueError(f"[yolo_func] --devices expects distinct GPU indices >= 0 such as 0,1, got {text!r}")
    return ids


def launch(devices: Sequence[int] | int, argv: Sequence[str], *, cpu: bool = False, master_port: int | None = None) -> int:
    """Run ``python -m yolo_func.cli <argv>`` as ``len(devices)`` data-parallel workers on this
    host through torchrun's public entry (:func:`torch.distributed.run.run`): the same as
    ``CUDA_VISIBLE_DEVICES=<devices> torchrun --standalone --nproc-per-node N -m yolo_func.cli
    <argv>``.

    Args:
      devices: GPU indices (they become ``CUDA_VISIBLE_DEVICES``; rank r uses the r-th), or a
        process count with ``cpu=True``.
      argv: the CLI arguments after ``yolo-func`` (e.g. ``["train", "--epochs", "3"]``), without
        ``--devices``.
      cpu: CPU workers (gloo); ``devices`` is then a count.
      master_port: the rendezvous port (default: torchrun's standalone mode picks a free one).

    Returns:
      0 when every worker succeeded.

    Raises:
      torch.distributed.elastic.multiprocessing.errors.ChildFailedError: a worker failed; the
        message shows the failing rank, its exit code and (with ``@record``) its traceback.
    """
    from torch.distributed.run import get_args_parser, run

    n = devices if isinstance(devices, int) else len(devices)
    if not cpu:
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in devices)
    args = ["--nproc-per-node", str(n), "--max-restarts", "0"]
    args += ["--standalone"] if master_port is None else ["--master-addr", "127.0.0.1", "--master-port", str(master_port)]
    args += ["-m", "yolo_func.cli", *argv]
    run(get_args_parser().parse_args(args))
    return 0
