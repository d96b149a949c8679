"""Shared test configuration: strict numerics, hypothesis profiles, marker skipping."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings

# Parity tests are strict: no TF32, deterministic kernels where torch has them.
torch.backends.cudnn.allow_tf32 = False
torch.backends.cuda.matmul.allow_tf32 = False
torch.use_deterministic_algorithms(True, warn_only=True)

settings.register_profile(
    "ci", derandomize=True, deadline=None, print_blob=True, max_examples=25,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", deadline=None, max_examples=50, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

#: The shared data folder (small COCO subsets); tests that need it skip when it is absent.
#: ``$YOLO_FUNC_SHARED_DATA`` overrides it (the GPU machine gets a copy inside the checkout).
SHARED_DATA = Path(os.environ.get("YOLO_FUNC_SHARED_DATA") or Path(__file__).resolve().parents[1].parent / "shared" / "data")

#: Tolerances in one place (GPU kernels differ from CPU ones in the last bits).
TOL = {"cpu": dict(rtol=1e-5, atol=1e-6), "cuda": dict(rtol=1e-4, atol=1e-4)}


def _has_reference() -> bool:
    return importlib.util.find_spec("ultralytics") is not None


def pytest_collection_modifyitems(config, items):
    skip_cuda = pytest.mark.skip(reason="needs a CUDA GPU (marker 'cuda')")
    skip_ref = pytest.mark.skip(reason="the reference package (ultralytics) is not importable (marker 'parity')")
    has_cuda, has_ref = torch.cuda.is_available(), _has_reference()
    for item in items:
        # get_closest_marker, not `in item.keywords`: keywords include folder names (tests/parity/).
        if item.get_closest_marker("cuda") is not None and not has_cuda:
            item.add_marker(skip_cuda)
        if item.get_closest_marker("parity") is not None and not has_ref:
            item.add_marker(skip_ref)


@pytest.fixture
def gen() -> torch.Generator:
    """A seeded CPU generator (init draws from the CPU so seeds are device independent)."""
    return torch.Generator().manual_seed(0)


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """``../shared/data``; skips the test when the folder is absent."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared test data not found at {SHARED_DATA}")
    return SHARED_DATA


@pytest.fixture
def builtin_segment_yolo(tmp_path, monkeypatch):
    """A factory ``make(num_images) -> (ds, data, names)`` for the reference-parity tests of masks:
    built-in segmentation val images written in the Ultralytics format, our ``YoloDataset`` of
    them, the reference's parsed data dict (its public ``check_det_dataset``; offline, a private
    settings folder) and each of our images' file name, to pair its dataset's items with ours."""
    monkeypatch.setenv("YOLO_OFFLINE", "1")
    monkeypatch.setenv("YOLO_CONFIG_DIR", str(tmp_path / "cfg"))

    def make(num_images: int):
        from ultralytics.data.utils import check_det_dataset

        from yolo_func.data import YoloDataset, builtin_dataset
        from yolo_func.data.yolo import write_yolo_dataset

        coco = builtin_dataset("segment", "val", root=tmp_path / "b", num_images=num_images)
        yaml_path = write_yolo_dataset({"train": coco, "val": coco}, tmp_path / "yolo")
        ds = YoloDataset(yaml_path, "val", task="segment")
        return ds, check_det_dataset(str(yaml_path)), [Path(f).name for f in ds.file_names]

    return make
