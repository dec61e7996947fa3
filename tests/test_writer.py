"""WAV file names from row ids, and atomic WAV writes."""
import numpy as np
import pytest
import soundfile as sf

from tts_cli.errors import OutputError
from tts_cli.output.writer import sanitize_id, wav_names, write_atomically, write_audio, write_wav


@pytest.mark.parametrize("row_id, stem", [
    ("000001", "000001"),
    ("../x", "___x"),
    ("a/b", "a_b"),
    ("a\\b", "a_b"),
    ("..", "__"),
    (".hidden", "_hidden"),
    ("v1.2-final_take", "v1.2-final_take"),
    ("héllo wörld", "h_llo_w_rld"),
    ("", "_"),
])
def test_sanitize_id_keeps_safe_characters_only(row_id, stem):
    assert sanitize_id(row_id) == stem


def test_sanitize_id_caps_length():
    assert len(sanitize_id("x" * 1000)) == 200


def test_colliding_ids_get_distinct_names_in_order():
    assert wav_names(["a/b", "a_b", "A_B", "a_b_2", "c"]) == [
        "a_b.wav", "a_b_2.wav", "A_B_3.wav", "a_b_2_2.wav", "c.wav"]


def test_write_wav_is_16_bit_at_the_given_rate_and_leaves_no_temp_file(tmp_path):
    audio = (0.5 * np.sin(np.linspace(0, 100, 3840))).astype(np.float32)
    write_wav(tmp_path / "x.wav", audio, 24000)
    info = sf.info(tmp_path / "x.wav")
    assert (info.samplerate, info.frames, info.subtype, info.format) == (24000, 3840, "PCM_16", "WAV")
    decoded, _ = sf.read(tmp_path / "x.wav", dtype="float32")
    assert np.abs(decoded - audio).max() < 1e-4
    assert [p.name for p in tmp_path.iterdir()] == ["x.wav"]


def test_wav_and_flac_hold_the_same_samples_rounded_to_the_nearest(tmp_path):
    """One conversion to 16 bits for every format (libsndfile floors a float sample for WAV and rounds
    it for FLAC): a row's samples do not depend on --format."""
    rng = np.random.default_rng(0)
    audio = np.concatenate([np.clip(0.3 * rng.standard_normal(20000), -1, 1),
                            [1.0, -1.0, 1.2, -1.2, 0.6 / 32768, 1.6 / 32768, -0.6 / 32768]]).astype(np.float32)
    write_audio(tmp_path / "x.wav", audio, 24000, "WAV")
    write_audio(tmp_path / "x.flac", audio, 24000, "FLAC")
    wav, flac = (sf.read(tmp_path / name, dtype="int16")[0] for name in ("x.wav", "x.flac"))
    assert np.array_equal(wav, flac)
    assert list(wav[-7:]) == [32767, -32768, 32767, -32768, 1, 2, -1]
    with pytest.raises(ValueError, match="1 of its 3 samples are NaN"):
        write_audio(tmp_path / "nan.wav", np.array([0.1, np.nan, np.inf], np.float32), 24000)
    assert not (tmp_path / "nan.wav").exists()
    inside = np.abs(audio) < 32767 / 32768   # (1.0 itself is clipped to 32767)
    assert np.abs(wav[inside] / 32768 - audio[inside]).max() <= 0.5 / 32768 + 1e-9


def test_failed_write_keeps_the_old_file_and_removes_the_temp_file(tmp_path):
    target = tmp_path / "r.json"
    target.write_text("old")

    def half_write(tmp):
        tmp.write_text("half")
        raise OSError("disk full")

    with pytest.raises(OutputError, match=f"cannot write {target}: disk full"):
        write_atomically(target, half_write)
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]


def test_interrupted_write_keeps_the_old_file_removes_the_temp_file_and_passes_the_interrupt_on(tmp_path):
    """Ctrl-C mid-write (tts bench rewrites its --json after each level): not an OutputError, and no
    .NAME.PID.tmp left beside the file. Only a SIGKILL, which runs no cleanup, leaves one."""
    target = tmp_path / "r.json"
    target.write_text("old")

    def interrupted(tmp):
        tmp.write_text("half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_atomically(target, interrupted)
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]


def test_write_wav_into_missing_folder_raises_output_error(tmp_path):
    with pytest.raises(OutputError, match="No such file or directory"):
        write_wav(tmp_path / "missing" / "x.wav", np.zeros(10, np.float32), 24000)
