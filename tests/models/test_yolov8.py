"""YOLOv8 models: parameter counts (REFERENCE.md §1.1, §1.4), shapes (§1.11), init rules (§1.9), bad input."""

import math

import pytest
import torch

from yolo_func import tree as T
from yolo_func import yolov8
from yolo_func.heads import pose_head, segment_head
from yolo_func.models import channels, get_scale, repeats
from yolo_func.testing import assert_trees_all_equal

# REFERENCE.md §1.1: sum(numel) over the unfused reference model (includes the 16 frozen DFL weights).
PARAM_COUNTS = {
    "n": (3_157_200, 3_409_968, 3_295_470),
    "s": (11_166_560, 11_821_056, 11_626_046),
    "m": (25_902_640, 27_285_968, 26_464_462),
    "l": (43_691_520, 45_997_728, 44_489_196),
    "x": (68_229_648, 71_827_888, 69_491_724),
}
TASKS = ("detect", "segment", "pose")


@pytest.mark.parametrize("scale", "nsmlx")
@pytest.mark.parametrize("task_index", range(3))
def test_parameter_counts_match_the_reference(scale, task_index):
    model = yolov8(scale, task=TASKS[task_index])  # nc 80 for detect/segment, 1 for pose
    params, state = model.abstract_init()
    expected = PARAM_COUNTS[scale][task_index]
    assert model.num_params(params) == expected
    assert T.tree_count(params) == expected - 16  # the frozen DFL projection is a constant here


# REFERENCE.md §1.4, nano column "n params" (each row's conv weights + BN affine).
NANO_LAYER_PARAMS = {
    ("backbone", "stem"): 464,
    ("backbone", "stage1", "conv"): 4_672,
    ("backbone", "stage1", "c2f"): 7_360,
    ("backbone", "stage2", "conv"): 18_560,
    ("backbone", "stage2", "c2f"): 49_664,
    ("backbone", "stage3", "conv"): 73_984,
    ("backbone", "stage3", "c2f"): 197_632,
    ("backbone", "stage4", "conv"): 295_424,
    ("backbone", "stage4", "c2f"): 460_288,
    ("backbone", "sppf"): 164_608,
    ("neck", "p4_td", "c2f"): 148_224,
    ("neck", "p3_out", "c2f"): 37_248,
    ("neck", "p4_out", "down"): 36_992,
    ("neck", "p4_out", "c2f"): 123_648,
    ("neck", "p5_out", "down"): 147_712,
    ("neck", "p5_out", "c2f"): 493_056,
}


def test_nano_per_layer_counts():
    params, _ = yolov8("n").abstract_init()
    for path, expected in NANO_LAYER_PARAMS.items():
        assert T.tree_count(T.tree_get(params["network"], "/".join(path))) == expected, path
    assert T.tree_count(params["heads"]["detect"]) + 16 == 897_664


def test_channel_and_repeat_arithmetic():
    # REFERENCE.md §1.2 / §1.4 tables
    assert [channels(c, get_scale("m")) for c in (64, 128, 256, 512, 1024)] == [48, 96, 192, 384, 576]
    assert [channels(c, get_scale("x")) for c in (64, 1024)] == [80, 640]
    assert [repeats(3, get_scale(s)) for s in "nsmlx"] == [1, 1, 2, 3, 3]
    assert [repeats(6, get_scale(s)) for s in "nsmlx"] == [2, 2, 4, 6, 6]


@pytest.fixture(scope="module")
def seg_model():
    model = yolov8("n", task="segment")
    params, state = model.init(torch.Generator().manual_seed(0))
    return model, params, state


def test_output_shapes_at_640(seg_model):
    """REFERENCE.md §1.11 at batch 2, 640x640."""
    model, params, state = seg_model
    x = torch.rand(2, 3, 640, 640, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        preds, new_state = model.apply(params, state, x, train=True)
        feats, _ = model.features(params["network"], state["network"], x, train=False)
        inf = model.predict(params, state, x)
    assert preds["detect"].box_dist.shape == (2, 8400, 64)
    assert preds["detect"].cls_logits.shape == (2, 8400, 80)
    assert preds["segment"].coeffs.shape == (2, 8400, 32)
    assert preds["segment"].protos.shape == (2, 32, 160, 160)
    assert [tuple(f.shape) for f in feats] == [(2, 64, 80, 80), (2, 128, 40, 40), (2, 256, 20, 20)]
    assert inf.y.shape == (2, 116, 8400) and inf.protos.shape == (2, 32, 160, 160)
    assert T.tree_structure(new_state) == T.tree_structure(state)


def test_pose_and_non_square_shapes():
    model = yolov8("n", task="pose")
    params, state = model.init(torch.Generator().manual_seed(0))
    x = torch.rand(1, 3, 256, 320)
    with torch.no_grad():
        preds, _ = model.apply(params, state, x, train=True)
        inf = model.predict(params, state, x)
    assert preds["detect"].cls_logits.shape == (1, 1680, 1)  # A = 32*40 + 16*20 + 8*10
    assert preds["pose"].keypoints.shape == (1, 1680, 51)
    assert inf.y.shape == (1, 56, 1680) and inf.protos is None


def test_detect_bias_init(seg_model):
    """REFERENCE.md §1.9 step 3 (nc = 80)."""
    _, params, _ = seg_model
    det = params["heads"]["detect"]
    for level, s, expected in zip(("p3", "p4", "p5"), (8, 16, 32), (-11.536642, -10.150348, -8.764053)):
        assert torch.all(det["box"][level]["pred"]["bias"] == 2.0)
        torch.testing.assert_close(det["cls"][level]["pred"]["bias"], torch.full((80,), expected), rtol=0, atol=1e-6)
        assert math.isclose(math.log(5 / 80 / (640 / s) ** 2), expected, abs_tol=1e-6)


def test_init_is_deterministic_per_seed():
    m = yolov8("n")
    a, _ = m.init(torch.Generator().manual_seed(3))
    b, _ = m.init(torch.Generator().manual_seed(3))
    c, _ = m.init(torch.Generator().manual_seed(4))
    assert_trees_all_equal(a, b, strict=True)
    assert not torch.equal(a["network"]["backbone"]["stem"]["conv"]["weight"], c["network"]["backbone"]["stem"]["conv"]["weight"])


def test_train_forward_never_writes_the_callers_state(seg_model):
    model, params, state = seg_model
    before = T.tree_clone(state)
    x = torch.rand(2, 3, 64, 64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        _, new = model.apply(params, state, x, train=True)
        _, same = model.apply(params, state, x, train=False)
    assert same is state
    assert_trees_all_equal(before, state, strict=True)
    moved = T.tree_leaves(T.tree_map(lambda a, b: not torch.equal(a, b), new, state))
    assert moved and all(moved)  # every BN saw a batch


def test_tree_paths_are_semantic(seg_model):
    _, params, state = seg_model
    paths = T.tree_paths(params)
    assert "network/backbone/stage2/c2f/m0/cv1/conv/weight" in paths
    assert "heads/detect/box/p3/pred/bias" in paths
    assert "heads/segment/proto/upsample/weight" in paths
    assert all(p.endswith(("running_mean", "running_var")) for p in T.tree_paths(state))


def test_swapping_heads_in_one_line():
    base = yolov8("n")
    ch = (64, 128, 256)
    model = base.with_heads({**base.heads, "pose": pose_head(channels=ch, kpt_shape=(5, 2))})
    params, state = model.init(torch.Generator().manual_seed(0))
    with torch.no_grad():
        preds, _ = model.apply(params, state, torch.rand(1, 3, 64, 64), train=True)
    assert preds["pose"].keypoints.shape == (1, 84, 10)
    model2 = base.with_heads({**base.heads, "segment": segment_head(channels=ch, num_masks=8, proto_channels=16)})
    p2, _ = model2.init(torch.Generator().manual_seed(0))
    assert p2["heads"]["segment"]["coeff"]["p3"]["pred"]["weight"].shape == (8, 16, 1, 1)  # c4 = max(64 // 4, 8)


# -- bad input --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def det():
    model = yolov8("n")
    return (model, *model.init(torch.Generator().manual_seed(0)))


@pytest.mark.parametrize(
    "images,exc,pattern",
    [
        (torch.rand(1, 4, 64, 64), ValueError, r"float\[B, 3, H, W\], got shape \(1, 4, 64, 64\)"),
        (torch.rand(3, 64, 64), ValueError, r"got shape \(3, 64, 64\)"),
        (torch.rand(1, 3, 64, 80), ValueError, r"multiples of 32, got H=64, W=80"),
        (torch.zeros(1, 3, 64, 64, dtype=torch.uint8), TypeError, r"floating point .* torch.uint8"),
        ([[0.0]], TypeError, r"must be a torch.Tensor"),
    ],
)
def test_bad_images(det, images, exc, pattern):
    model, params, state = det
    with pytest.raises(exc, match=pattern):
        model.apply(params, state, images, train=False)


def test_unknown_scale_and_task():
    with pytest.raises(ValueError, match=r"unknown scale 'q'; expected one of \['l', 'm', 'n', 's', 'x'\]"):
        yolov8("q")
    with pytest.raises(ValueError, match=r"unknown task 'obb'"):
        yolov8("n", task="obb")
    with pytest.raises(ValueError, match="kpt_shape"):
        yolov8("n", task="pose", kpt_shape=(17, 4))
    with pytest.raises(ValueError, match="num_classes"):
        yolov8("n", num_classes=0)


def test_params_from_another_scale(det):
    model, _, state = det
    s_params, _ = yolov8("s").abstract_init()
    with pytest.raises(ValueError, match=r"stem/conv/weight has shape \[32, 3, 3, 3\], expected \[16, 3, 3, 3\]"):
        model.apply(s_params, state, torch.rand(1, 3, 64, 64), train=False)
    with pytest.raises(ValueError, match=r"~ network/backbone/stem/conv/weight"):
        model.check_trees(s_params, state)


def test_swapped_or_partial_trees(det):
    model, params, state = det
    with pytest.raises(ValueError, match="wrong order|only a subtree"):
        model.apply(params["network"], state, torch.rand(1, 3, 64, 64), train=False)
    seg_params, seg_state = yolov8("n", task="segment").abstract_init()
    with pytest.raises(ValueError, match=r"has \['detect', 'segment'\], the model has heads \['detect'\]"):
        model.apply(seg_params, seg_state, torch.rand(1, 3, 64, 64), train=False)
    model.check_trees(params, state)  # the real trees pass the full check


def test_model_needs_a_detect_head_first():
    base = yolov8("n", task="pose")
    with pytest.raises(ValueError, match="needs a 'detect' head"):
        base.with_heads({"pose": base.heads["pose"]})
    with pytest.raises(ValueError, match="must be the first head"):
        base.with_heads({"pose": base.heads["pose"], "detect": base.heads["detect"]})


def test_init_needs_a_cpu_generator():
    with pytest.raises(TypeError, match="CPU torch.Generator"):
        yolov8("n").init(0)
