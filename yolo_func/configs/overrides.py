"""Strict ``key=value`` overrides with dotted keys, and the JSON round trip of a :class:`Config`.

Two checks, as nanoGPT's configurator does: an unknown key is rejected with the closest known keys
(``difflib``), and a value is parsed against the field's type — never a silent type change.

Example:
  >>> from yolo_func.configs import Config, apply_overrides
  >>> cfg = apply_overrides(Config(), ["optim.lr0=0.02", "data.path=/data/coco", "model.kpt_shape=17,3"])
  >>> cfg.optim.lr0, cfg.data.path
  (0.02, '/data/coco')
"""

from __future__ import annotations

import dataclasses
import difflib
import json
from collections.abc import Iterable, Mapping
from typing import Any, Literal, get_args, get_origin

from yolo_func.configs.base import Config, _hints, _is_optional, _is_section, check_value, config_keys, field_info, type_name

__all__ = [
    "parse_value",
    "format_value",
    "apply_overrides",
    "did_you_mean",
    "config_to_dict",
    "config_from_dict",
    "config_to_json",
    "config_from_json",
    "config_diff",
]

_TRUE = {"true", "yes", "on", "1"}
_FALSE = {"false", "no", "off", "0"}
_NONE = {"none", "null"}


def _closest(word: str, candidates: list[str], cutoff: float = 0.6) -> list[str]:
    """Candidates with a ``difflib`` similarity >= ``cutoff``, best first; ties keep the
    candidates' order (declaration order: the earlier, more common option first)."""
    scored = []
    for i, c in enumerate(candidates):
        m = difflib.SequenceMatcher(None, word, c)
        if m.real_quick_ratio() >= cutoff and m.quick_ratio() >= cutoff and m.ratio() >= cutoff:
            scored.append((-m.ratio(), i, c))
    return [c for _, _, c in sorted(scored)]


def did_you_mean(key: str, keys: Iterable[str] | None = None) -> str:
    """``"; did you mean 'optim.lr0'?"`` naming the closest dotted key to ``key``, or ``""``.

    Compares whole keys first, then the last component alone against every key's last component
    (``lr0`` -> ``optim.lr0``; ``mosiac`` -> ``data.augment.mosaic``). Equally close keys are
    ranked by declaration order.

    Example:
      >>> from yolo_func.configs import did_you_mean
      >>> did_you_mean("optim.lrr"), did_you_mean("zzz")
      ("; did you mean 'optim.lr0'?", '')
    """
    keys = list(config_keys() if keys is None else keys)
    close = _closest(key, keys)
    if not close:
        leaf = key.rsplit(".", 1)[-1]
        leaves = [k.rsplit(".", 1)[-1] for k in keys]
        names = _closest(leaf, leaves)
        close = [k for name in names[:1] for k, lf in zip(keys, leaves) if lf == name]
    if not close:
        return ""
    return f"; did you mean {close[0]!r}?"


def _strip_quotes(text: str) -> str:
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    return text


def parse_value(key: str, tp: Any, text: str) -> Any:
    """Parse the text of an override against a field's type (before bounds are checked).

    ``bool``: true/false/yes/no/on/off/1/0; ``int``: decimal integers only; ``float``: any Python
    float literal; ``Optional[...]``: ``none``/``null`` for None; tuples: ``17,3``, ``(17,3)`` or
    ``[17, 3]``; ``Literal``: one of the choices; ``str``: the text (surrounding quotes removed).

    Args:
      key: the dotted key, for messages.
      tp: the field's annotation.
      text: the value as typed.

    Returns:
      The Python value.

    Raises:
      ValueError: the text does not parse as the type (names the key, the type and the text).

    Example:
      >>> from typing import Optional
      >>> from yolo_func.configs import parse_value
      >>> parse_value("data.image_size", int, "320"), parse_value("x", Optional[int], "none"), parse_value("y", bool, "yes")
      (320, None, True)
      >>> parse_value("model.kpt_shape", tuple[int, int], "[17, 3]")
      (17, 3)
    """
    raw = text
    text = text.strip()
    optional, inner = _is_optional(tp)
    if optional and text.lower() in _NONE:
        return None
    tp = inner
    try:
        if get_origin(tp) is Literal:
            value = _strip_quotes(text)
            choices = get_args(tp)
            if value not in choices:
                hint = difflib.get_close_matches(value, [str(c) for c in choices], n=1, cutoff=0.5)
                fix = f"; did you mean {hint[0]!r}?" if hint else ""
                raise ValueError(f"[yolo_func] config key {key!r} expects {type_name(tp)}; got {raw!r}{fix}")
            return value
        if get_origin(tp) is tuple:
            body = text
            if len(body) >= 2 and body[0] + body[-1] in ("()", "[]"):
                body = body[1:-1]
            parts = [p for p in (s.strip() for s in body.split(",")) if p]
            args = get_args(tp)
            elems = [args[0]] * len(parts) if (len(args) == 2 and args[1] is Ellipsis) else list(args)
            if len(elems) != len(parts):
                raise ValueError(f"[yolo_func] config key {key!r} expects {type_name(tp)} ({len(elems)} comma-separated items); got {raw!r}")
            return tuple(parse_value(key, t, p) for t, p in zip(elems, parts))
        if tp is bool:
            low = text.lower()
            if low in _TRUE:
                return True
            if low in _FALSE:
                return False
            raise ValueError(f"[yolo_func] config key {key!r} expects bool (true/false); got {raw!r}")
        if tp is int:
            return int(text, 10)
        if tp is float:
            return float(text)
        if tp is str:
            return _strip_quotes(text)
    except ValueError as e:
        if str(e).startswith("[yolo_func]"):
            raise
        raise ValueError(f"[yolo_func] config key {key!r} expects {type_name(tp)}; got {raw!r}") from None
    raise TypeError(f"[yolo_func] config key {key!r} has an unsupported type {tp!r}")


def format_value(value: Any) -> str:
    """The override text that :func:`parse_value` reads back as ``value`` (``none``, ``true``,
    ``17,3``, ``0.02``, a string as is).

    Example:
      >>> from yolo_func.configs import format_value
      >>> format_value((17, 3)), format_value(None), format_value(True), format_value(0.02)
      ('17,3', 'none', 'true', '0.02')
    """
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        return ",".join(format_value(v) for v in value)
    if isinstance(value, float):
        return repr(value)
    return str(value)


def _split(item: str) -> tuple[str, str]:
    if not isinstance(item, str):
        raise TypeError(f"[yolo_func] an override must be a 'key=value' string; got {item!r} ({type(item).__name__})")
    key, sep, value = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ValueError(f"[yolo_func] override {item!r} is not 'key=value'; write e.g. optim.lr0=0.02")
    return key, value


def _unknown(key: str) -> ValueError:
    sections = {k.rsplit(".", 1)[0] for k in config_keys()} | {k.split(".")[0] for k in config_keys()}
    if key in sections:
        fields = [k for k in config_keys() if k.startswith(key + ".")]
        shown = ", ".join(fields[:8]) + (", ..." if len(fields) > 8 else "")
        return ValueError(f"[yolo_func] config key {key!r} is a section, not an option; set one of its keys ({shown})")
    hint = did_you_mean(key) or "; the keys are listed in docs/training.md and by yolo_func.configs.config_keys()"
    return ValueError(f"[yolo_func] unknown config key {key!r}{hint}")


def _replace_leaves(config: Any, values: Mapping[str, Any]) -> Any:
    """``dataclasses.replace`` down the tree: ``values`` maps dotted keys (relative) to values."""
    changes: dict[str, Any] = {}
    nested: dict[str, dict[str, Any]] = {}
    for key, value in values.items():
        head, dot, rest = key.partition(".")
        if dot:
            nested.setdefault(head, {})[rest] = value
        else:
            changes[head] = value
    for head, sub in nested.items():
        changes[head] = _replace_leaves(getattr(config, head), sub)
    return dataclasses.replace(config, **changes)


def apply_overrides(config: Config, overrides: Iterable[str] | Mapping[str, Any]) -> Config:
    """A new config with ``key=value`` overrides applied (the last of repeated keys wins).

    Args:
      config: the :class:`Config` to start from (e.g. a recipe's ``get_config()``).
      overrides: ``["optim.lr0=0.02", "data.path=/data/coco"]``, or a mapping ``{dotted key:
        value}`` whose string values are parsed and other values type-checked.

    Returns:
      A new :class:`Config` (validated: types and bounds).

    Raises:
      ValueError: an unknown key (with "did you mean"), a section given as a key, a value that does
        not parse as the field's type, or a value out of bounds.
      TypeError: a non-string value of the wrong type in a mapping.

    Example:
      >>> from yolo_func.configs import apply_overrides, get_recipe
      >>> cfg = apply_overrides(get_recipe("yolov8n"), ["optim.lr0=0.02", "data.image_size=320", "model.kpt_shape=5,3"])
      >>> cfg.optim.lr0, cfg.data.image_size, cfg.model.kpt_shape
      (0.02, 320, (5, 3))
    """
    if not isinstance(config, Config):
        raise TypeError(f"[yolo_func] apply_overrides expects a Config; got {type(config).__name__}")
    if isinstance(overrides, str):
        raise TypeError(f"[yolo_func] apply_overrides expects a list of 'key=value' strings; got the string {overrides!r}: wrap it in a list")
    infos = {f.key: f for f in field_info()}
    items = list(overrides.items()) if isinstance(overrides, Mapping) else [_split(o) for o in overrides]
    values: dict[str, Any] = {}
    for key, value in items:
        if key not in infos:
            raise _unknown(key)
        info = infos[key]
        if isinstance(value, str):
            value = parse_value(key, info.type, value)
        values[key] = check_value(key, info.type, value, info.meta)
    return _replace_leaves(config, values)


def config_to_dict(config: Any) -> dict[str, Any]:
    """The config as nested plain dicts of JSON values (tuples become lists).

    Args:
      config: a :class:`Config` or one of its sections.

    Example:
      >>> from yolo_func.configs import config_to_dict, get_recipe
      >>> d = config_to_dict(get_recipe("yolov8n-pose"))
      >>> sorted(d), d["model"]["kpt_shape"]                 # tuples become lists
      (['data', 'loss', 'model', 'optim', 'train', 'val'], [17, 3])
    """
    if not dataclasses.is_dataclass(config):
        raise TypeError(f"[yolo_func] config_to_dict expects a Config; got {type(config).__name__}")

    def plain(v: Any) -> Any:
        if dataclasses.is_dataclass(v):
            return {f.name: plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
        if isinstance(v, tuple):
            return [plain(x) for x in v]
        return v

    return plain(config)


def config_from_dict(data: Mapping[str, Any], *, source: str = "a config dict") -> Config:
    """Rebuild a :class:`Config` from :func:`config_to_dict`'s output (e.g. a run's ``config.json``).

    Keys missing from ``data`` take their defaults (a run folder written before an option existed
    still loads); unknown keys are an error.

    Args:
      data: nested dicts.
      source: what ``data`` came from (a file name), for messages.

    Raises:
      ValueError: an unknown key (names ``source`` and the key, with "did you mean") or a bad value.
      TypeError: a section that is not a dict, or a value of the wrong type.

    Example:
      >>> from yolo_func.configs import config_from_dict, config_to_dict, get_recipe
      >>> cfg = get_recipe("yolov8n-pose")
      >>> config_from_dict(config_to_dict(cfg)) == cfg
      True
    """
    def build(cls: type, d: Any, prefix: str) -> Any:
        if not isinstance(d, Mapping):
            raise TypeError(f"[yolo_func] config section {prefix.rstrip('.') or '<root>'!r} must be a JSON object; got {type(d).__name__}")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        kwargs: dict[str, Any] = {}
        for name, value in d.items():
            key = f"{prefix}{name}"
            if name not in fields:
                raise _unknown(key)
            tp = _hints(cls)[name]
            kwargs[name] = build(tp, value, f"{key}.") if _is_section(tp) else check_value(key, tp, value, fields[name].metadata)
        return cls(**kwargs)

    try:
        return build(Config, data, "")
    except (TypeError, ValueError) as e:  # name the file once, in front of the reason
        raise type(e)(f"[yolo_func] {source}: {str(e).removeprefix('[yolo_func] ')}") from None


def config_to_json(config: Config) -> str:
    """``config_to_dict`` as indented JSON text (what a run folder's ``config.json`` holds).

    Example:
      >>> import json
      >>> from yolo_func.configs import config_to_json, get_recipe
      >>> json.loads(config_to_json(get_recipe("yolov8n")))["model"]["scale"]
      'n'
    """
    return json.dumps(config_to_dict(config), indent=2) + "\n"


def config_from_json(text: str, *, source: str = "a JSON config") -> Config:
    """Parse :func:`config_to_json`'s text.

    Raises:
      ValueError: not JSON, or an unknown key / bad value (names ``source``).

    Example:
      >>> from yolo_func.configs import config_from_json, config_to_json, get_recipe
      >>> cfg = get_recipe("yolov8m")
      >>> config_from_json(config_to_json(cfg)) == cfg
      True
    """
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"[yolo_func] {source} is not valid JSON ({e}); delete or fix the file") from None
    return config_from_dict(data, source=source)


def config_diff(a: Config, b: Config) -> dict[str, tuple[Any, Any]]:
    """``{dotted key: (value in a, value in b)}`` for every option that differs.

    Example:
      >>> from yolo_func.configs import config_diff, get_recipe
      >>> config_diff(get_recipe("yolov8n"), get_recipe("yolov8s-seg"))
      {'model.scale': ('n', 's'), 'model.task': ('detect', 'segment')}
    """
    out = {}
    for info in field_info():
        va, vb = _get(a, info.key), _get(b, info.key)
        if va != vb:
            out[info.key] = (va, vb)
    return out


def _get(config: Any, key: str) -> Any:
    for part in key.split("."):
        config = getattr(config, part)
    return config
