"""The run folder: the single source of truth of a training run.

Layout (``runs/<task>/<name>`` by default, or ``train.out``)::

    config.json        the run's Config (config_to_json), written atomically at every (re)start
    weights/last.pt    resumable training checkpoint (train/checkpoint.py), written atomically
    weights/best.pt    the same kind of file, at the epoch of the best fitness so far
    results.csv        one row per completed epoch (results_columns(task)); header written once
    coco.csv           pycocotools numbers of each validation (COCO_COLUMNS; one row per iou type),
                       appended by the background evaluation (train/coco_background.py)
    events.jsonl       one JSON object per line: start, resume, epoch, checkpoint, coco, interrupt, end
    *.png              plots (train/plots.py)

Running again on a folder that holds ``weights/last.pt`` resumes it; on resume the rows of
``results.csv`` (and ``coco.csv``) after the resumed epoch are dropped, so the file always
matches the checkpoint. ``events.jsonl`` and ``coco.csv`` are written under :attr:`RunDir.lock`
(the background COCO evaluation appends to them while the loop runs).
A process killed mid-write leaves the previous files intact (atomic checkpoint and config writes;
a half-written last line of ``results.csv`` / ``events.jsonl`` is dropped when the folder is
opened again, with the temporary files of interrupted checkpoint writes).
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import shutil
import threading
import time
from collections.abc import Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from yolo_func.configs import Config, config_from_json, config_to_json
from yolo_func.io.checkpoint import TEMP_SUFFIX, HostStaging, atomic_write, write_checkpoint_payload
from yolo_func.train.checkpoint import (
    DataPosition,
    TrainingCheckpoint,
    load_training_checkpoint,
    training_payload,
)
from yolo_func.train.state import TrainState

__all__ = ["RunDir", "EVENTS", "COCO_COLUMNS", "results_columns", "fitness", "next_run_path", "latest_run"]

#: The kinds of line ``events.jsonl`` holds.
EVENTS = ("start", "resume", "epoch", "checkpoint", "coco", "compile", "interrupt", "end")
#: The columns of ``coco.csv``: the epoch (as in ``results.csv``), the iou type (``bbox``, ``segm``,
#: ``keypoints``) and pycocotools' stats (bbox / segm fill AP..AR100, keypoints AP..APl and AR..ARl).
COCO_COLUMNS = ("epoch", "kind", "AP", "AP50", "AP75", "APs", "APm", "APl", "AR1", "AR10", "AR100",
                "AR", "AR50", "AR75", "ARm", "ARl")

_LOSS_PARTS = {"detect": ("box", "cls", "dfl"), "segment": ("box", "cls", "dfl", "seg"), "pose": ("box", "cls", "dfl", "pose", "kobj")}
_METRIC_KINDS = {"detect": ("box",), "segment": ("box", "mask"), "pose": ("box", "pose")}


def results_columns(task: str) -> tuple[str, ...]:
    """The columns of ``results.csv`` for a task.

    ``epoch`` (1-based: the row closes that many epochs), ``time`` (seconds since the run started,
    resumed time included), ``loss/<part>`` (epoch means of the reference's loss items),
    ``lr/<group>`` (decay, no_decay, bias at the epoch's end), ``<kind>/mAP50`` and
    ``<kind>/mAP50-95`` (kind: box, and mask or pose), ``fitness`` (:func:`fitness`).

    Raises:
      ValueError: an unknown task.
    """
    if task not in _LOSS_PARTS:
        raise ValueError(f"[yolo_func] unknown task {task!r}; expected one of {list(_LOSS_PARTS)}")
    metrics = [f"{k}/{m}" for k in _METRIC_KINDS[task] for m in ("mAP50", "mAP50-95")]
    return ("epoch", "time", *(f"loss/{p}" for p in _LOSS_PARTS[task]), "lr/decay", "lr/no_decay", "lr/bias", *metrics, "fitness")


def fitness(row: Mapping[str, Any], task: str) -> float | None:
    """The reference's best-checkpoint criterion (8.4.190, REFERENCE.md §3.6): box mAP50-95, plus
    mask / pose mAP50-95 for segment / pose. None when a metric is missing (no validation)."""
    values = [row.get(f"{k}/mAP50-95") for k in _METRIC_KINDS[task]]
    if any(v is None or (isinstance(v, float) and math.isnan(v)) for v in values):
        return None
    return float(sum(values))


def next_run_path(root: str | os.PathLike, task: str, name: str) -> Path:
    """``root/task/name``, or the first free ``name2``, ``name3``, ... (the reference's numbering)."""
    base = Path(root) / task
    path, n = base / name, 2
    while path.exists():
        path, n = base / f"{name}{n}", n + 1
    return path


def latest_run(root: str | os.PathLike, task: str) -> Path | None:
    """The run folder under ``root/task`` whose ``weights/last.pt`` was written last, or None."""
    lasts = sorted((p.stat().st_mtime, p) for p in (Path(root) / task).glob("*/weights/last.pt"))
    return lasts[-1][1].parent.parent if lasts else None


def _repair_tail(path: Path) -> None:
    """Drop a half-written last line (a process killed mid-append) so appends start on a new line."""
    if not path.is_file() or path.stat().st_size == 0:
        return
    data = path.read_bytes()
    if not data.endswith(b"\n"):
        keep = data[: data.rfind(b"\n") + 1]
        atomic_write(path, lambda f: f.write(keep))


def _cell(v: Any) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return ""
    if isinstance(v, bool):
        raise TypeError(f"[yolo_func] results.csv cells are numbers; got {v!r}")
    if isinstance(v, int):
        return str(v)
    return repr(float(v))  # the shortest text that reads back as the same float: best-epoch choices survive a reopen


class RunDir:
    """One run folder (see the module docstring for its layout).

    Args:
      path: the folder; created (with ``weights/``) if missing.
      task: ``"detect"``, ``"segment"`` or ``"pose"`` (fixes the ``results.csv`` columns).

    Attributes:
      path, weights, last, best, config_path, results_path, events_path, coco_path: the paths.
      resumable: ``weights/last.pt`` existed when the folder was opened.
      lock: held while ``events.jsonl`` or ``coco.csv`` is appended to (a re-entrant lock).

    Raises:
      ValueError: ``path`` exists, is not empty and is not a run folder (no ``config.json``), or an
        existing ``results.csv`` has other columns (another task).

    Example:
      >>> import tempfile
      >>> from pathlib import Path
      >>> from yolo_func.configs import get_recipe
      >>> from yolo_func.train import RunDir
      >>> run = RunDir(Path(tempfile.mkdtemp()) / "exp", task="detect")
      >>> run.write_config(get_recipe("yolov8n")).name
      'config.json'
      >>> sorted(p.name for p in run.path.iterdir()), run.resumable
      (['config.json', 'weights'], False)
    """

    def __init__(self, path: str | os.PathLike, *, task: str):
        self.path = Path(path)
        self.task = task
        self.columns = results_columns(task)
        if self.path.exists() and not self.path.is_dir():
            raise ValueError(f"[yolo_func] run folder {str(self.path)!r} is a file; give a folder (train.out)")
        if self.path.is_dir() and any(self.path.iterdir()) and not self.config_path.is_file() and not self.weights.is_dir():
            raise ValueError(f"[yolo_func] {str(self.path)!r} exists and is not a run folder (no config.json or weights/); "
                             "give a new or empty folder as train.out")
        self.weights.mkdir(parents=True, exist_ok=True)
        self.lock = threading.RLock()  # events.jsonl / coco.csv: the background COCO evaluation appends too
        self._writer: threading.Thread | None = None  # the checkpoint write in flight (save(background=True))
        self._staging = HostStaging()  # host buffers of the checkpoint tensors, reused by every save
        self._writer_error: BaseException | None = None
        for folder in (self.path, self.weights):  # temporary files of writes a kill interrupted
            for tmp in folder.glob(f".*{TEMP_SUFFIX}"):
                tmp.unlink()
        _repair_tail(self.results_path)
        _repair_tail(self.events_path)
        _repair_tail(self.coco_path)
        if self.results_path.is_file() and self.results_path.stat().st_size:
            with open(self.results_path, newline="") as f:
                header = tuple(next(csv.reader(f), ()))
            if header != self.columns:
                raise ValueError(f"[yolo_func] {str(self.results_path)!r} has columns {list(header)}, expected {list(self.columns)} "
                                 f"for task {task!r}; this folder belongs to another run: give another train.out")
        self.resumable = self.last.is_file()

    # ---------------------------------------------------------------------------------- paths

    @property
    def weights(self) -> Path:
        return self.path / "weights"

    @property
    def last(self) -> Path:
        return self.weights / "last.pt"

    @property
    def best(self) -> Path:
        return self.weights / "best.pt"

    @property
    def config_path(self) -> Path:
        return self.path / "config.json"

    @property
    def results_path(self) -> Path:
        return self.path / "results.csv"

    @property
    def events_path(self) -> Path:
        return self.path / "events.jsonl"

    @property
    def coco_path(self) -> Path:
        return self.path / "coco.csv"

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r}, task={self.task!r})"

    @classmethod
    def for_config(cls, config: Config, *, root: str | os.PathLike = "runs") -> "RunDir":
        """The folder a config asks for: ``train.out`` if given (resumable when it holds
        ``weights/last.pt``); else with ``train.resume`` the latest run of the task under
        ``root/<task>``; else a new ``root/<task>/<name>`` (``name2``, ... when taken).

        Raises:
          ValueError: ``train.resume`` is set and no run of the task has a ``weights/last.pt``.
        """
        task = config.model.task
        if config.train.out is not None:
            return cls(config.train.out, task=task)
        if config.train.resume:
            found = latest_run(root, task)
            if found is None:
                raise ValueError(f"[yolo_func] train.resume is set but no run under {str(Path(root) / task)!r} has weights/last.pt; "
                                 "start without train.resume, or give the folder as train.out")
            return cls(found, task=task)
        return cls(next_run_path(root, task, config.train.name), task=task)

    # --------------------------------------------------------------------------------- config

    def write_config(self, config: Config) -> Path:
        """Write ``config.json`` atomically."""
        text = config_to_json(config).encode()
        return atomic_write(self.config_path, lambda f: f.write(text))

    def read_config(self) -> Config:
        """Read ``config.json``.

        Raises:
          FileNotFoundError: no config.json. ValueError: not valid JSON or an unknown key (names the file).
        """
        if not self.config_path.is_file():
            raise FileNotFoundError(f"[yolo_func] no config.json in run folder {str(self.path)!r}")
        return config_from_json(self.config_path.read_text(), source=str(self.config_path))

    def begin(self, config: Config, *, position: DataPosition | None = None) -> None:
        """Start (``position`` None) or resume a run: write ``config.json``, drop the
        ``results.csv`` and ``coco.csv`` rows after the epochs the checkpoint holds (all rows when
        starting), and log a ``start`` or ``resume`` event."""
        self.write_config(config)
        self.truncate_results(position.epoch if position is not None else 0)
        self._truncate_csv(self.coco_path, position.epoch if position is not None else 0)
        if position is None:
            self.event("start", path=str(self.path), task=self.task)
        else:
            self.event("resume", epoch=position.epoch, batch=position.batch, seed=position.seed)

    # ---------------------------------------------------------------------------- checkpoints

    def save(self, train_state: TrainState, *, config: Config, position: DataPosition, rng: dict | None = None,
             meta: dict | None = None, best: bool = False, background: bool = False) -> Path:
        """Write ``weights/last.pt`` atomically (and copy it to ``best.pt``, atomically, when
        ``best``), then log a ``checkpoint`` event.

        The tensors go to host buffers allocated at the first save and reused
        (:class:`yolo_func.io.checkpoint.HostStaging`: pinned memory, ``non_blocking`` copies on
        CUDA), so the caller never waits for the device: the copies are queued behind the step that
        produced the state and ahead of any later in-place change. With ``background=True``
        waiting for them, serialising, writing and fsync'ing run on a writer thread while training
        goes on (measured on one H200: ~0.75 s per epoch of a nano model otherwise; the blocking
        device-to-host copy another 0.6-1.0 s before the staging buffers). At most one write is in flight: a save waits for the
        previous one; :meth:`wait` waits for the last (the fit loop calls it before returning,
        also on Ctrl-C). Each file is still replaced atomically, so a kill at any moment leaves
        the previous checkpoint loadable; a write that failed raises at the next save or wait.

        Returns:
          The path of ``last.pt``.
        """
        t0 = time.perf_counter()
        self.wait()  # the previous write is done with the staging buffers
        payload = training_payload(train_state, config=config, position=position, rng=rng, meta=meta,
                                   staging=self._staging)
        copied = time.perf_counter() - t0  # the copies queued (CUDA) or done (CPU)

        def write() -> None:
            self._staging.synchronize()  # the device-to-host copies have landed (waited for here, not by training)
            write_checkpoint_payload(self.last, payload)
            if best:
                with open(self.last, "rb") as src:
                    atomic_write(self.best, lambda f: shutil.copyfileobj(src, f, 1 << 20))
            self.event("checkpoint", epoch=int(position.epoch), batch=int(position.batch), best=bool(best),
                       seconds=round(time.perf_counter() - t0, 3), copy_seconds=round(copied, 3),
                       background=bool(background))

        if not background:
            write()
            return self.last

        def run() -> None:
            try:
                write()
            except BaseException as e:  # noqa: BLE001 -- handed to the training thread at the next save/wait
                self._writer_error = e

        self._writer = threading.Thread(target=run, name="yolo_func-checkpoint", daemon=False)
        self._writer.start()
        return self.last

    def wait(self) -> None:
        """Wait for the checkpoint write in flight (if any); re-raise its error."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        if self._writer_error is not None:
            e, self._writer_error = self._writer_error, None
            raise RuntimeError(f"[yolo_func] writing the checkpoint {str(self.last)!r} failed: {e}") from e

    def load_last(self, template: TrainState, *, config: Config | None = None) -> TrainingCheckpoint:
        """Load ``weights/last.pt`` (see :func:`yolo_func.train.checkpoint.load_training_checkpoint`)."""
        self.wait()
        return load_training_checkpoint(self.last, template, config=config)

    # -------------------------------------------------------------------------------- results

    def log_epoch(self, row: Mapping[str, Any], *, timing: Mapping[str, float] | None = None) -> bool:
        """Append one row to ``results.csv`` (the header first when the file is new) and log an
        ``epoch`` event holding the row as ``results``.

        Args:
          row: ``{column: number}``; ``epoch`` is required, missing columns stay empty (e.g. an
            epoch without validation), ``fitness`` is computed from the metrics when absent.
          timing: optional ``{phase: seconds}`` stored in the event as ``timing`` (not in the CSV),
            e.g. the fit's ``first_batch`` / ``train`` / ``val`` / ``checkpoint_wait`` seconds.

        Returns:
          True when this row's fitness is the best so far (the caller then saves ``best.pt``).

        Raises:
          ValueError: a column not in :func:`results_columns`, or no ``epoch``.
        """
        unknown = [k for k in row if k not in self.columns]
        if unknown:
            raise ValueError(f"[yolo_func] results.csv has no column(s) {unknown} for task {self.task!r}; columns: {list(self.columns)}")
        if "epoch" not in row:
            raise ValueError("[yolo_func] a results.csv row needs its 'epoch' (1-based number of the epoch it closes)")
        row = dict(row)
        if row.get("fitness") is None:
            row["fitness"] = fitness(row, self.task)
        previous = [r["fitness"] for r in self.read_results() if r.get("fitness") is not None]
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        new = not self.results_path.is_file() or self.results_path.stat().st_size == 0
        if new:
            writer.writerow(self.columns)
        writer.writerow([_cell(row.get(c)) for c in self.columns])
        with open(self.results_path, "a", newline="") as f:
            f.write(buf.getvalue())
            f.flush()
            os.fsync(f.fileno())
        extra = {} if timing is None else {"timing": {k: round(float(v), 4) for k, v in timing.items()}}
        self.event("epoch", epoch=int(row["epoch"]), results={k: v for k, v in row.items() if v is not None}, **extra)
        return row["fitness"] is not None and all(row["fitness"] > p for p in previous)

    def read_results(self) -> list[dict[str, Any]]:
        """The rows of ``results.csv``: ``epoch`` an int, other cells floats or None (empty)."""
        if not self.results_path.is_file():
            return []
        with open(self.results_path, newline="") as f:
            reader = csv.DictReader(f)
            return [{k: (int(v) if k == "epoch" else (float(v) if v != "" else None)) for k, v in r.items()} for r in reader]

    def truncate_results(self, epochs_done: int) -> None:
        """Keep the rows of epochs ``1..epochs_done`` (rewritten atomically)."""
        self._truncate_csv(self.results_path, epochs_done)

    def _truncate_csv(self, path: Path, epochs_done: int) -> None:
        if not path.is_file():
            return
        with open(path, newline="") as f:
            rows = list(csv.reader(f))
        if not rows:
            return
        kept = [rows[0]] + [r for r in rows[1:] if r and int(r[0]) <= epochs_done]
        if len(kept) == len(rows):
            return
        buf = io.StringIO()
        csv.writer(buf, lineterminator="\n").writerows(kept)
        data = buf.getvalue().encode()
        atomic_write(path, lambda f: f.write(data))

    # ----------------------------------------------------------------------------------- coco

    def log_coco(self, epoch: int, metrics: Mapping[str, Mapping[str, float]], **fields: Any) -> dict:
        """Append one ``coco.csv`` row per iou type (the header first when the file is new) and log
        a ``coco`` event ``{"epoch", "bbox": {...}[, "segm"][, "keypoints"], **fields}``. Thread-safe.

        Args:
          epoch: the ``results.csv`` epoch (1-based) the validation closed.
          metrics: ``{iou_type: {key: value}}`` (:func:`yolo_func.eval.coco_eval.evaluate`).
          fields: more event fields (e.g. ``seconds``).

        Returns:
          The event record.

        Raises:
          ValueError: a key that is not a ``coco.csv`` column.
        """
        stats = [k for v in metrics.values() for k in v]
        unknown = sorted({k for k in stats if k not in COCO_COLUMNS[2:]})
        if unknown:
            raise ValueError(f"[yolo_func] coco.csv has no column(s) {unknown}; columns: {list(COCO_COLUMNS)}")
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        with self.lock:
            if not self.coco_path.is_file() or self.coco_path.stat().st_size == 0:
                writer.writerow(COCO_COLUMNS)
            for kind, values in metrics.items():
                writer.writerow([int(epoch), kind] + [_cell(values.get(c)) for c in COCO_COLUMNS[2:]])
            with open(self.coco_path, "a", newline="") as f:
                f.write(buf.getvalue())
                f.flush()
            return self.event("coco", epoch=int(epoch), **{k: dict(v) for k, v in metrics.items()}, **fields)

    def read_coco(self) -> list[dict[str, Any]]:
        """The rows of ``coco.csv``: ``epoch`` an int, ``kind`` a str, stats floats or None (empty)."""
        if not self.coco_path.is_file():
            return []
        with open(self.coco_path, newline="") as f:
            return [{k: (int(v) if k == "epoch" else v if k == "kind" else (float(v) if v != "" else None))
                     for k, v in r.items()} for r in csv.DictReader(f)]

    # --------------------------------------------------------------------------------- events

    def event(self, kind: str, **fields: Any) -> dict:
        """Append ``{"event": kind, "time": unix seconds, "utc": ISO time, **fields}`` to ``events.jsonl``.

        Raises:
          ValueError: ``kind`` not in :data:`EVENTS`. TypeError: a field is not JSON data.
        """
        if kind not in EVENTS:
            raise ValueError(f"[yolo_func] unknown event {kind!r}; expected one of {list(EVENTS)}")
        reserved = sorted({"event", "time", "utc"} & set(fields))
        if reserved:
            raise ValueError(f"[yolo_func] event {kind!r}: field(s) {reserved} are written by RunDir.event itself; rename them")
        now = time.time()
        record = {"event": kind, "time": now, "utc": datetime.fromtimestamp(now, timezone.utc).isoformat(timespec="seconds"), **fields}
        try:
            line = json.dumps(record, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise TypeError(f"[yolo_func] event {kind!r}: fields must be JSON numbers, strings, lists or dicts ({e}); got {fields!r}") from None
        with self.lock, open(self.events_path, "a") as f:
            f.write(line + "\n")
            f.flush()
        return record

    def read_events(self) -> list[dict]:
        """Every complete line of ``events.jsonl``, parsed."""
        if not self.events_path.is_file():
            return []
        return [json.loads(line) for line in self.events_path.read_text().splitlines() if line.endswith("}")]

    # -------------------------------------------------------------------------------- summary

    def best_row(self) -> dict[str, Any] | None:
        """The ``results.csv`` row of the best fitness (the first of equals), or None."""
        rows = [r for r in self.read_results() if r.get("fitness") is not None]
        return max(rows, key=lambda r: (r["fitness"], -r["epoch"])) if rows else None

    def summary(self) -> str:
        """A few lines naming the folder, the epochs done, the best epoch's metrics, the pycocotools
        table of the latest epoch in ``coco.csv`` (when there is one) and the files."""
        rows = self.read_results()
        best = self.best_row()
        lines = [f"Run folder: {self.path}"]
        if rows:
            lines.append(f"  epochs done: {rows[-1]['epoch']}, {rows[-1]['time'] or 0:.0f} s")
        if best is not None:
            kinds = _METRIC_KINDS[self.task]
            metrics = ", ".join(f"{k} mAP50 {best[f'{k}/mAP50']:.4f} mAP50-95 {best[f'{k}/mAP50-95']:.4f}"
                                for k in kinds if best.get(f"{k}/mAP50") is not None and best.get(f"{k}/mAP50-95") is not None)
            lines.append(f"  best: epoch {best['epoch']} (fitness {best['fitness']:.4f}): {metrics}")
        else:
            lines.append("  best: no validation yet")
        coco = self.read_coco()
        if coco:
            from yolo_func.eval.coco_eval import format_table

            last = max(r["epoch"] for r in coco)
            table = {r["kind"]: {k: v for k, v in r.items() if k not in ("epoch", "kind") and v is not None}
                     for r in coco if r["epoch"] == last}
            lines.append(f"  COCO (pycocotools) of epoch {last}:")
            lines.extend("    " + line for line in format_table(table).splitlines())
        weights = [str(p) for p in (self.best, self.last) if p.is_file()]
        lines.append(f"  weights: {', '.join(weights) if weights else 'none saved'}")
        logs = [self.results_path.name] + ([self.coco_path.name] if coco else []) + [self.events_path.name, self.config_path.name]
        lines.append(f"  logs: {', '.join(logs)}")
        return "\n".join(lines)
