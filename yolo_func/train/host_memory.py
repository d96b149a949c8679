"""Keep freed host memory in the process while training on the CPU (glibc ``mallopt``).

A functional training step allocates its results afresh every step (new parameters, moments,
activations and gradients) and frees the previous ones. With glibc's default settings the freed
memory at the top of the heap is returned to the kernel once it exceeds the trim threshold, and
blocks above the (dynamic) mmap threshold are unmapped on free, so the next step touches fresh
pages again: ~20,000 minor page faults a step for the nano detector at 320 px, batch 8, each fault
paid inside whichever kernel first writes the page. :func:`keep_freed_host_memory` raises the trim
threshold, pads heap growth and pins the mmap threshold at its maximum, so the freed memory stays
mapped and is reused: ~1,000 faults a step instead of ~11,000, and the CPU step ~4-5% shorter on
the development VM (median 811 -> 772 ms over three alternating rounds, one of which showed no gain;
``benchmarks/host_memory_ab.py``, ``benchmarks/results/host_memory_ab_20261206T205110Z.json``). The process keeps its peak heap instead of giving
memory back; the fit applies it on the CPU only (``YOLO_FUNC_KEEP_HOST_MEMORY=0`` turns it off).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

__all__ = ["keep_freed_host_memory"]

# mallopt(3) parameters (glibc <malloc.h>)
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_MAX = 4 * 1024 * 1024 * ctypes.sizeof(ctypes.c_long)  # glibc's cap: 32 MiB on 64-bit

_applied = False


def keep_freed_host_memory(*, trim_threshold: int = 1 << 30, top_pad: int = 256 << 20) -> bool:
    """Tell glibc's malloc to keep freed memory mapped (module docstring); process-wide, idempotent.

    Args:
      trim_threshold: bytes of free memory at the top of the heap kept before trimming (1 GiB).
      top_pad: extra bytes requested with each heap growth (256 MiB; untouched pages cost nothing).

    Returns:
      True when the settings are in effect (Linux with glibc, not switched off by
      ``YOLO_FUNC_KEEP_HOST_MEMORY=0``), else False (nothing changed).
    """
    global _applied
    if _applied:
        return True
    if os.environ.get("YOLO_FUNC_KEEP_HOST_MEMORY", "1") == "0" or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl or another libc: no mallopt
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = (mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX) == 1 and mallopt(_M_TRIM_THRESHOLD, int(trim_threshold)) == 1
          and mallopt(_M_TOP_PAD, int(top_pad)) == 1)
    _applied = ok
    return ok
