"""A ring of batch buffers shared with DataLoader worker processes, page-locked for the GPU.

Without it, a worker's batch reaches the GPU through three whole-batch copies and a fresh
shared-memory segment: the worker stacks its images, torch copies the stack into a new
shared-memory segment to send it (one file descriptor round trip per tensor), and the main
process's pin-memory thread copies it again into page-locked memory before the device copy. With
it, the workers letterbox each image straight into a slot of one anonymous shared mapping made
before they fork, and the main process copies the slot to the device directly (the mapping is
registered with CUDA once, so the copy is asynchronous): no per-batch segment, no pinning copy.

Slots are handed out in a fixed rotation by the sampler, in the main process. A slot is only
handed out again once the device copy of its previous batch has finished (its CUDA event): with
``slots >= prefetch_factor * workers + 2`` that wait is on a copy issued two batches earlier, so it
never blocks in practice, and a worker never writes into a slot whose batch has not been taken.
"""

from __future__ import annotations

import contextlib
import math
import mmap
from typing import Any

import torch

__all__ = ["SharedRing", "ring_slots"]


def ring_slots(workers: int, prefetch_factor: int) -> int:
    """Slots a ring needs behind a DataLoader of ``workers`` processes with ``prefetch_factor``:
    the batches it can have in flight (``prefetch_factor * workers``), the one being taken and the
    one whose device copy may still run."""
    return int(prefetch_factor) * int(workers) + 2


class SharedRing:
    """``slots`` byte buffers of ``slot_bytes`` each in one anonymous shared mapping.

    Made before the worker processes fork (they inherit the mapping and write into the same
    pages); :meth:`pin` page-locks it for CUDA afterwards, in the main process.

    Args:
      slots: number of buffers (:func:`ring_slots`).
      slot_bytes: bytes of one buffer (the largest batch: ``B * H * W * 3`` for uint8 images).
    """

    def __init__(self, slots: int, slot_bytes: int):
        if slots < 1 or slot_bytes < 1:
            raise ValueError(f"[yolo_func] SharedRing: slots and slot_bytes must be >= 1, got {slots}, {slot_bytes}")
        self.slots, self.slot_bytes = int(slots), int(slot_bytes)
        # MAP_SHARED | MAP_ANONYMOUS: shared with forked children, not backed by /dev/shm (whose
        # size a container often limits to 64 MiB)
        self._mem = mmap.mmap(-1, self.slots * self.slot_bytes)
        self.flat = torch.frombuffer(self._mem, dtype=torch.uint8)
        self._events: list[Any] = [None] * self.slots
        self._next = 0
        self.pinned = False

    @property
    def nbytes(self) -> int:
        return self.slots * self.slot_bytes

    def view(self, slot: int, shape: tuple[int, ...]) -> torch.Tensor:
        """uint8 tensor of ``shape`` over the start of buffer ``slot`` (no copy)."""
        n = math.prod(shape)
        if not 0 <= slot < self.slots or n > self.slot_bytes:
            raise ValueError(f"[yolo_func] SharedRing: slot {slot} of {self.slots} cannot hold {shape} "
                             f"({n} bytes > {self.slot_bytes})")
        start = slot * self.slot_bytes
        return self.flat[start:start + n].view(shape)

    def pin(self) -> bool:
        """Page-lock the mapping for CUDA (``cudaHostRegister``) so device copies from it are
        asynchronous; True when pinned. Call after the workers forked (what the driver does to
        registered pages across a fork is its own business). A failure leaves it pageable: the
        copies are then synchronous, still correct."""
        if self.pinned or not torch.cuda.is_available():
            return self.pinned
        rc = torch.cuda.cudart().cudaHostRegister(self.flat.data_ptr(), self.nbytes, 0)
        self.pinned = int(getattr(rc, "value", rc)) == 0
        return self.pinned

    def claim(self) -> int:
        """The next slot in rotation, once the device copy of its previous batch has finished."""
        slot = self._next % self.slots
        self._next += 1
        event, self._events[slot] = self._events[slot], None
        if event is not None:
            event.synchronize()
        return slot

    def to_device(self, slot: int, images: torch.Tensor, device: torch.device) -> torch.Tensor:
        """``images`` (a view of ``slot``) on ``device``, strides kept. On a GPU the copy is
        asynchronous when the ring is pinned, and the slot is not claimed again until it is done;
        elsewhere the result is a copy (the slot will be overwritten)."""
        if device.type != "cuda":
            return images.clone()
        out = images.to(device, non_blocking=self.pinned)
        if self.pinned:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            self._events[slot] = event
        return out

    def close(self) -> None:
        """Unregister the mapping from CUDA (after every pending copy from it finished)."""
        for event in self._events:
            if event is not None:
                event.synchronize()
        self._events = [None] * self.slots
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.flat.data_ptr())
            self.pinned = False

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown: CUDA may be gone already
            self.close()
