"""capture/cache.py on the CPU: the cache bounds distinct keys (input shapes), and the captures one
key needs (parts: network, heads, update) share its budget. Stand-in captures replace graphs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from yolo_func.capture import CaptureCache, CaptureCacheFull, CaptureUnavailable


def _fake(tag):
    return SimpleNamespace(signature=tag, forward=lambda: tag)


def _maker(calls):
    def make(tag):
        def capture():
            calls.append(tag)
            return _fake(tag)
        return capture
    return make


def test_cache_captures_each_key_once_and_refuses_past_its_bound():
    cache = CaptureCache(max_keys=2)
    calls = []
    make = _maker(calls)
    a = cache.get_or_capture((2, 3, 640, 640), make("a"))
    assert cache.get_or_capture((2, 3, 640, 640), make("a-again")) is a
    b = cache.get_or_capture((2, 3, 672, 672), make("b"))
    assert calls == ["a", "b"] and cache.num_captures == 2 and len(cache) == 2
    with pytest.raises(CaptureCacheFull) as info:
        cache.get_or_capture((2, 3, 704, 704), make("c"))
    assert calls == ["a", "b"]  # not captured
    err = info.value
    assert isinstance(err, CaptureUnavailable) and err.key == (2, 3, 704, 704)
    assert "capture cache full (2 keys" in err.reason and "(2, 3, 704, 704)" in err.reason
    assert str(err).startswith("[yolo_func] ")
    assert cache.overflows == 1
    # held keys still hit after an overflow
    assert cache.get_or_capture((2, 3, 672, 672), make("b-again")) is b
    assert cache.get((2, 3, 704, 704)) is None and (2, 3, 640, 640) in cache
    assert cache.keys() == [(2, 3, 640, 640), (2, 3, 672, 672)]
    cache.clear()
    assert len(cache) == 0 and cache.get_or_capture("k", make("c")).forward() == "c"


def test_parts_of_one_key_share_its_budget():
    """The issue's case: a segment model at network+heads needs network, two heads and the update
    for one image size; with max_keys=2 a second image size still gets all four captures."""
    cache = CaptureCache(max_keys=2)
    calls = []
    make = _maker(calls)
    parts = ["network", ("head", "detect"), ("head", "segment"), "update"]
    for size in (256, 320):
        key = ((4, 3, size, size), "uint8")
        for part in parts:
            cache.get_or_capture(key, make(f"{size}/{part}"), part=part)
    assert len(cache) == 2 and cache.num_captures == 8 and cache.overflows == 0
    assert cache.parts(((4, 3, 320, 320), "uint8")) == parts
    assert cache.get(((4, 3, 256, 256), "uint8"), ("head", "segment")).signature == "256/('head', 'segment')"
    # a third size is refused before its first part is captured: nothing is left behind
    with pytest.raises(CaptureCacheFull):
        cache.get_or_capture(((4, 3, 384, 384), "uint8"), make("384/network"), part="network")
    assert len(calls) == 8 and cache.parts(((4, 3, 384, 384), "uint8")) == []
    assert not cache.admits(((4, 3, 384, 384), "uint8")) and cache.admits(((4, 3, 256, 256), "uint8"))


@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 3)), max_size=40), st.integers(1, 4))
def test_budget_counts_keys_whatever_the_parts(requests, max_keys):
    """A model of the budget: a request is served iff its key is held or fewer than max_keys keys are
    held; each (key, part) is captured exactly once; refusals are counted."""
    cache = CaptureCache(max_keys=max_keys)
    calls = []
    held: dict[int, set[int]] = {}
    refused = 0
    for key, part in requests:
        admitted = key in held or len(held) < max_keys
        if admitted:
            got = cache.get_or_capture(key, _maker(calls)(f"{key}/{part}"), part=part)
            assert got.signature == f"{key}/{part}"
            held.setdefault(key, set()).add(part)
        else:
            with pytest.raises(CaptureCacheFull):
                cache.get_or_capture(key, _maker(calls)(f"{key}/{part}"), part=part)
            refused += 1
    assert len(cache) == len(held) <= max_keys
    assert cache.num_captures == len(calls) == sum(len(p) for p in held.values())
    assert sorted(calls) == sorted({f"{k}/{p}" for k, ps in held.items() for p in ps})
    assert cache.overflows == refused
    assert cache.keys() == list(held)  # capture order


def test_cache_stores_nothing_when_capture_fails():
    cache = CaptureCache(max_keys=1)

    def boom():
        raise CaptureUnavailable("inputs are on cpu")

    with pytest.raises(CaptureUnavailable):
        cache.get_or_capture("k", boom)
    assert len(cache) == 0 and cache.num_captures == 0
    with pytest.raises(TypeError, match="must return a Captured"):
        cache.get_or_capture("k", lambda: "not a capture")
    assert len(cache) == 0
    with pytest.raises(TypeError):
        cache.get_or_capture(["unhashable"], lambda: _fake("x"))
    with pytest.raises(TypeError):
        cache.get_or_capture("k", lambda: _fake("x"), part=["unhashable"])


@pytest.mark.parametrize("bad", [0, -1, 2.0, True])
def test_cache_bound_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match=r"\[yolo_func\] CaptureCache: max_keys must be an int >= 1"):
        CaptureCache(max_keys=bad)
