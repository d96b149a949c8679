"""The COCO scoring worker of :class:`yolo_func.train.coco_background.BackgroundCoco`, run as
``python -m yolo_func.train._coco_worker FD``: a separate interpreter (not a fork of the training
process, which holds CUDA and threads; not ``multiprocessing``'s spawn, which re-runs the user's
``__main__``) that talks over the socket ``FD`` with :class:`multiprocessing.connection.Connection`
messages: first the ground truth, then ``(records, image_ids, iou_types)`` requests answered with
``("ok", metrics)`` / ``("error", "Type: message")``, until ``None`` or a closed socket."""

from __future__ import annotations

import signal
import sys
from multiprocessing.connection import Connection


def serve(conn: Connection) -> None:
    """Index the ground truth received first, then score requests until told to stop."""
    from yolo_func.eval import coco_eval

    try:
        first = conn.recv()
    except (EOFError, OSError):
        return
    if first is None:  # started early (BackgroundCoco.start) and stopped before any evaluation
        return
    gt = coco_eval.load_coco(first)
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            return
        if job is None:
            return
        records, image_ids, iou_types = job
        try:
            with coco_eval.quiet_stdout():
                # workers=0: serial here; this process is already the parallelism
                metrics = coco_eval.evaluate(gt, records, iou_types=iou_types, image_ids=image_ids, verbose=False,
                                             workers=0)
            conn.send(("ok", metrics))
        except BaseException as e:  # noqa: BLE001 -- sent to the fit, which logs and warns
            conn.send(("error", f"{type(e).__name__}: {e}"))


if __name__ == "__main__":
    # Ctrl-C in a terminal reaches the whole process group: the fit handles it (and stops this
    # worker through the socket); the worker must not die mid-answer on its own
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    serve(Connection(int(sys.argv[1])))
