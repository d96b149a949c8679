"""Helpers shared by ``benchmarks/fit.py`` and ``benchmarks/fit_parity.py``: the data folders both
trainers read, running one fit in a child process (timed by the parent), the GPU-utilisation
sampler, model hashing and the output files.

Only the standard library is imported at module level: the child processes import this module
first, and their whole-process time should be the trainer's, not the benchmark's.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
#: ../shared/data beside the checkout, or shared/data inside it (the device copy), or $YOLO_FUNC_SHARED_DATA
SHARED = next((p for p in (Path(os.environ.get("YOLO_FUNC_SHARED_DATA", "/nonexistent")), REPO.parent / "shared" / "data",
                            REPO / "shared" / "data") if p.is_dir()), REPO.parent / "shared" / "data")
RESULT_TAG = "FITBENCH_RESULT "

# A stand-in for the one ``polars.read_csv(...).to_dict()`` call the reference trainer makes per
# epoch (ORACLE.md), used only when neither polars nor ../shared/tools/oracle-stubs is there.
_POLARS_STUB = '''"""polars stand-in for the reference trainer (read_csv(...).to_dict)."""
import csv
import io


class _Frame:
    def __init__(self, rows):
        self.rows = rows

    def to_dict(self, as_series=True):
        keys = list(self.rows[0]) if self.rows else []
        out = {k: [] for k in keys}
        for r in self.rows:
            for k in keys:
                v = r[k]
                try:
                    v = float(v)
                except (TypeError, ValueError):
                    pass
                out[k].append(v)
        return out


def read_csv(src, *a, **k):
    text = src.decode() if isinstance(src, (bytes, bytearray)) else open(src).read()
    return _Frame([{kk.strip(): v for kk, v in r.items()} for r in csv.DictReader(io.StringIO(text))])
'''


def utc_stamp() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")


# ---------------------------------------------------------------------------------------------- data


def _link(src: Path, dst: Path) -> None:
    if dst.exists():
        dst.unlink()
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


def coco_subset(src_json: Path, src_images: Path, out_dir: Path, n: int) -> Path:
    """``out_dir/annotations.json`` + ``out_dir/images/``: the source's images in id order, cycled
    to ``n`` entries (each a hard link or copy named ``<index>_<file>``, a fresh image id, its
    annotations copied with fresh ids). ``n`` below the source size takes the first ``n``."""
    d = json.loads(Path(src_json).read_text())
    imgs = sorted(d["images"], key=lambda im: im["id"])
    anns = defaultdict(list)
    for a in d["annotations"]:
        anns[a["image_id"]].append(a)
    (out_dir / "images").mkdir(parents=True, exist_ok=True)
    new_imgs, new_anns = [], []
    for i in range(n):
        im = imgs[i % len(imgs)]
        name = f"{i:06d}_{Path(im['file_name']).name}"
        _link(Path(src_images) / im["file_name"], out_dir / "images" / name)
        new_imgs.append({**im, "id": i + 1, "file_name": name})
        for a in anns[im["id"]]:
            new_anns.append({**a, "id": len(new_anns) + 1, "image_id": i + 1})
    out = {k: v for k, v in d.items() if k not in ("images", "annotations")}
    out.setdefault("info", {})
    out.setdefault("licenses", [])
    out.update(images=new_imgs, annotations=new_anns)
    path = out_dir / "annotations.json"
    path.write_text(json.dumps(out))
    return path


def source_dataset(data: str, task: str, split: str) -> tuple[Path, Path]:
    """(annotations JSON, image folder) of ``builtin`` (yolo_func's generated data, ``split``) or
    ``coco-tiny`` / ``coco-pose-tiny`` (../shared/data; one split, used for train and val)."""
    if data == "builtin":
        from yolo_func.data import builtin_dataset

        ds = builtin_dataset(task, split)
        return Path(ds.annotations_path), Path(ds.image_dir)
    root = SHARED / data
    if not (root / "annotations.json").is_file():
        raise RuntimeError(f"{data} not found at {root} (set YOLO_FUNC_SHARED_DATA to the folder holding it)")
    return root / "annotations.json", root / "images"


def make_data(data: str, task: str, n_train: int, n_val: int, out: Path) -> dict:
    """Writes the datasets both trainers read; returns ``{"coco": folder, "yolo": data.yaml, ...}``.

    ``out/coco/{train,val}/annotations.json`` + ``images/`` (our trainer's COCO-folder layout) and
    ``out/yolo/`` (the same images and labels in the Ultralytics format, written by
    :func:`yolo_func.data.write_yolo_dataset`, for the reference trainer and ``--our-format yolo``).
    """
    from yolo_func.data import CocoDataset
    from yolo_func.data.yolo import write_yolo_dataset

    tr_json, tr_img = source_dataset(data, task, "train")
    va_json, va_img = source_dataset(data, task, "val")
    coco = out / "coco"
    tr = coco_subset(tr_json, tr_img, coco / "train", n_train)
    va = coco_subset(va_json, va_img, coco / "val", n_val)
    dsets = {"train": CocoDataset(tr, coco / "train" / "images", task=task),
             "val": CocoDataset(va, coco / "val" / "images", task=task)}
    yaml = write_yolo_dataset(dsets, out / "yolo")
    return {"coco": str(coco), "yolo": str(yaml), "train_images": len(dsets["train"]), "val_images": len(dsets["val"]),
            "classes": len(dsets["train"].names), "source": f"{data} ({tr_json})"}


# ------------------------------------------------------------------------------------ child process


def oracle_env(tmp: Path) -> dict:
    """Environment for a child that imports the reference package: offline, its settings in a
    temp folder, a polars stand-in on PYTHONPATH when polars is missing."""
    env = dict(os.environ, YOLO_OFFLINE="1", YOLO_CONFIG_DIR=str(tmp / "yolo_config"))
    (tmp / "yolo_config").mkdir(parents=True, exist_ok=True)
    extra = [str(REPO)]
    stubs = next((p for p in (Path(os.environ.get("YOLO_FUNC_ORACLE_STUBS", "/nonexistent")),
                              REPO.parent / "shared" / "tools" / "oracle-stubs", REPO / "shared" / "tools" / "oracle-stubs")
                  if (p / "polars.py").is_file()), None)
    try:
        import importlib.util

        has_polars = importlib.util.find_spec("polars") is not None
    except Exception:  # noqa: BLE001
        has_polars = False
    if not has_polars:
        if stubs is None:
            stubs = tmp / "oracle-stubs"
            stubs.mkdir(parents=True, exist_ok=True)
            (stubs / "polars.py").write_text(_POLARS_STUB)
        extra.insert(0, str(stubs))
    env["PYTHONPATH"] = os.pathsep.join(extra + [p for p in [os.environ.get("PYTHONPATH")] if p])
    return env


def run_child(cmd: list[str], *, log: Path, timeout: float | None, env: dict | None = None) -> dict:
    """Runs ``cmd`` (its own session, stdout+stderr to ``log``); returns ``{"whole_s", "rc",
    "result" (the child's last ``FITBENCH_RESULT`` JSON line or None), "error"}``; on a timeout
    the child's process group is killed."""
    t0 = time.perf_counter()
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=str(REPO), start_new_session=True)
        try:
            rc = p.wait(timeout=timeout)
            error = None if rc == 0 else f"exit status {rc}"
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            rc = p.wait()
            error = f"timeout after {timeout:.0f} s"
    whole = time.perf_counter() - t0
    result = None
    text = log.read_text(errors="replace")
    for line in text.splitlines():
        if line.startswith(RESULT_TAG):
            result = json.loads(line[len(RESULT_TAG):])
    if error is None and result is None:
        error = "the child printed no result line"
    out = {"whole_s": whole, "rc": rc, "result": result, "error": error}
    if error:
        out["log_tail"] = text[-3000:]
    return out


def torchvision_nms_shim() -> bool:
    """Imports torchvision; where its compiled ops do not load (the CPU development VM's oracle
    venv: torchvision 0.28 beside a CPU torch 2.13 build), defines ``torchvision::nms`` and
    ``torchvision::qnms`` as greedy NMS in plain torch first so that the import and the reference
    trainer's validation run (CPU smoke runs only; the row says so). Returns True when it did."""
    import torch

    try:
        import torchvision  # noqa: F401

        return False
    except RuntimeError as e:
        if "torchvision::nms" not in str(e):
            raise
    for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
        del sys.modules[name]

    def nms(dets: torch.Tensor, scores: torch.Tensor, iou_threshold: float) -> torch.Tensor:
        order = scores.argsort(descending=True)
        boxes = dets[order].float()
        area = (boxes[:, 2] - boxes[:, 0]).clamp(min=0) * (boxes[:, 3] - boxes[:, 1]).clamp(min=0)
        alive = torch.ones(len(order), dtype=torch.bool)
        keep = []
        for i in range(len(order)):
            if not alive[i]:
                continue
            keep.append(i)
            lt = torch.maximum(boxes[i, :2], boxes[i + 1:, :2])
            rb = torch.minimum(boxes[i, 2:], boxes[i + 1:, 2:])
            inter = (rb - lt).clamp(min=0).prod(1)
            iou = inter / (area[i] + area[i + 1:] - inter).clamp(min=1e-12)
            alive[i + 1:] &= iou <= iou_threshold
        return order[torch.tensor(keep, dtype=torch.int64)]

    for op in ("nms", "qnms"):
        torch.library.define(f"torchvision::{op}", "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        torch.library.impl(f"torchvision::{op}", "CPU")(nms)
    import torchvision  # noqa: F401,F811
    import torchvision.ops.boxes

    torchvision.ops.boxes._assert_has_ops = lambda: None  # the op exists now (defined above)
    return True


def emit_result(obj: dict) -> None:
    """The child's one result line (parsed by :func:`run_child`)."""
    print(RESULT_TAG + json.dumps(obj), flush=True)


# ------------------------------------------------------------------------------ GPU utilisation


class GpuUtilSampler:
    """Samples the GPU's utilisation (percent of time in which at least one kernel ran, as NVML
    and nvidia-smi define it) in a background thread, with Unix timestamps.

    Sources, first that works: NVML's buffered utilisation samples (``nvmlDeviceGetSamples``, the
    driver's own sample points with their CPU timestamps, read every 0.5 s); NVML's
    ``nvmlDeviceGetUtilizationRates`` polled every ``period`` s; ``nvidia-smi -lms``.
    ``idle_share(windows)`` = 1 - mean(utilisation in the windows) / 100.
    """

    def __init__(self, index: int = 0, period: float = 0.1):
        self.index, self.period = index, period
        self.samples: list[tuple[float, float]] = []
        self.method: str | None = None
        self.error: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._proc: subprocess.Popen | None = None

    def start(self) -> "GpuUtilSampler":
        try:
            import pynvml

            pynvml.nvmlInit()
            h = pynvml.nvmlDeviceGetHandleByIndex(self.index)
            try:
                pynvml.nvmlDeviceGetSamples(h, pynvml.NVML_GPU_UTILIZATION_SAMPLES, 0)
                self.method = "nvml-samples"
            except pynvml.NVMLError as e:
                if "Not Found" not in str(e):  # NotFound: no sample yet, the call itself works
                    self.method = "nvml-poll"
                else:
                    self.method = "nvml-samples"
            self._thread = threading.Thread(target=self._nvml_loop, args=(pynvml, h), daemon=True)
        except Exception as e:  # noqa: BLE001 -- fall back to nvidia-smi
            self.error = f"NVML: {type(e).__name__}: {e}"
            exe = shutil.which("nvidia-smi")
            if exe is None:
                self.error += "; nvidia-smi not found"
                return self
            self._proc = subprocess.Popen([exe, f"--id={self.index}", "--query-gpu=utilization.gpu",
                                           "--format=csv,noheader,nounits", f"-lms={int(self.period * 1000)}"],
                                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            self.method = "nvidia-smi"
            self._thread = threading.Thread(target=self._smi_loop, daemon=True)
        self._thread.start()
        return self

    def _nvml_loop(self, pynvml, h) -> None:
        last = 0
        while not self._stop.is_set():
            try:
                if self.method == "nvml-samples":
                    _, samples = pynvml.nvmlDeviceGetSamples(h, pynvml.NVML_GPU_UTILIZATION_SAMPLES, last)
                    for s in samples:
                        if s.timeStamp > last:
                            self.samples.append((s.timeStamp / 1e6, float(s.sampleValue.uiVal)))
                    last = max([last] + [s.timeStamp for s in samples])
                else:
                    self.samples.append((time.time(), float(pynvml.nvmlDeviceGetUtilizationRates(h).gpu)))
            except pynvml.NVMLError:
                pass  # NotFound: no new sample since `last`
            self._stop.wait(0.5 if self.method == "nvml-samples" else self.period)

    def _smi_loop(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            try:
                self.samples.append((time.time(), float(line.strip())))
            except ValueError:
                pass
            if self._stop.is_set():
                break

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self.method and self.method.startswith("nvml"):
            self._thread.join(timeout=2)
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
        if self.method == "nvml-samples" and self.samples:
            skew = abs(self.samples[-1][0] - time.time())
            if skew > 30:  # timestamps not Unix microseconds: windows cannot be placed
                self.error = f"NVML sample timestamps are {skew:.0f} s away from the clock; windows not placed"

    def idle_share(self, windows: list[tuple[float, float]]) -> dict:
        """``{"idle_share", "samples", "method"}`` over the samples inside ``windows`` (Unix s)."""
        if self.method is None or (self.error and "windows not placed" in self.error):
            return {"idle_share": None, "samples": 0, "method": self.method, "error": self.error}
        vals = [u for t, u in self.samples if any(a <= t <= b for a, b in windows)]
        return {"idle_share": (1 - statistics.fmean(vals) / 100) if vals else None, "samples": len(vals),
                "method": self.method, "error": self.error if not vals else None}


def device_index() -> int:
    v = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip()
    return int(v) if v.isdigit() else 0


class Timeline:
    """Training windows of a fit: each epoch's from the end of its first step to the end of its
    last (synchronised), so captures and the first step's start-up fall outside, validation too."""

    def __init__(self, sync: Callable[[], None]):
        self.sync = sync
        self.t_fit0: float | None = None
        self.first: dict[int, float] = {}
        self.last: dict[int, float] = {}
        self.steps: dict[int, int] = defaultdict(int)

    def step(self, epoch: int, last_of_epoch: bool) -> None:
        now = time.time()
        self.steps[epoch] += 1
        if epoch not in self.first:
            self.first[epoch] = now
        if last_of_epoch:
            self.sync()
            now = time.time()
        self.last[epoch] = now

    def windows(self) -> list[tuple[float, float]]:
        return [(self.first[e], self.last[e]) for e in sorted(self.first) if self.last[e] > self.first[e]]

    def summary(self, t_end: float) -> dict:
        """start-up (fit entry -> the end of the first step), training windows, the gaps between
        them (validation, checkpoints, epoch starts) and the tail (last step -> fit return)."""
        w = self.windows()
        e = sorted(self.first)
        if not e or self.t_fit0 is None:
            return {}
        return {"startup_s": self.first[e[0]] - self.t_fit0,
                "train_windows_s": sum(b - a for a, b in w),
                "between_epochs_s": sum(self.first[e[i + 1]] - self.last[e[i]] for i in range(len(e) - 1)),
                "tail_s": t_end - self.last[e[-1]],
                "steps_per_epoch": [self.steps[k] for k in e]}


# ------------------------------------------------------------------------------------------ hashing


def tree_sha256(tree: Any) -> str:
    """sha256 over every leaf's path, dtype, shape and bytes (contiguous, CPU), in path order."""
    import torch

    from yolo_func import tree as T

    h = hashlib.sha256()
    for path, x in sorted(T.tree_items(tree), key=lambda kv: kv[0]):
        h.update(path.encode())
        if isinstance(x, torch.Tensor):
            t = x.detach().contiguous().cpu().reshape(-1)
            h.update(f"{t.dtype}{tuple(x.shape)}".encode())
            h.update((t.to(torch.uint8) if t.dtype == torch.bool else t).view(torch.uint8).numpy().tobytes())
        else:
            h.update(repr(x).encode())
    return h.hexdigest()


# ---------------------------------------------------------------------------------------- reporting


def scalars(d: Any) -> Any:
    """The numbers of a nested dict (metrics), as floats; other leaves dropped."""
    if isinstance(d, dict):
        out = {str(k): scalars(v) for k, v in d.items()}
        return {k: v for k, v in out.items() if v is not None and v != {}}
    try:
        return float(d)
    except (TypeError, ValueError):
        return None


def stats(values: list[float]) -> dict | None:
    v = [x for x in values if x is not None]
    if not v:
        return None
    return {"median": statistics.median(v), "min": min(v), "max": max(v), "n": len(v)}


def fmt_stat(s: dict | None, digits: int = 1, pct: bool = False) -> str:
    if not s:
        return "-"
    k = 100 if pct else 1
    u = "%" if pct else ""
    if s["n"] == 1:
        return f"{s['median'] * k:.{digits}f}{u}"
    return f"{s['median'] * k:.{digits}f}{u} ({s['min'] * k:.{digits}f}-{s['max'] * k:.{digits}f}{u})"


def host_meta(argv: list[str]) -> dict:
    meta = {"command": "python " + " ".join([os.path.relpath(argv[0], REPO)] + argv[1:]), "date": utc_stamp(),
            "host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version()}
    try:
        meta["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                        text=True, timeout=10).stdout.strip() or None
    except Exception:  # noqa: BLE001
        meta["commit"] = None
    try:
        import torch

        meta["torch"] = torch.__version__
        meta["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except Exception:  # noqa: BLE001
        pass
    try:
        from importlib.metadata import version

        meta["ultralytics"] = version("ultralytics")
    except Exception:  # noqa: BLE001
        meta["ultralytics"] = None
    return meta


def tmp_dir(prefix: str) -> Path:
    return Path(tempfile.mkdtemp(prefix=prefix))
