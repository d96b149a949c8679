"""``yolo-func export``: weights (our checkpoint or a reference-layout ``.pt``) to a deployable file.

Kept out of ``cli.py`` so that file only registers the subcommand (:func:`add_export_command`).
Weights are read as ``yolo-func val`` / ``predict`` read them (:func:`yolo_func.cli_eval.load_weights`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

__all__ = ["add_export_command"]


def _format(text: str) -> str:
    """argparse ``type=`` for ``--format``: one of :data:`yolo_func.export.FORMATS` (case-insensitive)."""
    from yolo_func.export import FORMATS

    value = text.strip().lower()
    if value not in FORMATS:
        raise argparse.ArgumentTypeError(f"unknown format {text!r}; supported: {', '.join(FORMATS)}")
    return value


def _check_onnx(path: str | Path, model: Any, params: dict, state: dict, *, image_size: int, batch: int = 1,
               seed: int = 0) -> float:
    """Run an exported raw (no NMS) ONNX file in onnxruntime on random images and compare it with
    ``model.predict``.

    Args:
      path: the ``.onnx`` file (float32 input ``images``).
      model, params, state: what was exported.
      image_size: square input side (a multiple of 32).
      batch: images in the check batch.
      seed: seed of the random images.

    Returns:
      ``max |onnx - predict| / max |predict|`` over every output (a relative error; float32 exports
      give about 1e-6).

    Raises:
      ImportError: onnxruntime is not installed.
    """
    import numpy as np
    import torch

    from yolo_func.export import _require

    ort = _require("onnxruntime")
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    images = torch.rand(batch, model.in_channels, image_size, image_size, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        ref = model.predict(params, state, images)
    outs = session.run(None, {"images": images.numpy()})
    worst = 0.0
    for r, o in zip([ref.y] + ([ref.protos] if ref.protos is not None else []), outs):
        r = r.float().numpy()
        worst = max(worst, float(np.abs(o.astype(np.float32) - r).max() / max(float(np.abs(r).max()), 1e-12)))
    return worst


def _export(args: argparse.Namespace) -> int:
    from yolo_func.cli_eval import load_weights
    from yolo_func.export import read_metadata, to_onnx

    weights = Path(args.weights)
    out = Path(args.out) if args.out else weights.with_suffix(".onnx")
    try:
        # Fail on a missing exporter before reading (possibly large) weights.
        from yolo_func.export import _require

        _require("onnx")
        _require("onnxscript")
        w = load_weights(weights)
        path = to_onnx(w.model, w.params, w.state, out, image_size=args.imgsz, batch=args.batch, dynamic=args.dynamic,
                       half=args.half, nms=args.nms, conf=args.conf, iou=args.iou, max_det=args.max_det,
                       opset=args.opset, names=w.names)
    except ImportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    meta = read_metadata(path)
    size_mb = path.stat().st_size / 2**20
    print(f"wrote {path} ({size_mb:.1f} MB): yolov8{w.model.scale} {w.model.task}, {w.model.num_classes} class{'' if w.model.num_classes == 1 else 'es'}, "
          f"input images [{'B' if args.dynamic else args.batch}, 3, {'H' if args.dynamic else args.imgsz}, "
          f"{'W' if args.dynamic else args.imgsz}]{' float16' if args.half else ''}, outputs {', '.join(meta['outputs'])}")
    if args.nms or args.half:
        return 0
    try:
        err = _check_onnx(path, w.model, w.params, w.state, image_size=args.imgsz, batch=1 if args.dynamic else args.batch)
    except ImportError:
        print("onnxruntime is not installed: the file was not checked (pip install onnxruntime)")
        return 0
    print(f"onnxruntime check: max |onnx - predict| = {err:.1e} of the largest output value")
    if err > 1e-3:  # float32 exports measure ~1e-6 .. 3e-5
        print(f"[yolo_func] export: the ONNX file differs from model.predict by {err:.1e} (relative); "
              "please report this with the command line", file=sys.stderr)
        return 1
    return 0


def add_export_command(sub: Any, image_size_type: Any, positive_int_type: Any) -> dict[str, Any]:
    """Register ``export`` on an argparse subparsers object.

    Args:
      sub: ``parser.add_subparsers(...)``'s result.
      image_size_type, positive_int_type: the CLI's argparse types for ``--imgsz`` and ``--batch``.

    Returns:
      ``{"export": handler}`` (the handler takes the parsed namespace and returns the exit status:
      0 written, 1 the export extra missing or the onnxruntime check failed, 2 bad input).

    Example:
      >>> import argparse
      >>> sub = argparse.ArgumentParser(prog="yolo-func").add_subparsers(dest="command")
      >>> handlers = add_export_command(sub, int, int)
      >>> args = sub.choices["export"].parse_args(["--weights", "best.pt", "--dynamic"])
      >>> sorted(handlers), args.format, args.imgsz, args.dynamic, args.opset
      (['export'], 'onnx', 640, True, 20)
    """
    from yolo_func.export import DEFAULT_OPSET

    p = sub.add_parser(
        "export", help="export weights to ONNX (raw inference output, optionally with NMS)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Export Model.predict to ONNX. Needs the export extra: pip install 'yolo_func[export]'. "
                    "A float32 raw export is checked against model.predict in onnxruntime when it is installed.")
    p.add_argument("--weights", required=True, default=argparse.SUPPRESS, help="our checkpoint or a reference-layout .pt")
    p.add_argument("--format", type=_format, default="onnx", help="output format (onnx)")
    p.add_argument("--out", default=None, help="output file; None: the weights path with .onnx")
    p.add_argument("--imgsz", type=image_size_type, default=640, help="square input side, a multiple of 32 (the example size with --dynamic)")
    p.add_argument("--batch", type=positive_int_type, default=1, help="batch size of the input (ignored with --dynamic)")
    p.add_argument("--dynamic", action="store_true", help="dynamic batch, height and width")
    p.add_argument("--half", action="store_true", help="float16 weights and input (for GPU runtimes)")
    p.add_argument("--nms", action="store_true", help="end the graph in NMS (det_batch, det_boxes, det_scores, det_classes, det_extra)")
    p.add_argument("--conf", type=float, default=0.25, help="NMS class-score threshold (with --nms)")
    p.add_argument("--iou", type=float, default=0.7, help="NMS IoU threshold (with --nms)")
    p.add_argument("--max-det", type=positive_int_type, default=300, help="detections per image (with --nms)")
    p.add_argument("--opset", type=int, default=DEFAULT_OPSET, help="ONNX opset (>= 18)")
    return {"export": _export}
