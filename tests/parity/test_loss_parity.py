"""Loss parity against the reference criterion used as a black box (ORACLE.md), marker ``parity``.

On random predictions and random targets for detect / segment / pose (zero targets, one target,
crowded images, tiny boxes, non-square images, an empty batch): the loss vector (x B), the items,
and the gradients of ``sum(vector)`` w.r.t. every prediction tensor.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import loss_cases as lc  # noqa: E402

pytestmark = pytest.mark.parity

CASES = [(task, seed, size, False) for task in lc.TASKS for seed, size in ((1, (64, 96)), (2, (128, 160)), (3, (96, 64)))]
CASES += [(task, 4, (64, 64), True) for task in lc.TASKS]


@pytest.mark.parametrize("task,seed,size,empty", CASES, ids=[f"{t}-{s}-{h}x{w}{'-empty' if e else ''}" for t, s, (h, w), e in CASES])
def test_loss_and_gradients_match_reference(task, seed, size, empty):
    case = lc.make_case(task, 7000 + seed, image_size=size, empty=empty)
    ours, ref = lc.run_ours(case, task), lc.run_reference(case, task)
    np.testing.assert_allclose(ours["vector"], ref["vector"], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ours["items"], ref["items"], rtol=1e-5, atol=1e-6)
    for key in (k for k in ref if k.startswith("grad_")):
        scale = np.abs(ref[key]).max() + 1e-12
        np.testing.assert_allclose(ours[key], ref[key], rtol=1e-4, atol=1e-5 * scale, err_msg=key)
