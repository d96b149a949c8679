"""PNG plots of a run: loss and metric curves, labelled training batches, predictions beside the
ground truth.

matplotlib is an optional extra (``pip install 'yolo_func[plots]'``). Without it every function
returns None without plotting, and the first call warns once with
:data:`MISSING_MATPLOTLIB` (:class:`PlotsUnavailableWarning`). Figures are drawn with the Agg
canvas through matplotlib's object API (no ``pyplot``, no global figure state, no display) and
written atomically, so a plot in the run folder is never half a file.

Host-side only: call these between epochs, never inside a training step.
"""

from __future__ import annotations

import csv
import io
import math
import os
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from yolo_func.io.checkpoint import atomic_write
from yolo_func.structures.records import Targets

__all__ = ["MISSING_MATPLOTLIB", "PlotsUnavailableWarning", "plots_available", "plot_results", "plot_batch",
           "plot_predictions", "COCO_SKELETON"]

#: The message of the (single) warning when matplotlib is missing.
MISSING_MATPLOTLIB = "[yolo_func] plots need matplotlib: pip install 'yolo_func[plots]'"

#: COCO's person skeleton (pairs of 0-based keypoint indices), drawn for 17-keypoint poses.
COCO_SKELETON = ((15, 13), (13, 11), (16, 14), (14, 12), (11, 12), (5, 11), (6, 12), (5, 6), (5, 7), (6, 8), (7, 9),
                 (8, 10), (1, 2), (0, 1), (0, 2), (1, 3), (2, 4), (3, 5), (4, 6))


class PlotsUnavailableWarning(UserWarning):
    """matplotlib is not installed; plots are skipped."""


_warned = False


def _matplotlib():
    """``(Figure, FigureCanvasAgg, colormaps)``, or None (warning once) when matplotlib is missing."""
    global _warned
    try:
        import matplotlib
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        if not _warned:
            _warned = True
            warnings.warn(MISSING_MATPLOTLIB, PlotsUnavailableWarning, stacklevel=3)
        return None
    return Figure, FigureCanvasAgg, matplotlib.colormaps


def plots_available() -> bool:
    """Whether matplotlib can be imported (without warning)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _save(fig, canvas_cls, path: str | os.PathLike) -> Path:
    buf = io.BytesIO()
    canvas_cls(fig).print_png(buf)
    data = buf.getvalue()
    return atomic_write(path, lambda f: f.write(data))


def _color(cmaps, c: int) -> tuple[float, float, float]:
    """A fixed colour per class (tab20, cycled)."""
    return tuple(cmaps["tab20"](int(c) % 20)[:3])


def _name(names: Sequence[str] | Mapping[int, str] | None, c: int) -> str:
    if names is None:
        return str(c)
    if isinstance(names, Mapping):
        return str(names.get(c, c))
    return str(names[c]) if 0 <= c < len(names) else str(c)


def _as_uint8_hwc(images: torch.Tensor, arg: str) -> torch.Tensor:
    """uint8[B, H, W, 3] on the CPU from uint8 / float-in-[0, 1] ``[B, 3, H, W]``."""
    if not isinstance(images, torch.Tensor) or images.dim() != 4 or images.shape[1] != 3:
        got = tuple(images.shape) if isinstance(images, torch.Tensor) else type(images).__name__
        raise ValueError(f"[yolo_func] {arg} must be uint8[B, 3, H, W] (or float in [0, 1]); got {got}")
    x = images.detach().cpu()
    if x.dtype != torch.uint8:
        x = (x.float().clamp(0, 1) * 255).round().to(torch.uint8)
    return x.permute(0, 2, 3, 1).contiguous()


# ------------------------------------------------------------------------------------------- curves


def plot_results(csv_path: str | os.PathLike, path: str | os.PathLike | None = None) -> Path | None:
    """Loss, learning-rate and metric curves from a run's ``results.csv``: one subplot per column
    against ``epoch`` (empty cells, e.g. epochs without validation, are skipped).

    Args:
      csv_path: the ``results.csv`` (:class:`yolo_func.train.RunDir` writes it).
      path: the PNG; default ``results.png`` beside the CSV.

    Returns:
      The PNG path, or None (matplotlib missing, or no rows yet).

    Raises:
      ValueError: the CSV has no ``epoch`` column.
    """
    mpl = _matplotlib()
    if mpl is None:
        return None
    Figure, Canvas, _ = mpl
    csv_path = Path(csv_path)
    with open(csv_path, newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        return None
    columns = [c for c in rows[0] if c != "epoch"]
    if "epoch" not in rows[0]:
        raise ValueError(f"[yolo_func] {str(csv_path)!r} has no 'epoch' column (columns: {list(rows[0])}); is it a yolo_func results.csv?")
    cols = min(5, len(columns))
    nrows = math.ceil(len(columns) / cols)
    fig = Figure(figsize=(3.2 * cols, 2.6 * nrows), dpi=100)
    axes = fig.subplots(nrows, cols, squeeze=False,
                        gridspec_kw=dict(left=0.05, right=0.98, top=1 - 0.3 / (2.6 * nrows), bottom=0.4 / (2.6 * nrows), hspace=0.55, wspace=0.3))
    for ax, name in zip(axes.flat, columns):
        pts = [(float(r["epoch"]), float(r[name])) for r in rows if r.get(name) not in ("", None)]
        if pts:
            xs, ys = zip(*pts)
            ax.plot(xs, ys, marker=".", linewidth=1.5, markersize=5)
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("epoch", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(columns):]:
        ax.set_axis_off()
    return _save(fig, Canvas, path if path is not None else csv_path.with_name("results.png"))


# ------------------------------------------------------------------------------------------ batches


def _draw_instances(ax, cmaps, boxes, classes, names, *, dx: float = 0.0, dy: float = 0.0, scale: float = 1.0,
                    scores=None, keypoints=None, fontsize: float = 7.0, dashed: bool = False) -> None:
    """Boxes (xyxy px) with class labels (and scores), keypoints with the COCO skeleton."""
    from matplotlib.patches import Rectangle

    for j in range(len(boxes)):
        x1, y1, x2, y2 = (float(v) * scale for v in boxes[j])
        c = int(classes[j])
        color = _color(cmaps, c)
        ax.add_patch(Rectangle((dx + x1, dy + y1), x2 - x1, y2 - y1, fill=False, edgecolor=color, linewidth=1.5,
                               linestyle="--" if dashed else "-"))
        label = _name(names, c) + (f" {float(scores[j]):.2f}" if scores is not None else "")
        inside = y1 < 1.6 * fontsize  # no room above the box within its image: label inside it
        ink = "black" if 0.299 * color[0] + 0.587 * color[1] + 0.114 * color[2] > 0.6 else "white"
        ax.text(dx + x1, dy + y1, label, fontsize=fontsize, color=ink, va="top" if inside else "bottom", ha="left",
                clip_on=True, bbox=dict(facecolor=color, edgecolor="none", pad=0.8, alpha=0.85))
        if keypoints is not None:
            kp = keypoints[j]
            seen = kp[:, 2] > 0 if kp.shape[1] == 3 else torch.ones(kp.shape[0], dtype=torch.bool)
            xs = dx + kp[:, 0] * scale
            ys = dy + kp[:, 1] * scale
            if kp.shape[0] == 17:
                for a, b in COCO_SKELETON:
                    if seen[a] and seen[b]:
                        ax.plot([float(xs[a]), float(xs[b])], [float(ys[a]), float(ys[b])], color=color, linewidth=1.2)
            ax.scatter(xs[seen].tolist(), ys[seen].tolist(), s=9, color="white", edgecolors=[color], linewidths=0.8, zorder=3)


def _instance_masks(targets: Targets, b: int, height: int, width: int) -> torch.Tensor | None:
    """bool[M, height, width] per slot (nearest-resized), from either mask layout, or None."""
    if targets.masks is None:
        return None
    m = targets.masks[b].detach().cpu()
    M = targets.boxes.shape[1]
    if m.dim() == 2:  # overlap-indexed: pixel value j + 1 belongs to slot j
        per = m[None] == torch.arange(1, M + 1)[:, None, None]
    else:
        per = m > 0.5
    return F.interpolate(per[None].float(), size=(height, width), mode="nearest")[0] > 0.5


def plot_batch(images: torch.Tensor, targets: Targets, names: Sequence[str] | Mapping[int, str] | None,
               path: str | os.PathLike, *, max_images: int = 16, max_size: int = 1920) -> Path | None:
    """A labelled mosaic of (augmented) training images: boxes with class names, instance masks
    blended in their class colour, keypoints with the COCO skeleton (17 keypoints).

    Args:
      images: uint8[B, 3, H, W] (or float[B, 3, H, W] in [0, 1]), RGB.
      targets: :class:`Targets` — boxes float[B, M, 4] xyxy px, classes int[B, M], valid bool[B, M],
        masks int64[B, H/4, W/4] overlap-indexed or float[B, M, H/4, W/4] (optional), keypoints
        float[B, M, P, 3] px (optional).
      names: class names by index (a list or a dict); None prints the index.
      path: the PNG.
      max_images: draw the first ``min(B, max_images)`` images, on a near-square grid.
      max_size: the mosaic's longer side is at most this many pixels.

    Returns:
      The PNG path, or None when matplotlib is missing.

    Raises:
      ValueError: ``images`` or ``targets`` have the wrong shapes.
    """
    hwc = _as_uint8_hwc(images, "images")
    B, H, W, _ = hwc.shape
    if targets.boxes.dim() != 3 or targets.boxes.shape[0] != B or targets.boxes.shape[2] != 4:
        raise ValueError(f"[yolo_func] targets.boxes must be float[B={B}, M, 4]; got {tuple(targets.boxes.shape)}")
    mpl = _matplotlib()
    if mpl is None:
        return None
    Figure, Canvas, cmaps = mpl
    n = min(B, max_images)
    cols = math.ceil(math.sqrt(n))
    rows = math.ceil(n / cols)
    scale = min(1.0, max_size / max(cols * W, rows * H))
    h, w = max(1, round(H * scale)), max(1, round(W * scale))
    canvas = torch.full((rows * h, cols * w, 3), 255, dtype=torch.uint8)
    boxes = targets.boxes.detach().cpu().float()
    classes = targets.classes.detach().cpu()
    valid = targets.valid.detach().cpu().bool()
    kpts = targets.keypoints.detach().cpu().float() if targets.keypoints is not None else None
    for b in range(n):
        tile = hwc[b].permute(2, 0, 1)[None].float()
        if (h, w) != (H, W):
            tile = F.interpolate(tile, size=(h, w), mode="area")
        tile = tile[0].permute(1, 2, 0)
        masks = _instance_masks(targets, b, h, w)
        if masks is not None:  # blend each valid instance's mask in its class colour
            for j in torch.nonzero(valid[b]).flatten().tolist():
                color = torch.tensor(_color(cmaps, int(classes[b, j]))) * 255
                tile = torch.where(masks[j][..., None], 0.5 * tile + 0.5 * color, tile)
        r, c = divmod(b, cols)
        canvas[r * h:(r + 1) * h, c * w:(c + 1) * w] = tile.round().clamp(0, 255).to(torch.uint8)
    fig = Figure(figsize=(cols * w / 100, rows * h / 100), dpi=100)
    ax = fig.add_axes((0, 0, 1, 1))
    ax.imshow(canvas.numpy(), interpolation="nearest")
    ax.set_xlim(0, cols * w)
    ax.set_ylim(rows * h, 0)
    ax.set_axis_off()
    fontsize = max(5.0, min(9.0, w / 50))
    for b in range(n):
        r, c = divmod(b, cols)
        keep = torch.nonzero(valid[b]).flatten()
        _draw_instances(ax, cmaps, boxes[b, keep], classes[b, keep], names, dx=c * w, dy=r * h, scale=scale,
                        keypoints=kpts[b, keep] if kpts is not None else None, fontsize=fontsize)
        ax.add_patch(_frame(c * w, r * h, w, h))
    return _save(fig, Canvas, path)


def _frame(x: float, y: float, w: float, h: float):
    from matplotlib.patches import Rectangle

    return Rectangle((x, y), w, h, fill=False, edgecolor="white", linewidth=2)


# -------------------------------------------------------------------------------------- predictions


def plot_predictions(image: torch.Tensor, gt_boxes: torch.Tensor, gt_classes: torch.Tensor, pred_boxes: torch.Tensor,
                     pred_classes: torch.Tensor, pred_scores: torch.Tensor, names: Sequence[str] | Mapping[int, str] | None,
                     path: str | os.PathLike, *, conf: float = 0.25) -> Path | None:
    """One validation image twice, side by side: the ground truth (left) and the predictions with
    a score of at least ``conf`` (right, labelled with their scores).

    Args:
      image: uint8[3, H, W] (or float in [0, 1]), RGB.
      gt_boxes: float[N, 4] xyxy px; gt_classes: int[N].
      pred_boxes: float[D, 4] xyxy px; pred_classes: int[D]; pred_scores: float[D].
      names: class names by index; None prints the index.
      path: the PNG.
      conf: hide predictions scoring below this (validation keeps scores down to 0.001).

    Returns:
      The PNG path, or None when matplotlib is missing.

    Raises:
      ValueError: shapes that do not match.
    """
    hwc = _as_uint8_hwc(image[None] if isinstance(image, torch.Tensor) and image.dim() == 3 else image, "image")
    if hwc.shape[0] != 1:
        raise ValueError(f"[yolo_func] image must be one uint8[3, H, W]; got {tuple(image.shape)}")
    for name, boxes, cls in (("gt", gt_boxes, gt_classes), ("pred", pred_boxes, pred_classes)):
        if boxes.dim() != 2 or boxes.shape[1] != 4 or cls.shape != boxes.shape[:1]:
            raise ValueError(f"[yolo_func] {name}_boxes must be float[N, 4] with {name}_classes int[N]; "
                             f"got {tuple(boxes.shape)} and {tuple(cls.shape)}")
    if pred_scores.shape != pred_classes.shape:
        raise ValueError(f"[yolo_func] pred_scores must be float[D] like pred_classes; got {tuple(pred_scores.shape)} and {tuple(pred_classes.shape)}")
    mpl = _matplotlib()
    if mpl is None:
        return None
    Figure, Canvas, cmaps = mpl
    _, H, W, _ = hwc.shape
    scale = min(1.0, 960 / max(H, W))
    fig = Figure(figsize=(2 * W * scale / 100, (H * scale + 24) / 100), dpi=100, layout="constrained")
    axes = fig.subplots(1, 2)
    keep = pred_scores.detach().cpu() >= conf
    panels = (("ground truth", gt_boxes, gt_classes, None),
              (f"predictions (score >= {conf:g})", pred_boxes[keep], pred_classes[keep], pred_scores[keep]))
    for ax, (title, boxes, cls, scores) in zip(axes, panels):
        ax.imshow(hwc[0].numpy(), interpolation="bilinear" if scale < 1 else "nearest")
        ax.set_xlim(0, W)
        ax.set_ylim(H, 0)
        ax.set_axis_off()
        ax.set_title(f"{title}: {len(boxes)}", fontsize=9)
        _draw_instances(ax, cmaps, boxes.detach().cpu().float(), cls.detach().cpu(), names,
                        scores=scores.detach().cpu() if scores is not None else None, fontsize=7)
    return _save(fig, Canvas, path)
