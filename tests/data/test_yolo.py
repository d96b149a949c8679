"""YoloDataset: the Ultralytics format, read back from a conversion of the COCO test data, and its bad input."""

from __future__ import annotations

import json
from pathlib import Path

import cv2
import numpy as np
import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st
from pycocotools import mask as mask_utils

from yolo_func.data import CocoDataset, YoloDataset
from yolo_func.data.polygons import merge_polygon_parts
from yolo_func.data.yolo import label_path, write_yolo_dataset

COCO_FLIP = [0, 2, 1, 4, 3, 6, 5, 8, 7, 10, 9, 12, 11, 14, 13, 16, 15]


@pytest.fixture(scope="module")
def converted(shared_data, tmp_path_factory):
    """{task: (CocoDataset, data.yaml of its YOLO-format conversion)} for coco-tiny / coco-pose-tiny."""
    out = {}
    for task, folder in (("detect", "coco-tiny"), ("segment", "coco-tiny"), ("pose", "coco-pose-tiny")):
        root = shared_data / folder
        coco = CocoDataset(root / "annotations.json", root / "images", task=task)
        out[task] = coco, write_yolo_dataset(coco, tmp_path_factory.mktemp(f"yolo-{task}"))
    return out


def _pairs(coco: CocoDataset, yolo: YoloDataset):
    by_name = {Path(f).name: i for i, f in enumerate(yolo.file_names)}
    assert sorted(by_name) == sorted(coco.file_names)
    for i in range(len(coco)):
        yield coco[i], yolo[by_name[coco.file_names[i]]]


def _check_masks(a: np.ndarray, b: np.ndarray) -> None:
    """IoU >= 0.95 for instances of at least 100 pixels; smaller ones differ by at most 6 pixels.

    pycocotools rasterises polygons at 1/5 px with round-half-up; COCO's 2-decimal coordinates land
    exactly on that tie for 1 in 20 values, and the normalise / denormalise round trip moves them by
    an ulp to either side, which flips a pixel or two along the edge.
    """
    for m1, m2 in zip(a, b):
        inter, union = int((m1 & m2).sum()), int((m1 | m2).sum())
        if m1.sum() >= 100:
            assert inter / union >= 0.95
        else:
            assert union - inter <= 6


@pytest.mark.parametrize("task", ["detect", "segment", "pose"])
def test_conversion_reads_back_as_coco(converted, task):
    coco, data_yaml = converted[task]
    for split in ("train", "val"):
        yolo = YoloDataset(data_yaml, split, task=task)
        assert len(yolo) == len(coco) and yolo.names == coco.names and sum(yolo.skipped.values()) == 0
        np.testing.assert_array_equal(np.sort(yolo.image_sizes, axis=0), np.sort(coco.image_sizes, axis=0))
    n = 0
    for a, b in _pairs(coco, yolo):
        np.testing.assert_array_equal(a.image, b.image)
        assert b.boxes.dtype == np.float32 and b.classes.dtype == np.int64
        np.testing.assert_array_equal(a.classes, b.classes)
        np.testing.assert_allclose(b.boxes, a.boxes, rtol=0, atol=1.0)
        if task == "segment":
            assert b.masks.shape == a.masks.shape and b.masks.dtype == np.uint8
            _check_masks(a.masks, b.masks)
        else:
            assert b.masks is None
        if task == "pose":
            assert b.keypoints.shape == a.keypoints.shape
            np.testing.assert_array_equal(a.keypoints[..., 2], b.keypoints[..., 2])
            np.testing.assert_allclose(b.keypoints[..., :2], a.keypoints[..., :2], rtol=0, atol=0.01)
        else:
            assert b.keypoints is None
        n += len(a.classes)
    assert n > 0
    if task == "pose":
        assert yolo.kpt_shape == (17, 3) and yolo.flip_idx == COCO_FLIP


def test_detect_reads_polygon_labels_for_boxes(converted):
    coco, _ = converted["detect"]
    yolo = YoloDataset(converted["segment"][1], "train", task="detect")
    for a, b in _pairs(coco, yolo):
        np.testing.assert_array_equal(a.classes, b.classes)
        np.testing.assert_allclose(b.boxes, a.boxes, rtol=0, atol=1.0)


def _ring() -> np.ndarray:
    m = np.zeros((60, 80), np.uint8)
    cv2.circle(m, (40, 30), 25, 1, -1)
    cv2.circle(m, (40, 30), 12, 0, -1)
    m[5:12, 2:9] = 1  # a second, separate part
    return m


def _triangle_and_specks() -> np.ndarray:
    m = np.zeros((60, 80), np.uint8)
    cv2.fillPoly(m, [np.array([[5, 5], [70, 20], [20, 55]])], 1)
    m[40, 60] = 1  # a lone pixel
    m[45:47, 50:60] = 1  # a 2-pixel-high bar
    return m


@pytest.mark.parametrize("make", [_ring, _triangle_and_specks])
def test_rle_masks_round_trip_through_polygons(tmp_path, make):
    """Non-crowd RLE masks (holes, specks) are outlined from OpenCV contours and rasterise back."""
    m = make()
    h, w = m.shape
    rle = mask_utils.encode(np.asfortranarray(m))
    (tmp_path / "images").mkdir()
    cv2.imwrite(str(tmp_path / "images" / "r.png"), np.zeros((h, w, 3), np.uint8))
    ys, xs = np.nonzero(m)
    ann = {"id": 1, "image_id": 1, "category_id": 3, "iscrowd": 0, "area": int(m.sum()),
           "bbox": [int(xs.min()), int(ys.min()), int(xs.max() - xs.min() + 1), int(ys.max() - ys.min() + 1)],
           "segmentation": {"size": [h, w], "counts": rle["counts"].decode()}}
    (tmp_path / "a.json").write_text(json.dumps({"images": [{"id": 1, "file_name": "r.png", "height": h, "width": w}],
                                                 "annotations": [ann], "categories": [{"id": 3, "name": "ring"}]}))
    coco = CocoDataset(tmp_path / "a.json", tmp_path / "images", task="segment")
    yolo = YoloDataset(write_yolo_dataset(coco, tmp_path / "y"), "val", task="segment")
    got = yolo[0].masks[0]
    inter, union = (got & m).sum(), (got | m).sum()
    assert inter / union >= 0.99  # exact on these shapes with OpenCV 5.1 and pycocotools 2.0.11
    np.testing.assert_allclose(yolo[0].boxes, coco[0].boxes, atol=1.0)


@st.composite
def _disjoint_rectangles(draw):
    cells = draw(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 3)), min_size=1, max_size=4, unique=True))
    parts = []
    for cx, cy in cells:  # one rectangle inside each 20x20 cell, with a margin, so they never touch
        x1, y1 = cx * 20 + draw(st.integers(1, 6)), cy * 20 + draw(st.integers(1, 6))
        x2, y2 = x1 + draw(st.integers(3, 12)), y1 + draw(st.integers(3, 12))
        parts.append(np.array([[x1, y1], [x2, y1], [x2, y2], [x1, y2]], np.float64))
    return parts


@given(_disjoint_rectangles())
def test_merged_parts_rasterise_to_their_union(parts):
    path = merge_polygon_parts(parts)
    merged = mask_utils.decode(mask_utils.frPyObjects([path.ravel().tolist()], 80, 80))[:, :, 0]
    union = mask_utils.decode(mask_utils.merge(mask_utils.frPyObjects([p.ravel().tolist() for p in parts], 80, 80)))
    np.testing.assert_array_equal(merged, union)


def test_merged_parts_hook_each_part_at_its_nearest_vertex_by_hand():
    base = np.array([[0, 0], [10, 0], [10, 10], [0, 10]], np.float64)
    a = np.array([[12, 1], [14, 1], [14, 3]], np.float64)  # nearest: a[0] to base[1]
    b = np.array([[-3, 11], [-2, 12], [-4, 12]], np.float64)  # nearest: b[1] to base[3]
    want = [[0, 0], [10, 0], [12, 1], [14, 1], [14, 3], [12, 1], [10, 0], [10, 10], [0, 10],
            [-2, 12], [-4, 12], [-3, 11], [-2, 12], [0, 10]]
    np.testing.assert_array_equal(merge_polygon_parts([base, a, b]), want)
    np.testing.assert_array_equal(merge_polygon_parts([base, b, a]), want)  # in base order, whatever the parts' order
    one = merge_polygon_parts([base])  # one part: itself, as a new array
    np.testing.assert_array_equal(one, base)
    one[0] = 99
    assert base[0, 0] == 0


def test_label_path_replaces_the_last_images_folder():
    assert label_path(Path("/d/images/train/images/x.jpg")) == Path("/d/images/train/labels/x.txt")
    assert label_path(Path("/d/images/val/sub/y.png")) == Path("/d/labels/val/sub/y.txt")


# ---------------------------------------------------------------------- hand-made datasets
def _image(path: Path, h=20, w=40) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    cv2.imwrite(str(path), np.full((h, w, 3), 100, np.uint8))


def _label(image: Path, text: str) -> None:
    p = label_path(image)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)


def _yaml(root: Path, **config) -> Path:
    path = root / "data.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_yaml_forms_folders_lists_and_txt(tmp_path):
    a, b, c = tmp_path / "images/a/1.png", tmp_path / "images/b/2.png", tmp_path / "images/c/3.jpg"
    for f in (a, b, c):
        _image(f)
    _label(a, "1 0.5 0.5 0.5 0.5\n")
    _label(b, "0 0.25 0.5 0.5 1.0\n\n0 0.75 0.25 0.1 0.1\n")
    # c has no label file: a background image.
    (tmp_path / "lists").mkdir()
    (tmp_path / "lists" / "val.txt").write_text("./../images/a/1.png\nimages/c/3.jpg\n")
    data = _yaml(tmp_path, path=".", train=["images/a", "images/b"], val="lists/val.txt", names={0: "cat", 1: "dog"})
    train = YoloDataset(data, "train", task="detect")
    assert train.names == ["cat", "dog"] and len(train) == 2
    assert train.file_names == ["images/a/1.png", "images/b/2.png"] and train.image_ids.tolist() == [0, 1]
    assert train.image_sizes.tolist() == [[20, 40], [20, 40]]
    s = train[1]
    np.testing.assert_allclose(s.boxes, [[0, 0, 20, 20], [28, 4, 32, 6]], atol=1e-5)
    assert s.classes.tolist() == [0, 0] and s.image_id == 1
    np.testing.assert_allclose(train[0].boxes, [[10, 5, 30, 15]], atol=1e-5)
    val = YoloDataset(data, "val", task="detect")
    assert val.file_names == ["images/a/1.png", "images/c/3.jpg"]
    assert val[1].boxes.shape == (0, 4) and val[1].classes.shape == (0,)
    names_list = _yaml(tmp_path, train="images/b", names=["cat", "dog"])  # no path: the yaml's folder
    assert YoloDataset(names_list, "train", task="detect").names == ["cat", "dog"]


def test_pose_two_column_keypoints(tmp_path):
    img = tmp_path / "images/t/1.png"
    _image(img)
    _label(img, "0 0.5 0.5 0.5 0.5 0.25 0.5 0 0 0.75 0.5\n")
    data = _yaml(tmp_path, train="images/t", names=["p"], kpt_shape=[3, 2], flip_idx=[0, 2, 1])
    s = YoloDataset(data, "train", task="pose")[0]
    np.testing.assert_allclose(s.keypoints[0], [[10, 10, 2], [0, 0, 0], [30, 10, 2]], atol=1e-5)


@pytest.mark.parametrize("config, task, match", [
    ({"train": "images/t"}, "detect", r"missing key\(s\) \['names'\]"),
    ({"names": ["a"]}, "detect", r"missing key\(s\) \['train'\]"),
    ({"names": ["a"], "train": "images/t"}, "pose", r"\['kpt_shape', 'flip_idx'\]"),
    ({"names": ["a"], "train": "images/t", "kpt_shape": [3, 3], "flip_idx": [0, 1, 1]}, "pose", "permutation"),
    ({"names": ["a"], "train": "images/t", "kpt_shape": [3, 4], "flip_idx": [0, 1, 2]}, "pose", "kpt_shape must be"),
    ({"names": {0: "a", 2: "b"}, "train": "images/t"}, "detect", "0..K-1"),
    ({"names": [], "train": "images/t"}, "detect", "non-empty"),
    ({"names": ["a"], "train": "images/nowhere"}, "detect", "neither a folder"),
    ({"names": ["a"], "train": "images/empty"}, "detect", "has no images"),
])
def test_yaml_errors_raise(tmp_path, config, task, match):
    _image(tmp_path / "images/t/1.png")
    (tmp_path / "images/empty").mkdir()
    data = _yaml(tmp_path, **config)
    with pytest.raises(ValueError, match=r"^\[yolo_func\] data_yaml=") as err:
        YoloDataset(data, "train", task=task)
    assert str(data) in str(err.value)
    assert err.match(match)


def test_missing_or_invalid_yaml(tmp_path):
    with pytest.raises(ValueError, match=r"no such file"):
        YoloDataset(tmp_path / "nope.yaml", "train", task="detect")
    (tmp_path / "bad.yaml").write_text("names: [a\n")
    with pytest.raises(ValueError, match="not valid YAML"):
        YoloDataset(tmp_path / "bad.yaml", "train", task="detect")


@pytest.mark.parametrize("task, line", [
    ("detect", "0 0.5 0.5 0.5"),  # 4 columns
    ("detect", "0 0.5 0.5 0.5 0.5 0.5"),  # 6 columns
    ("detect", "0 0.5 zero 0.5 0.5"),  # non-numeric
    ("detect", "7 0.5 0.5 0.5 0.5"),  # class out of range
    ("detect", "0.5 0.5 0.5 0.5 0.5"),  # non-integer class
    ("detect", "0 12 8 20 10"),  # pixels, not normalised
    ("segment", "0 0.1 0.1 0.5 0.1 0.5"),  # odd number of coordinates
    ("segment", "0 0.1 0.1 0.5 0.1"),  # two points: a 5-column box line
    ("pose", "0 0.5 0.5 0.2 0.2 0.1 0.1 2"),  # 1 keypoint, kpt_shape says 2
])
def test_bad_label_lines_are_skipped_and_counted(tmp_path, task, line):
    img = tmp_path / "images/t/1.png"
    _image(img)
    good = {"detect": "1 0.5 0.5 0.5 0.5", "segment": "1 0.1 0.1 0.9 0.1 0.9 0.9",
            "pose": "1 0.5 0.5 0.2 0.2 0.1 0.1 2 0.2 0.2 1"}[task]
    _label(img, f"{good}\n{line}\n")
    data = _yaml(tmp_path, train="images/t", names=["a", "b"], kpt_shape=[2, 3], flip_idx=[1, 0])
    with pytest.warns(UserWarning, match=r"\[yolo_func\] .*1\.txt:2 \(") as record:
        ds = YoloDataset(data, "train", task=task)
    assert len(record) == 1
    assert ds.skipped["bad_label_line"] == 1 and len(ds) == 1
    assert ds[0].classes.tolist() == [1]


def test_bad_images_are_skipped_and_counted(tmp_path):
    for k in range(4):
        _image(tmp_path / f"images/t/{k}.jpg")
    data = (tmp_path / "images/t/1.jpg").read_bytes()
    (tmp_path / "images/t/1.jpg").write_bytes(data[:100])
    (tmp_path / "images/t/2.jpg").write_bytes(b"")
    (tmp_path / "list.txt").write_text("images/t/0.jpg\nimages/t/1.jpg\nimages/t/2.jpg\nimages/t/3.jpg\nimages/t/9.jpg\n")
    _label(tmp_path / "images/t/3.jpg", "0 0.5 0.5 0 0.5\n")  # zero width
    cfg = _yaml(tmp_path, train="list.txt", names=["a"])
    with pytest.warns(UserWarning, match="9.jpg") as record:
        ds = YoloDataset(cfg, "train", task="detect")
    assert len(record) == 1
    assert ds.skipped == {"missing_image": 1, "corrupt_image": 2, "bad_label_line": 0, "empty_box": 1}
    assert ds.file_names == ["images/t/0.jpg", "images/t/3.jpg"]
    (tmp_path / "images/t/0.jpg").write_bytes(b"\xff\xd8\xff" + b"\x00" * 50)
    with pytest.raises(ValueError, match=r"^\[yolo_func\] image file .*0\.jpg is truncated"):
        ds[0]


def test_write_rejects_mismatched_splits(converted):
    with pytest.raises(ValueError, match="same task"):
        write_yolo_dataset({"train": converted["detect"][0], "val": converted["pose"][0]}, "/nonexistent")


@pytest.mark.parity
@pytest.mark.parametrize("task", ["segment", "pose"])
def test_reference_reads_the_conversion(converted, task, tmp_path, monkeypatch):
    """The reference's own dataset (black box, public ``build_yolo_dataset``) reads what
    ``write_yolo_dataset`` wrote: no corrupt file, the same classes, boxes and keypoints."""
    monkeypatch.setenv("YOLO_OFFLINE", "1")
    monkeypatch.setenv("YOLO_CONFIG_DIR", str(tmp_path / "cfg"))
    from ultralytics.cfg import get_cfg
    from ultralytics.data.build import build_yolo_dataset
    from ultralytics.data.utils import check_det_dataset

    _, data_yaml = converted[task]
    ours = YoloDataset(data_yaml, "train", task=task)
    data = check_det_dataset(str(data_yaml))
    ref = build_yolo_dataset(get_cfg(overrides={"task": task, "imgsz": 160}), data["train"], 4, data, mode="val")
    by_file = {Path(f).resolve(): i for i, f in enumerate(ours.image_files)}
    assert len(ref.labels) == len(ours)
    for label in ref.labels:
        i = by_file[Path(label["im_file"]).resolve()]
        h, w = ours.image_sizes[i]
        boxes, classes, keypoints = ours.labels(i)
        np.testing.assert_array_equal(label["cls"].reshape(-1).astype(np.int64), classes)
        cx, cy, bw, bh = np.asarray(label["bboxes"], np.float64).reshape(-1, 4).T
        ref_xyxy = np.stack([cx - bw / 2, cy - bh / 2, cx + bw / 2, cy + bh / 2], 1) * [w, h, w, h]
        np.testing.assert_allclose(ref_xyxy, boxes, atol=1.0)
        if task == "segment":
            assert len(label["segments"]) == len(classes)
        else:
            kp = np.asarray(label["keypoints"], np.float64) * [w, h, 1]
            np.testing.assert_allclose(kp, keypoints, atol=0.01)


def test_polygons_fill_to_the_masks(converted, shared_data):
    """``polygons(i)`` (one path per instance, float32 pixels) rasterises back to the dataset's
    masks, within the tolerance of the coordinates' rounding (see ``_check_masks``)."""
    coco, data_yaml = converted["segment"]
    yolo = YoloDataset(data_yaml, "train", task="segment")
    for ds in (coco, yolo):
        for i in range(0, len(ds), 4):
            s = ds[i]
            h, w = s.image.shape[:2]
            polys = ds.polygons(i)
            assert len(polys) == len(s.classes) and all(p.dtype == np.float32 and p.shape[1] == 2 for p in polys)
            filled = [mask_utils.decode(mask_utils.frPyObjects([p.astype(np.float64).ravel().tolist()], h, w))[:, :, 0]
                      for p in polys]
            _check_masks(s.masks, np.asarray(filled, np.uint8).reshape(s.masks.shape))
    assert YoloDataset(data_yaml, "train", task="detect").polygons(0) == []
