"""Where each Python thread of a run spent its time, from py-spy's raw output (collapsed stacks:
one stack per line, frames joined by ';', then its sample count).

    py-spy record --format raw --threads --idle --rate 200 -o run.txt -- python3 -m tts_cli synth ...
    python3 tools/pyspy_summary.py run.txt [--top 12] [--match tts_cli/ --match tts_kernels/]

Per thread: its samples, then the functions its samples were in, by self (the innermost frame:
with --idle, a thread waiting on a lock or an event shows the waiting call) and inclusive (any
frame of the stack, counted once per sample) for the files whose path contains a --match
string, then the self samples of those files by line (which line of a function holds them: a
native call that releases the GIL, such as a large numpy copy, has no frame of its own). Built
to say why `tts synth`'s engine thread leaves the GPU idle between steps (docs/bench.md, "Where
the synthesis wall goes"): the time it spends waiting for CUDA events against the time it spends
in the host's work, and what the other threads do meanwhile.
"""
from __future__ import annotations

import argparse
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

THREAD = re.compile(r"thread \((\w+)\)(?::\s*(.*))?$")
FRAME = re.compile(r"^(?P<func>.*) \((?P<file>[^()]*?)(?::\d+)?\)$")


@dataclass
class Thread:
    tid: str
    name: str = ""
    samples: int = 0
    self_frames: Counter = field(default_factory=Counter)
    self_lines: Counter = field(default_factory=Counter)   # the innermost frame with its line
    inclusive: Counter = field(default_factory=Counter)


def frame_key(frame: str) -> str:
    """'func (file:line)' -> 'func (file)': a function's samples summed over its lines."""
    match = FRAME.match(frame.strip())
    return f"{match['func']} ({match['file']})" if match else frame.strip()


def parse(text: str) -> dict[str, Thread]:
    """The threads of a raw py-spy profile, by thread id."""
    threads: dict[str, Thread] = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            raise ValueError(f"line {number} is not 'stack count': {line[:80]!r}")
        head, *frames = stack.split(";")
        match = THREAD.match(head.strip())
        if match is None:
            raise ValueError(f"line {number} does not start with a thread (py-spy's --threads): {head[:80]!r}")
        thread = threads.setdefault(match[1], Thread(match[1]))
        thread.name = thread.name or (match[2] or "").strip()   # py-spy names a thread on some lines only
        samples = int(count)
        thread.samples += samples
        keys = [frame_key(f) for f in frames if f.strip()]
        thread.self_frames[keys[-1] if keys else "(no Python frame)"] += samples
        if keys:
            thread.self_lines[frames[-1].strip()] += samples
        for key in set(keys):
            thread.inclusive[key] += samples
    return threads


def summary(threads: dict[str, Thread], top: int, matches: list[str]) -> str:
    total = sum(t.samples for t in threads.values()) or 1
    lines = []
    for thread in sorted(threads.values(), key=lambda t: -t.samples):
        lines.append(f"thread {thread.name or '?'} ({thread.tid}): {thread.samples} samples, "
                     f"{thread.samples / total:.1%} of all")
        lines.append("  self:")
        for key, n in thread.self_frames.most_common(top):
            lines.append(f"    {n / thread.samples:6.1%}  {key}")
        ours = [(key, n) for key, n in thread.inclusive.most_common() if any(m in key for m in matches)][:top]
        if ours:
            lines.append(f"  inclusive ({', '.join(matches)}):")
            for key, n in ours:
                lines.append(f"    {n / thread.samples:6.1%}  {key}")
        own_lines = [(key, n) for key, n in thread.self_lines.most_common() if any(m in key for m in matches)][:top]
        if own_lines:
            lines.append(f"  self, by line ({', '.join(matches)}):")
            for key, n in own_lines:
                lines.append(f"    {n / thread.samples:6.1%}  {key}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("profile", type=Path, help="py-spy record --format raw --threads output")
    parser.add_argument("--top", type=int, default=12, help="functions listed per thread and kind")
    parser.add_argument("--match", action="append", help="path parts of the files listed inclusively "
                                                         "(default: tts_cli/ and tts_kernels/)")
    args = parser.parse_args(argv)
    print(summary(parse(args.profile.read_text()), args.top, args.match or ["tts_cli/", "tts_kernels/"]))


if __name__ == "__main__":
    main()
