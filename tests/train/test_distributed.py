"""Data-parallel training on the CPU: 2 gloo processes (torch.multiprocessing spawn, torchrun for
the crash), tiny images (64 px), a few steps.

- A 2-process run with per-rank batch B equals a 1-process run with batch 2B, step by step. The
  comparison is meaningful only where the maths is the same: BN statistics are the global
  batch's on both sides (SyncBN on, the 1-process run through the same code with the identity
  all-reduce), and the loss is a sum over images (a test head whose loss has no per-batch
  normaliser). The YOLO detection loss divides by the batch's target-score sum, so with it a
  2 x B run differs from a 2B run by design (each rank normalises by its own batch, as the
  reference trainer's data-parallel mode does) — that is not something to test equality on.
  Both sides run in float64, so the only differences — summation orders (BN sums over two halves
  then an all-reduce, versus one sum over the whole batch; weight gradients summed per rank then
  across ranks) — are ~1e-15 relative and any real mismatch (a missing factor, a wrong slice, a
  BN statistic of one rank) shows up orders of magnitude above the tolerance: rtol 1e-9 and atol
  1e-9 x max(the tensor's largest magnitude, 1e-2) on the parameters after each step (an element far
  smaller than its tensor's scale carries the tensor's absolute rounding, ~1e-12; BN's backward
  amplifies summation-order differences, and the thread count changes the order from run to run). (In float32 the same comparison passes only at ~1e-3
  relative on small elements: BN's backward amplifies 1e-7 summation differences.) The running
  statistics go through SyncBN's two-point update (module :mod:`yolo_func.nn.batchnorm`):
  rtol 1e-7.
- The sampler: the two ranks' batches together are the 1-process loader's batches of 2B.
- Resume: a 2-process fit stopped mid-epoch (a hook on rank 0 only: the stop is voted) and resumed
  ends with bitwise the parameters of an uninterrupted 2-process fit (BN running statistics to
  float32 rounding: see the test).
- A crash in one rank ends a torchrun job with that rank's error within a bounded time.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[2]
IMGSZ, B, STEPS = 64, 1, 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(fn, world: int, *args) -> None:
    port = _free_port()
    mp.start_processes(_entry, args=(world, port, fn, args), nprocs=world, join=True, start_method="spawn")


def _entry(rank: int, world: int, port: int, fn, args) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), YOLO_FUNC_DIST_TIMEOUT="60")
    torch.set_num_threads(1)
    from yolo_func.train import distributed as D

    ctx = D.init_distributed("cpu")
    try:
        fn(ctx, *args)
    finally:
        D.shutdown()


# ------------------------------------------------------------------------------ step equivalence


def _sum_loss(preds, targets, assignment):
    """A detection-shaped loss with no per-batch normaliser: a sum over images (and anchors)."""
    logits, dist = preds.cls_logits.float(), preds.box_dist.float()
    l_cls = F.binary_cross_entropy_with_logits(logits, assignment.target_scores.to(logits.dtype), reduction="sum") / 64
    l_box = (dist.square().mean(-1) * assignment.fg_mask).sum() / 64
    return l_cls + l_box, {"box": l_box.detach(), "cls": l_cls.detach(), "dfl": torch.zeros(())}


def _setup(world: int, rank: int, batch: int, root: Path):
    from yolo_func import tree as T
    from yolo_func.data import TrainLoader, builtin_dataset
    from yolo_func.data.augment import AugmentConfig
    from yolo_func.models.yolov8 import yolov8
    from yolo_func.optim import sgd
    from yolo_func.train.step import init_train_state

    ds = builtin_dataset("detect", "train", root=root, num_images=2 * B * STEPS)
    aug = AugmentConfig(mosaic=0.0, fliplr=0.0, hsv_h=0.0, hsv_s=0.0, hsv_v=0.0, degrees=0.0, translate=0.0,
                        scale=0.0, shear=0.0, perspective=0.0)
    loader = TrainLoader(ds, batch_size=batch, image_size=IMGSZ, workers=0, seed=3, augment=aug, rank=rank,
                         world_size=world, max_boxes=32)
    model = yolov8("n", task="detect", num_classes=len(ds.names))
    model = model.with_heads({"detect": model.heads["detect"]._replace(loss=_sum_loss)})
    tx = sgd(learning_rate=0.05, momentum=0.9)
    params, state = model.init(torch.Generator().manual_seed(0))
    to64 = lambda tree: T.tree_map(lambda x: x.double(), tree)  # noqa: E731
    ts = init_train_state(model, tx, None, params=to64(params), state=to64(state))  # float64: see the module docstring
    return loader, model, tx, ts


def _run_steps(ctx, root: str, out: str) -> None:
    from yolo_func.nn import sync_batchnorm
    from yolo_func.train import distributed as D
    from yolo_func.train.step import train_step

    world, rank = (ctx.world_size, ctx.rank) if ctx is not None else (1, 0)
    loader, model, tx, ts = _setup(world, rank, B if ctx is not None else 2 * B, Path(root))
    reduce = D.differentiable_all_reduce if ctx is not None else (lambda t: t)
    record = {"images": [], "params": []}
    for b, batch in enumerate(loader):
        record["images"].append(batch.images.clone())
        with sync_batchnorm(reduce):
            ts, metrics = train_step(ts, batch._replace(images=batch.images.contiguous()), model=model, tx=tx,
                                     grad_reduce=D.GradReducer() if ctx is not None else None)
        record["params"].append({k: v.clone() for k, v in __import__("yolo_func").tree.tree_items(ts.params)})
        record.setdefault("loss", []).append(float(metrics["loss"]))
    record["state"] = dict(__import__("yolo_func").tree.tree_items(ts.state))
    torch.save(record, Path(out) / f"steps_w{world}_r{rank}.pt")


@pytest.fixture(scope="module")
def builtin_root(tmp_path_factory):
    from yolo_func.data import builtin_dataset

    root = tmp_path_factory.mktemp("builtin")
    builtin_dataset("detect", "train", root=root, num_images=16)  # generated once, read by the workers
    builtin_dataset("detect", "val", root=root, num_images=4)
    return root


@pytest.mark.slow
def test_two_ranks_of_batch_b_equal_one_process_of_batch_2b(tmp_path, builtin_root):
    _spawn(_run_steps, 2, str(builtin_root), str(tmp_path))
    _run_steps(None, str(builtin_root), str(tmp_path))
    r0, r1 = (torch.load(tmp_path / f"steps_w2_r{r}.pt") for r in (0, 1))
    one = torch.load(tmp_path / "steps_w1_r0.pt")
    assert len(one["params"]) == STEPS and len(r0["params"]) == STEPS
    for s in range(STEPS):
        # the sampler: rank 0's and rank 1's batches are the halves of the 1-process batch
        assert torch.equal(torch.cat([r0["images"][s], r1["images"][s]]), one["images"][s])
        for path, ref in one["params"][s].items():
            # the ranks hold bitwise the same parameters (the all-reduce gives every rank the same sum)
            assert torch.equal(r0["params"][s][path], r1["params"][s][path]), path
            atol = 1e-9 * max(float(ref.abs().max()), 1e-2)  # float64 rounding, scaled to the tensor (>= 1e-11)
            torch.testing.assert_close(r0["params"][s][path], ref, rtol=1e-9, atol=atol, msg=lambda m: f"step {s} {path}: {m}")
        # losses: the mean over the ranks of a sum over B images = half the sum over 2B images
        # (the step's loss metric is float32: finish_step sums the heads' losses in float32)
        assert r0["loss"][s] == pytest.approx(one["loss"][s] / 2, rel=1e-6)
    moved = sum(float((one["params"][-1][p] - v).abs().max()) for p, v in one["params"][0].items())
    assert moved > 0  # the steps did change the parameters
    # SyncBN: the running statistics are the global batch's, equal on the ranks
    for path, ref in one["state"].items():
        assert torch.equal(r0["state"][path], r1["state"][path]), path
        torch.testing.assert_close(r0["state"][path], ref, rtol=1e-7, atol=1e-9)


# -------------------------------------------------------------------------------------- fit resume


def _fit_config(out: Path, *, epochs: int = 1, extra=()):
    from yolo_func.configs import build_config

    return build_config("yolov8n", flags={"imgsz": IMGSZ, "batch": 2, "epochs": epochs, "out": str(out), "device": "cpu"},
                        overrides=["data.workers=0", "train.plots=false", "val.coco=off", "val.batch_size=1", *extra])


def _fit_runs(ctx, root: str, out: str) -> None:
    from yolo_func.data import builtin_dataset
    from yolo_func.train import fit

    root_p, out_p = Path(root), Path(out)
    data = (builtin_dataset("detect", "train", root=root_p, num_images=8), builtin_dataset("detect", "val", root=root_p, num_images=4))

    def stop_rank0_at_step_1(info):  # only rank 0 asks: the vote stops both after the same step
        if ctx.rank == 0 and info.step == 1:
            raise KeyboardInterrupt

    full = fit(_fit_config(out_p / "full"), train_data=data[0], val_data=data[1], progress=False)
    part = fit(_fit_config(out_p / "resumed"), train_data=data[0], val_data=data[1], progress=False, log_every=1,
               on_step=stop_rank0_at_step_1)
    assert part.stopped == "interrupted" and part.steps == 1, (part.stopped, part.steps)
    done = fit(_fit_config(out_p / "resumed"), train_data=data[0], val_data=data[1], progress=False)
    assert full.steps == done.steps == 2, (full.steps, done.steps)  # 8 images / (2 ranks x 2 images), 1 epoch
    from yolo_func import tree as T

    torch.save({"full": dict(T.tree_items(full.train_state.params)), "done": dict(T.tree_items(done.train_state.params)),
                "full_state": dict(T.tree_items(full.train_state.state)), "done_state": dict(T.tree_items(done.train_state.state)),
                "metrics": _scalars(full.metrics), "ema": full.train_state.ema.ema}, out_p / f"fit_r{ctx.rank}.pt")


def _scalars(metrics: dict) -> dict:
    """The validation's headline numbers: ``{kind: {P, R, mAP50, mAP50-95}}`` and the fitness."""
    return {k: ({m: float(x) for m, x in v.items()} if k != "per_class" and isinstance(v, dict) else None)
            for k, v in metrics.items() if k != "per_class"} | {"fitness": float(metrics["fitness"])}


@pytest.mark.slow
def test_two_rank_fit_resumes_bitwise(tmp_path, builtin_root):
    from yolo_func.testing import assert_trees_all_equal
    from yolo_func.train import read_training_checkpoint

    _spawn(_fit_runs, 2, str(builtin_root), str(tmp_path))
    r0, r1 = (torch.load(tmp_path / f"fit_r{r}.pt", weights_only=False) for r in (0, 1))  # our own files (numpy metrics)
    assert_trees_all_equal(r0["full"], r0["done"])  # the parameters: bitwise
    # BN running statistics (no sync_bn): each rank's own, averaged over the ranks at every save;
    # the stopped run averaged once more (at the stop), which reassociates their linear update
    # (avg((1-m) r_i + m b_i) vs (1-m) avg(r_i) + m avg(b_i)): float32 rounding, ~1e-7 relative
    for path, ref in r0["full_state"].items():
        torch.testing.assert_close(r0["done_state"][path], ref, rtol=1e-6, atol=1e-8)
    assert_trees_all_equal(r0["full"], r1["full"])  # every rank holds the same weights
    assert_trees_all_equal(r0["full_state"], r1["full_state"])  # BN statistics averaged over the ranks
    # sharded validation (2 of the 4 one-image batches per rank), gathered: the same metrics on each
    # rank, equal to one process validating every batch on the same (EMA) weights
    assert r0["metrics"] == r1["metrics"]
    from yolo_func.data import ValLoader, builtin_dataset
    from yolo_func.models.yolov8 import yolov8
    from yolo_func.train.fit import validate

    val = builtin_dataset("detect", "val", root=builtin_root, num_images=4)
    model = yolov8("n", task="detect", num_classes=len(val.names))
    loader = ValLoader(val, batch_size=1, image_size=IMGSZ, workers=0, shapes=getattr(val, "image_sizes", None))
    assert len(loader) == 4
    cfg = _fit_config(tmp_path / "unused")
    ema = r0["ema"]
    whole = validate(model, ema["params"], ema["state"], loader, val, config=cfg, device=torch.device("cpu"), progress=False)
    assert _scalars(whole) == r0["metrics"]
    # rank 0 alone wrote the run folder; the checkpoint's data position is the global one
    _, position, _ = read_training_checkpoint(tmp_path / "full" / "weights" / "last.pt")
    assert (position.epoch, position.batch) == (1, 0)
    rows = (tmp_path / "full" / "results.csv").read_text().strip().splitlines()
    assert len(rows) == 2  # the header and one row per epoch (not one per rank)


# ------------------------------------------------------------------------------------------ crash


CRASH_SCRIPT = textwrap.dedent("""
    import os, sys, time
    import torch
    from torch.distributed.elastic.multiprocessing.errors import record
    from yolo_func.train import distributed as D

    @record
    def main():
        ctx = D.init_distributed("cpu")
        grads = {"w": torch.ones(1000)}
        for step in range(1000):
            if ctx.rank == 1 and step == 3:
                raise RuntimeError("rank 1 failed on purpose at step 3")
            D.GradReducer()(grads, {"l": torch.ones(())}, {})
            time.sleep(0.01)
        print("not reached")

    main()
""")


def test_a_crash_in_one_rank_ends_the_job_with_its_error(tmp_path):
    script = tmp_path / "crash.py"
    script.write_text(CRASH_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(REPO), "YOLO_FUNC_DIST_TIMEOUT": "30", "OMP_NUM_THREADS": "1"}
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
                           "--max-restarts", "0", str(script)], env=env, capture_output=True, text=True, timeout=120)
    took = time.monotonic() - t0
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "rank 1 failed on purpose at step 3" in out
    assert "not reached" not in out
    assert took < 60, f"the job took {took:.0f} s to end after rank 1 failed"


def test_parse_devices_and_reducer_errors():
    from yolo_func.train import distributed as D

    assert D.parse_devices("0,1,3") == [0, 1, 3]
    for bad in ("", "0,0", "a,b", "-1"):
        with pytest.raises(ValueError, match="--devices"):
            D.parse_devices(bad)
    with pytest.raises(ValueError, match="op must be"):
        D.all_reduce_tree_({"x": torch.ones(1)}, op="max")
    assert D.init_distributed("cpu") is None or "RANK" in os.environ  # not a torchrun worker here


def test_buckets_group_per_dtype_and_respect_the_size():
    from yolo_func.train.distributed import _buckets

    leaves = [torch.zeros(10), torch.zeros(10, dtype=torch.float64), torch.zeros(300), torch.zeros(10)]
    got = _buckets(leaves, bucket_bytes=1250)  # float32: 40 + 1200 fit, + 40 more do not; float64 apart
    assert got == [[0, 2], [3], [1]]


# --------------------------------------------------------------------------------------------- CLI


def test_devices_starts_torchrun_through_its_public_entry(monkeypatch):
    import torch.distributed.run as run_mod

    from yolo_func.cli import main

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # restored after the test (launch sets it)
    seen = []
    monkeypatch.setattr(run_mod, "run", lambda args: seen.append(args))
    argv = ["train", "--epochs", "1", "--devices", "0,2", "data.workers=0"]
    assert main(argv) == 0
    (args,) = seen
    assert int(args.nproc_per_node) == 2 and args.module and args.training_script == "yolo_func.cli"
    assert args.training_script_args == ["train", "--epochs", "1", "data.workers=0"]  # --devices removed
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,2" and args.max_restarts == 0 and args.standalone
    seen.clear()
    assert main(["train", "--device", "cpu", "--devices", "0,1,2"]) == 0  # CPU: a count of gloo workers
    assert int(seen[0].nproc_per_node) == 3 and os.environ["CUDA_VISIBLE_DEVICES"] == "0,2"
    assert main(["train", "--devices", "0,0"]) == 2  # a bad list: one error line, exit 2
    seen.clear()
    assert main(["train", "--devices=0,1", "--epochs", "2"]) == 0
    assert seen[0].training_script_args == ["train", "--epochs", "2"]


@pytest.mark.slow
def test_devices_on_the_cpu_trains_end_to_end(tmp_path, builtin_root):
    from yolo_func.data import builtin_dataset

    ds = builtin_dataset("detect", "train", root=builtin_root, num_images=8)
    ann = Path(ds.annotations_path)
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "YOLO_FUNC_DIST_TIMEOUT": "120"}
    cmd = [sys.executable, "-m", "yolo_func.cli", "train", "--devices", "0,1", "--device", "cpu", "--data", str(ann),
           "--imgsz", str(IMGSZ), "--batch", "2", "--epochs", "1", "--out", str(out), "data.workers=0",
           "train.plots=false", "val.coco=off", "val.batch_size=1"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (out / "weights" / "last.pt").is_file()
    assert len((out / "results.csv").read_text().strip().splitlines()) == 2  # header + 1 epoch, written once
    assert "data-parallel: 2 processes (gloo)" in proc.stdout
