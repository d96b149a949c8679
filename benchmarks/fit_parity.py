"""Recipe parity: our trainer and the reference package's trainer (a black box, offline, plots
off), started from the same initial weights, on the same images, epochs, batch, size and recipe,
end within 0.02 mAP50-95 of each other (issue #14 item 6b).

    # one H200 (about 8 minutes: 3 seeds x 2 trainers)
    python benchmarks/fit_parity.py --out benchmarks/results
    python benchmarks/fit_parity.py --task segment --epochs 10 --seeds 0 1 --out benchmarks/results
    # CPU smoke (needs `ultralytics` importable by --ref-python)
    python benchmarks/fit_parity.py --device cpu --imgsz 64 --epochs 1 --seeds 0 --train-images 16 \
        --val-images 8 --workers 2 --ref-python /path/to/oracle/python --out /tmp/parity

For each seed:

1. Initial weights: the reference builds ``yolov8n{,-seg,-pose}.yaml`` with the data's class count
   (and keypoint shape) after ``torch.manual_seed(seed)`` (its own default initialisation) and
   saves it with ``YOLO.save`` (public API) as ``init_<seed>.pt``. Both trainers start from that
   file: ours with ``model.weights`` (``yolo_func.io`` reads reference ``.pt`` files; every head
   fits, so nothing is re-initialised), the reference with ``YOLO(init.pt).train(...)``.
2. Data: the built-in dataset of the task (``builtin_dataset(task, "train" / "val")``; 256 / 64
   images by default, ``--train-images`` / ``--val-images`` cut them), written once in the
   Ultralytics format (``write_yolo_dataset``); both trainers read that ``data.yaml`` (``--our-format
   coco`` gives ours the COCO JSON of the same images instead), so both train and validate on the
   same files and labels.
3. Our fit (``yolov8n`` recipe, ``train.seed=seed``, ``train.capture=auto`` on CUDA, BF16) and the
   reference's (``seed=seed``, AMP: FP16 with its GradScaler, which skips the steps whose gradients
   overflow), each in its own process; ``--precision fp32`` runs both in float32 instead. Recipe
   arguments passed to the reference explicitly, from our config's values: ``optimizer="SGD"``, ``lr0``, ``lrf``,
   ``momentum``, ``weight_decay``, ``warmup_*``, ``nbs``, ``cos_lr``, ``close_mosaic``, the
   augmentation gains (``mosaic``, ``translate``, ``scale``, ``degrees``, ``shear``, ``perspective``,
   ``hsv_*``, ``flip*``; ``mixup``, ``copy_paste``, ``cutmix`` 0, which ours does not have), the
   loss gains, ``conf`` / ``iou`` / ``max_det`` of the per-epoch validation.

``--cross-eval`` adds, per seed, each trainer's final weights (``weights/last.pt``: the EMA) scored
by the other's validator on the same val split and settings: ours through the reference's
``YOLO(pt).val`` (after ``benchmarks/to_reference_pt.py``), the reference's through our
``evaluate``. A gap that stays with the weights whichever validator scores them comes from the
training; one that follows the validator comes from the evaluation.

Compared: the last epoch's row of each ``results.csv`` (the per-epoch validation of the EMA
weights on the val split): box mAP50-95 and mAP50 (+ mask / pose). Pass: |mean(ours) -
mean(reference)| <= ``--tol`` (0.02) mAP50-95 for every kind, the means over the seeds; both
spreads (standard deviation and range over the seeds) reported. Writes
``parity_<task>_<stamp>.{json,md,csv,png}`` under ``--out`` after every fit (the CSV and PNG: the
per-epoch curves of every fit).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

from _fit_common import (REPO, emit_result, host_meta, make_data, oracle_env, run_child, tmp_dir,  # noqa: E402
                         torchvision_nms_shim, utc_stamp)

REF_YAML = {"detect": "yolov8{s}.yaml", "segment": "yolov8{s}-seg.yaml", "pose": "yolov8{s}-pose.yaml"}
RECIPE = {"detect": "yolov8{s}", "segment": "yolov8{s}-seg", "pose": "yolov8{s}-pose"}
KINDS = {"detect": ("box",), "segment": ("box", "mask"), "pose": ("box", "pose")}
REF_SUFFIX = {"box": "B", "mask": "M", "pose": "P"}


# ------------------------------------------------------------------------------------------ children


def child_init(spec: dict) -> None:
    """Initial weights, one file per seed, with the reference's own init (public API)."""
    import torch

    shim = torchvision_nms_shim() if spec["device"] == "cpu" else False
    from ultralytics import YOLO
    from ultralytics.nn.tasks import DetectionModel, PoseModel, SegmentationModel

    cls = {"detect": DetectionModel, "segment": SegmentationModel, "pose": PoseModel}[spec["task"]]
    files = {}
    for seed in spec["seeds"]:
        model = YOLO(spec["yaml"])
        torch.manual_seed(seed)
        kw = {"data_kpt_shape": tuple(spec["kpt_shape"])} if spec["task"] == "pose" else {}
        model.model = cls(spec["yaml"], nc=spec["classes"], verbose=False, **kw)
        path = Path(spec["dir"]) / f"init_{seed}.pt"
        model.save(str(path))
        files[seed] = str(path)
    emit_result({"files": files, "shim": shim})


def _read_csv(path: Path) -> list[dict]:
    with open(path) as f:
        return [{k.strip(): v.strip() for k, v in r.items()} for r in csv.DictReader(f)]


def _f(v) -> float | None:
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def _ref_metrics(row: dict, kinds) -> dict:
    """``{"box/mAP50": ..., "box/mAP50-95": ..., ...}`` from the reference's ``metrics/mAP50(B)``-style
    keys (a ``results.csv`` row or a validator's ``results_dict``)."""
    out = {}
    for k in kinds:
        s = REF_SUFFIX[k]
        out[f"{k}/mAP50"], out[f"{k}/mAP50-95"] = _f(row.get(f"metrics/mAP50({s})")), _f(row.get(f"metrics/mAP50-95({s})"))
    return out


def child_ours(spec: dict) -> None:
    from yolo_func.configs import build_config
    from yolo_func.train import fit

    cuda = spec["device"] != "cpu"
    flags = {"data": spec["data"], "epochs": spec["epochs"], "batch": spec["batch"], "imgsz": spec["imgsz"],
             "device": spec["device"], "out": spec["run_dir"], "weights": spec["weights"]}
    mixed = cuda and spec.get("precision", "mixed") == "mixed"
    overrides = [f"train.capture={spec['capture']}", f"train.autocast={'bfloat16' if mixed else 'none'}",
                 f"data.workers={spec['workers']}", "data.cache=none", "train.plots=false", "train.val_every=1",
                 f"train.seed={spec['seed']}", f"optim.lr0={spec['lr0']}"]
    config = build_config(spec["recipe"], flags=flags, overrides=overrides)
    t0 = time.perf_counter()
    result = fit(config, progress=True)
    fit_s = time.perf_counter() - t0
    curve = []
    for r in _read_csv(Path(result.run_dir) / "results.csv"):
        row = {"epoch": int(r["epoch"]), "time": _f(r.get("time"))}
        for k in spec["kinds"]:
            row[f"{k}/mAP50"], row[f"{k}/mAP50-95"] = _f(r.get(f"{k}/mAP50")), _f(r.get(f"{k}/mAP50-95"))
        curve.append(row)
    emit_result({"fit_s": fit_s, "stopped": result.stopped, "curve": curve})


def child_ref(spec: dict) -> None:
    import torch

    shim = torchvision_nms_shim() if spec["device"] == "cpu" else False
    import ultralytics
    from ultralytics import YOLO

    cuda = spec["device"] != "cpu"
    # built from the task's yaml (the task follows it) with the init file's weights transferred:
    # the public "build from YAML and transfer weights" route; checked below at the first step
    model = YOLO(spec["yaml"]).load(spec["weights"])
    init_sd = {k: v.float() for k, v in torch.load(spec["weights"], map_location="cpu", weights_only=False)["model"].state_dict().items()}
    check: dict = {}

    def on_train_start(trainer) -> None:
        sd = trainer.model.state_dict()
        diffs = {k: (sd[k].float().cpu() - v).abs().max().item() for k, v in init_sd.items()
                 if k in sd and sd[k].shape == v.shape and v.is_floating_point()}
        worst = max(diffs, key=diffs.get) if diffs else None
        check.update(init_keys=len(init_sd), init_keys_found=len(diffs), init_max_abs_diff=diffs.get(worst),
                     init_worst_key=worst, init_keys_differing=sum(d > 0 for d in diffs.values()))

    model.add_callback("on_train_start", on_train_start)
    kw = dict(data=spec["data"], epochs=spec["epochs"], batch=spec["batch"], imgsz=spec["imgsz"], workers=spec["workers"],
              plots=False, device=0 if cuda else "cpu", project=spec["project"], name=spec["name"], exist_ok=True,
              seed=spec["seed"], val=True, amp=spec.get("precision", "mixed") == "mixed", verbose=False, task=spec["task"],
              **spec["recipe_args"])
    t0 = time.perf_counter()
    metrics = model.train(**kw)
    if cuda:
        torch.cuda.synchronize()
    fit_s = time.perf_counter() - t0
    save_dir = Path(getattr(getattr(model, "trainer", None), "save_dir", Path(spec["project"]) / spec["name"]))
    curve = []
    for r in _read_csv(save_dir / "results.csv"):
        row = {"epoch": int(float(r["epoch"])), "time": _f(r.get("time"))}
        row.update(_ref_metrics(r, spec["kinds"]))
        curve.append(row)
    rd = getattr(metrics, "results_dict", None)
    final = {k: float(v) for k, v in rd.items()} if isinstance(rd, dict) else None
    emit_result({"fit_s": fit_s, "curve": curve, "final_eval_best": final, "ultralytics": ultralytics.__version__, **check,
                 **({"note": "torchvision's ops did not load here: NMS was a plain-torch stand-in (smoke run)"} if shim else {})})


def child_cross_ref(spec: dict) -> None:
    """Our final weights scored by the reference's validator (public API: ``YOLO(pt).val``)."""
    shim = torchvision_nms_shim() if spec["device"] == "cpu" else False
    from ultralytics import YOLO

    from to_reference_pt import convert

    Path(spec["dir"]).mkdir(parents=True, exist_ok=True)
    pt = convert(spec["weights"], Path(spec["dir"]) / "ours_as_ref.pt")
    cuda = spec["device"] != "cpu"
    m = YOLO(str(pt)).val(data=spec["data"], imgsz=spec["imgsz"], batch=spec["batch"], conf=spec["conf"], iou=spec["iou"],
                          max_det=spec["max_det"], plots=False, device=0 if cuda else "cpu", verbose=False,
                          project=spec["dir"], name="val", exist_ok=True, workers=spec["workers"])
    emit_result({"metrics": _ref_metrics(m.results_dict, spec["kinds"]), **({"note": "plain-torch NMS stand-in (smoke run)"} if shim else {})})


def child_cross_ours(spec: dict) -> None:
    """The reference's final weights scored by our validator (``evaluate``'s internal metric)."""
    from yolo_func.cli_eval import class_mapping, load_weights, open_dataset
    from yolo_func.eval import evaluate

    w = load_weights(spec["weights"])
    dataset = open_dataset(spec["data"], task=w.model.task)
    class_map, _ = class_mapping(w.names, list(dataset.names))
    metrics = evaluate(w.model, w.params, w.state, dataset, image_size=spec["imgsz"], batch_size=spec["batch"],
                       device=spec["device"], conf=spec["conf"], iou=spec["iou"], max_det=spec["max_det"],
                       class_map=class_map, workers=spec["workers"], progress=False, verbose=False, coco=False)
    internal = metrics["internal"]
    out = {}
    for k in spec["kinds"]:  # the internal metric has no "mask" (the val loader carries no mask labels)
        if k in internal:
            out[f"{k}/mAP50"], out[f"{k}/mAP50-95"] = _f(internal[k]["mAP50"]), _f(internal[k]["mAP50-95"])
    emit_result({"metrics": out, "source": w.source})


# -------------------------------------------------------------------------------------------- parent


def recipe_args(config) -> dict:
    """The reference trainer's arguments equal to our recipe's values (passed explicitly)."""
    o, a, lo, v = config.optim, config.data.augment, config.loss, config.val
    return dict(optimizer="SGD", lr0=o.lr0, lrf=o.lrf, momentum=o.momentum, weight_decay=o.weight_decay,
                warmup_epochs=o.warmup_epochs, warmup_momentum=o.warmup_momentum, warmup_bias_lr=o.warmup_bias_lr,
                nbs=o.nbs, cos_lr=o.cos_lr, close_mosaic=a.close_mosaic, mosaic=a.mosaic, translate=a.translate,
                scale=a.scale, degrees=a.degrees, shear=a.shear, perspective=a.perspective, hsv_h=a.hsv_h,
                hsv_s=a.hsv_s, hsv_v=a.hsv_v, flipud=a.flipud, fliplr=a.fliplr, mixup=0.0, copy_paste=0.0, cutmix=0.0,
                box=lo.box, cls=lo.cls, dfl=lo.dfl, pose=lo.pose, kobj=lo.kobj, conf=v.conf, iou=v.iou,
                max_det=v.max_det, patience=config.train.patience)


def summarize(runs: list[dict], kinds: tuple, tol: float) -> dict:
    out: dict = {"tol": tol, "kinds": {}}
    for k in kinds:
        entry = {}
        for impl in ("ours", "ref"):
            finals = [r["curve"][-1] for r in runs if r["impl"] == impl and r.get("curve")]
            d = {}
            for m in ("mAP50-95", "mAP50"):
                vals = [f[f"{k}/{m}"] for f in finals if f.get(f"{k}/{m}") is not None]
                d[m] = {"values": vals, "mean": statistics.fmean(vals) if vals else None,
                        "std": statistics.stdev(vals) if len(vals) > 1 else 0.0 if vals else None,
                        "min": min(vals) if vals else None, "max": max(vals) if vals else None}
            entry[impl] = d
        a, b = entry["ours"]["mAP50-95"]["mean"], entry["ref"]["mAP50-95"]["mean"]
        entry["diff_mAP50-95"] = None if a is None or b is None else a - b
        a50, b50 = entry["ours"]["mAP50"]["mean"], entry["ref"]["mAP50"]["mean"]
        entry["diff_mAP50"] = None if a50 is None or b50 is None else a50 - b50
        entry["pass"] = None if entry["diff_mAP50-95"] is None else abs(entry["diff_mAP50-95"]) <= tol
        out["kinds"][k] = entry
    verdicts = [e["pass"] for e in out["kinds"].values()]
    out["pass"] = None if any(v is None for v in verdicts) else all(verdicts)
    return out


def write_outputs(out: Path, base: str, meta: dict, runs: list[dict], summary: dict, kinds: tuple) -> None:
    (out / f"{base}.json").write_text(json.dumps({"meta": meta, "runs": runs, "summary": summary}, indent=1))
    with open(out / f"{base}.csv", "w", newline="") as f:
        w = csv.writer(f)
        cols = [f"{k}/{m}" for k in kinds for m in ("mAP50", "mAP50-95")]
        w.writerow(["impl", "seed", "epoch", "time"] + cols)
        for r in runs:
            for row in r.get("curve") or []:
                w.writerow([r["impl"], r["seed"], row["epoch"], row.get("time")] + [row.get(c) for c in cols])
    L = [f"# Recipe parity: {meta['task']} yolov8{meta['scale']}, {meta['date']}", "", f"`{meta['command']}`", "",
         f"host {meta['host']} ({meta['cpus']} CPUs), GPU {meta.get('gpu')}, torch {meta.get('torch')}, "
         f"ultralytics {meta.get('ultralytics')}, commit {meta.get('commit')}", "",
         f"{meta['train_images']} train + {meta['val_images']} val images ({meta['data_source']}), {meta['imgsz']} px, "
         f"batch {meta['batch']}, {meta['epochs']} epochs, SGD lr0 {meta['lr0']}, seeds {meta['seeds']}; both from the "
         "same reference-initialised `.pt` per seed; ours "
         f"{'BF16' if meta['device'] != 'cpu' and meta.get('precision', 'mixed') == 'mixed' else 'float32'}"
         f"{', capture ' + meta['capture'] if meta['device'] != 'cpu' else ''}, the reference "
         f"{'AMP' if meta.get('precision', 'mixed') == 'mixed' else 'float32 (amp=False)'}.", "",
         "## Final epoch (mean ± std over seeds, [min, max])", "",
         "| kind | metric | ours | reference | ours - reference | pass (abs(diff) <= tol on mAP50-95) |", "|---|---|--:|--:|--:|---|"]

    def ms(d):
        if d["mean"] is None:
            return "-"
        return f"{d['mean']:.4f} ± {d['std']:.4f} [{d['min']:.4f}, {d['max']:.4f}]"

    for k, e in summary["kinds"].items():
        for m in ("mAP50-95", "mAP50"):
            diff = e[f"diff_{m}"]
            L.append(f"| {k} | {m} | {ms(e['ours'][m])} | {ms(e['ref'][m])} | {'-' if diff is None else f'{diff:+.4f}'} | "
                     f"{e['pass'] if m == 'mAP50-95' else ''} |")
    L += ["", f"Overall: **{'PASS' if summary['pass'] else 'FAIL' if summary['pass'] is False else 'incomplete'}** "
          f"(tolerance {summary['tol']} mAP50-95, per kind, on the seed means).", "",
          "## Fits", "", "| impl | seed | status | fit s | whole process s | final " + " | final ".join(
              f"{k} mAP50-95" for k in kinds) + " |", "|---|--:|---|--:|--:|" + "--:|" * len(kinds)]
    for r in runs:
        last = (r.get("curve") or [{}])[-1]
        fit_s = "-" if r.get("fit_s") is None else f"{r['fit_s']:.1f}"
        whole = "-" if r.get("whole_s") is None else f"{r['whole_s']:.1f}"
        finals = " | ".join("-" if last.get(f"{k}/mAP50-95") is None else f"{last[f'{k}/mAP50-95']:.4f}" for k in kinds)
        status = r["status"] + (": " + r["error"] if r.get("error") else "")
        L.append(f"| {r['impl']} | {r['seed']} | {status} | {fit_s} | {whole} | {finals} |")
    L += ["", "Start check: ours logs no re-initialised head (`heads_reinitialised`: "
          + ", ".join(str(r.get("heads_reinitialised")) for r in runs if r["impl"] == "ours")
          + "); the reference model's weights at its first step minus the init file's, max |diff| (`init_max_abs_diff`): "
          + ", ".join(str(r.get("init_max_abs_diff")) for r in runs if r["impl"] == "ref") + "."]
    crossed = [r for r in runs if r.get("cross")]
    if crossed:
        L += ["", "## Cross evaluation (each trainer's final EMA weights, `weights/last.pt`)", "",
              "Own validator: the fit's last per-epoch validation; other validator: ours for the reference's weights "
              "(`evaluate`, internal metric), the reference's `val` for ours.", "",
              "| weights | seed | kind | own validator mAP50-95 | other validator mAP50-95 | other - own |",
              "|---|--:|---|--:|--:|--:|"]
        for r in crossed:
            last = (r.get("curve") or [{}])[-1]
            for k in kinds:
                own, other = last.get(f"{k}/mAP50-95"), (r["cross"] or {}).get(f"{k}/mAP50-95")
                diff = "-" if own is None or other is None else f"{other - own:+.4f}"
                L.append(f"| {r['impl']} | {r['seed']} | {k} | {'-' if own is None else f'{own:.4f}'} | "
                         f"{'-' if other is None else f'{other:.4f}'} | {diff} |")
            if r["cross"].get("error"):
                L.append(f"| {r['impl']} | {r['seed']} | error | {r['cross']['error']} | | |")
    L += ["", f"Curves: `{base}.csv` (every fit's per-epoch validation) and `{base}.png`."]
    (out / f"{base}.md").write_text("\n".join(L) + "\n")
    try:
        _plot(out / f"{base}.png", runs, kinds, meta)
    except Exception as e:  # noqa: BLE001 -- the numbers matter more than the picture
        print(f"plot skipped: {type(e).__name__}: {e}", flush=True)


def _plot(path: Path, runs: list[dict], kinds: tuple, meta: dict) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6 * len(kinds), 4.2))
    FigureCanvasAgg(fig)
    colors = {"ours": "tab:blue", "ref": "tab:orange"}
    for j, k in enumerate(kinds):
        ax = fig.add_subplot(1, len(kinds), j + 1)
        for r in runs:
            c = r.get("curve") or []
            if not c:
                continue
            ax.plot([x["epoch"] for x in c], [x.get(f"{k}/mAP50-95") or 0.0 for x in c], color=colors[r["impl"]],
                    alpha=0.8, marker=".", label=f"{'ours' if r['impl'] == 'ours' else 'reference'} seed {r['seed']}")
        ax.set_xlabel("epoch")
        ax.set_ylabel(f"{k} mAP50-95 (val)")
        ax.set_title(f"{meta['task']} yolov8{meta['scale']}: {k} mAP50-95")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(str(path), dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--child", choices=["init", "ours", "ref", "cross_ref", "cross_ours"], help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    ap.add_argument("--task", default="detect", choices=["detect", "segment", "pose"])
    ap.add_argument("--scale", default="n", choices=list("nsmlx"))
    ap.add_argument("--imgsz", type=int, default=640)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--lr0", type=float, default=0.01)
    ap.add_argument("--train-images", type=int, default=256)
    ap.add_argument("--val-images", type=int, default=64)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--capture", default="auto", help="our train.capture on CUDA")
    ap.add_argument("--our-format", default="yolo", choices=["yolo", "coco"], help="the data our trainer reads")
    ap.add_argument("--ref-python", default=sys.executable, help="the interpreter that imports ultralytics")
    ap.add_argument("--precision", default="mixed", choices=["mixed", "fp32"],
                    help="mixed: ours BF16 autocast on CUDA, the reference AMP (FP16 + GradScaler), each trainer's "
                         "default; fp32: both in float32 (train.autocast=none, amp=False), where the two trainers' "
                         "numerics can agree (REFERENCE.md 4.5)")
    ap.add_argument("--cross-eval", action="store_true",
                    help="also score each trainer's final weights with the other's validator (see the module docstring)")
    ap.add_argument("--tol", type=float, default=0.02)
    ap.add_argument("--run-timeout", type=float, default=300)
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    args = ap.parse_args()
    if args.child:
        spec = json.loads(args.spec)
        {"init": child_init, "ours": child_ours, "ref": child_ref, "cross_ref": child_cross_ref,
         "cross_ours": child_cross_ours}[args.child](spec)
        return

    from yolo_func.configs import build_config

    t_start = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = utc_stamp()
    base = f"parity_{args.task}_{stamp}"
    tmp = tmp_dir("yolo_func_parity_")
    kinds = KINDS[args.task]
    meta = host_meta(sys.argv)
    meta.update(task=args.task, scale=args.scale, imgsz=args.imgsz, batch=args.batch, epochs=args.epochs, seeds=args.seeds,
                lr0=args.lr0, device=args.device, capture=args.capture, workers=args.workers, tmp=str(tmp),
                precision=args.precision)
    print(f"[{time.perf_counter() - t_start:5.0f} s] writing the built-in {args.task} data under {tmp} ...", flush=True)
    data = make_data("builtin", args.task, args.train_images, args.val_images, tmp / "data")
    meta.update(train_images=data["train_images"], val_images=data["val_images"], data_source=data["source"])
    recipe = RECIPE[args.task].format(s=args.scale)
    our_config = build_config(recipe, overrides=[f"optim.lr0={args.lr0}"])
    rargs = recipe_args(our_config)
    meta["reference_args"] = rargs
    env_ref = oracle_env(tmp)
    script = str(Path(__file__).resolve())
    env_ours = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    kpt = None
    if args.task == "pose":
        from yolo_func.data import YoloDataset

        kpt = list(YoloDataset(data["yolo"], "train", task="pose").kpt_shape)
    print(f"[{time.perf_counter() - t_start:5.0f} s] initial weights (the reference's init, seeds {args.seeds}) ...", flush=True)
    init = run_child([args.ref_python, script, "--child", "init", "--spec", json.dumps(
        {"task": args.task, "yaml": REF_YAML[args.task].format(s=args.scale), "classes": data["classes"], "kpt_shape": kpt,
         "seeds": args.seeds, "dir": str(tmp), "device": args.device})], log=tmp / "init.log", timeout=300, env=env_ref)
    if init["error"]:
        print(init.get("log_tail"), flush=True)
        raise SystemExit(f"could not write the initial weights: {init['error']}")
    weights = {int(k): v for k, v in init["result"]["files"].items()}
    runs: list[dict] = []

    def record(run: dict) -> None:
        runs.append(run)
        keep = {k: v for k, v in run.items() if k not in ("log_tail", "curve")}
        last = (run.get("curve") or [{}])[-1]
        print(json.dumps(keep | {"final": last}), flush=True)
        if run.get("log_tail"):
            print(run["log_tail"], flush=True)
        write_outputs(out, base, meta, runs, summarize(runs, kinds, args.tol), kinds)

    def cross_eval(seed: int) -> None:
        """Seed ``seed``'s final weights, each scored by the other trainer's validator."""
        v = our_config.val
        common = {"device": args.device, "imgsz": args.imgsz, "batch": 2 * args.batch, "conf": v.conf, "iou": v.iou,
                  "max_det": v.max_det, "workers": min(args.workers, 4), "kinds": list(kinds), "data": data["yolo"]}
        jobs = [("ours", "cross_ref", tmp / "runs" / f"ours_s{seed}" / "weights" / "last.pt", args.ref_python, env_ref),
                ("ref", "cross_ours", tmp / "ref_runs" / f"ref_s{seed}" / "weights" / "last.pt", sys.executable, env_ours)]
        for weights_of, child, w, py, env in jobs:
            name = f"{child}_s{seed}"
            spec = {**common, "weights": str(w), "dir": str(tmp / name)}
            print(f"[{time.perf_counter() - t_start:5.0f} s] {name} ({weights_of}'s weights) ...", flush=True)
            r = run_child([py, script, "--child", child, "--spec", json.dumps(spec)], log=tmp / f"{name}.log",
                          timeout=args.run_timeout, env=env)
            run = next(x for x in runs if x["impl"] == weights_of and x["seed"] == seed)
            run["cross"] = (r["result"] or {}).get("metrics") if not r["error"] else {"error": r["error"]}
            if r["error"]:
                print(r.get("log_tail"), flush=True)
        write_outputs(out, base, meta, runs, summarize(runs, kinds, args.tol), kinds)

    try:
        for seed in args.seeds:
            for impl in ("ours", "ref"):
                name = f"{impl}_s{seed}"
                spec = {"device": args.device, "epochs": args.epochs, "batch": args.batch, "imgsz": args.imgsz,
                        "workers": args.workers, "seed": seed, "weights": weights[seed], "kinds": list(kinds),
                        "precision": args.precision}
                if impl == "ours":
                    spec.update(recipe=recipe, data=data["yolo"] if args.our_format == "yolo" else data["coco"],
                                run_dir=str(tmp / "runs" / name), capture=args.capture, lr0=args.lr0)
                    cmd, env = [sys.executable, script, "--child", "ours", "--spec", json.dumps(spec)], env_ours
                else:
                    spec.update(data=data["yolo"], project=str(tmp / "ref_runs"), name=name, recipe_args=rargs, task=args.task,
                                yaml=REF_YAML[args.task].format(s=args.scale))
                    cmd, env = [args.ref_python, script, "--child", "ref", "--spec", json.dumps(spec)], env_ref
                print(f"[{time.perf_counter() - t_start:5.0f} s] {name} ...", flush=True)
                r = run_child(cmd, log=tmp / f"{name}.log", timeout=args.run_timeout, env=env)
                run = {"impl": impl, "seed": seed, "whole_s": r["whole_s"], "status": "ok" if r["error"] is None else "error",
                       "log": str(tmp / f"{name}.log")}
                if r["error"]:
                    run.update(error=r["error"], log_tail=r.get("log_tail"))
                if impl == "ours":  # every head must come from the init file (fit logs re-initialised heads)
                    run["heads_reinitialised"] = "re-initialised" in (tmp / f"{name}.log").read_text(errors="replace")
                if r["result"]:
                    run.update(r["result"])
                    meta["ultralytics"] = r["result"].get("ultralytics", meta.get("ultralytics"))
                record(run)
            if args.cross_eval:
                cross_eval(seed)
    except Exception:  # noqa: BLE001 -- the fits so far are written
        traceback.print_exc()
    print(f"wrote {out / base}.{{json,md,csv,png}} ({time.perf_counter() - t_start:.0f} s); logs and runs in {tmp}", flush=True)
    print((out / f"{base}.md").read_text(), flush=True)


if __name__ == "__main__":
    main()
