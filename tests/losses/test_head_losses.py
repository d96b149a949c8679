"""Head-level losses: invariants, zero targets, gradients, the vectorised mask loss against a
per-image loop, per-instance vs overlap masks, head wiring and torch.func."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from yolo_func._types import DetectPreds, PosePreds, SegmentPreds
from yolo_func.assign import assign_from_detect, make_anchors
from yolo_func.heads import detect_head, pose_head, segment_head
from yolo_func.losses import detect_loss, pose_loss, segment_loss
from yolo_func.losses.mask import crop_bounds
from yolo_func.structures import targets_from_flat

ANCHORS = make_anchors([(8, 8), (4, 4), (2, 2)], (8, 16, 32))  # 64x64 image
B, A, K = 2, 84, 3


def _case(seed, n=(2, 3), kpt_d=3):
    g = torch.Generator().manual_seed(seed)
    dp = DetectPreds(torch.randn(B, A, 64, generator=g), torch.randn(B, A, K, generator=g) - 1)
    sp = SegmentPreds(torch.randn(B, A, 32, generator=g), torch.randn(B, 32, 16, 16, generator=g))
    pp = PosePreds(torch.randn(B, A, 17 * kpt_d, generator=g) * 0.5)
    N = sum(n)
    bi = torch.cat([torch.full((c,), float(b)) for b, c in enumerate(n)]) if N else torch.zeros(0)
    wh = torch.rand(N, 2, generator=g) * 0.5 + 0.1
    xy = wh / 2 + torch.rand(N, 2, generator=g) * (1 - wh)
    xywh = torch.cat((xy, wh), -1)
    masks = torch.zeros(B, 16, 16)
    counts = [0] * B
    for i in range(N):  # draw instances into an overlap map (value = slot + 1)
        b = int(bi[i])
        counts[b] += 1
        x1, y1, x2, y2 = ((xywh[i, :2] - xywh[i, 2:] / 2) * 16).long().tolist() + ((xywh[i, :2] + xywh[i, 2:] / 2) * 16).long().tolist()
        masks[b, y1:y2, x1:x2] = counts[b]
    kp = torch.cat((torch.rand(N, 17, 2, generator=g), torch.randint(0, 3, (N, 17, 1), generator=g).float()), -1)[..., :kpt_d]
    t = targets_from_flat(bi, torch.randint(0, K, (N,), generator=g).float(), xywh, batch_size=B, image_size=(64, 64),
                          masks=masks, keypoints=kp)
    return dp, sp, pp, t, assign_from_detect(dp, t, ANCHORS)


@settings(max_examples=10)
@given(st.integers(0, 2**16), st.tuples(st.integers(0, 4), st.integers(0, 4)))
def test_losses_finite_nonnegative_with_finite_gradients(seed, n):
    dp, sp, pp, t, a = _case(seed, n)
    leaves = [x.requires_grad_(True) for x in (*dp, *sp, *pp)]
    dp, sp, pp = DetectPreds(*leaves[:2]), SegmentPreds(*leaves[2:4]), PosePreds(leaves[4])
    total = 0
    for fn, preds in ((detect_loss(num_classes=K), dp), (segment_loss(), sp), (pose_loss(kpt_shape=(17, 3)), pp)):
        loss, parts = fn(preds, t, a)
        assert torch.isfinite(loss) and loss >= 0
        for v in parts.values():
            assert torch.isfinite(v) and v >= 0 and not v.requires_grad
        torch.testing.assert_close(loss.detach(), B * sum(parts.values()))
        total = total + loss
    for g in torch.autograd.grad(total, leaves):
        assert torch.isfinite(g).all()


def test_zero_targets():
    dp, sp, pp, t, a = _case(3, n=(0, 0))
    assert not a.fg_mask.any()
    _, d = detect_loss(num_classes=K)(dp, t, a)
    assert d["box"] == 0 and d["dfl"] == 0 and torch.isfinite(d["cls"]) and d["cls"] > 0
    # S = 1: cls = gain * sum BCE(logit, 0)
    torch.testing.assert_close(d["cls"], 0.5 * F.binary_cross_entropy_with_logits(dp.cls_logits, torch.zeros_like(dp.cls_logits), reduction="sum"))
    assert segment_loss()(sp, t, a)[1]["seg"] == 0
    p = pose_loss()(pp, t, a)[1]
    assert p["pose"] == 0 and p["kobj"] == 0


def _naive_seg(sp, t, a):
    """Per-image, per-positive loop (the reference's structure) as a second implementation."""
    total, npos = 0.0, 0
    hm, wm = t.masks.shape[-2:]
    for b in range(B):
        for anc in a.fg_mask[b].nonzero().flatten().tolist():
            j = int(a.gt_idx[b, anc])
            logit = (sp.coeffs[b, anc] @ sp.protos[b].reshape(32, -1)).reshape(hm, wm)
            gt = (t.masks[b] == j + 1).float()
            box = a.target_boxes[b, anc] / 64
            rows, cols = crop_bounds(box * torch.tensor([wm, hm, wm, hm]), (hm, wm))
            bce = F.binary_cross_entropy_with_logits(logit, gt, reduction="none") * rows[:, None] * cols[None, :]
            total = total + bce.mean() / ((box[2] - box[0]) * (box[3] - box[1]))
            npos += 1
    return 7.5 * total / max(npos, 1)


@settings(max_examples=8)
@given(st.integers(0, 2**16), st.tuples(st.integers(1, 5), st.integers(0, 5)))
def test_vectorised_mask_loss_matches_loop(seed, n):
    dp, sp, pp, t, a = _case(seed, n)
    _, parts = segment_loss()(sp, t, a)
    torch.testing.assert_close(parts["seg"], torch.as_tensor(_naive_seg(sp, t, a), dtype=torch.float32), rtol=1e-5, atol=1e-6)


def test_per_instance_masks_equal_overlap_masks():
    dp, sp, pp, t, a = _case(5)
    M = t.boxes.shape[1]
    per = (t.masks[:, None] == torch.arange(1, M + 1)[None, :, None, None]).float()
    t2 = t._replace(masks=per)
    torch.testing.assert_close(segment_loss()(sp, t, a)[1]["seg"], segment_loss()(sp, t2, a)[1]["seg"])


def test_two_column_keypoints_all_visible():
    dp, sp, pp, t, a = _case(7, kpt_d=2)
    loss, parts = pose_loss(kpt_shape=(17, 2))(pp, t, a)
    assert parts["kobj"] == 0 and parts["pose"] > 0
    # Same as 3-column targets with every keypoint visible (v = 2), for the location term.
    t3 = t._replace(keypoints=torch.cat((t.keypoints, torch.full_like(t.keypoints[..., :1], 2.0)), -1))
    sig = torch.full((17,), 1 / 17)
    pp3 = PosePreds(torch.cat((pp.keypoints.reshape(B, A, 17, 2), torch.zeros(B, A, 17, 1)), -1).reshape(B, A, 51))
    torch.testing.assert_close(parts["pose"], pose_loss(kpt_shape=(17, 3), sigmas=sig)(pp3, t3, a)[1]["pose"])


def test_heads_build_default_losses_and_torch_func():
    dp, sp, pp, t, a = _case(9)
    ch = (16, 32, 64)
    assert set(detect_head(num_classes=K, channels=ch).loss(dp, t, a)[1]) == {"box", "cls", "dfl"}
    assert set(segment_head(channels=ch).loss(sp, t, a)[1]) == {"seg"}
    assert set(pose_head(channels=ch).loss(pp, t, a)[1]) == {"pose", "kobj"}
    loss_fn = detect_loss(num_classes=K)

    def f(cls_logits):
        return loss_fn(DetectPreds(dp.box_dist, cls_logits), t, a)

    g, (value, parts) = torch.func.grad_and_value(f, has_aux=True)(dp.cls_logits)
    x = dp.cls_logits.clone().requires_grad_(True)
    g2 = torch.autograd.grad(f(x)[0], x)[0]
    torch.testing.assert_close(g, g2)
    assert torch.isfinite(value) and set(parts) == {"box", "cls", "dfl"}
