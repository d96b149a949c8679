"""Data-parallel scaling: images/s of the training step on 1 and N GPUs (torchrun workers, NCCL).

    python benchmarks/scaling.py --gpus 2 --out benchmarks/results          # nano + small segment, batch 16/GPU
    python benchmarks/scaling.py --gpus 2,4,8 --scales n,s --steps 50
    python benchmarks/scaling.py --cpu --gpus 2 --imgsz 64 --batch 2 --steps 3 --warmup 1   # gloo check (CPU)

For each scale and each world size W in {1} + ``--gpus``: ``torchrun --nproc-per-node W`` runs
this file in worker mode; every rank builds the same model (seeded init), a synthetic segmentation
batch of ``--batch`` images per rank (its own seed per rank), and
:class:`yolo_func.train.replay.ReplayTrainStep` at ``--capture`` (default ``network+heads``: the
deepest level that leaves room for the all-reduce between the replayed backward and the update;
the 1-GPU baseline runs the same level, without the all-reduce) with BF16 autocast and
channels_last. After ``--warmup`` steps (captures included), ``--steps`` steps are timed between
two barriers + synchronisations; images/s = W x batch x steps / seconds. Scaling efficiency =
images/s(W) / (W x images/s(1)). Rank 0 of each run writes a part; the launcher writes
``scaling_<date>.json`` (the command, GPU, torch and NCCL versions, every run, the efficiencies).

Issue 16's target: >= 90% efficiency from 1 to 2 GPUs at batch 16 per GPU with replay.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def worker(args: argparse.Namespace) -> None:
    from yolo_func import yolov8
    from yolo_func.optim import ema as make_ema
    from yolo_func.testing.synthetic import synthetic_batch
    from yolo_func.train import init_train_state, yolo_sgd
    from yolo_func.train import distributed as D
    from yolo_func.train.replay import ReplayTrainStep

    ctx = D.init_distributed("cpu" if args.cpu else "cuda")
    rank, world = (ctx.rank, ctx.world_size) if ctx is not None else (0, 1)
    device = ctx.device if ctx is not None else torch.device("cpu" if args.cpu else "cuda")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cudnn.benchmark = True
    model = yolov8(args.scale, task="segment", num_classes=80)
    opt = yolo_sgd(batch_size=args.batch * world, batches_per_epoch=1000, epochs=10)
    ema = make_ema(0.9999, 2000.0)
    ts = init_train_state(model, opt.tx, torch.Generator().manual_seed(0), device=device, ema=ema)
    step = ReplayTrainStep(model, opt.tx, ema=ema, capture="none" if args.cpu else args.capture,
                           grad_reduce=D.GradReducer() if ctx is not None else None)
    batch = synthetic_batch("segment", args.batch, args.imgsz, num_classes=80, max_boxes=16, seed=1 + rank, device=device)
    batch = batch._replace(images=(batch.images * 255).to(torch.uint8) if batch.images.is_floating_point() else batch.images)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        D.barrier(device if ctx is not None else None)

    for _ in range(args.warmup):
        ts, metrics = step(ts, batch)
    sync()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        ts, metrics = step(ts, batch)
    sync()
    seconds = time.perf_counter() - t0
    if ctx is not None:
        D.check_in_sync(ts.params, device=device)  # the ranks took the same steps
    finite = bool(metrics["finite"])
    if rank == 0:
        row = {"scale": args.scale, "world_size": world, "batch_per_rank": args.batch, "imgsz": args.imgsz,
               "capture": step.capture, "device": str(device), "steps": args.steps, "seconds": seconds,
               "images_per_s": world * args.batch * args.steps / seconds,
               "ms_per_step": 1000 * seconds / args.steps, "finite": finite,
               "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30 if device.type == "cuda" else None}
        Path(args.part).write_text(json.dumps(row))
    D.shutdown()


def launch(args: argparse.Namespace, scale: str, world: int, part: Path) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
           "--max-restarts", "0", __file__, "--worker", "--scale", scale, "--batch", str(args.batch),
           "--imgsz", str(args.imgsz), "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--capture", args.capture, "--part", str(part)] + (["--cpu"] if args.cpu else [])
    env = dict(os.environ)
    if not args.cpu:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(world))
    print(" ".join(cmd[2:]), flush=True)
    subprocess.run(cmd, env=env, check=True)
    return json.loads(part.read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gpus", default="2", help="world sizes to compare with 1, e.g. 2 or 2,4,8")
    p.add_argument("--scales", default="n,s")
    p.add_argument("--batch", type=int, default=16, help="images per GPU")
    p.add_argument("--imgsz", type=int, default=640)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=15)
    p.add_argument("--capture", default="network+heads", choices=["none", "network", "network+heads"])
    p.add_argument("--cpu", action="store_true", help="gloo CPU processes (checks the script; no meaningful speed)")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--scale", default="n", help=argparse.SUPPRESS)
    p.add_argument("--part", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    worlds = [1] + [int(w) for w in args.gpus.split(",") if int(w) > 1]
    if not args.cpu and torch.cuda.device_count() < max(worlds):
        sys.exit(f"error: --gpus asks for {max(worlds)} GPUs but this host has {torch.cuda.device_count()}")
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for scale in args.scales.split(","):
            for world in worlds:
                runs.append(launch(args, scale, world, Path(tmp) / f"{scale}_{world}.json"))
    efficiency = {}
    for scale in args.scales.split(","):
        base = next(r for r in runs if r["scale"] == scale and r["world_size"] == 1)["images_per_s"]
        for r in runs:
            if r["scale"] == scale and r["world_size"] > 1:
                efficiency[f"{scale}/{r['world_size']}"] = r["images_per_s"] / (r["world_size"] * base)
    report = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "date": dt.datetime.now().isoformat(timespec="seconds"),
              "torch": torch.__version__, "nccl": ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None,
              "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() and not args.cpu else "cpu (gloo)",
              "runs": runs, "scaling_efficiency": efficiency,
              "target": ">= 0.90 from 1 to 2 GPUs at batch 16 per GPU with replay"}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"scaling_{dt.date.today().isoformat()}{'_cpu' if args.cpu else ''}.json"
    path.write_text(json.dumps(report, indent=2))
    for k, v in efficiency.items():
        print(f"{k}: scaling efficiency {v:.3f}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
