"""Reference (Ultralytics YOLOv8) weights: the state-dict layout <-> our params/state trees, the model
a reference state dict holds, and safe reading of official-style ``.pt`` checkpoints
(REFERENCE.md §1.4, §1.6-1.10).

This module is the public face; import from here (or from :mod:`yolo_func.io`). Each part has one
owner module, internal to ``yolo_func.io``:

=========================  ==========================================================================
``io/_ref_keys.py``        the key table: reference positional names <-> our ``/``-paths
                           (:func:`our_path`, :func:`reference_key`), :func:`reference_layout`
``io/_ref_infer.py``       scale, task, classes, keypoints read from the tensor shapes
                           (:func:`infer_reference_model`, :func:`infer_reference_spec`)
``io/_ref_convert.py``     :func:`to_reference`, :func:`from_reference` with its shape checks and
                           mismatch report (:class:`LoadReport`)
``io/_safe_pickle.py``     the restricted unpickler (:data:`restricted_pickle`, :class:`PickledObject`)
``io/_ref_file.py``        reading checkpoint files: weights and metadata
                           (:func:`read_reference_checkpoint`, :func:`load_reference_model`)
=========================  ==========================================================================

Typical use::

    model, params, state, names = load_reference_model("yolov8n-seg.pt")   # all from the file
    params, state = load_reference_weights(yolov8("n", task="segment"), "yolov8n-seg.pt")
    sd = to_reference(model, params, state)   # ref.load_state_dict(sd) in the reference package
"""

from __future__ import annotations

from yolo_func.io._ref_convert import REPORT_LIMIT, Loaded, LoadReport, from_reference, to_reference
from yolo_func.io._ref_file import (
    ReferenceCheckpoint,
    ReferenceModel,
    load_reference_checkpoint,
    load_reference_model,
    load_reference_weights,
    read_reference_checkpoint,
)
from yolo_func.io._ref_infer import ReferenceSpec, infer_reference_model, infer_reference_spec
from yolo_func.io._ref_keys import HEAD_LAYER, NETWORK_LAYERS, RefEntry, our_path, reference_key, reference_layout
from yolo_func.io._safe_pickle import PickledObject, RefusedGlobalError, RestrictedUnpickler, restricted_pickle

__all__ = [
    "HEAD_LAYER",
    "NETWORK_LAYERS",
    "REPORT_LIMIT",
    "RefEntry",
    "LoadReport",
    "Loaded",
    "PickledObject",
    "RefusedGlobalError",
    "RestrictedUnpickler",
    "ReferenceCheckpoint",
    "ReferenceModel",
    "ReferenceSpec",
    "reference_key",
    "our_path",
    "reference_layout",
    "to_reference",
    "from_reference",
    "infer_reference_spec",
    "infer_reference_model",
    "read_reference_checkpoint",
    "load_reference_checkpoint",
    "load_reference_weights",
    "load_reference_model",
    "restricted_pickle",
]
