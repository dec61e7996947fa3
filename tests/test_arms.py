"""tools/arms.py's trees (the alternated bench itself runs on the device, docs/bench.md)."""
import difflib
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_arms_prepare_builds_patched_trees_of_a_commit_without_the_test_fixtures(tmp_path, monkeypatch):
    sys.path.insert(0, str(ROOT / "tools"))
    import arms
    monkeypatch.setattr(arms, "ARMS", tmp_path / "arms")
    readme = subprocess.run(["git", "-C", str(ROOT), "show", "HEAD:README.md"], check=True, capture_output=True,
                            text=True).stdout.splitlines(keepends=True)
    patch = tmp_path / "title.patch"
    patch.write_text("".join(difflib.unified_diff(readme, ["# patched\n"] + readme[1:], "a/README.md", "b/README.md")))
    arms.prepare(["here=.", f"patched=HEAD+{patch}"], with_tests=False)
    tree = tmp_path / "arms" / "patched"
    assert (tree / "README.md").read_text().splitlines()[0] == "# patched"
    assert (tree / "kernels" / "tts_kernels" / "linear.py").is_file()
    assert not (tree / "tests" / "fixtures").exists() and not (tree / "docs").exists()
    described = json.loads((tmp_path / "arms" / "arms.json").read_text())
    assert described["here"]["commit"] == "." and arms.tree_of("here", described) == ROOT
    assert described["patched"]["patches"] == [str(patch)]
    assert not (tmp_path / "arms" / "here").exists()


def test_arms_bench_gives_each_arm_its_own_options_after_the_common_ones(tmp_path, monkeypatch):
    """`NAME=SOURCE::OPTIONS`: one tree, two settings of `tts bench`, alternated."""
    sys.path.insert(0, str(ROOT / "tools"))
    import arms
    monkeypatch.setattr(arms, "ARMS", tmp_path / "arms")
    arms.prepare(["stream=.", "inline=.::--codec-in-line --codec-window 2"], with_tests=False)
    commands = []

    def fake_bench(command, **kwargs):   # writes the rows `tts bench --json` would
        commands.append(command)
        Path(command[command.index("--json") + 1]).write_text(json.dumps({"rows": [{"concurrency": 64}]}))
        return subprocess.CompletedProcess(command, 0)

    monkeypatch.setattr(arms.subprocess, "run", fake_bench)
    arms.bench("64", 2, tmp_path / "out", ["--requests", "8"])
    options = [command[command.index("--json") + 2:] for command in commands]
    assert options == [["--requests", "8"], ["--codec-in-line", "--codec-window", "2", "--requests", "8"]] * 2
    runs = json.loads((tmp_path / "out" / "arms.json").read_text())["runs"]
    assert [(r["arm"], r["args"]) for r in runs][:2] == [("stream", []),
                                                               ("inline", ["--codec-in-line", "--codec-window", "2"])]


def test_arms_synth_warms_up_then_alternates_the_arms_and_counts_the_files_that_differ(tmp_path, monkeypatch):
    """One warm-up run of the first arm on the manifest's first rows, then every arm per repeat in
    its own environment, each into a fresh folder; each run's report recorded with how many of its
    WAVs differ, byte for byte, from the first run's."""
    sys.path.insert(0, str(ROOT / "tools"))
    import arms
    monkeypatch.setattr(arms, "ARMS", tmp_path / "arms")
    arms.prepare(["main=.", "trim=.::MALLOC_TRIM_THRESHOLD_=1073741824 --rows 64"], with_tests=False)
    manifest = tmp_path / "m.txt"
    manifest.write_text("".join(f"r{i}\tline {i}\n" for i in range(5)))
    calls = []

    def fake_synth(command, cwd, env, **kwargs):   # writes what `tts synth` would: WAVs and report.json
        rows = Path(command[command.index("synth") + 1]).read_text().splitlines()
        out = Path(command[command.index("--out") + 1])
        calls.append((out.name, len(rows), env.get("MALLOC_TRIM_THRESHOLD_"), command[command.index("--model") + 2:],
                      sorted(p.name for p in out.glob("*")) if out.exists() else None))
        out.mkdir(parents=True, exist_ok=True)
        for i in range(len(rows)):   # the trim arm's r1 and r3 come out different
            (out / f"r{i}.wav").write_bytes(b"RIFF" + bytes([i + (i % 2 and "trim" in out.name)]))
        (out / "report.json").write_text(json.dumps({"totals": {"audio_seconds_per_second": 10.0 + len(calls)},
                                                     "synthesis": {"steps": 4}}))
        return subprocess.CompletedProcess(command, 0)

    monkeypatch.setattr(arms.subprocess, "run", fake_synth)
    work = tmp_path / "work"
    (work / "main-r0").mkdir(parents=True)
    (work / "main-r0" / "stale.wav").write_bytes(b"old")   # an earlier run's output: not resumed
    arms.synth(manifest, "CKPT", 2, tmp_path / "out", work, ["--max-frames", "4"], warm_up=3)
    assert calls == [("warm-up", 3, None, ["--max-frames", "4"], None),
                     ("main-r0", 5, None, ["--max-frames", "4"], None),
                     ("trim-r0", 5, "1073741824", ["--rows", "64", "--max-frames", "4"], None),
                     ("main-r1", 5, None, ["--max-frames", "4"], None),
                     ("trim-r1", 5, "1073741824", ["--rows", "64", "--max-frames", "4"], None)]
    runs = json.loads((tmp_path / "out" / "arms.json").read_text())["runs"]
    assert [(r["arm"], r["repeat"], r["files_differing"]) for r in runs] == [
        ("main", 0, 0), ("trim", 0, 2), ("main", 1, 0), ("trim", 1, 2)]
    assert [r["totals"]["audio_seconds_per_second"] for r in runs] == [12.0, 13.0, 14.0, 15.0]
    assert runs[1]["env"] == {"MALLOC_TRIM_THRESHOLD_": "1073741824"} and runs[0]["synthesis"] == {"steps": 4}
