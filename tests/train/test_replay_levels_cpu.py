"""The replay levels' plumbing on the CPU, with stand-in captures.

``ReplayTrainStep`` never replays on a CPU (it falls back), so its level classes — adopting static
buffers, BN snapshots for the non-finite guard, the update's named inputs, head captures, the
cache budget by shape, uint8 images inside the captured function — would otherwise only run on a
GPU. Here ``capture_vjp`` and ``capture_step`` are replaced by stand-ins with the same contract
(static buffers filled through the real :class:`yolo_func.capture.binder.Binder`, static outputs
overwritten by each "replay", one :func:`yolo_func.capture.count_capture` per capture) whose
"graphs" re-run the recorded function eagerly on the static buffers. Each level must then step
bitwise like the eager step, in float32: the same arithmetic on other buffers.
"""

from __future__ import annotations

import pytest
import torch

from yolo_func import tree as T
from yolo_func import yolov8
from yolo_func.capture import CaptureCache, Captured, CapturedStep, CaptureStats, StaticBuffers, StepBuffers, StepStats
from yolo_func.capture import vjp as capture_vjp_module
from yolo_func.capture.binder import Binder
from yolo_func.capture.counter import count_capture
from yolo_func.capture.whole_step import _static_tree
from yolo_func.func import autocast, autograd_vjp, current_vjp_backend, first_order
from yolo_func.optim import ema, multi_steps, sgd
from yolo_func.structures import Batch
from yolo_func.testing import assert_max_captures, assert_trees_all_equal
from yolo_func.testing.synthetic import synthetic_batch
from yolo_func.train import init_train_state
from yolo_func.train import replay as replay_module
from yolo_func.train.replay import CaptureFallbackWarning, ReplayTrainStep

pytestmark = pytest.mark.filterwarnings("error::yolo_func.train.replay.CaptureFallbackWarning")


class _Graph:
    def __init__(self, work):
        self.work = work

    def replay(self):
        self.work()


def _fake_capture_vjp(fn, params, state, x=(), *, warmup=3, autocast_dtype=None, generators=(), pool=None,
                      forward_context=None, vjp=None):
    """capture_vjp's contract on the CPU: static inputs, static outputs / new state / gradients,
    forward and backward 'replays' that recompute on the static buffers."""
    del warmup, generators
    static_p, static_s, static_x = T.tree_clone(params), T.tree_clone(state), T.tree_clone(x)
    inputs = Binder({"params": static_p, "state": static_s, "x": static_x}, autocast_dtype, what="inputs")
    box = {}

    if vjp is None and current_vjp_backend() == "autograd":  # as the real capture_vjp resolves it
        vjp = autograd_vjp

    def run():
        with autocast("cpu", autocast_dtype), (forward_context() if forward_context else _null()):
            if vjp is not None:  # e.g. a CompiledModel's autograd_vjp
                return vjp(lambda p: fn(p, static_s, static_x), static_p)
            return torch.func.vjp(lambda p: fn(p, static_s, static_x), static_p, has_aux=True)

    backup = T.tree_clone(static_s)
    out0, _, new0 = run()  # shapes of the outputs; like warm-up, it leaves no trace
    T.tree_copy_(static_s, backup)
    in_place = replay_module._holds(new0, static_s)
    outputs, cotangents = T.tree_clone(out0), T.tree_map(torch.zeros_like, out0)
    new_state = new0 if in_place else T.tree_clone(new0)
    grads = T.tree_map(torch.zeros_like, static_p)

    def fwd():
        out, box["vjp"], ns = run()
        T.tree_copy_(outputs, out)
        if not in_place:
            T.tree_copy_(new_state, ns)

    def bwd():
        (g,) = first_order(box["vjp"])(cotangents)
        T.tree_copy_(grads, g)

    index = count_capture()
    static = StaticBuffers(static_p, static_s, static_x, outputs, new_state, cotangents, grads)
    stats = CaptureStats(capture_index=index)
    cot = Binder({"d_outputs": cotangents}, None, what="output cotangents", fields=("shape", "device"))
    token = capture_vjp_module._PoolToken()
    r = capture_vjp_module._Replay(index=index, g_fwd=_Graph(fwd), g_bwd=_Graph(bwd), inputs=inputs,
                                   cotangents=cot, static=static, stats=stats, token=token)
    return Captured(r.forward, r.backward, inputs.signature, static, stats, pool)


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _fake_capture_step(fn, carry, inputs, *, warmup=2, pool=None, donate_carry=False, persistent=()):
    """capture_step's contract on the CPU: a donated or cloned static carry written back by every
    'replay', static aux outputs, persistent inputs read where they are."""
    del warmup
    carry_ids = {id(x) for x in T.tree_leaves(carry)} if donate_carry else set()
    used: set[int] = set()
    static_carry = _static_tree(carry, carry_ids, used)
    static_inputs = _static_tree(inputs, {id(x) for x in persistent} | used)
    binder = Binder({"carry": static_carry, "inputs": static_inputs}, None, what="step inputs")
    _, aux0 = fn(static_carry, static_inputs)  # fn is pure: allocates the aux buffers only
    aux = T.tree_clone(aux0)
    count_capture()
    stats = StepStats()

    def step(carry_, inputs_):
        stats.leaves_copied = binder.load(carry_, inputs_)
        new_carry, new_aux = fn(static_carry, static_inputs)
        T.tree_copy_(static_carry, new_carry)
        T.tree_copy_(aux, new_aux)
        stats.replays += 1
        return static_carry, aux

    return CapturedStep(step, binder.signature, StepBuffers(static_carry, static_inputs, aux), stats, pool)


@pytest.fixture
def fake_capture(monkeypatch):
    """Replay levels run their capture path on the CPU, with the stand-ins above."""
    monkeypatch.setattr(replay_module, "capture_vjp", _fake_capture_vjp)
    monkeypatch.setattr(replay_module, "capture_step", _fake_capture_step)
    monkeypatch.setattr(CaptureCache, "pool", property(lambda self: None))
    base = replay_module._Level.unavailable

    def unavailable(self, batch):  # everything but the device check
        reason = base(self, batch)
        return None if reason is not None and "not a CUDA device" in reason else reason

    monkeypatch.setattr(replay_module._Level, "unavailable", unavailable)


def _captures(capture, model, replay_update=True):
    if capture == "none":
        return 0
    if capture == "step":
        return 1
    return 1 + (len(model.heads) if capture == "network+heads" else 0) + int(replay_update)


def _uint8(b):
    return Batch((b.images * 255).round().to(torch.uint8), b.targets)


def _run(model, capture, sizes, *, images=None, seed=10, **kw):
    tx = multi_steps(sgd(0.01, 0.9), every=2)
    e = ema()
    ts = init_train_state(model, tx, torch.Generator().manual_seed(0), ema=e)
    step = ReplayTrainStep(model, tx, ema=e, capture=capture, autocast_dtype=None, **kw)
    out = []
    for i, size in enumerate(sizes):
        b = synthetic_batch("segment", 2, size, num_classes=model.num_classes, max_boxes=4, seed=seed + i)
        ts, m = step(ts, b if images is None else images(b))
        out.append((T.tree_clone(ts), {k: v.clone() for k, v in m.items()}))
    return out, step


def _assert_runs_equal(got, want, what):
    assert len(got) == len(want)
    for i, ((ts_g, m_g), (ts_w, m_w)) in enumerate(zip(got, want, strict=True)):
        try:
            assert_trees_all_equal(ts_g, ts_w, strict=True)
            assert_trees_all_equal(m_g, m_w, strict=True)
        except AssertionError as err:
            raise AssertionError(f"{what}, step {i}: {err}") from None


@pytest.fixture(scope="module")
def model():
    return yolov8("n", task="segment", num_classes=3)


@pytest.fixture(scope="module")
def eager_run(model):
    return _run(model, "none", [32, 32, 32])[0]


@pytest.mark.slow
@pytest.mark.parametrize("capture, replay_update", [("network", True), ("network", False),
                                                    ("network+heads", True), ("network+heads", False),
                                                    ("step", True)])
def test_each_level_steps_bitwise_like_eager(fake_capture, model, eager_run, capture, replay_update):
    n = _captures(capture, model, replay_update)
    with assert_max_captures(n=n) as made:
        got, step = _run(model, capture, [32, 32, 32], replay_update=replay_update)
    assert made.count == n and len(step.cache) == 1  # one shape, all its captures under one key
    _assert_runs_equal(got, eager_run, f"{capture} (replay_update={replay_update})")


@pytest.mark.slow
def test_network_heads_two_image_sizes_fit_max_captures_2(fake_capture, model):
    """The issue's budget case on the CPU: segment at network+heads, sizes alternating, with
    max_captures=2: every step replays (a fallback is an error here), 2 x 4 captures, bitwise equal
    to eager."""
    sizes = [32, 64, 32, 64]
    want, _ = _run(model, "none", sizes)
    with assert_max_captures(n=8) as made:
        got, step = _run(model, "network+heads", sizes, max_captures=2)
    assert made.count == 8 and len(step.cache) == 2
    assert all(len(step.cache.parts(k)) == 4 for k in step.cache.keys())
    _assert_runs_equal(got, want, "network+heads, two sizes")
    # a third size is refused before any capture, and that step runs eagerly with one warning
    ts = got[-1][0]
    with assert_max_captures(n=0), pytest.warns(CaptureFallbackWarning, match="capture cache full"):
        step(ts, synthetic_batch("segment", 2, 96, num_classes=3, max_boxes=4, seed=99))


@pytest.mark.slow
@pytest.mark.parametrize("capture", ["network", "network+heads", "step"])
def test_uint8_images_are_divided_inside_the_captured_function(fake_capture, model, capture, monkeypatch):
    """uint8 images reach the captured function as uint8 (its static input) and step bitwise like
    the float batch ``images.float() / 255``."""
    seen = []
    real = _fake_capture_vjp if capture != "step" else _fake_capture_step

    def spy(fn, a, b, *args, **kw):
        x = args[0] if args else kw.get("x", b)
        seen.extend(t.dtype for t in T.tree_leaves(x) if t.dim() == 4 and t.shape[1] == 3)
        return real(fn, a, b, *args, **kw)

    monkeypatch.setattr(replay_module, "capture_step" if capture == "step" else "capture_vjp", spy)
    want, _ = _run(model, capture, [32, 32], images=lambda b: Batch(_uint8(b).images.float() / 255, b.targets))
    seen.clear()
    got, _ = _run(model, capture, [32, 32], images=_uint8)
    assert torch.uint8 in seen  # the capture saw the uint8 images, not a float copy made before it
    _assert_runs_equal(got, want, f"{capture}: uint8 vs float")


def test_the_level_classes_cover_every_level_once():
    """``LEVELS`` is read off the level classes: each name once, each class a ``_Level``, and a
    step object runs the class of its level."""
    assert replay_module.LEVELS == ("none", "network", "network+heads", "step")
    classes = [replay_module._LEVEL_CLASSES[name] for name in replay_module.LEVELS]
    assert [c.name for c in classes] == list(replay_module.LEVELS)
    assert len(set(classes)) == len(classes) and all(issubclass(c, replay_module._Level) for c in classes)
    for name in replay_module.LEVELS:
        step = ReplayTrainStep(yolov8("n", task="detect", num_classes=3), multi_steps(sgd(0.1), every=1), capture=name)
        assert type(step._level).name == name


@pytest.mark.slow
def test_compiled_levels_step_bitwise_like_the_compiled_eager_step(fake_capture):
    """``compile=`` plumbing of every level on the CPU: with one shared
    :class:`yolo_func.train.compiled.CompiledModel` (``"aot_eager"``: dynamo + AOTAutograd, quick to
    compile; inductor runs in the GPU suite) each level steps bitwise like the compiled eager step
    (segment, a quarter-width model, 32 px), the compiled functions were traced once (no graph
    breaks, no recompiles) and the stand-in captures received the compiled vjp."""
    from yolo_func.models.scales import Scale
    from yolo_func.train.compiled import CompiledModel

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    tiny = yolov8(Scale("tiny", 0.33, 0.0625, 1024), task="segment", num_classes=3)
    cm = CompiledModel(tiny, "aot_eager")
    want, _ = _run(tiny, "none", [32, 32], compile=cm)
    seconds = cm.compile_seconds
    assert seconds > 0 and set(cm.compile_times) == {f"{p}/{d}" for p in ("network", "detect", "segment")
                                                      for d in ("forward", "backward")}
    for capture in ("network", "network+heads", "step"):
        n = _captures(capture, tiny)
        with assert_max_captures(n=n) as made:
            got, step = _run(tiny, capture, [32, 32], compile=cm)
        assert made.count == n and step.compiled is cm
        _assert_runs_equal(got, want, f"compiled {capture}")
    assert cm.compile_seconds == seconds  # nothing compiled again
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 3  # network, detect, segment: one graph each


@pytest.mark.slow
def test_autograd_backend_levels_step_bitwise_like_the_autograd_eager_step(fake_capture, model, monkeypatch):
    """``vjp="autograd"`` reaches every path of every level (warm-ups, captures, replays, the
    eager reference): ``torch.func.vjp`` raises throughout, and each level steps bitwise like the
    eager step with the same backend."""
    import yolo_func.func as F

    def no_functorch(*args, **kwargs):
        raise AssertionError("torch.func.vjp called under vjp='autograd'")

    monkeypatch.setattr(torch.func, "vjp", no_functorch)
    monkeypatch.setattr(F, "vjp", no_functorch)
    want, _ = _run(model, "none", [32, 32, 32], vjp="autograd")
    for capture in ("network", "network+heads", "step"):
        n = _captures(capture, model)
        with assert_max_captures(n=n) as made:
            got, step = _run(model, capture, [32, 32, 32], vjp="autograd")
        assert made.count == n and step.vjp == "autograd"
        _assert_runs_equal(got, want, f"autograd backend, {capture}")
