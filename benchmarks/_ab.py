"""Two checkouts side by side: run one snippet per arm in its own process, the arms alternating
round by round (a noisy machine slows both alike). Shared by ``loader_ab.py`` and
``update_cycle_ab.py``."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path


def arms(before: str, after: str) -> dict[str, str]:
    """``{"before": root, "after": root}`` as absolute paths."""
    return {"before": str(Path(before).resolve()), "after": str(Path(after).resolve())}


def alternate(roots: dict[str, str], code: str, argv: list[str], rounds: int,
              show: Callable[[int, str, str], None] | None = None) -> dict[str, list[str]]:
    """Run ``python -c code root *argv`` once per arm per round, alternating; each run's last
    stdout line, per arm in round order. ``show(round, arm, line)`` is called after each run."""
    got: dict[str, list[str]] = {k: [] for k in roots}
    for r in range(rounds):
        for name, root in roots.items():
            out = subprocess.run([sys.executable, "-c", code, root, *argv], capture_output=True, text=True, check=True)
            got[name].append(out.stdout.strip().splitlines()[-1])
            if show is not None:
                show(r, name, got[name][-1])
    return got
