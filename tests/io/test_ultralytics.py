"""Reference state-dict layout <-> our trees, loading errors, and the restricted checkpoint reader.

CPU only; the reference package is not needed (the fake checkpoint is built from stand-in classes).
"""

from __future__ import annotations

import io
import os
import pickle
import sys
import types
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from yolo_func import tree as T
from yolo_func.io import (
    Loaded,
    PickledObject,
    from_reference,
    load_reference_checkpoint,
    load_reference_weights,
    our_path,
    reference_key,
    reference_layout,
    restricted_pickle,
    to_reference,
)
from yolo_func.models import yolov8
from yolo_func.testing import assert_trees_all_equal

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

_INITS: dict = {}


def seeded(task: str, scale: str = "n"):
    """(model, params, state) from seed 0, cached (init is the slow part)."""
    if (scale, task) not in _INITS:
        model = yolov8(scale, task=task)
        _INITS[scale, task] = (model, *model.init(torch.Generator().manual_seed(0)))
    return _INITS[scale, task]


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


# -- round trips -----------------------------------------------------------------------------------


@pytest.mark.parametrize("task", TASKS)
def test_round_trip_nano_exact(task):
    model, params, state = seeded(task)
    p2, s2 = from_reference(model, to_reference(model, params, state))
    for a, b in ((params, p2), (state, s2)):
        assert T.tree_structure(a) == T.tree_structure(b)
        assert T.tree_paths(a) == T.tree_paths(b)
        assert [p for p, _ in _insertion_items(a)] == [p for p, _ in _insertion_items(b)]  # init order kept
        for x, y in zip(T.tree_leaves(a), T.tree_leaves(b), strict=True):
            assert torch.equal(x, y) and y.dtype == torch.float32
            assert x.data_ptr() != y.data_ptr()  # copied by default


def _insertion_items(tree, prefix=""):
    for k, v in tree.items():
        p = f"{prefix}/{k}" if prefix else k
        yield from (_insertion_items(v, p) if isinstance(v, dict) else [(p, v)])


@pytest.mark.parametrize("scale", ["s", "m", "l", "x"])
@pytest.mark.parametrize("task", TASKS)
def test_round_trip_other_scales_identity(scale, task):
    # Meta tensors (no memory): with copy=False every leaf must come back as the very same tensor.
    model = yolov8(scale, task=task)
    params, state = model.abstract_init()
    p2, s2 = from_reference(model, to_reference(model, params, state), copy=False)
    for a, b in ((params, p2), (state, s2)):
        assert T.tree_paths(a) == T.tree_paths(b)
        assert [id(x) for x in T.tree_leaves(a)] == [id(y) for y in T.tree_leaves(b)]


def test_fp16_is_cast_to_fp32():
    model, params, state = seeded("pose")
    sd = {k: (v.half() if v.is_floating_point() else v) for k, v in to_reference(model, params, state).items()}
    p2, s2 = from_reference(model, sd)
    assert_trees_all_equal((p2, s2), T.tree_map(lambda x: x.half().float(), (params, state)), strict=True)


def test_num_batches_tracked_is_ignored():
    model, params, state = seeded("detect")
    sd = dict(to_reference(model, params, state))
    sd["model.0.bn.num_batches_tracked"] = torch.tensor(7)
    p2, _ = from_reference(model, sd)
    assert torch.equal(p2["network"]["backbone"]["stem"]["bn"]["weight"], params["network"]["backbone"]["stem"]["bn"]["weight"])


# -- errors ------------------------------------------------------------------------------------------


def test_missing_unexpected_misshaped_in_one_message():
    model, params, state = seeded("detect")
    sd = dict(to_reference(model, params, state))
    del sd["model.4.m.1.cv2.bn.running_var"]
    sd["model.23.extra.weight"] = torch.zeros(3)
    sd["model.0.conv.weight"] = torch.zeros(16, 3, 5, 5)
    with pytest.raises(ValueError) as ei:
        from_reference(model, sd)
    msg = str(ei.value)
    assert msg.startswith("[yolo_func] ") and isinstance(ei.value.args[0], str)
    assert "1 missing, 1 unexpected, 1 mis-shaped" in msg
    assert " - model.4.m.1.cv2.bn.running_var (missing)" in msg
    assert " + model.23.extra.weight (unexpected)" in msg
    assert " ~ model.0.conv.weight: expected [16, 3, 3, 3], got [16, 3, 5, 5]" in msg


def test_wrong_dfl_and_dtype_are_reported():
    model, params, state = seeded("detect")
    sd = dict(to_reference(model, params, state))
    sd["model.22.dfl.conv.weight"] = torch.ones(1, 16, 1, 1)
    sd["model.1.conv.weight"] = torch.zeros(32, 16, 3, 3, dtype=torch.int32)
    with pytest.raises(ValueError) as ei:
        from_reference(model, sd)
    msg = str(ei.value)
    assert " ! model.22.dfl.conv.weight: expected the frozen DFL projection 0..15" in msg
    assert " ! model.1.conv.weight: expected a floating-point tensor, got dtype torch.int32" in msg
    sd["model.22.dfl.conv.weight"] = torch.arange(16.0).reshape(1, 1, 4, 4)
    with pytest.raises(ValueError, match=r"~ model.22.dfl.conv.weight: expected \[1, 16, 1, 1\], got \[1, 1, 4, 4\]"):
        from_reference(model, sd)


def test_another_scale_is_named():
    small = yolov8("m", task="detect")  # m: other widths and 2 bottlenecks per neck C2f
    sd = to_reference(small, *small.abstract_init())
    model = seeded("detect")[0]
    with pytest.raises(ValueError) as ei:
        from_reference(model, sd)
    msg = str(ei.value)
    assert " ~ model.0.conv.weight: expected [16, 3, 3, 3], got [48, 3, 3, 3]" in msg
    assert " + model.12.m.1.cv1.conv.weight (unexpected)" in msg
    assert "scale ['m'], not n" in msg


def test_task_and_class_hints():
    seg = seeded("segment")
    model = seeded("detect")[0]
    with pytest.raises(ValueError, match="segmentation checkpoint") as ei:
        from_reference(model, to_reference(*seg))
    assert " + model.22.proto.cv1.conv.weight (unexpected)" in str(ei.value)
    pose = seeded("pose")
    with pytest.raises(ValueError, match="pass num_classes=1"):
        from_reference(model, {k: v for k, v in to_reference(*pose).items() if ".cv4." not in k})
    with pytest.raises(TypeError, match="state_dict must be a mapping"):
        from_reference(model, [1, 2])


def test_to_reference_rejects_foreign_trees():
    model, params, state = seeded("detect")
    seg_model, seg_p, seg_s = seeded("segment")
    with pytest.raises(ValueError, match="do not fit yolov8n"):
        to_reference(model, seg_p, seg_s)


def test_non_strict_report_and_base():
    model, params, state = seeded("detect")
    model3 = yolov8("n", task="detect", num_classes=3)
    base = model3.init(torch.Generator().manual_seed(1))
    sd = dict(to_reference(model, params, state))
    del sd["model.0.bn.running_mean"]
    out = from_reference(model3, sd, strict=False, base=base)
    assert isinstance(out, Loaded) and not out.report.ok
    assert out.report.missing == ("model.0.bn.running_mean",)
    # nc 80 -> 3: the class branch narrows (c3 = max(ch0, min(nc, 100)) = 80 -> 64, REFERENCE.md §1.6)
    bad = {k for k, _, _ in out.report.mismatched}
    assert all(k.startswith("model.22.cv3.") for k in bad)
    assert {f"model.22.cv3.{i}.2.{j}" for i in range(3) for j in ("weight", "bias")} <= bad
    assert "model.22.cv3.0.0.conv.weight" in bad and "model.22.cv2.0.0.conv.weight" not in bad
    flat, flat_base, flat_src = T.tree_flat_dict(out.params), T.tree_flat_dict(base[0]), T.tree_flat_dict(params)
    assert torch.equal(flat["heads/detect/cls/p4/pred/weight"], flat_base["heads/detect/cls/p4/pred/weight"])
    assert torch.equal(flat["heads/detect/box/p4/conv1/conv/weight"], flat_src["heads/detect/box/p4/conv1/conv/weight"])
    assert torch.equal(out.state["network"]["backbone"]["stem"]["bn"]["running_mean"], base[1]["network"]["backbone"]["stem"]["bn"]["running_mean"])
    model3.check_trees(out.params, out.state)  # complete trees
    # without base the unfilled leaves are left out, and listed
    p, s, report = from_reference(model3, sd, strict=False)
    assert "heads/detect/cls/p4/pred/weight" not in T.tree_flat_dict(p) and "model.0.bn.running_mean" in report.format()


# -- checkpoints ---------------------------------------------------------------------------------------


def _fake_reference_classes(mp: pytest.MonkeyPatch) -> dict[str, type]:
    """Stand-ins for the reference classes, registered under reference module names in sys.modules."""
    names = {
        "ultralytics.nn.tasks": ["DetectionModel"],
        "ultralytics.nn.modules.conv": ["Conv"],
        "ultralytics.nn.modules.block": ["Block"],
        "ultralytics.utils": ["IterableSimpleNamespace"],
    }
    for pkg in ("ultralytics", "ultralytics.nn", "ultralytics.nn.modules"):
        mp.setitem(sys.modules, pkg, types.ModuleType(pkg))
    classes = {}
    for mod_name, cls_names in names.items():
        mod = types.ModuleType(mod_name)
        for name in cls_names:
            base = object if name == "IterableSimpleNamespace" else nn.Module
            cls = type(name, (base,), {"__module__": mod_name, "__qualname__": name})
            setattr(mod, name, cls)
            classes[name] = cls
        mp.setitem(sys.modules, mod_name, mod)
    return classes


def _module_tree(classes: dict[str, type], sd: dict[str, torch.Tensor]) -> nn.Module:
    """A stand-in module tree whose state_dict() has exactly the keys and shapes of ``sd``."""
    root = classes["DetectionModel"]()
    owners: dict[str, dict[str, torch.Tensor]] = {}
    for k, v in sd.items():
        owner, leaf = k.rsplit(".", 1)
        owners.setdefault(owner, {})[leaf] = v
    for owner, leaves in owners.items():
        parts = owner.split(".")
        parent = root
        for i, name in enumerate(parts[:-1]):
            if name not in parent._modules:
                kind = "Conv" if parts[i + 1] in ("conv", "bn") else "Block"
                parent.add_module(name, nn.Sequential() if parts[:i + 1] == ["model"] else classes[kind]())
                if kind == "Conv":
                    parent._modules[name].add_module("act", nn.SiLU())
            parent = parent._modules[name]
        w = leaves["weight"]
        if parts[-1] == "bn":
            leaf_mod = nn.BatchNorm2d(w.shape[0], eps=1e-3, momentum=0.03)
        elif parts[-1] == "upsample":
            leaf_mod = nn.ConvTranspose2d(w.shape[0], w.shape[1], 2, 2)
        else:
            leaf_mod = nn.Conv2d(w.shape[1], w.shape[0], w.shape[2], bias="bias" in leaves)
        parent.add_module(parts[-1], leaf_mod)
    root.register_buffer("scratch", torch.ones(3), persistent=False)  # must not appear
    root.args = classes["IterableSimpleNamespace"]()
    root.load_state_dict(sd)
    return root


@pytest.mark.parametrize("task", ["detect", "segment"])
def test_fake_official_checkpoint(task, tmp_path, monkeypatch):
    model, params, state = seeded(task)
    sd = to_reference(model, params, state)
    had_reference = "ultralytics" in sys.modules
    with monkeypatch.context() as mp:
        classes = _fake_reference_classes(mp)
        ema = _module_tree(classes, sd).half()
        other = _module_tree(classes, {k: (v * 0 if v.is_floating_point() else v) for k, v in sd.items()}).half()
        assert list(ema.state_dict()) == list(sd)
        torch.save({"epoch": 3, "model": other, "ema": ema, "updates": 10, "train_args": {"imgsz": 640},
                    "date": "2024-01-01"}, tmp_path / "ema.pt")
        torch.save({"epoch": -1, "model": ema, "ema": None}, tmp_path / "model.pt")
    assert ("ultralytics" in sys.modules) == had_reference  # fakes are gone again
    for name in ("ema.pt", "model.pt"):
        got = load_reference_checkpoint(tmp_path / name)
        assert list(got) == list(sd)  # ema preferred; non-persistent buffers skipped; reference order
        for k, v in sd.items():
            assert torch.equal(got[k], v.half() if v.is_floating_point() else v), k
        p2, s2 = load_reference_weights(model, tmp_path / name)
        assert_trees_all_equal((p2, s2), T.tree_map(lambda x: x.half().float(), (params, state)), strict=True)
    assert ("ultralytics" in sys.modules) == had_reference  # the reader imported nothing


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
    with pytest.raises(pickle.UnpicklingError) as ei:
        load_reference_checkpoint(path)
    name = target.split(".")[1]
    assert f".{name}' from a checkpoint" in str(ei.value) and str(ei.value).startswith("[yolo_func] ")
    assert not marker.exists()


def test_reference_globals_become_inert_stubs():
    # GLOBAL 'ultralytics.utils.callbacks run' + REDUCE: recorded, never imported or called.
    data = b"\x80\x02cultralytics.utils.callbacks\nrun\nq\x00X\x05\x00\x00\x00hello\x85R."
    obj = restricted_pickle.loads(data)
    assert isinstance(obj, PickledObject)
    assert obj.pickled_class == "ultralytics.utils.callbacks.run" and obj.args == ("hello",)
    assert "ultralytics.utils.callbacks" not in sys.modules


def test_checkpoint_without_model_entry(tmp_path):
    torch.save({"epoch": 1, "ema": None}, tmp_path / "x.pt")
    with pytest.raises(ValueError, match="neither an 'ema' nor a 'model'"):
        load_reference_checkpoint(tmp_path / "x.pt")
    torch.save({"model": {"a": torch.zeros(2)}}, tmp_path / "sd.pt")  # already a state dict
    assert torch.equal(load_reference_checkpoint(tmp_path / "sd.pt")["a"], torch.zeros(2))
    buf = io.BytesIO()
    torch.save({"model": [1, 2]}, buf)
    buf.seek(0)
    with pytest.raises(ValueError, match="not a pickled module"):
        load_reference_checkpoint(buf)
