"""Recipes: named YAML files of `tts synth` option defaults (recipes/NAME.yaml in a checkout, or
any YAML path). An option given on the command line wins over the recipe."""
from __future__ import annotations

from pathlib import Path

from tts_cli.errors import TTSError

RECIPES_DIR = Path(__file__).resolve().parents[1] / "recipes"
# recipe key -> type; `model` may also be the word "bundled"
SYNTH_KEYS = {"model": str, "speaker": str, "language": str, "seed": int, "greedy": bool,
              "max_frames": int, "batch_size": int, "rows": int, "depth": str, "codec_precision": str,
              "talker_precision": str, "device": str}


def available() -> list[str]:
    return sorted(p.stem for p in RECIPES_DIR.glob("*.yaml")) if RECIPES_DIR.is_dir() else []


def load_recipe(name_or_path: str) -> dict:
    import yaml

    path = Path(name_or_path)
    if not path.is_file():
        path = RECIPES_DIR / f"{name_or_path}.yaml"
    if not path.is_file():
        raise TTSError(f"recipe not found: {name_or_path} (give a YAML path or one of: "
                       f"{', '.join(available()) or 'none, recipes/ ships with the source checkout'})")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as e:
        raise TTSError(f"malformed YAML in recipe {path}: {e}") from None
    if not isinstance(data, dict):
        raise TTSError(f"recipe {path}: expected a mapping of option names to values")
    for key, value in data.items():
        if key not in SYNTH_KEYS:
            raise TTSError(f"recipe {path}: unknown key '{key}' (known: {', '.join(SYNTH_KEYS)})")
        kind = SYNTH_KEYS[key]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise TTSError(f"recipe {path}: '{key}' should be {kind.__name__}, got {value!r}")
    return data
