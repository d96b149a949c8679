"""Command line: ``yolo-func <command>``.

Commands:
  train  train a model (a recipe, flags and key=value overrides; no argument: yolov8n on the built-in data).
  demo   build a model, run one forward pass on a random image, print shapes and the parameter count.
  info   parameter counts of every scale and task.
  val    validate weights on a dataset (pycocotools metrics, predictions JSON).
  predict  detections and pictures for images, a folder or a glob.
  export   weights to ONNX (raw inference output, optionally with NMS).
"""

from __future__ import annotations

import argparse
import sys
import time

__all__ = ["main"]


def _image_size(text: str) -> int:
    """argparse ``type=`` for ``--imgsz``: a positive multiple of 32 (the network's largest stride)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive multiple of 32 (e.g. 640), got {text!r}") from None
    if value < 32 or value % 32:
        hint = max(32, -(-value // 32) * 32)
        raise argparse.ArgumentTypeError(f"expected a positive multiple of 32 (e.g. 640), got {value}; try {hint}")
    return value


def _positive_int(text: str) -> int:
    """argparse ``type=`` for counts such as ``--batch``: an int >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def _demo(args: argparse.Namespace) -> int:
    import torch

    from yolo_func import tree as T
    from yolo_func import yolov8

    model = yolov8(args.scale, task=args.task)
    params, state = model.init(torch.Generator().manual_seed(args.seed))
    images = torch.rand(args.batch, 3, args.imgsz, args.imgsz, generator=torch.Generator().manual_seed(args.seed + 1))
    t0 = time.perf_counter()
    with torch.no_grad():
        preds, _ = model.apply(params, state, images, train=True)
        inference = model.predict(params, state, images)
    dt = time.perf_counter() - t0
    print(f"yolov8{args.scale} {args.task}: {model.num_params(params):,} parameters "
          f"({T.tree_count(params):,} trainable + {model.reg_max} frozen DFL), {len(T.tree_leaves(state))} BN statistics tensors")
    print(f"input images {tuple(images.shape)}")
    for name, p in preds.items():
        for field, t in zip(p._fields, p):
            print(f"  train {name}.{field}: {tuple(t.shape)}")
    print(f"  inference y: {tuple(inference.y.shape)}" + (f", protos: {tuple(inference.protos.shape)}" if inference.protos is not None else ""))
    print(f"forward (train + inference) on CPU: {dt:.2f} s")
    return 0


def _info(args: argparse.Namespace) -> int:
    from yolo_func import yolov8
    from yolo_func.models import SCALES, TASKS

    print(f"{'scale':<6}" + "".join(f"{t:>14}" for t in TASKS))
    for s in SCALES:
        counts = []
        for t in TASKS:
            m = yolov8(s, task=t)
            counts.append(m.num_params(m.abstract_init()[0]))
        print(f"{s:<6}" + "".join(f"{c:>14,}" for c in counts))
    return 0


def _train(args: argparse.Namespace) -> int:
    """``yolo-func train``: build the config (recipe, flags, overrides), fit, print the summary.

    Returns 0 when the run ends (completed, early stop, time limit), 130 when interrupted by Ctrl-C
    (``last.pt`` is saved: run the same command again to resume)."""
    from yolo_func.configs import FLAGS, build_config

    if args.devices is not None:
        from yolo_func.train import distributed as D

        devices = D.parse_devices(args.devices)
        if D.env_world() is None and len(devices) > 1:  # start torchrun; each worker runs this command without --devices
            cpu = (args.device or "").startswith("cpu")
            return D.launch(len(devices) if cpu else devices, ["train", *_without_devices(args.argv)], cpu=cpu)
        if D.env_world() is None and len(devices) == 1 and not (args.device or "").startswith("cpu"):
            args.device = f"cuda:{devices[0]}"
    flags = {name: getattr(args, name) for name in FLAGS}
    overrides = list(args.overrides) + (["train.resume=true"] if args.resume else [])
    config = build_config(args.model, flags=flags, overrides=overrides, config_file=args.config)
    from yolo_func.train.fit import fit

    try:
        result = fit(config)
    except KeyboardInterrupt:  # a second Ctrl-C: stopped at once, last.pt is the previous save
        print("interrupted twice: stopped without saving (weights/last.pt is the previous checkpoint)", file=sys.stderr)
        return 130
    return 130 if result.stopped == "interrupted" else 0


def _without_devices(argv: list[str]) -> list[str]:
    """The train command's arguments without ``--devices X`` / ``--devices=X``."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--devices":
            skip = True
        elif not a.startswith("--devices="):
            out.append(a)
    return out


def _add_train(sub) -> None:
    from yolo_func.configs import FLAGS

    train = sub.add_parser(
        "train", help="train a model (no argument: yolov8n on the built-in data, the CPU or GPU default recipe)",
        description="Train a model. The recipe (--model), then the flags, then key=value overrides "
                    "(dotted keys, e.g. optim.lr0=0.02 data.augment.mosaic=0.5) build the config; "
                    "an existing --out folder with weights/last.pt resumes.")
    train.add_argument("--model", default=None, help="recipe name (yolov8n, yolov8s-seg, yolov8m-pose, builtin-cpu, ...); "
                                                     "default: builtin-gpu with CUDA, else builtin-cpu")
    help_of = {"data": "'builtin', a COCO folder, a COCO JSON (with --images) or a YOLO data.yaml",
               "images": "image folder of a COCO JSON", "epochs": "epochs", "batch": "batch size",
               "imgsz": "image size (a multiple of 32)", "device": "auto, cpu, cuda or cuda:N",
               "weights": "start from our checkpoint or a reference .pt", "out": "the run folder (resumed when it holds weights/last.pt)"}
    types = {"epochs": _positive_int, "batch": _positive_int, "imgsz": _image_size}
    for name, key in FLAGS.items():
        train.add_argument(f"--{name}", default=None, type=types.get(name, str), help=f"{help_of.get(name, '')} ({key})")
    train.add_argument("--config", default=None, metavar="FILE",
                       help="a .py file defining get_config() (e.g. a copy of a yolo_func/configs recipe) or a "
                            "run's config.json, instead of --model")
    train.add_argument("--resume", action="store_true", help="resume the latest run of the task (train.resume=true)")
    train.add_argument("--devices", default=None, metavar="0,1,...",
                       help="data-parallel training on these GPUs: starts torchrun with one process per device "
                            "(with --device cpu: that many gloo CPU processes); see docs/distributed.md")
    train.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. optim.lr0=0.02")


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``yolo-func`` console script.

    Args:
      argv: the arguments after the program name; None reads ``sys.argv[1:]``.

    Returns:
      The exit status: 0 on success; 2 for a usage error (argparse prints the usage and one
      ``yolo-func demo: error: argument --imgsz: ...`` line to stderr) or for a ``ValueError`` /
      ``TypeError`` raised by the library (printed as one ``error: ...`` line).

    Example:
      >>> main(["demo", "--imgsz", "64"])          # doctest: +ELLIPSIS
      yolov8n detect: ...
      0
      >>> main(["val", "--weights", "no-such.pt", "--data", "builtin", "--out", "val"])   # one error line on stderr
      2
    """
    parser = argparse.ArgumentParser(prog="yolo-func", description="Functional YOLOv8 training with torch.func")
    sub = parser.add_subparsers(dest="command")
    demo = sub.add_parser("demo", help="one forward pass on a random image; prints shapes and parameter count")
    demo.add_argument("--scale", default="n", choices=list("nsmlx"))
    demo.add_argument("--task", default="detect", choices=["detect", "segment", "pose"])
    demo.add_argument("--imgsz", type=_image_size, default=640, help="square input size, a positive multiple of 32")
    demo.add_argument("--batch", type=_positive_int, default=1, help="number of images (>= 1)")
    demo.add_argument("--seed", type=int, default=0)
    sub.add_parser("info", help="parameter counts of every scale and task")
    _add_train(sub)
    from yolo_func.cli_eval import add_eval_commands

    eval_handlers = add_eval_commands(sub, _image_size, _positive_int)
    from yolo_func.cli_export import add_export_command

    eval_handlers.update(add_export_command(sub, _image_size, _positive_int))
    try:
        # parse_known_args: ``key=value`` overrides may come before, between or after the flags
        # (``train optim.lr0=0.02 --epochs 3 data.workers=0``); argparse alone takes one run of them.
        args, extra = parser.parse_known_args(argv)
        args.argv = list(sys.argv[2:] if argv is None else argv[1:])  # the command's own arguments (--devices relaunches them)
        if args.command == "train" and all("=" in t and not t.startswith("-") for t in extra):
            args.overrides = [*args.overrides, *extra]
        elif extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    except SystemExit as e:  # usage errors (2) and --help (0): return the status instead of exiting
        return e.code if isinstance(e.code, int) else 2
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return {"demo": _demo, "info": _info, "train": _train, **eval_handlers}[args.command](args)
    except (ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    # torchrun workers (``-m yolo_func.cli``): @record writes an uncaught exception's traceback to
    # the file torchrun's agent reads, so the job's failure report shows the failing rank's error
    from torch.distributed.elastic.multiprocessing.errors import record

    sys.exit(record(main)())
