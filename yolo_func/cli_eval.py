"""``yolo-func val`` and ``yolo-func predict``: weights from a file, datasets from a path, JSON out.

Kept out of ``cli.py`` so that file only registers the subcommands (:func:`add_eval_commands`).

- Weights: our checkpoint (a training checkpoint of a run folder, ``weights/last.pt`` /
  ``best.pt``: the model is built from its config, the EMA weights are used when present, class
  names from its meta ``names`` when stored) or a reference-layout ``.pt``
  (:func:`yolo_func.io.load_reference_model`: model, weights and names from the file alone).
- Data for ``val``: a COCO folder (``annotations.json`` + ``images/``), a COCO JSON (images from
  ``--images``, default the ``images`` folder next to it) or a YOLO ``data.yaml`` (its ``val`` split).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, NamedTuple

__all__ = ["LoadedWeights", "load_weights", "open_dataset", "class_mapping", "add_eval_commands"]


class LoadedWeights(NamedTuple):
    """A model and its trees read from a weights file.

    Attributes:
      model: the :class:`~yolo_func.models.Model`.
      params, state: float32 trees on the CPU.
      names: one class name per model class.
      source: ``"yolo_func"`` or ``"reference"``.

    Example:
      >>> import tempfile, torch
      >>> from pathlib import Path
      >>> from yolo_func import yolov8
      >>> from yolo_func.io import to_reference
      >>> model = yolov8("n", task="detect", num_classes=5)
      >>> params, state = model.init(torch.Generator().manual_seed(0))
      >>> path = Path(tempfile.mkdtemp()) / "w.pt"
      >>> torch.save({"model": to_reference(model, params, state)}, path)      # a reference-layout file
      >>> from yolo_func.cli_eval import load_weights
      >>> model2, params2, state2, names, source = load_weights(path)    # a LoadedWeights record
      >>> model2.task, len(names), source
      ('detect', 5, 'reference')
    """

    model: Any
    params: dict
    state: dict
    names: list[str]
    source: str


def _ours(path: Path) -> LoadedWeights:
    from yolo_func import tree as T
    from yolo_func.configs import config_from_dict
    from yolo_func.io import read_checkpoint
    from yolo_func.models import yolov8

    payload = read_checkpoint(path)
    tensors = payload["tensors"]
    cfg = config_from_dict(payload["config"], source=f"the config in {path}").model
    prefix = "ema/ema/" if any(k.startswith("ema/ema/params/") for k in tensors) else ""
    flat = {k[len(prefix):]: v.float() if v.is_floating_point() else v for k, v in tensors.items() if k.startswith(prefix)}
    cls_key = "params/heads/detect/cls/p3/pred/weight"
    if cls_key not in flat:
        raise ValueError(f"[yolo_func] weights={str(path)!r}: a yolo_func checkpoint without {cls_key!r}; "
                         "expected a checkpoint written by the training loop (weights/last.pt or best.pt)")
    num_classes = int(flat[cls_key].shape[0])
    model = yolov8(cfg.scale, task=cfg.task, num_classes=num_classes, kpt_shape=tuple(cfg.kpt_shape))
    params = T.tree_from_flat_dict({k[len("params/"):]: v for k, v in flat.items() if k.startswith("params/")})
    state = T.tree_from_flat_dict({k[len("state/"):]: v for k, v in flat.items() if k.startswith("state/")})
    model.check_trees(params, state)
    stored = payload["meta"].get("names")
    names = [str(stored[i]) if isinstance(stored, list) and len(stored) == num_classes else str(i) for i in range(num_classes)]
    return LoadedWeights(model, params, state, names, "yolo_func")


def load_weights(path: str | Path) -> LoadedWeights:
    """Read our checkpoint or a reference-layout ``.pt``.

    Raises:
      ValueError: the file is missing or neither kind (the message gives both readers' reasons).

    Example:
      >>> import tempfile, torch
      >>> from pathlib import Path
      >>> from yolo_func import yolov8
      >>> from yolo_func.io import to_reference
      >>> model = yolov8("n", task="detect", num_classes=5)
      >>> params, state = model.init(torch.Generator().manual_seed(0))
      >>> path = Path(tempfile.mkdtemp()) / "w.pt"
      >>> torch.save({"model": to_reference(model, params, state)}, path)      # a reference-layout file
      >>> from yolo_func.cli_eval import load_weights
      >>> w = load_weights(path)                           # also a run's weights/best.pt (our checkpoint)
      >>> w.source, w.model.num_classes, w.names[:2]
      ('reference', 5, ['0', '1'])
    """
    from yolo_func.io import load_reference_model

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"[yolo_func] weights={str(path)!r}: no such file; pass a yolo_func checkpoint or a "
                         "reference .pt (e.g. yolov8n.pt)")
    try:
        return _ours(path)
    except ValueError as ours_error:
        try:
            ref = load_reference_model(path)
        except ValueError as ref_error:
            raise ValueError(f"[yolo_func] weights={str(path)!r} is neither a yolo_func checkpoint ({ours_error}) nor a "
                             f"reference checkpoint ({ref_error})") from None
    names = [str(ref.names[i]) for i in range(ref.model.num_classes)]
    return LoadedWeights(ref.model, ref.params, ref.state, names, "reference")


def open_dataset(data: str | Path, *, task: str, images: str | Path | None = None) -> Any:
    """The dataset ``yolo-func val --data`` names.

    Args:
      data: a COCO folder (``annotations.json`` + ``images/``), a COCO ``.json``, a YOLO ``.yaml``, or
        ``"builtin"``: the built-in data's val split of ``task`` (what ``yolo-func train`` trains on
        by default; generated on first use, then read from the cache).
      task: the model's task.
      images: the image folder of a COCO JSON (default: ``images`` next to the JSON).

    Raises:
      ValueError: none of these forms (the message lists them).

    Example:
      >>> from yolo_func.cli_eval import open_dataset
      >>> from yolo_func.data import builtin_dataset
      >>> val = builtin_dataset("detect", "val", num_images=2)
      >>> ds = open_dataset(val.annotations_path, task="detect", images=val.image_dir)   # a COCO JSON + --images
      >>> type(ds).__name__, len(ds)
      ('CocoDataset', 2)
    """
    from yolo_func.data import CocoDataset, YoloDataset, builtin_dataset

    if str(data) == "builtin":  # the same val split the fit validates on (configs' data.path="builtin")
        return builtin_dataset(task, "val", seed=0)
    data = Path(data)
    if data.is_dir() and (data / "annotations.json").is_file():
        return CocoDataset(data / "annotations.json", Path(images) if images else data / "images", task=task)
    if data.is_file() and data.suffix.lower() == ".json":
        return CocoDataset(data, Path(images) if images else data.parent / "images", task=task)
    if data.is_file() and data.suffix.lower() in (".yaml", ".yml"):
        return YoloDataset(data, "val", task=task)
    raise ValueError(f"[yolo_func] --data {str(data)!r}: expected a COCO folder (annotations.json + images/), a COCO "
                     "JSON (with --images), a YOLO data.yaml or 'builtin'")


def class_mapping(model_names: list[str], dataset_names: list[str]) -> tuple[list[int], str]:
    """Dataset class of each model class: by name when every model name is a dataset category,
    else by order (class i -> i-th category by id).

    Returns:
      ``(class_map, how)`` with ``how`` a sentence saying which rule applied.

    Raises:
      ValueError: by order, with different class counts (naming both).

    Example:
      >>> from yolo_func.cli_eval import class_mapping
      >>> class_mapping(["cat", "dog"], ["dog", "bird", "cat"])[0]    # by name
      [2, 0]
      >>> class_mapping(["0", "1"], ["dog", "cat"])[0]                # by order (names do not match)
      [0, 1]
    """
    index = {n: k for k, n in enumerate(dataset_names)}
    if len(set(model_names)) == len(model_names) and all(n in index for n in model_names):
        return [index[n] for n in model_names], (f"classes mapped by name: all {len(model_names)} class names of the "
                                                 f"weights are categories of the dataset")
    if len(model_names) != len(dataset_names):
        raise ValueError(f"[yolo_func] the weights have {len(model_names)} classes ({model_names[:5]}...) but the dataset "
                         f"has {len(dataset_names)} categories ({dataset_names[:5]}...), and the names do not match; "
                         "use weights trained on these categories or a dataset with the same classes")
    return list(range(len(model_names))), (f"classes mapped by order (class i -> i-th category by id): the names of the "
                                           f"weights are not all categories of the dataset")


def _write_json(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=1))


def _val(args: argparse.Namespace) -> int:
    from yolo_func.eval.evaluate import evaluate_with_records

    w = load_weights(args.weights)
    dataset = open_dataset(args.data, task=w.model.task, images=args.images)
    class_map, how = class_mapping(w.names, list(dataset.names))
    print(how)
    metrics, records = evaluate_with_records(
        w.model, w.params, w.state, dataset, image_size=args.imgsz, batch_size=args.batch, device=args.device,
        conf=args.conf, iou=args.iou, class_map=class_map, workers=args.workers, precision=args.precision,
    )
    out = Path(args.out)
    _write_json(out / "metrics.json", metrics)
    _write_json(out / "predictions.json", records)
    internal = metrics["internal"]
    print(f"internal: box mAP50 {internal['box']['mAP50']:.4f} mAP50-95 {internal['box']['mAP50-95']:.4f} "
          f"fitness {internal['fitness']:.4f}")
    print(f"wrote {out / 'metrics.json'} and {out / 'predictions.json'} ({len(records)} detections)")
    return 0


def _predict(args: argparse.Namespace) -> int:
    from yolo_func.eval.coco_eval import to_coco_results
    from yolo_func.eval.draw import save_image
    from yolo_func.eval.predict import draw_prediction, predict

    w = load_weights(args.weights)
    problems: list[str] = []

    def report(msg: str) -> None:
        problems.append(msg)
        print(msg, file=sys.stderr)

    preds = predict(w.model, w.params, w.state, args.source, conf=args.conf, iou=args.iou, image_size=args.imgsz,
                    device=args.device, names=w.names, on_problem=report, precision=args.precision)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    records, read, used = [], 0, set()
    ids = list(range(w.model.num_classes))
    for p in preds:
        if p.detections is None:
            continue
        read += 1
        for rec in to_coco_results(p.detections, image_id=0, category_ids=ids):
            del rec["image_id"]
            records.append({"file_name": str(p.path), **rec})
        stem = p.path.stem
        name = stem if stem not in used else f"{stem}_{len(used)}"
        used.add(name)
        save_image(out / f"{name}.jpg", draw_prediction(p, w.names))
    _write_json(out / "predictions.json", records)
    print(f"{read} image(s) read, {len(records)} detection(s); wrote {out / 'predictions.json'} and {read} picture(s)"
          + (f"; {len(problems)} problem(s) above" if problems else ""))
    if read == 0:
        print("[yolo_func] predict: no image could be read; pass image files, a folder of images or a glob",
              file=sys.stderr)
        return 1
    return 0


def add_eval_commands(sub: Any, image_size_type: Any, positive_int_type: Any) -> dict[str, Any]:
    """Register ``val`` and ``predict`` on an argparse subparsers object.

    Args:
      sub: ``parser.add_subparsers(...)``'s result.
      image_size_type, positive_int_type: the CLI's argparse types for ``--imgsz`` and ``--batch``.

    Returns:
      ``{command: handler}`` (each handler takes the parsed namespace and returns the exit status).

    Example:
      >>> import argparse
      >>> from yolo_func.cli_eval import add_eval_commands
      >>> parser = argparse.ArgumentParser(prog="demo")
      >>> handlers = add_eval_commands(parser.add_subparsers(dest="command"), int, int)
      >>> sorted(handlers)
      ['predict', 'val']
      >>> parser.parse_args(["val", "--weights", "w.pt", "--data", "d", "--out", "o"]).command
      'val'
    """
    fmt = argparse.ArgumentDefaultsHelpFormatter
    val = sub.add_parser("val", help="validate weights on a dataset: pycocotools metrics and predictions JSON",
                         formatter_class=fmt)
    val.add_argument("--weights", required=True, default=argparse.SUPPRESS, help="our checkpoint or a reference-layout .pt")
    val.add_argument("--data", required=True, default=argparse.SUPPRESS, help="a COCO folder (annotations.json + images/), a COCO JSON, a YOLO data.yaml or 'builtin' (the built-in val split)")
    val.add_argument("--images", default=None, help="image folder of a COCO JSON; None: the images/ folder next to it")
    val.add_argument("--out", required=True, default=argparse.SUPPRESS, help="output folder for metrics.json and predictions.json")
    val.add_argument("--imgsz", type=image_size_type, default=640, help="long side of the val images, a multiple of 32")
    val.add_argument("--batch", type=positive_int_type, default=32, help="images per val batch")
    val.add_argument("--conf", type=float, default=0.001, help="class-score threshold")
    val.add_argument("--iou", type=float, default=0.7, help="NMS IoU threshold")
    val.add_argument("--device", default=None, help="cpu, cuda, cuda:1 or 0; None: cuda when available, else cpu")
    val.add_argument("--workers", type=int, default=4, help="loader worker processes (0: in this process)")
    val.add_argument("--precision", default="auto", choices=["auto", "bf16", "fp16", "fp32"],
                     help="the network's autocast: auto = fp16 on CUDA (bf16 loses box mAP at high IoU), fp32 on the CPU")
    pred = sub.add_parser("predict", help="detections and pictures for images, a folder or a glob", formatter_class=fmt)
    pred.add_argument("--weights", required=True, default=argparse.SUPPRESS, help="our checkpoint or a reference-layout .pt")
    pred.add_argument("--source", required=True, nargs="+", default=argparse.SUPPRESS, help="image files, folders or glob patterns")
    pred.add_argument("--out", required=True, default=argparse.SUPPRESS, help="output folder for predictions.json and the pictures")
    pred.add_argument("--conf", type=float, default=0.25, help="class-score threshold")
    pred.add_argument("--iou", type=float, default=0.7, help="NMS IoU threshold")
    pred.add_argument("--imgsz", type=image_size_type, default=640, help="long side of the network input, a multiple of 32")
    pred.add_argument("--device", default=None, help="cpu, cuda, cuda:1 or 0; None: cuda when available, else cpu")
    pred.add_argument("--precision", default="auto", choices=["auto", "bf16", "fp16", "fp32"],
                      help="the network's autocast: auto = fp16 on CUDA (bf16 loses box mAP at high IoU), fp32 on the CPU")
    return {"val": _val, "predict": _predict}
