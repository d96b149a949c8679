"""Our losses against the reference outputs recorded in ``goldens/loss_*.npz`` (no reference needed).

Recorded by ``record_loss_goldens.py`` from the reference package on the random cases of
``loss_cases.py`` (zero / one / crowded / tiny targets, non-square images, an all-empty batch).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import loss_cases as lc  # noqa: E402
from record_loss_goldens import hash_seed  # noqa: E402

GOLDENS = sorted((Path(__file__).resolve().parent / "goldens").glob("loss_*.npz"))


def test_goldens_exist():
    tasks = {str(np.load(p)["task"]) for p in GOLDENS}
    assert tasks == set(lc.TASKS), f"missing loss goldens; found {[p.name for p in GOLDENS]}"


@pytest.mark.parametrize("path", GOLDENS, ids=[p.stem for p in GOLDENS])
def test_loss_matches_recorded_reference(path):
    data = dict(np.load(path))
    task = str(data.pop("task"))
    name = path.stem[len("loss_"):]
    case = {k: v for k, v in data.items() if not k.startswith("ref_")}
    ours = lc.run_ours(case, task)
    np.testing.assert_allclose(ours["vector"], data["ref_vector"], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ours["total"], data["ref_total"], rtol=1e-5, atol=1e-5)
    for key in (k for k in data if k.startswith("ref_gradproj_")):
        g = ours[f"grad_{key[len('ref_gradproj_'):]}"]
        _, proj = lc.projections(g, seed=hash_seed(name, "grad_" + key[len("ref_gradproj_"):]))
        scale = np.abs(g).sum() + 1e-12
        np.testing.assert_allclose(proj, data[key], rtol=1e-4, atol=1e-6 * scale, err_msg=key)
