"""Reading the JSON config files of a checkpoint, naming file and field in every error."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tts_cli.errors import CheckpointError


def read_json(path: Path) -> dict:
    if not path.is_file():
        raise CheckpointError(f"missing file: {path}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"malformed JSON in {path}: {e}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"malformed JSON in {path}: expected an object at the top level")
    return data


class ConfigFields:
    """Reads typed fields from one JSON object, naming file and field in every error."""

    def __init__(self, data: dict, where: str):
        self.data, self.where = data, where

    def get(self, key: str, kind: type | tuple, default: Any = ..., minimum: float | None = None) -> Any:
        if key not in self.data or self.data[key] is None:
            if default is ...:
                raise CheckpointError(f"{self.where}: missing field '{key}'")
            return default
        value = self.data[key]
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise CheckpointError(f"{self.where}: field '{key}' should be {_kind_name(kind)}, got {value!r}")
        if minimum is not None and value < minimum:
            raise CheckpointError(f"{self.where}: field '{key}' should be >= {minimum}, got {value!r}")
        return value

    def int_list(self, key: str) -> tuple[int, ...]:
        """A non-empty list of positive integers."""
        value = self.get(key, list)
        if not value or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in value):
            raise CheckpointError(f"{self.where}: field '{key}' should be a non-empty list of positive "
                                  f"integers, got {value!r}")
        return tuple(value)

    def sub(self, key: str) -> "ConfigFields":
        return ConfigFields(self.get(key, dict), f"{self.where} -> {key}")


def _kind_name(kind) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(k.__name__ for k in kinds)
