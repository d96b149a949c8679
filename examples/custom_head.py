"""A new head, written from scratch and trained with replay: FCOS-style centre-ness.

    python examples/custom_head.py                  # CPU: 128 px, batch 4, 40 steps
    python examples/custom_head.py --device cuda    # GPU: 640 px, batch 16, 1000 steps, replayed

The head predicts, for every anchor, how close the anchor lies to the centre of the object it is
assigned to (Tian et al., "FCOS", 2019, eq. 3): ``sqrt(min(l, r) / max(l, r) * min(t, b) / max(t, b))``
with l, t, r, b the distances from the anchor to the sides of its target box. It reads the shared
task-aligned :class:`yolo_func.Assignment` (no assignment of its own), is trained with a BCE on the
positive anchors, and at prediction time multiplies the class scores (``decode`` appends one channel
to the reference-layout inference output). Swapping it in is one ``Model.with_heads`` call; the
training step needs nothing else: each head gets its own VJP and loss, and the feature gradients of
all heads are summed before the one network backward.
"""

import argparse
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F

from yolo_func import Anchors, Assignment, Head, Inference, Targets, yolov8
from yolo_func.data import TrainLoader, ValLoader, builtin_dataset
from yolo_func.eval import postprocess
from yolo_func.heads import flatten_levels, multi_level
from yolo_func.io import save_checkpoint
from yolo_func.models import get_scale, neck_channels
from yolo_func.optim import adamw
from yolo_func.train import Batch, init_train_state
from yolo_func.train.metrics import fetch_metrics
from yolo_func.train.replay import ReplayTrainStep


class CenternessPreds(NamedTuple):
    """logits: float[B, A] raw centre-ness logits (one per anchor, anchors level-major)."""

    logits: torch.Tensor


def centerness_targets(assignment: Assignment) -> torch.Tensor:
    """float[B, A] in [0, 1]: FCOS centre-ness of each anchor in its assigned box (0 on background)."""
    centres = assignment.anchors.points * assignment.anchors.strides  # [A, 2] pixels
    lt = centres - assignment.target_boxes[..., :2]  # [B, A, 2] distances to the left and top sides
    rb = assignment.target_boxes[..., 2:] - centres  # [B, A, 2] to the right and bottom sides
    lt, rb = lt.clamp_min(1e-6), rb.clamp_min(1e-6)  # an anchor on (or outside) a side: 0, never NaN
    ratio = (torch.minimum(lt, rb) / torch.maximum(lt, rb)).prod(-1)
    return torch.where(assignment.fg_mask, ratio.sqrt(), 0.0)


def centerness_head(channels, *, hidden: int = 64, gain: float = 1.0) -> Head:
    """A centre-ness head over the neck's (P3, P4, P5) with ``channels`` channels; ``gain`` scales its loss."""
    branch = multi_level(channels, hidden, 1)  # per level: conv3x3-BN-SiLU x2, then a 1x1 conv -> 1 channel

    def init(gen: torch.Generator):
        params, state = branch.init(gen)
        for level in params.values():
            level["pred"]["bias"].fill_(-2.0)  # start at p ~ 0.12: most anchors are background
        return params, state

    def apply(params, state, feats, *, train: bool):
        maps, new_state = branch.apply(params, state, feats, train=train)
        return CenternessPreds(flatten_levels(maps)[..., 0]), new_state

    def loss(preds: CenternessPreds, targets: Targets, assignment: Assignment):
        del targets  # the assignment already holds each anchor's target box
        bce = F.binary_cross_entropy_with_logits(preds.logits, centerness_targets(assignment), reduction="none")
        fg = assignment.fg_mask.to(bce.dtype)
        value = (bce * fg).sum() / fg.sum().clamp_min(1)  # mean over positives; no host sync, static shapes
        return gain * value, {"bce": value.detach()}

    def decode(preds: CenternessPreds, anchors: Anchors):
        return preds.logits.sigmoid().unsqueeze(1)  # float[B, 1, A]: appended after detect's 4 + K channels

    return Head(init, apply, loss, decode)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--imgsz", type=int, help="square training size (default 640 on CUDA, 128 on the CPU)")
    p.add_argument("--batch", type=int, help="batch size (default 16 on CUDA, 4 on the CPU)")
    p.add_argument("--steps", type=int, help="training steps (default 1000 on CUDA, 40 on the CPU)")
    p.add_argument("--images", type=int, help="built-in train images (default 256)")
    p.add_argument("--out", default="runs/examples/custom_head", help="folder for last.pt")
    a = p.parse_args(argv)
    gpu = torch.device(a.device).type == "cuda"
    imgsz, batch, steps = a.imgsz or (640 if gpu else 128), a.batch or (16 if gpu else 4), a.steps or (1000 if gpu else 40)

    ds = builtin_dataset("detect", "train", num_images=a.images)
    loader = TrainLoader(ds, batch_size=batch, image_size=imgsz, workers=4 if gpu else 0, seed=0)
    stock = yolov8("n", num_classes=len(ds.names))
    model = stock.with_heads({**stock.heads, "centerness": centerness_head(neck_channels(get_scale("n")))})
    tx = adamw(1e-3, weight_decay=5e-4)  # any yolo_func.optim transform works; yolo_sgd is the reference recipe
    ts = init_train_state(model, tx, torch.Generator().manual_seed(0), device=a.device)
    step = ReplayTrainStep(model, tx, capture="network" if gpu else "none")  # each head: its own VJP

    history = []
    while len(history) < steps:
        for b in loader:
            images = b.images.to(a.device) if gpu else b.images.contiguous()
            targets = Targets(*(None if t is None else t.to(a.device) for t in b.targets))
            ts, metrics = step(ts, Batch(images, targets))
            history.append({k: metrics[k].detach().clone() for k in
                            ("loss/detect/box", "loss/detect/cls", "loss/centerness/bce",
                             "feat_grad_norm/detect", "feat_grad_norm/centerness", "finite")})
            if len(history) % 10 == 0 or len(history) == steps:
                m = fetch_metrics(history[-1])
                print(f"step {len(history):5d}  " + "  ".join(f"{k} {v:.4f}" for k, v in m.items()), flush=True)
            if len(history) == steps:
                break
    history = [fetch_metrics(h) for h in history]

    # prediction: class scores times centre-ness (the extra channel decode appended), then NMS
    val = builtin_dataset("detect", "val", num_images=a.images and max(a.images // 2, 1))
    vb = next(iter(ValLoader(val, batch_size=1, image_size=imgsz, workers=0)))  # letterboxed, not augmented
    with torch.no_grad():
        y = model.predict(ts.params, ts.state, vb.images.to(a.device).float().contiguous() / 255).y
    K = model.num_classes
    scored = torch.cat([y[:, :4], y[:, 4:4 + K] * y[:, 4 + K:]], 1)  # y[:, 4 + K:] is float[B, 1, A]
    dets = postprocess(Inference(scored, None), conf=0.05, num_classes=K)[0]
    print(f"{len(dets.boxes)} detections on a val image; top scores {dets.scores[:5].tolist()}")
    out = Path(a.out)
    save_checkpoint(out / "last.pt", {"params": ts.params, "state": ts.state}, config={"scale": "n", "heads": list(model.heads)})
    return {"history": history, "detections": dets, "train_state": ts, "model": model, "checkpoint": out / "last.pt"}


if __name__ == "__main__":
    main()
