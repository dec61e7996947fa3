"""The Qwen3 decoder block shared by the talker (28 layers) and the code predictor (5 layers).

Pre-norm block: x + o(attn(rope(qnorm(q(n1 x))), rope(knorm(k(n1 x))), v(n1 x))), then
h + down(silu(gate(n2 h)) * up(n2 h)); grouped-query attention, causal, no sliding window.
The talker's "multimodal" RoPE always receives three identical position streams, which makes it
exactly the standard rotate-half RoPE used here.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tts_cli.checkpoint import DecoderConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.fused = False   # the engine switches this on: one Triton kernel instead of ~8 torch ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            from tts_kernels.rms_norm import rms_norm
            return rms_norm(x, self.weight, self.eps)
        # Statistics in fp32, rounded back to the activation dtype BEFORE the weight multiply,
        # as the official model does (it matters in bf16).
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos/sin [..., head_dim] for integer positions, computed in fp32 then cast (as the official)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device)
                                .float() / head_dim))
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE: x * cos + [-x2, x1] * sin."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class GrowingKV:
    """One layer's keys and values that grow by concatenation: the plain reference path. Like
    StaticKV it has `at`, where the next update writes; here that is always its current length."""

    def __init__(self):
        self.k = self.v = None
        self.at = 0

    def update(self, k, v):
        self.at += k.shape[2]
        self.k = k if self.k is None else torch.cat((self.k, k), dim=2)
        self.v = v if self.v is None else torch.cat((self.v, v), dim=2)
        return self.k, self.v


class StaticKV:
    """One layer's keys and values in preallocated buffers [B, kv_heads, capacity, head_dim], so
    that a step can be captured in a CUDA graph. `at` says where the next update writes: an int
    (the same offset for every row; the code predictor's frame) or a [B] tensor (one token per row,
    each at its own position; the engine's talker step). The caller's mask hides unwritten slots."""

    def __init__(self, batch: int, kv_heads: int, capacity: int, head_dim: int, device, dtype):
        self.k = torch.zeros(batch, kv_heads, capacity, head_dim, device=device, dtype=dtype)
        self.v = torch.zeros_like(self.k)
        self.at: int | torch.Tensor = 0

    def update(self, k, v):
        if isinstance(self.at, int):
            end = self.at + k.shape[2]
            self.k[:, :, self.at:end] = k
            self.v[:, :, self.at:end] = v
            return self.k[:, :, :end], self.v[:, :, :end]
        index = self.at.view(-1, 1, 1, 1).expand(-1, k.shape[1], 1, k.shape[3])
        self.k.scatter_(2, index, k)
        self.v.scatter_(2, index, v)
        return self.k, self.v


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.cfg = cfg
        hd = cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * hd, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * hd, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * hd, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.num_heads * hd, cfg.hidden_size, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, mask, cache: GrowingKV | StaticKV | None):
        """x [B, S, D]; cos/sin [B, S, hd]; mask [B, 1, S, keys] bool (True = may attend)."""
        b, s, _ = x.shape
        hd, kv_heads = self.cfg.head_dim, self.cfg.num_kv_heads
        groups = self.cfg.num_heads // kv_heads
        q = self.q_norm(self.q_proj(x).view(b, s, -1, hd)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(b, s, -1, hd)).transpose(1, 2)
        v = self.v_proj(x).view(b, s, -1, hd).transpose(1, 2)
        cos, sin = cos[:, None], sin[:, None]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.update(k, v)
        # Grouped-query attention without copying keys: the query heads that share a kv head
        # (consecutive heads, as in repeat_interleave) are stacked along the query axis.
        # (SDPA here was no faster on the H200 and its fp32 GPU kernels broke exact equality
        # with the plain path: measured 2026-11-29.)
        q = q.reshape(b, kv_heads, groups * s, hd)
        scores = (q @ k.transpose(2, 3)) * hd ** -0.5
        scores = scores.masked_fill(~mask.repeat(1, 1, groups, 1), float("-inf"))
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out = (probs @ v).view(b, self.cfg.num_heads, s, hd).transpose(1, 2).reshape(b, s, -1)
        return self.o_proj(out)


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, cos, sin, mask, cache):
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class Decoder(nn.Module):
    """A stack of decoder layers and the final norm."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, positions, mask, caches: list | None = None):
        """x [B, S, D], positions [B, S] (RoPE position of each row's token), mask as in Attention;
        caches: one GrowingKV or StaticKV per layer, updated in place."""
        cos, sin = rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta, x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, mask, caches[i] if caches else None)
        return self.norm(x)
