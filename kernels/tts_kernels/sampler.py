"""One draw per row as one Triton kernel: temperature, top-k (ties at the boundary kept), Gumbel
noise from the counter-based hash of (seed, frame, group, token), argmax; rows that do not sample
take the argmax of the raw logits. The same function as tts_cli.model.sampler.choose without
top-p (the engine keeps the torch sampler when a request uses top-p), which takes some 40 small
kernels per draw: sort, gathers, masks, and five hash rounds over [B, V].

The hash runs in int64 with every product masked to 32 bits, exactly as the torch code does;
division and logarithms come from libdevice (correctly rounded like torch's; Triton's '/' and
tl.log are approximations on the GPU), numpy's in the interpreter.
"""
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from tts_kernels import compiled
from tts_kernels.launch import let_dependents_launch, programmatic, wait_for_predecessor

LOW32 = 0xFFFFFFFF


def sampler_warps(block: int) -> int:
    """Warps per row of the sampler kernel. They change only the time, not the draw (the threshold
    is an exact count). On the H200 (tools/sampler_bench.py) 16 warps took the talker's 4096-wide
    rows from 20.7 to 17.5 us; the code predictor's 2048 were fastest at 4 (10.2 us)."""
    return 16 if block >= 4096 else 4


@triton.jit
def _mix32(x):
    """lowbias32 on int64 values in [0, 2^32), as tts_cli.model.sampler._mix32."""
    mask = tl.full([], 0xFFFFFFFF, tl.int64)
    x = x ^ (x >> 16)
    x = (x * tl.full([], 0x7FEB352D, tl.int64)) & mask
    x = x ^ (x >> 15)
    x = (x * tl.full([], 0x846CA68B, tl.int64)) & mask
    return x ^ (x >> 16)


@triton.jit
def _order_key(x):
    """fp32 -> int32 whose signed order is the floats' order (an involution on the bits)."""
    bits = x.to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def kth_largest(values, k):
    """The k-th largest of values [BLOCK] fp32, counted with multiplicity (1 <= k <= BLOCK): a
    bisection over the values' order keys, one count over the row per step, at most 32. A sort of
    the row in registers took ~40 us per draw on the H200 (tools/step_profile.py). The bisection
    stops as soon as some threshold has exactly k keys at or above it: the smallest of those is the
    answer. Between the logits around the k-th largest there is usually a gap that a threshold
    falls into long before the 32nd step. Where ties straddle the k-th place it runs to the end."""
    keys = _order_key(values)
    # invariant: at least k keys >= lo, fewer than k keys > hi
    lo = tl.min(keys, axis=0).to(tl.int64)
    hi = tl.max(keys, axis=0).to(tl.int64)
    while lo < hi:
        mid = lo + (hi - lo + 1) // 2
        above = keys >= mid.to(tl.int32)
        count = tl.sum(above.to(tl.int32), axis=0)
        if count == k:
            lo = tl.min(tl.where(above, keys, 2147483647), axis=0).to(tl.int64)
            hi = lo
        elif count > k:
            lo = mid
        else:
            hi = mid - 1
    return _order_key(lo.to(tl.int32)).to(tl.float32, bitcast=True)


@triton.jit
def draw(raw, tokens, valid, temperature, k, seed, frame, group, do_sample, vocab, LIBDEVICE: tl.constexpr):
    """The token one row draws: raw [BLOCK] fp32 logits (-inf past the vocabulary), its sampler
    settings as scalars. Shared by the sampler kernel and the persistent depth kernel, so that
    both draw the same token."""
    if LIBDEVICE:
        scaled = libdevice.div_rn(raw, temperature)
    else:
        scaled = raw / temperature
    # top-k: the k-th largest (padding lanes are -inf, below every logit that is not)
    kth = tl.where((k <= 0) | (k > vocab), float("-inf"), kth_largest(scaled, k))
    warped = tl.where(scaled >= kth, scaled, float("-inf"))
    mask = tl.full([], 0xFFFFFFFF, tl.int64)
    seed = seed.to(tl.int64)
    frame = frame.to(tl.int64)
    key = _mix32(seed & mask)
    key = _mix32(key ^ ((seed >> 32) & mask))
    key = _mix32(key ^ (frame & mask))
    key = _mix32(key ^ (group & mask))
    bits = _mix32(key ^ tokens.to(tl.int64))
    unit = ((bits >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
    if LIBDEVICE:
        noise = -libdevice.log(-libdevice.log(unit))
    else:
        noise = -tl.log(-tl.log(unit))
    scores = tl.where(do_sample, warped + noise, raw)
    scores = tl.where(valid, scores, float("-inf"))
    return tl.argmax(scores, axis=0).to(tl.int64)


@triton.jit
def count_nonfinite(count_ptr, logits):
    """Adds the number of NaN and +inf logits to the int32 at count_ptr: what a value beyond the
    range of a 16-bit activation anywhere upstream becomes."""
    tl.atomic_add(count_ptr, tl.sum(((logits != logits) | (logits == float("inf"))).to(tl.int32), axis=0))


@triton.jit
def _talker_processors(raw, tokens, valid, seen_ptr, penalty, eos_blocked, suppressed_ptr, eos,
                       LIBDEVICE: tl.constexpr):
    """tts_cli.model.sampler.TalkerLogitsProcessor on one row: the repetition penalty on the ids
    seen (int8 flags), EOS at -inf while blocked, the suppressed ids at -inf."""
    seen = tl.load(seen_ptr + tokens, mask=valid, other=0) != 0
    if LIBDEVICE:
        divided = libdevice.div_rn(raw, penalty)
    else:
        divided = raw / penalty
    raw = tl.where(seen, tl.where(raw < 0, raw * penalty, divided), raw)
    raw = tl.where((tokens == eos) & eos_blocked, float("-inf"), raw)
    return tl.where(tl.load(suppressed_ptr + tokens, mask=valid, other=0) != 0, float("-inf"), raw)


@triton.jit
def _sample_rows(logits_ptr, logits_stride, temperature_ptr, top_k_ptr, do_sample_ptr, seeds_ptr,
                 frame_ptr, frame_stride, frame_offset, out_ptr, nonfinite_ptr, group, vocab,
                 seen_ptr, penalty_ptr, min_new_ptr, suppressed_ptr, eos, BLOCK: tl.constexpr,
                 LIBDEVICE: tl.constexpr, COUNT: tl.constexpr, TALKER: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0)
    tokens = tl.arange(0, BLOCK)
    valid = tokens < vocab
    let_dependents_launch(PDL)
    wait_for_predecessor(PDL)
    raw = tl.load(logits_ptr + row * logits_stride + tokens, mask=valid, other=float("-inf")).to(tl.float32)
    frame = tl.load(frame_ptr + row * frame_stride) + frame_offset
    if TALKER:
        raw = _talker_processors(raw, tokens, valid, seen_ptr + row * vocab, tl.load(penalty_ptr + row),
                                 frame < tl.load(min_new_ptr + row), suppressed_ptr, eos, LIBDEVICE)
    if COUNT:
        count_nonfinite(nonfinite_ptr, raw)
    token = draw(raw, tokens, valid, tl.load(temperature_ptr + row), tl.load(top_k_ptr + row),
                 tl.load(seeds_ptr + row), frame, group, tl.load(do_sample_ptr + row).to(tl.int1), vocab, LIBDEVICE)
    tl.store(out_ptr + row, token)


class TalkerProcessing(NamedTuple):
    """What the talker's processors read (tts_cli.model.sampler.TalkerLogitsProcessor): seen [B, V]
    bool, repetition_penalty [B, 1] fp32, min_new_tokens [B] int64 (EOS blocked while the frame
    drawn is below it), suppressed [V] bool, the EOS id."""
    seen: torch.Tensor
    repetition_penalty: torch.Tensor
    min_new_tokens: torch.Tensor
    suppressed: torch.Tensor
    eos: int


def sample_rows(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, do_sample: torch.Tensor,
                seeds: torch.Tensor, frame: int | torch.Tensor, group: int,
                nonfinite: torch.Tensor | None = None, frame_offset: int = 0,
                talker: TalkerProcessing | None = None) -> torch.Tensor:
    """logits [B, V]; temperature [B, 1] fp32; top_k [B]; do_sample [B] bool; seeds [B] int64; frame:
    an int or [B], plus frame_offset: the frame drawn. Returns the drawn ids [B] int64. nonfinite
    (int32 [1]): gets the count of NaN and +inf logits added. talker: the talker's processors
    first, in the same kernel (counted after them, as the torch engine counts)."""
    rows, vocab = logits.shape
    block = triton.next_power_of_2(vocab)
    if not torch.is_tensor(frame):
        frame = torch.full((1,), frame, dtype=torch.int64, device=logits.device)
    frame_stride = 0 if frame.numel() == 1 else frame.stride(0)
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if talker is not None:
        processing = (talker.seen.contiguous().view(torch.int8), talker.repetition_penalty.contiguous(),
                      talker.min_new_tokens.contiguous(), talker.suppressed.view(torch.int8), talker.eos)
    else:
        processing = (out, out, out, out, 0)
    _sample_rows[(rows,)](logits, logits.stride(0), temperature.contiguous(), top_k.contiguous(),
                          do_sample.contiguous(), seeds.contiguous(), frame, frame_stride, frame_offset, out,
                          nonfinite if nonfinite is not None else out, group, vocab, *processing,
                          BLOCK=block, LIBDEVICE=compiled(), COUNT=nonfinite is not None,
                          TALKER=talker is not None, num_warps=sampler_warps(block), **programmatic(logits))
    return out
