"""report.html: one self-contained page to listen to a run of `tts synth` or `tts score`.

The page is built from the data report.json and rows.parquet hold (nothing is measured again): the
summary (totals, device, settings, the WER summary when there is one), then every manifest row in one
table, the flagged rows first (hit cap, slow, silent, WER above 50%, failed), each group worst WER
first (without WER, `tts synth --no-wer`, the flags known are hit cap and failed). Each row that has
audio gets a player, its text and the ASR hypothesis side by side; a failed row shows its error
instead of a player. A click on a column header sorts by it (again: reversed; empty cells stay last).
A small plot shows each row's audio seconds and the wall seconds of the batch that made it, in
manifest order.

Self-contained: the CSS, the script that sorts and the plot (inline SVG) are in the page; it loads
nothing from the network. All text from the run (row text is user input) is HTML-escaped.

Where a player finds its audio: a relative link from the page. wav/flac output: the row's file
beside the page. `tts score`: the row's file in AUDIO_DIR, relative to the page's folder.
Parquet output keeps the audio inside its shards, which a browser cannot play: each row's FLAC bytes
are copied unchanged into `report_audio/NAME.flac` beside the page (NAME: the row's name in its
shard), and files there that no row names any more are removed. Files, not data URIs: a run of
thousands of rows would make a page of hundreds of megabytes that the browser must read before it
shows anything, while a file costs the disk its shard does and is read when it is played.
"""
from __future__ import annotations

import html
import os
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

from ..errors import OutputError
from .writer import write_atomically

PAGE_NAME = "report.html"
PARQUET_AUDIO_FOLDER = "report_audio"
# Up to this many players, each reads its file's header when the page opens (durations show at once);
# beyond it a player reads its file only when played, so a large run's page opens without thousands of reads.
PRELOAD_METADATA_MAX_PLAYERS = 200
FAILED_MEANING = "no audio, or its audio could not be heard: see the row's error"


@dataclass
class PageRow:
    """One manifest row as the page shows it."""
    row: int                       # 1-based: the manifest line or row
    id: str
    text: str
    audio: str | None = None       # relative link to the row's audio; None: no player
    hypothesis: str | None = None
    not_scored: str | None = None
    wer: float | None = None
    frames: int | None = None
    audio_seconds: float | None = None
    wall_seconds: float | None = None
    flags: list[str] = field(default_factory=list)
    error: str | None = None


@dataclass
class Column:
    key: str
    label: str
    sort: str | None    # "number", "text" or None (not sortable)
    note: str = ""


def write_synth_html(out_dir: Path, report: dict, wer_rows: list[dict] | None = None) -> Path:
    """report: report.json's dict (tts_cli/output/report.py); wer_rows: rows.parquet's rows, one per
    report row in the same order, when WER was computed."""
    out_dir = Path(out_dir)
    if report["settings"]["format"] == "parquet":
        audio_names = extract_parquet_audio(out_dir, report["rows"])
    else:   # the rows' own files: copies an earlier --format parquet run made are no row's now
        if (out_dir / PARQUET_AUDIO_FOLDER).is_dir():
            extract_parquet_audio(out_dir, [])
        audio_names = {row["id"]: row["file"] for row in report["rows"] if row["error"] is None and row["file"]}
    rows = synth_page_rows(report, wer_rows, audio_names)
    wer = report.get("wer")
    meanings = {"hit_cap": report["definitions"]["hit_cap"], **(wer["flag_meanings"] if wer else {})}
    return _write_page(out_dir, "tts synth report", _synth_summary(report), rows, meanings)


def write_score_html(out_dir: Path, report: dict, audio_dir: Path) -> Path:
    """report: `tts score`'s report.json dict (tts_cli/quality/scoring.py); audio_dir: where its rows' files are."""
    out_dir = Path(out_dir)
    folder = Path(os.path.relpath(Path(audio_dir).resolve(), out_dir.resolve()))
    rows = [PageRow(row=r["row"], id=r["id"], text=r["text"],
                    audio=None if r["error"] or not r["file"] else (folder / r["file"]).as_posix(),
                    hypothesis=r["hypothesis"], not_scored=r["not_scored"], wer=r["wer"], frames=r["frames"],
                    audio_seconds=r["seconds"], flags=r["flags"] + (["failed"] if r["error"] else []),
                    error=r["error"])
            for r in report["rows"]]
    summary = (_definition_list(report["settings"].items())
               + _wer_summary(report["summary"], report["protocol"]))
    return _write_page(out_dir, report["title"], summary, rows, report["flag_meanings"])


def synth_page_rows(report: dict, wer_rows: list[dict] | None, audio_names: dict[str, str]) -> list[PageRow]:
    """report.json's rows joined with rows.parquet's (hypothesis, WER, flags); audio_names: id -> the
    relative link of each row that has audio."""
    if wer_rows is not None and [r["id"] for r in wer_rows] != [r["id"] for r in report["rows"]]:
        raise ValueError("the WER rows do not match the report's rows one for one")
    from .report import NOT_SYNTHESIZED   # (report.py imports this module)

    rows = []
    for index, r in enumerate(report["rows"]):
        scored = wer_rows[index] if wer_rows is not None else None
        # A row's synthesis error, else the ASR's (its audio is there: it keeps its player).
        error = r["error"] or (scored and scored["error"])
        flags = scored["flags"] if scored else (["hit_cap"] if r["hit_cap"] else [])
        rows.append(PageRow(
            row=r["row"], id=r["id"], text=r["text"],
            audio=audio_names.get(r["id"]) if r["error"] is None else None,
            hypothesis=scored and scored["hypothesis"], not_scored=scored and scored["not_scored"],
            wer=scored and scored["wer"], frames=r["frames"], audio_seconds=r["audio_seconds"],
            wall_seconds=r["wall_seconds"],
            flags=flags + (["not synthesized"] if r["error"] == NOT_SYNTHESIZED else ["failed"] if error else []),
            error=error))
    return rows


def extract_parquet_audio(out_dir: Path, report_rows: list[dict]) -> dict[str, str]:
    """Copies the FLAC bytes of each ok row from its shard into report_audio/ (a file already there
    with the same bytes is kept); removes the files there that no row names. Returns id -> relative link."""
    import pyarrow.parquet as pq

    folder = Path(out_dir) / PARQUET_AUDIO_FOLDER
    wanted: dict[str, set[str]] = {}
    for r in report_rows:
        if r["error"] is None and r["file"]:
            wanted.setdefault(r["file"], set()).add(r["id"])
    links, kept, taken = {}, set(), set()
    if wanted:
        try:
            folder.mkdir(exist_ok=True)
        except OSError as e:   # (a file of that name, a full disk): exit 2 naming it, as for the rows' files
            raise OutputError(folder, e) from e
    for shard, ids in wanted.items():
        table = pq.read_table(Path(out_dir) / shard, columns=["id", "audio"]).to_pydict()
        for row_id, audio in zip(table["id"], table["audio"]):
            if row_id not in ids:
                continue
            # The row's own name: output_names keeps it safe, and unique among its run's rows only; a row
            # of an earlier run's shard may have it too (ids that differ in characters a name cannot keep).
            name, n = Path(audio["path"]).name, 1
            stem, _, extension = name.rpartition(".")
            while name.lower() in taken:
                n += 1
                name = f"{stem}_{n}.{extension}"
            taken.add(name.lower())
            path = folder / name
            if not (path.is_file() and path.read_bytes() == audio["bytes"]):
                write_atomically(path, lambda tmp, data=audio["bytes"]: tmp.write_bytes(data))
            links[row_id] = f"{PARQUET_AUDIO_FOLDER}/{name}"
            kept.add(name)
    if folder.is_dir():
        for path in folder.iterdir():
            if path.is_file() and path.name not in kept:
                try:
                    path.unlink()
                except OSError as e:
                    raise OutputError(path, e) from e
    return links


def first_order(rows: list[PageRow]) -> list[PageRow]:
    """Flagged rows first, then the rest; in each, worst WER first, rows without a WER last, then manifest order."""
    return sorted(rows, key=lambda r: (not r.flags, r.wer is None, -(r.wer or 0.0), r.row))


def _write_page(out_dir: Path, title: str, summary: str, rows: list[PageRow], meanings: dict[str, str]) -> Path:
    path = Path(out_dir) / PAGE_NAME
    page = render_page(title, summary, rows, {**meanings, "failed": FAILED_MEANING})
    write_atomically(path, lambda tmp: tmp.write_text(page, encoding="utf-8"))
    return path


def render_page(title: str, summary: str, rows: list[PageRow], meanings: dict[str, str]) -> str:
    """summary: HTML, already escaped; rows in manifest order."""
    columns = _columns(rows)
    ordered = first_order(rows)
    preload = "metadata" if sum(r.audio is not None for r in rows) <= PRELOAD_METADATA_MAX_PLAYERS else "none"
    flagged = sum(bool(r.flags) for r in rows)
    header = "".join(
        f'<th class="{c.key}"' + (f' data-type="{c.sort}"' if c.sort else "")
        + (f' title="{_e(c.note)}"' if c.note else "") + f">{_e(c.label)}</th>" for c in columns)
    body = "\n".join(_table_row(rank, r, columns, meanings, preload) for rank, r in enumerate(ordered))
    meaning_items = "".join(f"<li><b>{_e(name)}</b>: {_e(text)}</li>" for name, text in meanings.items())
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{_e(title)}</title>
<style>{_CSS}</style>
</head>
<body>
<h1>{_e(title)}</h1>
{summary}
<h2>Timing</h2>
{_timing_plot(rows)}
<h2>Rows</h2>
<p>{len(rows)} rows, {flagged} flagged. Flagged rows come first, then the others; in each, the worst WER
first. Click a column header to sort by it, again to reverse; sorting by flags gives this order back.</p>
<ul class="meanings">{meaning_items}</ul>
<table class="rows">
<thead><tr>{header}</tr></thead>
<tbody>
{body}
</tbody>
</table>
<script>{_SCRIPT}</script>
</body>
</html>
"""


def _columns(rows: list[PageRow]) -> list[Column]:
    """The columns the rows have values for (no WER or hypothesis without ASR, no frames for `tts score`)."""
    scored = any(r.wer is not None or r.hypothesis is not None or r.not_scored for r in rows)
    columns = [
        (True, Column("row", "row", "number", "the row's place in the manifest")),
        (True, Column("id", "id", "text")),
        (True, Column("flags", "flags", "number", "sort: flagged and worst WER first, the page's first order")),
        (scored, Column("wer", "WER", "number")),
        (any(r.frames is not None for r in rows), Column("frames", "frames", "number")),
        (any(r.audio_seconds is not None for r in rows), Column("audio", "audio s", "number")),
        (any(r.wall_seconds is not None for r in rows),
         Column("wall", "wall s", "number", "wall seconds of the batches that made the row")),
        (True, Column("listen", "listen", None)),
        (True, Column("text", "text", "text")),
        (scored, Column("hypothesis", "ASR hypothesis", "text")),
    ]
    return [column for shown, column in columns if shown]


def _table_row(rank: int, r: PageRow, columns: list[Column], meanings: dict[str, str], preload: str) -> str:
    if r.audio is not None:
        listen = f'<audio controls preload="{preload}" src="{_e(quote(r.audio))}"></audio>'
    else:
        listen = f'<span class="error">{_e(r.error or "no audio")}</span>'
    not_scored = f'<span class="note">not scored: {_e(r.not_scored)}</span>' if r.not_scored else ""
    if r.hypothesis is not None:   # heard, maybe not scored (its text has no words to score, ...)
        hypothesis = _e(r.hypothesis) + (f"<br>{not_scored}" if not_scored else "")
    elif not_scored:
        hypothesis = not_scored
    elif r.audio is not None and r.error:   # the audio is there; the ASR failed on it
        hypothesis = f'<span class="error">{_e(r.error)}</span>'
    else:
        hypothesis = ""
    flags = " ".join(f'<span class="flag" title="{_e(meanings.get(name, ""))}">{_e(name)}</span>' for name in r.flags)
    cells = {
        "row": (r.row, str(r.row)),
        "id": (None, _e(r.id)),
        "flags": (rank, flags),
        "wer": (r.wer, "" if r.wer is None else f"{100 * r.wer:.1f}%"),
        "frames": (r.frames, _number(r.frames)),
        "audio": (r.audio_seconds, _number(r.audio_seconds)),
        "wall": (r.wall_seconds, _number(r.wall_seconds)),
        "listen": (None, listen),
        "text": (None, _e(r.text)),
        "hypothesis": (None, hypothesis),
    }
    tds = []
    for column in columns:
        sort_value, content = cells[column.key]
        sort = "" if column.sort != "number" else f' data-sort="{"" if sort_value is None else sort_value}"'
        tds.append(f'<td class="{column.key}"{sort}>{content}</td>')
    classes = ("flagged" if r.flags else "") + (" failed" if r.audio is None else "")
    return (f'<tr class="{classes.strip()}" data-id="{_e(r.id)}" data-order="{rank}" '
            f'data-flagged="{int(bool(r.flags))}">' + "".join(tds) + "</tr>")


def _synth_summary(report: dict) -> str:
    model, settings, totals = report["model"], report["settings"], report["totals"]
    sampling = "greedy" if settings["greedy"] else f"sampled, base seed {settings['base_seed']}"
    items = [
        ("manifest", report["manifest"]),
        ("model", f"{model['dir']} ("
                  + ("bundled tiny model with random weights: its audio is noise" if model["bundled_random_model"]
                     else f"from {model['source']}") + ")"),
        ("device / dtype", f"{report['device']} / {report['dtype']}"),
        ("sampling", sampling),
        ("max frames", settings["max_frames"] or "default cap"),
        ("batch size", settings["batch_size"]),
        ("format", settings["format"]),
        *((("shard", settings["shard"]),) if settings["shard"] else ()),
        *((("devices", ", ".join(settings["devices"])),) if settings["devices"] else ()),
        ("tts", report["tts_version"]),
    ]
    totals_table = _summary_table(
        ("rows ok", "rows failed", "not synthesized (run stopped)", "empty rows skipped", "rows at frame cap",
         "resumed", "audio s", "wall s", "load s", "audio-s/s (xRT)"),
        (totals["ok"], totals["failed"], totals["not_synthesized"], totals["skipped_empty"], totals["hit_cap"],
         totals["resumed"], totals["audio_seconds"], totals["wall_seconds"], totals["load_seconds"], totals["xrt"]))
    notes = "".join(f"<p class=\"note\">Note: {_e(note)}.</p>" for note in report["notes"])
    definitions = (f'<p class="note">xRT = {_e(report["definitions"]["xrt"])}. '
                   f'Wall seconds: {_e(report["definitions"]["wall_seconds"])}.</p>')
    from .report import references_line, synthesis_line   # (report.py imports this module)
    # the lines report.md has under its totals
    lines = "".join(f'<p class="note">{name}: {_e(line(report[key]))}.</p>'
                    for name, key, line in (("References", "references", references_line),
                                            ("Engine", "synthesis", synthesis_line)) if report.get(key))
    html_parts = [_definition_list(items), "<h2>Totals</h2>", totals_table, definitions, lines, notes]
    if "wer" in report:
        html_parts += ["<h2>WER</h2>", _definition_list(report["wer"]["settings"].items()),
                       _wer_summary(report["wer"]["summary"], report["wer"]["protocol"])]
    return "\n".join(html_parts)


def flag_counts(flagged: dict, skip_zero: bool = False) -> str:
    """A WER summary's flagged rows by flag, "name count" each (n/a: not known, as hit_cap for files
    `tts score` did not make); skip_zero: only the flags some row has or that are unknown."""
    return ", ".join(f"{name} {'n/a' if count is None else count}" for name, count in flagged.items()
                     if not (skip_zero and count == 0))


def _wer_summary(summary: dict, protocol: str) -> str:
    table = _summary_table(
        ("rows", "scored", "not scored", "failed", "empty skipped", "mean WER", "corpus WER", "rows > 50%",
         "mean WER of rows <= 50%"),
        (summary["rows"], summary["scored_rows"], summary["not_scored"], summary["failed"],
         summary["skipped_empty"], _percent(summary["mean_wer"]), _percent(summary["corpus_wer"]),
         summary["rows_above_50"], _percent(summary["mean_wer_of_rows_at_or_below_50"])))
    return (f"{table}\n<p>Flagged rows: {_e(flag_counts(summary['flagged']))}.</p>\n"
            f"<details><summary>WER protocol</summary><p>{_e(protocol)}</p></details>")


def _timing_plot(rows: list[PageRow]) -> str:
    """Inline SVG, rows in manifest order: a bar per row of its audio seconds, and a line through the
    wall seconds of the batches that made the rows (the rows of one batch share one value)."""
    audio = [r.audio_seconds for r in rows]
    wall = [r.wall_seconds for r in rows]
    highest = max((v for v in audio + wall if v is not None), default=0.0)
    if highest <= 0:
        return '<p class="note">No timing: no row has audio.</p>'
    width, height, left, bottom, top = 800, 150, 48, 20, 8
    plot_height, step = height - bottom - top, (width - left) / len(rows)

    def y(value: float) -> float:
        return top + plot_height * (1 - value / highest)

    bars = "".join(
        f'<rect x="{left + i * step:.2f}" y="{y(v):.2f}" width="{max(step * 0.8, 0.5):.2f}" '
        f'height="{top + plot_height - y(v):.2f}"><title>row {r.row} ({_e(r.id)}): {v:.2f} s audio'
        + (f", {r.wall_seconds:.2f} s wall" if r.wall_seconds is not None else "") + "</title></rect>"
        for i, (r, v) in enumerate(zip(rows, audio)) if v is not None)
    points = " ".join(f"{left + (i + 0.4) * step:.2f},{y(v):.2f}" for i, v in enumerate(wall) if v is not None)
    line = f'<polyline class="wall" points="{points}"/>' if points else ""
    axis = (f'<line class="axis" x1="{left}" y1="{top + plot_height}" x2="{width}" y2="{top + plot_height}"/>'
            f'<line class="axis" x1="{left}" y1="{top}" x2="{left}" y2="{top + plot_height}"/>'
            f'<text x="{left - 4}" y="{top + 8}" text-anchor="end">{highest:.2f} s</text>'
            f'<text x="{left - 4}" y="{top + plot_height}" text-anchor="end">0</text>'
            f'<text x="{left}" y="{height - 4}">row {rows[0].row}</text>'
            f'<text x="{width}" y="{height - 4}" text-anchor="end">row {rows[-1].row}</text>')
    legend = "bars: each row's audio seconds" + (
        "; line: the wall seconds of the batches that made each row (rows of one batch share them)" if line else "")
    return (f'<figure><svg class="timing" viewBox="0 0 {width} {height}" role="img" '
            f'aria-label="{_e(legend)}">{axis}<g class="audio">{bars}</g>{line}</svg>'
            f"<figcaption>{_e(legend)}; rows in manifest order.</figcaption></figure>")


def _definition_list(items) -> str:
    return "<dl>" + "".join(f"<dt>{_e(key)}</dt><dd>{_e(_text(value))}</dd>" for key, value in items) + "</dl>"


def _summary_table(header: tuple[str, ...], values: tuple) -> str:
    return ('<table class="summary"><tr>' + "".join(f"<th>{_e(h)}</th>" for h in header) + "</tr><tr>"
            + "".join(f"<td>{_e(_text(v))}</td>" for v in values) + "</tr></table>")


def _text(value) -> str:
    if value is None:
        return ""
    if isinstance(value, dict):
        return ", ".join(f"{key}={val}" for key, val in value.items())
    return _number(value)


def _number(value) -> str:
    if value is None:
        return ""
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def _percent(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def _e(text) -> str:
    return html.escape(str(text), quote=True)


_CSS = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 1.5em; color: #222; }
h1 { font-size: 1.4em; } h2 { font-size: 1.15em; margin-top: 1.5em; }
dl { display: grid; grid-template-columns: max-content auto; gap: 0.1em 1em; }
dt { font-weight: 600; } dd { margin: 0; overflow-wrap: anywhere; }
table { border-collapse: collapse; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.5em; text-align: left; vertical-align: top; }
table.summary td { text-align: right; }
table.rows th { position: sticky; top: 0; background: #f3f3f3; }
table.rows th[data-type] { cursor: pointer; user-select: none; }
table.rows th[aria-sort=ascending]::after { content: " \\25B2"; }
table.rows th[aria-sort=descending]::after { content: " \\25BC"; }
table.rows td.text, table.rows td.hypothesis { width: 28%; }
td.wer, td.frames, td.audio, td.wall, td.row { text-align: right; white-space: nowrap; }
tr.flagged { background: #fff6d6; } tr.failed { background: #fde4e4; }
.flag { display: inline-block; border-radius: 0.6em; padding: 0 0.45em; margin: 0.1em; background: #e9b949;
        font-size: 0.85em; white-space: nowrap; }
.error { color: #a11; } .note { color: #666; }
audio { height: 2em; width: 15em; }
svg.timing { width: 100%; max-width: 60em; font-size: 11px; }
svg.timing g.audio rect { fill: #6b9bd1; }
svg.timing polyline.wall { fill: none; stroke: #d1495b; stroke-width: 1.5; }
svg.timing line.axis { stroke: #888; }
ul.meanings { color: #555; font-size: 0.9em; }
"""

# Sorting: a column's numbers are in each cell's data-sort (empty: no value); text is the cell's text.
_SCRIPT = """
"use strict";
for (const header of document.querySelectorAll("table.rows th[data-type]")) {
  header.addEventListener("click", () => sortRows(header));
}
function sortRows(header) {
  const table = header.closest("table"), column = header.cellIndex, numeric = header.dataset.type === "number";
  const ascending = header.getAttribute("aria-sort") !== "ascending";
  for (const other of header.parentElement.cells) other.removeAttribute("aria-sort");
  header.setAttribute("aria-sort", ascending ? "ascending" : "descending");
  const keyOf = row => {
    const cell = row.cells[column], value = numeric ? cell.dataset.sort : cell.textContent.trim();
    return value === "" ? null : (numeric ? Number(value) : value);
  };
  const rows = Array.from(table.tBodies[0].rows, row => ({row, key: keyOf(row), order: Number(row.dataset.order)}));
  rows.sort((a, b) => {
    if (a.key === null || b.key === null) return (a.key === null) - (b.key === null) || a.order - b.order;
    const order = numeric ? a.key - b.key : a.key.localeCompare(b.key, undefined, {numeric: true});
    return (ascending ? order : -order) || a.order - b.order;
  });
  table.tBodies[0].append(...rows.map(entry => entry.row));
}
"""
