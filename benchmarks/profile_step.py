"""Where a training step spends its time: kernels per step, GPU busy time, GPU idle gaps, host
time per step and the heaviest kernels, for our eager step, each replay level and the loss alone.

    python benchmarks/profile_step.py --out DIR --tasks detect,segment --batches 4,64

Uses ``torch.profiler`` (CUDA activity; kernels inside graph replays are listed one by one) over
``--steps`` steps after warm-up. Per variant it reports:

- ``kernels``: GPU kernels (and memcpy/memset) launched per step;
- ``busy_ms``: the union of their intervals per step (time the GPU computes);
- ``span_ms``: first kernel start to last kernel end per step (busy + idle gaps);
- ``host_ms``: wall time of the Python call per step without synchronising (the launch cost);
- ``top``: the 15 kernels with the largest total time (name, calls per step, ms per step).

Writes ``profile_<date>.json``. Profiling slows the host a little; use ``benchmarks/step.py`` for
the step times themselves.
"""

from __future__ import annotations

import argparse
import collections
import datetime as dt
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from loss import loss_step  # noqa: E402
from step import _floor, _ours  # noqa: E402



def _union_ms(intervals):
    busy, end = 0.0, None
    for s, e in sorted(intervals):
        if end is None or s > end:
            busy += e - s
            end = e
        elif e > end:
            busy += e - end
            end = e
    return busy / 1000.0


def profile(run, steps: int, warmup: int) -> dict:
    for _ in range(warmup):
        run()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        run()
    host_ms = (time.perf_counter() - t0) * 1000 / steps
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(steps):
            run()
        torch.cuda.synchronize()
    gpu = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    intervals = [(e.time_range.start, e.time_range.end) for e in gpu]
    by_name = collections.defaultdict(lambda: [0, 0.0])
    for e in gpu:
        by_name[e.name][0] += 1
        by_name[e.name][1] += e.time_range.elapsed_us()
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:15]
    span = (max(e for _, e in intervals) - min(s for s, _ in intervals)) / 1000.0 if intervals else 0.0
    return {
        "kernels": len(gpu) / steps,
        "busy_ms": _union_ms(intervals) / steps,
        "span_ms": span / steps,
        "host_ms": host_ms,
        "top": [{"name": n[:120], "calls": c / steps, "ms": t / 1000.0 / steps} for n, (c, t) in top],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--tasks", default="detect,segment")
    ap.add_argument("--batches", default="4,64")
    ap.add_argument("--variants", default="loss,eager,network,network+heads,step,floor")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=5)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("[yolo_func] benchmarks/profile_step.py needs a CUDA GPU")
    torch.backends.cudnn.benchmark = False
    results = []
    for task in args.tasks.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            for variant in args.variants.split(","):
                if variant == "loss":
                    run = loss_step(task, batch, 640, "cuda")[0]
                elif variant == "floor":
                    run = _floor(task, batch)
                else:
                    run = _ours(task, batch, "none" if variant == "eager" else variant)
                r = profile(run, args.steps, args.warmup)
                r.update(task=task, batch=batch, variant=variant)
                print(f"{task:8s} b{batch:<3d} {variant:14s} kernels {r['kernels']:7.0f}  busy {r['busy_ms']:7.2f} ms  "
                      f"span {r['span_ms']:7.2f} ms  host {r['host_ms']:7.2f} ms", flush=True)
                for k in r["top"][:8]:
                    print(f"      {k['ms']:7.3f} ms  x{k['calls']:<5.0f} {k['name'][:100]}")
                results.append(r)
                del run
                torch.cuda.empty_cache()
    now = dt.datetime.now(dt.timezone.utc)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"profile_{now:%Y%m%dT%H%M%S}.json"
    path.write_text(json.dumps({"command": " ".join(["python3", *sys.argv]), "gpu": torch.cuda.get_device_name(),
                                "torch": torch.__version__, "date": now.isoformat(timespec="seconds"),
                                "results": results}, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
