"""sgd / adamw against torch.optim.SGD / AdamW (foreach) over 50 random steps.

Tolerance: 1e-6 relative on parameters. What is bitwise equal, and why:

* SGD momentum buffers with ``weight_decay=0``: the same foreach ops in the same order
  (``buf*mu + g``; ``mu*0 + g == g`` on the first step) and they do not depend on the parameters.
* SGD parameters are NOT bitwise: torch applies ``p.add_(d, alpha=-lr)``, a fused multiply-add
  (one rounding), while an optax-shaped update materialises ``u = -lr*d`` and then adds it (two
  roundings). With decay the buffers then inherit that last-bit drift through ``wd*p``.
* AdamW with ``weight_decay=0``: bitwise, parameters and moments. torch's ``addcdiv`` evaluates
  ``p + (s*m)/denom``; our update is exactly ``(s*m)/denom`` and ``apply_updates`` adds it, so
  the roundings coincide (bias corrections in float64 as torch's host doubles).
* AdamW with decay: moments bitwise (they do not see the decay), parameters within an ulp or so:
  torch rounds ``p*(1-lr*wd)`` before adding the Adam step, we add ``(p*c - p) + step`` to ``p``.
"""

from __future__ import annotations

import pytest
import torch
from optim_helpers import as_tree, random_grads, small_params, torch_params

from yolo_func import tree as T
from yolo_func.optim import adamw, apply_updates, partition, sgd, yolo_param_labels
from yolo_func.testing import assert_trees_all_close, assert_trees_all_equal

STEPS = 50
# Parameters are O(1) (unit normal), so atol 1e-6 is 1e-6 relative to their scale; elements that
# drift towards 0 keep the absolute error they picked up while larger.
RTOL, ATOL = 1e-6, 1e-6


def _run_pair(tx, torch_opt_factory, *, steps=STEPS, seed=0, grad_scale=1.0):
    """Step ours and torch's side by side; yield (step, our params, torch params, state, opt)."""
    params = small_params(seed)
    paths, tparams = torch_params(params)
    opt = torch_opt_factory(paths, tparams)
    state = tx.init(params)
    gen = torch.Generator().manual_seed(seed + 1)
    for step in range(steps):
        grads = random_grads(params, gen, grad_scale)
        for tp, g in zip(tparams, T.tree_leaves(grads), strict=True):
            tp.grad = g.clone()  # torch's nesterov path may write into .grad
        opt.step()
        before = T.tree_clone(grads)
        updates, state = tx.update(grads, state, params)
        assert_trees_all_equal(grads, before)  # the caller's gradients are not written
        params = apply_updates(params, updates)
        yield step, params, as_tree(params, tparams), state, opt, tparams


SGD_CASES = [
    dict(momentum=0.0, nesterov=False, weight_decay=0.0),
    dict(momentum=0.9, nesterov=False, weight_decay=0.0),
    dict(momentum=0.937, nesterov=True, weight_decay=0.0),
    dict(momentum=0.937, nesterov=True, weight_decay=5e-4),
    dict(momentum=0.9, nesterov=False, weight_decay=1e-2),
    dict(momentum=0.0, nesterov=False, weight_decay=1e-2),
]


@pytest.mark.parametrize("case", SGD_CASES, ids=lambda c: "m{momentum}-n{nesterov}-wd{weight_decay}".format(**c))
def test_sgd_tracks_torch_sgd(case):
    lr = 0.01
    tx = sgd(lr, **case)
    factory = lambda paths, ps: torch.optim.SGD(ps, lr=lr, foreach=True, **case)  # noqa: E731
    for step, ours, theirs, state, opt, tparams in _run_pair(tx, factory):
        assert_trees_all_close(ours, theirs, rtol=RTOL, atol=ATOL)
        if case["momentum"] and case["weight_decay"] == 0:
            trace_state = state[0]
            bufs = [opt.state[p]["momentum_buffer"] for p in tparams]
            assert_trees_all_equal(T.tree_leaves(trace_state.momentum), bufs, strict=True)


def test_sgd_first_momentum_buffer_is_the_gradient():
    """torch: buf = g on the first step (no momentum scaling), dampening 0."""
    params = small_params()
    grads = random_grads(params, torch.Generator().manual_seed(3))
    tx = sgd(0.1, momentum=0.937, nesterov=False, weight_decay=0.0)
    _, state = tx.update(grads, tx.init(params), params)
    assert_trees_all_equal(state[0].momentum, grads)
    assert int(state[0].count) == 1


def test_sgd_param_groups_match_torch():
    """Three groups with different lr / decay: torch param groups == partition + yolo_param_labels."""
    lr, lr_bias, wd, mom = 0.01, 0.05, 5e-4, 0.937
    tx = partition(
        {
            "decay": sgd(lr, momentum=mom, nesterov=True, weight_decay=wd),
            "no_decay": sgd(lr, momentum=mom, nesterov=True),
            "bias": sgd(lr_bias, momentum=mom, nesterov=True),
        },
        yolo_param_labels,
    )
    labels = T.tree_leaves(yolo_param_labels(small_params()))
    assert sorted(set(labels)) == ["bias", "decay", "no_decay"]

    def factory(paths, ps):
        group = lambda name: [p for p, lab in zip(ps, labels, strict=True) if lab == name]  # noqa: E731
        return torch.optim.SGD(
            [
                {"params": group("bias"), "lr": lr_bias},
                {"params": group("decay"), "weight_decay": wd},
                {"params": group("no_decay")},
            ],
            lr=lr, momentum=mom, nesterov=True, foreach=True,
        )

    for _, ours, theirs, state, opt, tparams in _run_pair(tx, factory):
        assert_trees_all_close(ours, theirs, rtol=RTOL, atol=ATOL)
    # Buffers of the groups without decay never see the parameters: bitwise.
    for label in ("no_decay", "bias"):
        ours_bufs = state.inner_states[label][0].momentum
        for path, buf in ours_bufs.items():
            theirs_buf = opt.state[tparams[T.tree_paths(small_params()).index(path)]]["momentum_buffer"]
            assert torch.equal(buf, theirs_buf), path


ADAMW_CASES = [dict(weight_decay=0.0), dict(weight_decay=0.01), dict(weight_decay=0.05, b1=0.937, b2=0.99, eps=1e-6)]


@pytest.mark.parametrize("case", ADAMW_CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_adamw_tracks_torch_adamw(case):
    lr = 1e-3
    b1, b2, eps, wd = case.get("b1", 0.9), case.get("b2", 0.999), case.get("eps", 1e-8), case["weight_decay"]
    tx = adamw(lr, b1=b1, b2=b2, eps=eps, weight_decay=wd)
    factory = lambda paths, ps: torch.optim.AdamW(ps, lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd, foreach=True)  # noqa: E731
    for step, ours, theirs, state, opt, tparams in _run_pair(tx, factory):
        mu = [opt.state[p]["exp_avg"] for p in tparams]
        nu = [opt.state[p]["exp_avg_sq"] for p in tparams]
        if wd == 0:
            assert_trees_all_equal(ours, theirs)
            assert_trees_all_equal(T.tree_leaves(state.mu), mu, strict=True)
            assert_trees_all_equal(T.tree_leaves(state.nu), nu, strict=True)
        else:
            assert_trees_all_close(ours, theirs, rtol=RTOL, atol=ATOL)
            assert_trees_all_close(T.tree_leaves(state.mu), mu, rtol=RTOL, atol=ATOL)
        assert int(state.count) == step + 1 == int(opt.state[tparams[0]]["step"])


def test_adamw_param_groups_match_torch():
    lr, lr_bias, wd = 1e-3, 5e-3, 0.05
    tx = partition(
        {"decay": adamw(lr, weight_decay=wd), "no_decay": adamw(lr, weight_decay=0.0), "bias": adamw(lr_bias, weight_decay=0.0)},
        yolo_param_labels,
    )
    labels = T.tree_leaves(yolo_param_labels(small_params()))

    def factory(paths, ps):
        group = lambda name: [p for p, lab in zip(ps, labels, strict=True) if lab == name]  # noqa: E731
        return torch.optim.AdamW(
            [{"params": group("bias"), "lr": lr_bias, "weight_decay": 0.0},
             {"params": group("decay"), "weight_decay": wd},
             {"params": group("no_decay"), "weight_decay": 0.0}],
            lr=lr, foreach=True,
        )

    for _, ours, theirs, *_ in _run_pair(tx, factory):
        assert_trees_all_close(ours, theirs, rtol=RTOL, atol=ATOL)
        # The groups without decay are bitwise (see the module docstring).
        flat_o, flat_t = T.tree_flat_dict(ours), T.tree_flat_dict(theirs)
        for path, lab in zip(T.tree_paths(ours), labels, strict=True):
            if lab != "decay":
                assert torch.equal(flat_o[path], flat_t[path]), path


def test_sgd_rejects_nesterov_without_momentum():
    with pytest.raises(ValueError, match=r"^\[yolo_func\] sgd\(nesterov=True\)"):
        sgd(0.1, nesterov=True)
    with pytest.raises(TypeError, match=r"^\[yolo_func\] sgd\(learning_rate\)"):
        sgd("0.1")
