"""The run settings of `tts synth` with their defaults, declared once, and recipes: named YAML files
of those settings (recipes/NAME.yaml in a checkout, or any YAML path). An option given on the
command line wins over the recipe.

`RunSettings` is the one place these defaults live: cli.py takes the defaults of its typer options
from it (`tts bench` and `tts verify-golden` share its device and engine options), and a recipe's
keys and their types are its fields. This module imports no torch."""
from __future__ import annotations

import typing
from collections.abc import Hashable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Optional

from tts_cli.engine import (CODEC_PRECISIONS, DEFAULT_CODEC_PRECISION, DEFAULT_DEPTH, DEFAULT_TALKER_PRECISION,
                            DEPTH_CHOICES, TALKER_PRECISIONS)
from tts_cli.errors import TTSError

RECIPES_DIR = Path(__file__).resolve().parents[1] / "recipes"
AUTO_DEVICE = "auto"   # cuda when torch sees a GPU, else cpu (tts_cli.cli.resolve_device)
AUTO_ROWS = "auto"     # the engine's slots chosen per call (tts_cli.engine.AUTO_ROWS; parse_rows)


@dataclass(frozen=True)
class RunSettings:
    model: Optional[str] = None   # a folder, or "bundled"; None: $TTS_MODEL, else the bundled model
    speaker: Optional[str] = None   # None: cli.DEFAULT_SPEAKER on CustomVoice checkpoints (others have none)
    language: str = "auto"
    seed: int = 0
    greedy: bool = False
    max_frames: Optional[int] = None
    batch_size: Optional[int] = None
    rows: str = AUTO_ROWS   # auto or a whole number
    depth: str = DEFAULT_DEPTH
    codec_precision: str = DEFAULT_CODEC_PRECISION
    talker_precision: str = DEFAULT_TALKER_PRECISION
    device: str = AUTO_DEVICE


DEFAULTS = RunSettings()
SEED_RANGE = (-2**63, 2**63 - 1)   # a signed 64-bit integer: the samplers' seeds (a row's own, or the base + its index)


def wrapped_seed(seed: int) -> int:
    """A seed derived from another (the base + a row's index, a segment's stride) brought back into
    SEED_RANGE as 64-bit arithmetic wraps: the same within it, and never out of it."""
    low, high = SEED_RANGE
    return (seed - low) % (high - low + 1) + low
# The bounds of the numeric settings, for a recipe's keys as for the command line's options (cli.setting_option).
# max_frames: the frame caps are int64 tensors (a larger cap failed the run mid-synthesis on an overflow).
SETTING_RANGES = {"seed": SEED_RANGE, "max_frames": (1, 2**63 - 1), "batch_size": (1, None)}
# The settings that take one of a few words (checked for the command line in cli.check_engine_choices).
SETTING_CHOICES = {"depth": DEPTH_CHOICES, "codec_precision": CODEC_PRECISIONS, "talker_precision": TALKER_PRECISIONS}


def _value_type(hint) -> type:
    """int for Optional[int]: the type a set value has."""
    return next(arg for arg in typing.get_args(hint) if arg is not type(None)) if typing.get_args(hint) else hint


# recipe key -> type; `model` may also be the word "bundled"
RECIPE_KEYS = {field.name: _value_type(typing.get_type_hints(RunSettings)[field.name]) for field in fields(RunSettings)}


def available() -> list[str]:
    return sorted(p.stem for p in RECIPES_DIR.glob("*.yaml")) if RECIPES_DIR.is_dir() else []


def _read_yaml(text: str):
    """yaml.safe_load, but a key given twice in one mapping is an error (YAML requires unique keys; PyYAML
    keeps the last value without a word). yaml is imported here: only a run with a recipe needs it."""
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            first_line = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":   # `<<: *anchor`: keys the mapping may override
                    continue
                key = self.construct_object(key_node, deep=deep)
                if not isinstance(key, Hashable):   # refused by SafeLoader, with its own message
                    continue
                if key in first_line:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"found duplicate key {key!r} (first on line {first_line[key]})",
                        key_node.start_mark)
                first_line[key] = key_node.start_mark.line + 1
            return super().construct_mapping(node, deep)

    return yaml.load(text, Loader=UniqueKeyLoader)


def load_recipe(name_or_path: str) -> dict:
    import yaml

    path = Path(name_or_path)
    if not path.is_file():
        path = RECIPES_DIR / f"{name_or_path}.yaml"
    if not path.is_file():
        raise TTSError(f"recipe not found: {name_or_path} (give a YAML path or one of: "
                       f"{', '.join(available()) or 'none, recipes/ ships with the source checkout'})")
    try:
        data = _read_yaml(path.read_text(encoding="utf-8")) or {}
    except OSError as e:
        raise TTSError(f"recipe {path} cannot be read: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise TTSError(f"recipe {path} does not read as UTF-8 text: {e}") from None
    except yaml.YAMLError as e:   # (its position markers on one line)
        raise TTSError(f"malformed YAML in recipe {path}: {' '.join(str(e).split())}") from None
    if not isinstance(data, dict):
        raise TTSError(f"recipe {path}: expected a mapping of option names to values")
    settings = {}
    for key, value in data.items():
        if key not in RECIPE_KEYS:
            raise TTSError(f"recipe {path}: unknown key '{key}' (known: {', '.join(RECIPE_KEYS)})")
        if value is None:   # `key: null` (or `key:` alone) leaves the setting at its default, as if absent
            continue
        if key == "rows" and isinstance(value, int) and not isinstance(value, bool):
            value = str(value)   # `rows: 64` in YAML is an int
        kind = RECIPE_KEYS[key]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise TTSError(f"recipe {path}: '{key}' should be {kind.__name__}, got {value!r}")
        if isinstance(value, str) and not value.strip():   # `model: ""` would name the working folder
            raise TTSError(f"recipe {path}: '{key}' is empty (leave it out, or give null, for the default)")
        low, high = SETTING_RANGES.get(key, (None, None))
        if (low is not None and value < low) or (high is not None and value > high):
            bounds = f"from {low} to {high}" if high is not None else f"{low} or more"
            raise TTSError(f"recipe {path}: '{key}' should be {bounds}, got {value!r}")
        if key in SETTING_CHOICES and value not in SETTING_CHOICES[key]:
            raise TTSError(f"recipe {path}: '{key}' should be one of {', '.join(SETTING_CHOICES[key])}, got {value!r}")
        if key == "rows":
            parse_rows(value, f"recipe {path}: 'rows'")
        settings[key] = value
    return settings


def ascii_whole_number(text: str) -> int | None:
    """The number that `text` writes in ASCII digits alone, else None: str.isdigit() and int() also take
    other scripts' digits (١, ٢), which the options that take numbers are not documented to accept."""
    return int(text) if text.isascii() and text.isdigit() else None


def parse_rows(value: str, given_by: str = "--rows") -> int | None:
    """--rows (or what gave its value: given_by): None for auto, else the whole number of engine slots."""
    if value == AUTO_ROWS:
        return None
    slots = ascii_whole_number(value)
    if slots is not None and slots >= 1:
        return slots
    raise TTSError(f"{given_by} {value}: auto or a whole number of slots (1 or more)")
