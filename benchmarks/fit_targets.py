"""The training-loop issue's learning targets, each run through the CLI as a user would.

    # the GPU host (needs shared/data inside the checkout or ../shared/data beside it)
    python benchmarks/fit_targets.py --out $OUT --runs default coco-detect coco-segment coco-pose

Runs (each ``yolo-func train ...`` in its own process, wall-clock timed by this script):

- ``default``: ``yolo-func train`` with no argument (on CUDA: the built-in data at 640 with replay).
  Target: box mAP50 >= 0.85 within 3 minutes (read from ``results.csv``: the ``time`` of the
  first epoch at or above 0.85; that column counts from the start of the fit, the process
  start-up is reported beside it).
- ``coco-detect`` / ``coco-segment``: overfitting the 32 images of ``coco-tiny`` (train = val)
  from scratch: box mAP50 >= 0.5, and mask mAP50 >= 0.4 for segmentation.
- ``coco-pose``: ``coco-pose-tiny`` likewise: keypoint mAP50 >= 0.4.

The overfitting runs switch the augmentation off (the point is to memorise these images), step the
optimizer every batch (``optim.nbs`` = the batch: 32 images at batch 8 accumulated to 64 would make
one update per two epochs), never stop early (``train.patience=0``) and validate every
``--val-every`` epochs. Measured 2026-12-04 (benchmarks/results/README.md): segment box/mask mAP50
0.85 / 0.80, pose mAP50 0.48, each first met within ~70 s of fit. Extra ``key=value`` overrides after ``--`` go to every run.
Writes ``fit_targets_<stamp>.json`` / ``.md`` after each run (a timeout still leaves numbers).
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import json
import os
import subprocess
import sys
import time
from pathlib import Path

_REPO = Path(__file__).resolve().parents[1]
SHARED = next((p for p in (Path(os.environ.get("YOLO_FUNC_SHARED_DATA", "/nonexistent")), _REPO.parent / "shared" / "data",
                            _REPO / "shared" / "data") if p.is_dir()), _REPO.parent / "shared" / "data")

_NO_AUG = ["data.augment.mosaic=0", "data.augment.translate=0", "data.augment.scale=0", "data.augment.hsv_h=0",
           "data.augment.hsv_s=0", "data.augment.hsv_v=0", "data.augment.fliplr=0", "data.cache=ram"]


def runs(args) -> dict[str, dict]:
    over = ["--epochs", str(args.overfit_epochs), "--batch", str(args.overfit_batch), "--imgsz", "640",
            f"train.val_every={args.val_every}", f"optim.nbs={args.overfit_batch}", "train.patience=0", *_NO_AUG]
    return {
        "default": dict(argv=[], targets={"box/mAP50": 0.85}, within_s=180.0),
        "coco-detect": dict(argv=["--data", str(SHARED / "coco-tiny"), "--model", "yolov8n", *over],
                            targets={"box/mAP50": 0.5}),
        "coco-segment": dict(argv=["--data", str(SHARED / "coco-tiny"), "--model", "yolov8n-seg", *over],
                             targets={"box/mAP50": 0.5, "mask/mAP50": 0.4}),
        "coco-pose": dict(argv=["--data", str(SHARED / "coco-pose-tiny"), "--model", "yolov8n-pose", *over],
                          targets={"pose/mAP50": 0.4}),
    }


def read_rows(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    with open(path, newline="") as f:
        return [{k: float(v) for k, v in r.items() if v not in ("", None)} for r in csv.DictReader(f)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--runs", nargs="+", default=["default", "coco-detect", "coco-segment", "coco-pose"])
    ap.add_argument("--overfit-epochs", type=int, default=300)
    ap.add_argument("--overfit-batch", type=int, default=8)
    ap.add_argument("--val-every", type=int, default=25)
    ap.add_argument("--timeout", type=float, default=400.0, help="seconds per run")
    ap.add_argument("extra", nargs="*", help="key=value overrides for every run")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    command = "python benchmarks/fit_targets.py " + " ".join(sys.argv[1:])
    results = []
    table = runs(args)
    for name in args.runs:
        spec = table[name]
        folder = args.out / f"run_{name}"
        argv = [sys.executable, "-m", "yolo_func.cli", "train", *spec["argv"], "--out", str(folder), *args.extra]
        print(f"== {name}: {' '.join(argv[2:])}", flush=True)
        t0 = time.monotonic()
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=args.timeout, cwd=_REPO)
            rc, tail = done.returncode, (done.stdout[-1500:] + done.stderr[-1500:])
        except subprocess.TimeoutExpired as e:
            rc, tail = "timeout", str(e.stdout or "")[-1500:]
        wall = time.monotonic() - t0
        rows = read_rows(folder / "results.csv")
        row = {"run": name, "argv": argv[3:], "rc": rc, "process_s": round(wall, 1), "epochs": len(rows),
               "targets": spec["targets"], "tail": tail[-1200:]}
        if rows:
            last = rows[-1]
            row["fit_s"] = last.get("time")
            best = {k: max(r.get(k, 0.0) for r in rows) for k in spec["targets"]}
            row["best"] = best
            row["final"] = {k: last.get(k) for k in list(spec["targets"]) + [k.replace("mAP50", "mAP50-95") for k in spec["targets"]]}
            row["met"] = all(best[k] >= v for k, v in spec["targets"].items())
            first = next((r for r in rows if all(r.get(k, 0.0) >= v for k, v in spec["targets"].items())), None)
            row["first_epoch_meeting"] = None if first is None else int(first["epoch"])
            row["time_to_target_s"] = None if first is None else first["time"]
            if "within_s" in spec:
                row["met_within"] = first is not None and first["time"] <= spec["within_s"]
            row["curve"] = [{k: r.get(k) for k in ("epoch", "time", *spec["targets"])} for r in rows]
        print(json.dumps({k: v for k, v in row.items() if k not in ("tail", "curve")}), flush=True)
        results.append(row)
        meta = {"command": command, "stamp": stamp, "host": os.uname().nodename, "cpus": os.cpu_count()}
        try:
            import torch
            meta |= {"torch": torch.__version__, "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}
        except Exception:  # noqa: BLE001 -- metadata only
            pass
        (args.out / f"fit_targets_{stamp}.json").write_text(json.dumps({"meta": meta, "runs": results}, indent=1))
        lines = [f"# Training targets {stamp}", "", f"`{command}`", "", f"{meta}", "",
                 "| run | rc | epochs | process s | fit s | best | time to target s | met |", "|---|---|--:|--:|--:|---|--:|---|"]
        for r in results:
            lines.append(f"| {r['run']} | {r['rc']} | {r['epochs']} | {r['process_s']} | {r.get('fit_s')} | "
                         f"{r.get('best')} | {r.get('time_to_target_s')} | {r.get('met_within', r.get('met'))} |")
        (args.out / f"fit_targets_{stamp}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
