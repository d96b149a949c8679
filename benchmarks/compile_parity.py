"""The compiled step tracks the plain one: loss curves side by side over N steps of the built-in data.

    python benchmarks/compile_parity.py --out benchmarks/results                    # GPU: 200 steps, every task
    python benchmarks/compile_parity.py --tasks detect --steps 200 --compile max-autotune
    python benchmarks/compile_parity.py --device cpu --imgsz 64 --batch 2 --steps 6 --compile aot_eager --out /tmp/cp

Two training states start from the same weights; each step feeds the *same* loader batch (the
built-in dataset of the task, the fit's augmentation, ``yolo_sgd`` + EMA as the fit builds them) to
a plain :class:`~yolo_func.train.replay.ReplayTrainStep` and to one with ``compile=`` (same
``capture`` level: ``step`` on CUDA, ``none`` on the CPU; BF16 on CUDA). Every step's total loss
and loss parts of both are recorded.

Stated tolerance (the pass line): the mean total loss of the last ``--window`` steps (default 50)
of the compiled run is within ``--tol`` (default 5%) of the plain run's, relative. Inductor's fused
kernels re-associate floating-point sums and BF16 rounds differently, so the two runs are not
bitwise equal and drift apart like two seeds of the same trainer do not; the criterion checks that
they train alike. Also reported: the largest relative gap of the ``--window``-step moving averages
over the whole run, and the compile seconds.

Writes ``compile_parity_<stamp>.{json,md}`` (the command, GPU, torch version, per-step losses, a
table every ``--every`` steps) and ``.png`` (both curves per task) when matplotlib is importable.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from yolo_func import tree as T  # noqa: E402
from yolo_func import yolov8  # noqa: E402
from yolo_func.data import TrainLoader, builtin_dataset  # noqa: E402
from yolo_func.optim import ema  # noqa: E402
from yolo_func.structures.records import Targets  # noqa: E402
from yolo_func.train import init_train_state, yolo_sgd  # noqa: E402
from yolo_func.train.compiled import CompiledModel  # noqa: E402
from yolo_func.train.replay import ReplayTrainStep  # noqa: E402
from yolo_func.train.state import Batch  # noqa: E402


def _to(batch: Batch, device: torch.device) -> Batch:
    if device.type == "cpu":
        return batch._replace(images=batch.images.contiguous())
    t = batch.targets
    return Batch(batch.images.to(device, non_blocking=True), Targets(*(None if v is None else v.to(device) for v in t)))


def _moving(xs: list[float], w: int) -> list[float]:
    return [statistics.fmean(xs[max(0, i - w + 1): i + 1]) for i in range(len(xs))]


def run_task(task: str, args, device: torch.device) -> dict:
    data = builtin_dataset(task, "train")
    num_classes = len(getattr(data, "names", [])) or None
    model = yolov8(args.scale, task=task, num_classes=num_classes)
    epochs = max(1, -(-args.steps // max(1, len(data) // args.batch)))  # enough epochs for --steps
    loader = TrainLoader(data, batch_size=args.batch, image_size=args.imgsz, workers=args.workers, seed=0, task=task,
                         epochs=epochs)
    nb = len(loader)
    opt = yolo_sgd(batch_size=args.batch, batches_per_epoch=nb, epochs=epochs)
    e = ema()
    capture = "step" if device.type == "cuda" else "none"
    ts_plain = init_train_state(model, opt.tx, torch.Generator().manual_seed(0), device=device, ema=e)
    ts_comp = T.tree_clone(ts_plain)
    cm = CompiledModel(model, args.compile)
    plain = ReplayTrainStep(model, opt.tx, ema=e, capture=capture)
    comp = ReplayTrainStep(model, opt.tx, ema=e, capture=capture, compile=cm)
    curves: dict = {"plain": [], "compiled": [], "plain_parts": [], "compiled_parts": []}
    step = 0
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        for host_batch in loader:
            if step >= args.steps:
                break
            b = _to(host_batch, device)
            ts_plain, m_p = plain(ts_plain, b)
            m_p = {k: float(v) for k, v in m_p.items() if k == "loss" or k.startswith("loss/")}
            ts_comp, m_c = comp(ts_comp, b)
            m_c = {k: float(v) for k, v in m_c.items() if k == "loss" or k.startswith("loss/")}
            curves["plain"].append(m_p.pop("loss"))
            curves["compiled"].append(m_c.pop("loss"))
            curves["plain_parts"].append(m_p)
            curves["compiled_parts"].append(m_c)
            step += 1
        if step >= args.steps:
            break
    w = min(args.window, len(curves["plain"]))
    last_p, last_c = statistics.fmean(curves["plain"][-w:]), statistics.fmean(curves["compiled"][-w:])
    rel = abs(last_c - last_p) / max(abs(last_p), 1e-12)
    mp, mc = _moving(curves["plain"], w), _moving(curves["compiled"], w)
    worst = max(abs(c - p) / max(abs(p), 1e-12) for p, c in zip(mp, mc))
    return {"task": task, "steps": step, "capture": capture, "compile": cm.mode, "compile_s": round(cm.compile_seconds, 2),
            "compile_parts": {k: round(v, 2) for k, v in cm.compile_times.items()}, "window": w,
            "last_window_mean": {"plain": last_p, "compiled": last_c}, "last_window_rel_gap": rel,
            "max_moving_avg_rel_gap": worst, "pass": rel <= args.tol, "curves": curves}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tasks", nargs="+", default=["detect", "segment", "pose"])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--imgsz", type=int, default=640)
    ap.add_argument("--scale", default="n")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--compile", default="default", choices=["default", "max-autotune", "aot_eager"])
    ap.add_argument("--window", type=int, default=50)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--tol", type=float, default=0.05)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    args = ap.parse_args()
    device = torch.device(args.device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H%M%SZ")
    meta = {"command": "python " + " ".join(sys.argv), "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "date": stamp, "image_size": args.imgsz, "batch": args.batch, "scale": args.scale,
            "tol": args.tol, "inductor_cache_dir": os.environ.get("TORCHINDUCTOR_CACHE_DIR")}
    results = []
    for task in args.tasks:
        r = run_task(task, args, device)
        results.append(r)
        print(json.dumps({k: v for k, v in r.items() if k != "curves"}), flush=True)
        json.dump({"meta": meta, "results": results}, open(out / f"compile_parity_{stamp}.json", "w"), indent=1)
    lines = [f"# Compiled vs plain step, yolov8{args.scale}, {args.imgsz} px, batch {args.batch} — {meta['device']}, "
             f"torch {meta['torch']}, {stamp}", "", f"Command: `{meta['command']}`", "",
             f"Pass: mean loss of the last {args.window} steps within {100 * args.tol:.0f}% (relative).", "",
             "| task | steps | capture | compile | compile s | last-window mean plain / compiled | gap | max moving-avg gap | pass |",
             "|---|---:|---|---|---:|---|---:|---:|---|"]
    for r in results:
        lw = r["last_window_mean"]
        lines.append(f"| {r['task']} | {r['steps']} | {r['capture']} | {r['compile']} | {r['compile_s']:.0f} | "
                     f"{lw['plain']:.4f} / {lw['compiled']:.4f} | {100 * r['last_window_rel_gap']:.2f}% | "
                     f"{100 * r['max_moving_avg_rel_gap']:.2f}% | {'yes' if r['pass'] else 'NO'} |")
    for r in results:
        lines += ["", f"## {r['task']}: total loss every {args.every} steps", "", "| step | plain | compiled |", "|---:|---:|---:|"]
        for i in range(0, r["steps"], args.every):
            lines.append(f"| {i} | {r['curves']['plain'][i]:.4f} | {r['curves']['compiled'][i]:.4f} |")
    (out / f"compile_parity_{stamp}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:8 + len(results)]))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:  # noqa: BLE001 -- the plot is optional
        return 0 if all(r["pass"] for r in results) else 1
    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 3.5), squeeze=False)
    for ax, r in zip(axes[0], results):
        ax.plot(r["curves"]["plain"], label="plain", lw=1)
        ax.plot(r["curves"]["compiled"], label=f"compiled ({r['compile']})", lw=1)
        ax.set_title(r["task"])
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / f"compile_parity_{stamp}.png", dpi=110)
    return 0 if all(r["pass"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
