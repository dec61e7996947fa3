"""The GPU memory of `tts synth`'s engine per slot count: its peak beside the weights and the talker's keys and
values, allocated and reserved (the allocator's cache, what another process or a larger engine cannot have),
per slot. What STEP_BYTES_PER_SLOT (tts_cli.synthesizer) budgets for `--rows auto`.

    python3 tools/make_golden.py --build 1.7b-real --ckpt /tmp/ck --corpus tts_cli/assets/harvard-sentences.txt
    PYTHONPATH=.:kernels python3 tools/slot_memory.py --model /tmp/ck --rows 512,1024 --frames 100

Each slot count runs in a process of its own (the allocator's cache would carry over): one synthesize call of
2 x rows requests of the bundled Harvard sentences, every one forced to `--frames` frames, through an engine
of that many slots (its context as `tts synth` sizes it). An engine that runs out of memory is reported as such.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

GIB, MIB = 2**30, 2**20
SENTENCES = Path(__file__).resolve().parents[1] / "tts_cli" / "assets" / "harvard-sentences.txt"


def measure(model: str, rows: int, frames: int) -> str:
    import torch

    from tts_cli.engine.slots import talker_kv_bytes
    from tts_cli.request import Request
    from tts_cli.synthesizer import Synthesizer

    synth = Synthesizer.from_pretrained(model, device="cuda", engine=True, engine_rows=rows)
    torch.cuda.synchronize()
    weights = torch.cuda.memory_allocated()
    lines = [line.strip() for line in SENTENCES.read_text().splitlines() if line.strip()]
    requests = [Request(id=str(i), text=lines[i % len(lines)], speaker=synth.speakers[0], seed=i)
                for i in range(2 * rows)]
    torch.cuda.reset_peak_memory_stats()
    try:
        synth.synthesize(requests, max_frames=frames, min_new_tokens=frames + 1)
    except torch.cuda.OutOfMemoryError as e:
        return (f"rows {rows}: out of memory at a peak of {torch.cuda.max_memory_allocated() / GIB:.2f} GiB "
                f"allocated ({str(e).splitlines()[0]})")
    engine = synth._engine_now
    kv = talker_kv_bytes(synth.cfg, rows, engine.context, synth.model.talker.codec_embedding.weight.dtype,
                         engine.state.trailing_text is not None)
    allocated, reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
    return (f"rows {rows}: context {engine.context}, weights {weights / GIB:.2f} GiB, keys and values {kv / GIB:.2f}; "
            f"peak allocated {allocated / GIB:.2f} GiB ({(allocated - weights - kv) / rows / MIB:.2f} MiB a slot "
            f"beside them), reserved {reserved / GIB:.2f} ({(reserved - weights - kv) / rows / MIB:.2f} MiB a slot)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a checkpoint folder (make_golden.py --build 1.7b-real)")
    parser.add_argument("--rows", default="512,1024", help="slot counts, comma-separated")
    parser.add_argument("--frames", type=int, default=100, help="frames every request is forced to")
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    if len(rows) == 1:
        import torch

        if not torch.cuda.is_available():
            print("slot_memory.py measures a CUDA device's memory: none is available", file=sys.stderr)
            return 2
        print(measure(args.model, rows[0], args.frames), flush=True)
        return 0
    status = 0
    for n in rows:   # a process each
        status |= subprocess.run([sys.executable, __file__, "--model", args.model, "--rows", str(n),
                                  "--frames", str(args.frames)]).returncode
    return status


if __name__ == "__main__":
    sys.exit(main())
