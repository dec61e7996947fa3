"""Logits processors in the official (Hugging Face generate) order, and per-row seeded draws.

Talker (codebook 0): repetition penalty -> EOS blocked below min_new_tokens -> suppress the
special ids -> [sampling only: temperature -> top-k (ties kept) -> top-p] -> draw or argmax.
Code predictor (codebooks 1..15): [sampling only: temperature -> top-k -> top-p] -> draw or argmax.

Draws use the Gumbel-max trick with noise from a counter-based hash of (seed, frame, group,
token): a row's draws depend only on its own seed and position in the stream, never on its batch
mates, its slot, or how many draws happened before (unlike a shared torch.Generator). The hash
is 32-bit integer arithmetic, so a GPU kernel can reproduce it exactly.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

_MASK32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche mixer (lowbias32) on int64 tensors holding values in [0, 2^32).
    Products are masked to 32 bits; int64 wrap-around keeps the low 32 bits exact."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def uniform_noise(seeds: torch.Tensor, frame: int, group: int, vocab: int) -> torch.Tensor:
    """Uniform (0, 1) fp32 noise [B, vocab], a pure function of (seed, frame, group, token)."""
    seeds = seeds.to(torch.int64)
    key = _mix32(seeds & _MASK32)
    key = _mix32(key ^ ((seeds >> 32) & _MASK32))
    key = _mix32(key ^ (frame & _MASK32))
    key = _mix32(key ^ (group & _MASK32))
    tokens = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    bits = _mix32(key[:, None] ^ tokens[None, :])
    # 24 random bits -> centre of one of 2^24 equal bins, never 0 or 1
    return ((bits >> 8).float() + 0.5) * (1.0 / (1 << 24))


def gumbel_draw(logits: torch.Tensor, seeds: torch.Tensor, frame: int, group: int) -> torch.Tensor:
    """One draw per row from softmax(logits) (-inf entries are never drawn)."""
    u = uniform_noise(seeds, frame, group, logits.shape[-1])
    return torch.argmax(logits - torch.log(-torch.log(u)), dim=-1)


@dataclass(frozen=True)
class SamplerSettings:
    """One sampler's settings (the talker's or the code predictor's)."""
    do_sample: bool
    temperature: float
    top_k: int
    top_p: float
    repetition_penalty: float = 1.0


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """seen [B, V] bool: ids generated so far by that row (each id penalized once)."""
    if penalty == 1.0:
        return logits
    penalized = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(seen, penalized, logits)


def apply_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep every logit >= the k-th largest (ties at the boundary are all kept, as in HF)."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """HF TopP: drop the low-probability tail whose total mass is <= 1 - p; keep at least one."""
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, descending=False, dim=-1)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove_sorted = cumulative <= (1 - p)
    remove_sorted[..., -1:] = False
    remove = remove_sorted.scatter(-1, order, remove_sorted)
    return logits.masked_fill(remove, float("-inf"))


def warp(logits: torch.Tensor, s: SamplerSettings) -> torch.Tensor:
    """Temperature, top-k, top-p: applied only when sampling (HF skips warpers for greedy)."""
    if s.temperature != 1.0:
        logits = logits / s.temperature
    return apply_top_p(apply_top_k(logits, s.top_k), s.top_p)


def choose(logits: torch.Tensor, s: SamplerSettings, seeds: torch.Tensor, frame: int, group: int) -> torch.Tensor:
    if not s.do_sample:
        return torch.argmax(logits, dim=-1)
    return gumbel_draw(warp(logits, s), seeds, frame, group)


class TalkerLogitsProcessor:
    """The talker's processors before warping: repetition penalty, EOS block, suppression."""

    def __init__(self, vocab_size: int, eos_id: int, repetition_penalty: float, device):
        self.eos_id = eos_id
        self.penalty = repetition_penalty
        # The official model suppresses the top 1024 ids (the special codec ids) except EOS.
        self.suppressed = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        self.suppressed[vocab_size - 1024:] = True
        self.suppressed[eos_id] = False

    def __call__(self, logits: torch.Tensor, seen: torch.Tensor, eos_blocked: torch.Tensor) -> torch.Tensor:
        """logits [B, V] fp32; seen [B, V] bool; eos_blocked [B] bool (fewer than min_new_tokens so far)."""
        logits = apply_repetition_penalty(logits, seen, self.penalty)
        logits = logits.clone()
        logits[:, self.eos_id] = torch.where(eos_blocked, float("-inf"), logits[:, self.eos_id])
        return logits.masked_fill(self.suppressed, float("-inf"))
