"""Bitwise before/after tests for the eager-step op cuts of issue 17 item 4 (second pass).

Each restructured function is compared with a copy of its previous body kept here: the same
values bit for bit (``torch.equal`` on the raw values, dtypes and shapes included), on the CPU.
"""

from __future__ import annotations

import math

import pytest
import torch

from yolo_func.optim import interp_warmup, schedule_memo, yolo_schedules
from yolo_func.optim.base import finite_scalar


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_floating_point():
        width = {torch.float64: torch.int64, torch.float32: torch.int32, torch.float16: torch.int16,
                 torch.bfloat16: torch.int16}[a.dtype]
        return torch.equal(a.view(width), b.view(width))
    return torch.equal(a, b)


# -- interp_warmup: Python floats stay Python floats (before: one fill kernel per constant) ------

def _old_as64(x, device=None):
    if isinstance(x, torch.Tensor):
        return x.to(dtype=torch.float64)
    return torch.full((), float(x), dtype=torch.float64, device=device)


def _old_interp_warmup(x, end, start_value, end_value):
    xf = _old_as64(x)
    y0 = _old_as64(start_value, xf.device)
    y1 = _old_as64(end_value, xf.device)
    slope = (y1 - y0) / max(end, 1)
    return torch.where(xf == end, y1, slope * xf + y0)


@pytest.mark.parametrize("end", [0, 1, 3, 7, 300, 1000, 4917])
@pytest.mark.parametrize("values", [(0.0, 0.01), (0.1, 0.01), (0.8, 0.937), (1.0, 8.0), (1.0, 1.0), (0.0, 0.0),
                                    (0.1, 0.0123456789), (3.3e-5, 7.1e-3)])
@pytest.mark.parametrize("as_tensor", ["none", "start", "end", "both"])
def test_interp_warmup_is_bitwise_the_old_one(end, values, as_tensor):
    y0, y1 = values
    f64 = lambda v: torch.tensor(v, dtype=torch.float64)  # noqa: E731
    a = f64(y0) if as_tensor in ("start", "both") else y0
    b = f64(y1) if as_tensor in ("end", "both") else y1
    for x in sorted({0, 1, 2, end // 3, end // 2, max(end - 1, 0), end}):
        for xt in (torch.tensor(x), torch.tensor(float(x), dtype=torch.float64), torch.tensor(float(x))):
            new, old = interp_warmup(xt, end, a, b), _old_interp_warmup(xt, end, a, b)
            assert _bits_equal(new, old), (x, end, values, as_tensor, new.item(), old.item())


def test_yolo_schedules_are_bitwise_the_old_ones_over_warmup_and_after():
    """lr per group, momentum and accumulate from yolo_schedules, inside and outside schedule_memo
    (which now also shares the step's float64 conversion), against the old formulas."""
    nb, epochs, nw_epochs = 37, 5, 3.0
    s = yolo_schedules(lr0=0.01, lrf=0.01, momentum=0.937, warmup_momentum=0.8, warmup_bias_lr=0.1,
                       warmup_epochs=nw_epochs, epochs=epochs, batches_per_epoch=nb, nominal_accumulate=8)
    nw = s.warmup_iters
    assert nw == round(nw_epochs * nb)

    def old(ni):
        epoch = torch.div(ni, nb, rounding_mode="floor")
        e = _old_as64(epoch)
        tgt = 0.01 * (torch.clamp(1 - e / epochs, min=0.0) * (1.0 - 0.01) + 0.01)
        lr_w = torch.where(ni <= nw, _old_interp_warmup(ni, nw, 0.0, tgt), tgt)
        lr_b = torch.where(ni <= nw, _old_interp_warmup(ni, nw, 0.1, tgt), tgt)
        m = torch.full((), 0.937, dtype=torch.float64)
        mom = torch.where(ni <= nw, _old_interp_warmup(ni, nw, 0.8, m), m)
        warm = torch.clamp(torch.round(_old_interp_warmup(ni, nw, 1.0, 8.0)), min=1.0)
        acc = torch.where(ni <= nw, warm.to(torch.int64), torch.full((), 8, dtype=torch.int64))
        return lr_w, lr_b, mom, acc

    for i in list(range(0, nw + 3)) + [nb * epochs - 1, nb * epochs]:
        ni = torch.tensor(i)
        for memo in (False, True):
            if memo:
                with schedule_memo():
                    got = (s.lr["decay"](ni), s.lr["bias"](ni), s.momentum(ni), s.accumulate(ni))
            else:
                got = (s.lr["decay"](ni), s.lr["bias"](ni), s.momentum(ni), s.accumulate(ni))
            for g, o in zip(got, old(ni)):
                assert _bits_equal(g, o), (i, memo, g, o)


# -- finite_scalar: two kernels instead of isfinite's four ----------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_finite_scalar_is_isfinite(dtype):
    info = torch.finfo(dtype)
    vals = [0.0, -0.0, 1.0, -1.5, info.max, -info.max, info.tiny, info.tiny / 4, -info.tiny / 8, info.eps,
            math.inf, -math.inf, math.nan, 65504.0 if dtype == torch.float16 else 1e30]
    x = torch.tensor(vals, dtype=dtype)
    assert torch.equal(finite_scalar(x), torch.isfinite(x))
    for v in x:  # 0-dim, as the step's loss and gradient norm are
        assert torch.equal(finite_scalar(v), torch.isfinite(v))
    r = torch.randn(1000, generator=torch.Generator().manual_seed(0), dtype=torch.float64).to(dtype) * 1e4
    assert torch.equal(finite_scalar(r), torch.isfinite(r))


# -- ciou._forward: split / unbind instead of slices / selects --------------------------------------

def _old_ciou_forward(p, q, eps):
    K = 4 / math.pi**2
    p1, p2 = p[..., :2], p[..., 2:]
    q1, q2 = q[..., :2], q[..., 2:]
    wh1, wh2 = p2 - p1, q2 - q1
    w1, h1 = wh1[..., 0], wh1[..., 1] + eps
    w2, h2 = wh2[..., 0], wh2[..., 1] + eps
    iwh_raw = torch.minimum(p2, q2) - torch.maximum(p1, q1)
    iwh = iwh_raw.clamp(min=0)
    inter = iwh[..., 0] * iwh[..., 1]
    union = w1 * h1 + w2 * h2 - inter + eps
    iou = inter / union
    cwh = torch.maximum(p2, q2) - torch.minimum(p1, q1)
    cwh2 = cwh.pow(2)
    c2 = cwh2[..., 0] + cwh2[..., 1] + eps
    d = q1 + q2 - p1 - p2
    d2 = d.pow(2)
    rho2 = (d2[..., 0] + d2[..., 1]) / 4
    r1 = w1 / h1
    da = torch.atan(w2 / h2) - torch.atan(r1)
    v = K * da.pow(2)
    alpha = v / (v - iou + (1 + eps))
    out = iou - (rho2 / c2 + v * alpha)
    return out, (p1, p2, q1, q2, w1, h1, iwh_raw, iwh, union, iou, cwh, c2, d, rho2, r1, da, alpha)


def _random_boxes(gen, shape, dtype):
    xy = torch.rand(*shape, 2, generator=gen, dtype=torch.float64) * 40
    wh = torch.rand(*shape, 2, generator=gen, dtype=torch.float64) * 20
    wh[..., :3, :] = 0.0  # degenerate boxes (zero width / height)
    return torch.cat((xy, xy + wh), -1).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("layout", ["pairs", "broadcast"])
def test_ciou_forward_and_saved_tensors_are_bitwise_the_old_ones(dtype, layout):
    """The backward is a function of the saved tensors only: equal saved tensors give equal grads."""
    from yolo_func.structures.ciou import _forward, ciou

    gen = torch.Generator().manual_seed(3)
    if layout == "pairs":  # the loss: [B, A, 4] against [B, A, 4]
        p, q = _random_boxes(gen, (2, 37), dtype), _random_boxes(gen, (2, 37), dtype)
        q[0, 5:9] = p[0, 5:9]  # identical boxes: ties in min / max
    else:  # the assigner: [B, M, 1, 4] against [B, 1, A, 4]
        p, q = _random_boxes(gen, (2, 5, 1), dtype), _random_boxes(gen, (2, 1, 41), dtype)
    new_out, new_saved = _forward(p, q, 1e-7)
    old_out, old_saved = _old_ciou_forward(p, q, 1e-7)
    assert _bits_equal(new_out, old_out)
    for a, b in zip(new_saved, old_saved, strict=True):
        assert _bits_equal(a, b) and a.stride() == b.stride()
    pr = p.clone().requires_grad_(True)
    out = ciou(pr, q)
    assert _bits_equal(out.detach(), old_out)


# -- dfl_loss: both neighbouring bins in one gather --------------------------------------------------

def _old_dfl_loss(box_dist, target, reg_max=16):
    logp = box_dist.reshape(*box_dist.shape[:-1], 4, reg_max).log_softmax(-1)
    t = target.detach().clamp(0, reg_max - 1 - 0.01)
    tl = t.floor()
    wl = tl + 1 - t
    wr = 1 - wl
    idx = tl.long().unsqueeze(-1)
    lp_l = logp.gather(-1, idx).squeeze(-1)
    lp_r = logp.gather(-1, idx + 1).squeeze(-1)
    return -(lp_l * wl + lp_r * wr).mean(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_dfl_loss_value_and_gradient_are_bitwise_the_old_ones(dtype):
    from yolo_func.losses import dfl_loss

    gen = torch.Generator().manual_seed(5)
    logits = (torch.randn(2, 53, 64, generator=gen, dtype=torch.float64) * 3).to(dtype)
    target = (torch.rand(2, 53, 4, generator=gen, dtype=torch.float64) * 17 - 0.5).to(dtype)
    target[0, :4] = torch.tensor([0.0, 14.99, 15.0, 3.0], dtype=dtype)  # edges and exact bins
    w = torch.rand(2, 53, generator=gen, dtype=torch.float64).to(dtype)
    grads = []
    for fn in (dfl_loss, _old_dfl_loss):
        x = logits.clone().requires_grad_(True)
        val = fn(x, target)
        (g,) = torch.autograd.grad((val * w).sum(), x)
        grads.append((val.detach(), g))
    assert _bits_equal(grads[0][0], grads[1][0])
    assert _bits_equal(grads[0][1], grads[1][1])


# -- func.cat: one split in the backward instead of a slice per input -------------------------------

def test_cat_forward_and_vjp_are_bitwise_torch_cat(monkeypatch):
    from torch.func import vjp

    import yolo_func.func as func
    from yolo_func.func import cat

    monkeypatch.setattr(func, "_CAT_ON_CPU", True)  # the Function itself (CPU tensors get torch.cat)

    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(2, c, 5, 3, generator=gen) for c in (3, 1, 4)]
    w = torch.randn(2, 8, 5, 3, generator=gen)
    for dim, ys in ((1, xs), (-1, [x.transpose(1, 3).contiguous()[:, :, :, :2] for x in xs[:1]] * 2)):
        new = vjp(lambda *a: (cat(a, dim) * 3).sin(), *ys)
        old = vjp(lambda *a: (torch.cat(a, dim) * 3).sin(), *ys)
        assert _bits_equal(new[0], old[0])
        g = torch.randn(new[0].shape, generator=gen)
        for a, b in zip(new[1](g), old[1](g), strict=True):
            assert _bits_equal(a, b) and a.stride() == b.stride()
    xs16 = [xs[0].to(torch.bfloat16).requires_grad_(True), xs[1].requires_grad_(True)]
    y = cat(xs16, 1)  # mixed dtypes: promoted forward, each gradient in its input's dtype
    assert y.dtype == torch.float32
    ga, gb = torch.autograd.grad(y.sum(), xs16)
    assert ga.dtype == torch.bfloat16 and gb.dtype == torch.float32


@pytest.mark.parametrize("task", ["detect", "segment"])
def test_train_step_with_func_cat_is_bitwise_the_plain_cat_step(task, monkeypatch):
    """Two whole eager steps (network, heads, losses, optimizer, EMA) with ``func.cat`` and with
    plain ``torch.cat``: bit for bit the same state and metrics (``_CAT_ON_CPU``: the step uses
    ``torch.cat`` for CPU tensors otherwise)."""
    import yolo_func.func as func
    from yolo_func import yolov8
    from yolo_func.optim import ema
    from yolo_func.testing import assert_trees_all_equal
    from yolo_func.testing.synthetic import synthetic_batch
    from yolo_func.train import init_train_state, train_step, yolo_sgd

    model = yolov8("n", task=task, num_classes=3)
    opt = yolo_sgd(batch_size=2, batches_per_epoch=10, epochs=3)
    e = ema()
    b = synthetic_batch(task, 2, 64, num_classes=3, max_boxes=4, min_boxes=1, seed=2)
    runs = []
    for on in (True, False):
        monkeypatch.setattr(func, "_CAT_FUNCTION", on)
        monkeypatch.setattr(func, "_CAT_ON_CPU", True)
        ts = init_train_state(model, opt.tx, torch.Generator().manual_seed(0), ema=e)
        for _ in range(2):
            ts, m = train_step(ts, b, model=model, tx=opt.tx, ema=e)
        runs.append((ts, m))
    assert_trees_all_equal(runs[0], runs[1], strict=True)


# -- anchors_for_feats: memoised per shapes, device and dtype --------------------------------------

def test_anchors_memo_gives_the_fresh_values_and_reuses_them(monkeypatch):
    import yolo_func.assign.anchors as anchors_mod
    from yolo_func.assign import anchors_for_feats, make_anchors

    monkeypatch.setattr(anchors_mod, "_MEMO", {})
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        feats = [torch.zeros(2, 4, h, w, dtype=dtype) for h, w in ((40, 24), (20, 12), (10, 6))]
        a = anchors_for_feats(feats, (8, 16, 32))
        fresh = make_anchors([(40, 24), (20, 12), (10, 6)], (8, 16, 32), dtype=dtype)
        assert _bits_equal(a.points, fresh.points) and _bits_equal(a.strides, fresh.strides)
        assert anchors_for_feats(feats, (8, 16, 32)) is a  # memoised
        with torch.inference_mode():
            b = anchors_for_feats(feats, (8, 16, 32))
        assert b is not a and b.points.is_inference() and not a.points.is_inference()
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)  # never memoised while tracing
    feats = [torch.zeros(1, 1, 4, 4)]
    assert anchors_for_feats(feats, (8,)) is not anchors_for_feats(feats, (8,))
    monkeypatch.undo()


def test_anchors_memo_is_bounded(monkeypatch):
    import yolo_func.assign.anchors as anchors_mod
    from yolo_func.assign import anchors_for_feats

    monkeypatch.setattr(anchors_mod, "_MEMO", {})
    for s in range(1, 3 * anchors_mod._MEMO_SIZE):
        anchors_for_feats([torch.zeros(1, 1, s, s)], (8,))
    assert len(anchors_mod._MEMO) == anchors_mod._MEMO_SIZE
