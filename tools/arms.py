"""Alternated `tts bench` or `tts synth` arms: trees of other commits, or of main with a prepared
patch, timed against each other in one device run (docs/bench.md: arms alternate within one loan,
because loans differ by ~1%).

Here, before the device run (the trees travel in the working tree: carry `.arms`):

    python tools/arms.py prepare main=. epilogue=HEAD+/tmp/gemv-epilogue.patch
    python tools/arms.py prepare stream=. "inline=.::--codec-in-line"     # one tree, two settings
    python tools/arms.py prepare main=. "trim=.::MALLOC_TRIM_THRESHOLD_=1073741824"   # and an environment

On the device, from the repository root (Python packages the device lacks: see
/work/.library/device/README.md on carrying wheels):

    python3 tools/arms.py bench --concurrency 1,64 --repeats 2 [--arms main,epilogue] --out $OUT [-- EXTRA ARGS]
    python3 tools/arms.py synth MANIFEST --model CKPT --repeats 2 --out $OUT -- --max-frames 100 --no-wer

Each arm is a tree `.arms/NAME` (git archive of the commit, then `git apply` of each patch), or
`.` for the working tree itself, with options of its own after `::` if any: arguments for the
command (`tts bench` or `tts synth`), and NAME=VALUE words, environment variables for its runs. A
tree leaves out the test fixtures, the golden records and docs (~10 of its 16 MB; what travels to
the device is limited to 64 MiB) unless `--with-tests`. Every arm runs once per repeat, arms in the
order given, each run's log appended to OUT/arms.log; one JSON of every run goes to OUT/arms.json
and a summary line per run to stdout. `bench` records audio-s/s, ms per step and slots busy.
`synth` first runs the first arm once on the manifest's first `--warm-up` rows (not recorded: a
fresh machine's first process compiles the kernels), writes each run's output under `--work`, and
records its report's totals and `synthesis` block and how many of its output files differ, byte
for byte, from the first recorded run's.
"""
from __future__ import annotations

import argparse
import filecmp
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARMS = ROOT / ".arms"


# what a bench-only tree leaves out
NOT_FOR_BENCH = ["tests/fixtures", "tts_cli/assets/golden", "docs"]
ENVIRONMENT_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")


def tree_of(name: str, described: dict) -> Path:
    return ROOT if described[name]["commit"] == "." else ARMS / name


def prepare(specs: list[str], with_tests: bool) -> None:
    """specs: NAME=REV[+PATCH[+PATCH...]], or NAME=. (the working tree), each optionally followed by
    ::OPTIONS for that arm only: command arguments (e.g. `inline=.::--codec-in-line`) and NAME=VALUE
    environment variables."""
    shutil.rmtree(ARMS, ignore_errors=True)
    ARMS.mkdir()
    described = {}
    for spec in specs:
        name, _, source = spec.partition("=")
        source, _, options = source.partition("::")
        words = shlex.split(options)
        env = dict(word.split("=", 1) for word in words if ENVIRONMENT_WORD.match(word))
        args = [word for word in words if not ENVIRONMENT_WORD.match(word)]
        if source == ".":
            described[name] = {"commit": ".", "patches": [], "args": args, "env": env}
            print(" ".join([f"{name}: the working tree", *words]))
            continue
        rev, *patches = source.split("+")
        tree = ARMS / name
        tree.mkdir()
        left_out = [] if with_tests else NOT_FOR_BENCH
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "--", "."]
                                 + [f":(exclude){path}" for path in left_out], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
        for patch in patches:
            # the tree lies inside this repository: keep git from finding it (it would apply the
            # patch to the repository's paths, and ignore those outside the tree: all of them)
            subprocess.run(["git", "apply"] + [f"--exclude={path}/*" for path in left_out]
                           + [str((ROOT / patch).resolve())], cwd=tree, check=True,
                           env=dict(os.environ, GIT_CEILING_DIRECTORIES=str(ARMS)))
        commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", rev], check=True,
                                capture_output=True, text=True).stdout.strip()
        described[name] = {"commit": commit, "patches": patches, "args": args, "env": env}
        print(" ".join([f"{name}: {commit}", " + ".join(patches), *words]).rstrip())
    (ARMS / "arms.json").write_text(json.dumps(described, indent=1) + "\n")


def prepared(only: list[str] | None) -> dict:
    described = json.loads((ARMS / "arms.json").read_text())
    if only:
        unknown = set(only) - set(described)
        if unknown:
            raise SystemExit(f"no such arms: {', '.join(sorted(unknown))} (prepared: {', '.join(described)})")
        described = {name: described[name] for name in only}
    return described


def run_tts(name: str, described: dict, command: list[str], extra: list[str], log) -> int:
    """`python -m tts_cli COMMAND... ARM_ARGS EXTRA...` in the arm's tree and environment, its output to log."""
    tree = tree_of(name, described)
    env = dict(os.environ, **described[name]["env"], PYTHONPATH=os.pathsep.join(
        [str(tree), str(tree / "kernels")] + os.environ.get("PYTHONPATH", "").split(os.pathsep)))
    command = [*command, *described[name]["args"], *extra]
    log.write(f"== {name}: {shlex.join(command)}\n")
    log.flush()
    return subprocess.run([sys.executable, "-m", "tts_cli", *command], cwd=tree, env=env, stdout=log,
                          stderr=subprocess.STDOUT).returncode


def bench(concurrency: str, repeats: int, out: Path, extra: list[str], only: list[str] | None = None) -> None:
    described = prepared(only)
    out.mkdir(parents=True, exist_ok=True)
    runs = []
    with open(out / "arms.log", "a") as log:
        for repeat in range(repeats):
            for name in described:
                with tempfile.TemporaryDirectory() as tmp:
                    result = Path(tmp) / "bench.json"
                    status = run_tts(name, described, ["bench", "--concurrency", concurrency, "--json", str(result)],
                                     extra, log)
                    rows = json.loads(result.read_text())["rows"] if status == 0 else []
                for row in rows or [{}]:
                    runs.append(dict(arm=name, repeat=repeat, status=status, **described[name], **row))
                    print(f"{name:16s} r{repeat} c{row.get('concurrency', '?'):<4} "
                          f"{row.get('audio_s_per_s', 'failed')!s:>8} audio-s/s  {row.get('ms_per_step', '')}",
                          flush=True)
    (out / "arms.json").write_text(json.dumps(dict(extra_args=extra, runs=runs), indent=1) + "\n")


def synth(manifest: Path, model: str, repeats: int, out: Path, work: Path, extra: list[str],
          only: list[str] | None = None, warm_up: int = 512) -> None:
    described = prepared(only)
    out.mkdir(parents=True, exist_ok=True)
    manifest, work = manifest.resolve(), work.resolve()
    model = str(Path(model).resolve()) if Path(model).exists() else model   # (the runs start in their trees)
    runs = []
    with open(out / "arms.log", "a") as log:
        if warm_up:
            lines = manifest.read_text().splitlines(keepends=True)
            shutil.rmtree(work / "warm-up", ignore_errors=True)   # an earlier output would be resumed, not redone
            work.mkdir(parents=True, exist_ok=True)
            (work / "warm-up.txt").write_text("".join(lines[:warm_up]))
            first = next(iter(described))
            status = run_tts(first, described, ["synth", str(work / "warm-up.txt"), "--out", str(work / "warm-up"),
                                                "--model", model], extra, log)
            print(f"warm-up ({first}, {min(warm_up, len(lines))} rows): exit {status}", flush=True)
        for repeat in range(repeats):
            for name in described:
                folder = work / f"{name}-r{repeat}"
                shutil.rmtree(folder, ignore_errors=True)
                status = run_tts(name, described, ["synth", str(manifest), "--out", str(folder), "--model", model],
                                 extra, log)
                report = folder / "report.json"
                report = json.loads(report.read_text()) if report.is_file() else {}
                run = dict(arm=name, repeat=repeat, status=status, folder=str(folder), **described[name],
                           totals=report.get("totals", {}), synthesis=report.get("synthesis"))
                run["files_differing"] = differing(Path(runs[0]["folder"]), folder) if runs else 0
                runs.append(run)
                print(f"{name:16s} r{repeat} exit {status} {run['totals'].get('audio_seconds_per_second', '-')!s:>8} "
                      f"audio-s/s  wall {run['totals'].get('wall_seconds', '-')} s  "
                      f"{run['files_differing']} files differ from {runs[0]['arm']} r0", flush=True)
    (out / "arms.json").write_text(json.dumps(dict(extra_args=extra, runs=runs), indent=1) + "\n")


def differing(first: Path, other: Path) -> int:
    """How many audio files of `first` are missing from `other` or differ byte for byte."""
    files = [p.relative_to(first) for p in first.rglob("*") if p.suffix in {".wav", ".flac", ".mp3", ".parquet"}]
    return sum(not (other / f).is_file() or not filecmp.cmp(first / f, other / f, shallow=False) for f in files)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     epilog="bench and synth: arguments after `--` go to every run's command")
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("prepare", help="build the arms' trees under .arms/")
    p.add_argument("specs", nargs="+", help="NAME=REV[+PATCH...] or NAME=.")
    p.add_argument("--with-tests", action="store_true", help="keep the test fixtures, golden records and docs")
    b = commands.add_parser("bench", help="run tts bench in every arm, alternated")
    b.add_argument("--concurrency", default="1,64")
    b.add_argument("--repeats", type=int, default=2)
    b.add_argument("--arms", help="only these arms, in this order (comma-separated); default: all prepared")
    b.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "arms-out")))
    s = commands.add_parser("synth", help="run tts synth of one manifest in every arm, alternated")
    s.add_argument("manifest", type=Path)
    s.add_argument("--model", required=True)
    s.add_argument("--repeats", type=int, default=2)
    s.add_argument("--warm-up", type=int, default=512, help="rows of the first arm's run before the recorded ones")
    s.add_argument("--arms", help="only these arms, in this order (comma-separated); default: all prepared")
    s.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "arms-out")))
    s.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "arms-synth",
                   help="where the runs' outputs go (one folder each)")
    # what follows `--` goes to every run's `tts bench` or `tts synth` (split here: argparse would
    # give it to synth's manifest positional's group and then refuse the `--`)
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    args = parser.parse_args(argv[:len(argv) - len(extra) - 1] if "--" in argv else argv)
    only = args.arms.split(",") if getattr(args, "arms", None) else None
    if args.command == "prepare":
        prepare(args.specs, args.with_tests)
    elif args.command == "bench":
        bench(args.concurrency, args.repeats, args.out, extra, only)
    else:
        synth(args.manifest, args.model, args.repeats, args.out, args.work, extra, only, args.warm_up)


if __name__ == "__main__":
    main()
