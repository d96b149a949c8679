"""keep_freed_host_memory: freed host memory stays mapped, so re-allocating it costs no page faults."""

from __future__ import annotations

import subprocess
import sys

import pytest

_PROBE = r"""
import resource, sys, torch
from yolo_func.train.host_memory import keep_freed_host_memory
applied = keep_freed_host_memory() if sys.argv[1] == "1" else False
def step():  # a step's pattern: many blocks allocated and touched, then all freed
    xs = [torch.empty(12 << 20, dtype=torch.uint8) for _ in range(10)]
    for x in xs:
        x.fill_(1)
    del xs
for _ in range(3):  # warm up: the heap reaches its working size
    step()
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    step()
print(applied, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
"""


def _faults(tune: bool, env_off: bool = False) -> tuple[bool, int]:
    import os

    env = dict(os.environ, YOLO_FUNC_KEEP_HOST_MEMORY="0" if env_off else "1")
    out = subprocess.run([sys.executable, "-c", _PROBE, "1" if tune else "0"], capture_output=True, text=True,
                         env=env, check=True).stdout.split()
    return out[0] == "True", int(out[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt (Linux) only")
def test_freed_memory_is_reused_without_page_faults():
    applied, tuned = _faults(True)
    _, plain = _faults(False)
    assert applied
    # 10 steps x 120 MiB touched: 30720 pages a step when the heap is trimmed (or the blocks
    # unmapped) on free and mapped again; measured 306880 plain, 12288 tuned
    assert plain > 10 * 15000, plain
    assert tuned < plain / 10, (tuned, plain)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt (Linux) only")
def test_switched_off_by_the_environment():
    applied, faults = _faults(True, env_off=True)
    assert not applied and faults > 10 * 15000
