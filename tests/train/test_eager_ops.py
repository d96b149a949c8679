"""The eager step's dispatched aten ops stay counted (issue 17 item 4).

Measured 2026-12-04 (benchmarks/results/eager_ops_2026-12-04.md; yolov8n detect, 64 px, batch 2, CPU,
yolo_sgd + ema): 1976 ops before flat buffers, 1847 after; the guard + optimizer + EMA phase
1012 -> 883; then 1646 / 682 (benchmarks/results/eager_ops_2026-12-04b.md: no per-leaf views for
recognised flat groups, no select of the gradients in the guard, the step's gradient norm reused
by the guard); then 1398 / 434 (a fresh list is copied into a buffer the select / EMA lerp then
writes its result into: one set of views per tree instead of two); then 1382 (anchors: 35 -> 19
ops) and 1325 (BN on the CPU: native_batch_norm without F.batch_norm's unused reserve tensor).
Second pass (benchmarks/results/eager_ops_2026-12-04c.md): 1229 (update 414; schedule constants as
Python floats and shared casts, finite_scalar, func.cat's one-split backward, memoised anchors,
ciou / dfl_loss with fewer views and gathers, no redundant detaches). Third pass
(benchmarks/results/eager_ops_2026-12-05.md): 982 (update 130; on the CPU the selects' flags are
read on the host — yolo_func.optim.base.host_flag — and the EMA is one _foreach_lerp; func.cat is
torch.cat for CPU tensors under torch.func, +29 ops for -6 ms of host time). The bounds below sit a
little above the measurement so that an unrelated change that adds per-leaf work to the step fails
here.
"""

from __future__ import annotations

import torch

from yolo_func import yolov8
from yolo_func.optim import ema, flat
from yolo_func.optim.base import set_host_flags
from yolo_func.testing import count_aten_ops
from yolo_func.testing.synthetic import synthetic_batch
from yolo_func.train import init_train_state, train_step, yolo_sgd
from yolo_func.train.step import finish_step, heads_backward, network_vjp

STEP_MAX_OPS = 995       # measured 982 (torch 2.13 and 2.14)
UPDATE_MAX_OPS = 140     # guard + optimizer + EMA + metrics, measured 130


def _setup():
    model = yolov8("n", task="detect")
    opt = yolo_sgd(batch_size=2, batches_per_epoch=1000, epochs=100)
    e = ema()
    ts = init_train_state(model, opt.tx, torch.Generator().manual_seed(0), ema=e)
    b = synthetic_batch("detect", 2, 64, num_classes=model.num_classes, max_boxes=8, min_boxes=2, seed=1)
    ts, _ = train_step(ts, b, model=model, tx=opt.tx, ema=e)   # memo tables, lazy imports
    return model, opt.tx, e, ts, b


def test_eager_step_op_count_stays_below_the_measured_bound():
    model, tx, e, ts, b = _setup()
    with count_aten_ops() as c:
        train_step(ts, b, model=model, tx=tx, ema=e)
    assert c.total <= STEP_MAX_OPS, (c.total, c.by_op.most_common(10))

    feats, pull, net_state = network_vjp(model, ts.params["network"], ts.state["network"], b.images)
    hb = heads_backward(model, ts.params["heads"], ts.state["heads"], feats, b.targets)
    (g_net,) = pull(hb.g_feats)
    grads, new_state = {"network": g_net, "heads": hb.head_grads}, {"network": net_state, "heads": hb.head_states}

    def update():
        with count_aten_ops() as u:
            out = finish_step(ts, grads, new_state, hb.losses, hb.parts, hb.feat_norms, tx=tx, ema=e)
        return u, out

    u_host, (ts_host, m_host) = update()  # CPU: the selects' flags read on the host
    old_flags = set_host_flags(False)  # the device form, as on a GPU
    try:
        u_flat, (ts_flat, m_flat) = update()
        old = flat.set_enabled(False)
        try:
            u_cat, (ts_cat, m_cat) = update()
        finally:
            flat.set_enabled(old)
    finally:
        set_host_flags(old_flags)
    assert u_host.total <= UPDATE_MAX_OPS, u_host.by_op.most_common(10)
    # The host reads drop the model-sized selects and the EMA's views of a gathered buffer (one per
    # 4-D leaf: 63 conv kernels here).
    assert u_host.total <= u_flat.total - 60, (u_host.total, u_flat.total)
    # Device form: recognising the carried flat buffers saves the views and copies of the old inner
    # state, the old BN statistics and the EMA: one per 4-D leaf at least (63 conv kernels here).
    assert u_flat.total <= u_cat.total - 100, (u_flat.total, u_cat.total)
    assert u_flat.by_op["aten.cat.default"] < u_cat.by_op["aten.cat.default"]
    from yolo_func.testing import assert_trees_all_equal
    assert_trees_all_equal((ts_flat, m_flat), (ts_cat, m_cat), strict=True)
    assert_trees_all_equal((ts_host, m_host), (ts_cat, m_cat), strict=True)
