"""CPU profile of the validation path around the forward pass: loader, decode + NMS + masks, letterbox
undo, COCO records, pycocotools and the internal metric (issue #13 item 7).

The model is a stand-in (:class:`SyntheticModel`) whose ``predict`` returns a trained-model-like raw
output built from each val batch's labels (anchors in the central part of a labelled box predict jittered copies
of it with its class at 0.05-0.9; every other (anchor, class) score log-normal, ~0.03 % above
conf 0.001; random mask coefficients and prototypes for segment; jittered keypoints for pose),
deterministic per batch. Its generation time is measured and subtracted, so the numbers are what
``yolo_func.eval.evaluate`` itself costs besides the network: the part this script exists to cut.

    # after (this checkout) and before (any other checkout, e.g. a worktree of the base commit):
    python benchmarks/profile_eval.py --out benchmarks/results
    python benchmarks/profile_eval.py --code /tmp/evalfast-base --label before --out benchmarks/results

Rows (per task, ``--runs`` runs each, the cheapest reported): ``evaluate``'s CPU seconds (this
process's threads plus ended child processes; the loader in-process with ``--workers 0``) and
wall seconds, each minus the stand-in's ``predict``, per variant: ``default`` (``evaluate(...)`` as a user calls it),
and where the checked-out code has them ``coco_workers=0`` (pycocotools serially, in this process)
and ``coco=False`` (the internal metric only). ``--cprofile`` also writes the top functions by
cumulative time of one default run. Writes ``eval_cpu_<UTC stamp>_<label>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime as dt
import gc
import inspect
import io
import json
import os
import platform
import pstats
import resource
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

_REPO = Path(__file__).resolve().parents[1]


def _code_path() -> Path:
    """``--code DIR`` (read before argparse so the import below uses it), else this checkout."""
    if "--code" in sys.argv:
        return Path(sys.argv[sys.argv.index("--code") + 1]).resolve()
    return _REPO


sys.path.insert(0, str(_code_path()))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import yolo_func  # noqa: E402
from yolo_func.data import CocoDataset, ValLoader  # noqa: E402
from yolo_func.eval import evaluate  # noqa: E402
from yolo_func.models.yolov8 import Inference  # noqa: E402

SHARED = next((p for p in (Path(os.environ.get("YOLO_FUNC_SHARED_DATA", "/nonexistent")), _REPO.parent / "shared" / "data",
                            _REPO / "shared" / "data") if p.is_dir()), _REPO.parent / "shared" / "data")
DATA = {"detect": "coco-tiny", "segment": "coco-tiny", "pose": "coco-pose-tiny"}


class SyntheticModel:
    """Stand-in for a :class:`~yolo_func.models.Model`: ``predict`` returns a trained-model-like raw
    output for the next val batch (module docstring). ``seconds`` accumulates its own cost."""

    def __init__(self, dataset, *, task: str, num_classes: int, image_size: int, batch_size: int, seed: int = 0):
        self.task, self.num_classes = task, num_classes
        self.heads = {"detect": None, **({"pose": None} if task == "pose" else {}),
                      **({"segment": None} if task == "segment" else {})}
        # labels only (the images are dropped): one pass of the val loader, outside every timer
        self.targets = [b.targets for b in ValLoader(dataset, batch_size=batch_size, image_size=image_size, workers=0)]
        self.kpt_shape = tuple(dataset.kpt_shape) if task == "pose" else None
        self.seed, self.calls, self.seconds = seed, 0, 0.0

    def reset(self) -> None:
        self.calls, self.seconds, self.cpu_seconds = 0, 0.0, 0.0

    def predict(self, params, state, images):
        t0, c0 = time.perf_counter(), time.process_time()
        out = self._make(images.shape, self.targets[self.calls % len(self.targets)], self.seed + self.calls)
        self.calls += 1
        self.seconds += time.perf_counter() - t0
        self.cpu_seconds += time.process_time() - c0
        return out

    def _make(self, shape, t, seed) -> Inference:
        g = torch.Generator().manual_seed(seed)
        B, _, H, W = shape
        K = self.num_classes
        pts = []
        for s in (8, 16, 32):
            yy, xx = torch.meshgrid(torch.arange(H // s), torch.arange(W // s), indexing="ij")
            pts.append(torch.stack([(xx.reshape(-1) + 0.5) * s, (yy.reshape(-1) + 0.5) * s,
                                    torch.full((xx.numel(),), float(s))], 1))
        anchors = torch.cat(pts)  # [A, 3]
        A = anchors.shape[0]
        gt = t.boxes.float()  # [B, M, 4] xyxy
        M = gt.shape[1]
        c, wh = (gt[..., :2] + gt[..., 2:]) / 2, (gt[..., 2:] - gt[..., :2]).clamp(min=1)
        if M:
            d = (anchors[None, :, None, :2] - c[:, None]).abs() / (wh[:, None] / 2)  # [B, A, M, 2]
            inside = (d < 1).all(-1) & t.valid[:, None, :]
            closeness = torch.where(inside, 1 - d.max(-1).values, torch.full_like(inside, -1, dtype=torch.float32))
            best, j = closeness.max(-1)
        else:
            best, j = torch.full((B, A), -1.0), torch.zeros(B, A, dtype=torch.long)
        pos = best > 0.4  # the central part of a labelled box
        obj = torch.cat([c, wh], -1) if M else torch.zeros(B, 1, 4)
        obj_box = obj.gather(1, j[..., None].expand(-1, -1, 4))
        bg = torch.cat([anchors[None, :, :2].expand(B, -1, -1),
                        anchors[None, :, 2:3].expand(B, -1, 2) * (1 + 7 * torch.rand(B, A, 2, generator=g))], -1)
        boxes = torch.where(pos[..., None], obj_box * (1 + 0.08 * torch.randn(B, A, 4, generator=g)), bg)
        scores = torch.exp(-10.4 + 1.0 * torch.randn(B, A, K, generator=g)).clamp(max=1)
        cls = t.classes.gather(1, j) if M else torch.zeros(B, A, dtype=torch.long)
        hit = (0.05 + 0.85 * torch.rand(B, A, generator=g)) * best.clamp(min=0) ** 2
        scores.scatter_(2, cls[..., None], torch.where(pos, hit, scores.gather(2, cls[..., None])[..., 0])[..., None])
        parts, protos = [boxes, scores], None
        if self.task == "segment":
            parts.append(torch.randn(B, A, 32, generator=g))
            protos = torch.randn(B, 32, H // 4, W // 4, generator=g)
        if self.task == "pose":
            P = self.kpt_shape[0]
            if M and t.keypoints is not None:
                k = t.keypoints.float().gather(1, j[..., None, None].expand(-1, -1, P, 3)).clone()
            else:
                k = torch.zeros(B, A, P, 3)
            k[..., :2] += 3 * torch.randn(B, A, P, 2, generator=g)
            k[..., 2] = torch.rand(B, A, P, generator=g)
            parts.append(k.flatten(2))
        return Inference(torch.cat(parts, -1).transpose(1, 2).contiguous(), protos)


def repeated_coco(root: Path, task: str, n: int, out: Path) -> CocoDataset:
    """A COCO JSON of ``n`` image entries cycling over ``root`` (new ids, annotations copied, symlinked files)."""
    src = json.loads((root / "annotations.json").read_text())
    by_image: dict[int, list] = {}
    for a in src["annotations"]:
        by_image.setdefault(a["image_id"], []).append(a)
    images_in = sorted(src["images"], key=lambda im: im["id"])
    img_dir = out / "images"
    img_dir.mkdir(parents=True, exist_ok=True)
    images, anns = [], []
    for i in range(n):
        im = images_in[i % len(images_in)]
        name = f"{i:06d}_{im['file_name']}"
        if not (img_dir / name).exists():
            os.symlink((root / "images" / im["file_name"]).resolve(), img_dir / name)
        images.append({**im, "id": i + 1, "file_name": name})
        for a in by_image.get(im["id"], []):
            anns.append({**a, "id": len(anns) + 1, "image_id": i + 1})
    (out / "annotations.json").write_text(json.dumps({**src, "images": images, "annotations": anns}))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return CocoDataset(out / "annotations.json", img_dir, task=task)


def _supports(name: str) -> bool:
    return name in inspect.signature(evaluate).parameters


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run_once(model: SyntheticModel, ds, args, **kw) -> tuple[float, float, dict, float]:
    """(wall seconds without the stand-in's predict, predict seconds, metrics, CPU seconds without
    predict: this process's threads plus the child processes that ended meanwhile, e.g. forked
    pycocotools workers; with ``--workers 0`` the loader runs here and is counted too)."""
    model.reset()
    gc.collect()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t, c, cc = time.perf_counter(), time.process_time(), _children_cpu()
        m = evaluate(model, {}, {}, ds, image_size=args.imgsz, batch_size=args.batch, device="cpu", workers=args.workers,
                     progress=False, verbose=False, **kw)
        s = time.perf_counter() - t
        cpu = time.process_time() - c + _children_cpu() - cc
    return s - model.seconds, model.seconds, m, cpu - model.cpu_seconds


def _summary(m: dict) -> dict:
    out = {"internal_fitness": m["internal"]["fitness"], "internal_box_map": m["internal"]["box"]["mAP50-95"]}
    for k in ("bbox", "segm", "keypoints"):
        if k in m:
            out[f"coco_{k}_AP"] = m[k]["AP"]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--code", default=str(_REPO), help="checkout whose yolo_func is profiled (default this one)")
    ap.add_argument("--label", default="after", help="file name suffix, e.g. before / after")
    ap.add_argument("--tasks", nargs="+", default=["detect", "segment", "pose"], choices=list(DATA))
    ap.add_argument("--images", type=int, default=128, help="the tiny set cycled to this many val images")
    ap.add_argument("--imgsz", type=int, default=640)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--workers", type=int, default=0,
                    help="val loader workers (0: in this process, so its CPU time is counted)")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--cprofile", action="store_true", help="also the top functions of one default run per task")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    try:
        git = subprocess.run(["git", "-C", args.code, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             timeout=10).stdout.strip()
    except Exception:  # noqa: BLE001
        git = None
    meta = dict(command="python " + " ".join(sys.argv), date=stamp, host=platform.node(), cpus=os.cpu_count(),
                torch_threads=torch.get_num_threads(), code=str(_code_path()), yolo_func=yolo_func.__file__, git=git,
                torch=torch.__version__, settings=vars(args))
    variants = [("default", {})]
    if _supports("coco_workers"):
        variants.append(("coco_workers=0", {"coco_workers": 0}))
    if _supports("coco"):
        variants.append(("coco=False", {"coco": False}))
    rows, profiles = [], {}
    with tempfile.TemporaryDirectory(prefix="profile_eval_") as tmp:
        for task in args.tasks:
            ds = repeated_coco(SHARED / DATA[task], task, args.images, Path(tmp) / task)
            model = SyntheticModel(ds, task=task, num_classes=len(ds.names), image_size=args.imgsz, batch_size=args.batch)
            run_once(model, ds, args)  # warm-up (imports, pycocotools, loader start-up paths)
            for name, kw in variants:
                runs = [run_once(model, ds, args, **kw) for _ in range(args.runs)]
                best = min(runs, key=lambda r: r[3])
                row = dict(task=task, variant=name, images=len(ds), seconds=[r[0] for r in runs],
                           cpu_seconds=[r[3] for r in runs], best_cpu_s=best[3], best_s=min(r[0] for r in runs),
                           images_per_cpu_s=len(ds) / best[3], predict_s=best[1], **_summary(best[2]))
                rows.append(row)
                print(json.dumps(row), flush=True)
            if args.cprofile:
                prof = cProfile.Profile()
                prof.enable()
                run_once(model, ds, args)
                prof.disable()
                buf = io.StringIO()
                pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(args.top)
                profiles[task] = buf.getvalue()
    base = out / f"eval_cpu_{stamp}_{args.label}"
    base.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows, "profiles": profiles}, indent=1))
    lines = [f"# Validation path on the CPU ({args.label}) {stamp}", "", f"`{meta['command']}`", "",
             f"host {meta['host']} ({meta['cpus']} CPUs, torch threads {meta['torch_threads']}), code {meta['code']} "
             f"(git {git}), torch {meta['torch']}; {args.images} images, imgsz {args.imgsz}, batch {args.batch}, "
             f"loader workers {args.workers}, best of {args.runs} runs. Both columns exclude the stand-in model's "
             "predict. CPU s = this process's CPU time (all its threads) plus that of child processes that ended "
             "meanwhile (forked pycocotools workers): the comparable number on a shared machine; wall s depends on "
             "the machine's load.", "",
             "| task | variant | CPU s (best) | images per CPU s | CPU s, runs | wall s, runs | internal fitness | "
             "COCO AP (bbox/segm/kpt) |",
             "|---|---|--:|--:|---|---|--:|---|"]
    for r in rows:
        coco = "/".join(f"{r[k]:.4f}" for k in ("coco_bbox_AP", "coco_segm_AP", "coco_keypoints_AP") if k in r) or "-"
        lines.append(f"| {r['task']} | {r['variant']} | {r['best_cpu_s']:.2f} | {r['images_per_cpu_s']:.1f} | "
                     f"{', '.join(f'{s:.2f}' for s in r['cpu_seconds'])} | {', '.join(f'{s:.2f}' for s in r['seconds'])} | "
                     f"{r['internal_fitness']:.4f} | {coco} |")
    for task, text in profiles.items():
        lines += ["", f"## cProfile, {task}, default variant (cumulative)", "", "```", text.strip()[:6000], "```"]
    base.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"wrote {base}.json and .md", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
