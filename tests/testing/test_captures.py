"""yolo_func.testing.assert_max_captures on the CPU: captures are simulated through the capture
package's counter hook (count_capture), as a capture function advances it."""

from __future__ import annotations

import pytest
import torch

from yolo_func.capture import CaptureCache, CaptureUnavailable, capture_vjp, count_capture, num_captures
from yolo_func.testing import assert_max_captures


def test_passes_at_or_under_the_bound_and_counts_exactly():
    with assert_max_captures(n=3) as made:
        assert made.count == 0
        count_capture()
        count_capture()
        assert made.count == 2  # live inside the block
    assert made.count == 2
    count_capture()  # after the block: not counted
    assert made.count == 2


def test_fails_past_the_bound_with_the_count():
    with pytest.raises(AssertionError, match=r"^\[yolo_func\] assert_max_captures: 3 CUDA-graph captures .* at most 2"):
        with assert_max_captures(n=2):
            for _ in range(3):
                count_capture()


def test_zero_means_no_capture_at_all():
    with pytest.raises(AssertionError, match="1 CUDA-graph captures"):
        with assert_max_captures(n=0):
            count_capture()


def test_the_blocks_own_error_propagates_unchanged():
    with pytest.raises(KeyError, match="boom"):
        with assert_max_captures(n=0):
            count_capture()
            raise KeyError("boom")


def test_cache_hits_and_refused_captures_do_not_count():
    """A stand-in capture that advances the counter like capture_vjp: the cache captures a key
    once; a capture refused on the CPU (CaptureUnavailable) counts nothing."""
    cache = CaptureCache(max_keys=2)

    class Fake:
        def __init__(self):
            self.signature = count_capture()

    with assert_max_captures(n=1) as made:
        for _ in range(5):
            cache.get_or_capture("shape", Fake)
    assert made.count == 1
    before = num_captures()
    with assert_max_captures(n=0):
        with pytest.raises(CaptureUnavailable):
            capture_vjp(lambda p, s, x: ((x * p["w"],), s), {"w": torch.ones(2)}, {}, torch.ones(2))
    assert num_captures() == before


@pytest.mark.parametrize("bad", [-1, 1.5, True, None])
def test_n_must_be_a_non_negative_int(bad):
    with pytest.raises(ValueError, match=r"\[yolo_func\] assert_max_captures: n must be an int >= 0"):
        with assert_max_captures(n=bad):
            pass
