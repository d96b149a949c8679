"""Random loss cases shared by the loss parity test, the golden recorder and the golden test.

A case is a dict of numpy arrays in the reference's layout: predictions ``boxes [B, 64, A]``,
``scores [B, nc, A]`` (+ ``mask_coefficient [B, 32, A]``, ``proto [B, 32, H/4, W/4]`` | ``kpts
[B, 51, A]``) and the flat batch (``batch_idx``, ``cls``, ``bboxes`` normalised xywh, + overlap
``masks [B, H/4, W/4]`` | ``keypoints [N, 17, 3]``). Predictions are rounded to float16 values (stored
as float16, exact in float32) so goldens stay small. Images: zero targets, one target, a crowded
image (many targets on few anchors), and a mix with tiny (1.5-6 px) boxes. Predicted boxes are kept
near their anchors, and a target with fewer than topk positive-metric anchors has no zero-metric
candidate (so no candidate is picked from the zero ties of the top-k, trap T9); the generator checks this with our own candidate / metric code and redraws.
"""

from __future__ import annotations

import numpy as np
import torch

from yolo_func._types import Anchors, Assignment, DetectPreds, PosePreds, SegmentPreds, Targets
from yolo_func.assign import assign_from_detect, make_anchors
from yolo_func.assign.tal import _in_box, _metrics
from yolo_func.losses import detect_loss, pose_loss, segment_loss
from yolo_func.losses.dfl import dfl_expectation
from yolo_func.losses.box import bbox_iou, dist2bbox
from yolo_func.structures import targets_from_flat

TASKS = ("detect", "segment", "pose")
NUM_CLASSES = {"detect": 3, "segment": 2, "pose": 1}
STRIDES = (8, 16, 32)
REG_MAX = 16
NM = 32
KPT = (17, 3)


def _grid(image_size):
    H, W = image_size
    return [(H // s, W // s) for s in STRIDES]


def anchors_for(image_size) -> Anchors:
    return make_anchors(_grid(image_size), STRIDES)


def _boxes(rng, n, H, W, kind):
    """n xyxy pixel boxes inside the image."""
    out = []
    cx0, cy0 = rng.uniform(16, W - 16), rng.uniform(16, H - 16)
    for _ in range(n):
        if kind == "tiny":
            w, h = rng.uniform(1.5, 6.0, 2)
        elif kind == "crowded":
            w, h = rng.uniform(6.0, 22.0, 2)
        else:
            w, h = rng.uniform(8.0, 0.6 * W), rng.uniform(8.0, 0.6 * H)
        if kind == "crowded":
            cx, cy = cx0 + rng.uniform(-10, 10), cy0 + rng.uniform(-10, 10)
        else:
            cx, cy = rng.uniform(w / 2 + 0.5, W - w / 2 - 0.5), rng.uniform(h / 2 + 0.5, H - h / 2 - 0.5)
        x1, y1 = max(cx - w / 2, 0.5), max(cy - h / 2, 0.5)
        x2, y2 = min(cx + w / 2, W - 0.5), min(cy + h / 2, H - 0.5)
        out.append((x1, y1, x2, y2))
    return np.asarray(out, dtype=np.float64).reshape(n, 4)


def _f16(x):
    return np.asarray(x, dtype=np.float32).astype(np.float16)


def make_case(task: str, seed: int, *, image_size=(64, 96), empty: bool = False) -> dict[str, np.ndarray]:
    """One random case (see the module docstring). ``empty``: no targets in the whole batch."""
    rng = np.random.default_rng(seed)
    H, W = image_size
    nc = NUM_CLASSES[task]
    A = sum(h * w for h, w in _grid(image_size))
    plan = [[], [], [], []] if empty else [[], ["normal"], ["crowded"] * int(rng.integers(8, 13)),
                                          ["tiny"] * 2 + ["normal"] * int(rng.integers(1, 4)) + ["tiny"]]
    B = len(plan)
    batch_idx, boxes = [], []
    for b, kinds in enumerate(plan):
        for k in kinds:
            boxes.append(_boxes(rng, 1, H, W, k)[0])
            batch_idx.append(b)
    boxes = np.asarray(boxes, dtype=np.float64).reshape(-1, 4)
    n = len(batch_idx)
    xywh = np.concatenate([(boxes[:, :2] + boxes[:, 2:]) / 2, boxes[:, 2:] - boxes[:, :2]], 1) / [W, H, W, H]
    case = {
        "image_size": np.asarray(image_size, dtype=np.int64),
        "batch_idx": np.asarray(batch_idx, dtype=np.float32),
        "cls": rng.integers(0, nc, (n, 1)).astype(np.float32),
        "bboxes": xywh.astype(np.float32),
        "scores": _f16(rng.normal(-1.0, 2.0, (B, nc, A))),
    }
    if task == "segment":
        hm, wm = H // 4, W // 4
        masks = np.zeros((B, hm, wm), dtype=np.uint8)
        counters = np.zeros(B, dtype=np.int64)
        for (x1, y1, x2, y2), b in zip(boxes / 4, batch_idx):
            counters[b] += 1
            yy, xx = np.mgrid[0:hm, 0:wm] + 0.5
            cx, cy, rx, ry = (x1 + x2) / 2, (y1 + y2) / 2, max((x2 - x1) / 2, 0.5), max((y2 - y1) / 2, 0.5)
            inside = ((xx - cx) / rx) ** 2 + ((yy - cy) / ry) ** 2 <= 1.0 + rng.uniform(0, 0.5)
            masks[b][inside] = counters[b]
        case["masks"] = masks
        case["mask_coefficient"] = _f16(rng.normal(0, 1.0, (B, NM, A)))
        case["proto"] = _f16(np.log1p(np.exp(rng.normal(0, 1.0, (B, NM, hm, wm)))) - 0.3)
    if task == "pose":
        P = KPT[0]
        u = rng.uniform(0, 1, (n, P, 2))
        kx = (boxes[:, None, 0] + u[..., 0] * (boxes[:, None, 2] - boxes[:, None, 0])) / W
        ky = (boxes[:, None, 1] + u[..., 1] * (boxes[:, None, 3] - boxes[:, None, 1])) / H
        v = rng.choice([0.0, 1.0, 2.0], (n, P), p=[0.25, 0.25, 0.5])
        case["keypoints"] = np.stack([kx, ky, v], -1).astype(np.float32)
        case["kpts"] = _f16(rng.normal(0, 0.7, (B, P * KPT[1], A)))
    # Box logits: each anchor inside a (16 px enlarged) target predicts that target's box, jittered,
    # other anchors a random small box; redraw until no target with fewer than topk positive
    # metrics has a zero-metric candidate (trap T9).
    anchors = anchors_for(image_size)
    apx = (anchors.points * anchors.strides).numpy().astype(np.float64)  # [A, 2]
    st = anchors.strides.numpy()[:, 0].astype(np.float64)
    bins = np.arange(REG_MAX)
    for attempt in range(200):
        dist = rng.uniform(0.5, 3.0, (B, A, 4))
        for b in range(B):
            sel = [i for i, bb in enumerate(batch_idx) if bb == b]
            for i in rng.permutation(sel) if sel else []:
                x1, y1, x2, y2 = boxes[i]
                cx, cy = (x1 + x2) / 2, (y1 + y2) / 2
                w, h = max(x2 - x1, 16.0), max(y2 - y1, 16.0)
                inside = (np.abs(apx[:, 0] - cx) < w / 2) & (np.abs(apx[:, 1] - cy) < h / 2)
                ltrb = np.stack([apx[:, 0] - x1, apx[:, 1] - y1, x2 - apx[:, 0], y2 - apx[:, 1]], -1) / st[:, None]
                ltrb = np.clip(ltrb * rng.uniform(0.85, 1.15, ltrb.shape), 0.05, REG_MAX - 1.5)
                take = inside
                dist[b, take] = ltrb[take]
        logits = -((bins - dist[..., None]) ** 2) / (2 * 0.7**2) + rng.normal(0, 0.3, (B, A, 4, REG_MAX))
        case["boxes"] = _f16(logits.reshape(B, A, 4 * REG_MAX).transpose(0, 2, 1))
        if not _near_clamp(case, task):
            break
    else:  # pragma: no cover
        raise RuntimeError(f"could not draw a clamp-robust case for seed {seed}")
    return case


def _near_clamp(case, task) -> bool:
    """True when an in-box candidate's CIoU is within 1e-4 of the clamp at 0 (its metric could be
    zero in one implementation and tiny in the other, changing the top-k tie pattern)."""
    preds, targets, anchors = ours_inputs(case, task)[:3]
    if targets.boxes.shape[1] == 0:
        return False
    dist = dfl_expectation(preds.box_dist.float(), REG_MAX)
    boxes = dist2bbox(dist, anchors.points) * anchors.strides
    cand = _in_box(anchors.points * anchors.strides, targets.boxes, targets.valid, 16.0, 1e-9)
    u = bbox_iou(targets.boxes[:, :, None], boxes[:, None], kind="ciou")
    return bool((cand & (u.abs() < 1e-4)).any())


def _has_zero_candidates(case, task) -> bool:
    preds, targets, anchors = ours_inputs(case, task)[:3]
    if targets.boxes.shape[1] == 0:
        return False
    dist = dfl_expectation(preds.box_dist.float(), REG_MAX)
    boxes = dist2bbox(dist, anchors.points) * anchors.strides
    cand, _, align = _metrics(preds.cls_logits.float().sigmoid(), boxes, anchors.points * anchors.strides, targets,
                              alpha=0.5, beta=6.0, eps=1e-9, enlarge_to=16.0)
    # A tie matters only when a target has fewer than topk anchors with a positive metric (the
    # top-k is then filled with zero-metric anchors in tie order) and one of those is a candidate.
    short = (align > 0).sum(-1) < 10  # [B, M]
    zero_cand = (cand & (align <= 0)).any(-1)
    return bool((short & zero_cand & targets.valid).any())


def ours_inputs(case, task, *, requires_grad=False):
    """(detect preds, targets, anchors, head preds, leaves) from a case, our layout (float32)."""
    image_size = tuple(int(v) for v in case["image_size"])
    B = case["boxes"].shape[0]
    leaves = {k: torch.tensor(case[k], dtype=torch.float32).requires_grad_(requires_grad)
              for k in ("boxes", "scores", "mask_coefficient", "proto", "kpts") if k in case}
    preds = DetectPreds(leaves["boxes"].transpose(1, 2), leaves["scores"].transpose(1, 2))
    masks = torch.tensor(case["masks"].astype(np.int64)) if "masks" in case else None
    kpts = torch.tensor(case["keypoints"]) if "keypoints" in case else None
    targets = targets_from_flat(torch.tensor(case["batch_idx"]), torch.tensor(case["cls"]), torch.tensor(case["bboxes"]),
                                batch_size=B, image_size=image_size, masks=masks, keypoints=kpts)
    head = None
    if task == "segment":
        head = SegmentPreds(leaves["mask_coefficient"].transpose(1, 2), leaves["proto"])
    elif task == "pose":
        head = PosePreds(leaves["kpts"].transpose(1, 2))
    return preds, targets, anchors_for(image_size), head, leaves


def run_ours(case, task) -> dict[str, np.ndarray]:
    """Our loss vector in the reference's order (x B), items, and gradients of sum(vector)."""
    preds, targets, anchors, head, leaves = ours_inputs(case, task, requires_grad=True)
    B = preds.box_dist.shape[0]
    assignment: Assignment = assign_from_detect(preds, targets, anchors)
    total, parts = detect_loss(num_classes=NUM_CLASSES[task])(preds, targets, assignment)
    if task == "segment":
        t2, p2 = segment_loss()(head, targets, assignment)
        items = [parts["box"], p2["seg"], parts["cls"], parts["dfl"], torch.zeros(())]
    elif task == "pose":
        t2, p2 = pose_loss(kpt_shape=KPT)(head, targets, assignment)
        items = [parts["box"], p2["pose"], p2["kobj"], parts["cls"], parts["dfl"]]
    else:
        t2, items = torch.zeros(()), [parts["box"], parts["cls"], parts["dfl"]]
    total = total + t2
    names = list(leaves)
    grads = torch.autograd.grad(total, [leaves[k] for k in names], allow_unused=True)
    out = {"items": torch.stack(items).numpy(), "vector": (torch.stack(items) * B).numpy(), "total": total.detach().numpy()}
    for k, g in zip(names, grads):
        out[f"grad_{k}"] = (torch.zeros_like(leaves[k]) if g is None else g).numpy()
    return out


_REF_MODELS: dict = {}


def reference_criterion(task):
    """The reference criterion (black box, ORACLE.md), cached per task."""
    if task not in _REF_MODELS:
        from ultralytics.cfg import get_cfg
        from ultralytics.nn.tasks import DetectionModel, PoseModel, SegmentationModel

        cls, yaml = {"detect": (DetectionModel, "yolov8n.yaml"), "segment": (SegmentationModel, "yolov8n-seg.yaml"),
                     "pose": (PoseModel, "yolov8n-pose.yaml")}[task]
        ref = cls(yaml, nc=NUM_CLASSES[task], verbose=False)
        ref.args = get_cfg()
        _REF_MODELS[task] = ref
    return _REF_MODELS[task].init_criterion()


def run_reference(case, task) -> dict[str, np.ndarray]:
    """The reference's loss vector, items and gradients of sum(vector) w.r.t. the predictions."""
    crit = reference_criterion(task)
    B = case["boxes"].shape[0]
    leaves = {k: torch.tensor(case[k], dtype=torch.float32).requires_grad_(True)
              for k in ("boxes", "scores", "mask_coefficient", "proto", "kpts") if k in case}
    feats = [torch.zeros(B, 1, h, w) for h, w in _grid(tuple(int(v) for v in case["image_size"]))]
    raw = dict(leaves, feats=feats)
    batch = {"batch_idx": torch.tensor(case["batch_idx"]), "cls": torch.tensor(case["cls"]),
             "bboxes": torch.tensor(case["bboxes"])}
    if "masks" in case:
        batch["masks"] = torch.tensor(case["masks"].astype(np.float32))
    if "keypoints" in case:
        batch["keypoints"] = torch.tensor(case["keypoints"])
    vec, items = crit(raw, batch)
    names = list(leaves)
    grads = torch.autograd.grad(vec.sum(), [leaves[k] for k in names], allow_unused=True)
    out = {"vector": vec.detach().numpy(), "items": (vec.detach() / B).numpy(), "total": vec.sum().detach().numpy()}
    for k, g in zip(names, grads):
        out[f"grad_{k}"] = (torch.zeros_like(leaves[k]) if g is None else g).numpy()
    return out


def golden_cases():
    """(name, task, case) of the committed goldens: per task two random batches (64x96 and 96x64)
    and an empty one."""
    for task in TASKS:
        for i, seed in enumerate((11, 13)):
            size = (64, 96) if i == 0 else (96, 64)
            yield f"{task}_{i}", task, make_case(task, 1000 * TASKS.index(task) + seed, image_size=size)
        yield f"{task}_empty", task, make_case(task, 99, image_size=(64, 64), empty=True)


def projections(x: np.ndarray, seed: int, n: int = 4) -> tuple[np.ndarray, np.ndarray]:
    """``n`` random +-1 directions for a gradient tensor and the projections onto them (float64)."""
    r = np.random.default_rng(seed).choice(np.array([-1, 1], dtype=np.int8), (n, x.size))
    return r, r.astype(np.float64) @ x.reshape(-1).astype(np.float64)

