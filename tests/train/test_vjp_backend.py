"""The step's differentiation backend (``vjp="func" | "autograd"``, :func:`yolo_func.func.vjp_backend`).

- ``"autograd"`` runs the same forward (losses bitwise equal) and dispatches the same aten ops as
  ``"func"`` (counted), with gradients equal up to float summation order (a second implementation:
  torch.func's).
- It never imports ``torch._dynamo`` (checked in a fresh interpreter against ``"func"``, which does:
  the contrast keeps the check honest), in a step and in a whole CPU fit.
- The replay levels differentiate as their eager step does: CPU stand-in captures here
  (tests/train/test_replay_levels_cpu.py), real CUDA graphs in tests/capture/test_replay_step.py.
"""

from __future__ import annotations

import collections
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from yolo_func import tree as T
from yolo_func import yolov8
from yolo_func.configs import build_config
from yolo_func.func import VJP_BACKENDS, current_vjp_backend, flat_vjp, vjp_backend
from yolo_func.optim import ema, sgd
from yolo_func.testing import count_aten_ops
from yolo_func.testing.synthetic import synthetic_batch
from yolo_func.train import init_train_state, train_step
from yolo_func.train.replay import ReplayTrainStep

REPO = Path(__file__).resolve().parents[2]


def test_unknown_backends_are_refused_everywhere():
    with pytest.raises(ValueError, match=r"vjp backend must be one of \['func', 'autograd'\], got 'jax'"):
        with vjp_backend("jax"):
            pass
    model = yolov8("n", num_classes=2)
    with pytest.raises(ValueError, match="vjp must be one of"):
        ReplayTrainStep(model, sgd(0.01), vjp="torch")
    with pytest.raises(ValueError, match="train.vjp"):
        build_config("yolov8n", overrides=["train.vjp=jax"])
    assert build_config("yolov8n", overrides=["train.vjp=autograd"]).train.vjp == "autograd"
    assert build_config("yolov8n").train.vjp == "auto" and VJP_BACKENDS == ("func", "autograd")
    from yolo_func.train.fit import resolve_vjp

    # 'auto': autograd on the CPU (no torch._dynamo import, less host time), func on CUDA
    assert [resolve_vjp(v, torch.device(d)) for v in ("auto", "func", "autograd") for d in ("cpu", "cuda")] == \
        ["autograd", "func", "func", "func", "autograd", "autograd"]


def test_the_backend_is_per_thread_and_restored():
    import threading

    seen = {}
    with vjp_backend("autograd"):
        t = threading.Thread(target=lambda: seen.setdefault("other", current_vjp_backend()))
        t.start()
        t.join()
        seen["here"] = current_vjp_backend()
        with vjp_backend("func"):
            seen["nested"] = current_vjp_backend()
        seen["after_nested"] = current_vjp_backend()
    assert seen == {"other": "func", "here": "autograd", "nested": "func", "after_nested": "autograd"}
    assert current_vjp_backend() == "func"


def test_flat_vjp_through_autograd_matches_hand_computed_gradients():
    p = {"a": torch.tensor([1.0, -2.0]), "b": torch.tensor(3.0)}

    def fn(q):  # y = sum(a^2 * b): dy/da = 2ab, dy/db = sum(a^2)
        return (q["a"] ** 2 * q["b"]).sum(), {"n": torch.tensor(1)}

    with vjp_backend("autograd"):
        out, pullback, aux = flat_vjp(fn, p)
    (g,) = pullback(torch.tensor(2.0))
    assert out.item() == 15.0 and not out.requires_grad and aux["n"].item() == 1
    assert torch.equal(g["a"], torch.tensor([12.0, -24.0])) and torch.equal(g["b"], torch.tensor(10.0))


@pytest.mark.parametrize("task", ["detect", "segment", "pose"])
def test_autograd_step_has_the_same_forward_and_ops_and_close_gradients(task):
    model = yolov8("n", task=task, num_classes=3)
    tx, e = sgd(0.01, 0.9, nesterov=True), ema()
    ts0 = init_train_state(model, tx, torch.Generator().manual_seed(0), ema=e)
    batch = synthetic_batch(task, 2, 64, num_classes=3, max_boxes=4, seed=3)
    train_step(ts0, batch, model=model, tx=tx, ema=e)  # first-call caches (anchors) out of the count
    runs = {}
    for name in VJP_BACKENDS:
        with count_aten_ops() as ops:
            ts, m = train_step(ts0, batch, model=model, tx=tx, ema=e, vjp=name)
        runs[name] = (ts, m, collections.Counter(ops.by_op))
    (ts_f, m_f, ops_f), (ts_a, m_a, ops_a) = runs["func"], runs["autograd"]
    # the same kernels, op for op; autograd adds one detach (a view, no kernel) per fresh leaf
    detach = "aten.detach.default"
    extra = ops_a.pop(detach, 0) - ops_f.pop(detach, 0)
    assert ops_a == ops_f
    n_leaves = len(T.tree_leaves(ts0.params)) + 3 * len(model.heads)  # params, and each head's feature inputs
    assert 0 <= extra <= n_leaves + 16, (extra, n_leaves)
    for k, v in m_f.items():  # the forward (losses, parts) is the same computation: bitwise
        if k.startswith("loss"):
            assert torch.equal(m_a[k], v), k
    torch.testing.assert_close(m_a["grad_norm"], m_f["grad_norm"], rtol=1e-5, atol=0)
    assert T.tree_structure(ts_a) == T.tree_structure(ts_f)
    for a, f in zip(T.tree_leaves(ts_a.params), T.tree_leaves(ts_f.params)):
        torch.testing.assert_close(a, f, rtol=1e-5, atol=1e-7)
    changed = [not torch.equal(a, b) for a, b in zip(T.tree_leaves(ts_a.params), T.tree_leaves(ts0.params))]
    assert sum(changed) > len(changed) // 2  # the update happened (the comparison is not vacuous)
    assert all(torch.equal(a, f) for a, f in zip(T.tree_leaves(ts_a.state), T.tree_leaves(ts_f.state)))  # forward only


def _fresh(code: str) -> dict:
    """Run ``code`` in a fresh interpreter (torch._dynamo not imported yet); its last stdout line is JSON."""
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, cwd=REPO,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_autograd_steps_never_import_dynamo_and_func_steps_do():
    got = _fresh("""
        import json, sys, torch
        from yolo_func import yolov8
        from yolo_func.optim import sgd
        from yolo_func.testing.synthetic import synthetic_batch
        from yolo_func.train import init_train_state, train_step
        from yolo_func.train.replay import ReplayTrainStep
        res = {"start": "torch._dynamo" in sys.modules}
        model = yolov8("n", task="segment", num_classes=3)
        tx = sgd(0.01, 0.9)
        ts = init_train_state(model, tx, torch.Generator().manual_seed(0))
        b = synthetic_batch("segment", 2, 64, num_classes=3, max_boxes=4)
        ts, _ = train_step(ts, b, model=model, tx=tx, vjp="autograd")
        step = ReplayTrainStep(model, tx, capture="network+heads", vjp="autograd")  # eager on the CPU
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ts, _ = step(ts, b)
        res["autograd"] = "torch._dynamo" in sys.modules
        ts, _ = train_step(ts, b, model=model, tx=tx)
        res["func"] = "torch._dynamo" in sys.modules
        print(json.dumps(res))
    """)
    assert got == {"start": False, "autograd": False, "func": True}


@pytest.mark.slow
def test_a_cpu_fit_with_autograd_never_imports_dynamo(tmp_path):
    got = _fresh(f"""
        import json, sys
        from yolo_func.configs import build_config
        from yolo_func.data import builtin_dataset
        from yolo_func.train import fit
        root = {str(tmp_path / "data")!r}
        tr, va = builtin_dataset("detect", "train", root=root, num_images=4), builtin_dataset("detect", "val", root=root, num_images=2)
        cfg = build_config("yolov8n", flags={{"imgsz": 64, "batch": 2, "epochs": 1, "out": {str(tmp_path / "run")!r},
                           "device": "cpu"}}, overrides=["data.workers=0", "train.plots=false", "train.vjp=autograd"])
        r = fit(cfg, train_data=tr, val_data=va, progress=False)
        print(json.dumps({{"dynamo": "torch._dynamo" in sys.modules, "steps": r.steps, "stopped": r.stopped}}))
    """)
    assert got == {"dynamo": False, "steps": 2, "stopped": "completed"}
