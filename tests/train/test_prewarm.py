"""The warm-up through autograd (``vjp_through_autograd``) that lets a fit's first capture overlap
with the ``torch._dynamo`` import: the same gradients as ``torch.func`` (second implementation), and
on the GPU a fresh process's first replayed steps unchanged by it (bitwise against eager)."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from yolo_func import yolov8
from yolo_func.func import dynamo_imported, flat_vjp, vjp_through_autograd
from yolo_func.testing.synthetic import synthetic_batch

REPO = Path(__file__).resolve().parents[2]


def test_autograd_warmup_gives_the_functorch_gradients():
    model = yolov8("n", task="segment", num_classes=3)
    params, state = model.init(torch.Generator().manual_seed(0))
    x = synthetic_batch("segment", 2, 64, num_classes=3).images.float()

    def fn(p):
        feats, _ = model.features(p, state["network"], x, train=True)
        return tuple(feats), {}

    outs = {}
    for name, ctx in (("func", torch.no_grad), ("autograd", vjp_through_autograd)):
        with ctx():
            out, pullback, _ = flat_vjp(fn, params["network"])
        cot = tuple(torch.ones_like(f) for f in out)
        with torch.no_grad():
            outs[name] = (out, pullback(cot)[0])
    for a, b in zip(outs["func"][0], outs["autograd"][0]):
        assert torch.equal(a, b)
    ga, gb = outs["func"][1], outs["autograd"][1]
    from yolo_func import tree as T
    for a, b in zip(T.tree_leaves(ga), T.tree_leaves(gb)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert not getattr(__import__("yolo_func.func", fromlist=["_VJP"])._VJP, "autograd", False)  # restored


def test_dynamo_imported_reads_a_finished_import():
    import torch._dynamo  # noqa: F401

    assert dynamo_imported()


@pytest.mark.cuda
def test_first_capture_with_dynamo_importing_on_a_thread_equals_eager():
    # a fresh interpreter: torch._dynamo not imported yet, imported on a thread as the fit does
    script = textwrap.dedent("""
        import threading, sys, torch
        from yolo_func import yolov8, tree as T
        from yolo_func.optim import sgd
        from yolo_func.testing.synthetic import synthetic_batch
        from yolo_func.train import init_train_state
        from yolo_func.train.replay import ReplayTrainStep
        import yolo_func.func as F
        assert "torch._dynamo" not in sys.modules
        calls = []
        orig = F.autograd_vjp
        F.autograd_vjp = lambda *a, **k: (calls.append(1), orig(*a, **k))[1]
        import yolo_func.train.replay as R
        R.dynamo_imported = lambda: False  # the import below may finish before the first step: force the path
        threading.Thread(target=lambda: __import__("torch._dynamo")).start()
        model = yolov8("n", task="segment", num_classes=5)
        tx = sgd(0.01, momentum=0.9)
        batches = [synthetic_batch("segment", 2, 128, num_classes=5, max_boxes=8, seed=i, device="cuda") for i in range(3)]
        def run(capture):
            ts = init_train_state(model, tx, torch.Generator().manual_seed(0), device="cuda")
            step = ReplayTrainStep(model, tx, capture=capture, warmup=1)
            for b in batches:
                ts, m = step(ts, b)
            return T.tree_map(lambda t: t.clone(), (ts, m)), step
        replayed, step = run("step")
        assert step.cache.num_captures == 1, step.cache.num_captures
        prewarm_calls = len(calls)
        eager, _ = run("none")
        for a, b in zip(T.tree_leaves(replayed), T.tree_leaves(eager)):
            assert torch.equal(a, b)
        print("PREWARM_CALLS", prewarm_calls)
    """)
    env = dict(os.environ, YOLO_FUNC_PREWARM="1")  # opt-in (yolo_func.train.replay.PREWARM)
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=str(REPO), timeout=300, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    calls = int(p.stdout.split("PREWARM_CALLS")[1].split()[0])
    assert calls > 0  # the prewarm ran (through autograd) and the results still equal eager
