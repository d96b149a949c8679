"""On a GPU: no host synchronisation and CUDA-graph capture of the whole optimizer + EMA update.

Marked ``cuda`` (skipped on CPU-only machines).
"""

from __future__ import annotations

import pytest
import torch
from optim_helpers import random_grads, small_params, yolo_recipe

from yolo_func import tree as T
from yolo_func.optim import adamw, apply_updates, apply_updates_, ema
from yolo_func.testing import assert_trees_all_equal

pytestmark = pytest.mark.cuda


def _grads_seq(params, n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [T.tree_to(random_grads(params, gen, 20.0 if i % 3 == 0 else 1.0), "cuda") for i in range(n)]


def _lr_schedule(step):
    return 1e-3 * (1 + step.to(torch.float64)) ** -0.5


def test_no_host_sync():
    params = T.tree_to(small_params(), "cuda")
    tx, e, adam = yolo_recipe(), ema(), adamw(_lr_schedule, weight_decay=0.01)
    state, es, adam_state = tx.init(params), e.init(params), adam.init(params)
    grads = _grads_seq(params, 6)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for g in grads:
            u, state = tx.update(g, state, params)
            params = apply_updates(params, u)
            es = e.update(params, es, stepped=state.stepped)
            _, adam_state = adam.update(g, adam_state, params)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert int(state.count) == 6


@pytest.mark.parametrize("which", ["sgd_recipe", "adamw"])
def test_update_replays_in_a_cuda_graph(which):
    """Capture update + in-place apply + state copy + gated EMA once; replays equal eager bitwise."""
    make = yolo_recipe if which == "sgd_recipe" else (lambda: adamw(_lr_schedule, weight_decay=0.01))
    tx, e = make(), ema()
    params0 = T.tree_to(small_params(), "cuda")
    grads = _grads_seq(params0, 9, seed=1)

    # Eager reference.
    p_ref = T.tree_clone(params0)
    s_ref, es_ref = tx.init(p_ref), e.init(p_ref)
    for g in grads:
        u, s_ref = tx.update(g, s_ref, p_ref)
        p_ref = apply_updates(p_ref, u)
        flag = getattr(s_ref, "stepped", None)
        es_ref = e.update(p_ref, es_ref, stepped=flag)

    # Static buffers and one captured step.
    sp = T.tree_clone(params0)
    ss, ses, sg = tx.init(sp), e.init(sp), T.tree_zeros_like(sp)

    def step():
        u, new_s = tx.update(sg, ss, sp)
        apply_updates_(sp, u)
        T.tree_copy_(ss, new_s)
        T.tree_copy_(ses, e.update(sp, ses, stepped=getattr(ss, "stepped", None)))

    snapshot = T.tree_clone((sp, ss, ses))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    T.tree_copy_((sp, ss, ses), snapshot)
    for g in grads:
        T.tree_copy_(sg, g)
        graph.replay()
    torch.cuda.synchronize()
    assert_trees_all_equal(sp, p_ref)
    assert_trees_all_equal(ss, s_ref)
    assert_trees_all_equal(ses, es_ref)
