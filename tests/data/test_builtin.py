"""The built-in dataset: determinism, the cache's atomicity, and the invariants of its annotations."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from yolo_func.data import CocoDataset, YoloDataset, builtin_dataset
from yolo_func.data import builtin as B
from yolo_func.data.yolo import write_yolo_dataset

COCO_FLIP = [0, 2, 1, 4, 3, 6, 5, 8, 7, 10, 9, 12, 11, 14, 13, 16, 15]
N = 10


@pytest.fixture(scope="session")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("builtin-cache")


@pytest.fixture(scope="session")
def shapes(cache) -> CocoDataset:
    return builtin_dataset("segment", "train", root=cache, num_images=N)


@pytest.fixture(scope="session")
def figures(cache) -> CocoDataset:
    return builtin_dataset("pose", "train", root=cache, num_images=N)


def _hashes(folder: Path) -> dict[str, str]:
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_same_seed_same_bytes(tmp_path):
    a = B.generate_builtin("shapes", "val", root=tmp_path / "a", seed=3, num_images=4)
    b = B.generate_builtin("shapes", "val", root=tmp_path / "b", seed=3, num_images=4)
    assert _hashes(a) == _hashes(b) and len(_hashes(a)) == 4 + 2
    c = B.generate_builtin("shapes", "val", root=tmp_path / "c", seed=4, num_images=4)
    assert (a / "images/000001.png").read_bytes() != (c / "images/000001.png").read_bytes()
    d = B.generate_builtin("shapes", "train", root=tmp_path / "a", seed=3, num_images=4)
    assert (a / "images/000001.png").read_bytes() != (d / "images/000001.png").read_bytes()


def test_figures_same_seed_same_bytes(tmp_path):
    a = B.generate_builtin("figures", "train", root=tmp_path / "a", num_images=3)
    b = B.generate_builtin("figures", "train", root=tmp_path / "b", num_images=3)
    assert _hashes(a) == _hashes(b)


def test_cache_folder_is_versioned_and_complete(shapes, cache):
    folder = cache / f"builtin-v{B.GENERATOR_VERSION}" / f"shapes-seed0-train-{N}"
    assert shapes.annotations_path == folder / "annotations.json"
    manifest = json.loads((folder / "manifest.json").read_text())
    assert sorted(manifest) == sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*")
                                      if p.is_file() and p.name != "manifest.json")
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".")]  # no temp folder left


def test_corrupt_cache_is_regenerated(tmp_path):
    folder = B.generate_builtin("shapes", "val", root=tmp_path, num_images=3)
    before = _hashes(folder)
    (folder / "images/000002.png").write_bytes(b"\x89PNG\r\n\x1a\n")  # truncated by a crash
    assert B.generate_builtin("shapes", "val", root=tmp_path, num_images=3) == folder
    assert _hashes(folder) == before
    (folder / "manifest.json").unlink()  # an interrupted copy
    ds = builtin_dataset("detect", "val", root=tmp_path, num_images=3)
    assert _hashes(folder) == before and len(ds) == 3


def test_interrupted_generation_leaves_nothing(tmp_path, monkeypatch):
    def boom(out, *args):
        (out / "images").mkdir()
        (out / "images" / "000001.png").write_bytes(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(B, "_write_split", boom)
    with pytest.raises(KeyboardInterrupt):
        B.generate_builtin("shapes", "train", root=tmp_path, num_images=2)
    base = tmp_path / f"builtin-v{B.GENERATOR_VERSION}"
    assert list(base.iterdir()) == []


def test_concurrent_generation_keeps_the_finished_copy(tmp_path, monkeypatch):
    real = B._write_split
    seen = {}

    def racing(out, kind, split, seed, n):
        # Another process generates and publishes the same split while this one is writing.
        monkeypatch.setattr(B, "_write_split", real)
        first = B.generate_builtin(kind, split, root=tmp_path, seed=seed, num_images=n)
        seen["inode"] = (first / "annotations.json").stat().st_ino
        real(out, kind, split, seed, n)

    monkeypatch.setattr(B, "_write_split", racing)
    folder = B.generate_builtin("shapes", "val", root=tmp_path, num_images=2)
    assert (folder / "annotations.json").stat().st_ino == seen["inode"]  # not replaced under a reader
    assert [p.name for p in folder.parent.iterdir()] == [folder.name]  # no temp folder left


def test_cache_root_from_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert B.builtin_root() == tmp_path / "xdg" / "yolo_func"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert B.builtin_root() == tmp_path / "home" / ".cache" / "yolo_func"
    assert B.builtin_root(tmp_path / "r") == tmp_path / "r"


def test_bad_arguments():
    with pytest.raises(ValueError, match="split='test'"):
        builtin_dataset("detect", "test")
    with pytest.raises(ValueError, match="task must be one of"):
        builtin_dataset("classify", "train")
    with pytest.raises(ValueError, match="at least 1"):
        builtin_dataset("detect", "train", num_images=0)
    with pytest.raises(ValueError, match=r"seed=-1\): expected an int >= 0"):
        builtin_dataset("detect", "train", seed=-1)


def test_shapes_annotations_are_the_visible_pixels(shapes):
    assert shapes.names == list(B.SHAPE_CLASSES) and shapes.category_ids == [1, 2, 3, 4, 5]
    assert len(shapes) == N and sum(shapes.skipped.values()) == 0
    for i in range(len(shapes)):
        s = shapes[i]
        h, w = s.image.shape[:2]
        assert 320 <= h <= 640 and 320 <= w <= 640 and h % 32 == 0 and w % 32 == 0
        assert shapes.file_names[i].endswith(".png")
        # Occlusion: visible parts never overlap, and each is big enough to be annotated.
        assert s.masks.sum(0).max(initial=0) <= 1
        assert (s.masks.reshape(len(s.masks), -1).sum(1) >= 16).all()
        for mask, box in zip(s.masks, s.boxes):
            ys, xs = np.nonzero(mask)
            np.testing.assert_array_equal(box, [xs.min(), ys.min(), xs.max() + 1, ys.max() + 1])


def test_shape_colours_identify_classes(shapes):
    """Each class is painted in its own colour: the median visible colour is nearest to it."""
    colours = np.array(list(B.SHAPE_CLASSES.values()), np.float64)
    hits = total = 0
    for i in range(len(shapes)):
        s = shapes[i]
        for mask, cls in zip(s.masks, s.classes):
            if mask.sum() < 50:
                continue
            median = np.median(s.image[mask > 0].astype(np.float64), axis=0)
            hits += int(np.argmin(((colours - median) ** 2).sum(1)) == cls)
            total += 1
    assert total > 10 and hits / total > 0.9


def test_figures_keypoints(figures):
    assert figures.names == ["figure"] and figures.kpt_shape == (17, 3) and figures.flip_idx == COCO_FLIP
    seen = set()
    masks_of = CocoDataset(figures.annotations_path, figures.image_dir, task="segment")  # the same JSON's masks
    for i in range(len(figures)):
        s = figures[i]
        h, w = s.image.shape[:2]
        assert s.keypoints.shape == (len(s.boxes), 17, 3)
        masks = masks_of[i].masks
        assert len(masks) == len(s.keypoints)
        for kp, mask in zip(s.keypoints, masks):
            v = kp[:, 2]
            seen |= set(v.tolist())
            assert set(v.tolist()) <= {0.0, 1.0, 2.0}
            np.testing.assert_array_equal(kp[v == 0, :2], 0)
            inside = kp[v > 0]
            assert ((inside[:, 0] >= 0) & (inside[:, 0] < w) & (inside[:, 1] >= 0) & (inside[:, 1] < h)).all()
            # A visible keypoint lies on its own figure's visible pixels.
            for x, y, _ in kp[v == 2]:
                assert mask[int(y), int(x)] == 1
            # Frontal figures: the left shoulder and hip are on the image's right of the right ones
            # (before the tilt of at most 15 degrees, the left-right gap is 0.15 of the height).
            if v[5] > 0 and v[6] > 0:
                assert kp[5, 0] > kp[6, 0]
    assert {1.0, 2.0} <= seen


def test_figures_have_boxes_on_visible_pixels(figures):
    masks_of = CocoDataset(figures.annotations_path, figures.image_dir, task="segment")
    n = 0
    for i in range(len(figures)):
        s, m = figures[i], masks_of[i]
        assert m.masks.sum(0).max(initial=0) <= 1
        for mask, box in zip(m.masks, s.boxes):
            ys, xs = np.nonzero(mask)
            np.testing.assert_array_equal(box, [xs.min(), ys.min(), xs.max() + 1, ys.max() + 1])
            n += 1
    assert n >= N


def test_segment_and_detect_share_the_shapes(cache, shapes):
    det = builtin_dataset("detect", "train", root=cache, num_images=N)
    assert det.annotations_path == shapes.annotations_path
    for i in (0, N - 1):
        np.testing.assert_array_equal(det[i].boxes, shapes[i].boxes)


def test_builtin_converts_to_yolo_format(shapes, tmp_path):
    yolo = YoloDataset(write_yolo_dataset(shapes, tmp_path), "train", task="segment")
    ious = []
    for i in range(len(shapes)):
        a, b = shapes[i], yolo[i]
        np.testing.assert_array_equal(a.classes, b.classes)
        np.testing.assert_allclose(b.boxes, a.boxes, atol=1.0)
        for m1, m2 in zip(a.masks, b.masks):
            ious.append((m1 & m2).sum() / (m1 | m2).sum())
    assert min(ious) >= 0.9 and np.mean(ious) >= 0.99


@pytest.mark.slow
def test_default_split_statistics(tmp_path):
    """The default train split (256 images): balanced classes, small objects, crowded images."""
    ds = builtin_dataset("segment", "train", root=tmp_path)
    assert len(ds) == B.DEFAULT_SIZES["train"]
    counts = np.zeros(len(ds.names), np.int64)
    sizes, per_image = [], []
    for i in range(len(ds)):
        boxes, classes, _ = ds.labels(i)
        counts += np.bincount(classes, minlength=len(ds.names))
        sizes += np.minimum(boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1]).tolist()
        per_image.append(len(classes))
    assert counts.min() > 0.7 * counts.mean()
    sizes = np.array(sizes)
    assert (sizes < 20).mean() > 0.05 and (sizes > 100).mean() > 0.1
    assert max(per_image) >= 10 and min(per_image) <= 1


@pytest.mark.cuda
@pytest.mark.parity
@pytest.mark.slow
def test_reference_trainer_learns_the_shapes(tmp_path):
    """Learnable: the reference trainer (black box) reaches box mAP50 >= 0.85 on the built-in val
    split within 3 minutes on one GPU at 640 (the training-loop issue's bar for our own trainer)."""
    import os
    import subprocess
    import sys

    data = write_yolo_dataset({"train": builtin_dataset("detect", "train", root=tmp_path / "cache"),
                               "val": builtin_dataset("detect", "val", root=tmp_path / "cache")}, tmp_path / "yolo")
    script = (
        "import json\n"
        "from ultralytics import YOLO\n"
        f"r = YOLO('yolov8n.yaml').train(data={str(data)!r}, epochs=300, time=0.05, imgsz=640, batch=16, workers=8,"
        f" device=0, optimizer='SGD', lr0=0.01, plots=False, seed=0, project={str(tmp_path / 'runs')!r}, name='det',"
        " verbose=False)\n"
        "print('RESULT', json.dumps({k: float(v) for k, v in r.results_dict.items()}))\n")
    repo = Path(__file__).resolve().parents[2]  # polars stand-in (ORACLE.md): ../shared or a carried shared/
    stubs = next((p for p in (repo.parent / "shared" / "tools" / "oracle-stubs", repo / "shared" / "tools" / "oracle-stubs")
                  if p.is_dir()), repo.parent / "shared" / "tools" / "oracle-stubs")
    env = dict(os.environ, YOLO_OFFLINE="1", YOLO_CONFIG_DIR=str(tmp_path / "cfg"),
               PYTHONPATH=os.pathsep.join(p for p in (str(stubs), os.environ.get("PYTHONPATH", "")) if p))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=900)
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line is not None, done.stdout[-3000:] + done.stderr[-3000:]
    metrics = json.loads(line[len("RESULT "):])
    map50 = next(v for k, v in metrics.items() if "mAP50(B)" in k)
    assert map50 >= 0.85, metrics
