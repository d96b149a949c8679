"""Our model against recorded reference outputs (CPU, no reference package needed).

The goldens were recorded by ``tests/parity/record_model_goldens.py`` (oracle venv): the reference
nano models loaded with our seed-0 init, one train-mode forward (outputs and the BN statistics it
leaves) and one eval-mode forward with those statistics, on a seeded 2x3x64x64 input.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from yolo_func.io import to_reference
from yolo_func.models import yolov8

GOLDENS = Path(__file__).resolve().parent / "goldens"
# rtol as the issue asks; atol 1e-4 because CPU conv kernels reduce in an order that depends on
# the thread count (1 vs 2 OpenMP threads moves near-zero activations by up to ~5e-6) and on the
# CPU's vector ISA: goldens recorded on an AVX-512 machine differ by up to 4.7e-5 on an AVX2-only
# AMD EPYC (train-mode BN at batch 2 amplifies conv rounding). A wrong layer or weight mapping
# moves outputs by 1e-2 or more.
TOL = dict(rtol=1e-5, atol=1e-4)
TASKS = ("detect", "segment", "pose")


def load_golden(task: str) -> dict[str, np.ndarray]:
    """The recording for ``task``, with the entries it shares with the detect recording filled in."""
    with np.load(GOLDENS / f"model_n_{task}.npz") as z:
        g = {k: z[k] for k in z.files}
    if task != "detect":
        with np.load(GOLDENS / "model_n_detect.npz") as z:
            d = {k: z[k] for k in z.files}
        for k in g.pop("recipe:from_detect").tolist():
            if k == "eval:y":
                g[k] = np.concatenate([d[k], g.pop("eval:y_extra")], 1)
            else:
                g[k] = d[k]
    return g


def recorded_input(g: dict[str, np.ndarray]) -> torch.Tensor:
    shape = tuple(int(v) for v in g["recipe:input_shape"])
    x = torch.randn(shape, generator=torch.Generator().manual_seed(int(g["recipe:input_seed"])))
    # Told apart: a change of torch's RNG stream (this fails) from a change of the model (later asserts).
    np.testing.assert_array_equal(x.flatten()[:8].numpy(), g["recipe:input_head"], err_msg="torch.randn stream changed")
    assert abs(float(x.double().sum()) - float(g["recipe:input_sum"])) < 1e-9
    return x


def check(ours: torch.Tensor, golden: np.ndarray, what: str) -> None:
    assert tuple(ours.shape) == golden.shape, f"{what}: {tuple(ours.shape)} vs {golden.shape}"
    torch.testing.assert_close(ours, torch.from_numpy(golden), **TOL, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("task", TASKS)
def test_model_matches_reference_goldens(task):
    g = load_golden(task)
    x = recorded_input(g)
    model = yolov8("n", task=task)
    params, state = model.init(torch.Generator().manual_seed(int(g["recipe:init_seed"])))

    preds, new_state = model.apply(params, state, x, train=True)
    feats, _ = model.features(params["network"], state["network"], x, train=True)
    for i, f in enumerate(feats):
        check(f, g[f"train:feats{i}"], f"feats{i}")
    check(preds["detect"].box_dist.transpose(1, 2), g["train:boxes"], "boxes")
    check(preds["detect"].cls_logits.transpose(1, 2), g["train:scores"], "scores")
    if task == "segment":
        check(preds["segment"].coeffs.transpose(1, 2), g["train:mask_coefficient"], "mask_coefficient")
        check(preds["segment"].protos, g["train:proto"], "proto")
    if task == "pose":
        check(preds["pose"].keypoints.transpose(1, 2), g["train:kpts"], "kpts")

    sd = to_reference(model, params, new_state)
    bn = {k[3:]: v for k, v in g.items() if k.startswith("bn:")}
    assert set(bn) == {k for k in sd if k.endswith(("running_mean", "running_var"))}
    for k, v in bn.items():
        check(sd[k], v, k)

    out = model.predict(params, new_state, x)
    check(out.y, g["eval:y"], "eval y")
    if task == "segment":
        check(out.protos, g["eval:proto"], "eval proto")
    else:
        assert out.protos is None and "eval:proto" not in g


def test_goldens_are_small():
    for task in TASKS:
        assert (GOLDENS / f"model_n_{task}.npz").stat().st_size < 300 * 1024
