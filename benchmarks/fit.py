"""Complete-fit benchmark: our trainer eager vs replayed, then the reference package's own trainer,
on the same images, epochs, batch and size (issue #14 item 7).

    # one H200 (about 6 minutes): nano segmentation, 640 px, BF16, 5 epochs, 512 + 16 images
    python benchmarks/fit.py --out benchmarks/results --pairs 2 --batches 4 16 64
    # CPU smoke (replay rows are skipped there; the reference rows need `ultralytics` importable)
    python benchmarks/fit.py --device cpu --imgsz 64 --images 16 --val-images 4 --epochs 1 --batches 4 \
        --pairs 1 --workers 2 --out /tmp/fitbench [--no-ref]

Data: ``coco-tiny`` (../shared/data, or shared/data inside the checkout on the GPU machine)
repeated to ``--images`` training images, its first ``--val-images`` as the validation split
(``--data builtin``: the built-in train / val splits cut or repeated likewise). Written once as a
COCO folder (our trainer's input, ``--our-format coco``) and as an Ultralytics-format copy of the
same files (the reference's input; ``--our-format yolo`` makes ours read it too).

Each fit runs in a fresh child process (``python benchmarks/fit.py --child ...``):

- ``whole_s``: the parent's clock from starting the child to its exit (interpreter start,
  imports, dataset scan, fit, worker shutdown);
- ``fit_s``: the child's clock around ``yolo_func.train.fit(config)`` (ours) or
  ``YOLO(yaml).train(...)`` (the reference; the model's construction before it is ``build_s``),
  synchronised at the end;
- a breakdown from the step hook (ours: ``on_step``; the reference: its public callbacks):
  ``startup_s`` (fit entry to the end of the first step: data, model, loader workers, the first
  step with its captures), ``train_windows_s`` (each epoch from the end of its first step to the
  end of its last, synchronised), ``between_epochs_s`` (validation, checkpoints, the next epoch's
  start), ``tail_s`` (the last step to the fit's return: last validation, saves, the reference's
  final validation of ``best.pt``);
- ``gpu_idle_share``: 1 - mean GPU utilisation / 100 over the training windows, from NVML's own
  utilisation samples (pynvml; else polled NVML, else ``nvidia-smi -lms 100``). NVML's utilisation
  is the fraction of each sample period (about 1/6 s on recent GPUs) in which at least one kernel
  was running: it counts a tiny kernel as busy as a full one (not SM occupancy), the windows' edges
  are placed to one sample period, and the first step of each epoch is outside its window;
- ``hash``: sha256 of the final ``TrainState`` (params + BN statistics = ``model``, the EMA's
  params and statistics = ``ema``, every leaf = ``all``) after each of our fits: eager and replay
  are designed to end with the same bytes (same seed, same data order).

Our config: the ``yolov8n-seg`` recipe (``--task``/``--scale``), batch, 640 px, ``train.autocast=
bfloat16`` on CUDA, ``train.capture=none`` (eager) or ``auto`` (replay: ``step`` when every head
is capturable), ``data.workers`` 8, ``data.cache=none`` (the reference's default), ``train.plots=
false``, validation every epoch (as the reference), seed 0. The reference: ``YOLO("yolov8n-seg.yaml")
.train(data=..., epochs, batch, imgsz, workers=8, plots=False, device, optimizer="SGD", lr0=0.01,
seed=0, val=True, amp=True)``, offline (``YOLO_OFFLINE=1``), its settings in a temp folder.

Order: for each batch, eager and replay alternate in pairs (``--pairs``), then the reference
(``--ref-runs`` times) at that batch, so a run cut short by a time limit still holds complete
comparisons for the first batches. ``fit_<UTC stamp>.json`` and ``.md`` are rewritten after every
run (command, host, versions, a row per run, a summary per batch with medians and ranges, the
ratios and the issue's targets).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

from _fit_common import (REPO, GpuUtilSampler, Timeline, device_index, emit_result, fmt_stat, host_meta,  # noqa: E402
                         make_data, oracle_env, run_child, scalars, stats, tmp_dir,
                         torchvision_nms_shim, tree_sha256, utc_stamp)

REF_YAML = {"detect": "yolov8{s}.yaml", "segment": "yolov8{s}-seg.yaml", "pose": "yolov8{s}-pose.yaml"}
RECIPE = {"detect": "yolov8{s}", "segment": "yolov8{s}-seg", "pose": "yolov8{s}-pose"}
#: targets of issue #14 item 7 (one H200)
TARGETS = {"replay_reduction_b4": 0.5, "ref_over_ours_b4": 3.0, "ref_over_ours_b16": 2.5, "gpu_idle_share": 0.15}


# ------------------------------------------------------------------------------------------ children


def warm_imports(env_ref: dict | None, ref_python: str) -> dict:
    """One untimed interpreter per trainer that imports its modules (and ``torch._dynamo``, which
    ``torch.func``'s backward imports), so that no timed fit pays for compiling Python bytecode
    that an installed package has cached after its first use. A freshly provisioned host (wheels
    installed with ``--no-compile``, a torch whose dynamo modules were never imported) would
    otherwise charge several seconds of it to whichever fit runs first. Returns the seconds each took."""
    out = {}
    ours = "import torch, torch._dynamo, torch.func, yolo_func.train.fit, yolo_func.eval, pycocotools.cocoeval"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", ours], check=False, env=env, cwd=str(REPO))
    out["ours"] = round(time.perf_counter() - t0, 2)
    if env_ref is not None:
        ref = ("import torch, torch._dynamo, ultralytics; from ultralytics import YOLO; "
               "import ultralytics.models.yolo.detect, ultralytics.models.yolo.segment, ultralytics.models.yolo.pose")
        t0 = time.perf_counter()
        subprocess.run([ref_python, "-c", ref], check=False, env=env_ref, cwd=str(REPO))
        out["ref"] = round(time.perf_counter() - t0, 2)
    return out


def child_ours(spec: dict) -> None:
    import torch

    from yolo_func.configs import build_config
    from yolo_func.train import fit

    cuda = spec["device"] != "cpu"
    flags = {"data": spec["data"], "epochs": spec["epochs"], "batch": spec["batch"], "imgsz": spec["imgsz"],
             "device": spec["device"], "out": spec["run_dir"]}
    overrides = [f"train.capture={spec['capture']}", f"train.autocast={'bfloat16' if cuda else 'none'}",
                 f"data.workers={spec['workers']}", "data.cache=none", "train.plots=false", "train.val_every=1",
                 "train.seed=0"] + list(spec.get("overrides", []))
    config = build_config(spec["recipe"], flags=flags, overrides=overrides)
    nb = spec["train_images"] // spec["batch"]
    tl = Timeline(torch.cuda.synchronize if cuda else (lambda: None))
    sampler = GpuUtilSampler(device_index()).start() if cuda else None

    def on_step(info) -> None:
        tl.step(info.epoch, info.batch_index == nb - 1)

    tl.t_fit0 = time.time()
    t0 = time.perf_counter()
    result = fit(config, on_step=on_step, progress=True)
    if cuda:
        torch.cuda.synchronize()
    fit_s = time.perf_counter() - t0
    t_end = time.time()
    out = {"fit_s": fit_s, "stopped": result.stopped, "epochs_done": result.epochs_done, "steps": result.steps,
           **tl.summary(t_end)}
    if sampler is not None:
        sampler.stop()
        idle = sampler.idle_share(tl.windows())
        whole = sampler.idle_share([(tl.t_fit0, t_end)])
        out.update(gpu_idle_share=idle["idle_share"], gpu_samples=idle["samples"], gpu_method=idle["method"],
                   gpu_error=idle.get("error"), gpu_idle_share_fit=whole["idle_share"])
        out["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
    ts = result.train_state
    out["hash"] = {"model": tree_sha256({"params": ts.params, "state": ts.state}),
                   "ema": tree_sha256(ts.ema.ema) if ts.ema is not None else None,
                   "all": tree_sha256(ts._asdict())}
    m = result.metrics or {}
    out["metrics"] = scalars(m)
    out["capture"] = spec["capture"]
    try:  # where the time between training windows went: the fit's per-epoch phases (events.jsonl)
        events = [json.loads(line) for line in (Path(result.run_dir) / "events.jsonl").read_text().splitlines()]
        out["epoch_timing"] = [e.get("timing") for e in events if e["event"] == "epoch"]
        out["checkpoint_events"] = [{k: e.get(k) for k in ("epoch", "seconds", "copy_seconds", "background")}
                                    for e in events if e["event"] == "checkpoint"]
    except (OSError, ValueError, KeyError) as e:
        out["epoch_timing_error"] = f"{type(e).__name__}: {e}"
    emit_result(out)


def child_ref(spec: dict) -> None:
    import torch

    shim = torchvision_nms_shim() if spec["device"] == "cpu" else False
    import ultralytics
    from ultralytics import YOLO

    cuda = spec["device"] != "cpu"
    tl = Timeline(torch.cuda.synchronize if cuda else (lambda: None))
    nb = spec["train_images"] // spec["batch"]
    state = {"epoch": -1, "batch": 0}

    def on_epoch_start(trainer) -> None:
        state["epoch"] += 1
        state["batch"] = 0

    def on_batch_end(trainer) -> None:
        state["batch"] += 1
        tl.step(state["epoch"], state["batch"] == nb)

    t_b = time.perf_counter()
    model = YOLO(spec["model"])
    build_s = time.perf_counter() - t_b
    model.add_callback("on_train_epoch_start", on_epoch_start)
    model.add_callback("on_train_batch_end", on_batch_end)
    sampler = GpuUtilSampler(device_index()).start() if cuda else None
    kw = dict(data=spec["data"], epochs=spec["epochs"], batch=spec["batch"], imgsz=spec["imgsz"], workers=spec["workers"],
              plots=False, device=0 if cuda else "cpu", optimizer="SGD", lr0=spec.get("lr0", 0.01), project=spec["project"],
              name=spec["name"], exist_ok=True, seed=spec.get("seed", 0), val=True, amp=True, verbose=False)
    kw.update(spec.get("extra", {}))
    tl.t_fit0 = time.time()
    t0 = time.perf_counter()
    metrics = model.train(**kw)
    if cuda:
        torch.cuda.synchronize()
    fit_s = time.perf_counter() - t0
    t_end = time.time()
    out = {"fit_s": fit_s, "build_s": build_s, "ultralytics": ultralytics.__version__, **tl.summary(t_end)}
    if shim:
        out["note"] = "torchvision's ops did not load here: NMS was a plain-torch stand-in (smoke run)"
    if sampler is not None:
        sampler.stop()
        idle = sampler.idle_share(tl.windows())
        whole = sampler.idle_share([(tl.t_fit0, t_end)])
        out.update(gpu_idle_share=idle["idle_share"], gpu_samples=idle["samples"], gpu_method=idle["method"],
                   gpu_error=idle.get("error"), gpu_idle_share_fit=whole["idle_share"])
        out["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
    out["metrics"] = scalars(getattr(metrics, "results_dict", None) or {})
    emit_result(out)


# -------------------------------------------------------------------------------------------- parent


def summarize(rows: list[dict], batches: list[int]) -> dict:
    out = {}
    for b in batches:
        s: dict = {}
        for variant in ("eager", "replay", "ref"):
            rr = [r for r in rows if r["batch"] == b and r["variant"] == variant and r.get("status") == "ok"]
            s[variant] = {"fit_s": stats([r["fit_s"] for r in rr]), "whole_s": stats([r["whole_s"] for r in rr]),
                          "gpu_idle_share": stats([r.get("gpu_idle_share") for r in rr]),
                          "startup_s": stats([r.get("startup_s") for r in rr]),
                          "train_windows_s": stats([r.get("train_windows_s") for r in rr]),
                          "between_epochs_s": stats([r.get("between_epochs_s") for r in rr]),
                          "tail_s": stats([r.get("tail_s") for r in rr])}

        def med(v, k):
            return (s[v][k] or {}).get("median")

        ratios = {}
        for k in ("fit_s", "whole_s"):
            e, r, ref = med("eager", k), med("replay", k), med("ref", k)
            if e and r:
                ratios[f"replay_reduction_{k}"] = 1 - r / e
            for v, x in (("replay", r), ("eager", e)):
                if ref and x:
                    ratios[f"ref_over_{v}_{k}"] = ref / x
        s["ratios"] = ratios
        hashes = {r["variant"]: set() for r in rows if r["batch"] == b and r.get("hash")}
        for r in rows:
            if r["batch"] == b and r.get("hash"):
                hashes[r["variant"]].add(r["hash"]["all"])
        allh = set().union(*hashes.values()) if hashes else set()
        s["hashes"] = {"distinct_all": len(allh), "eager_equals_replay": (len(allh) == 1 and len(hashes) == 2) if len(hashes) == 2 else None,
                       "eager_runs_agree": len(hashes.get("eager", ())) <= 1}
        out[str(b)] = s
    return out


def write_outputs(out: Path, stamp: str, meta: dict, rows: list[dict], summary: dict) -> None:
    (out / f"fit_{stamp}.json").write_text(json.dumps({"meta": meta, "rows": rows, "summary": summary}, indent=1))
    L = [f"# Complete-fit benchmark {meta['date']}", "", f"`{meta['command']}`", "",
         f"host {meta['host']} ({meta['cpus']} CPUs), GPU {meta.get('gpu')}, torch {meta.get('torch')}, "
         f"ultralytics {meta.get('ultralytics')}, commit {meta.get('commit')}", "",
         f"{meta['task']} yolov8{meta['scale']}, {meta['imgsz']} px, {meta['epochs']} epochs, "
         f"{meta.get('train_images')} train + {meta.get('val_images')} val images ({meta.get('data_source')}), "
         f"{meta['workers']} workers, no RAM cache, plots off, validation every epoch; ours "
         f"{'BF16' if meta['device'] != 'cpu' else 'float32'}, train.vjp={meta.get('vjp', 'func')}, the reference AMP.", "",
         f"Before the timed fits, one untimed interpreter per trainer imported its modules (Python bytecode "
         f"cached, as on any machine after a first run): {meta.get('warm_imports_s', 'skipped (--no-warm-imports)')} s.", "",
         "## Runs", "",
         "| # | batch | variant | status | complete fit s | whole process s | start-up s | train windows s | between epochs s | tail s | GPU idle | peak GiB | model hash |",
         "|--:|--:|---|---|--:|--:|--:|--:|--:|--:|--:|--:|---|"]

    def f(v, d=1, pct=False):
        return "-" if v is None else (f"{100 * v:.{d}f}%" if pct else f"{v:.{d}f}")

    for i, r in enumerate(rows):
        h = (r.get("hash") or {}).get("all")
        L.append(f"| {i + 1} | {r['batch']} | {r['variant']} | {r.get('status')}{': ' + r['error'] if r.get('error') else ''} | "
                 f"{f(r.get('fit_s'))} | {f(r.get('whole_s'))} | {f(r.get('startup_s'))} | {f(r.get('train_windows_s'))} | "
                 f"{f(r.get('between_epochs_s'))} | {f(r.get('tail_s'))} | {f(r.get('gpu_idle_share'), 1, True)} | "
                 f"{f(r.get('peak_reserved_gib'), 2)} | {h[:12] if h else '-'} |")
    L += ["", "## Summary (median and range over the runs)", "",
          "| batch | variant | complete fit s | whole process s | start-up s | train windows s | between epochs s | tail s | GPU idle (train windows) |",
          "|--:|---|--:|--:|--:|--:|--:|--:|--:|"]
    for b, s in summary.items():
        for v in ("eager", "replay", "ref"):
            x = s[v]
            if x["fit_s"] is None:
                continue
            L.append(f"| {b} | {v} | {fmt_stat(x['fit_s'])} | {fmt_stat(x['whole_s'])} | {fmt_stat(x['startup_s'])} | "
                     f"{fmt_stat(x['train_windows_s'])} | {fmt_stat(x['between_epochs_s'])} | {fmt_stat(x['tail_s'])} | "
                     f"{fmt_stat(x['gpu_idle_share'], 1, True)} |")
    L += ["", "## Ratios and targets (issue #14 item 7, one H200)", "",
          "| batch | replay shorter than eager (fit / whole) | reference / replay (fit / whole) | reference / eager (fit / whole) | eager bytes == replay bytes |",
          "|--:|--:|--:|--:|---|"]

    def g(d, k, pct=False):
        v = d.get(k)
        return "-" if v is None else (f"{100 * v:.0f}%" if pct else f"{v:.2f}x")

    for b, s in summary.items():
        r = s["ratios"]
        L.append(f"| {b} | {g(r, 'replay_reduction_fit_s', True)} / {g(r, 'replay_reduction_whole_s', True)} | "
                 f"{g(r, 'ref_over_replay_fit_s')} / {g(r, 'ref_over_replay_whole_s')} | "
                 f"{g(r, 'ref_over_eager_fit_s')} / {g(r, 'ref_over_eager_whole_s')} | {s['hashes']['eager_equals_replay']} |")
    L += ["", f"Targets: replay >= {TARGETS['replay_reduction_b4']:.0%} shorter than eager at batch 4; complete fit "
          f">= {TARGETS['ref_over_ours_b4']}x shorter than the reference at batch 4 and >= {TARGETS['ref_over_ours_b16']}x "
          f"at batch 16; GPU idle share during training epochs < {TARGETS['gpu_idle_share']:.0%}; the same model bytes "
          "after the eager and the replayed fits.", "",
          "GPU idle share: 1 - mean NVML utilisation over each epoch's training window (end of its first step to the "
          "synchronised end of its last). NVML utilisation is the share of each ~1/6 s sample period in which any "
          "kernel ran (not SM occupancy: a tiny kernel counts as busy), so it is a lower bound of the real idleness "
          "of the SMs; the windows' edges are placed to one sample period."]
    (out / f"fit_{stamp}.md").write_text("\n".join(L) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--child", choices=["ours", "ref"], help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    ap.add_argument("--task", default="segment", choices=["detect", "segment", "pose"])
    ap.add_argument("--scale", default="n", choices=list("nsmlx"))
    ap.add_argument("--data", default="coco-tiny", help="coco-tiny (../shared/data), coco-pose-tiny or builtin")
    ap.add_argument("--images", type=int, default=512, help="training images (the source repeated)")
    ap.add_argument("--val-images", type=int, default=16)
    ap.add_argument("--imgsz", type=int, default=640)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--batches", type=int, nargs="+", default=[4, 16, 64])
    ap.add_argument("--pairs", type=int, default=2, help="eager/replay pairs per batch")
    ap.add_argument("--ref-runs", type=int, default=1, help="reference fits per batch (0: none)")
    ap.add_argument("--no-ref", action="store_true", help="skip the reference trainer")
    ap.add_argument("--variants", nargs="+", default=["eager", "replay"], choices=["eager", "replay"],
                    help="our variants to run (e.g. only replay beside the reference)")
    ap.add_argument("--vjp", default="func", choices=["func", "autograd"],
                    help="our step's differentiation backend (train.vjp): 'autograd' never imports torch._dynamo")
    ap.add_argument("--ref-python", default=sys.executable, help="the interpreter that imports ultralytics")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--capture", default="auto", help="our replay level (train.capture) for the replay rows")
    ap.add_argument("--our-format", default="coco", choices=["coco", "yolo"], help="the data our trainer reads")
    ap.add_argument("--run-timeout", type=float, default=400, help="seconds before one fit is killed")
    ap.add_argument("--budget", type=float, default=None, help="seconds after which no new fit starts")
    ap.add_argument("--no-warm-imports", action="store_true",
                    help="skip the untimed import of each trainer's modules before the timed fits (see warm_imports)")
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    args = ap.parse_args()
    if args.child:
        spec = json.loads(args.spec)
        (child_ours if args.child == "ours" else child_ref)(spec)
        return

    t_start = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = utc_stamp()
    tmp = tmp_dir("yolo_func_fitbench_")
    meta = host_meta(sys.argv)
    meta.update(task=args.task, scale=args.scale, imgsz=args.imgsz, epochs=args.epochs, workers=args.workers,
                device=args.device, ref_python=args.ref_python, tmp=str(tmp), vjp=args.vjp)
    print(f"writing the data under {tmp} ...", flush=True)
    data = make_data(args.data, args.task, args.images, args.val_images, tmp / "data")
    meta.update(train_images=data["train_images"], val_images=data["val_images"], data_source=data["source"])
    our_data = data["coco"] if args.our_format == "coco" else data["yolo"]
    rows: list[dict] = []
    env_ref = None if args.no_ref or args.ref_runs == 0 else oracle_env(tmp)
    script = str(Path(__file__).resolve())
    cuda = args.device != "cpu"
    if not args.no_warm_imports:
        meta["warm_imports_s"] = warm_imports(env_ref, args.ref_python)

    def record(row: dict) -> None:
        rows.append(row)
        keep = {k: v for k, v in row.items() if k != "log_tail"}
        print(json.dumps(keep), flush=True)
        if row.get("log_tail"):
            print(row["log_tail"], flush=True)
        write_outputs(out, stamp, meta, rows, summarize(rows, args.batches))

    def over_budget() -> bool:
        return args.budget is not None and time.perf_counter() - t_start > args.budget

    def run(kind: str, variant: str, batch: int, i: int) -> None:
        row = {"impl": kind, "variant": variant, "batch": batch, "run": i}
        if over_budget():
            record({**row, "status": "skipped", "error": f"--budget {args.budget:.0f} s spent"})
            return
        name = f"{variant}_b{batch}_{i}"
        spec = {"device": args.device, "epochs": args.epochs, "batch": batch, "imgsz": args.imgsz, "workers": args.workers,
                "train_images": data["train_images"]}
        if kind == "ours":
            spec.update(recipe=RECIPE[args.task].format(s=args.scale), data=our_data, run_dir=str(tmp / "runs" / name),
                        capture="none" if variant == "eager" else args.capture, overrides=[f"train.vjp={args.vjp}"])
            env, py = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO)] + [p for p in [os.environ.get("PYTHONPATH")] if p])), sys.executable
        else:
            spec.update(model=REF_YAML[args.task].format(s=args.scale), data=data["yolo"], project=str(tmp / "ref_runs"), name=name)
            env, py = env_ref, args.ref_python
        print(f"[{time.perf_counter() - t_start:6.0f} s] {name} ...", flush=True)
        r = run_child([py, script, "--child", kind, "--spec", json.dumps(spec)], log=tmp / f"{name}.log",
                      timeout=args.run_timeout, env=env)
        row.update(whole_s=r["whole_s"], status="ok" if r["error"] is None else "error", log=str(tmp / f"{name}.log"))
        if r["error"]:
            row["error"] = r["error"]
            row["log_tail"] = r.get("log_tail")
        if r["result"]:
            row.update(r["result"])
            if kind == "ref" and r["result"].get("ultralytics"):
                meta["ultralytics"] = r["result"]["ultralytics"]
        record(row)

    try:
        for batch in args.batches:
            for i in range(args.pairs):
                if "eager" in args.variants:
                    run("ours", "eager", batch, i)
                if "replay" in args.variants and cuda:
                    run("ours", "replay", batch, i)
                elif "replay" in args.variants:
                    record({"impl": "ours", "variant": "replay", "batch": batch, "run": i, "status": "skipped",
                            "error": "replay needs CUDA (on the CPU every level is the eager step)"})
            if env_ref is not None:
                for i in range(args.ref_runs):
                    run("ref", "ref", batch, i)
    except Exception:  # noqa: BLE001 -- the numbers so far are written
        traceback.print_exc()
    print(f"wrote {out / f'fit_{stamp}.json'} and .md ({time.perf_counter() - t_start:.0f} s); logs and runs in {tmp}", flush=True)
    print((out / f"fit_{stamp}.md").read_text(), flush=True)


if __name__ == "__main__":
    main()
