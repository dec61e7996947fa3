"""Rows + what the ASR heard -> per-row WER and flags, the summary, and the score files:
report.json, report.md, report.html (same content) and rows.parquet (one row per manifest row).

`tts score` runs it on existing audio files; the same rows and files serve WER in `tts synth`.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from ..manifest import Manifest
from ..output.report import markdown_cell
from ..output.report_html import flag_counts, write_score_html
from ..output.ledger import LEDGER_NAME, latest_entries
from ..output.writer import wav_names, write_atomically
from .asr import SPLIT_CHARACTER_LANGUAGES, Transcript
from .asr_pool import AsrPool, NotHeard
from .wer import (FLAG_MEANINGS, HIGH_WER, NEAR_SILENT_RMS, PROTOCOL, RowWer, has_unspaced_script, row_wer,
                  slow_rows, summarize)

WORST_ROWS = 10


@dataclass
class ScoredRow:
    row: int                                  # 1-based manifest line or row, as tts synth's report numbers it
    id: str
    text: str
    language: str
    file: str | None = None
    hypothesis: str | None = None
    wer: float | None = None
    errors: int | None = None
    reference_words: int | None = None
    frames: int | None = None                 # known for our own synthesis only
    seconds: float | None = None
    first_audio_seconds: float | None = None  # first-audio latency, known for our own synthesis only
    rms: float | None = None
    hit_cap: bool | None = None
    flags: list[str] = field(default_factory=list)
    not_scored: str | None = None
    error: str | None = None


def apply_transcripts(rows: list[ScoredRow], heard: dict[str, Transcript | str],
                      key: Callable[[ScoredRow], str | None] = lambda row: row.file) -> None:
    """Fill in hypothesis, WER and flags from the ASR results, keyed by key(row) (by default the row's
    file name: unique, unlike ids); rows that already carry an error keep it."""
    for row in rows:
        result = heard.get(key(row))
        if row.error is not None or result is None:
            continue
        if isinstance(result, NotHeard):
            row.not_scored = str(result)
            continue
        if isinstance(result, str):
            row.error = result
            continue
        row.seconds, row.rms = result.seconds, result.rms
        row.hypothesis, row.not_scored = result.hypothesis, result.not_scored
        if row.hypothesis is not None:
            split = result.asr_language in SPLIT_CHARACTER_LANGUAGES or has_unspaced_script(row.text)
            score = row_wer(row.text, row.hypothesis, split, simplified=result.asr_language in ("zh", "yue"))
            if score is None:
                row.not_scored = "the text has no words after normalization"
            else:
                row.wer, row.errors, row.reference_words = score.wer, score.errors, score.reference_words
    for row, slow in zip(rows, slow_rows([r.seconds for r in rows], [r.text for r in rows])):
        row.flags = [name for name, on in (
            ("hit_cap", bool(row.hit_cap)),
            ("slow", slow),
            ("silent", row.rms is not None and row.rms < NEAR_SILENT_RMS),
            ("wer_above_50", row.wer is not None and row.wer > HIGH_WER),
        ) if on]


def build_report(rows: list[ScoredRow], context: dict, skipped_empty: int = 0) -> dict:
    """context: {"title": ..., "settings": {...}}: what was scored and how (files, ASR model),
    printed at the top of report.md."""
    scores = [RowWer(r.wer, r.errors, r.reference_words) for r in rows if r.wer is not None]
    summary = {
        "rows": len(rows),
        "not_scored": sum(r.not_scored is not None and r.error is None for r in rows),
        "failed": sum(r.error is not None for r in rows),
        "skipped_empty": skipped_empty,
        **summarize(scores),
        # hit_cap unknown (None: `tts score` of files it did not make) in every row: no count
        "flagged": {name: None if name == "hit_cap" and all(r.hit_cap is None for r in rows)
                    else sum(name in r.flags for r in rows) for name in FLAG_MEANINGS},
    }
    return {**context, "protocol": PROTOCOL, "flag_meanings": FLAG_MEANINGS, "summary": summary,
            "rows": [asdict(r) for r in rows]}


AUDIO_EXTENSIONS = (".wav", ".flac")  # what `tts synth` writes; other systems' files may be either


def rows_from_manifest(manifest: Manifest, audio_dir: Path) -> list[ScoredRow]:
    """One row per manifest row, with its audio file in audio_dir. In a `tts synth` run's folder only the
    file its ledger names for the row's id is the row's: a folder resumed into, or redone in another
    format, may hold other names and stale files, and the name a row would get may be another row's
    (`_2`, ...), so a row the ledger records as failed, or does not record, has no audio. Elsewhere
    the file is named from the id as our writer names it (sanitized, repeated names `_2`, ...). A row
    without a file or with a manifest problem carries the error."""
    ledger = run_ledger(audio_dir)
    entries = latest_entries(audio_dir) if ledger else None
    rows = []
    for row, wav_name in zip(manifest.rows, wav_names([row.request.id for row in manifest.rows])):
        request = row.request
        scored = ScoredRow(row.number, request.id, request.text, request.language, error=row.problem)
        if entries is None:
            stem = wav_name.removesuffix(".wav")
            names = [stem + ext for ext in AUDIO_EXTENSIONS]
            missing = f"audio file not found: {audio_dir / stem}{{{','.join(AUDIO_EXTENSIONS)}}}"
        else:
            names, missing = _ledger_file(entries.get(request.id), ledger, request.text)
            missing = missing or f"audio file not found: {audio_dir / names[0]}"
        found = [name for name in names if (audio_dir / name).is_file()]
        if found:
            scored.file = found[0]
        elif scored.error is None:
            scored.error = missing
        rows.append(scored)
    return rows


def run_ledger(audio_dir: Path) -> Path | None:
    """The ledger of the `tts synth` run whose folder audio_dir is, which alone names the rows' files there; None
    for another folder."""
    ledger = audio_dir / LEDGER_NAME
    return ledger if ledger.is_file() else None


def _ledger_file(entry: dict | None, ledger: Path, text: str) -> tuple[list[str], str | None]:
    """The row's file as its latest ledger entry names it, or why the row has none to score: also when it was
    made from another text than the manifest's (an edited manifest: its WER would be of other words)."""
    if entry is None:
        return [], f"no audio: {ledger} has no entry for this row (it was not synthesized there)"
    if entry["status"] != "ok":
        return [], f"no audio: {ledger} records this row as failed: {entry.get('error')}"
    made_from = entry.get("params", {}).get("text", text)
    if made_from != text:
        return [], f"no audio of this text: {ledger} records this row as made from another text: {made_from!r}"
    if Path(entry.get("file") or "").suffix not in AUDIO_EXTENSIONS:
        return [], (f"no audio file: {ledger} records this row in {entry.get('file')} (tts score reads "
                    f"{' and '.join(AUDIO_EXTENSIONS)} files)")
    return [entry["file"]], None


def score_audio_dir(audio_dir: Path, rows: list[ScoredRow], asr_model: Path, workers: int) -> list[NotHeard]:
    """Hear every row's file in audio_dir with the ASR model and fill in its WER and flags; returns why
    each row not heard was not (a stop, or an ASR worker that died after some rows were heard)."""
    with AsrPool(asr_model, workers=workers) as pool:
        for row in rows:
            if row.error is None:
                pool.submit(row.file, audio_dir / row.file, row.text, row.language)
        heard = pool.results()
        apply_transcripts(rows, heard)
    return [result for result in heard.values() if isinstance(result, NotHeard)]


def write_score_files(out_dir: Path, report: dict, audio_dir: Path) -> dict[str, Path]:
    """audio_dir: where the rows' files are (report.html links them)."""
    out_dir = Path(out_dir)
    paths = {name: out_dir / name for name in ("report.json", "report.md", "rows.parquet")}
    write_atomically(paths["report.json"], lambda tmp: tmp.write_text(
        json.dumps(report, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"))
    write_atomically(paths["report.md"], lambda tmp: tmp.write_text(render_markdown(report), encoding="utf-8"))
    write_rows_parquet(paths["rows.parquet"], report["rows"])
    paths["report.html"] = write_score_html(out_dir, report, audio_dir)
    return paths


def write_rows_parquet(path: Path, rows: list[dict]) -> None:
    """rows.parquet: one row per manifest row, the ScoredRow fields (asdict)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_pylist(rows, schema=row_schema())
    write_atomically(path, lambda tmp: pq.write_table(table, tmp))


def row_schema():
    """rows.parquet columns: a fixed schema, so that a column of nulls keeps its type."""
    import pyarrow as pa
    types = {"row": pa.int64(), "id": pa.string(), "text": pa.string(), "language": pa.string(),
             "file": pa.string(), "hypothesis": pa.string(), "wer": pa.float64(), "errors": pa.int64(),
             "reference_words": pa.int64(), "frames": pa.int64(), "seconds": pa.float64(),
             "first_audio_seconds": pa.float64(), "rms": pa.float64(), "hit_cap": pa.bool_(),
             "flags": pa.list_(pa.string()), "not_scored": pa.string(), "error": pa.string()}
    return pa.schema(list(types.items()))


def render_markdown(report: dict) -> str:
    rows = report["rows"]
    lines = [f"# {report['title']}", ""]
    lines += [f"- {key}: `{value}`" for key, value in report["settings"].items()]
    lines += [""] + wer_markdown({**report, "worst_rows": worst_rows(rows), "flagged_rows": flagged_rows(rows),
                                  "not_scored_rows": not_scored_rows(rows)}, "##")
    lines += _table("##", "Failed", ("id", "error"), [(r["id"], r["error"]) for r in rows if r["error"]])
    return "\n".join(lines)


def worst_rows(rows: list[dict]) -> list[dict]:
    """The WORST_ROWS scored rows of highest WER, as report rows (dicts)."""
    worst = sorted((r for r in rows if r["wer"] is not None), key=lambda r: -r["wer"])[:WORST_ROWS]
    return [{name: r[name] for name in ("id", "wer", "text", "hypothesis")} for r in worst]


def flagged_rows(rows: list[dict]) -> list[dict]:
    return [{name: r[name] for name in ("id", "flags", "wer", "seconds", "frames")} for r in rows if r["flags"]]


def not_scored_rows(rows: list[dict]) -> list[dict]:
    return [{name: r[name] for name in ("id", "language", "not_scored")}
            for r in rows if r["not_scored"] and not r["error"]]


def wer_markdown(section: dict, level: str) -> list[str]:
    """Summary, protocol, worst rows, flags and not-scored rows of a WER report section (keys summary,
    protocol, flag_meanings, worst_rows, flagged_rows, not_scored_rows), headings at `level` (## or ###)."""
    s = section["summary"]
    lines = [
        f"{level} Summary",
        "",
        "| rows | scored | not scored | failed | empty skipped | mean WER | corpus WER | rows > 50% | mean WER of rows <= 50% |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        f"| {s['rows']} | {s['scored_rows']} | {s['not_scored']} | {s['failed']} | {s['skipped_empty']} "
        f"| {_percent(s['mean_wer'])} | {_percent(s['corpus_wer'])} | {s['rows_above_50']} "
        f"| {_percent(s['mean_wer_of_rows_at_or_below_50'])} |",
        "",
        f"Flagged rows: {flag_counts(s['flagged'])}.",
        "",
        f"{level} Protocol",
        "",
        section["protocol"],
        "",
    ]
    worst = section["worst_rows"]
    lines += _table(level, f"Worst {len(worst)} rows", ("id", "WER", "text", "hypothesis"),
                    [(r["id"], _percent(r["wer"]), r["text"], r["hypothesis"]) for r in worst])
    lines += _table(level, "Flags", ("id", "flags", "WER", "seconds", "frames"),
                    [(r["id"], ", ".join(r["flags"]), _percent(r["wer"]), _number(r["seconds"]), _number(r["frames"]))
                     for r in section["flagged_rows"]])
    lines += [f"- {name}: {meaning}" for name, meaning in section["flag_meanings"].items()] + [""]
    lines += _table(level, "Not scored", ("id", "language", "why"),
                    [(r["id"], r["language"], r["not_scored"]) for r in section["not_scored_rows"]])
    return lines


def _table(level: str, title: str, header: tuple[str, ...], rows: list[tuple]) -> list[str]:
    lines = [f"{level} {title}", ""]
    if not rows:
        return lines + ["none", ""]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(markdown_cell(value) for value in row) + " |" for row in rows]
    return lines + [""]


def _percent(value: float | None) -> str:
    return "" if value is None else f"{100 * value:.1f}%"


def _number(value) -> str:
    if value is None:
        return ""
    return f"{value:.2f}" if isinstance(value, float) else str(value)


