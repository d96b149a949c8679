"""Reference checkpoint files: the safe reader, the metadata beside the weights, building the model
from a file alone, and every error a user meets with a wrong file (``yolo_func.io.ultralytics``;
owner modules ``io/_ref_file.py`` and ``io/_safe_pickle.py``).

CPU only. Reference-layout files are written at test time from our own state dicts
(``reference_files.py``); one small file written by the reference package itself is committed
(``fixtures/README.md``) to prove the real format is read.
"""

from __future__ import annotations

import io
import os
import pickle
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from reference_files import random_state_dict, write_reference_checkpoint

from yolo_func import tree as T
from yolo_func._types import PosePreds
from yolo_func.assign.anchors import make_anchors
from yolo_func.heads.pose import decode_keypoints
from yolo_func.io import (
    PickledObject,
    RefusedGlobalError,
    from_reference,
    infer_reference_spec,
    load_reference_checkpoint,
    load_reference_model,
    load_reference_weights,
    read_reference_checkpoint,
    reference_layout,
    restricted_pickle,
)
from yolo_func.models import yolov8
from yolo_func.testing import assert_trees_all_equal

FIXTURE = Path(__file__).parent / "fixtures" / "yolov8n-pose-kpt3x2-nc3.pt"
EXPECTED = "Expected a YOLOv8 checkpoint written by torch.save (a zip archive holding data.pkl, or the legacy pickle format)"


def fp16(sd):
    return {k: (v.half() if v.is_floating_point() else v) for k, v in sd.items()}


# -- files written in the reference's layout --------------------------------------------------------


CASES = {
    # (task, model kwargs, names as pickled, kpt_shape as pickled, entry)
    "detect-model-dictnames": ("detect", {"num_classes": 3}, {0: "a", 1: "b", 2: "c"}, None, "model"),
    "segment-ema-listnames": ("segment", {"num_classes": 2}, ["road", "car"], None, "ema"),
    "pose-model-6x2": ("pose", {"kpt_shape": (6, 2)}, {0: "person"}, (6, 2), "model"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_generated_checkpoint_round_trip(case, tmp_path):
    task, kwargs, names, kpt_shape, entry = CASES[case]
    model = yolov8("n", task=task, **kwargs)
    sd = random_state_dict(model, seed=1)
    had_reference = "ultralytics" in sys.modules
    path = write_reference_checkpoint(tmp_path / "w.pt", sd, task=task, names=names, kpt_shape=kpt_shape, entry=entry)
    assert ("ultralytics" in sys.modules) == had_reference  # the stand-ins are gone again
    ck = read_reference_checkpoint(path)
    assert ("ultralytics" in sys.modules) == had_reference  # the reader imported nothing
    assert list(ck.state_dict) == list(sd)  # reference order; the non-persistent buffer is skipped
    assert_trees_all_equal(ck.state_dict, fp16(sd), strict=True)
    assert ck.entry == entry and ck.task == task and ck.kpt_shape == kpt_shape
    assert ck.names == (dict(enumerate(names)) if isinstance(names, list) else names)
    assert ck.yaml["nc"] == model.num_classes
    assert load_reference_checkpoint(path).keys() == ck.state_dict.keys()
    # into a model built by hand, and into the one the file alone describes
    want = from_reference(model, fp16(sd))
    assert_trees_all_equal(load_reference_weights(model, path), want, strict=True)
    built, params, state, got_names = load_reference_model(path)
    assert (built.scale, built.task, built.num_classes) == ("n", task, model.num_classes)
    assert [e[:2] for e in reference_layout(built)] == [e[:2] for e in reference_layout(model)]
    assert_trees_all_equal((params, state), want, strict=True)
    assert got_names == {i: ck.names[i] for i in range(model.num_classes)}


def test_stored_kpt_shape_wins_over_the_rule(tmp_path):
    # 12 keypoint channels: the shape rule reads 4x3; the file says 6x2 and is right.
    model = yolov8("n", task="pose", kpt_shape=(6, 2))
    sd = random_state_dict(model)
    assert infer_reference_spec(sd).kpt_shape == (4, 3)
    path = write_reference_checkpoint(tmp_path / "p.pt", sd, task="pose", kpt_shape=(6, 2))
    built = load_reference_model(path).model
    raw, anchors = _raw_keypoints(12)
    assert torch.equal(built.heads["pose"].decode(PosePreds(raw), anchors), decode_keypoints(raw, anchors, (6, 2)))
    # a stale stored kpt_shape that does not fit the tensors is ignored (the rule applies)
    path = write_reference_checkpoint(tmp_path / "q.pt", sd, task="pose", kpt_shape=(17, 3))
    built = load_reference_model(path).model
    assert torch.equal(built.heads["pose"].decode(PosePreds(raw), anchors), decode_keypoints(raw, anchors, (4, 3)))


def test_names_default_to_ids(tmp_path):
    model = yolov8("n", task="detect", num_classes=4)
    path = write_reference_checkpoint(tmp_path / "n.pt", random_state_dict(model), task="detect", names={1: "one"})
    assert load_reference_model(path).names == {0: "0", 1: "one", 2: "2", 3: "3"}
    path = write_reference_checkpoint(tmp_path / "m.pt", random_state_dict(model), task="detect")
    assert read_reference_checkpoint(path).names is None
    assert load_reference_model(path).names == {0: "0", 1: "1", 2: "2", 3: "3"}


def _raw_keypoints(channels: int):
    anchors = make_anchors([(2, 2), (1, 1), (1, 1)], (8, 16, 32))
    raw = torch.randn(1, anchors.points.shape[0], channels, generator=torch.Generator().manual_seed(3))
    return raw, anchors


# -- the file the reference package wrote -----------------------------------------------------------


def test_oracle_written_fixture_metadata():
    ck = read_reference_checkpoint(FIXTURE)
    assert ck.entry == "model" and ck.task == "pose"
    assert ck.names == {0: "cat", 1: "dog", 2: "bird"}
    assert ck.kpt_shape == (3, 2)
    assert ck.yaml["nc"] == 3 and ck.yaml["kpt_shape"] == [3, 2] and ck.yaml["scale"] == "n"
    want = yolov8("n", task="pose", num_classes=3, kpt_shape=(3, 2))
    assert [(k, tuple(v.shape)) for k, v in ck.state_dict.items()] == [(e.key, e.shape) for e in reference_layout(want)]
    assert {v.dtype for k, v in ck.state_dict.items() if not k.endswith("num_batches_tracked")} == {torch.float16}
    # 6 keypoint channels: the rule alone reads 2x3 (documented ambiguity); the file's metadata says 3x2
    assert infer_reference_spec(ck.state_dict).kpt_shape == (2, 3)
    assert infer_reference_spec(ck.state_dict, kpt_shape=ck.kpt_shape).kpt_shape == (3, 2)


def test_oracle_written_fixture_builds_its_model():
    model, params, state, names = load_reference_model(FIXTURE)
    assert (model.scale, model.task, model.num_classes) == ("n", "pose", 3)
    assert names == {0: "cat", 1: "dog", 2: "bird"}
    raw, anchors = _raw_keypoints(6)
    assert torch.equal(model.heads["pose"].decode(PosePreds(raw), anchors), decode_keypoints(raw, anchors, (3, 2)))
    # every floating entry of the file holds its 1-based position in the file's state dict
    position = {k: i + 1 for i, k in enumerate(read_reference_checkpoint(FIXTURE).state_dict)}
    want = {"params": {}, "state": {}}
    for e in reference_layout(model):
        if e.path is not None:
            want[e.kind][e.path] = torch.full(e.shape, float(position[e.key]))
    assert_trees_all_equal(
        (params, state), (T.tree_from_flat_dict(want["params"]), T.tree_from_flat_dict(want["state"])), strict=True
    )


def test_oracle_written_fixture_into_the_wrong_model():
    with pytest.raises(ValueError) as ei:
        load_reference_weights(yolov8("n", task="detect"), FIXTURE)
    lines = str(ei.value).splitlines()
    # 397 - 355 = 42 keypoint-branch entries; the class branch: pred weight and bias per level (3 -> 80 rows: 6)
    # plus its conv blocks narrowed from 80 to 64 channels (c3 = max(64, min(nc, 100)); 3 levels x 10 entries)
    assert lines[0] == (
        f"[yolo_func] the file {str(FIXTURE)!r} does not fit yolov8n (detect, scale n, 80 classes): 0 missing, "
        "42 unexpected, 36 mis-shaped (expected 355 keys, got 397)"
    )
    assert lines[1] == (
        f"hint: the file {str(FIXTURE)!r} holds yolov8n-pose (pose, scale n, 3 classes, keypoints 3x2); build the model "
        "with yolov8('n', task='pose', num_classes=3, kpt_shape=(3, 2)) (or load_reference_model(path))."
    )
    assert not lines[2].startswith("hint:")
    assert lines[-1] == " ... and 58 more"


# -- errors a user can act on -------------------------------------------------------------------------


@pytest.mark.parametrize("loader", [read_reference_checkpoint, load_reference_checkpoint, load_reference_model])
def test_missing_file(loader, tmp_path):
    path = tmp_path / "nope" / "yolov8n.pt"
    for arg in (path, str(path)):
        with pytest.raises(FileNotFoundError) as ei:
            loader(arg)
        msg = str(ei.value)
        assert msg == f"[yolo_func] reference checkpoint {str(path)!r} does not exist; pass the path of a YOLOv8 .pt file, e.g. yolov8n.pt"
    with pytest.raises(FileNotFoundError, match=r"^\[yolo_func\] reference checkpoint 'nope\.pt' does not exist \(relative to the working directory '.+'\); pass"):
        loader("nope.pt")
    with pytest.raises(FileNotFoundError, match=r"^\[yolo_func\] reference checkpoint .*nope"):
        load_reference_weights(yolov8("n"), path)


def _not_a_checkpoint(path, why_regex: str) -> str:
    with pytest.raises(ValueError) as ei:
        read_reference_checkpoint(path)
    msg = str(ei.value)
    name = os.fspath(path) if isinstance(path, (str, os.PathLike)) else "<BytesIO>"
    assert msg.startswith(f"[yolo_func] {name!r} is not a PyTorch checkpoint: "), msg
    assert EXPECTED in msg
    import re

    assert re.search(why_regex, msg), msg
    return msg


def test_empty_text_directory_and_foreign_zip(tmp_path):
    (tmp_path / "empty.pt").write_bytes(b"")
    _not_a_checkpoint(tmp_path / "empty.pt", r": it is empty \(0 bytes\)\. Expected")
    (tmp_path / "notes.pt").write_text("epochs: 10\nlr: 0.01\n")
    _not_a_checkpoint(tmp_path / "notes.pt", r": it starts with b'epochs: ' \(a text file\?\), not a zip archive or a pickle\. Expected")
    (tmp_path / "dir.pt").mkdir()
    _not_a_checkpoint(tmp_path / "dir.pt", r": it is a directory\. Expected")
    with zipfile.ZipFile(tmp_path / "other.zip", "w") as z:
        z.writestr("hello.txt", "not torch")
    _not_a_checkpoint(tmp_path / "other.zip", r": it is a zip archive without '<folder>/data\.pkl' \(it holds 'hello\.txt'\)\. Expected")
    _not_a_checkpoint(io.BytesIO(b""), r"it is empty")
    with pytest.raises(TypeError, match=r"^\[yolo_func\] read_reference_checkpoint: path must be"):
        read_reference_checkpoint(42)
    with open(tmp_path / "notes.pt") as text_mode, pytest.raises(TypeError, match="binary mode"):
        read_reference_checkpoint(text_mode)


@pytest.mark.parametrize("keep", [0.5, 0.98])
def test_truncated_checkpoint(keep, tmp_path):
    data = FIXTURE.read_bytes()
    path = tmp_path / "cut.pt"
    path.write_bytes(data[: int(len(data) * keep)])  # the zip's central directory (at the end) is gone
    _not_a_checkpoint(path, r": it is a damaged zip archive \(.+\): a truncated download\?\. Expected")
    legacy = tmp_path / "legacy.pt"
    torch.save({"model": {"w": torch.zeros(64)}}, legacy, _use_new_zipfile_serialization=False)
    legacy.write_bytes(legacy.read_bytes()[:-40])  # the legacy (pickle) format, cut inside its storages
    _not_a_checkpoint(legacy, r": reading it failed \(\w+: .*\): a truncated or damaged file\?\. Expected")
    path.write_bytes(data)  # and the whole file reads
    assert len(read_reference_checkpoint(path).state_dict) == 397


@given(st.binary(max_size=64), st.sampled_from([b"", b"\x80\x02", b"PK\x03\x04"]))
def test_random_bytes_give_a_value_error(tail, head):
    buf = io.BytesIO(head + tail)
    try:
        read_reference_checkpoint(buf)
    except RefusedGlobalError as e:  # a random GLOBAL opcode: refused, named, nothing ran
        assert str(e).startswith("[yolo_func] refusing to load global")
    except ValueError as e:
        assert str(e).startswith("[yolo_func] '<BytesIO>' ")
    else:
        raise AssertionError(f"{head + tail!r} read as a checkpoint")


def test_checkpoint_without_model_entry(tmp_path):
    torch.save({"epoch": 1, "ema": None}, tmp_path / "x.pt")
    with pytest.raises(ValueError, match=r"checkpoint '.*x\.pt' has neither an 'ema' nor a 'model' entry \(keys \['ema', 'epoch'\]\)"):
        load_reference_checkpoint(tmp_path / "x.pt")
    torch.save({"model": {"a": torch.zeros(2)}}, tmp_path / "sd.pt")  # already a state dict
    ck = read_reference_checkpoint(tmp_path / "sd.pt")
    assert list(ck.state_dict) == ["a"] and torch.equal(ck.state_dict["a"], torch.zeros(2)) and ck.names is None
    buf = io.BytesIO()
    torch.save({"model": [1, 2]}, buf)
    buf.seek(0)
    with pytest.raises(ValueError, match="entry 'model' is a list, not a pickled module"):
        load_reference_checkpoint(buf)
    buf = io.BytesIO()
    torch.save([1, 2], buf)
    buf.seek(0)
    with pytest.raises(ValueError, match="must hold a dict with 'ema'/'model', got a list"):
        load_reference_checkpoint(buf)


# -- safe unpickling ------------------------------------------------------------------------------------


class _Evil:
    def __init__(self, fn, args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


@pytest.mark.parametrize("target", ["os.system", "builtins.eval", "builtins.exec", "subprocess.call", "builtins.getattr"])
@pytest.mark.parametrize("container", ["zip", "raw"])
def test_malicious_pickles_are_refused(target, container, tmp_path):
    import builtins
    import subprocess

    marker = tmp_path / "pwned"
    cmd = f"touch {marker}"
    fn, args = {
        "os.system": (os.system, (cmd,)),
        "builtins.eval": (builtins.eval, (f"open({str(marker)!r}, 'w')",)),
        "builtins.exec": (builtins.exec, (f"open({str(marker)!r}, 'w')",)),
        "subprocess.call": (subprocess.call, (["touch", str(marker)],)),
        "builtins.getattr": (builtins.getattr, ("x", "upper")),
    }[target]
    path = tmp_path / "evil.pt"
    if container == "zip":
        torch.save({"model": _Evil(fn, args), "ema": None}, path)
    else:
        path.write_bytes(pickle.dumps(_Evil(fn, args), protocol=2))
    with pytest.raises(RefusedGlobalError) as ei:
        load_reference_checkpoint(path)
    assert isinstance(ei.value, pickle.UnpicklingError)
    name = target.split(".")[1]
    msg = str(ei.value)
    assert f".{name}' from a checkpoint" in msg and msg.startswith("[yolo_func] ") and msg.endswith(f"(in {str(path)!r})")
    assert not marker.exists()


def test_reference_globals_become_inert_stubs():
    # GLOBAL 'ultralytics.utils.callbacks run' + REDUCE: recorded, never imported or called.
    data = b"\x80\x02cultralytics.utils.callbacks\nrun\nq\x00X\x05\x00\x00\x00hello\x85R."
    obj = restricted_pickle.loads(data)
    assert isinstance(obj, PickledObject)
    assert obj.pickled_class == "ultralytics.utils.callbacks.run" and obj.args == ("hello",)
    assert "ultralytics.utils.callbacks" not in sys.modules
