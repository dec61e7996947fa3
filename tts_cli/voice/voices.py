"""The voices of a run's clone rows: each distinct ref_audio encoded once into its speaker embedding
and codes (ReferenceCache, kept in OUT/.references/ for the runs that resume), and attached to its
rows' requests as the VoiceReference the synthesizer takes.

The encoders (the speaker encoder's x-vector and the speech tokenizer's encoder's codes) come from
the Base checkpoint, in float32, and load once per process on the first reference that no cache
file holds: a resumed run whose references are all in OUT/.references loads neither.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from time import perf_counter

import numpy as np
import torch

from ..checkpoint import fingerprint, load_safetensors, open_checkpoint
from ..config_file import read_json
from ..request import Request, VoiceReference
from .cache import ReferenceCache
from .checks import clone_problem


class ReferenceEncoders:
    """encode(waveform_24k) -> (speaker embedding [D] float32, codes [frames, 16] int64), the two
    encoders of a Base checkpoint, loaded on the first call."""

    def __init__(self, model_dir: Path, device: str = "cpu"):
        self.model_dir, self.device = Path(model_dir), device
        self.speaker_encoder = self.codec_encoder = None
        self.load_seconds = 0.0

    def __call__(self, waveform: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        if self.speaker_encoder is None:
            self._load()
        wave = torch.from_numpy(np.ascontiguousarray(waveform, dtype=np.float32))
        return self.speaker_encoder.embed(wave), self.codec_encoder.encode(wave)

    def _load(self) -> None:
        from ..model.codec_encoder import load_codec_encoder
        from ..model.speaker_encoder import CHECKPOINT_PREFIX, load_speaker_encoder

        start = perf_counter()
        config_path = self.model_dir / "config.json"
        self.speaker_encoder = load_speaker_encoder(
            read_json(config_path), load_safetensors(self.model_dir, prefix=CHECKPOINT_PREFIX), config_path,
            device=self.device)
        self.codec_encoder = load_codec_encoder(self.model_dir / "speech_tokenizer", device=self.device)
        self.load_seconds += perf_counter() - start


class Voices:
    """attach(request): a clone row's request with its encoded reference, for a Base checkpoint.
    Rows that do not clone, or whose checkpoint cannot (clone_problem: the synthesizer's row check
    refuses them with the reason), pass unchanged; a bad or changed reference file raises
    ReferenceAudioError (a RequestError: that row fails)."""

    def __init__(self, model_dir: Path, out_dir: Path, device: str = "cpu"):
        self.model_type = open_checkpoint(model_dir).config.model_type
        # The cache's encoder tag: embeddings and codes of another checkpoint are not this one's, nor
        # are those of another checkpoint put into the same folder (its encoders' files differ), nor
        # those encoded on another kind of device (other kernels, other last bits: a run would not
        # give the audio a fresh run on this device gives).
        self.encoder_tag = f"{Path(model_dir).resolve()} {fingerprint(model_dir)} float32 {torch.device(device).type}"
        self.out_dir = Path(out_dir)
        self.encoders = ReferenceEncoders(model_dir, device)
        self.cache: ReferenceCache | None = None   # made on the first clone row (it sweeps the folder)
        self.distinct: set[str] = set()

    def attach(self, request: Request) -> Request:
        if not request.clones_voice or clone_problem(request, self.model_type):
            return request
        if self.cache is None:
            self.cache = ReferenceCache(self.out_dir, self.encoders, self.encoder_tag)
        encoded = self.cache.get(request.ref_audio, request.ref_audio_sha256)
        self.distinct.add(encoded.sha256)
        reference = VoiceReference(encoded.speaker_embedding, None if request.x_vector_only else encoded.codes,
                                   request.ref_text, name=request.ref_audio)
        return replace(request, reference=reference)

    def summary(self) -> dict:
        """For the report: distinct references this run used, how many it encoded and how many it
        read from cache files, and the seconds spent (encode seconds include the encoders' load)."""
        counts = self.cache.summary() if self.cache else {
            "references_encoded": 0, "references_from_cache_files": 0, "reference_encode_seconds": 0.0}
        return {"references_used": len(self.distinct), **counts,
                "reference_encoder_load_seconds": round(self.encoders.load_seconds, 3)}
