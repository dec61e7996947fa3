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
    assert [(r["arm"], r["bench_args"]) for r in runs][:2] == [("stream", []),
                                                               ("inline", ["--codec-in-line", "--codec-window", "2"])]
