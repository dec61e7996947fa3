"""report.json, report.md and report.html: what each row produced, and the run's totals and settings.

report.md and report.html (tts_cli/output/report_html.py) are rendered from the same dict that
report.json holds, so they always agree.
"""
from __future__ import annotations

import html
import json
import re
from dataclasses import dataclass
from pathlib import Path

from ..request import Request
from .report_html import write_synth_html
from .writer import write_atomically

DEFINITIONS = {
    "xrt": "audio_seconds_this_run / wall_seconds: seconds of audio made per wall-clock second, the same "
           "number as audio_seconds_per_second; above 1 is faster than real time",
    "resumed": "rows whose output an earlier run into this folder made (same text and settings, from the ledger)",
    "segment_frames": "frames of each segment of a row split at sentence or clause boundaries; its segments "
                      "are joined with a 40 ms crossfade",
    "wall_seconds": "run total: synthesis and WAV writing, model loading excluded (see load_seconds); "
                    "per row: seconds from the start of the batch (synthesize call) that made it to its end there, "
                    "added up over the batches of its segments",
    "hit_cap": "the row stopped at its frame cap (--max-frames or the default cap), not at end of speech",
    "references": "voice cloning: references_used, the distinct reference files this run's rows cloned; of those, "
                  "references_encoded were encoded by this run (speaker embedding and codes) and "
                  "references_from_cache_files read from DIR/.references, where an earlier run into DIR left them; "
                  "reference_encode_seconds: reading, resampling and encoding them, including "
                  "reference_encoder_load_seconds, loading the encoders",
    "synthesis": "the GPU engine's time, summed over this run's synthesize calls (absent on the plain CPU path; with "
                 "--gpus summed over the workers, each worker's in per_worker): prompt_seconds building the prompts' "
                 "token ids, engine_build_seconds building engines and capturing their CUDA graphs, engine_seconds "
                 "running them (waits for the GPU included), of which gpu_wait_seconds its thread was blocked waiting "
                 "for the GPU (the rest is host work: when the host is the bound, this is small), row_callback_seconds"
                 " went to handing finished rows over, prompt_vector_seconds to building the prompts' vectors and "
                 "pcm_copy_seconds to copying the audio to each row's array (both while waiting for the GPU where it "
                 "could); ms_per_step = engine_seconds / steps (with --gpus the mean over the workers' steps, which "
                 "run at once); gpu_ms_per_step: each stage's GPU time per decode step from CUDA events (prefill: "
                 "admissions; stages on other streams overlap); slots_busy: frames / (steps x engine slots); "
                 "peak_gpu_gib: the most GPU memory the process's tensors held at once (torch.cuda.max_memory_allocated;"
                 " with --gpus the most of any worker; null on cpu)",
}


NOT_SYNTHESIZED = "not synthesized: the run stopped before this row"   # a row's error after SIGTERM, Ctrl-C
# What a synth run writes into its folder beside the rows' outputs and the ledger (cli.run_synth).
RUN_FILES = ("report.json", "report.md", "report.html", "rows.parquet")


@dataclass
class RowRecord:
    """One manifest row: either a file (a parquet shard for --format parquet) or an error."""
    request: Request
    row_number: int | None = None   # 1-based line or row in the manifest
    file: str | None = None
    frames: int | None = None
    segment_frames: list[int] | None = None
    audio_seconds: float | None = None
    wall_seconds: float | None = None
    hit_cap: bool | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def not_synthesized(self) -> bool:
        """Left for a rerun by a stopped run: neither made nor failed."""
        return self.error == NOT_SYNTHESIZED


@dataclass
class RunInfo:
    manifest: str
    model_dir: str
    model_source: str            # "--model", "$TTS_MODEL" or "bundled"
    bundled_random_model: bool
    device: str
    dtype: str
    greedy: bool
    base_seed: int
    max_frames: int | None
    batch_size: int
    skipped_empty: int
    load_seconds: float
    wall_seconds: float
    tts_version: str
    output_format: str = "wav"
    segment_chars: int | None = None
    max_text_chars: int | None = None
    shard: str | None = None          # "i/n" or None
    devices: list[str] | None = None  # worker devices with --gpus
    resumed: int = 0
    audio_seconds_this_run: float = 0.0
    notes: list[str] | None = None
    device_choice: str | None = None  # why this device: "auto: torch sees no CUDA device", "--device", ...
    references: dict | None = None    # tts_cli/voice/voices.py Voices.summary(), when rows clone a voice
    synthesis: dict | None = None     # tts_cli/synthesizer.py SynthesisTiming.as_dict(), on the engine path


def build_report(info: RunInfo, rows: list[RowRecord], wer: dict | None = None) -> dict:
    """wer: the WER section (tts_cli/quality/synth_wer.py), when WER was computed."""
    audio_seconds = sum(row.audio_seconds or 0.0 for row in rows)
    xrt = round(info.audio_seconds_this_run / info.wall_seconds, 3) if info.wall_seconds > 0 else None
    return {
        "tts_version": info.tts_version,
        "manifest": info.manifest,
        "model": {
            "dir": info.model_dir,
            "source": info.model_source,
            "bundled_random_model": info.bundled_random_model,
        },
        "device": info.device,
        "dtype": info.dtype,
        "settings": {
            "greedy": info.greedy,
            "base_seed": info.base_seed,
            "seed_rule": "a row without its own seed uses base_seed + its 0-based row index in the manifest; "
                         "seeds are unused with greedy",
            "max_frames": info.max_frames,
            "batch_size": info.batch_size,
            "format": info.output_format,
            "segment_chars": info.segment_chars,
            "max_text_chars": info.max_text_chars,
            "shard": info.shard,
            "devices": info.devices,
            "device_choice": info.device_choice,
        },
        "totals": {
            "rows": len(rows),
            "ok": sum(row.ok for row in rows),
            "failed": sum(not row.ok and not row.not_synthesized for row in rows),
            "not_synthesized": sum(row.not_synthesized for row in rows),
            "skipped_empty": info.skipped_empty,
            "resumed": info.resumed,
            "hit_cap": sum(bool(row.hit_cap) for row in rows),
            "audio_seconds": round(audio_seconds, 3),
            "audio_seconds_this_run": round(info.audio_seconds_this_run, 3),
            "wall_seconds": round(info.wall_seconds, 3),
            "load_seconds": round(info.load_seconds, 3),
            "audio_seconds_per_second": xrt,
            "xrt": xrt,
        },
        **({"references": info.references} if info.references is not None else {}),
        **({"synthesis": info.synthesis} if info.synthesis else {}),
        "definitions": DEFINITIONS,
        "notes": info.notes or [],
        **({"wer": wer} if wer is not None else {}),
        "rows": [_row_dict(row) for row in rows],
    }


def _row_dict(row: RowRecord) -> dict:
    request = row.request
    return {
        "row": row.row_number,
        "id": request.id,
        "text": request.text,
        "speaker": request.speaker,
        "language": request.language,
        "instruct": request.instruct,
        # the reference of a cloned voice (None for the other rows)
        "ref_audio": request.ref_audio,
        "ref_text": request.ref_text,
        "x_vector_only": request.x_vector_only if request.clones_voice else None,
        "seed": request.seed,
        "frames": row.frames,
        "segment_frames": row.segment_frames,
        "audio_seconds": None if row.audio_seconds is None else round(row.audio_seconds, 3),
        "wall_seconds": None if row.wall_seconds is None else round(row.wall_seconds, 3),
        "hit_cap": row.hit_cap,
        "file": row.file,
        "error": row.error,
    }


def write_reports(out_dir: Path, report: dict, wer_rows: list[dict] | None = None) -> tuple[Path, Path]:
    """wer_rows: the rows of rows.parquet when WER was computed (the page shows their hypotheses)."""
    json_path, md_path = Path(out_dir) / "report.json", Path(out_dir) / "report.md"
    write_atomically(json_path, lambda tmp: tmp.write_text(
        json.dumps(report, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"))
    write_atomically(md_path, lambda tmp: tmp.write_text(render_markdown(report), encoding="utf-8"))
    write_synth_html(out_dir, report, wer_rows)
    return json_path, md_path


def render_markdown(report: dict) -> str:
    model, settings, totals = report["model"], report["settings"], report["totals"]
    model_note = ("bundled tiny model with random weights: its audio is noise" if model["bundled_random_model"]
                  else f"from {model['source']}")
    sampling = "greedy" if settings["greedy"] else f"sampled, base seed {settings['base_seed']}"
    lines = [
        "# tts synth report",
        "",
        f"- manifest: `{report['manifest']}`",
        f"- model: `{model['dir']}` ({model_note})",
        f"- device / dtype: {report['device']}"
        + (f" ({settings['device_choice']})" if settings.get("device_choice") else "") + f" / {report['dtype']}",
        f"- sampling: {sampling}; max frames: {settings['max_frames'] or 'default cap'}; "
        f"batch size: {settings['batch_size']}; format: {settings['format']}"
        + (f"; shard {settings['shard']}" if settings["shard"] else ""),
        f"- tts {report['tts_version']}",
        "",
        "## Totals",
        "",
        "| rows ok | rows failed | not synthesized (run stopped) | empty rows skipped | rows at frame cap | resumed "
        "| audio s | wall s | audio-s/s | xRT |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        f"| {totals['ok']} | {totals['failed']} | {totals['not_synthesized']} | {totals['skipped_empty']} "
        f"| {totals['hit_cap']} | {totals['resumed']} "
        f"| {totals['audio_seconds']:.3f} | {totals['wall_seconds']:.3f} "
        f"| {_number(totals['audio_seconds_per_second'])} | {_number(totals['xrt'])} |",
        "",
        f"xRT = {DEFINITIONS['xrt']}.",
        f"Wall seconds: {DEFINITIONS['wall_seconds']}. Model loading took {totals['load_seconds']:.3f} s.",
        f"Resumed: {DEFINITIONS['resumed']}.",
        *_reference_lines(report.get("references")),
        *_synthesis_lines(report.get("synthesis")),
        *(f"Note: {markdown_text(note)}." for note in report["notes"]),
        "",
        *_wer_lines(report.get("wer")),
        "## Rows",
        "",
        "| row | id | voice | language | frames | audio s | wall s | hit cap | file or error | text |",
        "|---:|---|---|---|---:|---:|---:|---|---|---|",
    ]
    for row in report["rows"]:
        outcome = f"`{row['file']}`" if row["error"] is None else f"error: {row['error']}"
        frames = _number(row["frames"])
        if row["segment_frames"]:   # a split row: its segments' frames too, as report.json has them
            frames += f" ({' + '.join(map(str, row['segment_frames']))})"
        lines.append("| " + " | ".join(markdown_cell(value) for value in (
            _number(row["row"]), row["id"], voice_label(row), row["language"], frames,
            _number(row["audio_seconds"]), _number(row["wall_seconds"]),
            "" if row["hit_cap"] is None else ("yes" if row["hit_cap"] else "no"),
            outcome, row["text"])) + " |")
    return "\n".join(lines) + "\n"


def voice_label(row: dict) -> str:
    """A report row's voice in a few words: its speaker, the reference it clones, its instruct."""
    if row.get("ref_audio"):
        return f"clone of {Path(row['ref_audio']).name} ({'x-vector' if row['x_vector_only'] else 'ICL'})"
    return "; ".join(part for part in (row["speaker"], row["instruct"] and f"instruct: {row['instruct']}") if part)


def _reference_lines(references: dict | None) -> list[str]:
    if references is None:
        return []
    return [f"References: {references_line(references)}."]


def _synthesis_lines(synthesis: dict | None) -> list[str]:
    if not synthesis:
        return []
    return [f"Engine: {synthesis_line(synthesis)}.",
            *(f"- {worker}: {synthesis_line(one)}." for worker, one in synthesis.get("per_worker", {}).items())]


def synthesis_line(synthesis: dict) -> str:
    """One line of where the engine's time went, for report.md and the console."""
    busy = synthesis["slots_busy"]
    stages = ", ".join(f"{name} {ms:.2f}" for name, ms in synthesis["gpu_ms_per_step"].items())
    workers = len(synthesis.get("per_worker", ()))
    return ((f"summed over {workers} workers running at once, " if workers else "")
            + f"{synthesis['steps']} steps in {synthesis['engine_seconds']:.2f} s ({synthesis['ms_per_step']:.2f} ms "
            f"per step" + (f", {busy:.0%} of slot-steps made a frame" if busy is not None else "") + ")"
            + (f"; GPU ms per step: {stages}" if stages else "")
            + f"; the engine's thread waited {synthesis['gpu_wait_seconds']:.2f} s for the GPU and handed rows "
            f"over in {synthesis['row_callback_seconds']:.2f} s, built prompt vectors in "
            f"{synthesis['prompt_vector_seconds']:.2f} s and copied audio in "
            f"{synthesis['pcm_copy_seconds']:.2f} s"
            + f"; prompts tokenized in {synthesis['prompt_seconds']:.2f} s, engines built in "
            f"{synthesis['engine_build_seconds']:.2f} s ({synthesis['calls']} calls)"
            + (f"; peak GPU memory {peak:.1f} GiB" if (peak := synthesis.get("peak_gpu_gib")) is not None else ""))


def references_line(references: dict) -> str:
    """One line of the voice-cloning counts, for report.md and the console."""
    return (f"{references['references_used']} used by this run's rows, {references['references_encoded']} encoded in "
            f"{references['reference_encode_seconds']:.2f} s (encoders loaded in "
            f"{references['reference_encoder_load_seconds']:.2f} s), {references['references_from_cache_files']} "
            "read from the cache files of an earlier run")


def _wer_lines(wer: dict | None) -> list[str]:
    if wer is None:
        return []
    from ..quality.scoring import wer_markdown   # imports jiwer: only when WER was computed
    return (["## WER (per row: rows.parquet)", ""] + [f"- {key}: `{value}`" for key, value in wer["settings"].items()]
            + [""] + wer_markdown(wer, "###"))


def _number(value) -> str:
    if value is None:
        return ""
    return f"{value:.3f}" if isinstance(value, float) else str(value)


# Control characters but tab and LF (C0, DEL, C1): written as \xNN, not raw into the file.
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def markdown_text(text) -> str:
    """Text for report.md as text: `<`, `>`, `&` as entities (markdown passes raw HTML through, and
    rows' text, ids, errors and transcripts come from outside), a CR as a line end (markdown takes a
    lone one for one), other control characters as \\xNN."""
    text = str(text).replace("\r\n", "\n").replace("\r", "\n")
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", html.escape(text, quote=False))


def markdown_cell(value) -> str:
    """A markdown table cell (None: empty): markdown_text, its `|` and backslashes escaped, on one line."""
    if value is None:
        return ""
    return markdown_text(value).replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ")
