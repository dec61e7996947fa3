"""WER inside `tts synth`: every row goes to the ASR worker processes as soon as its output is
written (the rows resumed from an earlier run as soon as the run has planned), so that ASR runs
beside synthesis; the transcripts are gathered at the end into the WER section of report.json /
report.md and into rows.parquet, with the same protocol, metrics and flags as `tts score`.
"""
from __future__ import annotations

from pathlib import Path
from time import perf_counter

import numpy as np

from ..output.formats import file_extension
from ..output.report import RowRecord
from .asr import COMPUTE_TYPE, TRANSCRIBE_OPTIONS, AsrModelChoice, AudioSource
from .asr_pool import AsrPool, NotHeard
from .scoring import ScoredRow, apply_transcripts, build_report, flagged_rows, not_scored_rows, worst_rows


class SynthWer:
    def __init__(self, asr: AsrModelChoice, workers: int, out_dir: Path, output_format: str):
        self.asr, self.workers = asr, workers
        self.out_dir, self.output_format = Path(out_dir), output_format
        self.pool = AsrPool(asr.path, workers=workers, start_now=True)  # loads while the TTS model loads
        self._shard: tuple[str | None, dict[str, bytes]] = (None, {})
        self._unread: dict[str, str] = {}   # row id -> why its output could not be read back

    def feed(self, record: RowRecord, audio: np.ndarray | None = None, sample_rate: int | None = None) -> None:
        """A finished row: its audio in memory, or else its output named by record.file (an audio
        file, or the parquet shard that holds the row)."""
        source: AudioSource
        if audio is not None:
            source = (audio, sample_rate, file_extension(self.output_format).upper())
        elif self.output_format == "parquet":
            try:
                source = self._audio_in_shard(record.file, record.request.id)
            except Exception as e:   # a damaged or edited shard: this row fails its WER, the others go on
                self._unread[record.request.id] = f"cannot read its audio from {record.file}: {type(e).__name__}: {e}"
                return
        else:
            source = self.out_dir / record.file
        self.pool.submit(record.request.id, source, record.request.text, record.request.language)

    def _audio_in_shard(self, shard: str, row_id: str) -> bytes:
        """The row's FLAC bytes from its shard (one shard kept in memory: resumed rows come in order)."""
        if self._shard[0] != shard:
            import pyarrow.parquet as pq
            table = pq.read_table(self.out_dir / shard, columns=["id", "audio"]).to_pydict()
            self._shard = (shard, {i: a["bytes"] for i, a in zip(table["id"], table["audio"])})
        return self._shard[1][row_id]

    def finish(self, records: list[RowRecord], skipped_empty: int) -> tuple[dict, list[dict]]:
        """Waits for the ASR; returns the report's WER section and the rows of rows.parquet (one per record)."""
        start = perf_counter()
        heard = {**self.pool.results(), **self._unread}
        unheard = [result for result in heard.values() if isinstance(result, NotHeard)]
        self.unheard, self.unheard_why = len(unheard), "; ".join(dict.fromkeys(unheard)) or None   # each cause once
        self.heard = len(heard) - len(unheard)
        wait_seconds = perf_counter() - start
        # a row a stopped run left for the rerun is not scored, not failed
        rows = [ScoredRow(r.row_number, r.request.id, r.request.text, r.request.language, file=r.file,
                          frames=r.frames, seconds=r.audio_seconds, hit_cap=r.hit_cap,
                          error=None if r.not_synthesized else r.error,
                          not_scored=r.error if r.not_synthesized else None) for r in records]
        apply_transcripts(rows, heard, key=lambda row: row.id)   # ids of rows that ran are unique
        report = build_report(rows, {"settings": {
            "ASR model": str(self.asr.path), "ASR model source": self.asr.source,
            "ASR settings": dict(TRANSCRIBE_OPTIONS, compute_type=COMPUTE_TYPE), "ASR workers": self.workers,
            "ASR wait after synthesis (s)": round(wait_seconds, 3)}}, skipped_empty)
        scored = report.pop("rows")
        report.update(worst_rows=worst_rows(scored), flagged_rows=flagged_rows(scored),
                      not_scored_rows=not_scored_rows(scored))
        return report, scored

    def unheard_note(self) -> str | None:
        """After finish: the report's note on the rows made that the ASR did not hear, or None.
        (Rows never synthesized are not scored either: the WER summary counts those too.)"""
        if not self.unheard:
            return None
        if not self.heard:
            return f"WER not computed: none of the {self.unheard} rows made was heard ({self.unheard_why})"
        return f"WER covers part of the run: {self.unheard} of the rows made were not scored ({self.unheard_why})"

    def close(self) -> None:
        self.pool.close()

