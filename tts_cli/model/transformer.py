"""The Qwen3 decoder block shared by the talker (28 layers) and the code predictor (5 layers).

Pre-norm block: x + o(attn(rope(qnorm(q(n1 x))), rope(knorm(k(n1 x))), v(n1 x))), then
h + down(silu(gate(n2 h)) * up(n2 h)); grouped-query attention, causal, no sliding window.
The talker's "multimodal" RoPE always receives three identical position streams, which makes it
exactly the standard rotate-half RoPE used here.

Numerics: activations are fp32 whatever the weights' dtype. With bf16 weights (as the checkpoint
stores them) the torch code below widens the weights per call: it is the fp32 model on bf16-valued
weights, the reference that the fast path is held to (docs/numerics.md).

Fast path (the engine switches it on with `use_kernels`): for new tokens against StaticKV caches,
each layer runs as eight kernels: residual add + norm, one q/k/v projection, attention (with the q/k
norms, RoPE and the cache write), o projection, residual add + norm, one gate/up projection, SiLU *
up, down projection (tts_kernels; the projections a GEMV kernel at one fp16 row, a Triton GEMM at
2-64 fp16 rows, else cuBLAS; on the first two the gate/up projection does the SiLU * up itself:
seven kernels). Projections read the 16-bit weights once and their fp32 input rounded to the
weights' dtype: once to fp16 over fp16 weights, as two bf16 halves over bf16 ones
(tts_kernels.linear); the KV cache, and the queries and probabilities that meet it, are in the
weights' dtype.
The torch code is the reference it is tested against (tests/test_kernels.py, tests/test_gpu.py).
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from tts_cli.checkpoint import DecoderConfig


class Linear(nn.Linear):
    """nn.Linear for fp32 activations over weights of any dtype. Over narrower (bf16) weights the
    torch path widens them per call (the reference) and the fused one is tts_kernels.linear."""

    fused = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused and x.dtype != self.weight.dtype:
            from tts_kernels.linear import linear
            return linear(x, self.weight, self.bias)
        return self.reference(x)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The torch path, whatever `fused` says."""
        if x.dtype == self.weight.dtype:
            return super().forward(x)
        return F.linear(x, self.weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))


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
        # as the official model does (it matters for bf16 activations).
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
    """One layer's keys and values in preallocated buffers [R, kv_heads, capacity, head_dim], so
    that a step can be captured in a CUDA graph. `at` says where the next update writes: an int
    (the same offset for every row: the code predictor's frame, a prefill) or a [B] tensor (one
    token per row, each at its own position; the engine's talker step). `rows` [B] maps batch rows
    to cache rows (None: batch row i is cache row i; see for_rows). The caller's mask hides
    unwritten slots; it must be causal by cache position (what the fused path assumes).
    `segments` (for_segments): a packed prefill tile, whose batch row b is not a row of the input
    but its count[b] tokens from token first[b] on, written from position at[b] on."""

    def __init__(self, batch: int, kv_heads: int, capacity: int, head_dim: int, device, dtype,
                 buffers: tuple[torch.Tensor, torch.Tensor] | None = None):
        """buffers: the keys' and values' (views of a buffer of every layer's), else new zeros."""
        self.k, self.v = buffers if buffers is not None else (
            torch.zeros(batch, kv_heads, capacity, head_dim, device=device, dtype=dtype) for _ in range(2))
        self.at: int | torch.Tensor = 0
        self.rows: torch.Tensor | None = None
        self.segments: tuple[torch.Tensor, torch.Tensor] | None = None
        self.segments_host: list[list[int]] | None = None
        self.segment_tokens = 0   # with segments: the most tokens a segment holds
        self.all_rows = torch.arange(batch, device=device)

    def for_rows(self, rows: torch.Tensor, at: int = 0) -> "StaticKV":
        """The same buffers for a batch whose row i is cache row rows[i], writing from position
        `at` on (a prefill of some slots)."""
        view = copy.copy(self)
        view.rows, view.at = rows, at
        return view

    def for_segments(self, rows: torch.Tensor, at: torch.Tensor, first: torch.Tensor, count: torch.Tensor,
                     most: int, host: list[list[int]] | None = None) -> "StaticKV":
        """The same buffers for a packed tile (class doc) whose segments hold at most `most` tokens:
        segment b's go to cache row rows[b]. host: rows, at, first and count as lists, for the torch
        path, which walks the segments on the host (else it reads them from the device)."""
        view = self.for_rows(rows)
        view.at, view.segments, view.segment_tokens = at, (first, count), most
        view.segments_host = host
        return view

    def first_rows(self, rows: int) -> "StaticKV":
        """The first `rows` cache rows as a cache of their own (views of these buffers)."""
        view = copy.copy(self)
        view.k, view.v, view.all_rows = self.k[:rows], self.v[:rows], self.all_rows[:rows]
        return view

    def row_index(self) -> torch.Tensor:
        return self.all_rows if self.rows is None else self.rows

    def positions(self, tokens: int) -> torch.Tensor:
        """[B, tokens]: the cache position each new token of each row is written to."""
        offsets = torch.arange(tokens, device=self.k.device)
        if isinstance(self.at, int):
            return (self.at + offsets).expand(self.row_index().shape[0], tokens)
        return self.at[:, None] + offsets

    def update(self, k, v):
        k, v = k.to(self.k.dtype), v.to(self.v.dtype)
        if isinstance(self.at, int):
            rows = slice(None) if self.rows is None else self.rows
            end = self.at + k.shape[2]
            self.k[rows, :, self.at:end] = k
            self.v[rows, :, self.at:end] = v
            return self.k[rows, :, :end], self.v[rows, :, :end]
        if self.rows is not None:
            raise ValueError("per-row positions need the cache's own row order")
        index = self.at.view(-1, 1, 1, 1).expand(-1, k.shape[1], 1, k.shape[3])
        self.k.scatter_(2, index, k)
        self.v.scatter_(2, index, v)
        return self.k, self.v


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.cfg = cfg
        hd = cfg.head_dim
        self.q_proj = Linear(cfg.hidden_size, cfg.num_heads * hd, bias=cfg.attention_bias)
        self.k_proj = Linear(cfg.hidden_size, cfg.num_kv_heads * hd, bias=cfg.attention_bias)
        self.v_proj = Linear(cfg.hidden_size, cfg.num_kv_heads * hd, bias=cfg.attention_bias)
        self.o_proj = Linear(cfg.num_heads * hd, cfg.hidden_size, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.qkv = None   # (weight, bias) of q, k, v as one projection, once merged

    def prepare_fused(self) -> None:
        """q, k and v become row blocks of one weight (and bias): one GEMM on the fused path, the
        same numbers (views, no copy) on the plain one."""
        self.qkv = merge_linears([self.q_proj, self.k_proj, self.v_proj], self.qkv)

    def forward(self, x, cos, sin, mask, cache: GrowingKV | StaticKV | None):
        """x [B, S, D]; cos/sin [B, S, hd]; mask [B, 1, S, keys] bool (True = may attend)."""
        b, s, _ = x.shape
        hd = self.cfg.head_dim
        q = self.q_norm(self.q_proj(x).view(b, s, -1, hd)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(b, s, -1, hd)).transpose(1, 2)
        v = self.v_proj(x).view(b, s, -1, hd).transpose(1, 2)
        cos, sin = cos[:, None], sin[:, None]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if isinstance(cache, StaticKV) and cache.segments is not None:
            return self.o_proj(self._attend_segments(q, k, v, cache))
        if cache is not None:
            k, v = cache.update(k, v)
        return self.o_proj(self._attend(q, k, v, mask))

    def _attend(self, q, k, v, mask):
        """q [B, heads, S, hd], keys and values [B, kv_heads, keys, hd], mask [B, 1, S, keys] -> [B, S, heads * hd]."""
        b, _, s, hd = q.shape
        k, v = k.to(q.dtype), v.to(q.dtype)   # the engine keeps 16-bit caches under fp32 activations
        # Grouped-query attention without copying keys: the query heads that share a kv head
        # (consecutive heads, as in repeat_interleave) are stacked along the query axis.
        # (SDPA here was no faster on the H200 and its fp32 GPU kernels broke exact equality
        # with the plain path: measured 2026-11-29.)
        kv_heads = self.cfg.num_kv_heads
        q = q.reshape(b, kv_heads, -1, hd)
        scores = (q @ k.transpose(2, 3)) * hd ** -0.5
        scores = scores.masked_fill(~mask.repeat(1, 1, q.shape[2] // s, 1), float("-inf"))
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return (probs @ v).view(b, self.cfg.num_heads, s, hd).transpose(1, 2).reshape(b, s, -1)

    def _attend_segments(self, q, k, v, cache: StaticKV):
        """A packed tile (StaticKV.for_segments; the batch is one row of all its tokens): each
        segment's keys and values into its cache row, its queries against that row's keys up to
        their own positions. The other tokens' outputs are zeros. Each segment's products have the
        shape of a full one (its queries zero-padded to segment_tokens, the keys that far), so that
        a token's sums do not depend on how many tokens its segment has (CPU GEMMs choose their
        kernels, and so their order of summation, by shape)."""
        out = q.new_zeros(q.shape[2], q.shape[1] * q.shape[3])
        host = cache.segments_host or [t.tolist() for t in (cache.rows, cache.at, *cache.segments)]
        most = cache.segment_tokens
        for i, (row, at, first, count) in enumerate(zip(*host)):
            if count:
                tokens = slice(first, first + count)
                cache.for_rows(cache.rows[i:i + 1], at).update(k[:, :, tokens], v[:, :, tokens])
                queries = q.new_zeros(*q.shape[:2], most, q.shape[3])
                queries[:, :, :count] = q[:, :, tokens]
                end = min(at + most, cache.k.shape[2])
                mask = torch.ones(most, end, dtype=torch.bool, device=q.device).tril(at)
                heads = self._attend(queries, cache.k[row:row + 1, :, :end], cache.v[row:row + 1, :, :end],
                                     mask[None, None])
                out[tokens] = heads[0, :count]
        return out[None]


def merge_linears(linears: list[nn.Linear], merged: tuple | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenates the weights (and biases) of linears over the same input and makes each
    linear's parameters views of the result; returns (weight, bias). `merged`: the result of an
    earlier call, returned as is while the linears still view it (not after e.g. `.to(dtype)`)."""
    if merged is not None and linears[0].weight.data_ptr() == merged[0].data_ptr():
        return merged
    weight = torch.cat([l.weight.detach() for l in linears])
    bias = None if linears[0].bias is None else torch.cat([l.bias.detach() for l in linears])
    start = 0
    for linear in linears:
        rows = linear.weight.shape[0]
        linear.weight = nn.Parameter(weight[start:start + rows], requires_grad=False)
        if bias is not None:
            linear.bias = nn.Parameter(bias[start:start + rows], requires_grad=False)
        start += rows
    return weight, bias


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = Linear(dim, hidden, bias=False)
        self.up_proj = Linear(dim, hidden, bias=False)
        self.down_proj = Linear(hidden, dim, bias=False)
        self.fused = False
        self.gate_up = None   # (weight, None) of gate and up as one projection, once merged

    def prepare_fused(self) -> None:
        self.gate_up = merge_linears([self.gate_proj, self.up_proj], self.gate_up)

    def forward(self, x):
        if self.fused:
            from tts_kernels.swiglu import silu_mul
            return self.down_proj(silu_mul(F.linear(x, *self.gate_up)))
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
        self.fused = False
        self.rope_tables: list[tuple[torch.Tensor, torch.Tensor]] = []

    def cache_rope(self, positions: int) -> None:
        """Precomputes cos/sin of positions [0, positions) for the fused path, whose kernels read
        table rows instead of recomputing them (~8 kernels) per call. Tables only grow, and
        replaced ones stay alive: CUDA graphs captured earlier still read them."""
        if self.rope_tables and self.rope_tables[-1][0].shape[0] >= positions:
            return
        self.rope_tables.append(rope_cos_sin(torch.arange(positions, device=self.norm.weight.device),
                                             self.cfg.head_dim, self.cfg.rope_theta, torch.float32))

    def uses_kernels(self, caches: list | None) -> bool:
        """Whether a call with these caches takes the fused path."""
        return self.fused and bool(caches) and isinstance(caches[0], StaticKV)

    def forward(self, x, positions, mask, caches: list | None = None, x_rows: torch.Tensor | None = None):
        """x [B, S, D], positions [B, S] (RoPE position of each row's token), mask as in Attention;
        caches: one GrowingKV or StaticKV per layer, updated in place. Returns fp32. The fused path
        (StaticKV caches) ignores positions and mask: it derives both from the caches' `at`.
        x_rows [B]: one token per row, row r's being x[x_rows[r]] of a table x [N, D] (an embedding
        lookup, which the fused path's first kernels do as they read it)."""
        x = x.float()
        if self.uses_kernels(caches):
            return self._forward_kernels(x, caches, x_rows)
        if x_rows is not None:
            x = x[x_rows][:, None]
        cos, sin = rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta, x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, mask, caches[i] if caches else None)
        return self.norm(x)

    def _forward_kernels(self, x, caches, x_rows=None):
        """The same layers as eight kernels each, seven at one and at 2-64 fp16 rows (module doc).
        Every layer's cache has the same `at` and rows (set by the caller for all of them). Positions
        and mask are implied: the new tokens of a row go to cache positions at, at + 1, ... and RoPE
        uses those; attention is causal by cache position."""
        from tts_kernels.attention import cached_attention
        from tts_kernels.linear import project, split
        from tts_kernels.swiglu import project_silu
        cfg = self.cfg
        cache = caches[0]
        self.cache_rope(cache.k.shape[2])   # a no-op in the engine, which sized the tables first
        cos, sin = self.rope_tables[-1]
        rows, start = cache.row_index().contiguous(), cache.at
        eps = cfg.rms_norm_eps
        dtype = self.layers[0].mlp.down_proj.weight.dtype   # of the projections' inputs (tts_kernels.linear)
        if x_rows is None:
            b, s, width = x.shape
            stream = x.reshape(b * s, width).contiguous()   # the residual stream: the input (never written)
        else:
            (b, width), s, stream = (x_rows.shape[0], x.shape[-1]), 1, x.contiguous()   # its rows x_rows
        per_row = s if cache.segments is None else cache.segment_tokens
        x = torch.empty(b * s, width, device=stream.device, dtype=torch.float32)   # the stream from the first add on
        delta = None   # the last projection's output, not yet added to the stream
        for layer, cache in zip(self.layers, caches):
            attn, mlp = layer.self_attn, layer.mlp
            attn_input = split(stream, dtype, layer.input_layernorm.weight, eps, delta=delta, residual=x,
                               x_rows=x_rows)
            # the o and down outputs only reach split, which adds any number of partial sums, and
            # the q/k/v output attention, which does too
            qkv = project(attn_input, *attn.qkv, partial_sums=True)
            heads = cached_attention(qkv, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, attn.q_norm.weight,
                                     attn.k_norm.weight, eps, cos, sin, cache.k, cache.v, rows, start, per_row,
                                     cfg.head_dim ** -0.5, dtype, segments=cache.segments, tokens=b * s)
            delta = project(heads, attn.o_proj.weight, attn.o_proj.bias, partial_sums=True)
            gate_up_input = split(stream, dtype, layer.post_attention_layernorm.weight, eps, delta=delta,
                                  residual=x, x_rows=x_rows)
            stream, x_rows = x, None
            delta = project(project_silu(gate_up_input, mlp.gate_up[0], dtype), mlp.down_proj.weight,
                            partial_sums=True)
        return split(stream, torch.float32, self.norm.weight, eps, delta=delta, residual=x,
                     x_rows=x_rows).view(b, s, width)


def use_kernels(root: nn.Module, on: bool) -> None:
    """Switches every module under `root` that has a fused path (RMSNorm, SwiGLU, SnakeBeta,
    Decoder, Linear, CodePredictor) to it, or back to the torch reference; on the way in, lets each
    prepare what its fused path reads (merged projections, tables)."""
    for module in root.modules():
        if hasattr(module, "fused"):
            module.fused = on
        if on and hasattr(module, "prepare_fused"):
            module.prepare_fused()
