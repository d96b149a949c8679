"""The eager training step against a plain autograd step, the non-finite policy, accumulation,
resume equality and a short run whose loss falls."""

import math
import warnings

import pytest
import torch

from yolo_func import tree as T
from yolo_func import yolov8
from yolo_func.assign import assign_from_detect
from yolo_func.io import load_checkpoint, save_checkpoint
from yolo_func.optim import adamw, chain, clip_by_global_norm, ema, multi_steps, partition, sgd, yolo_param_labels
from yolo_func.structures.targets import targets_from_lists
from yolo_func.testing import assert_trees_all_close, assert_trees_all_equal
from yolo_func.train import Batch, init_train_state, train_step, yolo_sgd
from yolo_func.train.metrics import NonFiniteLossWarning, fetch_metrics

LR, MOMENTUM, WD = 0.01, 0.9, 5e-4


def _batch(task: str, seed: int = 1, size: int = 64) -> Batch:
    g = torch.Generator().manual_seed(seed)
    images = torch.rand(2, 3, size, size, generator=g)
    boxes = [torch.tensor([[4.0, 4.0, 40.0, 30.0], [20.0, 16.0, 60.0, 60.0]]), torch.tensor([[10.0, 10.0, 50.0, 40.0]])]
    classes = [torch.tensor([0, 0]), torch.tensor([0])] if task == "pose" else [torch.tensor([1, 0]), torch.tensor([0])]
    kw = {}
    if task == "pose":
        kw["keypoints_list"] = [
            torch.cat([b[:, None, :2] + torch.rand(len(b), 17, 2, generator=g) * (b[:, None, 2:] - b[:, None, :2]),
                       torch.full((len(b), 17, 1), 2.0)], -1) for b in boxes
        ]
    t = targets_from_lists(boxes, classes, image_size=(size, size), **kw)
    if task == "segment":
        m = torch.zeros(2, size // 4, size // 4, dtype=torch.int64)
        m[0, 1:8, 1:10], m[0, 4:15, 5:15], m[1, 2:10, 2:12] = 1, 2, 1
        t = t._replace(masks=m)
    return Batch(images, t)


def _tx():
    groups = {name: sgd(LR, MOMENTUM, nesterov=True, weight_decay=WD if name == "decay" else 0.0)
              for name in ("decay", "no_decay", "bias")}
    return multi_steps(chain(clip_by_global_norm(10.0), partition(groups, yolo_param_labels)), every=1)


def _autograd_reference(model, params, state, batches):
    """The same functions trained the usual way: leaf tensors, loss.backward(), torch.optim.SGD."""
    params = T.tree_map(lambda x: x.clone().requires_grad_(True), params)
    labels = T.tree_flat_dict(yolo_param_labels(params))
    flat = T.tree_flat_dict(params)
    groups = [{"params": [flat[p] for p in flat if labels[p] == g], "weight_decay": WD if g == "decay" else 0.0}
              for g in ("decay", "no_decay", "bias")]
    opt = torch.optim.SGD(groups, lr=LR, momentum=MOMENTUM, nesterov=True)
    for batch in batches:
        preds, new_state = model.apply(params, state, batch.images, train=True)
        feats_shapes = [(8, 8), (4, 4), (2, 2)]
        from yolo_func.assign import make_anchors

        anchors = make_anchors(feats_shapes, model.strides)
        assignment = assign_from_detect(preds["detect"], batch.targets, anchors)
        loss = sum(head.loss(preds[name], batch.targets, assignment)[0] for name, head in model.heads.items())
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(flat.values()), 10.0)
        opt.step()
        state = T.tree_map(lambda x: x.detach(), new_state)
    return T.tree_map(lambda x: x.detach(), params), state


@pytest.mark.slow
@pytest.mark.parametrize("task", ["detect", "segment", "pose"])
def test_step_equals_an_autograd_reference_step(task):
    """10 steps: explicit per-head VJPs + summed feature gradients + our SGD == loss.backward() + torch SGD.

    Run in float64: the explicit feature-gradient sum adds the heads' and the neck's contributions
    in another order than autograd's accumulation, and our SGD rounds ``-lr * d`` before adding it
    (torch fuses the add). In float32 those orderings differ by ~3e-5 relative in the gradients of
    the ill-conditioned tiny-batch BN layers; in float64 the two paths agree to ~1e-8 relative (rtol 1e-6, atol 1e-7 asserted; the pose keypoint terms carry float32 sigmas) after
    10 steps, which leaves no room for a real difference (a wrong sign, a missing head, a double
    count would all show at 1e-2).
    """
    model = yolov8("n", task=task, num_classes=2 if task != "pose" else 1)
    params, state = model.init(torch.Generator().manual_seed(0))
    params, state = T.tree_cast(params, torch.float64), T.tree_cast(state, torch.float64)
    batches = [_batch(task, seed=s) for s in range(10)]
    batches = [Batch(b.images.double(), b.targets) for b in batches]
    ref_params, ref_state = _autograd_reference(model, params, state, batches)
    tx = _tx()
    ts = init_train_state(model, tx, torch.Generator(), params=params, state=state)
    for b in batches:
        ts, _ = train_step(ts, b, model=model, tx=tx)
    moved = max(float((a - b).abs().max()) for a, b in zip(T.tree_leaves(ts.params), T.tree_leaves(params), strict=True))
    assert moved > 1e-3  # the comparison is not between two untrained models
    assert_trees_all_close(ts.params, ref_params, rtol=1e-6, atol=1e-7, strict=True)
    assert_trees_all_close(ts.state, ref_state, rtol=1e-6, atol=1e-7, strict=True)


def test_step_is_pure_and_counts():
    model = yolov8("n", task="detect", num_classes=2)
    tx = _tx()
    ts = init_train_state(model, tx, torch.Generator().manual_seed(0))
    before = T.tree_clone(ts)
    new, metrics = train_step(ts, _batch("detect"), model=model, tx=tx)
    assert_trees_all_equal(before, ts, strict=True)  # nothing written
    assert int(new.step) == 1 and int(new.skipped) == 0
    m = fetch_metrics(metrics)
    assert set(m) >= {"loss/detect/box", "loss/detect/cls", "loss/detect/dfl", "feat_grad_norm/detect", "loss", "grad_norm"}
    # the total equals the batch size times the sum of the parts (the reference's convention)
    assert m["loss"] == pytest.approx(2 * (m["loss/detect/box"] + m["loss/detect/cls"] + m["loss/detect/dfl"]), rel=1e-5)


def test_non_finite_step_is_skipped_and_reported():
    model = yolov8("n", task="segment", num_classes=2)
    tx = _tx()
    e = ema()
    ts = init_train_state(model, tx, torch.Generator().manual_seed(0), ema=e)
    ts, _ = train_step(ts, _batch("segment"), model=model, tx=tx, ema=e)
    good = T.tree_clone(ts)
    bad = _batch("segment")
    bad = Batch(bad.images.clone(), bad.targets)
    bad.images[0, 0, 0, 0] = float("nan")
    ts2, metrics = train_step(ts, bad, model=model, tx=tx, ema=e)
    with pytest.warns(NonFiniteLossWarning, match=r"step 1: non-finite loss"):
        m = fetch_metrics(metrics)
    assert m["finite"] == 0.0 and int(ts2.skipped) == 1 and int(ts2.step) == 2
    for name in ("params", "state", "opt_state", "ema"):
        for (path, a), b in zip(T.tree_items(getattr(ts2, name)), T.tree_leaves(getattr(good, name)), strict=True):
            if path.endswith("count") or "/count" in path or path.endswith("last_step") or path.endswith("stepped"):
                continue
            assert torch.equal(a, b), f"{name}/{path} changed on a skipped step"
    ts3, metrics = train_step(ts2, _batch("segment", seed=5), model=model, tx=tx, ema=e)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fetch_metrics(metrics)["finite"] == 1.0
    assert not torch.equal(ts3.params["network"]["backbone"]["stem"]["conv"]["weight"],
                           ts2.params["network"]["backbone"]["stem"]["conv"]["weight"])


def test_accumulation_steps_every_k_micro_batches():
    model = yolov8("n", task="detect", num_classes=2)
    groups = {n: sgd(LR, MOMENTUM, nesterov=True) for n in ("decay", "no_decay", "bias")}
    tx = multi_steps(partition(groups, yolo_param_labels), every=2)
    ts0 = init_train_state(model, tx, torch.Generator().manual_seed(0))
    ts1, m1 = train_step(ts0, _batch("detect", 1), model=model, tx=tx)
    assert_trees_all_equal(ts1.params, ts0.params, strict=True)
    ts2, m2 = train_step(ts1, _batch("detect", 2), model=model, tx=tx)
    assert not bool(m1["stepped"]) and bool(m2["stepped"])
    assert not torch.equal(ts2.params["heads"]["detect"]["cls"]["p3"]["pred"]["bias"],
                           ts1.params["heads"]["detect"]["cls"]["p3"]["pred"]["bias"])


def test_resume_is_bitwise_identical(tmp_path):
    model = yolov8("n", task="detect", num_classes=2)
    opt = yolo_sgd(batch_size=2, batches_per_epoch=3, epochs=3)
    e = ema()
    batches = [_batch("detect", s) for s in range(6)]

    def run(ts, bs):
        for b in bs:
            ts, _ = train_step(ts, b, model=model, tx=opt.tx, ema=e)
        return ts

    fresh = lambda: init_train_state(model, opt.tx, torch.Generator().manual_seed(0), ema=e)  # noqa: E731
    straight = run(fresh(), batches)
    half = run(fresh(), batches[:3])
    save_checkpoint(tmp_path / "ck.pt", half, config={"scale": "n", "task": "detect"})
    template = fresh()
    resumed, config, _ = load_checkpoint(tmp_path / "ck.pt", template)
    resumed = run(resumed, batches[3:])
    assert config["task"] == "detect"
    assert_trees_all_equal(resumed, straight, strict=True)


@pytest.mark.slow
def test_loss_falls_on_a_repeated_batch():
    model = yolov8("n", task="detect", num_classes=2)
    groups = {n: sgd(0.01, 0.9, nesterov=True) for n in ("decay", "no_decay", "bias")}
    tx = multi_steps(chain(clip_by_global_norm(10.0), partition(groups, yolo_param_labels)), every=1)
    ts = init_train_state(model, tx, torch.Generator().manual_seed(0))
    batch = _batch("detect")
    losses = []
    for _ in range(25):
        ts, m = train_step(ts, batch, model=model, tx=tx)
        losses.append(fetch_metrics(m)["loss"])
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5, losses


# -- the non-finite skip for every optimizer (issue 11) ------------------------------------------

def _nan_batch(seed: int) -> Batch:
    b = _batch("detect", seed)
    images = b.images.clone()
    images[1, 2, 5, 7] = float("nan")
    return Batch(images, b.targets)


SKIP_OPTIMIZERS = {
    "sgd": lambda: sgd(0.01, 0.9),
    "adamw": lambda: adamw(1e-3),
    # nbs=4: accumulation ramps 1 -> 2 over the warmup, so the first steps step every call while
    # every group's lr and the momentum change with the iteration ni
    "yolo_sgd": lambda: yolo_sgd(batch_size=2, batches_per_epoch=4, epochs=3, nbs=4).tx,
    "multi_steps1": lambda: multi_steps(sgd(0.01, 0.9, nesterov=True), every=1),
    "multi_steps4": lambda: multi_steps(sgd(0.01, 0.9, nesterov=True), every=4),
}


@pytest.mark.parametrize("name", [n if n in ("sgd", "adamw") else pytest.param(n, marks=pytest.mark.slow)
                                  for n in sorted(SKIP_OPTIMIZERS)])
def test_a_nan_batch_is_skipped_for_every_optimizer(name):
    """Two steps, a batch with a NaN pixel, one more step.

    The NaN step leaves every leaf of params, BN statistics, the whole inner optimizer state
    (floats and its own counters) and the EMA bitwise unchanged; only the documented counters move
    (TrainState.step, TrainState.skipped, the guard's count, notfinite counters, stepped). The step
    after it equals the same step of a run that never saw the NaN batch, bitwise, once that run's
    iteration counters are advanced by the one micro-batch the skip consumed (the schedules read
    ``ni``, which counts every micro-batch as the reference's loop index does).
    """
    model = yolov8("n", task="detect", num_classes=2)
    tx, e = SKIP_OPTIMIZERS[name](), ema()
    ts = init_train_state(model, tx, torch.Generator().manual_seed(0), ema=e)
    for s in (1, 2):
        ts, _ = train_step(ts, _batch("detect", s), model=model, tx=tx, ema=e)
    before = T.tree_clone(ts)

    skipped, metrics = train_step(ts, _nan_batch(3), model=model, tx=tx, ema=e)
    m = fetch_metrics(metrics, warn=False)
    assert m["finite"] == 0.0 and m["stepped"] == 0.0 and not math.isfinite(m["loss"])
    assert int(skipped.skipped) == int(before.skipped) + 1 and int(skipped.step) == int(before.step) + 1
    assert_trees_all_equal(ts, before)  # pure: the input state was not written
    assert_trees_all_equal(skipped.params, before.params, strict=True)
    assert_trees_all_equal(skipped.state, before.state, strict=True)
    assert_trees_all_equal(skipped.ema, before.ema, strict=True)
    assert_trees_all_equal(skipped.opt_state.inner_state, before.opt_state.inner_state, strict=True)
    o, b = skipped.opt_state, before.opt_state
    assert int(o.count) == int(b.count) + 1 == 3
    assert (int(o.notfinite_count), int(o.total_notfinite_count), bool(o.stepped)) == (1, 1, False)

    after, m_after = train_step(skipped, _batch("detect", 4), model=model, tx=tx, ema=e)
    # the run without the NaN batch, its iteration counters advanced by the skipped micro-batch
    aligned = before._replace(step=before.step + 1, opt_state=b._replace(count=b.count + 1))
    clean, m_clean = train_step(aligned, _batch("detect", 4), model=model, tx=tx, ema=e)
    assert bool(m_clean["stepped"])  # the compared step changes the params (also for every=4)
    assert int(after.opt_state.total_notfinite_count) == 1 and int(after.skipped) == int(clean.skipped) + 1
    expected = clean._replace(skipped=after.skipped,
                              opt_state=clean.opt_state._replace(total_notfinite_count=after.opt_state.total_notfinite_count))
    assert_trees_all_equal(after, expected, strict=True)
    assert_trees_all_equal(m_after, m_clean, strict=True)
    moved = T.tree_map(lambda x, y: (x - y).abs().max(), after.params, before.params)
    assert max(float(v) for v in T.tree_leaves(moved)) > 0


def test_without_the_alignment_a_schedule_would_see_another_iteration():
    """The alignment above matters: yolo_sgd's warmup lr at ni=3 differs from ni=2, so a run that
    skipped a batch is not the run that never saw it unless ni counts the skipped micro-batch."""
    opt = yolo_sgd(batch_size=2, batches_per_epoch=4, epochs=3, nbs=4)
    lr = opt.schedules.lr["decay"]
    assert float(lr(torch.tensor(3))) != float(lr(torch.tensor(2)))


def test_metrics_reader_reads_posted_values_and_reports_skipped_steps_like_fetch_metrics():
    from yolo_func.train.metrics import MetricsReader

    reader = MetricsReader()
    assert reader.poll() is None  # nothing posted yet
    reader.post({"loss": torch.tensor(0.25), "step": torch.tensor(3), "finite": torch.tensor(True)})
    assert reader.poll() == {"loss": 0.25, "step": 3.0, "finite": 1.0}  # CPU: read at once
    assert reader.poll(wait=True) == reader.latest == {"loss": 0.25, "step": 3.0, "finite": 1.0}
    with pytest.warns(NonFiniteLossWarning, match=r"step 4: non-finite loss/detect/box=nan"):
        reader.post({"loss/detect/box": torch.tensor(float("nan")), "step": torch.tensor(4), "finite": torch.tensor(False)})
        got = reader.poll()
    assert math.isnan(got["loss/detect/box"]) and got["finite"] == 0.0


@pytest.mark.cuda
def test_metrics_reader_does_not_wait_for_the_device():
    from yolo_func.train.metrics import MetricsReader

    dev = torch.device("cuda")
    reader = MetricsReader()
    reader.post({"loss": torch.tensor(1.0, device=dev)})
    assert reader.poll(wait=True) == {"loss": 1.0}
    x = torch.tensor(2.0, device=dev)  # before the sleep: a tensor built from a Python number waits for the stream
    torch.cuda._sleep(200_000_000)  # the device is busy for a while
    reader.post({"loss": x})
    assert reader.poll() == {"loss": 1.0}  # not landed yet: the previous values, no wait
    assert reader.poll(wait=True) == {"loss": 2.0}
