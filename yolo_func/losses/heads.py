"""Head-level losses: pure functions ``(preds, targets, assignment) -> (scalar, parts)``.

Return convention (all three heads; REFERENCE.md §2.5, trap T12):

* ``parts`` are the *gained, per-batch* items, equal to the reference's loss items
  (``box = 7.5 * L_box`` ...), detached float32 scalars.
* the scalar is ``B * sum(parts)`` computed with gradient: exactly the quantity the reference
  trainer backpropagates (``sum(loss_vector)``), so gradients equal the reference's. The
  segmentation (detect + segment) and pose (detect + pose) totals are the sums of the heads'
  scalars; the sum of their gradients is the reference's gradient.

All normalisers are on-device ``clamp_min(1)`` tensors; no host sync, no boolean-mask indexing,
no Python branch on tensor values, so the losses can be captured in a CUDA graph. Losses are
computed in float32 whatever the prediction dtype (autocast only affects the heads and the
mask matmul).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from yolo_func._types import Assignment, DetectPreds, PosePreds, SegmentPreds, Targets
from yolo_func.losses.cls import cls_loss
from yolo_func.losses.dfl import dfl_loss
from yolo_func.losses.keypoint import keypoint_losses, keypoint_sigmas
from yolo_func.losses.mask import mask_loss
from yolo_func.losses.precision import at_least_f32
from yolo_func.structures.boxes import bbox2dist, dfl_expectation, dist2bbox
from yolo_func.structures.ciou import ciou

__all__ = ["LossGains", "detect_loss", "segment_loss", "pose_loss", "LossFn"]

#: ``(preds, targets, assignment) -> (scalar float[], parts dict[str, float[]])``.
LossFn = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]


class LossGains(NamedTuple):
    """Loss gains (reference ``default.yaml``: box 7.5, cls 0.5, dfl 1.5, pose 12.0, kobj 1.0).

    The segmentation term uses the *box* gain (trap T13).

    Example:
      >>> from yolo_func.losses import LossGains
      >>> LossGains()
      LossGains(box=7.5, cls=0.5, dfl=1.5, pose=12.0, kobj=1.0)
      >>> LossGains(cls=1.0).cls
      1.0
    """

    box: float = 7.5
    cls: float = 0.5
    dfl: float = 1.5
    pose: float = 12.0
    kobj: float = 1.0


def _batch(x: torch.Tensor) -> int:
    return int(x.shape[0])


def detect_loss(*, num_classes: int, reg_max: int = 16, gains: LossGains = LossGains()) -> LossFn:
    """The YOLOv8 detection loss (ultralytics ``v8DetectionLoss``; REFERENCE.md §2.4-2.5).

    ``S = max(sum target_scores, 1)``; ``L_cls = sum BCE / S``; per positive anchor weight
    ``w = sum_c target_scores``; ``L_box = sum_pos (1 - CIoU(pred, target)) w / S`` in grid
    units; ``L_dfl = sum_pos DFL(box_dist, ltrb target clamped to R - 1.01) w / S``.

    Args:
      num_classes: K (reference ``nc``).
      reg_max: R DFL bins (16).
      gains: :class:`LossGains` (box, cls, dfl used).

    Returns:
      ``loss(preds: DetectPreds, targets: Targets, assignment: Assignment) -> (scalar, parts)``
      with ``preds.box_dist float[B, A, 4R]``, ``preds.cls_logits float[B, A, K]``; parts
      ``{"box", "cls", "dfl"}`` are the gained per-batch items (detached float[]), the scalar is
      ``B * (box + cls + dfl)`` with gradient. No positives: box = dfl = 0, cls finite.

    Example:
      >>> loss_fn = detect_loss(num_classes=80)
    """

    def loss(preds: DetectPreds, targets: Targets, assignment: Assignment):
        with torch.autocast(preds.box_dist.device.type, enabled=False):  # float32 maths (trap T20)
            return _loss(preds, targets, assignment)

    def _loss(preds: DetectPreds, targets: Targets, assignment: Assignment):
        box_dist, logits = at_least_f32(preds.box_dist), at_least_f32(preds.cls_logits)
        B, A, K = logits.shape
        if K != num_classes or box_dist.shape[-1] != 4 * reg_max:
            raise ValueError(f"[yolo_func] detect loss: expected cls_logits [B, A, {num_classes}] and box_dist "
                             f"[B, A, {4 * reg_max}], got {tuple(logits.shape)} and {tuple(box_dist.shape)}")
        anchors = assignment.anchors
        points, strides = anchors.points.to(logits.dtype), anchors.strides.to(logits.dtype)
        fg = assignment.fg_mask
        scores = assignment.target_scores.to(logits.dtype)
        norm = scores.sum().clamp(min=1)
        l_cls = cls_loss(logits, scores, norm)
        weight = torch.where(fg, scores.sum(-1), torch.zeros((), device=logits.device))  # [B, A]
        pred_boxes = dist2bbox(dfl_expectation(box_dist, reg_max), points)  # grid units
        tgt_boxes = assignment.target_boxes.to(logits.dtype) / strides
        ciou_v = ciou(pred_boxes, tgt_boxes)
        l_box = ((1.0 - ciou_v) * weight).sum() / norm
        tgt_ltrb = bbox2dist(points, tgt_boxes, reg_max - 1)
        l_dfl = (dfl_loss(box_dist, tgt_ltrb, reg_max=reg_max) * weight).sum() / norm
        box, cls, dfl = gains.box * l_box, gains.cls * l_cls, gains.dfl * l_dfl
        total = (box + cls + dfl) * B
        return total, {"box": box.detach(), "cls": cls.detach(), "dfl": dfl.detach()}

    return loss


def segment_loss(*, gains: LossGains = LossGains(), topk: int = 10, max_positives: int | None = None) -> LossFn:
    """The YOLOv8 instance-mask loss (the mask part of ultralytics ``v8SegmentationLoss``;
    REFERENCE.md §2.6), vectorised over images and positives (:func:`yolo_func.losses.mask.mask_loss`).

    ``L_seg = sum over positive anchors of mean_pixels(crop(BCE(coeffs @ protos, G))) / area_n``
    divided by the number of positives of the batch, times the *box* gain. The image size is
    ``4 x`` the prototype size (prototypes are at stride 4); if the target masks have another size
    the prototypes are bilinearly resized to it (``align_corners=False``).

    Args:
      gains: :class:`LossGains` (``box`` is the seg gain).
      topk: the assigner's top-k; the static positive slots per image are ``min(A, M * topk)``.
      max_positives: override the slot count (must be >= the largest positive count per image).

    Returns:
      ``loss(preds: SegmentPreds, targets: Targets, assignment: Assignment) -> (scalar, parts)``
      with ``preds.coeffs float[B, A, NM]``, ``preds.protos float[B, NM, H/4, W/4]`` and
      ``targets.masks`` (overlap int64[B, Hm, Wm] or per-instance float[B, M, Hm, Wm]); parts
      ``{"seg"}`` (the gained per-batch item, detached), scalar ``B * seg`` with gradient.
      No positives: seg = 0.

    Example:
      >>> import torch
      >>> from yolo_func import yolov8
      >>> from yolo_func.assign import assign_from_detect
      >>> from yolo_func.testing.synthetic import synthetic_batch
      >>> model = yolov8("n", task="segment", num_classes=5)
      >>> params, state = model.init(torch.Generator().manual_seed(0))
      >>> batch = synthetic_batch("segment", 2, 64, num_classes=5, max_boxes=4)
      >>> feats, _ = model.features(params["network"], state["network"], batch.images.float() / 255, train=True)
      >>> preds, _ = model.apply(params, state, batch.images.float() / 255, train=True)
      >>> a = assign_from_detect(preds["detect"], batch.targets, model.anchors(feats))
      >>> from yolo_func.losses import segment_loss
      >>> loss, parts = segment_loss()(preds["segment"], batch.targets, a)
      >>> loss.shape, sorted(parts)
      (torch.Size([]), ['seg'])
    """

    def loss(preds: SegmentPreds, targets: Targets, assignment: Assignment):
        coeffs, protos = preds.coeffs, preds.protos
        if targets.masks is None:
            raise ValueError("[yolo_func] segment loss: targets.masks is None; build the targets with masks")
        B, A, NM = coeffs.shape
        hp, wp = protos.shape[-2:]
        image_size = (4 * hp, 4 * wp)
        hm, wm = targets.masks.shape[-2:]
        if (hm, wm) != (hp, wp):
            protos = F.interpolate(protos, size=(hm, wm), mode="bilinear", align_corners=False)
        M = targets.boxes.shape[1]
        slots = max_positives if max_positives is not None else M * topk
        if M == 0:  # static shape: no targets, no positives
            total = coeffs.float().sum() * 0 + protos.float().sum() * 0
            return total, {"seg": total.detach()}
        loss_sum, num_pos = mask_loss(coeffs, protos, targets.masks, assignment.fg_mask, assignment.gt_idx,
                                      assignment.target_boxes, image_size=image_size, num_slots=slots)
        seg = gains.box * loss_sum / num_pos.clamp(min=1)
        return seg * B, {"seg": seg.detach()}

    return loss


def pose_loss(
    *, kpt_shape: tuple[int, int] = (17, 3), gains: LossGains = LossGains(), sigmas: torch.Tensor | None = None
) -> LossFn:
    """The YOLOv8 keypoint losses (the pose part of ultralytics ``v8PoseLoss``; REFERENCE.md §2.7).

    Args:
      kpt_shape: (P, D) with D = 2 or 3.
      gains: :class:`LossGains` (``pose`` 12.0, ``kobj`` 1.0).
      sigmas: float[P] OKS sigmas; default COCO / 10 for (17, 3), else ``1 / P`` (the reference's rule).

    Returns:
      ``loss(preds: PosePreds, targets: Targets, assignment: Assignment) -> (scalar, parts)``
      with ``preds.keypoints float[B, A, P*D]`` and ``targets.keypoints float[B, M, P, 2|3]``
      (pixels); parts ``{"pose", "kobj"}`` (gained per-batch items, detached), scalar
      ``B * (pose + kobj)`` with gradient. No positives: both 0.

    Example:
      >>> import torch
      >>> from yolo_func import yolov8
      >>> from yolo_func.assign import assign_from_detect
      >>> from yolo_func.testing.synthetic import synthetic_batch
      >>> model = yolov8("n", task="pose", num_classes=1)
      >>> params, state = model.init(torch.Generator().manual_seed(0))
      >>> batch = synthetic_batch("pose", 2, 64, num_classes=1, max_boxes=4, kpt_shape=(17, 3))
      >>> feats, _ = model.features(params["network"], state["network"], batch.images.float() / 255, train=True)
      >>> preds, _ = model.apply(params, state, batch.images.float() / 255, train=True)
      >>> a = assign_from_detect(preds["detect"], batch.targets, model.anchors(feats))
      >>> from yolo_func.losses import pose_loss
      >>> loss, parts = pose_loss(kpt_shape=(17, 3))(preds["pose"], batch.targets, a)
      >>> loss.shape, sorted(parts)
      (torch.Size([]), ['kobj', 'pose'])
    """
    P, D = int(kpt_shape[0]), int(kpt_shape[1])
    sig = keypoint_sigmas((P, D)) if sigmas is None else torch.as_tensor(sigmas, dtype=torch.float32)
    if sig.shape != (P,):
        raise ValueError(f"[yolo_func] pose_loss: sigmas must be float[{P}], got shape {tuple(sig.shape)}")

    sig_cache: dict = {}  # sigmas per (device): one host-to-device copy, on the first call only

    def loss(preds: PosePreds, targets: Targets, assignment: Assignment):
        with torch.autocast(preds.keypoints.device.type, enabled=False):
            return _loss(preds, targets, assignment)

    def _loss(preds: PosePreds, targets: Targets, assignment: Assignment):
        raw = at_least_f32(preds.keypoints)
        if raw.device not in sig_cache:
            sig_cache[raw.device] = sig.to(raw.device)
        B, A, C = raw.shape
        if C != P * D:
            raise ValueError(f"[yolo_func] pose loss: expected keypoints float[B, A, {P * D}], got {tuple(raw.shape)}")
        if targets.keypoints is None:
            raise ValueError("[yolo_func] pose loss: targets.keypoints is None; build the targets with keypoints")
        kp = targets.keypoints.to(raw.dtype)
        M = kp.shape[1]
        if M == 0:
            total = raw.sum() * 0
            return total, {"pose": total.detach(), "kobj": total.detach()}
        gt = kp.gather(1, assignment.gt_idx[:, :, None, None].expand(B, A, P, kp.shape[-1]))
        anchors = assignment.anchors
        l_pose, l_kobj = keypoint_losses(raw.reshape(B, A, P, D), gt, assignment.target_boxes.to(raw.dtype),
                                         assignment.fg_mask, anchors.points.to(raw.dtype), anchors.strides.to(raw.dtype),
                                         sig_cache[raw.device])
        pose, kobj = gains.pose * l_pose, gains.kobj * l_kobj
        return (pose + kobj) * B, {"pose": pose.detach(), "kobj": kobj.detach()}

    return loss
