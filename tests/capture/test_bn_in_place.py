"""The premise of capture's BN-in-place mode, checked on the CPU: under ``torch.func.vjp`` the
YOLOv8n network with :func:`yolo_func.nn.update_stats_in_place` gives the same outputs, gradients
and statistics as the out-of-place default, writing the statistics into the given buffers."""

import torch

from yolo_func import nn
from yolo_func import tree as T
from yolo_func import yolov8


def test_in_place_statistics_under_vjp_equal_the_functional_ones():
    model = yolov8("n")
    params, state = model.init(torch.Generator().manual_seed(0))
    p, s = params["network"], state["network"]
    gen = torch.Generator().manual_seed(1)
    x = torch.rand(2, 3, 64, 64, generator=gen)

    def run(s_in):
        return torch.func.vjp(lambda q: model.network.apply(q, s_in, x, train=True), p, has_aux=True)

    out_ref, vjp_ref, s_ref = run(s)
    static = T.tree_clone(s)
    with nn.update_stats_in_place():
        out, vjp_fn, s_new = run(static)
    # the new state is the given buffers, holding exactly the functional statistics
    assert all(a is b for a, b in zip(T.tree_leaves(s_new), T.tree_leaves(static)))
    for a, b in zip(T.tree_leaves(static), T.tree_leaves(s_ref)):
        assert torch.equal(a, b)
    # and the statistics did move (0.97 * 0 + 0.03 * batch mean is not all zero)
    assert any(not torch.equal(a, b) for a, b in zip(T.tree_leaves(static), T.tree_leaves(s)))
    ct = T.tree_map(lambda o: torch.randn(o.shape, generator=gen), out_ref)
    for a, b in zip(T.tree_leaves(out), T.tree_leaves(out_ref)):
        assert torch.equal(a, b)
    for a, b in zip(T.tree_leaves(vjp_fn(ct)), T.tree_leaves(vjp_ref(ct))):
        assert torch.equal(a, b)
