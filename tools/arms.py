"""Alternated `tts bench` arms: trees of other commits, or of main with a prepared patch, timed
against each other in one device run (docs/bench.md: arms alternate within one loan, because
loans differ by ~1%).

Here, before the device run (the trees travel in the working tree: carry `.arms`):

    python tools/arms.py prepare main=. epilogue=HEAD+/tmp/gemv-epilogue.patch
    python tools/arms.py prepare stream=. "inline=.::--codec-in-line"     # one tree, two settings

On the device, from the repository root (Python packages the device lacks: see
/work/.library/device/README.md on carrying wheels):

    python3 tools/arms.py bench --concurrency 1,64 --repeats 2 [--arms main,epilogue] --out $OUT [-- EXTRA ARGS]

Each arm is a tree `.arms/NAME` (git archive of the commit, then `git apply` of each patch), or
`.` for the working tree itself, with `tts bench` options of its own after `::` if any. A tree
leaves out the test fixtures, the golden records and docs (~10 of its 16 MB; what travels to the
device is limited to 64 MiB) unless `--with-tests`. The
bench runs every arm once per repeat, arms in the order given, and writes one JSON of every run
(audio-s/s, ms per step, slots busy) to OUT/arms.json, each run's log appended to OUT/arms.log,
and a summary table to stdout.
"""
from __future__ import annotations

import argparse
import json
import os
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


def tree_of(name: str, described: dict) -> Path:
    return ROOT if described[name]["commit"] == "." else ARMS / name


def prepare(specs: list[str], with_tests: bool) -> None:
    """specs: NAME=REV[+PATCH[+PATCH...]], or NAME=. (the working tree), each optionally followed by
    ::OPTIONS, `tts bench` options for that arm only (e.g. `inline=.::--codec-in-line`)."""
    shutil.rmtree(ARMS, ignore_errors=True)
    ARMS.mkdir()
    described = {}
    for spec in specs:
        name, _, source = spec.partition("=")
        source, _, options = source.partition("::")
        bench_args = shlex.split(options)
        if source == ".":
            described[name] = {"commit": ".", "patches": [], "bench_args": bench_args}
            print(" ".join([f"{name}: the working tree", *bench_args]))
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
        described[name] = {"commit": commit, "patches": patches, "bench_args": bench_args}
        print(" ".join([f"{name}: {commit}", " + ".join(patches), *bench_args]).rstrip())
    (ARMS / "arms.json").write_text(json.dumps(described, indent=1) + "\n")


def bench(concurrency: str, repeats: int, out: Path, extra: list[str], only: list[str] | None = None) -> None:
    described = json.loads((ARMS / "arms.json").read_text())
    if only:
        unknown = set(only) - set(described)
        if unknown:
            raise SystemExit(f"no such arms: {', '.join(sorted(unknown))} (prepared: {', '.join(described)})")
        described = {name: described[name] for name in only}
    out.mkdir(parents=True, exist_ok=True)
    runs = []
    with open(out / "arms.log", "a") as log:
        for repeat in range(repeats):
            for name in described:
                tree = tree_of(name, described)
                env = dict(os.environ, PYTHONPATH=os.pathsep.join(
                    [str(tree), str(tree / "kernels")] + os.environ.get("PYTHONPATH", "").split(os.pathsep)))
                with tempfile.TemporaryDirectory() as tmp:
                    result = Path(tmp) / "bench.json"
                    log.write(f"== {name} repeat {repeat}\n")
                    log.flush()
                    status = subprocess.run([sys.executable, "-m", "tts_cli", "bench", "--concurrency", concurrency,
                                             "--json", str(result)] + described[name].get("bench_args", []) + extra,
                                            cwd=tree, env=env, stdout=log,
                                            stderr=subprocess.STDOUT).returncode
                    rows = json.loads(result.read_text())["rows"] if status == 0 else []
                for row in rows or [{}]:
                    runs.append(dict(arm=name, repeat=repeat, status=status, **described[name], **row))
                    print(f"{name:16s} r{repeat} c{row.get('concurrency', '?'):<4} "
                          f"{row.get('audio_s_per_s', 'failed')!s:>8} audio-s/s  {row.get('ms_per_step', '')}",
                          flush=True)
    (out / "arms.json").write_text(json.dumps(dict(extra_args=extra, runs=runs), indent=1) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("prepare", help="build the arms' trees under .arms/")
    p.add_argument("specs", nargs="+", help="NAME=REV[+PATCH...] or NAME=.")
    p.add_argument("--with-tests", action="store_true", help="keep the test fixtures, golden records and docs")
    b = commands.add_parser("bench", help="run tts bench in every arm, alternated")
    b.add_argument("--concurrency", default="1,64")
    b.add_argument("--repeats", type=int, default=2)
    b.add_argument("--arms", help="only these arms, in this order (comma-separated); default: all prepared")
    b.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "arms-out")))
    b.add_argument("extra", nargs="*", help="more `tts bench` arguments (after --)")
    args = parser.parse_args()
    if args.command == "prepare":
        prepare(args.specs, args.with_tests)
    else:
        bench(args.concurrency, args.repeats, args.out, args.extra, args.arms.split(",") if args.arms else None)


if __name__ == "__main__":
    main()
