"""Write our trained weights as a ``.pt`` the reference package loads (black box, public API only).

    python benchmarks/to_reference_pt.py runs/detect/x/weights/last.pt /tmp/ours_as_ref.pt

Our checkpoint (or any file ``yolo-func val --weights`` reads) -> ``yolo_func.io.to_reference``
(the reference state-dict layout) -> a freshly built reference model of the same scale, task and
class count (``YOLO("yolov8n.yaml")``-style), ``load_state_dict(strict=True)``, class names set,
the task recorded, ``YOLO.save``. Then checks the file back: the reference reloads it as the same
task (``YOLO(dst).task``) and our reader loads it and gives the same tensors.
Needs ``ultralytics`` importable (benchmarks only; never a dependency of the package).

The task: ``YOLO(path)`` takes it from the saved model's ``task`` attribute, which ``YOLO(yaml)``
sets on the model it builds but a bare ``SegmentationModel(yaml, nc=...)`` lacks; without it the
reference reads the file as ``detect`` (even with ``YOLO(path, task="segment")``) and its ``val``
runs the detection validator on a segmentation head (``AttributeError: 'tuple' object has no
attribute 'shape'`` in its NMS). So the rebuilt model gets the ``task`` and ``args`` of the one
``YOLO(yaml)`` built.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from yolo_func.cli_eval import load_weights  # noqa: E402
from yolo_func.io import load_reference_checkpoint, to_reference  # noqa: E402

_SUFFIX = {"detect": "", "segment": "-seg", "pose": "-pose"}


def convert(src: str | Path, dst: str | Path) -> Path:
    """Writes ``dst`` and returns it; raises when the round trip does not give the same tensors."""
    from ultralytics import YOLO

    w = load_weights(src)
    model = w.model
    sd = {k: v.detach().float().cpu() for k, v in to_reference(model, w.params, w.state).items()}
    if model.task not in _SUFFIX:
        raise ValueError(f"{src}: only detect, segment and pose models are converted here (got {model.task})")
    yaml = f"yolov8{model.scale}{_SUFFIX[model.task]}.yaml"
    ref = YOLO(yaml, task=model.task)
    from ultralytics.nn.tasks import DetectionModel, PoseModel, SegmentationModel

    built = ref.model  # YOLO(yaml) set its task and args; a bare cls(...) has neither
    if model.task == "pose":
        from yolo_func.eval.evaluate import model_kpt_shape

        kpt = model_kpt_shape(model, w.params)  # (P, D) from the pose head's output channels
        ref.model = PoseModel(yaml, nc=model.num_classes, data_kpt_shape=tuple(kpt), verbose=False)
    else:
        cls = {"detect": DetectionModel, "segment": SegmentationModel}[model.task]
        ref.model = cls(yaml, nc=model.num_classes, verbose=False)
    ref.model.task = model.task  # what YOLO(path) reads the task from (else "detect")
    ref.model.args = {**(getattr(built, "args", None) or {}), "task": model.task}
    missing = ref.model.load_state_dict(sd, strict=False)
    extra = [k for k in missing.missing_keys if not k.endswith("num_batches_tracked")]
    if extra or missing.unexpected_keys:
        raise ValueError(f"state dict mismatch: missing {extra[:5]}, unexpected {missing.unexpected_keys[:5]}")
    ref.model.names = {i: n for i, n in enumerate(w.names)}
    dst = Path(dst)
    ref.save(str(dst))
    seen = YOLO(str(dst)).task
    if seen != model.task:
        raise ValueError(f"{dst}: the reference reads this file as task {seen!r}, not {model.task!r}")
    back = load_reference_checkpoint(dst)
    for k, v in sd.items():
        if k in back and not torch.allclose(back[k].float(), v, rtol=1e-3, atol=1e-3):  # the file is fp16
            raise ValueError(f"{dst}: {k} differs after the round trip")
    return dst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src")
    ap.add_argument("dst")
    a = ap.parse_args()
    print(convert(a.src, a.dst))


if __name__ == "__main__":
    main()
