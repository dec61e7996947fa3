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

from dataclasses import dataclass, fields

import torch

from tts_cli.model.host import to_device

_MASK32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche mixer (lowbias32) on int64 tensors holding values in [0, 2^32).
    Products are masked to 32 bits; int64 wrap-around keeps the low 32 bits exact."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def uniform_noise(seeds: torch.Tensor, frame: int | torch.Tensor, groups: range, vocab: int) -> torch.Tensor:
    """Uniform (0, 1) fp32 noise [len(groups), B, vocab], a pure function of (seed, frame, group,
    token). frame: one int for every row, or [B] (each row's own frame index). Several groups
    at once cost the same few kernels as one (the code predictor's 15 draws of a frame)."""
    seeds = seeds.to(torch.int64)
    key = _mix32(seeds & _MASK32)
    key = _mix32(key ^ ((seeds >> 32) & _MASK32))
    key = _mix32(key ^ (torch.as_tensor(frame, device=seeds.device) & _MASK32))
    # arange, not tensor(list): no host-to-device copy, so it can be captured in a CUDA graph
    group_ids = torch.arange(groups.start, groups.stop, device=seeds.device, dtype=torch.int64)
    key = _mix32(key[None, :] ^ (group_ids[:, None] & _MASK32))
    tokens = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    return bits_to_unit(_mix32(key[..., None] ^ tokens))


def gumbel_noise(seeds: torch.Tensor, frame: int | torch.Tensor, groups: range, vocab: int) -> torch.Tensor:
    """Gumbel noise -log(-log(u)) [len(groups), B, vocab] for Gumbel-max draws."""
    return -torch.log(-torch.log(uniform_noise(seeds, frame, groups, vocab)))


def bits_to_unit(bits: torch.Tensor) -> torch.Tensor:
    """32 random bits -> fp32 in (0, 1): the centre of one of 2^23 equal bins. Not 24 bits: the
    top bin's centre, 1 - 2^-25, rounds to 1.0 in fp32 and -log(-log(u)) becomes +inf (NaN on
    -inf logits, which then wins the argmax)."""
    return ((bits >> 9).float() + 0.5) * (1.0 / (1 << 23))


@dataclass(frozen=True)
class SamplerSettings:
    """One sampler's settings (the talker's or the code predictor's)."""
    do_sample: bool
    temperature: float
    top_k: int
    top_p: float
    repetition_penalty: float = 1.0


@dataclass
class RowSampling:
    """Per-row sampler settings as tensors, so one batch (and one CUDA graph) can mix settings.
    do_sample [B] bool; temperature, top_p_tail, repetition_penalty [B, 1] fp32; top_k [B] int64.
    top_p_tail is 1 - top_p, the probability mass top-p may drop, subtracted in double on the host
    and rounded once: HF compares with the Python float 1 - top_p, not 1 minus a float32 top_p."""
    do_sample: torch.Tensor
    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p_tail: torch.Tensor
    repetition_penalty: torch.Tensor

    @classmethod
    def uniform(cls, s: SamplerSettings, rows: int, device) -> "RowSampling":
        return cls.stack([s] * rows, device)

    @classmethod
    def stack(cls, settings: list[SamplerSettings], device) -> "RowSampling":
        """One row per settings object. Built on the host and copied without blocking (from pinned
        memory on CUDA), so that the engine never waits for the GPU here."""
        def column(values, dtype):
            return to_device(torch.tensor(values, dtype=dtype), device)
        return cls(column([s.do_sample for s in settings], torch.bool),
                   column([[s.temperature] for s in settings], torch.float32),
                   column([s.top_k for s in settings], torch.int64),
                   column([[1 - s.top_p] for s in settings], torch.float32),
                   column([[s.repetition_penalty] for s in settings], torch.float32))

    def assign(self, rows: torch.Tensor, other: "RowSampling") -> None:
        """Copies `other`'s rows into these rows (index tensor)."""
        for f in fields(self):
            getattr(self, f.name)[rows] = getattr(other, f.name)


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """seen [B, V] bool: ids generated so far by that row (each id penalized once); penalty [B, 1]."""
    penalized = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(seen, penalized, logits)


def kth_largest(ascending: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """The row's k-th largest logit [B, 1], from the row sorted ascending; k [B], where k <= 0 or
    k >= V gives the smallest (top-k then keeps everything)."""
    vocab = ascending.shape[-1]
    position = torch.where((k <= 0) | (k > vocab), 0, vocab - k)
    return ascending.gather(-1, position[:, None])


def apply_top_k(logits: torch.Tensor, kth: torch.Tensor) -> torch.Tensor:
    """Keep every logit >= the row's k-th largest (ties at the boundary are all kept, as in HF)."""
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, tail: torch.Tensor, ascending: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """HF TopP: drop the low-probability tail whose total mass is <= tail (1 - p); keep at least
    one. tail [B, 1]; tail <= 0 (p >= 1) keeps everything. ascending, ids [B, V]: the logits
    sorted ascending and their token ids, equal logits in id order (a stable sort, as CUDA's sort
    is; CPU's default sort, which HF uses, leaves the order of equal logits open)."""
    cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
    remove_sorted = (cumulative <= tail) & (tail > 0)
    remove_sorted[..., -1:] = False
    remove = remove_sorted.scatter(-1, ids, remove_sorted)
    return logits.masked_fill(remove, float("-inf"))


def warp(logits: torch.Tensor, rows: RowSampling, top_p: bool = True) -> torch.Tensor:
    """Temperature, top-k, top-p: applied only when sampling (HF skips warpers for greedy).
    top_p=False skips top-p when no row uses it. One sort of the row serves both: HF sorts the
    row again after top-k, where the kept logits stand in the same order at the same places as
    here, and the dropped ones (-inf) carry no mass."""
    logits = logits / rows.temperature
    ascending, ids = torch.sort(logits, dim=-1, stable=True)
    kth = kth_largest(ascending, rows.top_k)
    logits = apply_top_k(logits, kth)
    if not top_p:
        return logits
    return apply_top_p(logits, rows.top_p_tail, apply_top_k(ascending, kth), ids)


def choose(logits: torch.Tensor, rows: RowSampling, seeds: torch.Tensor, frame: int | torch.Tensor,
           group: int, top_p: bool = True, noise: torch.Tensor | None = None) -> torch.Tensor:
    """Each row's draw (or argmax when it does not sample). noise: this group's Gumbel noise
    [B, V] when precomputed (see gumbel_noise), else computed here. A draw is the argmax of the
    warped logits plus the noise (Gumbel-max; -inf logits are never drawn); one argmax serves
    the drawing rows and the greedy ones."""
    if noise is None:
        noise = gumbel_noise(seeds, frame, range(group, group + 1), logits.shape[-1])[0]
    scores = torch.where(rows.do_sample[:, None], warp(logits, rows, top_p) + noise, logits)
    return torch.argmax(scores, dim=-1)


class TalkerLogitsProcessor:
    """The talker's processors before warping: repetition penalty, EOS block, suppression."""

    def __init__(self, vocab_size: int, eos_id: int, device):
        self.eos_id = eos_id
        # The official model suppresses the top 1024 ids (the special codec ids) except EOS.
        self.suppressed = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        self.suppressed[vocab_size - 1024:] = True
        self.suppressed[eos_id] = False

    def __call__(self, logits: torch.Tensor, seen: torch.Tensor, eos_blocked: torch.Tensor,
                 penalty: torch.Tensor) -> torch.Tensor:
        """logits [B, V] fp32; seen [B, V] bool; eos_blocked [B] bool (fewer than min_new_tokens so
        far); penalty [B, 1]."""
        logits = apply_repetition_penalty(logits, seen, penalty)
        logits = logits.clone()
        logits[:, self.eos_id] = torch.where(eos_blocked, float("-inf"), logits[:, self.eos_id])
        return logits.masked_fill(self.suppressed, float("-inf"))
