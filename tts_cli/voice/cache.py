"""Each distinct reference encoded once per output folder: its speaker embedding and codes are kept
in memory for the run and in OUT/.references/<sha256>.safetensors for the runs that resume it.

The encoders are given as one callable, `encode(waveform_24k) -> (speaker_embedding, codes)`;
a file records which encoder made it (`encoder`, e.g. the checkpoint folder), and a file made by
another encoder, or unreadable, is encoded again and replaced. Files are written atomically
(tts_cli/output/writer.py), so a run killed mid-write leaves either no file or a whole one.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from time import perf_counter
from typing import Callable

import numpy as np
import torch

from ..output.writer import remove_temporary_files, write_atomically
from .reference_audio import ReferenceAudioError, load_reference

CACHE_DIR_NAME = ".references"
Encoder = Callable[[np.ndarray], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class EncodedReference:
    sha256: str
    speaker_embedding: torch.Tensor    # [hidden] float32
    codes: torch.Tensor                # [frames, code groups] int64
    seconds: float                     # the reference's length at 24 kHz


class ReferenceCache:
    """get(path, sha256) -> EncodedReference, encoding a reference only when neither this run nor
    an earlier one into the same folder (with the same encoder) did. Counts what it did, for the
    report: `encoded`, `encode_seconds` (loading, resampling and encoding), `loaded` (from files)."""

    def __init__(self, out_dir: Path, encode: Encoder, encoder: str):
        self.folder = Path(out_dir) / CACHE_DIR_NAME
        self.folder.mkdir(parents=True, exist_ok=True)
        remove_temporary_files(self.folder)   # a killed run's; the folder's run lock is held
        self.encode, self.encoder = encode, encoder
        self._in_memory: dict[str, EncodedReference] = {}
        self.encoded = 0
        self.loaded = 0
        self.encode_seconds = 0.0

    def path_for(self, sha256: str) -> Path:
        return self.folder / f"{sha256}.safetensors"

    def get(self, path: str, sha256: str) -> EncodedReference:
        """The reference whose bytes hashed to sha256 when the manifest was checked. ReferenceAudioError
        when the file has changed since (its row's ledger key would not describe it) or is bad."""
        cached = self._in_memory.get(sha256) or self._read(sha256)
        if cached is None:
            start = perf_counter()
            reference = load_reference(path)
            if reference.sha256 != sha256:
                raise ReferenceAudioError(
                    f"reference {path} changed while the run was going (SHA-256 {sha256[:12]}... when the manifest "
                    f"was read, now {reference.sha256[:12]}...); rerun to use it")
            speaker_embedding, codes = self.encode(reference.waveform)
            cached = EncodedReference(sha256, speaker_embedding.detach().float().cpu().contiguous(),
                                      codes.detach().to(torch.int64).cpu().contiguous(), reference.seconds)
            self._write(cached)
            self.encoded += 1
            self.encode_seconds += perf_counter() - start
        self._in_memory[sha256] = cached
        return cached

    def summary(self) -> dict:
        return {"references_encoded": self.encoded, "references_from_cache_files": self.loaded,
                "reference_encode_seconds": round(self.encode_seconds, 3)}

    def _read(self, sha256: str) -> EncodedReference | None:
        from safetensors import SafetensorError
        from safetensors.torch import safe_open

        path = self.path_for(sha256)
        if not path.is_file():
            return None
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                if meta.get("encoder") != self.encoder or meta.get("sha256") != sha256:
                    return None
                cached = EncodedReference(sha256, f.get_tensor("speaker_embedding"), f.get_tensor("codes"),
                                          float(meta["seconds"]))
        except (SafetensorError, OSError, KeyError, ValueError):
            return None   # damaged or foreign: encoded again and replaced
        self.loaded += 1
        return cached

    def _write(self, reference: EncodedReference) -> None:
        from safetensors.torch import save

        tensors = {"speaker_embedding": reference.speaker_embedding, "codes": reference.codes}
        meta = {"sha256": reference.sha256, "encoder": self.encoder, "seconds": repr(reference.seconds)}
        # Written by Python, as the audio is: safetensors' own save_file makes its files 0600, whatever the umask,
        # and another user resuming the folder could not read them.
        data = save(tensors, metadata=meta)
        write_atomically(self.path_for(reference.sha256), lambda tmp: tmp.write_bytes(data))
