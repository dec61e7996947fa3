"""tools/side_by_side.py runs the official implementation and `tts` on the same checkpoint and work
(on the bundled tiny model here; the speed comparison itself is a GPU run, docs/bench.md)."""
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "tts_cli" / "assets" / "tiny-1.7b-customvoice"


def test_side_by_side_runs_both_implementations_on_the_same_work(tmp_path):
    from tts_cli.quality import reference
    try:
        reference.import_official()
    except ImportError as e:
        pytest.skip(f"the official implementation is not importable here: {e}")
    sys.path.insert(0, str(ROOT / "tools"))
    import side_by_side
    out = tmp_path / "sbs.json"
    assert side_by_side.main(["--ckpt", str(TINY), "--batches", "2", "--frames", "3", "--json", str(out)]) == 0
    import json
    row = json.loads(out.read_text())["rows"][0]
    for name in ("official", "tts"):
        assert row[name]["audio_s"] == pytest.approx(2 * 3 * 1920 / 24000)   # both made 2 x 3 frames
        assert row[name]["wall_s"] > 0
    assert row["ratio"] == pytest.approx(row["tts"]["audio_s_per_s"] / row["official"]["audio_s_per_s"], rel=0.01)
