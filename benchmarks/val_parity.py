"""Validator parity: our ``evaluate`` (internal metric) and the reference's ``YOLO(pt).val`` on the
same weights, images, size and settings (issues #13 / #14: tells an evaluation gap from a
training gap).

    # CPU, the oracle venv (ultralytics and yolo_func importable), a pose run of ours:
    YOLO_OFFLINE=1 YOLO_CONFIG_DIR=$(mktemp -d) /work/oracle-venv/bin/python benchmarks/val_parity.py \\
        --weights runs/pose/weights/best.pt --data /tmp/pd/yolo/data.yaml --device cpu --out benchmarks/results
    # GPU machine (PYTHONPATH holding the carried wheels, as benchmarks/results/README.md says)
    python3 benchmarks/val_parity.py --weights /tmp/detect.pt /tmp/segment.pt --data coco-tiny --out $OUT

For each of our checkpoints (``yolo-func train``'s ``weights/best.pt``):

1. the reference's validator: the weights converted by ``benchmarks/to_reference_pt.py``, ``YOLO(pt).val(data=..., imgsz, batch, conf, iou,
   max_det, plots=False)`` (public API, black box); its ``results_dict``;
2. ours: :func:`yolo_func.eval.evaluate` (``coco=False``: the internal metric) on the same data
   (``--data``: a YOLO ``data.yaml``; ``coco-tiny`` / ``coco-pose-tiny`` write the shared COCO
   subset in the Ultralytics format first, so both read the same files).

Compared per kind: box and pose from ``evaluate``; for a segmentation checkpoint also ``mask``, from
the fit's per-epoch validation (:func:`yolo_func.train.fit.validate`: ``evaluate``'s internal
metric carries no mask labels), whose box row must equal ``evaluate``'s. P, R, mAP50, mAP50-95 and
their differences;
pass: every |mAP difference| <= ``--tol`` (0.002: the two forwards differ by float rounding only).
Writes ``val_parity_<stamp>.{json,md}`` under ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

from _fit_common import SHARED, host_meta, torchvision_nms_shim, utc_stamp  # noqa: E402

REF_SUFFIX = {"box": "B", "pose": "P", "mask": "M"}
KINDS = {"detect": ("box",), "segment": ("box", "mask"), "pose": ("box", "pose")}


def yolo_data(data: str, task: str, work: Path) -> Path:
    """A YOLO ``data.yaml``: ``data`` itself, or the shared COCO subset of that name written in the
    Ultralytics format (every image as the val split)."""
    p = Path(data)
    if p.suffix in (".yaml", ".yml"):
        if not p.is_file():
            raise SystemExit(f"val_parity: --data {data}: no such file")
        return p
    from yolo_func.data import CocoDataset
    from yolo_func.data.yolo import write_yolo_dataset

    root = SHARED / data
    if not (root / "annotations.json").is_file():
        raise SystemExit(f"val_parity: --data {data}: neither a data.yaml nor a shared dataset under {SHARED}")
    ds = CocoDataset(root / "annotations.json", root / "images", task=task)
    return write_yolo_dataset({"train": ds, "val": ds}, work / f"{data}-{task}")


def reference_metrics(pt: Path, data: Path, args, kinds) -> dict:
    from ultralytics import YOLO

    with contextlib.redirect_stdout(io.StringIO()):
        m = YOLO(str(pt)).val(data=str(data), imgsz=args.imgsz, batch=args.batch, conf=args.conf, iou=args.iou,
                              max_det=args.max_det, plots=False, device="cpu" if args.device == "cpu" else 0,
                              verbose=False, project=str(pt.parent), name="val", exist_ok=True, workers=args.workers)
    r = m.results_dict
    out = {}
    for k in kinds:
        s = REF_SUFFIX[k]
        out[k] = {"P": r[f"metrics/precision({s})"], "R": r[f"metrics/recall({s})"],
                  "mAP50": r[f"metrics/mAP50({s})"], "mAP50-95": r[f"metrics/mAP50-95({s})"]}
    return out


def our_metrics(w, data: Path, args, kinds) -> dict:
    """``evaluate``'s internal metric of the loaded checkpoint ``w`` (``cli_eval.load_weights``)."""
    from yolo_func.cli_eval import class_mapping, open_dataset
    from yolo_func.eval import evaluate

    ds = open_dataset(str(data), task=w.model.task)
    class_map, _ = class_mapping(w.names, list(ds.names))
    m = evaluate(w.model, w.params, w.state, ds, image_size=args.imgsz, batch_size=args.batch, device=args.device,
                 conf=args.conf, iou=args.iou, max_det=args.max_det, class_map=class_map, workers=args.workers,
                 progress=False, verbose=False, coco=False)["internal"]
    out = {k: {q: float(m[k][q]) for q in ("P", "R", "mAP50", "mAP50-95")} for k in kinds if k != "mask"}
    if "mask" in kinds:  # the fit's validation (the only mask metric of ours), same loader settings
        import torch

        from yolo_func import tree as T
        from yolo_func.configs import build_config
        from yolo_func.data import ValLoader
        from yolo_func.train.fit import validate

        if class_map != list(range(len(class_map))):
            raise SystemExit("val_parity: the mask row needs the checkpoint's classes in the dataset's order")
        cfg = build_config("yolov8n-seg", flags={"imgsz": args.imgsz},
                           overrides=[f"val.conf={args.conf}", f"val.iou={args.iou}", f"val.max_det={args.max_det}"])
        loader = ValLoader(ds, batch_size=args.batch, image_size=args.imgsz, workers=args.workers)
        dev = torch.device("cpu" if args.device == "cpu" else "cuda")
        amp = torch.float16 if dev.type == "cuda" else None  # as evaluate's precision="auto"
        v = validate(w.model, T.tree_to(w.params, dev), T.tree_to(w.state, dev), loader, ds,
                     config=cfg, device=dev, autocast_dtype=amp, progress=False)
        out["mask"] = {q: float(v["mask"][q]) for q in ("P", "R", "mAP50", "mAP50-95")}
        out["box_fit_validate"] = {q: float(v["box"][q]) for q in ("P", "R", "mAP50", "mAP50-95")}
    return out



def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--weights", nargs="+", required=True, help="our checkpoints")
    ap.add_argument("--data", nargs="+", required=True,
                    help="a YOLO data.yaml, or coco-tiny / coco-pose-tiny (shared data); one, or one per --weights")
    ap.add_argument("--imgsz", type=int, default=640)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--conf", type=float, default=0.001)
    ap.add_argument("--iou", type=float, default=0.7)
    ap.add_argument("--max-det", type=int, default=300)
    ap.add_argument("--workers", type=int, default=0)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tol", type=float, default=0.002)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)
    if len(args.data) not in (1, len(args.weights)):
        ap.error("--data: one, or one per --weights")
    shim = torchvision_nms_shim() if args.device == "cpu" else False
    from to_reference_pt import convert
    from yolo_func.cli_eval import load_weights

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="yolo_func_valparity_"))
    rows = []
    for i, weights in enumerate(args.weights):
        data_arg = args.data[0] if len(args.data) == 1 else args.data[i]
        t0 = time.perf_counter()
        w = load_weights(weights)  # read once: the task and our metric
        task = w.model.task
        kinds = KINDS[task]
        data = yolo_data(data_arg, task, work)
        ours = our_metrics(w, data, args, kinds)
        with contextlib.redirect_stdout(io.StringIO()):
            ref_pt = convert(weights, work / f"{i}_{Path(weights).stem}_as_ref.pt")
        ref = reference_metrics(ref_pt, data, args, kinds)
        diff = {k: {q: ours[k][q] - ref[k][q] for q in ours[k]} for k in kinds}
        if "box_fit_validate" in ours:  # the fit's validation scores boxes as evaluate does
            print(f"box mAP50-95: evaluate {ours['box']['mAP50-95']:.4f}, fit validate "
                  f"{ours.pop('box_fit_validate')['mAP50-95']:.4f}", flush=True)
        ok = all(abs(diff[k][q]) <= args.tol for k in kinds for q in ("mAP50", "mAP50-95"))
        rows.append({"weights": str(weights), "task": task, "data": str(data_arg), "ours": ours, "reference": ref,
                     "diff": diff, "pass": ok, "seconds": round(time.perf_counter() - t0, 1)})
        print(json.dumps(rows[-1]), flush=True)
    stamp = utc_stamp()
    meta = host_meta(sys.argv if argv is None else ["benchmarks/val_parity.py", *argv])
    meta.update(imgsz=args.imgsz, batch=args.batch, conf=args.conf, iou=args.iou, max_det=args.max_det, tol=args.tol,
                device=args.device, **({"note": "plain-torch NMS stand-in for the reference (CPU)"} if shim else {}))
    (out / f"val_parity_{stamp}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    md = [f"# Validator parity ({stamp})", "", f"`{meta['command']}`", "",
          "| weights | task | kind | ours P / R / mAP50 / mAP50-95 | reference P / R / mAP50 / mAP50-95 | diff mAP50 / mAP50-95 | pass |",
          "|---|---|---|---|---|---|---|"]
    for r in rows:
        for k in r["ours"]:
            o, f, d = r["ours"][k], r["reference"][k], r["diff"][k]
            md.append(f"| {Path(r['weights']).name} | {r['task']} | {k} | "
                      + " / ".join(f"{o[q]:.4f}" for q in ("P", "R", "mAP50", "mAP50-95")) + " | "
                      + " / ".join(f"{f[q]:.4f}" for q in ("P", "R", "mAP50", "mAP50-95")) + " | "
                      + f"{d['mAP50']:+.4f} / {d['mAP50-95']:+.4f} | {'PASS' if r['pass'] else 'FAIL'} |")
    (out / f"val_parity_{stamp}.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0 if all(r["pass"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
