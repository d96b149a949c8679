"""Reading and writing weights: the reference (Ultralytics YOLOv8) state-dict layout, the model a
reference file holds and safe reading of its checkpoint files (:mod:`yolo_func.io.ultralytics`, the
facade over the internal ``_ref_*`` / ``_safe_pickle`` modules); our own atomic pytree checkpoints
(:mod:`yolo_func.io.checkpoint`)."""

from yolo_func.io.checkpoint import FORMAT, atomic_write, load_checkpoint, read_checkpoint, restore_tree, save_checkpoint

from yolo_func.io.ultralytics import (
    HEAD_LAYER,
    NETWORK_LAYERS,
    Loaded,
    LoadReport,
    PickledObject,
    ReferenceCheckpoint,
    ReferenceModel,
    ReferenceSpec,
    RefEntry,
    RefusedGlobalError,
    from_reference,
    infer_reference_model,
    infer_reference_spec,
    load_reference_checkpoint,
    load_reference_model,
    load_reference_weights,
    our_path,
    reference_key,
    read_reference_checkpoint,
    reference_layout,
    restricted_pickle,
    to_reference,
)

__all__ = [
    "FORMAT",
    "save_checkpoint",
    "load_checkpoint",
    "read_checkpoint",
    "restore_tree",
    "atomic_write",
    "HEAD_LAYER",
    "NETWORK_LAYERS",
    "Loaded",
    "LoadReport",
    "PickledObject",
    "ReferenceCheckpoint",
    "ReferenceModel",
    "ReferenceSpec",
    "RefEntry",
    "RefusedGlobalError",
    "from_reference",
    "infer_reference_model",
    "infer_reference_spec",
    "load_reference_checkpoint",
    "load_reference_model",
    "load_reference_weights",
    "our_path",
    "reference_key",
    "read_reference_checkpoint",
    "reference_layout",
    "restricted_pickle",
    "to_reference",
]
