"""The premise of capture's BN-in-place mode, checked on the CPU: under ``torch.func.vjp`` the
YOLOv8n network with :func:`yolo_func.nn.update_stats_in_place` gives the same outputs, gradients
and statistics as the out-of-place default, writing the statistics into the given buffers."""

import pytest
import torch

from yolo_func import nn
from yolo_func import tree as T
from yolo_func import yolov8
from yolo_func.testing import assert_trees_all_equal


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
    assert [id(a) for a in T.tree_leaves(s_new)] == [id(b) for b in T.tree_leaves(static)]
    assert_trees_all_equal(static, s_ref, strict=True)
    # and the statistics did move (0.97 * 0 + 0.03 * batch mean is not all zero)
    with pytest.raises(AssertionError, match="not equal"):
        assert_trees_all_equal(static, s)
    ct = T.tree_map(lambda o: torch.randn(o.shape, generator=gen), out_ref)
    assert_trees_all_equal(out, out_ref, strict=True)
    assert_trees_all_equal(vjp_fn(ct), vjp_ref(ct), strict=True)
