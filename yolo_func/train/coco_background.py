"""pycocotools evaluation of a validation pass, in a background thread (``val.coco``).

The fit loop validates epoch k (the internal metric, which picks ``best.pt``, and the COCO result
records of every val image), hands the records to :class:`BackgroundCoco` and trains epoch k+1
while ``COCOeval`` scores epoch k. When it is done the worker appends the numbers to ``coco.csv``
and a ``coco`` event to ``events.jsonl`` (:meth:`RunDir.log_coco`, under the folder's lock).

- At most one evaluation is in flight: :meth:`BackgroundCoco.submit` first waits for the previous
  one (bounding memory to two epochs of records), which in practice has long finished.
- The end of a fit waits for the last one (:meth:`BackgroundCoco.finish`); its numbers go to the
  summary and :class:`~yolo_func.train.FitResult`'s ``coco``. An interrupted fit waits
  ``INTERRUPT_WAIT_S`` at most, an exception not at all: the evaluation is then abandoned (it
  writes nothing when it ends). Each evaluation runs on its own *daemon* thread, not in a
  ``ThreadPoolExecutor``, whose worker threads the interpreter joins at exit: an abandoned
  ``COCOeval`` of a large val set would keep a Ctrl-C'd process alive for a minute.
- A failing evaluation logs a ``coco`` event with ``error`` and is warned about (from the main
  thread, when the loop next looks); the fit goes on.
- The scoring itself runs in a *worker process* (:mod:`yolo_func.train._coco_worker`, started
  once per fit with the ground truth; a fresh interpreter, so neither a fork of a CUDA process nor
  a re-run of the user's ``__main__``):
  ``COCOeval`` is Python-heavy and, on a thread of the training process, holds the GIL that the
  next epoch's data feeding, validation and checkpoint copy need (measured on an H200 at batch 4:
  validation 1.1-2.1 s and the checkpoint's device-to-host copy 0.6-1.0 s per epoch while an
  evaluation ran, 0.3 s and 0.1 s at batch 16 where it finished sooner). The daemon thread only
  waits on the pipe. A replaced :func:`evaluate_records` (tests, custom scorers) is a function of
  this process and runs on the thread, as before; so does ``BackgroundCoco(process=False)``.
- pycocotools' printing is dropped for the worker (:func:`~yolo_func.eval.coco_eval.quiet_stdout`).
- The worker scores against a private deep copy of the ground truth (made once, in the worker):
  ``COCOeval`` rewrites the ground-truth annotations it reads (polygons to RLE, ``ignore`` flags),
  and the dataset's own ``COCO`` stays untouched for the main thread.

None of this is training state: a resumed run is bitwise equal to an uninterrupted one whether or
not the evaluations ran, finished or failed.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import warnings
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any, NamedTuple

from yolo_func.eval import coco_eval

__all__ = ["BackgroundCoco", "evaluate_records", "resolve_coco", "INTERRUPT_WAIT_S"]

#: Seconds an interrupted fit waits for the evaluation in flight before abandoning it.
INTERRUPT_WAIT_S = 5.0


def resolve_coco(mode: str, dataset: Any) -> bool:
    """Whether ``val.coco`` (``"auto"``, ``"on"``, ``"off"``) runs pycocotools on ``dataset``.

    ``"auto"`` is on when the dataset carries its COCO ground truth (a
    :class:`~yolo_func.data.CocoDataset`, the built-in data): nothing to build. ``"on"`` also
    builds it for a :class:`~yolo_func.data.YoloDataset` (:func:`yolo_func.eval.coco_ground_truth`).

    Raises:
      ValueError: ``"on"`` for a dataset with neither a COCO ground truth nor ``labels`` / ``image_sizes``.
    """
    if mode == "off":
        return False
    own = getattr(dataset, "coco", None) is not None and hasattr(dataset, "category_ids")
    if mode == "auto":
        return own
    if not own and not (hasattr(dataset, "labels") and hasattr(dataset, "image_sizes")):
        raise ValueError(f"[yolo_func] val.coco=on but the val data ({type(dataset).__name__}) has no COCO ground truth "
                         "and no labels(i) / image_sizes to build one; use a CocoDataset or a YoloDataset, or val.coco=off")
    return True


def evaluate_records(ground_truth: Any, records: Sequence[dict], *, image_ids: Sequence[int] | None,
                     iou_types: Sequence[str]) -> dict[str, dict[str, float]]:
    """What the worker runs: :func:`yolo_func.eval.coco_eval.evaluate` without printing, exactly as
    :meth:`~yolo_func.eval.CocoEvaluator.evaluate` calls it (so ``yolo_func.eval.evaluate`` on the same
    weights and data gives the same numbers). A module attribute, looked up per call: tests replace it."""
    return coco_eval.evaluate(ground_truth, records, iou_types=iou_types, image_ids=image_ids, verbose=False)


_THREAD_SCORER = evaluate_records  # the module's own scorer: the one a worker process runs


class _ProcessScorer:
    """A worker interpreter (:mod:`yolo_func.train._coco_worker`) that scores records against the
    ground truth it received first (pickled once); one request at a time over a socket pair."""

    def __init__(self, ground_truth: Any):
        import os
        import socket
        import subprocess
        import sys
        from multiprocessing.connection import Connection
        from pathlib import Path

        import yolo_func

        # the child imports this very package, wherever it was imported from (a source tree too)
        root = str(Path(yolo_func.__file__).resolve().parents[1])
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
        ours, theirs = socket.socketpair()
        try:
            self._proc = subprocess.Popen([sys.executable, "-m", "yolo_func.train._coco_worker", str(theirs.fileno())],
                                          pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, env=env)
        finally:
            theirs.close()
        self._conn = Connection(ours.detach())
        self._ground_truth = ground_truth  # sent by the first score(), on the waiting thread

    @property
    def unused(self) -> bool:
        """No request was ever sent (the ground truth is still here): nothing to finish."""
        return self._ground_truth is not None

    def score(self, records: list, image_ids, iou_types: list[str]) -> dict:
        try:
            if self._ground_truth is not None:  # the worker is still importing: sent from this thread
                gt, self._ground_truth = self._ground_truth, None
                self._conn.send(gt)
            self._conn.send((records, image_ids, iou_types))
            status, payload = self._conn.recv()
        except (EOFError, OSError) as e:
            raise RuntimeError(f"the COCO worker process ended unexpectedly (exit code {self._proc.poll()})") from e
        if status == "error":
            raise RuntimeError(payload)
        return payload

    def close(self, *, kill: bool) -> None:
        """Stop the process: ask it to exit (``kill=False``, after it answered) or terminate it."""
        import subprocess

        if not kill:
            with contextlib.suppress(OSError, ValueError):  # the worker has already gone
                self._conn.send(None)
            with contextlib.suppress(subprocess.TimeoutExpired):  # still running: terminated below
                self._proc.wait(timeout=5.0)
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                self._proc.kill()
        self._conn.close()


class _Job(NamedTuple):
    epoch: int
    records: list
    image_ids: list[int] | None
    iou_types: list[str]
    future: Future
    abandoned: threading.Event
    thread: threading.Thread


class BackgroundCoco:
    """One pycocotools evaluation at a time, off the training thread.

    Args:
      ground_truth: a pycocotools ``COCO`` or a COCO dict (copied once, in the worker).
      run_dir: the :class:`~yolo_func.train.RunDir` whose ``coco.csv`` / ``events.jsonl`` get the results.
      process: score in a worker process (None: yes, unless :func:`evaluate_records` has been
        replaced, whose replacement runs on the thread); False: on the thread, in this process.

    Attributes:
      results: ``{epoch: {iou_type: {key: value}}}`` of the evaluations collected so far.
      errors: ``{epoch: "Type: message"}`` of the ones that failed.
    """

    def __init__(self, ground_truth: Any, *, run_dir: Any, process: bool | None = None):
        self._source = ground_truth
        self._process = process
        self._scorer: _ProcessScorer | None = None
        self._gt = None
        self._run_dir = run_dir
        self._job: _Job | None = None
        self.results: dict[int, dict] = {}
        self.errors: dict[int, str] = {}

    # ------------------------------------------------------------------------------- the worker

    def _ground_truth(self):
        if self._gt is None:
            data = getattr(self._source, "dataset", self._source)  # a COCO's dict, or the dict
            self._gt = coco_eval.load_coco(data)  # a deep copy, indexed
        return self._gt

    def _work(self, epoch: int, records: list, image_ids, iou_types, future: Future, abandoned: threading.Event,
              scorer: _ProcessScorer | None = None) -> None:
        if not future.set_running_or_notify_cancel():
            return
        t0 = time.perf_counter()
        try:
            if scorer is not None:
                metrics = scorer.score(records, image_ids, iou_types)
            else:
                with coco_eval.quiet_stdout():
                    metrics = evaluate_records(self._ground_truth(), records, image_ids=image_ids, iou_types=iou_types)
        except BaseException as e:  # noqa: BLE001 - reported in events.jsonl and by the main thread
            try:
                with self._run_dir.lock:  # abandon() takes it too: nothing is written once abandoned
                    if not abandoned.is_set():
                        self._run_dir.event("coco", epoch=epoch, error=f"{type(e).__name__}: {e}",
                                            seconds=round(time.perf_counter() - t0, 3))
            except Exception:  # noqa: BLE001 - the warning still reports the evaluation's error
                pass
            future.set_exception(e)
            return
        try:
            with self._run_dir.lock:
                if not abandoned.is_set():
                    self._run_dir.log_coco(epoch, metrics, seconds=round(time.perf_counter() - t0, 3))
        except BaseException as e:  # noqa: BLE001 - e.g. a full disk: reported like a failed evaluation
            future.set_exception(e)
            return
        future.set_result(metrics)

    # -------------------------------------------------------------------------- the main thread

    @property
    def in_flight(self) -> int | None:
        """The epoch being evaluated (or evaluated and not yet collected), or None."""
        return None if self._job is None else self._job.epoch

    def submit(self, epoch: int, records: list, *, image_ids: Sequence[int] | None, iou_types: Sequence[str]) -> None:
        """Start evaluating one validation's records (after waiting for the previous evaluation).

        Args:
          epoch: the ``results.csv`` epoch (1-based) the records belong to.
          records: COCO result records (:attr:`yolo_func.eval.CocoEvaluator.results`); handed over, not copied.
          image_ids: the validated images (:attr:`~yolo_func.eval.CocoEvaluator.image_ids`).
          iou_types: ``bbox`` [+ ``segm`` / ``keypoints``].
        """
        self.collect(wait=True)
        scorer = self.start()
        future: Future = Future()
        abandoned = threading.Event()
        ids = None if image_ids is None else list(image_ids)
        thread = threading.Thread(target=self._work, args=(epoch, records, ids, list(iou_types), future, abandoned, scorer),
                                  name=f"yolo_func-coco-epoch{epoch}", daemon=True)
        self._job = _Job(epoch, records, ids, list(iou_types), future, abandoned, thread)
        thread.start()

    def start(self) -> _ProcessScorer | None:
        """Start the worker interpreter now (if this evaluator scores in one and it is not running
        yet), so that its imports overlap with the fit's start-up and first epoch instead of
        delaying the first evaluation (and, through it, the second submit). :meth:`submit` calls
        it too. Returns the worker's handle, or None when scoring runs on a thread."""
        use_process = os.name == "posix" and (self._process if self._process is not None
                                              else evaluate_records is _THREAD_SCORER)
        if use_process and self._scorer is None:
            try:
                self._scorer = _ProcessScorer(getattr(self._source, "dataset", self._source))  # a COCO's dict, or the dict
            except OSError as e:  # e.g. no process left to start: score on the thread instead
                warnings.warn(f"[yolo_func] could not start the COCO worker process ({e}); scoring on a thread",
                              UserWarning, stacklevel=3)
                self._process = False
                use_process = False
        return self._scorer if use_process else None

    def collect(self, *, wait: bool | float = False) -> None:
        """Take the finished evaluation's numbers (or warn about its failure).

        Args:
          wait: False: only if it has finished; True: wait for it; a number: wait that many seconds at most.
        """
        job = self._job
        if job is None:
            return
        if wait is not True:
            job.thread.join(timeout=0 if wait is False else float(wait))
            if job.thread.is_alive():
                return
        try:
            metrics = job.future.result()
        except Exception as e:  # noqa: BLE001 - the fit goes on; the event holds the error too
            self.errors[job.epoch] = f"{type(e).__name__}: {e}"
            warnings.warn(f"[yolo_func] the background COCO evaluation of epoch {job.epoch} failed "
                          f"({type(e).__name__}: {e}); training goes on (see events.jsonl)", UserWarning, stacklevel=2)
        else:
            self.results[job.epoch] = metrics
        finally:
            self._job = None

    def finish(self, *, timeout: float | None = None) -> dict | None:
        """Wait for the evaluation in flight (``timeout`` seconds at most; None: until it ends) and
        return the numbers of the latest epoch evaluated, or None. One still running after the
        timeout is abandoned: it writes nothing when it ends."""
        try:
            self.collect(wait=True if timeout is None else timeout)
        except BaseException:  # e.g. Ctrl-C while waiting
            self.abandon()
            raise
        self.abandon()
        return self.results[max(self.results)] if self.results else None

    def abandon(self) -> None:
        """Stop caring about the evaluation in flight (it writes nothing when it ends) and stop the
        worker process (terminated if it is still scoring; its thread then ends too)."""
        job, self._job = self._job, None
        if job is not None:
            with self._run_dir.lock:
                job.abandoned.set()
        scorer, self._scorer = self._scorer, None
        if scorer is not None:  # terminated at once when still scoring, or never used (started early, still importing)
            scorer.close(kill=(job is not None and job.thread.is_alive()) or scorer.unused)
