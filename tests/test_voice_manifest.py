"""Voice fields in manifests and on the command line: ref_audio, ref_text, x_vector_only, instruct.
A fuzz of bad reference rows mixed with good ones, at the manifest and through `tts synth`."""
import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import soundfile as sf
from typer.testing import CliRunner

from tts_cli import cli, manifest as manifest_module
from tts_cli.errors import TTSError
from tts_cli.job import JobSettings, plan_row, segment_requests
from tts_cli.manifest import ManifestRow, RowDefaults, read_manifest
from tts_cli.request import Request

runner = CliRunner()
BASE_MODEL = Path(__file__).resolve().parent / "fixtures" / "tiny-1.7b-base"
CLONE_REFUSED = "this checkpoint (custom_voice) cannot clone a voice: needs a Base checkpoint"


def tone(sample_rate: int, seconds: float, amplitude: float = 0.3) -> np.ndarray:
    t = np.arange(int(sample_rate * seconds)) / sample_rate
    return amplitude * np.sin(2 * np.pi * 220 * t) + amplitude / 3 * np.sin(2 * np.pi * 1700 * t)


def make_references(folder: Path) -> dict[str, Path]:
    """Good and bad reference files of every kind the fuzz uses."""
    folder.mkdir()
    f = {name: folder / name for name in (
        "good.wav", "good.flac", "good.ogg", "missing.wav", "dangling.wav", "dir.wav", "empty.wav", "zero.wav",
        "text.wav", "header.wav", "cut.ogg", "noise.flac", "silence.wav", "quiet.wav", "half.wav", "long.wav",
        "nan.wav", "inf.wav", "low-rate.wav")}
    sf.write(f["good.wav"], tone(24000, 1.5), 24000, subtype="PCM_16")
    sf.write(f["good.flac"], np.stack([tone(44100, 2), tone(44100, 2, 0.1)], axis=1), 44100)
    sf.write(f["good.ogg"], tone(48000, 1.2), 48000, format="OGG")
    f["dangling.wav"].symlink_to(folder / "nowhere.wav")
    f["dir.wav"].mkdir()
    f["empty.wav"].write_bytes(b"")
    sf.write(f["zero.wav"], np.zeros(0), 24000, subtype="PCM_16")
    f["text.wav"].write_text("This is a transcript, not audio.\n" * 5)
    f["header.wav"].write_bytes(f["good.wav"].read_bytes()[:30])
    f["cut.ogg"].write_bytes(f["good.ogg"].read_bytes()[:200])
    f["noise.flac"].write_bytes(np.random.default_rng(1).integers(0, 256, 3000, dtype=np.uint8).tobytes())
    sf.write(f["silence.wav"], np.zeros(48000), 24000, subtype="PCM_16")
    sf.write(f["quiet.wav"], tone(24000, 2, 3e-4), 24000, subtype="FLOAT")
    sf.write(f["half.wav"], tone(24000, 0.5), 24000, subtype="PCM_16")
    sf.write(f["long.wav"], tone(8000, 61), 8000, subtype="PCM_16")
    for name, bad in (("nan.wav", np.nan), ("inf.wav", np.inf)):
        samples = tone(24000, 1.5).astype(np.float32)
        samples[12000] = bad
        sf.write(f[name], samples, 24000, subtype="FLOAT")
    sf.write(f["low-rate.wav"], tone(4000, 2), 4000, subtype="PCM_16")
    return f


# (ref_audio cell, ref_text, x_vector_only, instruct, expected reason); ref_audio as a name in
# refs/ is written relative to the manifest's folder ("../refs/NAME"); bytes are cells as given.
BAD_ROWS = [
    ("missing.wav", "Hi.", None, None, "reference file not found"),
    ("dangling.wav", "Hi.", None, None, "reference file not found"),
    ("dir.wav", "Hi.", None, None, "is a directory, not an audio file"),
    ("empty.wav", "Hi.", None, None, "reference file is empty (0 bytes)"),
    ("zero.wav", "Hi.", None, None, "holds no samples (0 s of audio)"),
    ("text.wav", "Hi.", None, None, "not audio that libsndfile reads (wav, flac, ogg, mp3, ...): Format not recognised"),
    ("header.wav", "Hi.", None, None, "not audio that libsndfile reads"),
    ("cut.ogg", "Hi.", None, None, "not audio that libsndfile reads"),
    ("noise.flac", "Hi.", None, None, "not audio that libsndfile reads"),
    ("silence.wav", "Hi.", None, None, "is silent (digital silence"),
    ("quiet.wav", "Hi.", None, None, "is silent (RMS -73.0 dBFS"),
    ("half.wav", "Hi.", None, None, "is 0.50 s long, shorter than 1 s"),
    ("long.wav", None, True, None, "is 61.00 s long, longer than 60 s"),
    ("nan.wav", "Hi.", None, None, "non-finite samples (NaN or infinity; first at 0.500 s)"),
    ("inf.wav", None, True, None, "non-finite samples"),
    ("low-rate.wav", "Hi.", None, None, "sampled at 4000 Hz, below 8000 Hz"),
    ("good.wav", None, None, None, "ICL voice cloning (x_vector_only false) needs ref_text"),
    ("good.wav", "  ", False, None, "needs ref_text"),
    (None, "A transcript.", None, None, "ref_text without ref_audio"),
    (None, None, True, None, "x_vector_only without ref_audio"),
    ("good.wav", "Hi.", 2, None, "x_vector_only must be true or false (or 1 or 0), got 2"),
    ("good.wav", "Hi.", None, "Speak softly.", "instruct with ref_audio: a voice clone takes no instruct"),
    (b"bad\x00path.wav", "Hi.", None, None, "contains a NUL character"),
    (b"https://example.com/voice.wav", "Hi.", None, None, "is a URL: tts reads local files only"),
    (b"caf\xe9.wav", "Hi.", None, None, "invalid UTF-8 in the ref_audio"),
    ("good.wav", b"ok \xff", None, None, "invalid UTF-8 in the ref_text"),
    ("good.wav", "Bell\x07 here.", None, None, "ref_text: text contains control character U+0007"),
    ("good.wav", "word " * 30, None, None, "ref_text: text is 149 characters, over the limit of 100"),
    (None, None, None, "Calm " * 401, "instruct: text is 2004 characters, over the limit of 2000 (instructs)"),
    (None, None, None, "Bell\x07 voice.", "instruct: text contains control character U+0007"),
]
GOOD_CLONE_ROWS = [
    ("good.wav", "Hello there.", None, None),
    ("good.flac", None, True, None),
    ("good.ogg", "Another reference.", 0, None),
    ("ABSOLUTE:good.wav", None, 1, None),
]


def _cell(value, refs: Path):
    if isinstance(value, str) and value.startswith("ABSOLUTE:"):
        return str(refs / value.removeprefix("ABSOLUTE:")).encode()
    if isinstance(value, str):
        return f"../refs/{value}".encode()
    return value


def write_fuzz_manifest(tmp_path: Path, plain_rows: int) -> tuple[Path, list, Path]:
    """A parquet manifest in tmp_path/manifests/ of bad rows, good clone rows and good plain rows,
    shuffled; returns (path, rows as (id, expected reason or None, clones), refs folder)."""
    refs = tmp_path / "refs"
    make_references(refs)
    rows = [(f"bad-{k}", ref, text, xvec, instruct, reason) for k, (ref, text, xvec, instruct, reason)
            in enumerate(BAD_ROWS)]
    rows += [(f"clone-{k}", ref, text, xvec, instruct, None) for k, (ref, text, xvec, instruct)
             in enumerate(GOOD_CLONE_ROWS)]
    rows += [(f"plain-{k}", None, None, None, None, None) for k in range(plain_rows)]
    order = np.random.default_rng(43).permutation(len(rows))
    rows = [rows[i] for i in order]
    (tmp_path / "manifests").mkdir()
    path = tmp_path / "manifests" / "voices.parquet"
    text_of = lambda value: value.encode() if isinstance(value, str) else value   # noqa: E731
    pq.write_table(pa.table({
        "id": [row[0] for row in rows],
        "text": [f"Row {row[0]} says a few words." for row in rows],
        "ref_audio": pa.array([_cell(row[1], refs) for row in rows], pa.binary()),
        "ref_text": pa.array([text_of(row[2]) for row in rows], pa.binary()),
        # An integer column, as pandas writes flags with nulls; a boolean one: test_null_cells_take_the_option_defaults.
        "x_vector_only": pa.array([None if row[3] is None else int(row[3]) for row in rows], pa.int64()),
        "instruct": [row[4] for row in rows],
    }), path)
    return path, [(row[0], row[5], row[0].startswith("clone")) for row in rows], refs


def test_fuzzed_reference_rows_fail_with_their_reason_and_the_good_ones_pass(tmp_path, monkeypatch):
    assert len(BAD_ROWS) >= 20
    checked = []
    monkeypatch.setattr(manifest_module, "check_reference",
                        lambda path: checked.append(path) or manifest_module_check(path))
    path, expected, refs = write_fuzz_manifest(tmp_path, plain_rows=3)
    manifest = read_manifest(path, RowDefaults("vivian", "auto", 0, max_text_chars=100))
    assert [row.request.id for row in manifest.rows] == [row_id for row_id, _, _ in expected]
    for row, (row_id, reason, clones) in zip(manifest.rows, expected):
        if reason is None:
            assert row.problem is None, (row_id, row.problem)
            assert row.request.clones_voice == clones
        else:
            assert row.problem is not None and reason in row.problem, (row_id, row.problem, reason)
    good = {row.request.id: row.request for row in manifest.good_rows}
    assert good["clone-0"].ref_audio == str(refs / "good.wav") == good["clone-3"].ref_audio   # relative == absolute
    assert good["clone-0"].ref_audio_sha256 == hashlib.sha256((refs / "good.wav").read_bytes()).hexdigest()
    assert good["clone-0"].ref_audio_sha256 == good["clone-3"].ref_audio_sha256
    assert (good["clone-0"].ref_text, good["clone-0"].x_vector_only) == ("Hello there.", False)
    assert (good["clone-1"].ref_text, good["clone-1"].x_vector_only) == (None, True)
    assert good["clone-2"].x_vector_only is False and good["plain-0"].ref_audio_sha256 is None
    # Each distinct file of the rows still good after the field checks is read once.
    assert len(checked) == len(set(checked)) and str(refs / "good.wav") in checked


manifest_module_check = manifest_module.check_reference


def test_fuzz_through_tts_synth_on_a_custom_voice_checkpoint(tmp_path):
    """Bad rows fail with their reason, clone rows are refused by the CustomVoice checkpoint, the
    plain rows are synthesized, exit status 1."""
    path, expected, _ = write_fuzz_manifest(tmp_path, plain_rows=3)
    out = tmp_path / "out"
    result = runner.invoke(cli.app, ["synth", str(path), "--out", str(out), "--model", str(cli.BUNDLED_MODEL_DIR),
                                     "--max-text-chars", "100", "--max-frames", "2", "--greedy"])
    assert result.exit_code == 1, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    report = json.loads((out / "report.json").read_text())
    assert len(report["rows"]) == len(expected)
    for row, (row_id, reason, clones) in zip(report["rows"], expected):
        assert row["id"] == row_id
        if row_id.startswith("plain"):
            assert row["error"] is None and sf.info(out / row["file"]).frames > 0, row
        else:
            assert (reason or CLONE_REFUSED) in (row["error"] or ""), (row, reason)
            assert row["file"] is None
    assert report["totals"]["ok"] == 3 and report["totals"]["failed"] == len(BAD_ROWS) + len(GOOD_CLONE_ROWS)


def test_txt_corpus_takes_one_voice_from_the_options(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    sf.write(tmp_path / "me.wav", tone(24000, 1.5), 24000, subtype="PCM_16")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("a\tFirst line.\nb\tSecond line.\n")
    defaults = RowDefaults("vivian", "auto", 0, ref_audio="me.wav", ref_text="My own words.")
    rows = read_manifest(corpus, defaults).rows
    sha = hashlib.sha256((tmp_path / "me.wav").read_bytes()).hexdigest()
    assert [(r.problem, r.request.ref_audio, r.request.ref_audio_sha256, r.request.ref_text, r.request.x_vector_only)
            for r in rows] == [(None, str(tmp_path / "me.wav"), sha, "My own words.", False)] * 2
    designed = read_manifest(corpus, RowDefaults("vivian", "auto", 0, instruct="A calm, low voice.")).rows
    assert [r.request.instruct for r in designed] == ["A calm, low voice."] * 2
    missing = read_manifest(corpus, RowDefaults("vivian", "auto", 0, ref_audio="me.wav")).rows
    assert all("needs ref_text" in r.problem for r in missing)
    # x_vector_only reads no transcript: a ref_text given anyway is left out of the rows' settings, and said
    x_vector = read_manifest(corpus, RowDefaults("vivian", "auto", 0, ref_audio="me.wav", ref_text="My own words.",
                                                 x_vector_only=True))
    assert [(r.problem, r.request.ref_text, r.request.x_vector_only) for r in x_vector.rows] == [(None, None, True)] * 2
    assert x_vector.notes == ["ref_text left out of 2 x_vector_only rows: they clone from the reference's speaker "
                              "embedding alone, which reads no transcript"]


def test_a_blank_instruct_or_ref_text_option_is_none_as_a_blank_cell_is(tmp_path, monkeypatch):
    """Whitespace alone in --instruct or --ref-text, as in an instruct or ref_text cell, gives none: the same
    rows, ledger keys included, as the option left empty."""
    monkeypatch.chdir(tmp_path)
    sf.write(tmp_path / "me.wav", tone(24000, 1.5), 24000, subtype="PCM_16")
    (tmp_path / "corpus.txt").write_text("One line to speak.\n")
    pq.write_table(pa.table({"text": ["One line to speak."], "instruct": [" \t "]}), tmp_path / "cells.parquet")
    voice_design = ["--model", str(BASE_MODEL.parent / "tiny-1.7b-voicedesign")]
    clone = ["--model", str(BASE_MODEL), "--ref-audio", "me.wav", "--x-vector-only"]
    runs = {"designed": ("corpus.txt", [*voice_design, "--instruct", ""]),
            "designed blank": ("corpus.txt", [*voice_design, "--instruct", " \t "]),
            "designed blank cell": ("cells.parquet", voice_design),
            "cloned": ("corpus.txt", [*clone, "--ref-text", ""]),
            "cloned blank": ("corpus.txt", [*clone, "--ref-text", " \t "])}
    params = {}
    for out, (manifest, options) in runs.items():
        result = runner.invoke(cli.app, ["synth", manifest, "--out", out, "--no-wer", "--max-frames", "2", *options])
        assert result.exit_code == 0, (out, result.output)
        [entry] = [json.loads(line) for line in (tmp_path / out / "ledger.jsonl").read_text().splitlines()]
        params[out] = (entry["key"], entry["params"].get("instruct"), entry["params"].get("ref_text"))
    assert params["designed"] == params["designed blank"] == params["designed blank cell"]
    assert params["cloned"] == params["cloned blank"] and params["designed"][1:] == (None, None)


def test_a_transcript_goes_with_the_reference_of_its_own_row(tmp_path, monkeypatch):
    """--ref-text is --ref-audio's transcript: a row with a reference of its own does not take it (a
    transcript of another file would clone its voice from the wrong words), and a row's own ref_text
    does not go with --ref-audio."""
    monkeypatch.chdir(tmp_path)
    for name in ("me.wav", "own.wav"):
        sf.write(tmp_path / name, tone(24000, 1.5), 24000, subtype="PCM_16")
    pq.write_table(pa.table({"id": ["default", "own", "own-text", "own-both"],
                             "text": ["One.", "Two.", "Three.", "Four."],
                             "ref_audio": [None, "own.wav", None, "own.wav"],
                             "ref_text": [None, None, "Words of its own.", "Words of own.wav."]}), tmp_path / "m.parquet")
    rows = read_manifest(tmp_path / "m.parquet", RowDefaults(None, "auto", 0, ref_audio="me.wav",
                                                             ref_text="Words of me.wav.")).rows
    assert [(r.request.ref_audio, r.request.ref_text) for r in rows] == [
        (str(tmp_path / "me.wav"), "Words of me.wav."), (str(tmp_path / "own.wav"), None),
        (str(tmp_path / "me.wav"), "Words of its own."), (str(tmp_path / "own.wav"), "Words of own.wav.")]
    assert [r.problem for r in rows] == [
        None, "ICL voice cloning (x_vector_only false) needs ref_text, the reference's transcript; give it, or set "
              "x_vector_only to clone from the speaker embedding alone",
        "ref_text without ref_audio in its row: a row's transcript is of its own reference, and this row takes "
        "--ref-audio's (whose transcript is --ref-text)", None]


def test_x_vector_only_goes_with_the_reference_of_its_own_row(tmp_path, monkeypatch):
    """--x-vector-only says how to clone --ref-audio: a row with a reference and transcript of its own
    stays an ICL clone (it would lose its transcript), and takes x-vector mode only from its own column."""
    monkeypatch.chdir(tmp_path)
    for name in ("me.wav", "own.wav"):
        sf.write(tmp_path / name, tone(24000, 1.5), 24000, subtype="PCM_16")
    pq.write_table(pa.table({"id": ["default", "own-both", "own-x"], "text": ["One.", "Two.", "Three."],
                             "ref_audio": [None, "own.wav", "own.wav"],
                             "ref_text": [None, "Words of own.wav.", None],
                             "x_vector_only": pa.array([None, None, True], pa.bool_())}), tmp_path / "m.parquet")
    rows = read_manifest(tmp_path / "m.parquet", RowDefaults(None, "auto", 0, ref_audio="me.wav",
                                                             x_vector_only=True)).rows
    assert [(r.problem, r.request.x_vector_only, r.request.ref_text) for r in rows] == [
        (None, True, None), (None, False, "Words of own.wav."), (None, True, None)]


def test_cli_options_give_every_row_the_voice_and_its_ledger_key(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    sf.write(tmp_path / "me.flac", tone(24000, 1.5), 24000)
    (tmp_path / "corpus.txt").write_text("One line to speak.\nAnother line.\n")
    result = runner.invoke(cli.app, ["synth", "corpus.txt", "--out", "out", "--model", str(BASE_MODEL), "--no-wer",
                                     "--ref-audio", "me.flac", "--x-vector-only", "--max-frames", "2"])
    assert result.exit_code == 0, result.output
    rows = json.loads((tmp_path / "out" / "report.json").read_text())["rows"]
    assert [(row["error"], row["frames"]) for row in rows] == [(None, 2), (None, 2)]
    ledger = [json.loads(line) for line in (tmp_path / "out" / "ledger.jsonl").read_text().splitlines()]
    sha = hashlib.sha256((tmp_path / "me.flac").read_bytes()).hexdigest()
    assert [(entry["params"]["ref_audio_sha256"], entry["params"]["x_vector_only"]) for entry in ledger] == \
        [(sha, True)] * 2


def _key(request: Request) -> str:
    return plan_row(ManifestRow(0, request), "x.wav", JobSettings()).key


def test_ledger_key_follows_the_reference_content_not_its_path(tmp_path):
    clone = Request(id="r", text="Words.", speaker="vivian", ref_audio="/a/me.wav", ref_audio_sha256="1" * 64,
                    ref_text="Mine.")
    moved = Request(**{**clone.__dict__, "ref_audio": "/b/me.wav"})
    edited = Request(**{**clone.__dict__, "ref_audio_sha256": "2" * 64})
    retold = Request(**{**clone.__dict__, "ref_text": "Other words."})
    by_embedding = Request(**{**clone.__dict__, "x_vector_only": True})
    assert _key(moved) == _key(clone)
    assert len({_key(clone), _key(edited), _key(retold), _key(by_embedding)}) == 4
    plain = Request(id="r", text="Words.", speaker="vivian")
    params = plan_row(ManifestRow(0, plain), "x.wav", JobSettings()).params
    assert not {"ref_audio_sha256", "ref_text", "x_vector_only"} & set(params)   # keys of earlier runs still match


def test_split_rows_keep_their_voice():
    request = Request(id="r", text="One sentence here. " * 30, speaker="vivian", ref_audio="/a/me.wav",
                      ref_audio_sha256="1" * 64, ref_text="Mine.", x_vector_only=False, seed=5)
    segments = segment_requests(request, 100)
    assert len(segments) > 2
    assert {(s.ref_audio, s.ref_audio_sha256, s.ref_text, s.x_vector_only) for s in segments} == {
        ("/a/me.wav", "1" * 64, "Mine.", False)}
    assert [s.id for s in segments[:2]] == ["r#1", "r#2"] and segments[1].seed != segments[0].seed


@pytest.mark.parametrize("columns, message", [
    ({"text": ["a"], "ref_audio": [3]}, "column 'ref_audio' has type int64; expected string \\(a path\\)"),
    ({"text": ["a"], "ref_text": [1.5]}, "column 'ref_text' has type double; expected string"),
    ({"text": ["a"], "x_vector_only": ["yes"]},
     "column 'x_vector_only' has type string; expected boolean, or numbers 1 and 0"),
])
def test_voice_columns_of_the_wrong_type_fail_the_file(tmp_path, columns, message):
    path = tmp_path / "m.parquet"
    pq.write_table(pa.table(columns), path)
    with pytest.raises(TTSError, match=f"m\\.parquet: {message}"):
        read_manifest(path, RowDefaults("vivian", "auto", 0))


def test_columns_as_pandas_writes_them(tmp_path):
    """A category column is dictionary-encoded; an integer column with nulls becomes floats."""
    pd = pytest.importorskip("pandas")
    sf.write(tmp_path / "me.wav", tone(24000, 1.5), 24000, subtype="PCM_16")
    pd.DataFrame({"text": ["One.", "Two.", "Three."], "ref_audio": pd.Categorical(["me.wav", "me.wav", "me.wav"]),
                  "x_vector_only": [1, None, 0.5], "ref_text": [None, "Words.", None],
                  "speaker": pd.Categorical(["a", None, "b"])}).to_parquet(tmp_path / "m.parquet")
    rows = read_manifest(tmp_path / "m.parquet", RowDefaults(None, "auto", 0)).rows
    assert [(r.request.ref_audio, r.request.x_vector_only, r.request.ref_text, r.request.speaker) for r in rows] == [
        (str(tmp_path / "me.wav"), True, None, "a"), (str(tmp_path / "me.wav"), False, "Words.", None),
        (str(tmp_path / "me.wav"), False, None, "b")]
    assert [r.problem for r in rows] == [None, None, "x_vector_only must be true or false (or 1 or 0), got 0.5"]


def test_null_cells_take_the_option_defaults(tmp_path):
    sf.write(tmp_path / "default.wav", tone(24000, 1.5), 24000, subtype="PCM_16")
    sf.write(tmp_path / "own.wav", tone(16000, 1.5), 16000, subtype="PCM_16")
    path = tmp_path / "m.parquet"
    pq.write_table(pa.table({"text": ["a", "b"], "ref_audio": [None, "own.wav"],
                             "x_vector_only": pa.array([None, False], pa.bool_()),
                             "ref_text": [None, "Own words."]}), path)
    cwd = os.getcwd()
    defaults = RowDefaults("vivian", "auto", 0, ref_audio=str(tmp_path / "default.wav"), x_vector_only=True)
    rows = read_manifest(path, defaults).rows
    assert os.getcwd() == cwd
    assert [(r.problem, Path(r.request.ref_audio).name, r.request.x_vector_only, r.request.ref_text) for r in rows] == [
        (None, "default.wav", True, None), (None, "own.wav", False, "Own words.")]


def test_help_shows_the_voice_options_and_the_reference_limits():
    result = runner.invoke(cli.app, ["synth", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    help_text = " ".join(result.output.split())
    for option in ("--ref-audio FILE", "--ref-text TEXT", "--x-vector-only", "--instruct TEXT"):
        assert option in help_text
    assert "A reference must be 1 to 60 s of audio (the official code sets no maximum" in help_text
    assert "ref_audio, ref_text, x_vector_only" in help_text


def test_a_changed_reference_file_is_a_changed_row_on_resume(tmp_path, monkeypatch):
    from fakes import use_fake_synthesizer

    fake = use_fake_synthesizer(monkeypatch, tmp_path)
    fake.validate = lambda request: None   # a CustomVoice fake: it would refuse a clone's row, which names no speaker
    monkeypatch.chdir(tmp_path)
    sf.write(tmp_path / "me.wav", tone(24000, 1.5), 24000, subtype="PCM_16")
    (tmp_path / "corpus.txt").write_text("a\tFirst line.\nb\tSecond line.\n")
    args = ["synth", "corpus.txt", "--out", "out", "--model", str(BASE_MODEL), "--ref-audio", "me.wav",
            "--ref-text", "Me."]
    assert runner.invoke(cli.app, args).exit_code == 0
    (tmp_path / "moved").mkdir()
    os.replace(tmp_path / "me.wav", tmp_path / "moved" / "me.wav")
    moved = runner.invoke(cli.app, args[:-4] + ["--ref-audio", "moved/me.wav", "--ref-text", "Me."])
    assert moved.exit_code == 0 and "2 rows ok (2 from an earlier run)" in moved.output   # same bytes, same rows

    sf.write(tmp_path / "moved" / "me.wav", tone(24000, 1.5, 0.2), 24000, subtype="PCM_16")
    changed = runner.invoke(cli.app, args[:-4] + ["--ref-audio", "moved/me.wav", "--ref-text", "Me."])
    assert changed.exit_code == 2
    assert "2 rows were made before with other text or settings" in changed.stderr
    assert "ref_audio_sha256" in changed.stderr
