"""What `tts bench` shows: its table (100 columns, nothing cut), the stage that bounds each
concurrency, the plot of one or several result files (`tts bench --plot`, `tts plot`), and nothing
into a stdout closed early."""
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from tts_cli import bench_plot, cli
from tts_cli.bench import bounding_stage
from tts_cli.errors import TTSError

runner = CliRunner()
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _row(concurrency, audio_s_per_s, ms, codec_stream=False, **extra):
    """A bench JSON row as `tts bench --json` writes it (figures made up, of the sizes a GPU gives)."""
    return dict(concurrency=concurrency, requests=max(800, 3 * concurrency), frames=99999, audio_s=9999.9,
                wall_s=12.345, audio_s_per_s=audio_s_per_s, xrt=123.45, rtf=0.0081, first_audio_p50_s=0.1234,
                first_audio_p99_s=1.2345, ms_per_step=ms, steps=9999, slots_busy=0.76, peak_gpu_gib=123.45,
                depth="loop", codec_window=4, codec_stream=codec_stream,
                bound_by=bounding_stage(ms, codec_stream), **extra)


def _stages(depth, talker, codec, prefill, host=0.0):
    return dict(depth=depth, talker=talker, codec=codec, prefill=prefill, host=host)


def gpu_result(label_model="random:1.7b"):
    return {
        "model": label_model, "device": "cuda", "device_choice": "auto: torch sees 1 CUDA device",
        "cpu_figures": False, "dtype": "float16", "gpu": "NVIDIA H200", "talker_precision": "fp16",
        "codec_window": "auto (16 at one row, else 4)",
        "rows": [_row(1, 28.19, _stages(1.641, 1.019, 0.17, 0.089), codec_stream=True),
                 _row(64, 742.1, _stages(2.65, 1.6, 1.9, 1.5, 0.3), codec_stream=True),
                 _row(512, 12345.6, _stages(10.12, 12.34, 15.27, 11.59, 0.12), tail_steps={"128": 17, "256": 9})],
    }


PEER_LINES = [  # shared/peer_bench/results/run1.jsonl's format
    {"system": "qwen-tts-hf (reference)", "batch": 1, "audio_s_per_s": 0.398, "codec_share": 0.038},
    {"system": "qwen-tts-hf (reference)", "batch": 64, "audio_s_per_s": 27.2, "codec_share": 0.028},
    {"system": "qwen-tts-hf (reference)", "batch": 64, "audio_s_per_s": 25.8, "codec_share": 0.027},
    {"system": "qwen3-tts-triton (hybrid)", "batch": 8, "audio_s_per_s": 28.9, "codec_share": 0.139},
]


def test_bounding_stage_is_the_largest_share_and_a_streamed_codec_bounds_only_beyond_the_rest():
    assert bounding_stage(_stages(2.0, 1.0, 3.0, 0.5), codec_stream=False) == "codec"
    assert bounding_stage(_stages(2.0, 1.0, 3.0, 0.5), codec_stream=True) == "depth"   # beside 3.5 ms in line
    assert bounding_stage(_stages(2.0, 1.0, 4.0, 0.5), codec_stream=True) == "codec"
    assert bounding_stage(_stages(1.0, 1.0, 0.5, 2.5), codec_stream=False) == "prefill"
    assert bounding_stage(_stages(0.1, 0.1, 0.1, 0.1, host=5.0), codec_stream=False) == "host"
    assert bounding_stage(_stages(0.0, 0.0, 0.0, 0.0, host=30.0), codec_stream=False) is None   # CPU: not timed


def test_bench_table_fits_100_columns_and_cuts_nothing():
    result = gpu_result()
    console = Console(file=io.StringIO(), width=cli.BENCH_TABLE_WIDTH)
    console.print(cli.bench_table(result))
    lines = console.file.getvalue().splitlines() + cli.bench_notes(result, "auto")
    assert max(len(line) for line in lines) <= 100
    assert not any("…" in line for line in lines)
    text = " ".join(" ".join(lines).split())   # the notes wrap
    row_512 = next(line for line in lines if line.lstrip().startswith("512 "))
    for value in ("1536", "12345.6", "123.45", "0.008", "0.123", "1.234", "10.12", "12.34", "15.27", "11.59",
                  "0.12", "codec", "76%", "123.5"):
        assert value in row_512.split(), value
    assert "bound: the stage with the largest share of a step" in text
    assert "ms per step" in text and "GiB: peak GPU memory" in text
    assert "c512 26 of 9999 steps (on 256 then 128 rows)" in text   # keys as the JSON has them: strings


def test_plot_draws_a_line_per_run_and_stacked_stage_bars_per_timed_run(tmp_path):
    ours, peers = tmp_path / "bench.json", tmp_path / "peers.jsonl"
    ours.write_text(json.dumps(gpu_result()))
    peers.write_text("".join(json.dumps(line) + "\n" for line in PEER_LINES))
    runs = bench_plot.read_runs(ours) + bench_plot.read_runs(peers)
    assert [run.label for run in runs] == ["bench: tts random:1.7b fp16", "qwen-tts-hf (reference)",
                                           "qwen3-tts-triton (hybrid)"]
    assert [(p.concurrency, p.audio_s_per_s) for p in runs[1].points] == [(1, 0.398), (64, pytest.approx(26.5))]
    out = tmp_path / "plot.png"
    figure = bench_plot.plot_runs(runs, out)
    assert out.read_bytes().startswith(PNG_SIGNATURE)
    import matplotlib.image
    height, width, _ = matplotlib.image.imread(str(out)).shape
    assert width > 1000 and height > 500
    rate, split = figure.axes
    assert [line.get_label() for line in rate.get_lines()] == [run.label for run in runs]
    assert rate.get_yscale() == "log"   # 0.4 beside 12345.6
    # peers have no stage times: one run's stages, one stacked container each, a bar per concurrency
    assert len(split.containers) == len(bench_plot.STEP_STAGES)
    assert all(len(container) == 3 for container in split.containers)
    shares = [[bar.get_height() for bar in container] for container in split.containers]
    assert [sum(column) for column in zip(*shares)] == pytest.approx([100, 100, 100])
    assert shares[0][0] == pytest.approx(100 * 1.641 / (1.641 + 1.019 + 0.17 + 0.089))   # depth at c1


def test_plot_reads_captures_and_arms_and_sets_two_timed_runs_side_by_side(tmp_path):
    capture = tmp_path / "capture.json"   # a file keeping bench results under keys, as docs/ captures do
    capture.write_text(json.dumps({"date": "2026-12-03", "run_a": gpu_result(), "run_b": gpu_result("random:0.6b"),
                                   "log": "text"}))
    arms = tmp_path / "arms.json"   # tools/arms.py
    arms.write_text(json.dumps({"extra_args": [], "runs": [
        dict(arm="main", repeat=0, status=0, **_row(64, 700.0, _stages(2.6, 1.6, 1.9, 1.5))),
        dict(arm="main", repeat=0, status=0, **_row(128, 900.0, _stages(3.6, 2.1, 2.9, 1.7)))]}))
    runs = bench_plot.read_runs(capture) + bench_plot.read_runs(arms)
    assert [run.label for run in runs] == ["capture run_a: tts random:1.7b fp16",
                                           "capture run_b: tts random:0.6b fp16", "arms: main r0"]
    figure = bench_plot.plot_runs(runs, tmp_path / "plot.png")
    assert len(figure.axes[0].get_lines()) == 3
    assert len(figure.axes[1].containers) == 3 * len(bench_plot.STEP_STAGES)


def test_plot_command_writes_the_png_and_names_what_it_cannot_read(tmp_path):
    ours = tmp_path / "bench.json"
    ours.write_text(json.dumps(gpu_result()))
    result = runner.invoke(cli.app, ["plot", str(ours), "--out", str(tmp_path / "x.png")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "x.png").read_bytes().startswith(PNG_SIGNATURE)
    assert "1 runs: bench: tts random:1.7b fp16" in result.stdout
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"rows": [{"id": "a"}]}))
    result = runner.invoke(cli.app, ["plot", str(other), "--out", str(tmp_path / "y.png")])
    assert result.exit_code == 2 and f"{other}: no bench results in it" in result.stderr
    result = runner.invoke(cli.app, ["plot", str(tmp_path / "x.png"), "--out", str(tmp_path / "z.png")])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert f"{tmp_path / 'x.png'}: not a text file (bench results are JSON or JSON lines)" in result.stderr


def test_plotting_without_matplotlib_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)   # import matplotlib -> ImportError
    with pytest.raises(TTSError, match=r"plotting needs matplotlib.*pip install -e '\.\[plot\]' in the tts checkout"):
        bench_plot.plot_runs(bench_plot.runs_from(gpu_result(), "bench"), tmp_path / "x.png")
    # tts bench refuses before it runs anything
    result = runner.invoke(cli.app, ["bench", "--device", "cpu", "--plot", str(tmp_path / "x.png")])
    assert result.exit_code == 2 and "pip install -e '.[plot]' in the tts checkout" in result.stderr
    assert not (tmp_path / "x.png").exists()


def test_plot_reads_results_nested_deeper_and_refuses_values_it_cannot_draw(tmp_path):
    nested = tmp_path / "nested.json"   # as bench/results keeps several runs: {"runs": {name: result}}
    arm_row = dict(arm="main", repeat=1, **_row(64, 700.0, _stages(2.6, 1.6, 1.9, 1.5)))
    nested.write_text(json.dumps({"note": "x", "runs": {"icl": gpu_result(), "cv": gpu_result("random:0.6b")},
                                  "arms": {"runs": [arm_row]}}))
    assert [run.label for run in bench_plot.read_runs(nested)] == [
        "nested icl: tts random:1.7b fp16", "nested cv: tts random:0.6b fp16", "nested arms: main r1"]
    for rows in ([], [{"concurrency": 1, "audio_s_per_s": None}], [{"concurrency": 1, "audio_s_per_s": "fast"}],
                 [{"concurrency": 0, "audio_s_per_s": 1.0}], [{"concurrency": True, "audio_s_per_s": 1.0}]):
        bad = tmp_path / "bad.json"
        bad.write_text(json.dumps({"rows": rows}))
        result = runner.invoke(cli.app, ["plot", str(bad), "--out", str(tmp_path / "b.png")])
        assert result.exit_code == 2 and f"{bad}: no bench results in it" in result.stderr, (rows, result.output)
    # stage times missing a stage: drawn without them, not a KeyError
    partial = tmp_path / "partial.json"
    partial.write_text(json.dumps({"rows": [{"concurrency": 1, "audio_s_per_s": 1.0,
                                             "ms_per_step": {"depth": 1.0, "talker": 2.0}}]}))
    assert bench_plot.read_runs(partial)[0].points[0].ms_per_step is None
    assert runner.invoke(cli.app, ["plot", str(partial), "--out", str(tmp_path / "p.svg")]).exit_code == 0
    assert (tmp_path / "p.svg").read_text().lstrip().startswith("<?xml")


def test_an_unreadable_results_file_is_named_where_it_breaks(tmp_path):
    """A bench JSON cut short (a copy, an edit) was reported at line 1, column 2, where JSON lines read
    its first line; a JSON lines file broken at a later line was reported at line 1 too."""
    cut = tmp_path / "bench.json"
    whole = json.dumps(gpu_result(), indent=2)
    cut.write_text(whole[:whole.index('"rows"')])
    result = runner.invoke(cli.app, ["plot", str(cut), "--out", str(tmp_path / "x.png")])
    line = whole[:whole.index('"rows"')].count("\n") + 1
    assert result.exit_code == 2 and f"{cut}: neither JSON (" in result.stderr, result.output
    assert f"line {line} column" in " ".join(result.stderr.split())
    torn = tmp_path / "peers.jsonl"
    torn.write_text("".join(json.dumps(line) + "\n" for line in PEER_LINES[:2]) + "\n" + '{"system": "x", "ba')
    result = runner.invoke(cli.app, ["plot", str(torn), "--out", str(tmp_path / "x.png")])
    assert result.exit_code == 2 and "nor JSON lines (line 4, column 17:" in " ".join(result.stderr.split())


def test_plot_makes_its_missing_folder_as_bench_plot_does(tmp_path):
    ours = tmp_path / "bench.json"
    ours.write_text(json.dumps(gpu_result()))
    result = runner.invoke(cli.app, ["plot", str(ours), "--out", str(tmp_path / "plots" / "x.png")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "plots" / "x.png").read_bytes().startswith(PNG_SIGNATURE)


def test_dollar_signs_in_the_title_and_run_names_are_drawn_as_text(tmp_path):
    """A pair of $ is matplotlib's math mode: a title with prices, or a run name, that is no valid TeX
    between them ended the plot with a traceback."""
    peers = tmp_path / "peers.jsonl"
    peers.write_text("".join(json.dumps(dict(line, system=f"{line['system']} $\\frac{{1}}{{$")) + "\n"
                             for line in PEER_LINES))
    result = runner.invoke(cli.app, ["plot", str(peers), "--out", str(tmp_path / "x.png"),
                                     "--title", "H200 at $2.50/h {vs $\\frac{1}{"])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "x.png").read_bytes().startswith(PNG_SIGNATURE)


@pytest.mark.parametrize("name", ["p.txt", "pdir"])
def test_a_plot_name_without_a_picture_format_is_refused_before_anything_runs(tmp_path, name):
    ours = tmp_path / "bench.json"
    ours.write_text(json.dumps(gpu_result()))
    message = f"the plot {tmp_path / name}: its name must end in .png, .svg, .pdf"
    result = runner.invoke(cli.app, ["plot", str(ours), "--out", str(tmp_path / name)])
    assert result.exit_code == 2 and message in " ".join(result.stderr.split()), result.output
    result = runner.invoke(cli.app, ["bench", "--device", "cpu", "--json", str(tmp_path / "b.json"),
                                     "--plot", str(tmp_path / name)])
    assert result.exit_code == 2 and message in " ".join(result.stderr.split()), result.output
    assert not (tmp_path / "b.json").exists() and list(tmp_path.iterdir()) == [ours]   # the bench never ran


def test_a_stdout_closed_early_leaves_bench_its_own_exit_status(tmp_path):
    """`tts bench ... | true`: the reader went before the table; the results are written all the same, and the
    status is the bench's (rich's own handling of the closed pipe would end it with 1)."""
    results = tmp_path / "b.json"
    read_end, write_end = os.pipe()
    os.close(read_end)   # nobody reads: writing the table meets EPIPE
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    env.pop("TTS_MODEL", None)
    try:
        process = subprocess.Popen([sys.executable, "-m", "tts_cli", "bench", "--device", "cpu", "--concurrency", "1",
                                    "--requests", "1", "--frames", "8", "--json", str(results)],
                                   env=env, stdout=write_end, stderr=subprocess.PIPE, text=True)
    finally:
        os.close(write_end)
    _, stderr = process.communicate(timeout=300)
    assert process.returncode == 0, stderr
    assert "Traceback" not in stderr and "Error" not in stderr
    assert [row["concurrency"] for row in json.loads(results.read_text())["rows"]] == [1]


def test_writing_the_results_removes_the_temporary_file_of_a_bench_killed_mid_write(tmp_path):
    """A bench killed by SIGKILL while writing its JSON leaves `.NAME.PID.tmp` beside it (write_atomically
    has no chance to remove it): the next write removes it, not one of a process still running."""
    from tts_cli.bench import write_json
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(gone.stdout)
    path = tmp_path / "bench.json"
    killed = tmp_path / f".bench.json.{dead_pid}.tmp"
    running = tmp_path / f".bench.json.{os.getppid()}.tmp"
    other = tmp_path / f".other.json.{dead_pid}.tmp"
    for leftover in (killed, running, other):
        leftover.write_text("{")
    write_json({"rows": []}, path)
    assert json.loads(path.read_text()) == {"rows": []}
    assert not killed.exists()
    assert running.exists() and other.exists()
