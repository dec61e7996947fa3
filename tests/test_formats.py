"""Output formats (wav, flac, parquet as a datasets Audio column) and long text joined into one file."""
import importlib.util
import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import soundfile as sf
from typer.testing import CliRunner

from tts_cli import cli
from tts_cli.textsplit import crossfade_samples, split_text

from fakes import SAMPLES_PER_FRAME, use_fake_synthesizer

runner = CliRunner()


def _synth(*args):
    return runner.invoke(cli.app, ["synth", *map(str, args)])


@pytest.fixture
def fake(monkeypatch, tmp_path):
    return use_fake_synthesizer(monkeypatch, tmp_path)


def test_flac_files_hold_the_rows_audio(fake, tmp_path):
    manifest = tmp_path / "m.txt"
    manifest.write_text("a\tOne.\nb b\tTwo more.\n")
    out = tmp_path / "out"
    assert _synth(manifest, "--out", out, "--model", tmp_path / "model", "--format", "flac").exit_code == 0
    report = json.loads((out / "report.json").read_text())
    assert [row["file"] for row in report["rows"]] == ["a.flac", "b_b.flac"]
    for row in report["rows"]:
        info = sf.info(out / row["file"])
        assert (info.format, info.subtype, info.samplerate) == ("FLAC", "PCM_16", 24000)
        assert info.frames == row["frames"] * SAMPLES_PER_FRAME


def test_unknown_format_is_refused_before_anything_runs(fake, tmp_path):
    manifest = tmp_path / "m.txt"
    manifest.write_text("a\tOne.\n")
    result = _synth(manifest, "--out", tmp_path / "out", "--model", tmp_path / "model", "--format", "mp3")
    assert result.exit_code == 2 and "--format 'mp3': expected one of wav, flac, parquet" in result.stderr
    assert not (tmp_path / "out").exists()


def test_parquet_shards_are_a_datasets_audio_column(fake, tmp_path):
    manifest = tmp_path / "m.parquet"
    pq.write_table(pa.table({"id": ["a", "b", "c"], "text": ["One.", "Two two.", "boom"]}), manifest)
    out = tmp_path / "out"
    assert _synth(manifest, "--out", out, "--model", tmp_path / "model", "--format", "parquet").exit_code == 1
    report = json.loads((out / "report.json").read_text())
    assert [row["file"] for row in report["rows"]] == ["part-00000.parquet", "part-00000.parquet", None]
    table = pq.read_table(out / "part-00000.parquet")
    assert table.schema.field("audio").type == pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    assert table.column_names == ["id", "text", "speaker", "language", "audio", "sampling_rate", "duration"]
    features = json.loads(table.schema.metadata[b"huggingface"])["info"]["features"]
    assert features["audio"] == {"sampling_rate": 24000, "_type": "Audio"}
    for row, expected in zip(table.to_pylist(), report["rows"]):
        assert (row["id"], row["text"], row["sampling_rate"]) == (expected["id"], expected["text"], 24000)
        audio, rate = sf.read(io.BytesIO(row["audio"]["bytes"]))
        assert rate == 24000 and len(audio) == expected["frames"] * SAMPLES_PER_FRAME
        assert row["duration"] == pytest.approx(len(audio) / 24000) and row["audio"]["path"] == f"{row['id']}.flac"


def test_a_parquet_shard_is_written_once_its_first_row_has_waited_a_minute(tmp_path, monkeypatch):
    """Rows wait in memory for their shard (and their ledger lines for it): a shard of whatever waits
    is written once the first waiting row is PARQUET_MAX_WAIT_S old, so a kill loses about a minute
    of finished rows, not up to a thousand."""
    import numpy as np

    from tts_cli.output import formats

    clock = [100.0]
    monkeypatch.setattr(formats.time, "monotonic", lambda: clock[0])
    sink = formats.ParquetSink(tmp_path, 24000, set())
    audio = np.zeros(2400, dtype=np.float32)

    def add(row_id):
        entry = {"id": row_id, "params": {"text": "Hi.", "speaker": "vivian", "language": "auto"}}
        sink.add(entry, f"{row_id}.flac", sink.store(f"{row_id}.flac", audio))

    add("a")
    clock[0] += 30
    add("b")
    assert sink.durable_entries() == [] and not list(tmp_path.glob("*.parquet"))
    clock[0] += formats.PARQUET_MAX_WAIT_S - 30
    assert [(e["id"], e["file"]) for e in sink.durable_entries()] == [("a", "part-00000.parquet"),
                                                                        ("b", "part-00000.parquet")]
    assert pq.read_table(tmp_path / "part-00000.parquet").column("id").to_pylist() == ["a", "b"]
    add("c")   # the next shard's clock starts with its first row
    clock[0] += formats.PARQUET_MAX_WAIT_S - 1
    assert sink.durable_entries() == []
    assert [e["file"] for e in sink.durable_entries(final=True)] == ["part-00001.parquet"]


def test_a_parquet_shard_holds_rows_per_file_rows_at_most(tmp_path):
    """Rows come a batch at a time, and those waiting may pass rows_per_file: the rest wait for the next shard."""
    import numpy as np

    from tts_cli.output import formats

    sink = formats.ParquetSink(tmp_path, 24000, set(), rows_per_file=2)
    for row_id in "abc":   # one batch's rows, added before the sink is asked for its durable entries
        entry = {"id": row_id, "params": {"text": "Hi.", "speaker": "vivian", "language": "auto"}}
        sink.add(entry, f"{row_id}.flac", sink.store(f"{row_id}.flac", np.zeros(2400, dtype=np.float32)))
    assert [(e["id"], e["file"]) for e in sink.durable_entries()] == [("a", "part-00000.parquet"),
                                                                        ("b", "part-00000.parquet")]
    assert [(e["id"], e["file"]) for e in sink.durable_entries(final=True)] == [("c", "part-00001.parquet")]
    assert [pq.read_table(path).column("id").to_pylist() for path in sorted(tmp_path.glob("*.parquet"))] == [
        ["a", "b"], ["c"]]


@pytest.mark.skipif(importlib.util.find_spec("datasets") is None, reason="Hugging Face datasets is not installed")
def test_parquet_shards_load_with_datasets(fake, tmp_path):
    import datasets

    manifest = tmp_path / "m.txt"
    manifest.write_text("a\tOne.\nb\tTwo two.\n")
    out = tmp_path / "out"
    assert _synth(manifest, "--out", out, "--model", tmp_path / "model", "--format", "parquet").exit_code == 0
    loaded = datasets.load_dataset("parquet", data_files=str(out / "part-*.parquet"), split="train")
    assert isinstance(loaded.features["audio"], datasets.Audio) and loaded.features["audio"].sampling_rate == 24000
    raw = loaded.cast_column("audio", datasets.Audio(decode=False))
    assert [sf.info(io.BytesIO(row["audio"]["bytes"])).samplerate for row in raw] == [24000, 24000]


@pytest.mark.skipif(not (cli.BUNDLED_MODEL_DIR / "config.json").is_file(), reason="the bundled model is missing")
def test_a_2000_character_paragraph_is_one_wav_as_long_as_its_segments(tmp_path, monkeypatch):
    """Acceptance: long text is split, each segment capped, and joined into one file whose length is
    the segments' minus one crossfade per seam."""
    monkeypatch.delenv("TTS_MODEL", raising=False)
    sentences = [f"Sentence {i} tells of the birch canoe, the smooth planks, and the long quiet river."
                 for i in range(40)]
    paragraph = " ".join(sentences)[:2000].rsplit(" ", 1)[0] + "."
    assert len(paragraph) >= 1990
    manifest = tmp_path / "m.txt"
    manifest.write_text(f"paragraph\t{paragraph}\n")
    out = tmp_path / "out"
    result = _synth(manifest, "--out", out, "--max-frames", 4, "--greedy", "--segment-chars", 300)
    assert result.exit_code == 0, result.output
    row = json.loads((out / "report.json").read_text())["rows"][0]
    segments = split_text(paragraph, 300)
    assert len(row["segment_frames"]) == len(segments) == 8
    assert all(1 <= frames <= 4 for frames in row["segment_frames"]) and row["frames"] == sum(row["segment_frames"])
    segments_md = " + ".join(map(str, row["segment_frames"]))   # report.md says each segment's frames too
    assert f"| {row['frames']} ({segments_md}) |" in (out / "report.md").read_text()
    audio, rate = sf.read(out / "paragraph.wav")
    expected = sum(row["segment_frames"]) * SAMPLES_PER_FRAME - (len(segments) - 1) * crossfade_samples(rate)
    assert len(audio) == expected
    assert row["audio_seconds"] == pytest.approx(expected / rate, abs=1e-3)
    assert sorted(p.name for p in out.glob("*.wav")) == ["paragraph.wav"]
