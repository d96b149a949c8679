"""Pictures of detections: boxes, class names and scores, mask overlays, keypoint skeletons (OpenCV).

Images are RGB ``uint8[H, W, 3]`` numpy arrays (what the datasets decode), detections in that
image's pixels (see :func:`yolo_func.eval.scale_to_original`). Drawing never modifies its input.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import torch

__all__ = ["COCO_SKELETON", "PALETTE", "class_color", "draw_detections", "save_image"]

#: COCO person skeleton as 0-based keypoint index pairs (the annotation file's 1-based list, minus 1).
COCO_SKELETON = (
    (15, 13), (13, 11), (16, 14), (14, 12), (11, 12), (5, 11), (6, 12), (5, 6), (5, 7), (6, 8),
    (7, 9), (8, 10), (1, 2), (0, 1), (0, 2), (1, 3), (2, 4), (3, 5), (4, 6),
)  # fmt: skip

#: 20 distinct RGB colours, cycled by class index.
PALETTE = (
    (255, 56, 56), (255, 157, 151), (255, 112, 31), (255, 178, 29), (207, 210, 49), (72, 249, 10),
    (146, 204, 23), (61, 219, 134), (26, 147, 52), (0, 212, 187), (44, 153, 168), (0, 194, 255),
    (52, 69, 147), (100, 115, 255), (0, 24, 236), (132, 56, 255), (82, 0, 133), (203, 56, 255),
    (255, 149, 200), (255, 55, 199),
)  # fmt: skip


def _cv2():
    try:
        import cv2
    except ImportError as e:  # pragma: no cover - a dependency
        raise ImportError("[yolo_func] drawing needs OpenCV: pip install opencv-python-headless") from e
    return cv2


def class_color(cls: int) -> tuple[int, int, int]:
    """RGB colour of a class index."""
    return PALETTE[int(cls) % len(PALETTE)]


def _numpy(x) -> np.ndarray | None:
    if x is None:
        return None
    return x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


def _name(names, cls: int) -> str:
    if names is None:
        return str(cls)
    if isinstance(names, Mapping):
        return str(names.get(cls, cls))
    return str(names[cls]) if 0 <= cls < len(names) else str(cls)


def draw_detections(
    image: np.ndarray,
    detections,
    *,
    class_names: Sequence[str] | Mapping[int, str] | None = None,
    skeleton: Sequence[tuple[int, int]] | None = COCO_SKELETON,
    kpt_conf: float = 0.5,
    mask_alpha: float = 0.45,
    line_width: int | None = None,
) -> np.ndarray:
    """Draw one image's detections.

    Args:
      image: uint8[H, W, 3] RGB.
      detections: a :class:`~yolo_func.eval.Detections` in this image's pixels (masks bool[N, h, w]
        of any size are resized to H x W, nearest).
      class_names: names by class index (list or dict); the index is printed when missing.
      skeleton: keypoint index pairs to join (COCO's for 17 keypoints; None draws points only).
      kpt_conf: keypoints with a confidence at or below this are not drawn (D = 3 only).
      mask_alpha: opacity of the mask overlay.
      line_width: box line width; default ``max(2, round(0.003 * (H + W) / 2))``.

    Returns:
      uint8[H, W, 3] RGB, a new array.

    Raises:
      ValueError: an image that is not uint8[H, W, 3].
    """
    cv2 = _cv2()
    image = np.asarray(image)
    if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
        raise ValueError(
            f"[yolo_func] draw_detections: image must be uint8[H, W, 3] RGB, got {image.dtype}{list(image.shape)}; "
            f"convert a CHW tensor with image.permute(1, 2, 0).numpy()"
        )
    out = np.ascontiguousarray(image.copy())
    H, W = out.shape[:2]
    lw = line_width or max(2, round(0.003 * (H + W) / 2))
    boxes = _numpy(detections.boxes).astype(np.float64).reshape(-1, 4)
    scores = _numpy(detections.scores).astype(np.float64).reshape(-1)
    classes = _numpy(detections.classes).astype(np.int64).reshape(-1)
    masks, kpts = _numpy(detections.masks), _numpy(detections.keypoints)
    if masks is not None and len(masks):
        overlay = out.astype(np.float32)
        for i in range(len(masks))[::-1]:  # highest score drawn last, on top
            m = masks[i].astype(np.uint8)
            if m.shape != (H, W):
                m = cv2.resize(m, (W, H), interpolation=cv2.INTER_NEAREST)
            sel = m.astype(bool)
            overlay[sel] = overlay[sel] * (1 - mask_alpha) + np.array(class_color(classes[i]), np.float32) * mask_alpha
        out = np.clip(overlay.round(), 0, 255).astype(np.uint8)
    font, scale = cv2.FONT_HERSHEY_SIMPLEX, max(lw / 3, 0.4)
    thick = max(lw - 1, 1)
    for i in range(len(scores))[::-1]:
        color = class_color(classes[i])
        x1, y1, x2, y2 = (int(round(v)) for v in boxes[i])
        cv2.rectangle(out, (x1, y1), (x2, y2), color, lw, cv2.LINE_AA)
        label = f"{_name(class_names, int(classes[i]))} {scores[i]:.2f}"
        (tw, th), base = cv2.getTextSize(label, font, scale, thick)
        # Above the box when it fits, else just inside it; shifted left to stay in the picture.
        ty1 = y1 - th - base - 2 if y1 - th - base - 2 >= 0 else max(y1, 0)
        tx1 = max(min(x1, W - tw - 2), 0)
        cv2.rectangle(out, (tx1, ty1), (tx1 + tw + 2, ty1 + th + base + 2), color, -1, cv2.LINE_AA)
        text_color = (0, 0, 0) if (0.299 * color[0] + 0.587 * color[1] + 0.114 * color[2]) > 150 else (255, 255, 255)
        cv2.putText(out, label, (tx1 + 1, ty1 + th + 1), font, scale, text_color, thick, cv2.LINE_AA)
    if kpts is not None and len(kpts):
        r = max(lw, 2)
        for i in range(len(kpts)):
            k = kpts[i]
            vis = k[:, 2] > kpt_conf if k.shape[1] >= 3 else np.ones(len(k), bool)
            vis &= (k[:, 0] > 0) | (k[:, 1] > 0)
            for a, b in skeleton or ():
                if a < len(k) and b < len(k) and vis[a] and vis[b]:
                    pa, pb = (int(round(k[a, 0])), int(round(k[a, 1]))), (int(round(k[b, 0])), int(round(k[b, 1])))
                    cv2.line(out, pa, pb, (51, 153, 255), max(lw - 1, 1), cv2.LINE_AA)
            for j in np.nonzero(vis)[0]:
                cv2.circle(out, (int(round(k[j, 0])), int(round(k[j, 1]))), r, (255, 128, 0), -1, cv2.LINE_AA)
    return out


def save_image(path: str | Path, image: np.ndarray) -> Path:
    """Write an RGB uint8[H, W, 3] picture (format from the suffix, e.g. ``.jpg``, ``.png``).

    Raises:
      ValueError: OpenCV could not write the file (unknown suffix, missing folder).
    """
    cv2 = _cv2()
    path = Path(path)
    if not cv2.imwrite(str(path), np.ascontiguousarray(np.asarray(image)[:, :, ::-1])):
        raise ValueError(f"[yolo_func] save_image: could not write {str(path)!r}; check the folder exists and the suffix is an image type")
    return path
