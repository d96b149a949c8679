"""Reference key table: positional names <-> our paths, and the layout of every scale and task
(``yolo_func.io.ultralytics``; owner module ``io/_ref_keys.py``). CPU only, no reference package."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from reference_files import seeded

from yolo_func import tree as T
from yolo_func.io import our_path, reference_key, reference_layout, to_reference
from yolo_func.models import yolov8

#: ``../shared`` beside the repository (holds the reference key listings).
SHARED = Path(__file__).resolve().parents[2].parent / "shared"
KEY_FILES = {"detect": "reference-keys-yolov8n.txt", "segment": "reference-keys-yolov8n-seg.txt", "pose": "reference-keys-yolov8n-pose.txt"}
TASKS = ("detect", "segment", "pose")
SCALES = ("n", "s", "m", "l", "x")

#: REFERENCE.md §1.1: sum of numel over all parameters of the unfused reference model (incl. the 16 DFL weights).
REF_PARAM_COUNTS = {
    "n": (3_157_200, 3_409_968, 3_295_470),
    "s": (11_166_560, 11_821_056, 11_626_046),
    "m": (25_902_640, 27_285_968, 26_464_462),
    "l": (43_691_520, 45_997_728, 44_489_196),
    "x": (68_229_648, 71_827_888, 69_491_724),
}
#: REFERENCE.md §1.1: state-dict entries of the nano models.
REF_ENTRY_COUNTS = {"detect": 355, "segment": 417, "pose": 397}

# -- names ---------------------------------------------------------------------------------------


def test_documented_examples():
    assert our_path("model.22.cv3.1.2.bias") == ("params", "heads/detect/cls/p4/pred/bias")
    assert our_path("model.2.m.0.cv1.bn.running_mean") == ("state", "network/backbone/stage1/c2f/m0/cv1/bn/running_mean")
    assert our_path("model.16.conv.weight") == ("params", "network/neck/p4_out/down/conv/weight")
    assert our_path("model.9.cv2.bn.bias") == ("params", "network/backbone/sppf/cv2/bn/bias")
    assert our_path("model.22.proto.upsample.weight") == ("params", "heads/segment/proto/upsample/weight")
    assert our_path("model.22.cv4.0.2.weight", task="pose") == ("params", "heads/pose/kpt/p3/pred/weight")
    assert our_path("model.22.cv4.2.1.bn.weight", task="segment") == ("params", "heads/segment/coeff/p5/conv2/bn/weight")
    assert our_path("model.0.bn.num_batches_tracked") is None
    assert our_path("model.22.dfl.conv.weight") is None
    assert reference_key("heads/segment/coeff/p5/conv2/bn/running_var", kind="state") == "model.22.cv4.2.1.bn.running_var"
    assert reference_key("network/neck/p5_out/c2f/m2/cv2/conv/weight", kind="params") == "model.21.m.2.cv2.conv.weight"


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("task", TASKS)
def test_names_are_a_bijection_over_the_layout(scale, task):
    model = yolov8(scale, task=task)
    params, state = model.abstract_init()
    want = {("params", p) for p in T.tree_paths(params)} | {("state", p) for p in T.tree_paths(state)}
    layout = reference_layout(model)
    keys = [e.key for e in layout]
    assert len(set(keys)) == len(keys)
    got = set()
    for e in layout:
        mapped = our_path(e.key, task=task)
        if e.path is None:
            assert mapped is None and e.kind in ("num_batches_tracked", "dfl")
            continue
        assert mapped == (e.kind, e.path)
        assert reference_key(e.path, kind=e.kind) == e.key
        got.add(mapped)
    assert got == want  # every leaf of ours has exactly one reference key
    # Parameter count = REFERENCE.md §1.1 (independent numbers, incl. the 16 frozen DFL weights).
    n = sum(torch.Size(e.shape).numel() for e in layout if e.kind in ("params", "dfl"))
    assert n == REF_PARAM_COUNTS[scale][TASKS.index(task)]


@pytest.mark.parametrize("task", TASKS)
def test_layout_matches_reference_listing(task):
    model, params, state = seeded(task)
    sd = to_reference(model, params, state)
    assert len(sd) == REF_ENTRY_COUNTS[task]
    path = SHARED / KEY_FILES[task]
    if not path.is_file():
        pytest.skip(f"reference key listing not found at {path}")
    want = []
    for line in path.read_text().splitlines():
        key, shape = line.split(" ")
        want.append((key, tuple(int(d) for d in shape.strip("[]").split(",") if d)))
    got = [(k, tuple(v.shape)) for k, v in sd.items()]
    assert got == want  # same keys, same shapes, same order
    for k, v in sd.items():
        assert v.dtype == (torch.int64 if k.endswith("num_batches_tracked") else torch.float32), k


def test_reference_only_entries():
    model, params, state = seeded("detect")
    sd = to_reference(model, params, state)
    assert torch.equal(sd["model.22.dfl.conv.weight"].flatten(), torch.arange(16.0))
    nbt = [v for k, v in sd.items() if k.endswith("num_batches_tracked")]
    assert len(nbt) == 57 and all(v.dtype == torch.int64 and v.shape == () and int(v) == 0 for v in nbt)
    # values are the tree's own tensors (state_dict() semantics)
    assert sd["model.0.conv.weight"] is params["network"]["backbone"]["stem"]["conv"]["weight"]
    assert sd["model.4.m.1.cv2.bn.running_var"] is state["network"]["backbone"]["stage2"]["c2f"]["m1"]["cv2"]["bn"]["running_var"]


@settings(max_examples=40)
@given(st.text(alphabet="model.0123456789cvbnprotsfwigharu_", max_size=40))
def test_our_path_rejects_garbage_with_value_error(key):
    try:
        got = our_path(key, task="segment")
    except ValueError as e:
        assert str(e).startswith("[yolo_func] ")
        return
    if got is not None:  # whatever parses must map back to the same key
        assert reference_key(got[1], kind=got[0]) == key


def test_name_errors():
    with pytest.raises(ValueError, match="task='segment' or task='pose'"):
        our_path("model.22.cv4.0.0.conv.weight")
    with pytest.raises(ValueError, match="layer 10 has no parameters"):
        our_path("model.10.conv.weight")
    with pytest.raises(ValueError, match="c2f block"):
        our_path("model.2.m.0.cv3.conv.weight")
    with pytest.raises(ValueError, match="is a state leaf"):
        reference_key("network/backbone/stem/bn/running_mean", kind="params")
    with pytest.raises(ValueError, match="not a YOLOv8 params path"):
        reference_key("network/backbone/stage9/conv/conv/weight", kind="params")


