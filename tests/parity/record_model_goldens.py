"""Record reference model outputs for our seeded init (run in the oracle venv; see ORACLE.md).

    YOLO_OFFLINE=1 YOLO_CONFIG_DIR=/tmp/ycfg .oracle/bin/python tests/parity/record_model_goldens.py

For each of n/detect, n/segment, n/pose:

1. our init from ``torch.Generator().manual_seed(INIT_SEED)`` (``yolov8("n", task=...).init``) is
   loaded into the reference model built from its yaml (``to_reference`` + ``load_state_dict``);
2. the input is ``torch.randn(INPUT_SHAPE, generator=torch.Generator().manual_seed(INPUT_SEED))``;
3. one train-mode forward records ``boxes``, ``scores``, ``feats``, (``mask_coefficient``, ``proto`` |
   ``kpts``) and then the BN running statistics (``bn:<reference key>``);
4. one eval-mode forward, with those updated statistics, records the inference output ``y`` (and
   ``proto`` for segmentation).

Everything is stored as float32 in ``tests/parity/goldens/model_n_<task>.npz`` together with the
recipe (seeds, shape, versions) and a fingerprint of the input (its sum and first values), so that a
change of torch's RNG stream is told apart from a change of the model. The CPU test that reads them
is ``tests/parity/test_model_goldens.py``.

Size: the network is drawn first from the same seed, so its outputs and statistics are the same for
all three tasks (and the whole detect head for detect and segment, both nc = 80). Entries of the
segment / pose recordings that are bitwise equal to the detect recording are left out and named in
``recipe:from_detect``; when the first ``4 + nc`` rows of the eval output equal detect's, only the
extra rows are stored (``eval:y_extra``). That keeps each file well under 300 KB.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

os.environ.setdefault("YOLO_OFFLINE", "1")
os.environ.setdefault("YOLO_CONFIG_DIR", os.path.join(tempfile.gettempdir(), "yolo_func_ycfg"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

INIT_SEED = 0
INPUT_SEED = 1
INPUT_SHAPE = (2, 3, 64, 64)
YAML = {"detect": "yolov8n.yaml", "segment": "yolov8n-seg.yaml", "pose": "yolov8n-pose.yaml"}
OUT = Path(__file__).resolve().parent / "goldens"


def make_input() -> torch.Tensor:
    """The recorded input (the test regenerates it with the same recipe)."""
    return torch.randn(INPUT_SHAPE, generator=torch.Generator().manual_seed(INPUT_SEED))


def record(task: str) -> dict[str, np.ndarray]:
    import ultralytics
    from ultralytics.nn.tasks import DetectionModel, PoseModel, SegmentationModel

    from yolo_func.io import to_reference
    from yolo_func.models import yolov8

    model = yolov8("n", task=task)
    params, state = model.init(torch.Generator().manual_seed(INIT_SEED))
    cls = {"detect": DetectionModel, "segment": SegmentationModel, "pose": PoseModel}[task]
    ref = cls(YAML[task], nc=model.num_classes, verbose=False).float()
    ref.load_state_dict(to_reference(model, params, state), strict=True)
    x = make_input()
    out: dict[str, np.ndarray] = {}
    ref.train()
    with torch.no_grad():
        raw = ref(x)
    for k in ("boxes", "scores", "mask_coefficient", "proto", "kpts"):
        if k in raw:
            out[f"train:{k}"] = raw[k].numpy()
    for i, f in enumerate(raw["feats"]):
        out[f"train:feats{i}"] = f.numpy()
    for k, v in ref.state_dict().items():
        if k.endswith(("running_mean", "running_var")):
            out[f"bn:{k}"] = v.numpy()
    ref.eval()
    with torch.no_grad():
        y, _ = ref(x)
    if task == "segment":
        y, proto = y
        out["eval:proto"] = proto.numpy()
    out["eval:y"] = y.numpy()
    out = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in out.items()}
    out["recipe:init_seed"] = np.array(INIT_SEED)
    out["recipe:input_seed"] = np.array(INPUT_SEED)
    out["recipe:input_shape"] = np.array(INPUT_SHAPE)
    out["recipe:input_sum"] = np.array(float(x.double().sum()))
    out["recipe:input_head"] = x.flatten()[:8].numpy()
    out["recipe:versions"] = np.array(f"ultralytics {ultralytics.__version__}, torch {torch.__version__}")
    return out


def dedupe(rec: dict[str, np.ndarray], detect: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Drop the entries bitwise equal to the detect recording (named in ``recipe:from_detect``)."""
    shared = [
        k for k, v in rec.items()
        if not k.startswith("recipe:") and k != "eval:y" and k in detect and np.array_equal(v, detect[k])
    ]
    out = {k: v for k, v in rec.items() if k not in shared}
    y, yd = rec["eval:y"], detect["eval:y"]
    if y.shape[1] > yd.shape[1] and np.array_equal(y[:, : yd.shape[1]], yd):
        del out["eval:y"]
        out["eval:y_extra"] = np.ascontiguousarray(y[:, yd.shape[1] :])
        shared.append("eval:y")
    out["recipe:from_detect"] = np.array(shared)
    return out


if __name__ == "__main__":
    OUT.mkdir(parents=True, exist_ok=True)
    detect = record("detect")
    for task in ("detect", "segment", "pose"):
        rec = detect if task == "detect" else dedupe(record(task), detect)
        path = OUT / f"model_n_{task}.npz"
        np.savez_compressed(path, **rec)
        print(f"{path} {path.stat().st_size / 1024:.0f} KiB, {len(rec)} entries")
