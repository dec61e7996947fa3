"""The reference cache: each distinct reference encoded once per output folder, kept across runs."""
import os
import stat
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch

from tts_cli.output.writer import write_wav
from tts_cli.voice.cache import CACHE_DIR_NAME, ReferenceCache
from tts_cli.voice.reference_audio import ReferenceAudioError, check_reference


class CountingEncoder:
    """encode(waveform_24k) -> (speaker embedding, codes) made from the waveform, counting calls."""

    def __init__(self):
        self.calls = []

    def __call__(self, waveform):
        self.calls.append(len(waveform))
        frames = len(waveform) // 1920
        embedding = torch.tensor([waveform.mean(), waveform.std(), float(len(waveform))], dtype=torch.float32)
        codes = torch.arange(frames * 16, dtype=torch.int64).reshape(frames, 16) % 2048
        return embedding, codes


@pytest.fixture
def references(tmp_path):
    """Two distinct reference files and the SHA-256 of each."""
    paths = {}
    for name, freq, seconds in [("a.wav", 220, 1.5), ("b.flac", 330, 2.0)]:
        t = np.arange(int(48000 * seconds)) / 48000
        sf.write(tmp_path / name, 0.3 * np.sin(2 * np.pi * freq * t), 48000)
        paths[name] = (str(tmp_path / name), check_reference(str(tmp_path / name)))
    return paths


def test_each_reference_encoded_once_and_resumed_runs_read_the_files(tmp_path, references):
    out = tmp_path / "out"
    encoder = CountingEncoder()
    cache = ReferenceCache(out, encoder, encoder="model-A")
    rows = [references["a.wav"], references["b.flac"], references["a.wav"], references["a.wav"], references["b.flac"]]
    first = [cache.get(path, sha) for path, sha in rows]
    assert encoder.calls == [36000, 48000]            # 1.5 s and 2 s at 24 kHz, once each
    assert cache.summary()["references_encoded"] == 2 and cache.summary()["references_from_cache_files"] == 0
    assert cache.encode_seconds > 0
    files = sorted(p.name for p in (out / CACHE_DIR_NAME).iterdir())
    assert files == sorted(f"{sha}.safetensors" for _, sha in references.values())
    assert first[0] is first[2] and first[0].seconds == 1.5 and first[0].codes.shape == (18, 16)

    resumed_encoder = CountingEncoder()
    resumed = ReferenceCache(out, resumed_encoder, encoder="model-A")
    again = [resumed.get(path, sha) for path, sha in rows]
    assert resumed_encoder.calls == [] and resumed.summary() == {
        "references_encoded": 0, "references_from_cache_files": 2, "reference_encode_seconds": 0.0}
    for old, new in zip(first, again):
        assert torch.equal(old.speaker_embedding, new.speaker_embedding) and torch.equal(old.codes, new.codes)
        assert new.codes.dtype == torch.int64 and new.seconds == old.seconds


def test_another_encoder_or_a_damaged_file_encodes_again(tmp_path, references):
    out = tmp_path / "out"
    path, sha = references["a.wav"]
    ReferenceCache(out, CountingEncoder(), encoder="model-A").get(path, sha)

    other = CountingEncoder()
    ReferenceCache(out, other, encoder="model-B").get(path, sha)
    assert len(other.calls) == 1                       # model-A's embedding is not model-B's

    (out / CACHE_DIR_NAME / f"{sha}.safetensors").write_bytes(b"\x00" * 40)
    repaired = CountingEncoder()
    ReferenceCache(out, repaired, encoder="model-B").get(path, sha)
    assert len(repaired.calls) == 1
    assert len(ReferenceCache(out, CountingEncoder(), encoder="model-B").get(path, sha).codes) == 18


def test_another_checkpoint_in_the_same_folder_or_another_device_is_another_encoder(tmp_path):
    """The tag holds the checkpoint's fingerprint, not only the folder's path: a checkpoint replaced in
    place encodes again (its cached x-vector would be the old one's voice)."""
    import os
    import shutil
    from pathlib import Path

    from tts_cli.voice.voices import Voices

    model = Path(shutil.copytree(Path(__file__).parent / "fixtures" / "tiny-1.7b-base", tmp_path / "model"))
    tag = Voices(model, tmp_path / "out").encoder_tag
    weights = model / "model.safetensors"
    data = bytearray(weights.read_bytes())
    weights.write_bytes(data)   # the same checkpoint written again: the same voice
    os.utime(weights, ns=(10**18, 10**18))
    assert Voices(model, tmp_path / "out").encoder_tag == tag
    data[len(data) // 2] ^= 0xFF   # another checkpoint of the same shapes: other weights
    weights.write_bytes(data)
    assert Voices(model, tmp_path / "out").encoder_tag != tag
    # encoded on a GPU, a reference's last bits differ from the CPU's: the CPU's cache file is not reused
    tag = Voices(model, tmp_path / "out").encoder_tag
    assert Voices(model, tmp_path / "out", "cuda:1").encoder_tag == tag.replace(" cpu", " cuda") != tag


def test_a_killed_write_leaves_no_cache_file(tmp_path, references, monkeypatch):
    out = tmp_path / "out"
    path, sha = references["a.wav"]

    def killed(tmp, data):
        with open(tmp, "wb") as f:
            f.write(data[:len(data) // 2])
        raise KeyboardInterrupt   # stands for the process dying mid-write

    monkeypatch.setattr(Path, "write_bytes", killed)
    with pytest.raises(KeyboardInterrupt):
        ReferenceCache(out, CountingEncoder(), encoder="m").get(path, sha)
    assert list((out / CACHE_DIR_NAME).iterdir()) == []
    monkeypatch.undo()
    (out / CACHE_DIR_NAME / f".{sha}.safetensors.123.tmp").write_bytes(b"left by a killed process")
    cache = ReferenceCache(out, CountingEncoder(), encoder="m")
    assert list((out / CACHE_DIR_NAME).iterdir()) == []   # its leftovers are removed
    cache.get(path, sha)
    assert cache.encoded == 1 and (out / CACHE_DIR_NAME / f"{sha}.safetensors").is_file()


def test_cache_files_take_the_permissions_of_the_runs_other_outputs(tmp_path, references):
    """Made under the umask, as the audio is: another user resuming a shared folder reads them back."""
    path, sha = references["a.wav"]
    old_umask = os.umask(0o027)
    try:
        ReferenceCache(tmp_path / "out", CountingEncoder(), encoder="m").get(path, sha)
        write_wav(tmp_path / "out" / "row.wav", np.zeros(10, np.float32), 24000)
    finally:
        os.umask(old_umask)
    mode = stat.S_IMODE((tmp_path / "out" / CACHE_DIR_NAME / f"{sha}.safetensors").stat().st_mode)
    assert mode == stat.S_IMODE((tmp_path / "out" / "row.wav").stat().st_mode) == 0o640


def test_a_reference_changed_since_the_manifest_was_read_fails_its_rows(tmp_path, references):
    path, sha = references["a.wav"]
    t = np.arange(48000) / 24000
    sf.write(path, 0.2 * np.sin(2 * np.pi * 500 * t), 24000)
    encoder = CountingEncoder()
    with pytest.raises(ReferenceAudioError, match=f"reference {path} changed while the run was going .*{sha[:12]}"):
        ReferenceCache(tmp_path / "out", encoder, encoder="m").get(path, sha)
    assert encoder.calls == []

