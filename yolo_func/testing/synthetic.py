"""Synthetic training batches with static shapes (tests, parity runs and benchmarks).

Not a data pipeline: boxes are random rectangles, instance masks are the boxes' inscribed ellipses
drawn into the reference's overlap-indexed map (larger instances first, so smaller ones win
overlaps), keypoints lie inside their box. Everything is drawn from one seeded CPU generator and
then moved to the device, so a seed gives the same batch on any machine.
"""

from __future__ import annotations

import torch

from yolo_func.structures import Targets
from yolo_func.structures import Batch

__all__ = ["synthetic_batch"]


def synthetic_batch(
    task: str,
    batch_size: int,
    image_size: int | tuple[int, int] = 640,
    *,
    num_classes: int = 80,
    max_boxes: int = 8,
    min_boxes: int = 1,
    kpt_shape: tuple[int, int] = (17, 3),
    seed: int = 0,
    device: torch.device | str = "cpu",
) -> Batch:
    """A random batch for ``task`` in {"detect", "segment", "pose"}.

    Args:
      batch_size: B.
      image_size: H = W, or (H, W); multiples of 32.
      num_classes: classes are drawn from ``[0, num_classes)``.
      max_boxes: M (the padded width); each image gets ``min_boxes..max_boxes`` real targets.
      kpt_shape: (P, D) for pose.
      seed: CPU generator seed.

    Returns:
      ``Batch(images float[B, 3, H, W] in [0, 1], Targets(boxes float[B, M, 4] xyxy px, classes
      int64[B, M], valid bool[B, M], masks int64[B, H/4, W/4] (segment), keypoints
      float[B, M, P, 3] (pose)))``.
    """
    if task not in ("detect", "segment", "pose"):
        raise ValueError(f"[yolo_func] synthetic_batch: unknown task {task!r}")
    H, W = (image_size, image_size) if isinstance(image_size, int) else image_size
    B, M = batch_size, max_boxes
    g = torch.Generator().manual_seed(seed)
    images = torch.rand(B, 3, H, W, generator=g)
    counts = torch.randint(min_boxes, M + 1, (B,), generator=g)
    valid = torch.arange(M)[None, :] < counts[:, None]
    wh = (0.05 + 0.45 * torch.rand(B, M, 2, generator=g)) * torch.tensor([W, H])
    c = torch.rand(B, M, 2, generator=g) * (torch.tensor([W, H]) - wh) + wh / 2
    boxes = torch.cat((c - wh / 2, c + wh / 2), -1) * valid[..., None]
    classes = torch.randint(0, num_classes, (B, M), generator=g) * valid
    masks = keypoints = None
    if task == "segment":
        hm, wm = H // 4, W // 4
        ys = (torch.arange(hm) + 0.5)[:, None]
        xs = (torch.arange(wm) + 0.5)[None, :]
        masks = torch.zeros(B, hm, wm, dtype=torch.int64)
        area = (wh[..., 0] * wh[..., 1]) * valid
        order = area.argsort(1, descending=True)
        for b in range(B):  # data generation, not the training step
            for j in order[b].tolist():
                if not valid[b, j]:
                    continue
                cx, cy = c[b, j, 0] / 4, c[b, j, 1] / 4
                rx, ry = wh[b, j, 0] / 8, wh[b, j, 1] / 8
                inside = ((xs - cx) / rx) ** 2 + ((ys - cy) / ry) ** 2 <= 1
                masks[b][inside] = j + 1
    if task == "pose":
        P, D = kpt_shape
        rel = torch.rand(B, M, P, 2, generator=g)
        xy = boxes[:, :, None, :2] + rel * (boxes[:, :, None, 2:] - boxes[:, :, None, :2])
        vis = torch.randint(0, 3, (B, M, P, 1), generator=g).float() * valid[..., None, None]
        keypoints = torch.cat((xy * (vis > 0), vis), -1)
    targets = Targets(boxes, classes.long(), valid, masks, keypoints)
    batch = Batch(images, targets)
    return Batch(batch.images.to(device), Targets(*(None if x is None else x.to(device) for x in targets)))
