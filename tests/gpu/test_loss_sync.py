"""The whole loss forward + backward (assignment + detect / segment / pose losses) runs without a
host synchronisation (marker ``cuda``; run on the GPU machine)."""

from __future__ import annotations

import pytest
import torch

from yolo_func._types import DetectPreds, PosePreds, SegmentPreds
from yolo_func.assign import assign_from_detect, make_anchors
from yolo_func.losses import detect_loss, pose_loss, segment_loss
from yolo_func.structures import targets_from_flat

pytestmark = pytest.mark.cuda


def _inputs(batch=4, size=640, per_image=12, device="cuda"):
    g = torch.Generator().manual_seed(0)
    sizes = [(size // s, size // s) for s in (8, 16, 32)]
    anchors = make_anchors(sizes, (8, 16, 32), device=device)
    A, hm = anchors.points.shape[0], size // 4
    n = batch * per_image
    wh = torch.rand(n, 2, generator=g) * 0.3 + 0.02
    xy = wh / 2 + torch.rand(n, 2, generator=g) * (1 - wh)
    bi = torch.arange(batch).repeat_interleave(per_image).float()
    masks = torch.randint(0, per_image + 1, (batch, hm, hm), generator=g).float()
    kp = torch.cat((torch.rand(n, 17, 2, generator=g), torch.randint(0, 3, (n, 17, 1), generator=g).float()), -1)
    t = targets_from_flat(bi, torch.randint(0, 80, (n,), generator=g).float(), torch.cat((xy, wh), -1),
                          batch_size=batch, image_size=(size, size), masks=masks, keypoints=kp)
    t = type(t)(*(x.to(device) if x is not None else None for x in t))

    def leaf(*shape):
        return torch.randn(*shape, generator=g).to(device).requires_grad_(True)

    preds = (DetectPreds(leaf(batch, A, 64), leaf(batch, A, 80)), SegmentPreds(leaf(batch, A, 32), leaf(batch, 32, hm, hm)),
             PosePreds(leaf(batch, A, 51)))
    return preds, t, anchors


def test_loss_forward_backward_has_no_host_sync():
    (dp, sp, pp), t, anchors = _inputs()
    fns = (detect_loss(num_classes=80), segment_loss(), pose_loss(kpt_shape=(17, 3)))

    def step():
        a = assign_from_detect(dp, t, anchors)
        total = fns[0](dp, t, a)[0] + fns[1](sp, t, a)[0] + fns[2](pp, t, a)[0]
        return torch.autograd.grad(total, [*dp, *sp, *pp]), a

    step()  # warm-up (lazy CUDA init, kernels) outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        grads, a = step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert a.fg_mask.any()
    assert all(torch.isfinite(g).all() for g in grads)
