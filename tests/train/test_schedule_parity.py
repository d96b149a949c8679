"""The training loop's per-iteration schedule against the reference trainer (black box; marker ``parity``).

Issue 14 item 6b asks why ours learns boxes faster than the reference on the GPU recipe-parity
runs. This pins the loop semantics down on the CPU, float32, tiny data (24 built-in images at 64
px, batch 4, 4 epochs, ``nbs`` 14 so ``accumulate = round(3.5) = 4`` and the decay is scaled by
16/14, ``warmup_epochs`` 1.5 so warmup ends mid-epoch, ``close_mosaic`` 1):

* the reference trainer runs in a child process (``schedule_ref_child.py``) with callbacks and
  wrapped public methods recording, per iteration, every group's lr / momentum / weight decay,
  ``accumulate``, whether the optimizer stepped, the EMA update count and decay, the images per
  batch, ``zero_grad`` calls and the epoch that closes mosaic; the child also replays *our*
  optimizer (``yolo_sgd`` wrapped as the step wraps it) and EMA on the reference's own
  micro-batch gradients and compares parameters and EMA after every iteration, and compares our
  gradients of its first batch (same initial weights) with its own;
* our real ``fit`` runs the same config with spies on the schedules it builds
  (``yolo_func.train.optimizer.yolo_schedules``) and on ``mosaic_enabled``, and an ``on_step`` hook
  reading the step / stepped flag / EMA count from the train state.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.parity

REPO = Path(__file__).resolve().parents[2]
N_TRAIN, BATCH, EPOCHS, IMGSZ = 24, 4, 4, 64
OPTIM = {"lr0": 0.01, "lrf": 0.01, "momentum": 0.937, "weight_decay": 0.0005, "warmup_epochs": 1.5,
         "warmup_bias_lr": 0.1, "warmup_momentum": 0.8, "nbs": 14}
CLOSE_MOSAIC = 1
GROUPS = ("decay", "no_decay", "bias")


def _stubs() -> Path:
    return next((p for p in (REPO.parent / "shared" / "tools" / "oracle-stubs", REPO / "shared" / "tools" / "oracle-stubs")
                 if p.is_dir()), REPO.parent / "shared" / "tools" / "oracle-stubs")


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    pytest.importorskip("ultralytics")
    from yolo_func.data import builtin_dataset
    from yolo_func.data.yolo import write_yolo_dataset

    tmp = tmp_path_factory.mktemp("schedule")
    train = builtin_dataset("detect", "train", num_images=N_TRAIN, root=tmp / "cache")
    val = builtin_dataset("detect", "val", num_images=4, root=tmp / "cache")
    data = write_yolo_dataset({"train": train, "val": val}, tmp / "yolo")
    spec = {"data": str(data), "epochs": EPOCHS, "batch": BATCH, "imgsz": IMGSZ, "classes": len(train.names),
            "project": str(tmp / "runs"), "close_mosaic": CLOSE_MOSAIC, "optim": OPTIM}
    env = dict(os.environ, YOLO_OFFLINE="1", YOLO_CONFIG_DIR=str(tmp / "cfg"),
               PYTHONPATH=os.pathsep.join(p for p in (str(REPO), str(_stubs()), os.environ.get("PYTHONPATH", "")) if p))
    done = subprocess.run([sys.executable, str(Path(__file__).with_name("schedule_ref_child.py")), json.dumps(spec)],
                          env=env, capture_output=True, text=True, timeout=600)
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line is not None, done.stdout[-3000:] + done.stderr[-3000:]
    ref = json.loads(line[len("RESULT "):])
    return ref, _our_trace(tmp, train, val)


def _our_trace(tmp: Path, train, val) -> dict:
    import yolo_func.data.loader as loader_mod
    import yolo_func.train.optimizer as optimizer_mod
    from yolo_func.configs import build_config
    from yolo_func.optim import ema_decay, yolo_param_labels
    from yolo_func import tree as T
    from yolo_func.train import fit

    log: dict = {"values": {}, "mosaic": {}, "steps": [], "opt": []}
    real_schedules, real_mosaic = optimizer_mod.yolo_schedules, loader_mod.mosaic_enabled

    def spy_schedules(*a, **k):
        s = real_schedules(*a, **k)

        def wrap(key, f):
            def g(ni):
                v = f(ni)
                log["values"].setdefault(int(ni), {})[key] = v.item()
                return v
            return g

        return s._replace(lr={name: wrap(f"lr/{name}", f) for name, f in s.lr.items()},
                          momentum=wrap("momentum", s.momentum), accumulate=wrap("accumulate", s.accumulate))

    def spy_mosaic(epoch, epochs, cfg):
        v = real_mosaic(epoch, epochs, cfg)
        log["mosaic"][epoch] = v
        return v

    fit_mod = importlib.import_module("yolo_func.train.fit")  # the module (yolo_func.train.fit is also the function)
    real_optimizer = fit_mod._optimizer

    def spy_optimizer(*a, **k):
        opt = real_optimizer(*a, **k)
        log["opt"].append(opt)
        return opt

    def on_step(info) -> None:
        ts = info.train_state
        if not log["steps"]:
            labels = T.tree_leaves(yolo_param_labels(ts.params))
            log["group_sizes"] = {g: labels.count(g) for g in GROUPS}
        log["steps"].append({"epoch": info.epoch, "i": info.batch_index, "ni": int(info.metrics["step"]),
                             "images": int(info.batch.images.shape[0]), "stepped": bool(ts.opt_state.stepped),
                             "ema_updates": int(ts.ema.count), "ema_decay": float(ema_decay(ts.ema.count))})

    config = build_config("yolov8n", flags={"epochs": EPOCHS, "imgsz": IMGSZ, "batch": BATCH, "device": "cpu",
                                            "out": str(tmp / "ours")},
                          overrides=[f"optim.{k}={v}" for k, v in OPTIM.items()] + [
                              f"data.augment.close_mosaic={CLOSE_MOSAIC}", "data.workers=0", "data.cache=none",
                              "train.plots=false", "val.coco=off", f"train.val_every={EPOCHS}", "train.capture=none",
                              "train.autocast=none", "train.vjp=autograd"])  # autograd: same loop, fast CPU start-up
    mp = pytest.MonkeyPatch()
    try:
        mp.setattr(optimizer_mod, "yolo_schedules", spy_schedules)
        mp.setattr(loader_mod, "mosaic_enabled", spy_mosaic)
        mp.setattr(fit_mod, "_optimizer", spy_optimizer)
        fit(config, train_data=train, val_data=val, on_step=on_step, progress=False)
    finally:
        mp.undo()
    return log


def _ref_rows(ref: dict) -> list[dict]:
    return [r for r in ref["rows"] if "ni" in r]


def _hand_steps(nb: int) -> list[int]:
    """REFERENCE.md §4.3 by hand: nw = round(warmup_epochs * nb); accumulate ramps 1 -> 4 by np.interp
    and round-half-even until ni = nw; a step when ni - last_step >= accumulate."""
    import numpy as np

    nw = round(min(OPTIM["warmup_epochs"], EPOCHS - 1) * nb)
    last, out = -1, []
    for ni in range(nb * EPOCHS):
        acc = max(1, round(float(np.interp(ni, [0, nw], [1, 4])))) if ni <= nw else 4
        if ni - last >= acc:
            out.append(ni)
            last = ni
    return out


def test_groups_and_weight_decay(traces):
    ref, ours = traces
    start = ref["train_start"]
    assert start["type"] == "SGD" and start["accumulate"] == 4
    groups = {g["kind"]: g for g in start["groups"]}
    assert set(groups) == set(GROUPS)
    assert all(g["nesterov"] and g["dampening"] == 0 for g in groups.values())
    # weight decay: 5e-4 * batch * accumulate / nbs = 5e-4 * 4 * 4 / 14 on the decayed group only
    expected = 0.0005 * 4 * 4 / 14
    assert groups["decay"]["weight_decay"] == pytest.approx(expected, rel=1e-12)
    assert groups["no_decay"]["weight_decay"] == 0 and groups["bias"]["weight_decay"] == 0
    (opt,) = ours["opt"]
    assert opt.accumulate == 4 and opt.weight_decay == pytest.approx(expected, rel=1e-12)
    # sizes: the reference's decayed group also holds its frozen DFL kernel (a constant in ours)
    assert ours["group_sizes"] == {"decay": groups["decay"]["n"] - 1, "no_decay": groups["no_decay"]["n"],
                                   "bias": groups["bias"]["n"]}


def test_per_iteration_schedule_matches_reference(traces):
    ref, ours = traces
    rows = _ref_rows(ref)
    nb = ref["train_start"]["nb"]
    assert nb == N_TRAIN // BATCH == 6  # N divisible by the batch: no partial batch (ours drops one, the reference keeps it)
    assert len(ours["steps"]) == len(rows) == nb * EPOCHS
    sched = ours["opt"][0].schedules
    for s, r in zip(ours["steps"], rows, strict=True):
        where = f"epoch {r['epoch']} batch {r['i']} (ni {r['ni']})"
        assert (s["epoch"], s["i"], s["ni"], s["images"]) == (r["epoch"], r["i"], r["ni"], r["images"]), where
        # The values the optimizer itself read at this ni (copied before the calls below add theirs):
        # an accumulating call's optimizer reads only the accumulation count on the CPU (its
        # learning rates and momentum would be selected away), a stepping call reads them all.
        used = dict(ours["values"].get(s["ni"], {}))
        ni = torch.tensor(s["ni"], dtype=torch.int64)
        v = {**{f"lr/{g}": sched.lr[g](ni).item() for g in GROUPS}, "momentum": sched.momentum(ni).item(),
             "accumulate": sched.accumulate(ni).item()}
        assert not s["stepped"] or {k: used.get(k) for k in v} == v, f"values the optimizer used at {where}"
        assert used.get("accumulate") == v["accumulate"], f"the accumulation count the optimizer read at {where}"
        for g in GROUPS:
            assert v[f"lr/{g}"] == pytest.approx(r["lr"][g], rel=1e-12, abs=1e-15), f"lr/{g} at {where}"
            assert v["momentum"] == pytest.approx(r["momentum"][g], rel=1e-12), f"momentum at {where}"
        assert v["accumulate"] == r["accumulate"], f"accumulate at {where}"
        assert s["stepped"] == r["stepped"], f"optimizer step at {where}"
        assert s["ema_updates"] == r["ema_updates"], f"EMA updates at {where}"
        assert s["ema_decay"] == pytest.approx(r["ema_decay"], rel=1e-12), f"EMA decay at {where}"
    # hand-checked landmarks of this config: nw = round(1.5 * 6) = 9 (warmup ends mid-epoch 1);
    # the accumulation window is not flushed at an epoch's end (the reference zeroes gradients only
    # after a step, and once before training)
    steps = _hand_steps(nb)
    assert steps == [0, 1, 3, 6, 10, 14, 18, 22]
    assert [r["ni"] for r in rows if r["stepped"]] == steps
    assert ref["zero_grad_at"] == [-1, *steps]
    assert rows[9]["lr"]["bias"] == pytest.approx(0.01 * (1 - 1 / 4 * 0.99), rel=1e-12)  # lr0 * lf(1) at ni = nw
    # close_mosaic: both turn mosaic off from epoch E - close_mosaic
    assert ref["mosaic_closed_at_epoch"] == EPOCHS - CLOSE_MOSAIC
    assert [e for e, on in sorted(ours["mosaic"].items()) if not on] == [EPOCHS - CLOSE_MOSAIC]


def test_our_optimizer_and_ema_on_reference_gradients(traces):
    """Our ``yolo_sgd`` + EMA fed the reference's micro-batch gradients track its parameters and EMA."""
    ref, _ = traces
    for r in _ref_rows(ref):
        where = f"ni {r['ni']}"
        assert r["ours_stepped"] == r["stepped"], where
        assert r["ours_ema_count"] == r["ema_updates"], where
        assert r["params_max_abs_diff"] <= 1e-5, where
        assert r["ema_max_abs_diff"] <= 1e-5, where


def test_first_batch_gradients_match_reference(traces):
    """Same weights, same batch: our loss and gradients equal the reference's (its loss x batch size)."""
    ref, _ = traces
    g = ref["grad_check"]
    assert g is not None and g["batch"] == BATCH
    assert g["ours_loss"] == pytest.approx(g["ref_loss"], rel=1e-5)
    assert g["diff_norm"] <= 1e-4 * g["ref_norm"]
    assert g["ours_norm"] == pytest.approx(g["ref_pre_step_norm"], rel=1e-5)
    assert torch.tensor(list(g["ours_parts"].values())).allclose(torch.tensor(g["ref_loss_items"]), rtol=1e-4, atol=1e-6)
