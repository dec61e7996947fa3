"""Where a kernel's warps stall, from Nsight Compute's per-instruction samples: the share of each
stall reason over the whole kernel, the instructions with the most samples (with their top
reason), and optionally the share of address ranges (a loop found in that list, say).

On the device (ncu is in /usr/local/cuda/bin there), one launch of the kernel, then its source page:

    ncu -k regex:_depth_frame -s 2 -c 1 --set full --import-source yes -o $OUT/depth \\
        python3 tools/depth_bench.py --rows 64 --replays 3 --no-breakdown
    ncu -i $OUT/depth.ncu-rep --page source --csv --print-source sass > $OUT/depth-sass.csv

Here:

    python tools/ncu_summary.py depth-sass.csv [--top 30] [--range b9a00-b9e00 ...]

Addresses in --range are the last five hex digits, as the list prints them. Under ncu the SM
clock is held at its base (1.38 GHz on the H200), so its durations are longer than a graph
replay's; the shares are what this tool is for.
"""
from __future__ import annotations

import argparse
import csv

SAMPLES = "Warp Stall Sampling (All Samples)"
ADDRESS_DIGITS = 5


def read(path: str) -> list[dict[str, str]]:
    """The per-instruction rows of an ncu source-page CSV (its first line names the kernel)."""
    with open(path, newline="") as f:
        lines = list(csv.reader(f))
    header = next(i for i, line in enumerate(lines) if line and line[0] == "Address")
    names = lines[header]
    return [dict(zip(names, line)) for line in lines[header + 1:] if len(line) == len(names)]


def short_address(row: dict[str, str]) -> int:
    return int(row["Address"], 16) % 16 ** ADDRESS_DIGITS


def count(row: dict[str, str], name: str) -> int:
    return int(row.get(name) or 0)


def total_samples(rows: list[dict[str, str]]) -> int:
    return sum(count(row, SAMPLES) for row in rows)


def stall_reasons(rows: list[dict[str, str]]) -> list[str]:
    """The stall columns (each sample counted once: not the Not Issued repeats)."""
    return [name for name in rows[0] if name.startswith("stall_") and "Not Issued" not in name]


def stall_shares(rows: list[dict[str, str]]) -> dict[str, float]:
    """Each stall reason's share of all samples, largest first."""
    total = total_samples(rows)
    sums = {reason[len("stall_"):]: sum(count(row, reason) for row in rows) for reason in stall_reasons(rows)}
    return {reason: n / total for reason, n in sorted(sums.items(), key=lambda item: -item[1]) if n}


def range_share(rows: list[dict[str, str]], first: int, end: int) -> float:
    """The share of all samples at addresses first <= a < end (short addresses)."""
    return sum(count(row, SAMPLES) for row in rows if first <= short_address(row) < end) / total_samples(rows)


def hottest(rows: list[dict[str, str]], top: int) -> list[tuple[int, float, str, str]]:
    """(short address, share of samples, top stall reason, instruction) of the `top` instructions
    with the most samples."""
    total, reasons = total_samples(rows), stall_reasons(rows)
    ranked = sorted(rows, key=lambda row: -count(row, SAMPLES))[:top]
    return [(short_address(row), count(row, SAMPLES) / total,
             max(reasons, key=lambda reason: count(row, reason))[len("stall_"):], row["Source"].strip())
            for row in ranked if count(row, SAMPLES)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("csv", help="ncu --page source --csv --print-source sass output")
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--range", nargs="*", default=[], metavar="FIRST-END", help="hex, last five digits")
    args = parser.parse_args(argv)
    rows = read(args.csv)
    print(f"{total_samples(rows)} samples over {len(rows)} instructions")
    for reason, share in stall_shares(rows).items():
        print(f"  {reason:20s} {100 * share:5.1f}%")
    for span in args.range:
        first, end = (int(v, 16) for v in span.split("-"))
        print(f"{span}: {100 * range_share(rows, first, end):.1f}% of the samples")
    for address, share, reason, source in hottest(rows, args.top):
        print(f"  {address:05x} {100 * share:5.1f}% {reason:17s} {source[:90]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
