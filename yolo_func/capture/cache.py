"""A bounded cache of captures, budgeted by key (input shape), not by graph.

A training step at a replay level needs one or several captures per input shape: the network's
forward/backward pair, one pair per head, the update graph, or one whole-step graph. The budget
that matters to a user is how many input shapes (batch shape, image size, target bucket) can be
replayed, so :class:`CaptureCache` bounds distinct *keys* and stores under each key the captures
it needs by *part* name (``"network"``, ``("head", "segment")``, ``"update"``, ...): the parts of
one key count once.

Example:
  >>> from types import SimpleNamespace as Fake   # stands in for a Captured
  >>> cache = CaptureCache(max_keys=1)
  >>> net = cache.get_or_capture((2, 3, 64, 64), lambda: Fake(signature="net"), part="network")
  >>> upd = cache.get_or_capture((2, 3, 64, 64), lambda: Fake(signature="upd"), part="update")
  >>> len(cache), cache.num_captures, cache.parts((2, 3, 64, 64))
  (1, 2, ['network', 'update'])
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import torch

from yolo_func.capture.signature import CaptureCacheFull

__all__ = ["CaptureCache"]

_MAIN = "main"


class CaptureCache:
    """Captures for at most ``max_keys`` keys; under each key, one capture per part.

    A key is hashable (input shapes, dtypes, the level, ...); a part names one capture the key
    needs (default ``"main"``). The cache never evicts (evicting would re-capture over and over): a
    new key past the bound raises :class:`yolo_func.capture.CaptureCacheFull` (a
    :class:`yolo_func.capture.CaptureUnavailable`), so a caller falls back to eager with one
    warning naming the reason. A new part of a key already held is always captured: the parts of
    one key share its budget, so a step never finds its first capture accepted and a later one of
    the same shape refused (which would leave an unused capture behind).

    Entries may share one memory pool: pass ``pool=cache.pool`` to the capture functions (see
    "Aliasing" in :mod:`yolo_func.capture.vjp` for the replay-order rule that comes with it).

    Args:
      max_keys: the bound on distinct keys, an int >= 1.

    Raises:
      ValueError: ``max_keys`` is not an int >= 1.

    Example:
      >>> from yolo_func.capture import CaptureCache, CaptureCacheFull
      >>> cache = CaptureCache(max_keys=1)
      >>> class Fake:                                      # anything with a ``signature`` (a Captured on CUDA)
      ...     signature = None
      >>> a = cache.get_or_capture((16, 640), Fake)        # captured once ...
      >>> cache.get_or_capture((16, 640), Fake) is a       # ... then reused
      True
      >>> try:
      ...     cache.get_or_capture((16, 672), Fake)        # a second key past max_keys=1
      ... except CaptureCacheFull as e:
      ...     print(type(e).__name__)
      CaptureCacheFull
    """

    def __init__(self, max_keys: int = 4):
        if isinstance(max_keys, bool) or not isinstance(max_keys, int) or max_keys < 1:
            raise ValueError(f"[yolo_func] CaptureCache: max_keys must be an int >= 1, got {max_keys!r}")
        self.max_keys = max_keys
        self._entries: dict[Hashable, dict[Hashable, Any]] = {}
        self._pool = None
        self.num_captures = 0  #: captures this cache made (all parts of all keys)
        self.overflows = 0  #: requests refused because the cache was full

    @property
    def pool(self) -> Any:
        """A memory pool handle shared by this cache's entries (created on first use; needs CUDA)."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        return self._pool

    def get(self, key: Hashable, part: Hashable = _MAIN) -> Any | None:
        """The capture stored for ``(key, part)``, or ``None``."""
        return self._entries.get(key, {}).get(part)

    def admits(self, key: Hashable) -> bool:
        """Whether a capture for ``key`` would be accepted (held already, or room for a new key)."""
        return key in self._entries or len(self._entries) < self.max_keys

    def get_or_capture(self, key: Hashable, capture: Callable[[], Any], *, part: Hashable = _MAIN) -> Any:
        """The capture for ``(key, part)``; if absent, call ``capture()`` once and store its result.

        Args:
          key: hashable, e.g. ``("network", (16, 3, 640, 640), torch.uint8)``.
          capture: zero-argument function returning a :class:`yolo_func.capture.Captured` or
            :class:`yolo_func.capture.CapturedStep` (anything with a ``signature``).
          part: which of the key's captures this is.

        Raises:
          CaptureCacheFull: ``key`` is new and ``max_keys`` keys are held (``capture`` is not called).
          TypeError: an unhashable key or part; ``capture()`` returned no capture (nothing stored).
          Whatever ``capture`` raises (nothing is stored then).
        """
        hash(key), hash(part)  # an unhashable key fails here, with Python's own TypeError
        parts = self._entries.get(key)
        if parts is not None and part in parts:
            return parts[part]
        if parts is None and len(self._entries) >= self.max_keys:
            self.overflows += 1
            raise CaptureCacheFull(key, tuple(self._entries), self.max_keys)
        entry = capture()
        if not hasattr(entry, "signature"):  # a Captured or a CapturedStep
            raise TypeError(f"[yolo_func] CaptureCache: capture() must return a Captured or CapturedStep, "
                            f"got {type(entry).__name__}")
        self._entries.setdefault(key, {})[part] = entry
        self.num_captures += 1
        return entry

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        """The number of keys held (what ``max_keys`` bounds)."""
        return len(self._entries)

    def keys(self) -> list[Hashable]:
        """The keys held, in capture order."""
        return list(self._entries)

    def parts(self, key: Hashable) -> list[Hashable]:
        """The parts held for ``key``, in capture order (empty for a key not held)."""
        return list(self._entries.get(key, {}))

    def clear(self) -> None:
        """Drop every entry (their graphs and pool memory are freed once no one else holds them)."""
        self._entries.clear()

    def __repr__(self) -> str:
        return f"CaptureCache({len(self)}/{self.max_keys} keys, {self.num_captures} captures, keys={self.keys()})"
