"""CocoDataset against pycocotools' own reading of the JSON, image decoding, and the bad-input policy."""

from __future__ import annotations

import json
import pickle
import warnings
from pathlib import Path

import cv2
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from PIL import Image, ImageOps
from pycocotools import mask as mask_utils
from pycocotools.coco import COCO

from yolo_func.data import CocoDataset, Sample
from yolo_func.data.augment import RoiMasks
from yolo_func.data.coco import flip_index_from_names, segmentations_to_mask_crops, segmentations_to_masks
from yolo_func.data.images import check_image, decode_image, image_size, read_image

COCO_FLIP = [0, 2, 1, 4, 3, 6, 5, 8, 7, 10, 9, 12, 11, 14, 13, 16, 15]
#: COCO's 80 category ids in class order (REFERENCE.md §3.5).
COCO80_IDS = ([*range(1, 12)] + [*range(13, 26)] + [27, 28] + [*range(31, 45)] + [*range(46, 66)] + [67, 70]
              + [*range(72, 83)] + [*range(84, 91)])


@pytest.fixture(scope="module")
def tiny(shared_data):
    root = shared_data / "coco-tiny"
    return root / "annotations.json", root / "images"


@pytest.fixture(scope="module")
def pose_tiny(shared_data):
    root = shared_data / "coco-pose-tiny"
    return root / "annotations.json", root / "images"


def _quiet_coco(path) -> COCO:
    import contextlib
    import io
    with contextlib.redirect_stdout(io.StringIO()):
        return COCO(str(path))


# ---------------------------------------------------------------------- real data vs pycocotools
def test_detect_matches_pycocotools(tiny):
    ann_file, images = tiny
    ds = CocoDataset(ann_file, images, task="detect")
    coco = _quiet_coco(ann_file)
    raw = json.loads(Path(ann_file).read_text())
    assert len(ds) == len(raw["images"]) == 32
    assert ds.category_ids == COCO80_IDS
    assert ds.names == [coco.cats[i]["name"] for i in COCO80_IDS]
    assert ds.image_ids.tolist() == [img["id"] for img in raw["images"]]
    assert ds.image_sizes.tolist() == [[img["height"], img["width"]] for img in raw["images"]]
    total = 0
    for i in range(len(ds)):
        s = ds[i]
        assert isinstance(s, Sample) and s.masks is None and s.keypoints is None
        img = coco.imgs[s.image_id]
        assert s.file_name == img["file_name"] and s.image.shape == (img["height"], img["width"], 3)
        assert s.image.dtype == np.uint8 and s.boxes.dtype == np.float32 and s.classes.dtype == np.int64
        anns = coco.loadAnns(coco.getAnnIds(imgIds=[s.image_id], iscrowd=False))
        expected = np.array([[a["bbox"][0], a["bbox"][1], a["bbox"][0] + a["bbox"][2], a["bbox"][1] + a["bbox"][3]]
                             for a in anns], np.float32).reshape(-1, 4)
        np.testing.assert_allclose(s.boxes, expected, rtol=0, atol=1e-4)
        assert s.classes.tolist() == [COCO80_IDS.index(a["category_id"]) for a in anns]
        total += len(anns)
    assert total == 288 - 4  # the 4 crowd annotations are not targets
    assert sum(ds.skipped.values()) == 0


def test_images_without_annotations_are_counted(tiny):
    ds = CocoDataset(*tiny, task="detect")
    coco = _quiet_coco(tiny[0])
    empty = [i for i, img_id in enumerate(ds.image_ids) if not coco.getAnnIds(imgIds=[int(img_id)])]
    assert len(empty) == 2
    for i in empty:
        s = ds[i]
        assert s.boxes.shape == (0, 4) and s.classes.shape == (0,)


def test_segment_masks_equal_ann_to_mask(tiny):
    ds = CocoDataset(*tiny, task="segment")
    coco = _quiet_coco(tiny[0])
    for i in range(len(ds)):
        s = ds[i]
        anns = coco.loadAnns(coco.getAnnIds(imgIds=[s.image_id], iscrowd=False))
        h, w = s.image.shape[:2]
        assert s.masks.dtype == np.uint8 and s.masks.shape == (len(anns), h, w)
        for k, a in enumerate(anns):
            np.testing.assert_array_equal(s.masks[k], coco.annToMask(a))


def test_pose_keypoints_equal_json(pose_tiny):
    ds = CocoDataset(*pose_tiny, task="pose")
    coco = _quiet_coco(pose_tiny[0])
    assert ds.names == ["person"] and ds.category_ids == [1]
    assert ds.kpt_shape == (17, 3) and ds.flip_idx == COCO_FLIP
    n = 0
    for i in range(len(ds)):
        s = ds[i]
        anns = coco.loadAnns(coco.getAnnIds(imgIds=[s.image_id], iscrowd=False))
        assert s.keypoints.shape == (len(anns), 17, 3) and s.keypoints.dtype == np.float32 and s.masks is None
        for k, a in enumerate(anns):
            np.testing.assert_array_equal(s.keypoints[k], np.array(a["keypoints"], np.float32).reshape(17, 3))
        n += len(anns)
    assert n == 87 - 1  # one crowd
    assert {0.0, 1.0, 2.0} >= set(np.concatenate([ds[i].keypoints[..., 2].ravel() for i in range(len(ds))]).tolist())


def test_pose_selects_keypoint_categories_only(tmp_path):
    data = _mini_json(tmp_path, categories=[{"id": 1, "name": "person", "keypoints": ["nose", "left_eye", "right_eye"]},
                                            {"id": 2, "name": "dog"}],
                      annotations=[_ann(1, 1, 1, [2, 2, 10, 10], keypoints=[3, 3, 2, 0, 0, 0, 5, 5, 1]),
                                   _ann(2, 1, 2, [1, 1, 5, 5])])
    ds = CocoDataset(data, tmp_path / "images", task="pose")
    assert ds.names == ["person"] and ds.flip_idx == [0, 2, 1] and ds.kpt_shape == (3, 3)
    s = ds[0]
    assert s.classes.tolist() == [0]
    np.testing.assert_array_equal(s.keypoints[0], [[3, 3, 2], [0, 0, 0], [5, 5, 1]])
    with pytest.raises(ValueError, match="keypoints"):
        CocoDataset(data, tmp_path / "images", task="pose", categories=["dog"])


def test_pose_bad_or_missing_keypoints(tmp_path):
    data = _mini_json(tmp_path, categories=[{"id": 1, "name": "person", "keypoints": ["nose", "left_eye", "right_eye"]}],
                      annotations=[_ann(1, 1, 1, [2, 2, 10, 10], keypoints=[3, 3, 2, 0, 0]),  # 5 values, not 9
                                   _ann(2, 1, 1, [1, 1, 5, 5])])  # no keypoints field: all invisible
    with pytest.warns(UserWarning, match=r"a\.png \(bad_keypoints: annotation 1 has 5 values, expected 9\)"):
        ds = CocoDataset(data, tmp_path / "images", task="pose")
    assert ds.skipped["bad_keypoints"] == 1
    s = ds[0]
    np.testing.assert_array_equal(s.boxes, [[1, 1, 6, 6]])
    np.testing.assert_array_equal(s.keypoints, np.zeros((1, 3, 3), np.float32))


def test_category_selection_and_order(tiny):
    ds = CocoDataset(*tiny, task="detect", categories=[18, "person"])
    assert ds.category_ids == [18, 1] and ds.names == ["dog", "person"]
    coco = _quiet_coco(tiny[0])
    for i in range(len(ds)):
        s = ds[i]
        anns = [a for a in coco.loadAnns(coco.getAnnIds(imgIds=[s.image_id], iscrowd=False))
                if a["category_id"] in (18, 1)]
        assert s.classes.tolist() == [{18: 0, 1: 1}[a["category_id"]] for a in anns]
    with pytest.raises(ValueError, match=r"\[yolo_func\] .*categories= names 'unicorn'"):
        CocoDataset(*tiny, task="detect", categories=["unicorn"])
    with pytest.raises(ValueError, match="twice"):
        CocoDataset(*tiny, task="detect", categories=[1, "person"])


def test_decode_close_to_pillow(tiny):
    ds = CocoDataset(*tiny, task="detect")
    for i in range(0, len(ds), 8):
        ours = ds[i].image.astype(np.int16)
        pil = np.asarray(ImageOps.exif_transpose(Image.open(ds.image_path(i))).convert("RGB")).astype(np.int16)
        assert ours.shape == pil.shape
        assert np.abs(ours - pil).mean() < 1.5  # two JPEG decoders differ by IDCT rounding only


def test_pickle_round_trip_and_lazy_coco(tiny):
    ds = CocoDataset(*tiny, task="segment")
    clone = pickle.loads(pickle.dumps(ds))
    assert clone._coco is None
    a, b = ds[3], clone[3]
    np.testing.assert_array_equal(a.masks, b.masks)
    np.testing.assert_array_equal(a.boxes, b.boxes)
    assert len(clone.coco.getImgIds()) == 32
    assert "info" in clone.coco.dataset and "licenses" in clone.coco.dataset  # for pycocotools' loadRes


# ---------------------------------------------------------------------- helpers for synthetic JSONs
def _write_image(path: Path, h: int = 24, w: int = 32, value=(10, 120, 240)) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    img = np.zeros((h, w, 3), np.uint8)
    img[:] = value
    cv2.imwrite(str(path), img[:, :, ::-1])


def _ann(ann_id, image_id, category_id, bbox, **extra):
    return {"id": ann_id, "image_id": image_id, "category_id": category_id, "bbox": bbox, "iscrowd": 0,
            "area": bbox[2] * bbox[3], **extra}


def _mini_json(tmp_path: Path, *, images=None, annotations=(), categories=None, name="ann.json", write_images=True):
    images = images if images is not None else [{"id": 1, "file_name": "a.png", "height": 24, "width": 32}]
    if write_images:
        for img in images:
            if not (tmp_path / "images" / img["file_name"]).exists():
                _write_image(tmp_path / "images" / img["file_name"], img["height"], img["width"])
    (tmp_path / "images").mkdir(exist_ok=True)
    categories = categories if categories is not None else [{"id": 1, "name": "a"}, {"id": 5, "name": "b"}]
    path = tmp_path / name
    path.write_text(json.dumps({"images": images, "annotations": list(annotations), "categories": categories}))
    return path


def _assert_crops_equal(got, segms, h, w):
    want = RoiMasks.from_dense(segmentations_to_masks(segms, h, w))
    np.testing.assert_array_equal(got[0], want.offsets)
    assert len(got[1]) == len(want.crops)
    for a, b in zip(got[1], want.crops):
        assert a.flags.c_contiguous and a.dtype == np.uint8
        np.testing.assert_array_equal(a, b)


def test_mask_crops_equal_cropped_dense_masks(tiny):
    """The loader's fast path (crops cut from the decoded RLEs) equals cropping the annToMask masks."""
    ds = CocoDataset(*tiny, task="segment")
    for i in range(len(ds)):
        s, crops = ds.sample_with_mask_crops(i)
        full = ds[i]
        assert s.masks is None and s.image_id == full.image_id
        np.testing.assert_array_equal(s.image, full.image)
        np.testing.assert_array_equal(s.boxes, full.boxes)
        _assert_crops_equal(crops, ds.segmentations(i), *full.image.shape[:2])


@given(polys=st.lists(st.lists(st.tuples(st.floats(-5, 45), st.floats(-5, 35)), min_size=3, max_size=7),
                      min_size=0, max_size=4))
def test_mask_crops_of_random_polygons(polys):
    """Polygons partly outside the image, degenerate ones (empty masks) and overlaps included."""
    h, w = 30, 40
    segms = [[[c for xy in poly for c in xy]] for poly in polys]
    _assert_crops_equal(segmentations_to_mask_crops(segms, h, w), segms, h, w)


def test_rle_annotations_equal_ann_to_mask(tmp_path):
    h, w = 24, 32
    m = np.zeros((h, w), np.uint8)
    m[3:10, 4:20] = 1
    m[12:20, 25:30] = 1
    compressed = mask_utils.encode(np.asfortranarray(m))
    compressed = {"size": [h, w], "counts": compressed["counts"].decode()}
    # Uncompressed RLE: column-major run lengths starting with zeros.
    flat = m.flatten(order="F")
    runs, cur, n = [], 0, 0
    for v in flat:
        if v != cur:
            runs.append(n)
            cur, n = v, 0
        n += 1
    runs.append(n)
    poly = [[2, 2, 12, 2, 12, 9, 2, 9], [20, 15, 30, 15, 25, 22]]
    path = _mini_json(tmp_path, annotations=[_ann(1, 1, 1, [4, 3, 26, 17], segmentation=compressed),
                                             _ann(2, 1, 5, [4, 3, 26, 17], segmentation={"size": [h, w], "counts": runs}),
                                             _ann(3, 1, 1, [2, 2, 28, 20], segmentation=poly)])
    ds = CocoDataset(path, tmp_path / "images", task="segment")
    coco = _quiet_coco(path)
    s = ds[0]
    assert s.classes.tolist() == [0, 1, 0]
    for k, ann_id in enumerate([1, 2, 3]):
        np.testing.assert_array_equal(s.masks[k], coco.annToMask(coco.anns[ann_id]))
    np.testing.assert_array_equal(s.masks[0], m)
    _assert_crops_equal(ds.sample_with_mask_crops(0)[1], ds.segmentations(0), h, w)


# ---------------------------------------------------------------------- image formats
def _pattern(h=40, w=60) -> np.ndarray:
    a = np.zeros((h, w, 3), np.uint8)
    a[:, : w // 2] = (200, 30, 30)
    a[:, w // 2:] = (30, 30, 200)
    a[: h // 8] = (20, 200, 20)
    return a


@pytest.mark.parametrize("kind", ["gray_png", "rgba_png", "palette_png", "cmyk_jpeg", "exif_jpeg", "gray16_png"])
def test_image_modes_become_rgb(tmp_path, kind):
    a = _pattern()
    path = tmp_path / "images" / ("x.png" if kind.endswith("png") else "x.jpg")
    path.parent.mkdir()
    pil = Image.fromarray(a)
    if kind == "gray_png":
        pil.convert("L").save(path)
    elif kind == "rgba_png":
        rgba = np.dstack([a, np.full(a.shape[:2], 128, np.uint8)])
        Image.fromarray(rgba, "RGBA").save(path)
    elif kind == "palette_png":
        pil.convert("P").save(path)
    elif kind == "cmyk_jpeg":
        pil.convert("CMYK").save(path, quality=95)
    elif kind == "gray16_png":
        cv2.imwrite(str(path), (a[:, :, 0].astype(np.uint16) * 257))
    else:
        exif = Image.Exif()
        exif[0x0112] = 6  # rotate 90 degrees clockwise to display
        pil.save(path, exif=exif, quality=95)
    # Independent expectation: Pillow's decoding with the EXIF orientation applied.
    expected = np.asarray(ImageOps.exif_transpose(Image.open(path)).convert("RGB")).astype(np.int16)
    if kind == "gray16_png":
        expected = np.repeat(a[:, :, :1], 3, axis=2).astype(np.int16)
    h, w = expected.shape[:2]
    json_path = _mini_json(tmp_path, images=[{"id": 7, "file_name": path.name, "height": h, "width": w}],
                           write_images=False)
    ds = CocoDataset(json_path, tmp_path / "images", task="detect")
    image = ds[0].image
    assert image.dtype == np.uint8 and image.shape == (h, w, 3) and image.flags.c_contiguous
    tol = 3 if kind.endswith("jpeg") else 0
    assert np.abs(image.astype(np.int16) - expected).max() <= tol + (2 if kind == "cmyk_jpeg" else 0)
    if kind == "exif_jpeg":
        assert (h, w) == (60, 40)
        assert image_size(path) == (60, 40)
        # Rotated clockwise: the green top band is now the right-hand columns.
        assert image[:, -2, 1].min() > 150 and image[:, 2, 1].max() < 100


@given(h=st.integers(1, 70), w=st.integers(1, 70), orientation=st.integers(1, 8), png=st.booleans())
def test_header_size_equals_decoded_size(tmp_path_factory, h, w, orientation, png):
    path = tmp_path_factory.mktemp("hdr") / ("x.png" if png else "x.jpg")
    img = Image.fromarray(np.full((h, w, 3), 90, np.uint8))
    if png:
        img.save(path)
    else:
        exif = Image.Exif()
        exif[0x0112] = orientation
        img.save(path, exif=exif)
    assert check_image(path) == read_image(path).shape[:2]


@given(st.lists(st.sampled_from(["nose", "left_eye", "right_eye", "left_hand", "right_hand", "tail", "leftmost"]),
                unique=True, min_size=1))
def test_flip_index_is_an_involution(names):
    flip = flip_index_from_names(names)
    assert sorted(flip) == list(range(len(names)))
    assert [flip[f] for f in flip] == list(range(len(names)))
    for k, n in enumerate(names):
        if n.startswith("left_") and n.replace("left_", "right_") in names:
            assert names[flip[k]] == n.replace("left_", "right_")


def test_coco_flip_index():
    names = ["nose", "left_eye", "right_eye", "left_ear", "right_ear", "left_shoulder", "right_shoulder", "left_elbow",
             "right_elbow", "left_wrist", "right_wrist", "left_hip", "right_hip", "left_knee", "right_knee",
             "left_ankle", "right_ankle"]
    assert flip_index_from_names(names) == COCO_FLIP


# ---------------------------------------------------------------------- bad input: raised at construction
@pytest.mark.parametrize("case, match", [
    ("missing_json", "no such file"),
    ("not_json", "not valid JSON"),
    ("no_images_key", "missing or non-list keys"),
    ("unknown_image", "points to image_id 99"),
    ("unknown_category", "category_id 42"),
    ("no_bbox", "no 4-number bbox"),
    ("duplicate_image", "more than once"),
    ("image_without_size", "lacks one of id, file_name, height, width"),
    ("missing_folder", "no such folder"),
    ("annotation_without_id_keys", "lacks the key"),
])
def test_structural_errors_raise(tmp_path, case, match):
    images_dir = tmp_path / "images"
    path = _mini_json(tmp_path)
    raw = json.loads(path.read_text())
    if case == "missing_json":
        path = tmp_path / "nope.json"
    elif case == "not_json":
        path.write_text("{not json")
    elif case == "no_images_key":
        del raw["images"]
    elif case == "unknown_image":
        raw["annotations"] = [_ann(1, 99, 1, [1, 1, 2, 2])]
    elif case == "unknown_category":
        raw["annotations"] = [_ann(1, 1, 42, [1, 1, 2, 2])]
    elif case == "no_bbox":
        raw["annotations"] = [{"id": 1, "image_id": 1, "category_id": 1}]
    elif case == "duplicate_image":
        raw["images"].append(dict(raw["images"][0]))
    elif case == "image_without_size":
        del raw["images"][0]["height"]
    elif case == "missing_folder":
        images_dir = tmp_path / "nowhere"
    elif case == "annotation_without_id_keys":
        raw["annotations"] = [{"id": 1, "category_id": 1, "bbox": [1, 1, 2, 2]}]
    if case not in ("missing_json", "not_json", "missing_folder"):
        path.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=r"^\[yolo_func\] ") as err:
        CocoDataset(path, images_dir, task="detect")
    assert match in str(err.value)
    if case != "missing_folder":
        assert str(path) in str(err.value)


def test_unknown_task_raises(tiny):
    with pytest.raises(ValueError, match="task must be one of"):
        CocoDataset(*tiny, task="classify")


# ---------------------------------------------------------------------- bad input: skipped and counted
def test_bad_images_are_skipped_counted_and_warned(tmp_path):
    images = [{"id": k, "file_name": f"{k}.jpg", "height": 24, "width": 32} for k in range(1, 6)]
    for img in images:
        _write_image(tmp_path / "images" / img["file_name"])
    (tmp_path / "images" / "2.jpg").unlink()  # missing
    data = (tmp_path / "images" / "3.jpg").read_bytes()
    (tmp_path / "images" / "3.jpg").write_bytes(data[: len(data) // 2])  # truncated
    (tmp_path / "images" / "4.jpg").write_bytes(b"not an image at all")  # unreadable
    images[4]["height"] = 30  # size mismatch with the file
    path = _mini_json(tmp_path, images=images, annotations=[_ann(1, 1, 1, [1, 1, 5, 5]), _ann(2, 2, 1, [1, 1, 5, 5])],
                      write_images=False)
    with pytest.warns(UserWarning, match=r"\[yolo_func\] .*2\.jpg \(missing_image") as record:
        ds = CocoDataset(path, tmp_path / "images", task="detect")
    assert len(record) == 1
    message = str(record[0].message)
    assert "3.jpg (corrupt_image" in message and "truncated" in message and "4.jpg (corrupt_image" in message
    assert ds.skipped["missing_image"] == 1 and ds.skipped["corrupt_image"] == 2 and ds.skipped["size_mismatch"] == 1
    assert len(ds) == 1 and ds.file_names == ["1.jpg"] and ds.image_ids.tolist() == [1]
    assert ds[0].boxes.shape == (1, 4)


def test_unreadable_image_at_getitem_names_the_file(tmp_path):
    path = _mini_json(tmp_path)
    ds = CocoDataset(path, tmp_path / "images", task="detect")
    (tmp_path / "images" / "a.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\x00" * 40)
    with pytest.raises(ValueError, match=r"^\[yolo_func\] image file .*a\.png is truncated"):
        ds[0]
    (tmp_path / "images" / "a.png").unlink()
    with pytest.raises(ValueError, match=r"^\[yolo_func\] image file .*a\.png could not be read"):
        ds[0]
    with pytest.raises(IndexError):
        ds[1]


def test_verify_false_defers_missing_files_to_getitem(tmp_path):
    path = _mini_json(tmp_path)
    (tmp_path / "images" / "a.png").unlink()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ds = CocoDataset(path, tmp_path / "images", task="detect", verify=False)
    assert len(ds) == 1
    with pytest.raises(ValueError, match="a.png"):
        ds[0]


def test_bad_annotations_are_skipped_and_counted(tmp_path):
    poly_ok = [2, 2, 12, 2, 12, 9]
    anns = [
        _ann(1, 1, 1, [1, 1, 0, 5]),  # zero width
        _ann(2, 1, 1, [2, 2, 10, 7], segmentation=[poly_ok, [1, 2, 3]]),  # one odd part dropped, instance kept
        _ann(3, 1, 1, [2, 2, 10, 7], segmentation=[[1, 2, 3, 4]]),  # two points only: instance dropped
        _ann(4, 1, 5, [2, 2, 10, 7], segmentation={"size": [10, 10], "counts": "abc"}),  # RLE of another size
        _ann(5, 1, 5, [2, 2, 10, 7], segmentation=[poly_ok], iscrowd=1),  # crowd: ignored, not counted
        _ann(6, 1, 5, [30, 20, 10, 10], segmentation=[poly_ok]),  # clipped to the image: 30..32 x 20..24
    ]
    path = _mini_json(tmp_path, annotations=anns)
    with pytest.warns(UserWarning, match="a.png"):
        ds = CocoDataset(path, tmp_path / "images", task="segment")
    assert ds.skipped["empty_box"] == 1 and ds.skipped["bad_polygon"] == 2 and ds.skipped["bad_rle"] == 1
    s = ds[0]
    np.testing.assert_array_equal(s.boxes, np.array([[2, 2, 12, 9], [30, 20, 32, 24]], np.float32))
    assert s.classes.tolist() == [0, 1]
    expected = mask_utils.decode(mask_utils.merge(mask_utils.frPyObjects([poly_ok], 24, 32)))
    np.testing.assert_array_equal(s.masks[0], expected)
    # The same JSON for detection: segmentations are not read, so only the empty box is skipped.
    with pytest.warns(UserWarning):
        det = CocoDataset(path, tmp_path / "images", task="detect")
    assert det.skipped["empty_box"] == 1 and det.skipped["bad_polygon"] == 0
    assert det[0].classes.tolist() == [0, 0, 1, 1]


def test_no_warning_for_clean_data(tiny):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        CocoDataset(*tiny, task="segment")


def test_decode_errors_name_the_file():
    with pytest.raises(ValueError, match=r"^\[yolo_func\] image file foo\.jpg is empty"):
        decode_image(b"", "foo.jpg")
    with pytest.raises(ValueError, match="foo.gif is not a JPEG/PNG"):
        decode_image(b"GIF89a" + b"\x00" * 20, "foo.gif")
