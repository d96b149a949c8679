"""Our trees <-> reference state dicts: round trips, casts, and the mismatch report with its hints
(``yolo_func.io.ultralytics``; owner module ``io/_ref_convert.py``). CPU only, no reference package."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from reference_files import seeded

from yolo_func import tree as T
from yolo_func.io import Loaded, LoadReport, from_reference, reference_layout, to_reference
from yolo_func.io.ultralytics import REPORT_LIMIT
from yolo_func.models import yolov8
from yolo_func.testing import assert_trees_all_equal

TASKS = ("detect", "segment", "pose")


def meta_state_dict(model) -> dict[str, torch.Tensor]:
    """The reference state dict of ``model`` with meta tensors (shapes only), DFL excepted (it is checked by value)."""
    sd = {e.key: torch.empty(e.shape, device="meta") for e in reference_layout(model)}
    sd["model.22.dfl.conv.weight"] = torch.arange(16.0).reshape(1, 16, 1, 1)
    return sd


def shared_storage(a, b) -> list[str]:
    """Paths whose leaves of ``a`` and ``b`` share memory (trees compared by path)."""
    fa, fb = T.tree_flat_dict(a), T.tree_flat_dict(b)
    assert fa.keys() == fb.keys()
    return [p for p in fa if fa[p].data_ptr() == fb[p].data_ptr()]


def error_of(model, sd) -> list[str]:
    with pytest.raises(ValueError) as ei:
        from_reference(model, sd)
    assert isinstance(ei.value.args[0], str) and len(ei.value.args) == 1  # not a tuple message
    return str(ei.value).splitlines()


# -- round trips -----------------------------------------------------------------------------------


@pytest.mark.parametrize("task", TASKS)
def test_round_trip_nano_exact(task):
    model, params, state = seeded(task)
    p2, s2 = from_reference(model, to_reference(model, params, state))
    assert_trees_all_equal(params, p2, strict=True)
    assert_trees_all_equal(state, s2, strict=True)
    for a, b in ((params, p2), (state, s2)):
        assert T.tree_paths(a) == T.tree_paths(b)
        assert list(T.tree_flat_dict(a)) == list(T.tree_flat_dict(b))  # init (insertion) order kept
        assert shared_storage(a, b) == []  # copied by default


@pytest.mark.parametrize("scale", ["s", "m", "l", "x"])
@pytest.mark.parametrize("task", TASKS)
def test_round_trip_other_scales_identity(scale, task):
    # Meta tensors (no memory): with copy=False every leaf must come back as the very same tensor.
    model = yolov8(scale, task=task)
    params, state = model.abstract_init()
    p2, s2 = from_reference(model, to_reference(model, params, state), copy=False)
    for a, b in ((params, p2), (state, s2)):
        fa, fb = T.tree_flat_dict(a), T.tree_flat_dict(b)
        assert list(fa) == list(fb)
        assert [p for p in fa if fa[p] is not fb[p]] == []


def test_fp16_is_cast_to_fp32():
    model, params, state = seeded("pose")
    sd = {k: (v.half() if v.is_floating_point() else v) for k, v in to_reference(model, params, state).items()}
    p2, s2 = from_reference(model, sd)
    rounded = T.tree_cast(T.tree_cast((params, state), torch.float16), torch.float32)
    assert_trees_all_equal(rounded, (p2, s2), strict=True)  # float32 holding the fp16 values


def test_expanded_entries_become_contiguous_copies():
    # Reference files may hold views (the committed fixture stores stride-0 tensors): copies are dense.
    model, params, state = seeded("detect")
    sd = dict(to_reference(model, params, state))
    sd["model.0.conv.weight"] = torch.full((1, 1, 1, 1), 0.5).expand(16, 3, 3, 3)
    p2, _ = from_reference(model, sd)
    w = p2["network"]["backbone"]["stem"]["conv"]["weight"]
    assert w.is_contiguous() and torch.equal(w, torch.full((16, 3, 3, 3), 0.5))


def test_num_batches_tracked_is_ignored():
    model, params, state = seeded("detect")
    sd = dict(to_reference(model, params, state))
    sd["model.0.bn.num_batches_tracked"] = torch.tensor(7)
    p2, s2 = from_reference(model, sd)
    assert_trees_all_equal(params, p2, strict=True)


# -- the report ------------------------------------------------------------------------------------


def test_missing_unexpected_misshaped_in_one_message_without_false_hints():
    model, params, state = seeded("detect")
    sd = dict(to_reference(model, params, state))
    del sd["model.4.m.1.cv2.bn.running_var"]
    sd["model.23.extra.weight"] = torch.zeros(3)
    sd["model.0.conv.weight"] = torch.zeros(16, 3, 5, 5)
    lines = error_of(model, sd)
    assert lines[0] == (
        "[yolo_func] the state dict does not fit yolov8n (detect, scale n, 80 classes): 1 missing, 1 unexpected, "
        "1 mis-shaped (expected 355 keys, got 355)"
    )
    # the weights are yolov8n detect with 80 classes, like the model: no hint may claim otherwise
    assert not [line for line in lines if line.startswith("hint:")]
    assert lines[1].startswith("the 3 problem(s)")
    assert lines[2:] == [
        " - model.4.m.1.cv2.bn.running_var (missing)",
        " + model.23.extra.weight (unexpected)",
        " ~ model.0.conv.weight: expected [16, 3, 3, 3], got [16, 3, 5, 5]",
    ]


def test_wrong_dfl_and_dtype_are_reported():
    model, params, state = seeded("detect")
    sd = dict(to_reference(model, params, state))
    sd["model.22.dfl.conv.weight"] = torch.ones(1, 16, 1, 1)
    sd["model.1.conv.weight"] = torch.zeros(32, 16, 3, 3, dtype=torch.int32)
    lines = error_of(model, sd)
    assert lines[0].endswith("0 missing, 0 unexpected, 0 mis-shaped, 2 invalid (expected 355 keys, got 355)")
    assert " ! model.22.dfl.conv.weight: expected the frozen DFL projection 0..15, got [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]..." in lines
    assert " ! model.1.conv.weight: expected a floating-point tensor, got dtype torch.int32" in lines
    sd["model.22.dfl.conv.weight"] = torch.arange(16.0).reshape(1, 1, 4, 4)
    with pytest.raises(ValueError, match=r"~ model.22.dfl.conv.weight: expected \[1, 16, 1, 1\], got \[1, 1, 4, 4\]"):
        from_reference(model, sd)


def test_other_scale_and_task_hint_comes_first_and_the_listing_is_capped():
    # The case of issue 11: an s-segment state dict loaded into an n-detect model.
    model = yolov8("n", task="detect")
    lines = error_of(model, meta_state_dict(yolov8("s", task="segment")))
    # 417 - 355 = 62 segment-only entries (cv4: 3 levels x (2 Conv blocks x 6 + 2) = 42; proto: 3 x 6 + 2 = 20).
    # Mis-shaped: 355 - 57 num_batches_tracked - 1 DFL = 297 compared entries, minus those equal at both
    # scales: per level the box branch's conv1 BN (4), conv2 (5) and pred (2), and the class pred bias [80]:
    # 3 x 12 = 36; 297 - 36 = 261.
    assert lines[0] == (
        "[yolo_func] the state dict does not fit yolov8n (detect, scale n, 80 classes): 0 missing, 62 unexpected, "
        "261 mis-shaped (expected 355 keys, got 417)"
    )
    assert lines[1] == (
        "hint: the state dict holds yolov8s-seg (segment, scale s, 80 classes); build the model with "
        "yolov8('s', task='segment') (or infer_reference_model(state_dict))."
    )
    assert len([line for line in lines if line.startswith("hint:")]) == 1  # no class-count hint: both have 80
    assert lines[2].startswith(f"{REPORT_LIMIT} of the 323 problem(s)")
    entries = lines[3:-1]
    assert len(entries) == REPORT_LIMIT == 20
    assert {e[:3] for e in entries} == {" + ", " ~ "}  # both kinds shown
    assert lines[-1] == " ... and 303 more"


def test_the_real_class_count_or_none():
    model = yolov8("n", task="detect")
    # another scale, 80 classes both: the class branch is mis-shaped (its width), yet no class hint
    lines = error_of(model, meta_state_dict(yolov8("s", task="detect")))
    assert [line for line in lines if line.startswith("hint:")] == [
        "hint: the state dict holds yolov8s (detect, scale s, 80 classes); build the model with yolov8('s', "
        "task='detect') (or infer_reference_model(state_dict))."
    ]
    # same scale and task, 3 classes
    lines = error_of(model, meta_state_dict(yolov8("n", task="detect", num_classes=3)))
    assert lines[0].endswith("0 missing, 0 unexpected, 36 mis-shaped (expected 355 keys, got 355)")  # the cv3 branch: 3 x 12
    assert lines[1] == (
        "hint: the class branch predicts 3 classes, the model 80: build the model with yolov8('n', task='detect', "
        "num_classes=3), or pass strict=False, base=model.init(gen) to keep the rest and train a new 80-class branch."
    )
    assert not lines[2].startswith("hint:")


def test_keypoint_channels_hint():
    model = yolov8("n", task="pose")
    lines = error_of(model, meta_state_dict(yolov8("n", task="pose", kpt_shape=(5, 2))))
    assert lines[1] == (
        "hint: the state dict holds yolov8n-pose (pose, scale n, 1 class, keypoints 5x2); build the model with "
        "yolov8('n', task='pose', kpt_shape=(5, 2)) (or infer_reference_model(state_dict))."
    )


def test_partial_state_dict_hints():
    model = yolov8("n", task="detect")
    pose = meta_state_dict(yolov8("n", task="pose"))
    # a pose state dict without its keypoint branch reads as a 1-class detect model
    lines = error_of(model, {k: v for k, v in pose.items() if ".cv4." not in k})
    assert [line for line in lines if line.startswith("hint:")] == [
        "hint: the class branch predicts 1 class, the model 80: build the model with yolov8('n', task='detect', "
        "num_classes=1), or pass strict=False, base=model.init(gen) to keep the rest and train a new 80-class branch."
    ]
    # no stem: the scale is unknown, the head keys still show the task
    seg_head = {k: v for k, v in meta_state_dict(yolov8("s", task="segment")).items() if k.startswith("model.22.")}
    hints = [line for line in error_of(model, seg_head) if line.startswith("hint:")]
    assert hints == ["hint: the state dict has the head branches of a segment model: build the model with task='segment'."]
    # a wrapper prefix
    wrapped = {f"module.{k}": v for k, v in meta_state_dict(model).items()}
    hints = [line for line in error_of(model, wrapped) if line.startswith("hint:")]
    assert hints == [
        "hint: no key starts with 'model.' (e.g. 'module.model.0.conv.weight'): strip the wrapper's prefix first "
        "(e.g. 'module.' from DataParallel)."
    ]
    with pytest.raises(TypeError, match=r"^\[yolo_func\] from_reference: state_dict must be a mapping"):
        from_reference(model, [1, 2])


_KEYS = st.lists(st.text("abcxyz", min_size=1, max_size=4), max_size=12, unique=True)


@given(_KEYS, _KEYS, _KEYS, _KEYS, st.integers(0, 30))
def test_report_listing_is_capped_and_fair(missing, unexpected, mismatched, invalid, limit):
    report = LoadReport(
        tuple(missing), tuple(unexpected), tuple((k, (1,), (2,)) for k in mismatched), tuple((k, "bad") for k in invalid)
    )
    full = report.format().splitlines()
    kinds = [len(missing), len(unexpected), len(mismatched), len(invalid)]
    total = sum(kinds)
    assert len(full) == total
    got = report.format(limit).splitlines()
    if total <= limit:
        assert got == full
        return
    *shown, last = got
    assert last == f" ... and {total - limit} more"
    assert len(shown) == limit
    assert [line for line in full if line in shown] == shown  # a subsequence of the full listing, in its order
    prefixes = (" - ", " + ", " ~ ", " ! ")
    per_kind = [sum(line.startswith(p) for line in shown) for p in prefixes]
    # round-robin: the kinds not shown in full got equal shares (+1 for the earlier ones), and a kind
    # shown in full is no larger than that share
    partial = [i for i in range(4) if per_kind[i] < kinds[i]]
    lo = min(per_kind[i] for i in partial)
    assert max(per_kind[i] for i in partial) <= lo + 1
    assert all(kinds[i] <= lo + 1 for i in range(4) if i not in partial)
    assert report.summary() == f"{kinds[0]} missing, {kinds[1]} unexpected, {kinds[2]} mis-shaped" + (
        f", {kinds[3]} invalid" if kinds[3] else ""
    )


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
