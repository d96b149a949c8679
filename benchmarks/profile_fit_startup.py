"""Where the first epoch of a fit goes (issue 14, item 7): set-up phases, graph captures, steps.

``benchmarks/fit.py`` showed epoch 1's training phase far longer than the later epochs' (the
warm-up and the captures). This script runs one fit in this process and times, each with a
device synchronisation around it:

- the set-up phases ``yolo_func.train.fit`` calls (``load_datasets``, ``build_model``,
  ``init_train_state``, the loaders), and each validation;
- every capture the replay step builds (``capture_step`` / ``capture_vjp`` / ``capture_head``),
  with the target bucket ``M`` of the batch that triggered it;
- every training step (wall time after a sync), its epoch and ``M``.

Writes ``startup_<stamp>.json`` (every event) and prints a summary: seconds in captures, in
steps that captured, in plain steps, per epoch.

GPU example (the fit benchmark's data: coco-tiny repeated to 512 images)::

    python benchmarks/profile_fit_startup.py --batch 4 --epochs 2 --out /tmp/startup

CPU smoke run: ``--device cpu --imgsz 160 --images 16 --epochs 1 --workers 0``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

T0 = time.perf_counter()
sys.path.insert(0, str(Path(__file__).resolve().parent))
import _fit_common as C  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--task", default="segment", choices=["detect", "segment", "pose"])
    ap.add_argument("--data", default="coco-tiny")
    ap.add_argument("--images", type=int, default=512)
    ap.add_argument("--val-images", type=int, default=16)
    ap.add_argument("--imgsz", type=int, default=640)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--capture", default="auto")
    ap.add_argument("--override", action="append", default=[], help="extra key=value config overrides")
    ap.add_argument("--cprofile", action="store_true", help="also write the fit's cProfile (top 60 by cumulative time)")
    ap.add_argument("--no-import-thread", action="store_true",
                    help="skip fit's import thread (_warm_imports): the step imports what it needs when it needs it")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import tempfile

    import torch

    import importlib

    F = importlib.import_module("yolo_func.train.fit")  # the module (yolo_func.train.fit is also the function)
    R = importlib.import_module("yolo_func.train.replay")
    from yolo_func.configs import build_config

    t_import = time.perf_counter() - T0
    cuda = args.device != "cpu"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    events: list[dict] = []
    state = {"M": None, "epoch": 0}
    t_fit0 = [0.0]

    def now() -> float:
        return time.perf_counter() - t_fit0[0]

    def timed(module, name: str, kind: str):
        fn = getattr(module, name)

        def wrapper(*a, **k):
            sync()
            t = now()
            out = fn(*a, **k)
            sync()
            events.append({"kind": kind, "name": name, "start": round(t, 4), "seconds": round(now() - t, 4),
                           "M": state["M"], "epoch": state["epoch"]})
            return out

        setattr(module, name, wrapper)

    def timed_fn(fn, name: str):
        # a captured function's eager runs (the warm-ups) timed one by one; never synced while capturing
        def wrapper(*a, **k):
            capturing = cuda and torch.cuda.is_current_stream_capturing()
            if not capturing:
                sync()
            t = now()
            out = fn(*a, **k)
            if not capturing:
                sync()
            events.append({"kind": "capture_fn", "name": name, "start": round(t, 4), "seconds": round(now() - t, 4),
                           "capturing": capturing, "M": state["M"]})
            return out

        return wrapper

    def timed_capture(name: str):
        fn = getattr(R, name)

        def wrapper(f, *a, **k):
            sync()
            t = now()
            out = fn(timed_fn(f, name), *a, **k)
            sync()
            events.append({"kind": "capture", "name": name, "start": round(t, 4), "seconds": round(now() - t, 4),
                           "M": state["M"], "epoch": state["epoch"]})
            return out

        setattr(R, name, wrapper)

    if args.no_import_thread:
        F._warm_imports = lambda *a, **k: None
    for name in ("capture_step", "capture_vjp"):
        timed_capture(name)
    timed(R, "capture_head", "capture")
    # inside each validation: the network, the two postprocess calls, the host copies, COCO records
    for name in ("postprocess", "_dets_to_host", "val_gt_masks", "scale_to_original"):
        timed(F, name, "val_part")
    timed(F.CocoEvaluator, "process", "val_part")
    timed(F.MetricAccumulator, "process", "val_part")
    timed(F.MetricAccumulator, "compute", "val_part")
    for name in ("load_datasets", "build_model", "init_train_state", "validate", "_coco_setup", "_final_plots"):
        timed(F, name, "phase")
    for name in ("TrainLoader", "ValLoader", "ReplayTrainStep"):
        timed(F, name, "phase")

    # the batch's M is known before the step runs: wrap _to_device (called once per step)
    to_dev = F._to_device

    def to_device(batch, device):
        state["M"] = int(batch.targets.boxes.shape[1])
        return to_dev(batch, device)

    F._to_device = to_device

    tmp = Path(tempfile.mkdtemp(prefix="yolo_func_startup_"))
    data = C.make_data(args.data, args.task, args.images, args.val_images, tmp / "data")
    recipe = {"detect": "yolov8n", "segment": "yolov8n-seg", "pose": "yolov8n-pose"}[args.task]
    flags = {"data": data["coco"], "epochs": args.epochs, "batch": args.batch, "imgsz": args.imgsz,
             "device": args.device, "out": str(tmp / "run")}
    overrides = [f"train.capture={args.capture}", f"train.autocast={'bfloat16' if cuda else 'none'}",
                 f"data.workers={args.workers}", "data.cache=none", "train.plots=false", "train.val_every=1",
                 "train.seed=0"] + args.override
    config = build_config(recipe, flags=flags, overrides=overrides)
    nb = data["train_images"] // args.batch
    last = [None]

    def on_step(info) -> None:
        sync()
        t = now()
        state["epoch"] = info.epoch
        prev = last[0] if last[0] is not None else t
        events.append({"kind": "step", "epoch": info.epoch, "batch": info.batch_index, "end": round(t, 4),
                       "since_prev": round(t - prev, 4), "M": state["M"]})
        last[0] = t
        if info.batch_index == nb - 1:
            last[0] = None  # the next epoch's first step also counts the validation and loader wait

    sync()
    t_fit0[0] = time.perf_counter()
    if args.cprofile:
        import cProfile
        import io
        import pstats

        prof = cProfile.Profile()
        result = prof.runcall(F.fit, config, on_step=on_step, progress=False)
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(60)
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(40)
        if args.out:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / f"startup_{args.task}_b{args.batch}_cprofile.txt").write_text(buf.getvalue())
    else:
        result = F.fit(config, on_step=on_step, progress=False)
    sync()
    fit_s = time.perf_counter() - t_fit0[0]

    steps = [e for e in events if e["kind"] == "step"]
    caps = [e for e in events if e["kind"] == "capture"]
    summary = {"import_thread": not args.no_import_thread, "import_s": round(t_import, 3), "fit_s": round(fit_s, 3), "steps": len(steps),
               "first_step_end_s": steps[0]["end"] if steps else None,
               "capture_s": round(sum(e["seconds"] for e in caps), 3), "captures": len(caps),
               "capture_buckets": sorted({e["M"] for e in caps if e["M"] is not None}),
               "phases": {e["name"]: e["seconds"] for e in events if e["kind"] == "phase" and e["name"] != "validate"},
               "validate_s": [e["seconds"] for e in events if e.get("name") == "validate"]}
    per_epoch = {}
    for ep in sorted({s["epoch"] for s in steps}):
        st = [s for s in steps if s["epoch"] == ep]
        body = sorted(s["since_prev"] for s in st[1:])
        med = body[len(body) // 2] if body else 0.0
        per_epoch[ep] = {"steps": len(st), "first_end": st[0]["end"], "last_end": st[-1]["end"],
                         "median_step_s": round(med, 4),
                         "slow_steps": [(s["batch"], s["M"], s["since_prev"]) for s in st[1:] if s["since_prev"] > 5 * med + 0.02][:40],
                         "excess_s": round(sum(max(0.0, s["since_prev"] - med) for s in st[1:]), 3)}
    summary["per_epoch"] = per_epoch
    parts: dict = {}
    for e in events:
        if e["kind"] == "val_part":
            p = parts.setdefault(e["name"], [0, 0.0])
            p[0] += 1
            p[1] = round(p[1] + e["seconds"], 4)
    summary["val_parts_calls_seconds"] = parts
    summary["capture_fn_runs"] = [(e["name"], e["M"], e["capturing"], e["seconds"]) for e in events if e["kind"] == "capture_fn"][:24]
    summary["stopped"] = result.stopped
    text = json.dumps({"args": vars(args), "summary": summary, "events": events}, indent=1)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"startup_{args.task}_b{args.batch}_{C.utc_stamp()}.json").write_text(text)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
