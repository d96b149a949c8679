"""Pure layers against independent torch.nn implementations written from REFERENCE.md §1.3."""

import hypothesis.strategies as st
import pytest
import torch
import torch.nn as tnn
from hypothesis import given

from yolo_func import nn
from yolo_func import tree as T
from yolo_func.testing import assert_trees_all_equal


def _bn_module(c):
    return tnn.BatchNorm2d(c, eps=1e-3, momentum=0.03)


class RefConv(tnn.Module):
    """Conv2d (no bias) -> BN(eps 1e-3, momentum 0.03) -> SiLU, straight from the spec."""

    def __init__(self, c1, c2, k=1, s=1):
        super().__init__()
        self.conv = tnn.Conv2d(c1, c2, k, s, k // 2, bias=False)
        self.bn = _bn_module(c2)

    def forward(self, x):
        return tnn.functional.silu(self.bn(self.conv(x)))


class RefC2f(tnn.Module):
    def __init__(self, c1, c2, n, shortcut):
        super().__init__()
        self.h = int(c2 * 0.5)
        self.cv1 = RefConv(c1, 2 * self.h)
        self.cv2 = RefConv((2 + n) * self.h, c2)
        self.m = tnn.ModuleList(tnn.ModuleList([RefConv(self.h, self.h, 3), RefConv(self.h, self.h, 3)]) for _ in range(n))
        self.shortcut = shortcut

    def forward(self, x):
        y = list(self.cv1(x).chunk(2, 1))
        for a, b in self.m:
            z = b(a(y[-1]))
            y.append(y[-1] + z if self.shortcut else z)
        return self.cv2(torch.cat(y, 1))


def _load_conv(ref: RefConv, p, s):
    ref.conv.weight.data.copy_(p["conv"]["weight"])
    ref.bn.weight.data.copy_(p["bn"]["weight"])
    ref.bn.bias.data.copy_(p["bn"]["bias"])
    ref.bn.running_mean.copy_(s["bn"]["running_mean"])
    ref.bn.running_var.copy_(s["bn"]["running_var"])


def _perturb(tree, gen):
    # Non-trivial BN affine/statistics so the comparison is not against the identity.
    return T.tree_map(lambda x: x + 0.1 * torch.rand(x.shape, generator=gen), tree)


@given(seed=st.integers(0, 2**31 - 1), c_in=st.integers(1, 6), c_out=st.integers(1, 6), k=st.sampled_from([1, 3]), s=st.sampled_from([1, 2]))
def test_conv_bn_act_matches_torch_nn(seed, c_in, c_out, k, s):
    g = torch.Generator().manual_seed(seed)
    layer = nn.conv_bn_act(c_in, c_out, k, s)
    p, st_ = layer.init(g)
    p, st_ = _perturb(p, g), _perturb(st_, g)
    ref = RefConv(c_in, c_out, k, s)
    _load_conv(ref, p, st_)
    x = torch.randn(2, c_in, 8, 8, generator=g)
    before = T.tree_clone(st_)
    for train in (True, False):
        ref.train(train)
        y, new = layer.apply(p, st_, x, train=train)
        torch.testing.assert_close(y, ref(x), rtol=1e-5, atol=1e-6)
        if train:
            torch.testing.assert_close(new["bn"]["running_mean"], ref.bn.running_mean)
            torch.testing.assert_close(new["bn"]["running_var"], ref.bn.running_var)
            _load_conv(ref, p, st_)  # reset the reference's stats for the eval comparison
        else:
            assert new is st_  # eval mode returns the very same state object
    # the caller's state is never written to
    assert_trees_all_equal(before, st_, strict=True)


def test_bn_in_place_opt_in_writes_the_given_buffers(gen):
    layer = nn.batchnorm(4)
    p, s = layer.init(gen)
    x = torch.randn(3, 4, 5, 5, generator=gen)
    _, fresh = layer.apply(p, s, x, train=True)
    assert torch.count_nonzero(s["running_mean"]) == 0
    with nn.update_stats_in_place():
        _, same = layer.apply(p, s, x, train=True)
    assert same["running_mean"] is s["running_mean"]
    torch.testing.assert_close(s["running_mean"], fresh["running_mean"], rtol=0, atol=0)
    # running_var uses the unbiased batch variance: 0.97 * 1 + 0.03 * var_unbiased
    var_u = x.transpose(0, 1).reshape(4, -1).var(1, unbiased=True)
    torch.testing.assert_close(fresh["running_var"], 0.97 + 0.03 * var_u, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("n,shortcut", [(1, True), (2, True), (2, False), (3, False)])
def test_c2f_matches_spec_module(gen, n, shortcut):
    c1, c2 = 8, 8
    layer = nn.c2f(c1, c2, n, shortcut=shortcut)
    p, s = layer.init(gen)
    p = _perturb(p, gen)
    ref = RefC2f(c1, c2, n, shortcut).eval()
    _load_conv(ref.cv1, p["cv1"], s["cv1"])
    _load_conv(ref.cv2, p["cv2"], s["cv2"])
    for j, (a, b) in enumerate(ref.m):
        _load_conv(a, p[f"m{j}"]["cv1"], s[f"m{j}"]["cv1"])
        _load_conv(b, p[f"m{j}"]["cv2"], s[f"m{j}"]["cv2"])
    x = torch.randn(2, c1, 6, 6, generator=gen)
    y, _ = layer.apply(p, s, x, train=False)
    torch.testing.assert_close(y, ref(x), rtol=1e-5, atol=1e-6)


def test_sppf_pools_three_times_with_minus_infinity_padding(gen):
    layer = nn.sppf(8, 8, 5)
    p, s = layer.init(gen)
    x = -torch.rand(1, 8, 7, 7, generator=gen) - 1.0  # all negative: zero padding would win a max
    cv1, cv2 = RefConv(8, 4), RefConv(16, 8)
    _load_conv(cv1, p["cv1"], s["cv1"])
    _load_conv(cv2, p["cv2"], s["cv2"])
    cv1.eval(), cv2.eval()
    y1 = cv1(x)
    pool = tnn.MaxPool2d(5, 1, 2)
    p1 = pool(y1)
    p2 = pool(p1)
    p3 = pool(p2)
    ref = cv2(torch.cat([y1, p1, p2, p3], 1))
    y, _ = layer.apply(p, s, x, train=False)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("seed", [0, 7])
def test_init_equals_torch_default_init(seed):
    """Same seed -> the same numbers as nn.Conv2d / nn.ConvTranspose2d's reset_parameters."""
    torch.manual_seed(seed)
    conv = tnn.Conv2d(6, 5, 3, bias=True)
    convt = tnn.ConvTranspose2d(4, 4, 2, 2, bias=True)
    g = torch.Generator().manual_seed(seed)
    p1, _ = nn.conv2d(6, 5, 3).init(g)
    p2, _ = nn.conv_transpose2d(4, 4, 2, 2).init(g)
    assert torch.equal(p1["weight"], conv.weight) and torch.equal(p1["bias"], conv.bias)
    assert torch.equal(p2["weight"], convt.weight) and torch.equal(p2["bias"], convt.bias)


def test_conv_transpose_doubles_resolution(gen):
    layer = nn.conv_transpose2d(3, 5, 2, 2)
    p, s = layer.init(gen)
    x = torch.randn(2, 3, 4, 6, generator=gen)
    y, _ = layer.apply(p, s, x, train=True)
    ref = tnn.functional.conv_transpose2d(x, p["weight"], p["bias"], 2)
    assert y.shape == (2, 5, 8, 12) and torch.equal(y, ref)


def test_upsample_and_concat(gen):
    x = torch.randn(1, 2, 3, 3, generator=gen)
    y, _ = nn.upsample(2).apply({}, {}, x, train=False)
    assert torch.equal(y[..., ::2, ::2], x) and torch.equal(y[..., 1::2, 1::2], x)
    z, _ = nn.concat().apply({}, {}, [x, y[..., :3, :3]], train=False)
    assert z.shape == (1, 4, 3, 3)


def test_split_generators_are_deterministic_and_distinct(gen):
    a = nn.split(torch.Generator().manual_seed(3), 3)
    b = nn.split(torch.Generator().manual_seed(3), 3)
    draws_a = [torch.rand(4, generator=g) for g in a]
    draws_b = [torch.rand(4, generator=g) for g in b]
    assert_trees_all_equal(draws_a, draws_b, strict=True)
    assert not torch.equal(draws_a[0], draws_a[1])


def test_abstract_init_allocates_nothing_with_the_real_shapes(gen):
    with nn.abstract_init():
        p, s = nn.c2f(8, 16, 2, shortcut=True).init(torch.Generator().manual_seed(0))
    real_p, real_s = nn.c2f(8, 16, 2, shortcut=True).init(gen)
    assert all(x.device.type == "meta" for x in T.tree_leaves((p, s)))
    assert T.tree_diff(p, real_p) == "" and T.tree_diff(s, real_s) == ""


@given(seed=st.integers(0, 2**16), dtype=st.sampled_from([torch.float32, torch.float64]),
       channels_last=st.booleans(), b=st.integers(1, 3), hw=st.integers(1, 5))
def test_train_batchnorm_on_the_cpu_equals_the_public_f_batch_norm_bitwise(seed, dtype, channels_last, b, hw):
    """The CPU training path calls native_batch_norm directly (no unused reserve tensor): output,
    running statistics and the vjp w.r.t. (x, weight, bias) equal F.batch_norm's bit for bit, and
    a single value per channel raises as F.batch_norm does."""
    import torch.nn.functional as F
    from torch.func import vjp
    g = torch.Generator().manual_seed(seed)
    c = 3
    x = torch.randn(b, c, hw, hw, generator=g, dtype=dtype) * 3 + 1
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    params = {"weight": torch.rand(c, generator=g, dtype=dtype) + 0.5, "bias": torch.randn(c, generator=g, dtype=dtype)}
    state = {"running_mean": torch.randn(c, generator=g, dtype=dtype), "running_var": torch.rand(c, generator=g, dtype=dtype) + 0.1}
    if b * hw * hw == 1:
        with pytest.raises(ValueError, match="more than 1 value per channel"):
            nn.batchnorm_apply(params, state, x, train=True)
        with pytest.raises(ValueError, match="more than 1 value per channel"):
            F.batch_norm(x, state["running_mean"].clone(), state["running_var"].clone(), params["weight"],
                         params["bias"], True, 0.03, 1e-3)
        return
    ct = torch.randn(x.shape, generator=g, dtype=dtype)

    def ours(p, xx):
        y, s = nn.batchnorm_apply(p, state, xx, train=True, eps=1e-3, momentum=0.03)
        return y, s

    def public(p, xx):
        m, v = state["running_mean"].clone(), state["running_var"].clone()
        y = F.batch_norm(xx, m, v, p["weight"], p["bias"], True, 0.03, 1e-3)
        return y, {"running_mean": m, "running_var": v}

    (y1, pull1, s1), (y2, pull2, s2) = (vjp(f, params, x, has_aux=True) for f in (ours, public))
    assert y1.stride() == y2.stride()
    assert_trees_all_equal((y1, s1, pull1(ct)), (y2, s2, pull2(ct)), strict=True)
