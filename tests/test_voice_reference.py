"""Reference audio: loading as the official code does (librosa.load + librosa.resample, soxr HQ),
content hashes, and each reason a file cannot be a reference."""
import hashlib
import os

import numpy as np
import pytest
import soundfile as sf

from tts_cli.voice.reference_audio import (ReferenceAudioError, check_reference, load_reference,
                                           resolve_reference_path)


def signal(sample_rate: int, channels: int, seconds: float = 1.25) -> np.ndarray:
    t = np.arange(int(sample_rate * seconds)) / sample_rate
    left = 0.4 * np.sin(2 * np.pi * 220 * t) + 0.1 * np.sin(2 * np.pi * 3100 * t)
    right = 0.3 * np.sin(2 * np.pi * 330 * t + 0.5)
    return np.stack([left, right][:channels], axis=1)


# What the official code's loading gives for these files: `librosa.load(path, sr=None, mono=True)`
# then `librosa.resample(y, orig_sr=sr, target_sr=24000)`, run with librosa 0.11.0 and soxr 1.1.0
# on 2026-12-03: (samples, sum, sum of squares, samples at indexes 0, 1, 100, 12345, last).
LIBROSA_GOLDEN = {
    (44100, 2, "WAV"): (30001, 2.6474015885032713, 974.2155092269422,
                        [0.05877722427248955, 0.13537275791168213, -0.08278503268957138, 0.017023101449012756, 0.0]),
    (16000, 1, "FLAC"): (30000, 0.001869475468993187, 2550.000666651085,
                         [0.0018802136182785034, 0.08353905379772186, -0.24998489022254944, 0.3027932643890381,
                          -0.08353899419307709]),
}


@pytest.mark.parametrize("sample_rate, channels, audio_format", list(LIBROSA_GOLDEN))
def test_loading_matches_librosa_load_and_resample(tmp_path, sample_rate, channels, audio_format):
    path = tmp_path / f"ref.{audio_format.lower()}"
    sf.write(path, signal(sample_rate, channels), sample_rate, subtype="PCM_16", format=audio_format)
    reference = load_reference(str(path))
    samples, total, energy, values = LIBROSA_GOLDEN[(sample_rate, channels, audio_format)]
    wave = reference.waveform
    assert wave.dtype == np.float32 and wave.shape == (samples,)   # 44.1 kHz: librosa's ceil gives 30001, not 30000
    assert float(wave.astype(np.float64).sum()) == pytest.approx(total, rel=1e-6, abs=1e-6)
    assert float((wave.astype(np.float64) ** 2).sum()) == pytest.approx(energy, rel=1e-6)
    assert [float(wave[i]) for i in (0, 1, 100, 12345, samples - 1)] == pytest.approx(values, abs=1e-7)
    assert (reference.source_sample_rate, reference.channels) == (sample_rate, channels)
    assert reference.sha256 == hashlib.sha256(path.read_bytes()).hexdigest() == check_reference(str(path))


def test_24khz_mono_is_taken_as_read_and_stereo_is_the_channel_mean(tmp_path):
    stereo = signal(24000, 2)
    sf.write(tmp_path / "s.wav", stereo, 24000, subtype="FLOAT")
    sf.write(tmp_path / "m.wav", stereo[:, 0], 24000, subtype="FLOAT")
    expected = stereo.astype(np.float32).mean(axis=1, dtype=np.float32)
    assert np.array_equal(load_reference(str(tmp_path / "s.wav")).waveform, expected)
    assert np.array_equal(load_reference(str(tmp_path / "m.wav")).waveform, stereo[:, 0].astype(np.float32))


@pytest.mark.parametrize("audio_format", ["OGG", "MP3"])
def test_compressed_formats_that_libsndfile_reads(tmp_path, audio_format):
    if audio_format not in sf.available_formats():
        pytest.skip(f"this libsndfile reads no {audio_format}")
    path = tmp_path / f"ref.{audio_format.lower()}"
    sf.write(path, signal(48000, 1, 1.5), 48000, format=audio_format)
    reference = load_reference(str(path))
    assert reference.source_sample_rate == 48000
    assert reference.seconds == pytest.approx(1.5, abs=0.06)   # mp3 frames pad the end


def test_relative_paths_start_from_the_given_folder(tmp_path):
    assert resolve_reference_path("a/../b.wav", tmp_path / "m") == str(tmp_path / "m" / "b.wav")
    assert resolve_reference_path("../refs/b.wav", tmp_path / "m") == str(tmp_path / "refs" / "b.wav")
    assert resolve_reference_path(str(tmp_path / "x.wav"), tmp_path / "m") == str(tmp_path / "x.wav")


def _write(path, data, sample_rate=24000, subtype="PCM_16"):
    sf.write(path, data, sample_rate, subtype=subtype)
    return path


def test_each_bad_file_names_its_reason(tmp_path):
    good = _write(tmp_path / "good.wav", signal(24000, 1)[:, 0])
    nan = signal(24000, 1)[:, 0].astype(np.float32)
    nan[4800] = np.nan
    cases = {
        tmp_path / "missing.wav": "reference file not found",
        tmp_path: "is a directory, not an audio file",
        tmp_path / "empty.wav": "is empty (0 bytes)",
        _write(tmp_path / "zero.wav", np.zeros(0)): "holds no samples",
        tmp_path / "text.wav": "not audio that libsndfile reads (wav, flac, ogg, mp3, ...): Format not recognised",
        tmp_path / "cut.wav": "not audio that libsndfile reads",
        _write(tmp_path / "silence.wav", np.zeros(48000)): "silent (digital silence",
        _write(tmp_path / "quiet.wav", 3e-3 * signal(24000, 1)[:, 0], subtype="FLOAT"): "silent (RMS -61.2 dBFS",
        _write(tmp_path / "short.wav", signal(24000, 1, 0.5)[:, 0]): "is 0.50 s long, shorter than 1 s",
        _write(tmp_path / "long.wav", signal(8000, 1, 60.5)[:, 0], 8000): "is 60.50 s long, longer than 60 s",
        _write(tmp_path / "nan.wav", nan, subtype="FLOAT"): "non-finite samples (NaN or infinity; first at 0.200 s)",
        _write(tmp_path / "low.wav", signal(4000, 1, 2)[:, 0], 4000): "sampled at 4000 Hz, below 8000 Hz",
    }
    (tmp_path / "empty.wav").write_bytes(b"")
    (tmp_path / "text.wav").write_text("not audio at all\n" * 20)
    (tmp_path / "cut.wav").write_bytes(good.read_bytes()[:20])
    # Just inside each limit: quiet but above -60 dBFS, 1 s, 60 s, 8 kHz.
    for name, data, rate in [("soft.wav", 4e-3 * signal(24000, 1)[:, 0], 24000),
                             ("1s.wav", signal(24000, 1, 1.0)[:, 0], 24000),
                             ("60s.wav", signal(8000, 1, 60.0)[:, 0], 8000), ("8k.wav", signal(8000, 1)[:, 0], 8000)]:
        assert len(check_reference(str(_write(tmp_path / name, data, rate, "FLOAT")))) == 64
    for path, reason in cases.items():
        with pytest.raises(ReferenceAudioError) as caught:
            load_reference(str(path))
        assert reason in str(caught.value) and str(path) in str(caught.value), (path, caught.value)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_unreadable_file(tmp_path):
    path = _write(tmp_path / "locked.wav", signal(24000, 1)[:, 0])
    path.chmod(0)
    with pytest.raises(ReferenceAudioError, match="reference file unreadable: .*locked.wav: Permission denied"):
        check_reference(str(path))


def test_an_over_long_file_is_refused_from_its_header_without_decoding(tmp_path, monkeypatch):
    path = _write(tmp_path / "hour.wav", np.zeros(8000 * 90, dtype=np.float32) + 0.1, 8000)
    monkeypatch.setattr(sf.SoundFile, "read", lambda *args, **kwargs: pytest.fail("decoded the samples"))
    with pytest.raises(ReferenceAudioError, match="is 90.00 s long, longer than 60 s"):
        check_reference(str(path))


def _without_length(flac: bytes) -> bytes:
    """The FLAC with its STREAMINFO's total samples 0 ("unknown"), as an encoder writing to a pipe leaves it."""
    data = bytearray(flac)
    assert data[:4] == b"fLaC" and data[4] & 0x7F == 0   # the first metadata block: STREAMINFO, from byte 8
    data[8 + 13] &= 0xF0
    data[8 + 14:8 + 18] = bytes(4)
    return bytes(data)


def test_a_flac_whose_header_gives_no_length_is_refused_with_that_reason(tmp_path):
    good = _write(tmp_path / "good.flac", signal(16000, 1, 2.0)[:, 0], 16000)
    streamed = tmp_path / "streamed.flac"
    streamed.write_bytes(_without_length(good.read_bytes()))
    with sf.SoundFile(streamed) as audio:
        assert audio.frames == 2 ** 63 - 1   # libsndfile's "unknown"
    with pytest.raises(ReferenceAudioError, match=r"streamed.flac gives no length in its header \(a FLAC written "
                                                  r"to a pipe\?\): write it again as a file, e.g. as WAV"):
        check_reference(str(streamed))
    assert load_reference(str(good)).waveform.shape == (48000,)


def test_a_length_just_past_a_limit_never_reads_as_within_it():
    from tts_cli.voice.reference_audio import check_length
    for seconds, said in ((0.99996, "is 0.99 s long, shorter than 1 s"), (60.001, "is 60.01 s long, longer than 60 s")):
        with pytest.raises(ReferenceAudioError, match=said):
            check_length(seconds, "r.wav")
