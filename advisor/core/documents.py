"""Typed JSON round-trip for the dataclasses that cross package boundaries.

``to_jsonable`` turns a dataclass tree into plain JSON values; ``from_jsonable`` builds it
back, checking every field against the dataclass's type hints and naming the path of the
first bad value (``compute.parameters[3].ready_s: expected a number, got 'x'``).  Written
here because the standard library has no validating reader and the data is small.
"""

from __future__ import annotations

import dataclasses
import json
import numbers
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Union, get_args, get_origin, get_type_hints


def check_int(name: str, value, minimum: int = 1) -> None:
    """Raise ValueError naming ``name`` unless ``value`` is an integer >= ``minimum`` (bools are not)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name}={value!r}; allowed: an integer >= {minimum}")


class SchemaError(ValueError):
    """A JSON document does not match the dataclass it should describe."""


def to_jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_jsonable(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init}
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    return value


def _describe(value: Any) -> str:
    text = repr(value)
    return text if len(text) < 60 else text[:57] + "..."


def from_jsonable(cls: Any, data: Any, path: str = "") -> Any:
    """Build ``cls`` (a dataclass or a typing form) from JSON ``data``, validating it."""
    where = path or "document"
    origin = get_origin(cls)
    if cls is Any:
        return data
    if origin in (Union, types.UnionType):
        options = get_args(cls)
        if data is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return from_jsonable(option, data, path)
            except SchemaError as exc:
                errors.append(str(exc))
        raise SchemaError(errors[0] if len(errors) == 1 else f"{where}: {_describe(data)} matches none of {options}")
    if origin in (list, tuple, typing.Sequence) or cls in (list, tuple):
        if not isinstance(data, list):
            raise SchemaError(f"{where}: expected a list, got {_describe(data)}")
        args = get_args(cls)
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(args) != len(data):
                raise SchemaError(f"{where}: expected {len(args)} items, got {len(data)}")
            return tuple(from_jsonable(a, v, f"{path}[{i}]") for i, (a, v) in enumerate(zip(args, data)))
        item = args[0] if args else Any
        items = [from_jsonable(item, v, f"{path}[{i}]") for i, v in enumerate(data)]
        return tuple(items) if origin is tuple else items
    if origin is dict or cls is dict:
        if not isinstance(data, dict):
            raise SchemaError(f"{where}: expected an object, got {_describe(data)}")
        args = get_args(cls)
        value_type = args[1] if args else Any
        return {str(k): from_jsonable(value_type, v, f"{path}.{k}" if path else str(k)) for k, v in data.items()}
    if dataclasses.is_dataclass(cls):
        if not isinstance(data, dict):
            raise SchemaError(f"{where}: expected an object for {cls.__name__}, got {_describe(data)}")
        hints = get_type_hints(cls)
        fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
        unknown = sorted(set(data) - set(fields))
        if unknown:
            raise SchemaError(f"{where}: unknown field(s) {unknown} for {cls.__name__}")
        kwargs = {}
        for name, f in fields.items():
            sub = f"{path}.{name}" if path else name
            if name not in data:
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                    raise SchemaError(f"{sub}: missing")
                continue
            kwargs[name] = from_jsonable(hints[name], data[name], sub)
        try:
            return cls(**kwargs)
        except (ValueError, TypeError) as exc:
            raise SchemaError(f"{where}: {exc}") from None
    if cls is float:
        if isinstance(data, bool) or not isinstance(data, (int, float)):
            raise SchemaError(f"{where}: expected a number, got {_describe(data)}")
        return float(data)
    if cls is int:
        if isinstance(data, bool) or not isinstance(data, int):
            raise SchemaError(f"{where}: expected an integer, got {_describe(data)}")
        return data
    if cls is bool:
        if not isinstance(data, bool):
            raise SchemaError(f"{where}: expected true or false, got {_describe(data)}")
        return data
    if cls is str:
        if not isinstance(data, str):
            raise SchemaError(f"{where}: expected a string, got {_describe(data)}")
        return data
    raise SchemaError(f"{where}: cannot read type {cls!r}")


def read_json(path: str | Path, what: str = "document") -> Any:
    """The parsed contents of a JSON file; errors name the file and say what was expected."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{what} file {str(p)!r} does not exist")
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{p}: {what} is not valid JSON: {exc}") from None


#: every document kind this advisor reads: kind string -> its class (filled as each class is defined)
DOCUMENT_KINDS: dict[str, type[JsonDocument]] = {}


class JsonDocument:
    """JSON text and file I/O for a type with ``to_dict`` / ``from_dict``.

    ``from_dict`` does the validation; this adds the messages for text that is not JSON
    and for files that do not exist, naming what was expected (``what``).  A subclass that
    sets ``KIND`` is registered in :data:`DOCUMENT_KINDS`, so :func:`read_document` can
    read it from a file without being told what it holds.
    """

    what = "document"
    KIND = ""
    VERSION = 1
    #: what to do with a document of another version
    REDO = "create it again with this version"

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if "KIND" in cls.__dict__ and cls.KIND:  # a subclass that inherits its kind reads as its parent
            known = DOCUMENT_KINDS.get(cls.KIND)
            # the same class defined again (a reloaded module) takes its place
            if known is not None and known.__qualname__ != cls.__qualname__:
                raise TypeError(f"document kind {cls.KIND!r} is taken by {known.__qualname__}")
            DOCUMENT_KINDS[cls.KIND] = cls

    @classmethod
    def check_header(cls, data) -> None:
        """Raise ValueError unless ``data`` is an object of this class's kind and version."""
        if not isinstance(data, Mapping):
            raise ValueError(f"a {cls.what} must be a JSON object, got {type(data).__name__}")
        if data.get("kind") != cls.KIND:
            raise ValueError(f"not a {cls.what}: 'kind' is {data.get('kind')!r}, expected {cls.KIND!r}")
        if data.get("version") != cls.VERSION:
            raise ValueError(
                f"{cls.what} version {data.get('version')!r} is not supported (this advisor reads version "
                f"{cls.VERSION}); {cls.REDO}"
            )

    def to_dict(self) -> dict:  # pragma: no cover - provided by the subclass
        raise NotImplementedError

    @classmethod
    def from_dict(cls, data):  # pragma: no cover - provided by the subclass
        raise NotImplementedError

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{cls.what} is not valid JSON: {exc}") from None
        return cls.from_dict(data)

    def save(self, path: str | Path) -> None:
        """Write the JSON form to ``path``."""
        Path(path).write_text(self.to_json() + "\n")

    @classmethod
    def load(cls, path: str | Path):
        """Read one from a JSON file; errors name the file and the bad field."""
        data = read_json(path, cls.what)
        try:
            return cls.from_dict(data)
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None


class VersionedDocument(JsonDocument):
    """A dataclass document with ``kind`` and ``version`` fields checked on load.

    Subclasses set ``KIND`` and ``VERSION`` (class constants) and declare ``kind`` and
    ``version`` fields defaulting to them.
    """

    def to_dict(self) -> dict:
        return to_jsonable(self)

    @classmethod
    def from_dict(cls, data):
        cls.check_header(data)
        try:
            return from_jsonable(cls, data)
        except SchemaError as exc:
            raise ValueError(f"malformed {cls.what}: {exc}") from None


def read_document(path: str | Path, accept: Sequence[type[JsonDocument]] | None = None) -> JsonDocument:
    """The document in a JSON file, of whichever registered kind it declares.

    Args:
        path: the JSON file.
        accept: the document classes allowed (default: every kind in :data:`DOCUMENT_KINDS`).

    Returns:
        An instance of the class registered for the file's ``kind``.

    Raises:
        ValueError: a missing file, text that is not JSON, a kind not accepted (naming those
            that are), or a malformed document (naming the file and the field).
    """
    accept = list(accept) if accept is not None else list(DOCUMENT_KINDS.values())
    names = [("an " if c.what[0] in "aeiou" else "a ") + c.what for c in accept]
    expected = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]
    data = read_json(path, accept[0].what if len(accept) == 1 else "document")
    kind = data.get("kind") if isinstance(data, dict) else None
    cls = DOCUMENT_KINDS.get(kind) if isinstance(kind, str) else None
    if cls is None or cls not in accept:
        raise ValueError(f"{path} is not {expected} (kind {kind!r})")
    try:
        return cls.from_dict(data)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
