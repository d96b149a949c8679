"""The run folder and the resumable training checkpoint: atomic writes under SIGKILL, refusal of
truncated and foreign files, exact round trips, results.csv / events.jsonl bookkeeping."""

from __future__ import annotations

import json
import math
import multiprocessing as mp
import os
import random
import signal
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from yolo_func import tree as T
from yolo_func import yolov8
from yolo_func.configs import Config, apply_overrides, get_recipe
from yolo_func.io.checkpoint import save_checkpoint
from yolo_func.optim import ema
from yolo_func.testing import assert_trees_all_equal
from yolo_func.train import TrainState, init_train_state, yolo_sgd
from yolo_func.train.checkpoint import (
    TRAINING_FORMAT,
    DataPosition,
    capture_rng,
    load_training_checkpoint,
    read_training_checkpoint,
    restore_rng,
    save_training_checkpoint,
)
from yolo_func.train.run_dir import RunDir, fitness, latest_run, next_run_path, results_columns

DETECT = get_recipe("yolov8n")


@pytest.fixture(scope="module")
def real_state() -> TrainState:
    """yolov8n detection at init with the reference optimizer and EMA (a real TrainState)."""
    model = yolov8("n", task="detect")
    opt = yolo_sgd(batch_size=4, batches_per_epoch=8, epochs=3)
    return init_train_state(model, opt.tx, torch.Generator().manual_seed(0), ema=ema())


def _small_state(fill: float, n: int = 1000) -> TrainState:
    zero = torch.zeros((), dtype=torch.int64)
    return TrainState({"w": torch.full((n,), fill)}, {"bn": {"running_mean": torch.zeros(3)}}, (), None, zero + int(fill), zero)


# ------------------------------------------------------------------------------ checkpoint contents


@pytest.mark.slow
def test_round_trip_of_a_real_train_state(tmp_path, real_state):
    gen = torch.Generator().manual_seed(5)
    rng = capture_rng({"augment": gen})
    path = save_training_checkpoint(tmp_path / "last.pt", real_state, config=DETECT, position=DataPosition(2, 3, 7),
                                    rng=rng, meta={"note": "x"})
    template = T.tree_zeros_like(real_state)  # the same structure, other values
    ck = load_training_checkpoint(path, template, config=DETECT)
    assert_trees_all_equal(ck.train_state, real_state, strict=True)
    assert ck.config == DETECT and ck.position == DataPosition(2, 3, 7) and ck.meta == {"note": "x"}
    # The RNG states come back: the draws after restoring equal the draws after capturing.
    expected = (torch.rand(3, generator=gen), torch.rand(3), np.random.rand(3), random.random())
    torch.manual_seed(123), np.random.seed(123), random.seed(123), gen.manual_seed(123)
    restore_rng(ck.rng, {"augment": gen})
    got = (torch.rand(3, generator=gen), torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    assert np.array_equal(got[2], expected[2]) and got[3] == expected[3]
    with pytest.raises(ValueError, match=r"no saved state for generator\(s\) \['mosaic'\]; the checkpoint has \['augment'\]"):
        restore_rng(ck.rng, {"mosaic": gen})
    assert read_training_checkpoint(path) == (DETECT, DataPosition(2, 3, 7), {"note": "x"})


def test_truncated_and_empty_checkpoints_are_refused_naming_the_file(tmp_path):
    path = save_training_checkpoint(tmp_path / "last.pt", _small_state(1.0, 100_000), config=DETECT, position=DataPosition(0, 0, 0))
    data = path.read_bytes()
    for cut in (len(data) // 2, len(data) - 10, 100):
        path.write_bytes(data[:cut])
        with pytest.raises(ValueError, match=rf"checkpoint '{path}' is a torch archive that is truncated or damaged \({cut} bytes"):
            load_training_checkpoint(path, _small_state(0.0, 100_000))
    path.write_bytes(b"")
    with pytest.raises(ValueError, match=r"last.pt' is empty \(0 bytes\); delete it or give another file"):
        load_training_checkpoint(path, _small_state(0.0))


def test_foreign_files_are_refused_naming_the_file(tmp_path):
    template = _small_state(0.0)
    cases = {
        "random.pt": (lambda p: p.write_bytes(random.Random(0).randbytes(4096)), r"is not a torch checkpoint file \(it starts with"),
        "config.json": (lambda p: p.write_text(json.dumps({"epoch": 3})), r"is not a torch checkpoint file \(it starts with b'\{\"epoch\""),
        "other.pt": (lambda p: torch.save({"model": {"conv.weight": torch.ones(2)}, "epoch": 3}, p),
                     r"is not a yolo_func.checkpoint/1 checkpoint \(format: None, keys \['epoch', 'model'\]\)"),
        "weights.pt": (lambda p: save_checkpoint(p, template), r"is a weights checkpoint, not a training checkpoint"),
        "future.pt": (lambda p: save_checkpoint(p, template, extra={"format": "yolo_func.training/9"}),
                      r"training checkpoint of format 'yolo_func.training/9'; this yolo_func reads 'yolo_func.training/1'"),
    }
    for name, (write, message) in cases.items():
        path = tmp_path / name
        write(path)
        with pytest.raises(ValueError, match=rf"'{path}'.*" + message if name != "random.pt" else message):
            load_training_checkpoint(path, template)
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        load_training_checkpoint(tmp_path / "missing.pt", template)


@pytest.mark.slow
def test_checkpoints_of_another_task_or_model_are_refused(tmp_path, real_state):
    path = save_training_checkpoint(tmp_path / "last.pt", real_state, config=DETECT, position=DataPosition(1, 0, 0))
    seg = get_recipe("yolov8n-seg")
    with pytest.raises(ValueError, match=r"is a yolov8n checkpoint that does not fit this run \(yolov8n-seg\): model.task: checkpoint 'detect', this run 'segment'"):
        load_training_checkpoint(path, real_state, config=seg)
    with pytest.raises(ValueError, match=r"model.scale: checkpoint 'n', this run 's'"):
        load_training_checkpoint(path, real_state, config=get_recipe("yolov8s"))
    with pytest.raises(ValueError, match=r"model.num_classes: checkpoint 80, this run 3"):
        save_training_checkpoint(path, real_state, config=apply_overrides(DETECT, ["model.num_classes=80"]), position=DataPosition(1, 0, 0))
        load_training_checkpoint(path, real_state, config=apply_overrides(DETECT, ["model.num_classes=3"]))
    # Without a config to compare, the template catches it and lists the paths.
    with pytest.raises(ValueError, match=r"does not fit the template:\n - params/w \(in the template, not in the checkpoint\)\n"
                                         r"(.*\n)* \+ params/heads/detect/box/p3/conv1/conv/weight \(in the checkpoint, not in the template\)"):
        load_training_checkpoint(path, _small_state(0.0))


def test_a_kill_while_writing_leaves_the_previous_checkpoint_loadable(tmp_path):
    """SIGKILL a child that writes a ~16 MB checkpoint in a loop, 4 times: twice at a random
    moment (any phase of the loop), twice the moment a temporary file is seen (inside a write).

    The targeted kills make the test exercise atomicity on any machine: with random moments alone,
    a fast disk can leave every kill outside a write (that flaked on CI).
    """
    ctx = mp.get_context("fork")  # the child inherits torch: no 2-second import per kill
    run_path = tmp_path / "run"
    rng = random.Random(0)
    interrupted = 0

    def writing() -> bool:
        return any(p.name.endswith(".tmp") for p in (run_path / "weights").iterdir())

    for round_ in range(4):
        ready = ctx.Event()
        child = ctx.Process(target=_write_forever, args=(str(run_path), 100 * round_, ready))
        child.start()
        assert ready.wait(30), "the writer never finished its first checkpoint"
        if round_ % 2:
            deadline = time.monotonic() + 30
            while not writing():
                assert time.monotonic() < deadline, "the writer never started another write"
        else:
            time.sleep(rng.uniform(0.0, 0.4))
        os.kill(child.pid, signal.SIGKILL)
        child.join(10)
        assert child.exitcode == -signal.SIGKILL
        interrupted += writing()
        run = RunDir(run_path, task="detect")  # cleans the interrupted write's temporary file
        assert not any(p.name.endswith(".tmp") for p in run.weights.iterdir())
        ck = run.load_last(_small_state(0.0, _BIG))
        i = ck.position.epoch
        assert i >= 100 * round_ and ck.position == DataPosition(i, 1, 0)
        assert torch.equal(ck.train_state.params["w"], torch.full((_BIG,), float(i)))  # complete, and the one its position says
        assert all(e["event"] in ("checkpoint",) for e in run.read_events())
    assert interrupted >= 1, "no kill landed inside a write; the test did not exercise atomicity"


_BIG = 4_000_000


def _write_forever(path: str, start: int, ready) -> None:
    torch.set_num_threads(1)  # forked child: no intra-op thread pool (as DataLoader workers do)
    run = RunDir(path, task="detect")
    i = start
    while True:
        run.save(_small_state(float(i), _BIG), config=DETECT, position=DataPosition(i, 1, 0))
        ready.set()
        i += 1


# -------------------------------------------------------------------------------------- run folder


def _row(epoch: int, m: float | None, **kw) -> dict:
    row = {"epoch": epoch, "time": 10.0 * epoch, "loss/box": 1.0 / epoch, "loss/cls": 2.0, "loss/dfl": 1.5,
           "lr/decay": 0.01, "lr/no_decay": 0.01, "lr/bias": 0.01}
    if m is not None:
        row.update({"box/mAP50": m + 0.2, "box/mAP50-95": m})
    row.update(kw)
    return row


def test_results_rows_header_once_best_and_truncation_on_resume(tmp_path):
    run = RunDir(tmp_path / "r", task="detect")
    run.begin(DETECT)
    assert [run.log_epoch(_row(e, m)) for e, m in [(1, 0.1), (2, 0.3), (3, None), (4, 0.2), (5, 0.35)]] == [True, True, False, False, True]
    text = run.results_path.read_text().splitlines()
    assert text[0] == ",".join(results_columns("detect")) and len(text) == 6
    assert text[0] == "epoch,time,loss/box,loss/cls,loss/dfl,lr/decay,lr/no_decay,lr/bias,box/mAP50,box/mAP50-95,fitness"
    rows = run.read_results()
    assert [r["epoch"] for r in rows] == [1, 2, 3, 4, 5]
    assert rows[2]["box/mAP50"] is None and rows[2]["fitness"] is None  # an epoch without validation
    assert math.isclose(rows[1]["loss/box"], 0.5) and math.isclose(rows[1]["fitness"], 0.3)
    # A process killed mid-append leaves half a line; reopening drops it, appends start on a new line.
    with open(run.results_path, "a") as f:
        f.write("6,60,0.1")
    run = RunDir(tmp_path / "r", task="detect")
    assert [r["epoch"] for r in run.read_results()] == [1, 2, 3, 4, 5]
    # Resume from a checkpoint holding 3 epochs: rows 4 and 5 go, the header stays, new rows follow.
    run.begin(DETECT, position=DataPosition(3, 0, 0))
    assert [r["epoch"] for r in run.read_results()] == [1, 2, 3]
    assert run.log_epoch(_row(4, 0.31)) is True
    assert [r["epoch"] for r in run.read_results()] == [1, 2, 3, 4]
    assert run.results_path.read_text().count("epoch,") == 1
    run.begin(DETECT)  # a fresh start in the same folder drops every row
    assert run.read_results() == []


def test_results_columns_per_task_and_fitness():
    assert results_columns("segment")[-5:] == ("box/mAP50", "box/mAP50-95", "mask/mAP50", "mask/mAP50-95", "fitness")
    assert "loss/seg" in results_columns("segment") and "loss/kobj" in results_columns("pose")
    assert results_columns("pose")[-3:-1] == ("pose/mAP50", "pose/mAP50-95")
    assert fitness({"box/mAP50-95": 0.25, "mask/mAP50-95": 0.5}, "segment") == 0.75
    assert fitness({"box/mAP50-95": 0.25}, "segment") is None
    with pytest.raises(ValueError, match="unknown task 'classify'"):
        results_columns("classify")


def test_bad_rows_and_another_tasks_folder_are_refused(tmp_path):
    run = RunDir(tmp_path / "r", task="detect")
    with pytest.raises(ValueError, match=r"no column\(s\) \['mask/mAP50'\] for task 'detect'"):
        run.log_epoch({"epoch": 1, "mask/mAP50": 0.1})
    with pytest.raises(ValueError, match=r"needs its 'epoch'"):
        run.log_epoch({"time": 1.0})
    run.log_epoch(_row(1, 0.1))
    with pytest.raises(ValueError, match=r"results.csv' has columns .* expected .* for task 'segment'"):
        RunDir(tmp_path / "r", task="segment")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("x")
    with pytest.raises(ValueError, match=r"'.*notes' exists and is not a run folder \(no config.json or weights/\)"):
        RunDir(tmp_path / "notes", task="detect")


def test_events_are_json_lines_with_wall_time(tmp_path):
    run = RunDir(tmp_path / "r", task="detect")
    t0 = time.time()
    run.begin(DETECT)
    run.log_epoch(_row(1, 0.1))
    run.save(_small_state(1.0), config=DETECT, position=DataPosition(1, 0, 0), best=True)
    run.event("interrupt", epoch=1, batch=5)
    run.event("end", reason="interrupted")
    events = run.read_events()
    assert [e["event"] for e in events] == ["start", "epoch", "checkpoint", "interrupt", "end"]
    assert all(t0 - 1 <= e["time"] <= time.time() + 1 and e["utc"].endswith("+00:00") for e in events)
    assert events[1]["epoch"] == 1 and events[1]["results"]["box/mAP50-95"] == 0.1 and events[1]["results"]["time"] == 10.0
    assert events[2]["best"] is True and events[3]["batch"] == 5
    lines = run.events_path.read_text().splitlines()
    assert len(lines) == 5 and all(json.loads(line)["event"] for line in lines)
    with pytest.raises(ValueError, match=r"unknown event 'epoch_end'; expected one of"):
        run.event("epoch_end")
    with pytest.raises(ValueError, match=r"event 'end': field\(s\) \['time'\] are written by RunDir.event itself"):
        run.event("end", time=3.0)
    with pytest.raises(TypeError, match=r"event 'end': fields must be JSON"):
        run.event("end", tensor=torch.ones(1))


def test_best_is_a_copy_of_last_at_its_epoch_and_summary_names_them(tmp_path):
    run = RunDir(tmp_path / "r", task="detect")
    run.begin(DETECT)
    for epoch, m in [(1, 0.1), (2, 0.4), (3, 0.2)]:
        is_best = run.log_epoch(_row(epoch, m))
        run.save(_small_state(float(epoch)), config=DETECT, position=DataPosition(epoch, 0, 0), best=is_best)
    assert run.load_last(_small_state(0.0)).position.epoch == 3
    best = load_training_checkpoint(run.best, _small_state(0.0))
    assert best.position.epoch == 2 and torch.equal(best.train_state.params["w"], torch.full((1000,), 2.0))
    text = run.summary()
    assert str(run.path) in text and "best: epoch 2 (fitness 0.4000): box mAP50 0.6000 mAP50-95 0.4000" in text
    assert str(run.best) in text and str(run.last) in text and "epochs done: 3" in text
    assert "no validation yet" in RunDir(tmp_path / "empty", task="detect").summary()


def test_background_saves_detach_from_the_state_keep_order_and_raise_write_errors(tmp_path, monkeypatch):
    run = RunDir(tmp_path / "r", task="detect")
    run.begin(DETECT)
    state = _small_state(1.0)
    run.save(state, config=DETECT, position=DataPosition(1, 0, 0), best=True, background=True)
    state.params["w"].fill_(9.0)  # the training thread goes on changing its tensors in place
    run.save(_small_state(2.0), config=DETECT, position=DataPosition(2, 0, 0), background=True)  # waits for the first
    ck = run.load_last(_small_state(0.0))  # waits for the second
    assert ck.position.epoch == 2 and torch.equal(ck.train_state.params["w"], torch.full((1000,), 2.0))
    best = load_training_checkpoint(run.best, _small_state(0.0))  # the copy taken at save time, not the 9s
    assert best.position.epoch == 1 and torch.equal(best.train_state.params["w"], torch.full((1000,), 1.0))
    events = [json.loads(line) for line in (run.path / "events.jsonl").read_text().splitlines()]
    assert [(e["event"], e.get("epoch")) for e in events if e["event"] == "checkpoint"] == [("checkpoint", 1), ("checkpoint", 2)]

    import yolo_func.train.run_dir as run_dir_module

    def full_disk(path, payload):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(run_dir_module, "write_checkpoint_payload", full_disk)
    run.save(_small_state(3.0), config=DETECT, position=DataPosition(3, 0, 0), background=True)
    with pytest.raises(RuntimeError, match=r"writing the checkpoint .*last\.pt.* failed: .*No space left"):
        run.wait()
    run.wait()  # reported once
    assert run.load_last(_small_state(0.0)).position.epoch == 2  # the previous checkpoint is intact


def test_config_json_round_trip_and_file_named_on_unknown_keys(tmp_path):
    run = RunDir(tmp_path / "r", task="segment")
    cfg = apply_overrides(get_recipe("yolov8s-seg"), ["optim.lr0=0.02", "data.path=/data/coco"])
    run.write_config(cfg)
    assert run.read_config() == cfg
    data = json.loads(run.config_path.read_text())
    data["train"]["epoch"] = 3
    run.config_path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=rf"{run.config_path}: unknown config key 'train.epoch'; did you mean 'train.epochs'\?"):
        run.read_config()


def test_folder_naming_resume_and_latest(tmp_path):
    assert next_run_path(tmp_path, "detect", "exp") == tmp_path / "detect" / "exp"
    for expected in ("exp", "exp2", "exp3"):
        run = RunDir.for_config(DETECT, root=tmp_path)
        assert run.path == tmp_path / "detect" / expected and not run.resumable
    assert latest_run(tmp_path, "detect") is None
    with pytest.raises(ValueError, match=r"train.resume is set but no run under '.*detect' has weights/last.pt"):
        RunDir.for_config(apply_overrides(DETECT, ["train.resume=true"]), root=tmp_path)
    old = RunDir(tmp_path / "detect" / "exp", task="detect")
    old.save(_small_state(1.0), config=DETECT, position=DataPosition(1, 0, 0))
    newer = RunDir(tmp_path / "detect" / "exp2", task="detect")
    newer.save(_small_state(2.0), config=DETECT, position=DataPosition(2, 0, 0))
    os.utime(old.last, (time.time() - 100, time.time() - 100))
    resumed = RunDir.for_config(apply_overrides(DETECT, ["train.resume=true"]), root=tmp_path)
    assert resumed.path == newer.path and resumed.resumable
    explicit = RunDir.for_config(apply_overrides(DETECT, [f"train.out={old.path}"]), root=tmp_path)
    assert explicit.path == old.path and explicit.resumable  # an existing out with last.pt resumes


@settings(parent=settings.get_profile("ci"), max_examples=15)
@given(metrics=st.lists(st.one_of(st.none(), st.floats(0, 1, allow_nan=False), st.sampled_from([0.1234564, 0.1234562])),
                        min_size=1, max_size=8), data=st.data())
def test_best_flags_follow_the_running_max_and_resume_keeps_a_prefix(metrics, data):
    with tempfile.TemporaryDirectory() as tmp:
        run = RunDir(Path(tmp) / "r", task="detect")
        flags = [run.log_epoch(_row(e, m)) for e, m in enumerate(metrics, start=1)]
        best_so_far, expected = -1.0, []
        for m in metrics:  # an independent running max over the validated epochs
            expected.append(m is not None and m > best_so_far)
            best_so_far = max(best_so_far, m) if m is not None else best_so_far
        assert flags == expected
        k = data.draw(st.integers(0, len(metrics)))
        run = RunDir(Path(tmp) / "r", task="detect")
        run.begin(DETECT, position=DataPosition(k, 0, 0))
        rows = run.read_results()
        assert [r["epoch"] for r in rows] == list(range(1, k + 1))
        assert [r["box/mAP50-95"] for r in rows] == metrics[:k]  # floats read back exactly


@pytest.mark.cuda
def test_cuda_train_state_and_generators_round_trip(tmp_path):
    dev = torch.device("cuda")
    opt = yolo_sgd(batch_size=4, batches_per_epoch=8, epochs=3)
    ts = init_train_state(yolov8("n"), opt.tx, torch.Generator().manual_seed(0), device=dev, ema=ema())  # NHWC on CUDA
    gen = torch.Generator(device=dev).manual_seed(3)
    torch.rand(1, device=dev)  # the default CUDA generator exists
    path = save_training_checkpoint(tmp_path / "last.pt", ts, config=DETECT, position=DataPosition(1, 2, 0),
                                    rng=capture_rng({"augment": gen}))
    ck = load_training_checkpoint(path, T.tree_zeros_like(ts), config=DETECT)
    assert_trees_all_equal(ck.train_state, ts, strict=True)
    conv = next(x for _, x in T.tree_items(ck.train_state.params) if x.dim() == 4)
    assert conv.is_cuda and conv.is_contiguous(memory_format=torch.channels_last)  # the template's layout
    expected = (torch.rand(4, generator=gen, device=dev), torch.rand(4, device=dev))
    gen.manual_seed(99), torch.cuda.manual_seed(99)
    restore_rng(ck.rng, {"augment": gen})
    got = (torch.rand(4, generator=gen, device=dev), torch.rand(4, device=dev))
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


def test_coco_csv_appends_from_threads_and_is_truncated_on_resume(tmp_path):
    import csv
    import threading

    from yolo_func.train.run_dir import COCO_COLUMNS

    run = RunDir(tmp_path / "r", task="pose")
    run.begin(DETECT)
    box = {k: 0.25 for k in ("AP", "AP50", "AP75", "APs", "APm", "APl", "AR1", "AR10", "AR100")}
    kpt = {k: 0.5 for k in ("AP", "AP50", "AP75", "APm", "APl", "AR", "AR50", "AR75", "ARm", "ARl")}
    # four writers at once (the background evaluation and the loop share the folder): whole lines, one header
    threads = [threading.Thread(target=run.log_coco, args=(e, {"bbox": box, "keypoints": kpt}), kwargs={"seconds": 1.0})
               for e in (1, 2, 3, 4)]
    for t in threads:
        t.start()
    for _ in range(20):
        run.event("checkpoint", epoch=0, batch=0)
    for t in threads:
        t.join()
    rows = run.read_coco()
    assert sorted((r["epoch"], r["kind"]) for r in rows) == [(e, k) for e in (1, 2, 3, 4) for k in ("bbox", "keypoints")]
    row = next(r for r in rows if r["kind"] == "keypoints")
    assert row["APs"] is None and row["ARl"] == 0.5 and next(r for r in rows if r["kind"] == "bbox")["AR100"] == 0.25
    events = run.read_events()
    assert len(events) == 1 + 20 + 4 and sorted(e["epoch"] for e in events if e["event"] == "coco") == [1, 2, 3, 4]
    assert next(e for e in events if e["event"] == "coco")["keypoints"] == kpt
    text = run.summary()
    assert "COCO (pycocotools) of epoch 4:" in text and "coco.csv" in text
    with pytest.raises(ValueError, match=r"coco.csv has no column\(s\) \['mAP'\]"):
        run.log_coco(5, {"bbox": {"mAP": 1.0}})
    RunDir(tmp_path / "r", task="pose").begin(DETECT, position=DataPosition(2, 0, 0))  # a resume at epoch 2
    with open(run.coco_path, newline="") as f:
        data = list(csv.reader(f))
    assert tuple(data[0]) == COCO_COLUMNS and sorted({int(r[0]) for r in data[1:]}) == [1, 2]


def test_quiet_stdout_mutes_the_calling_thread_only(capsys):
    import threading

    from yolo_func.eval.coco_eval import quiet_stdout

    inside, go_on = threading.Event(), threading.Event()

    def worker():
        with quiet_stdout():
            print("from pycocotools")
            inside.set()
            go_on.wait(5)
            print("still muted")

    t = threading.Thread(target=worker)
    t.start()
    inside.wait(5)
    print("the training loop")  # printed while the worker is muted
    go_on.set()
    t.join()
    assert capsys.readouterr().out == "the training loop\n"
