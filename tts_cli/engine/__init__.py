"""The slot engine (runner, step, slots, prefill). This module imports no torch: the CLI reads its
defaults here without loading the engine."""

# Measured on the H200 (random 1.7B, bf16, docs/bench.md): K = 4 gave c64 362.8 audio-s/s against
# 247.7 at K = 1 and 376.1 at K = 8, for 3 more steps of first-audio latency (K = 8: 7 more).
DEFAULT_CODEC_WINDOW = 4
