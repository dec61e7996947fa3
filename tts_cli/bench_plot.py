"""Bench results as a picture (`tts bench --plot`, `tts plot`): (a) audio-s/s per concurrency, one
line per run; (b) each step's time split by stage, stacked bars per concurrency (runs side by side).

Runs are read from:
- `tts bench --json` results: one run (`rows`, each with `concurrency`, `audio_s_per_s`,
  `ms_per_step`); also such results nested at any depth in a larger JSON object (a capture that keeps
  several tables), one run per key;
- tools/arms.py's arms.json (`runs`: one row per arm, repeat and concurrency): one run per arm and
  repeat; also nested;
- the peer benches' JSON lines (bench/results/peers-*.jsonl: `system`, `batch`, `audio_s_per_s`):
  one run per system, repeated measurements averaged; they have no stage times, so only (a).

matplotlib (extra [plot]) is imported only to draw."""
from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from tts_cli import install_hint
from tts_cli.errors import TTSError

# The keys of a bench row's ms_per_step (tts_cli.engine.runner.EngineStats.per_step), in the order
# they are shown and stacked.
STEP_STAGES = ("depth", "talker", "codec", "prefill", "host")
STAGE_COLORS = {"depth": "tab:blue", "talker": "tab:orange", "codec": "tab:green", "prefill": "tab:red",
                "host": "tab:gray"}
RUN_HATCHES = ("", "//", "..", "xx", "\\\\", "oo")   # tells apart the runs' bars in (b)
LOG_SCALE_RATIO = 50   # (a) has a log y axis when its largest audio-s/s is more than this times its smallest
PLOT_EXTRA = f"{install_hint('plot')} (matplotlib)"
PLOT_FORMATS = (".png", ".svg", ".pdf")   # the file's suffix says which


@dataclass
class Point:
    concurrency: int
    audio_s_per_s: float
    ms_per_step: dict | None = None   # None where the stages were not timed (CPU runs, peers)


@dataclass
class Run:
    label: str
    points: list[Point]

    @property
    def staged(self) -> bool:
        return any(p.ms_per_step for p in self.points)


def check_plotting(path: Path) -> None:
    """That a plot can be drawn into `path`: matplotlib is there and the name says a format it writes."""
    if path.suffix.lower() not in PLOT_FORMATS:
        raise TTSError(f"the plot {path}: its name must end in {', '.join(PLOT_FORMATS)} (the format it is written in)")
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        raise TTSError(f"plotting needs matplotlib, which is not installed ({e}): {PLOT_EXTRA}") from None


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _timed(ms_per_step) -> dict | None:
    """ms_per_step where its stages were timed (on CPU only host is: nothing to split), every stage a
    number of ms; else None."""
    if not isinstance(ms_per_step, dict) or not all(_number(ms_per_step.get(stage)) for stage in STEP_STAGES):
        return None
    if not any(ms_per_step[stage] > 0 for stage in STEP_STAGES if stage != "host"):
        return None
    return ms_per_step


def _point_row(row, *keys: str) -> bool:
    """A result row with the keys (the first a concurrency) and numbers where a plot needs them."""
    return (isinstance(row, dict) and set(keys) <= row.keys() and isinstance(row[keys[0]], int)
            and not isinstance(row[keys[0]], bool) and row[keys[0]] >= 1
            and _number(row["audio_s_per_s"]) and row["audio_s_per_s"] >= 0)


def _bench_label(result: dict, name: str) -> str:
    """Its weights' dtype as the run had them (on CPU fp32, whatever --talker-precision said)."""
    label = f"{name}: tts {result.get('model', '?')}"
    weights = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}.get(result.get("dtype"))
    if weights or result.get("talker_precision"):
        label += f" {weights or result['talker_precision']}"
    return label + (" (CPU)" if result.get("cpu_figures") else "")


def _is_bench_result(data) -> bool:
    return isinstance(data, dict) and isinstance(data.get("rows"), list) and bool(data["rows"]) and all(
        _point_row(r, "concurrency", "audio_s_per_s") for r in data["rows"])


def runs_from(data, name: str) -> list[Run]:
    """The runs in one parsed results file (see the module docstring); name: how the file is called."""
    if _is_bench_result(data):
        return [Run(_bench_label(data, name),
                    [Point(r["concurrency"], r["audio_s_per_s"], _timed(r.get("ms_per_step"))) for r in data["rows"]])]
    if isinstance(data, list):
        groups: dict[str, list[dict]] = {}
        for row in data:
            if _point_row(row, "batch", "system", "audio_s_per_s"):   # peers
                groups.setdefault(str(row["system"]), []).append(dict(row, concurrency=row["batch"]))
            elif _point_row(row, "concurrency", "arm", "audio_s_per_s"):   # tools/arms.py's rows
                groups.setdefault(f"{name}: {row['arm']} r{row.get('repeat', 0)}", []).append(row)
        return [Run(label, _averaged(rows)) for label, rows in groups.items()]
    if isinstance(data, dict):   # arms.json's `runs`, or a capture holding results under some of its keys
        return [run for key, value in data.items() if isinstance(value, (dict, list))
                for run in runs_from(value, name if key == "runs" else f"{name} {key}")]
    return []


def _averaged(rows: list[dict]) -> list[Point]:
    """One point per concurrency: the mean of its measurements (stage times from the first timed one)."""
    by_level: dict[int, list[dict]] = {}
    for row in rows:
        by_level.setdefault(int(row["concurrency"]), []).append(row)
    return [Point(c, statistics.mean(r["audio_s_per_s"] for r in group),
                  next((_timed(r.get("ms_per_step")) for r in group if _timed(r.get("ms_per_step"))), None))
            for c, group in sorted(by_level.items())]


def read_runs(path: Path) -> list[Run]:
    """The runs of a results file: JSON, or JSON lines."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise TTSError(f"cannot read {path}: {e}") from None
    except UnicodeDecodeError:
        raise TTSError(f"{path}: not a text file (bench results are JSON or JSON lines)") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as as_json:
        data = []
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                data.append(json.loads(line))
            except json.JSONDecodeError as e:   # e's position is within the line: the file's line is named here
                raise TTSError(f"{path}: neither JSON ({as_json}) nor JSON lines (line {number}, column {e.colno}: "
                               f"{e.msg})") from None
    runs = runs_from(data, path.stem)
    if not runs:
        raise TTSError(f"{path}: no bench results in it (tts bench --json, tools/arms.py's arms.json, or "
                       "peer bench JSON lines with system, batch and audio_s_per_s)")
    return runs


def _unique_labels(runs: list[Run]) -> list[Run]:
    seen: dict[str, int] = {}
    unique = []
    for run in runs:
        seen[run.label] = seen.get(run.label, 0) + 1
        unique.append(run if seen[run.label] == 1 else Run(f"{run.label} ({seen[run.label]})", run.points))
    return unique


def _literal(text: str) -> str:
    """text as matplotlib shows it as given: a pair of $ would start math mode (a title "$2.50/h vs $1.80/h" lost
    its spaces, and one that is no valid TeX failed the plot)."""
    return text.replace("$", r"\$")


def plot_runs(runs: list[Run], path: Path, title: str = "tts bench"):
    """Draws the runs into a PNG at path; returns the matplotlib Figure (axes[0]: one line per run,
    axes[1]: one bar container per timed run and stage)."""
    check_plotting(path)
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    runs = _unique_labels(runs)
    figure = Figure(figsize=(13, 5.5), layout="constrained")
    rate, split = figure.subplots(1, 2, gridspec_kw={"width_ratios": [1, 1.2]})
    figure.suptitle(_literal(title))

    levels = sorted({p.concurrency for run in runs for p in run.points})
    for run in runs:
        points = sorted(run.points, key=lambda p: p.concurrency)
        rate.plot([p.concurrency for p in points], [p.audio_s_per_s for p in points], marker="o",
                  label=_literal(run.label))
    rate.set_xscale("log", base=2)
    rate.set_xticks(levels, [str(c) for c in levels])
    rates = [p.audio_s_per_s for run in runs for p in run.points if p.audio_s_per_s > 0]
    wide = bool(rates) and max(rates) > LOG_SCALE_RATIO * min(rates)
    if wide:   # e.g. the official implementation's 0.4 beside a thousand: both readable
        rate.set_yscale("log")
    rate.set_xlabel("concurrency (rows in flight)")
    rate.set_ylabel("audio seconds per wall second" + (" (log scale)" if wide else ""))
    rate.set_title("(a) throughput")
    rate.grid(True, alpha=0.3)
    rate.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12), fontsize="small")   # below: no data hidden

    staged = [run for run in runs if run.staged]
    split.set_title("(b) a step's time by stage; on top: the stages' ms per step")
    if not staged:
        split.text(0.5, 0.5, "no stage times in these results\n(timed on CUDA only)", ha="center", va="center",
                   transform=split.transAxes)
        split.set_axis_off()
    else:
        staged_levels = sorted({p.concurrency for run in staged for p in run.points if p.ms_per_step})
        width = 0.8 / len(staged)
        for index, run in enumerate(staged):
            points = {p.concurrency: p.ms_per_step for p in run.points if p.ms_per_step}
            xs = [i + (index - (len(staged) - 1) / 2) * width for i, c in enumerate(staged_levels) if c in points]
            totals = [sum(points[c][s] for s in STEP_STAGES) for c in staged_levels if c in points]
            bottoms = [0.0] * len(xs)
            for stage in STEP_STAGES:
                shares = [100 * points[c][stage] / total for c, total in
                          zip((c for c in staged_levels if c in points), totals)]
                split.bar(xs, shares, width, bottom=bottoms, color=STAGE_COLORS[stage],
                          hatch=RUN_HATCHES[index % len(RUN_HATCHES)], edgecolor="white")
                bottoms = [b + s for b, s in zip(bottoms, shares)]
            for x, total in zip(xs, totals):
                split.text(x, 101, f"{total:.1f} ms", ha="center", va="bottom", fontsize="x-small")
        split.set_xticks(range(len(staged_levels)), [str(c) for c in staged_levels])
        split.set_xlabel("concurrency")
        split.set_ylabel("share of the stages' time (%)")
        split.set_ylim(0, 112)
        stages = split.legend(handles=[Patch(facecolor=STAGE_COLORS[stage], label=stage) for stage in STEP_STAGES],
                              loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=len(STEP_STAGES),
                              fontsize="small")
        if len(staged) > 1:   # which bar is which run: left to right, told apart by hatching
            split.add_artist(stages)
            split.legend(handles=[Patch(facecolor="white", edgecolor="black", hatch=RUN_HATCHES[i % len(RUN_HATCHES)],
                                        label=_literal(f"bar {i + 1}: {run.label}")) for i, run in enumerate(staged)],
                         loc="upper center", bbox_to_anchor=(0.5, -0.22), fontsize="small")
    try:
        figure.savefig(path, dpi=120)
    except OSError as e:
        raise TTSError(f"cannot write the plot {path}: {e}") from None
    return figure
