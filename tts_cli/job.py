"""One `tts synth` run after the model is loaded: validate rows, synthesize in batches, write WAVs.

A row that cannot be synthesized becomes a failed RowRecord with the error message; the rest go on.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from time import perf_counter
from typing import Callable

from .errors import RequestError, TTSError
from .output.report import RowRecord
from .output.writer import wav_names, write_wav
from .request import Request, Result


@dataclass
class PendingRow:
    record: RowRecord
    wav_name: str


def validate_rows(synth, requests: list[Request]) -> tuple[list[RowRecord], list[PendingRow]]:
    """All rows as records (invalid ones already failed), and the valid ones still to synthesize.

    WAV names are assigned over every row, so a row's file name depends only on the manifest.
    """
    records, pending = [], []
    for request, name in zip(requests, wav_names([request.id for request in requests])):
        record = RowRecord(request)
        records.append(record)
        try:
            synth.validate(request)
        except RequestError as e:
            record.error = str(e)
        else:
            pending.append(PendingRow(record, name))
    return records, pending


def synthesize_rows(synth, pending: list[PendingRow], out_dir: Path, *, batch_size: int, greedy: bool,
                    max_frames: int | None, on_batch_done: Callable[[list[RowRecord]], None]) -> float:
    """Synthesize and write every pending row, batch by batch; returns the wall seconds taken."""
    start = perf_counter()
    for first in range(0, len(pending), batch_size):
        batch = pending[first:first + batch_size]
        batch_start = perf_counter()
        outcomes = _synthesize_isolating_errors(synth, [row.record.request for row in batch], greedy, max_frames)
        batch_seconds = perf_counter() - batch_start
        for row, outcome in zip(batch, outcomes):
            row.record.wall_seconds = batch_seconds
            if isinstance(outcome, TTSError):
                row.record.error = str(outcome)
            else:
                _write_row(row, outcome, out_dir, synth.sample_rate)
        on_batch_done([row.record for row in batch])
    return perf_counter() - start


def _synthesize_isolating_errors(synth, requests: list[Request], greedy: bool,
                                 max_frames: int | None) -> list[Result | TTSError]:
    """One Result per request; when a batch fails with a TTSError, its rows are retried one by one
    so that only the row at fault fails."""
    try:
        results = synth.synthesize(requests, greedy=greedy, max_frames=max_frames)
    except TTSError as e:
        if len(requests) == 1:
            return [e]
        return [outcome for request in requests
                for outcome in _synthesize_isolating_errors(synth, [request], greedy, max_frames)]
    if len(results) != len(requests):
        raise RuntimeError(f"synthesize returned {len(results)} results for {len(requests)} requests")
    return results


def _write_row(row: PendingRow, result: Result, out_dir: Path, sample_rate: int) -> None:
    record = row.record
    try:
        write_wav(out_dir / row.wav_name, result.audio, sample_rate)
    except OSError as e:
        record.error = f"cannot write {out_dir / row.wav_name}: {e}"
        return
    record.file = row.wav_name
    record.frames = result.frames
    record.audio_seconds = len(result.audio) / sample_rate
    record.hit_cap = result.hit_cap
