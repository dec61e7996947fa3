"""The slot engine (runner, step, slots, prefill). This module imports no torch: the CLI reads its
defaults here without loading the engine."""
from fractions import Fraction

# The codec runs every K decode steps over the last K frames (the engine's codec window). Measured on
# the H200 (random 1.7B, docs/bench.md at 0bca9b7): bf16, 2026-11-29, K = 4 gave c64 362.8 audio-s/s
# against 247.7 at K = 1 and 376.1 at K = 8, for 3 more steps of first-audio latency (K = 8: 7 more);
# fp16, 2026-11-30, K = 4 / 8: c64 624.2, 624.5 / 627.3, 627.5 (first audio 38 / 69 ms), c8 119.1 / 117.9.
DEFAULT_CODEC_WINDOW = 4
# At one row the window closes as soon as the row stops (no other slot keeps it open), so a larger K
# costs no idle window, only first-audio latency and one step per request that ends inside a window
# (the host learns of the stop a step late): c1 K = 4 / 8 / 16: 18.0 / 18.7 / 19.0 audio-s/s,
# first audio 17 / 33 / 64 ms (docs/bench.md at 0bca9b7, 2026-11-30).
ONE_ROW_CODEC_WINDOW = 16
CODEC_WINDOW_RULE = f"{ONE_ROW_CODEC_WINDOW} at one row, else {DEFAULT_CODEC_WINDOW}"   # codec_window_for, said


def codec_window_for(rows: int) -> int:
    """The codec window K when none is given, for an engine of `rows` slots."""
    return ONE_ROW_CODEC_WINDOW if rows == 1 else DEFAULT_CODEC_WINDOW


# On CUDA the codec runs on a stream of its own beside the next window's steps up to this many rows,
# in line after them above. H200, random 1.7B fp16, alternated (docs/bench.md): its own stream won
# at c1 (27.25-27.46 against 26.77 audio-s/s) and c64 (701.0 against 696.2), and lost at c128
# (874.3, 844.8 against 878.2, 875.9 in line) and c256 (984.1, 954.5 against 1003.0, 1001.2), where
# the code predictor's loop of wide kernels and the codec's blocks contend for the SMs.
CODEC_STREAM_MAX_ROWS = 64
CODEC_STREAM_RULE = f"on CUDA up to {CODEC_STREAM_MAX_ROWS} rows, else in line"   # codec_stream_for, said


def codec_stream_for(rows: int, cuda: bool) -> bool:
    """Whether the codec runs on its own CUDA stream when the caller does not say, for `rows` slots."""
    return cuda and rows <= CODEC_STREAM_MAX_ROWS


# From this many GEMM rows up, cuBLAS gave every projection of the talker and code predictor the same
# sums for a row whatever the product's rows (probed on the H200 from 2048 down to 256, 2026-12-04;
# at 128 the two down projections differed): the least rows of a GEMM whose shape may vary.
INVARIANT_GEMM_ROWS = 256
# ... and up to this many: a prefill tile holds at most these GEMM rows (64 prompts x 32 positions), so
# that an engine of more than 512 slots prefills in the tile sizes probed.
MAX_PREFILL_GEMM_ROWS = 2048
# The codec's cuBLAS GEMMs (F.linear, addmm: its transformer and upsampling blocks, 4 to 16 GEMM rows
# per engine row) run on at most this many engine rows at once: at 1024 the [4096, 1024] one at
# M = 16384 gave a row other sums by its position (H200, 2026-12-04, docs/bench.md), while up to 512
# every one of them gives a row the same sums anywhere (tests/test_gpu.py). A step of more rows runs
# each in blocks of these rows (the last padded), a tail step pads to them (step.PaddedGEMMs,
# codec_gemm_scale).
CODEC_GEMM_ROWS = 512


def codec_gemm_scale(engine_rows: int, step_rows: int) -> Fraction:
    """The codec's GEMM rows in a step of `step_rows` of an engine of `engine_rows` slots, as a
    multiple of the step's own (PaddedGEMMs' `scale`): 1 where they are the same."""
    return Fraction(min(engine_rows, CODEC_GEMM_ROWS), step_rows)


# Once a run's queue is empty, the requests still speaking are moved at a window boundary into the
# first rows / 2 (then rows / 4 ...) slots, and the steps run on graphs of that many rows: the ragged
# end of a run then steps half-empty graphs at most, not a 512-row graph for a few rows. A row's
# numbers must stay those of the full step (batch invariance), so: not below TAIL_MIN_ROWS, down to
# which every kernel of ours picks its variant as at more rows (the attention kernels by rows up to
# 64); the talker's and code predictor's projections on cuBLAS (at 64 rows they would take
# gemm_rows) with their GEMMs (M = rows) padded to INVARIANT_GEMM_ROWS, and the code predictor's loop
# (not the persistent kernel); the codec's GEMMs (F.linear, addmm) padded to the full step's shapes:
# without that, a 128-row tail of a 256-row engine gave a seeded row the same codes and other PCM
# (tests/test_gpu.py on the H200, 2026-12-04). Down to 64 rather than 128: priced by
# tools/slot_occupancy.py --tail-min-rows 64 (CPU, 2026-12-05) at c128 1021 -> 1060, c256 1275 -> 1332,
# c512 1666 -> 1687 audio-s/s (slots busy 86 -> 91%, 85 -> 90%, 92 -> 93%).
TAIL_MIN_ROWS = 64


def tail_rows_for(rows: int, cuda: bool) -> tuple[int, ...]:
    """The tails' row counts of an engine of `rows` slots (largest first): on CUDA, rows / 2, rows / 4
    ... down to TAIL_MIN_ROWS; none elsewhere (off CUDA the engine is a reference, not a speed path)."""
    tails = []
    while cuda and rows % 2 == 0 and rows // 2 >= TAIL_MIN_ROWS:
        rows //= 2
        tails.append(rows)
    return tuple(tails)


# A prefill chunk's positions at most (prefill.py): the attention kernel's tokens per row.
PREFILL_COLUMNS = 32


# The prefill's packed tiles (prefill.py) hold rows x 4 tokens (the token rows of its earlier tiles of
# rows / 8 whole prompts of PREFILL_COLUMNS positions), at least a chunk's, at most
# MAX_PREFILL_GEMM_ROWS. On CUDA a round's last tile may also hold any multiple of INVARIANT_GEMM_ROWS
# below that, so that a few prompts run a small tile; its GEMMs still have INVARIANT_GEMM_ROWS rows or more.
def prefill_tiles_for(rows: int, cuda: bool) -> tuple[int, ...]:
    """The prefill's tile sizes in tokens (largest first) for an engine of `rows` slots."""
    tile = max(PREFILL_COLUMNS, min(rows * PREFILL_COLUMNS // 8, MAX_PREFILL_GEMM_ROWS))
    if not cuda or tile <= INVARIANT_GEMM_ROWS or tile % INVARIANT_GEMM_ROWS:
        return (tile,)
    return tuple(range(tile, 0, -INVARIANT_GEMM_ROWS))


def prefill_head_rows(rows: int) -> int:
    """The prompts of one call of the prefill's codebook-0 head (a GEMM of one shape per engine)."""
    return max(1, min(rows // 8, MAX_PREFILL_GEMM_ROWS // PREFILL_COLUMNS))


# From this many slots on CUDA, the prefill computes a voice's leading prompt positions once and
# prefills those prompts from after them (prefill.py, "Voice prefixes"). On the bench's admissions
# the packed tiles then take 0.85x (64 slots), 0.76x (128), 0.71x (256) and 0.68x (512) the token rows
# of whole prompts (tools/slot_occupancy.py --prefill), for one copy of the prefix's keys and values
# (every layer's) per admission. Fewer slots admit a prompt or two at a time, in one tile either way.
VOICE_PREFIX_MIN_ROWS = 64


def voice_prefixes_for(rows: int, cuda: bool) -> bool:
    """Whether the prefill uses voice prefixes when the caller does not say."""
    return cuda and rows >= VOICE_PREFIX_MIN_ROWS


# The engine's slots in `tts synth`: every call runs this many rows whatever it holds, so that a
# seeded row's audio does not depend on what else is synthesized with it (batch invariance holds
# for one rows setting). 64: the batch the engine issue fixes; more rows raise throughput (c128,
# c256 in docs/bench.md) at the cost of first-audio latency and memory.
DEFAULT_ENGINE_ROWS = 64
# `--rows auto` (the default of `tts synth` on CUDA): per call, the first of these slot counts that the
# call's segments fill (at most 64 slots left over) and whose talker KV cache the GPU memory budget
# holds, else the last. The order is that of measured throughput, random 1.7B fp16 weights, forced
# lengths: H100, 6d30cb4 (2026-12-06), tts synth of 4096 Harvard rows x 100 frames, alternated: 1024
# slots 1796.1 and 1809.9 audio-s/s, 512 1534.7 and 1737.4 (byte-identical WAVs); H200 (docs/bench.md,
# 2026-12-03), 2048 requests: 512 slots 1303.9, 256 1231.7; 800 requests (2026-12-02): 128 928.5, 64 741.8.
# Not 2048 (tts bench on the H200 at 88da7d4: 1963.9 against 1866.0 at 1024): in `tts synth` of that corpus on an
# H100 80GB its engine ran out of memory though STEP_BYTES_PER_SLOT x 2048 fit the free memory (2026-12-06).
AUTO_ROWS = (1024, 512, 256, 128, 64)
AUTO_ROWS_RULE = (f"the most slots of {', '.join(map(str, AUTO_ROWS))} that a call's segments fill and the GPU "
                  "memory holds")
# How the code predictor's 16 positions run in a decode step: `loop` (one CUDA-graphed kernel
# sequence per position), `kernel` (tts_kernels.depth_frame, one persistent kernel per frame, where
# it can run: else the loop, with the reason logged), `auto` (the kernel where it can run and was
# measured faster: over fp16 weights, at 2-64 rows; at one row the loop, whose kernels launch as
# programmatic dependents there: tts_kernels.launch). The kernel runs up to 64 rows, in a tile of
# 16 or 64 rows (tts_kernels.depth_schedule.ROW_TILES). On the H200 over fp16 weights (docs/bench.md at 0bca9b7),
# `tts bench` audio-s/s kernel against loop, each pair from one loan: c1 17.2 / 14.0, c8 114.9 / 103.6
# (2026-11-30); c64 570.4 and 581.3 / 534.4 and 539.4, alternated (2026-11-30); c32 in the 64-row tile
# 376.6 and 376.7 / 351.1 and 351.3, alternated (2026-12-01). Over bf16 weights it was slower (4.6
# against 3.3 ms per 64-row frame, 2026-11-30).
DEPTH_CHOICES = ("auto", "kernel", "loop")
DEFAULT_DEPTH = "auto"
# The vocoder's convolution inputs on the fused path (tts_kernels.conv): fp16 (and its residual
# stream; fp32 accumulation; values beyond fp16's range are detected and the audio refused) or fp32
# (TF32).
CODEC_PRECISIONS = ("fp16", "fp32")
DEFAULT_CODEC_PRECISION = "fp16"
# The talker's and code predictor's weights on CUDA, which set how their projections read their fp32
# inputs (tts_kernels.linear): fp16 (the checkpoint's bf16 values converted, exact from 2^-17 to
# fp16's maximum, smaller ones rounded to multiples of 2^-24; each input rounded once to fp16; NaN
# or infinite logits are detected and the run refused) or bf16 (each input as two bf16 halves, 16
# bits, for twice the GEMM rows: slower in the prefill and at 128+ rows, docs/bench.md). A
# checkpoint with weights beyond fp16's range loads as bf16 (logged).
TALKER_PRECISIONS = ("fp16", "bf16")
DEFAULT_TALKER_PRECISION = "fp16"
