"""Draws docs/images/builtin_samples.png: built-in train samples with their boxes, masks and keypoints.

Run from the repository root: ``python docs/images/make_builtin_samples.py [--root CACHE]``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import cv2
import numpy as np

from yolo_func.data import builtin_dataset
from yolo_func.data.builtin import SHAPE_CLASSES

TILE = 256


def _tile(sample, names, skeleton=None) -> np.ndarray:
    image = sample.image.copy()
    colours = [(255, 255, 255), (0, 0, 0)]
    if sample.masks is not None:
        for k, mask in enumerate(sample.masks):
            contours, _ = cv2.findContours(mask, cv2.RETR_CCOMP, cv2.CHAIN_APPROX_SIMPLE)
            cv2.drawContours(image, contours, -1, (255, 255, 255), 1)
    for k, (box, cls) in enumerate(zip(sample.boxes, sample.classes)):
        x1, y1, x2, y2 = (int(round(v)) for v in box)
        cv2.rectangle(image, (x1, y1), (x2, y2), colours[0], 2)
        cv2.rectangle(image, (x1, y1), (x2, y2), colours[1], 1)
        cv2.putText(image, names[cls], (x1, max(10, y1 - 3)), cv2.FONT_HERSHEY_SIMPLEX, 0.4, (255, 255, 255), 1,
                    cv2.LINE_AA)
    if sample.keypoints is not None:
        for kp in sample.keypoints:
            for j, (x, y, v) in enumerate(kp):
                if v > 0:
                    colour = (0, 255, 0) if v == 2 else (255, 0, 0)
                    if j in (1, 3, 5, 7, 9, 11, 13, 15):  # left side: filled
                        cv2.circle(image, (int(x), int(y)), 3, colour, -1)
                    else:
                        cv2.circle(image, (int(x), int(y)), 3, colour, 1)
    h, w = image.shape[:2]
    s = TILE / max(h, w)
    image = cv2.resize(image, (int(w * s), int(h * s)), interpolation=cv2.INTER_AREA)
    out = np.full((TILE, TILE, 3), 255, np.uint8)
    out[:image.shape[0], :image.shape[1]] = image
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--root", default=None, help="cache folder (default: the user cache)")
    parser.add_argument("--out", default=str(Path(__file__).with_name("builtin_samples.png")))
    args = parser.parse_args()
    seg = builtin_dataset("segment", "train", root=args.root)
    pose = builtin_dataset("pose", "train", root=args.root)
    rows = [[_tile(seg[i], list(SHAPE_CLASSES)) for i in range(4)],
            [_tile(seg[i], list(SHAPE_CLASSES)) for i in range(4, 8)],
            [_tile(pose[i], ["figure"]) for i in range(4)]]
    grid = np.concatenate([np.concatenate(r, axis=1) for r in rows], axis=0)
    try:  # a 256-colour palette keeps the committed PNG small; Pillow is only a test dependency
        from PIL import Image
        Image.fromarray(grid).quantize(256, dither=Image.Dither.NONE).save(args.out, optimize=True)
    except ImportError:
        cv2.imwrite(args.out, grid[:, :, ::-1], [cv2.IMWRITE_PNG_COMPRESSION, 9])
    print(args.out, grid.shape)


if __name__ == "__main__":
    main()
