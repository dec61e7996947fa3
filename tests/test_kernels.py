"""The Triton kernels against the torch code they replace. On CPU they run in Triton's
interpreter (TRITON_INTERPRET=1, set before triton is imported: hence a subprocess), in fp32:
the interpreter's fp32 -> bf16 casts truncate instead of rounding, and its tl.dot of bf16
operands is wrong outright (a 16 x 16 product off by ~1e10 under Triton 3.9), so bf16 is checked
on the GPU (tests/test_gpu.py)."""
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

RMS_NORM_CHECK = """
import torch
from tts_cli.model.transformer import RMSNorm
from tts_kernels.rms_norm import rms_norm

g = torch.Generator().manual_seed(0)
for dtype, shape in ((torch.float32, (3, 5, 96)), (torch.float32, (7, 2048)), (torch.float32, (4, 2, 16, 128))):
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    norm = RMSNorm(shape[-1], 1e-6)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(shape[-1], generator=g))
    norm = norm.to(dtype)
    expected = norm(x)
    got = rms_norm(x, norm.weight, norm.eps)
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
print("rms_norm ok")
"""

LAYER_KERNELS_CHECK = """
import copy
import torch
from tts_cli.checkpoint import DecoderConfig
from tts_cli.model.transformer import Decoder, StaticKV, use_kernels
from tts_kernels.linear import linear, project, split
from tts_kernels.swiglu import silu_mul
import torch.nn.functional as F

# the parts kernels with one (fp32) part: residual add + norm, projection, SiLU * up
g = torch.Generator().manual_seed(0)
x, w = torch.randn(70, 96, generator=g), 0.1 * torch.randn(2 * 40, 96, generator=g)
bias, norm_w, delta = torch.randn(80, generator=g), 1 + 0.1 * torch.randn(96, generator=g), torch.randn(70, 96, generator=g)
updated = x.clone()
normed = split(updated, torch.float32, norm_w, 1e-6, delta=delta)
torch.testing.assert_close(updated, x + delta, rtol=0, atol=0)
ref = (x + delta) * torch.rsqrt((x + delta).pow(2).mean(-1, keepdim=True) + 1e-6) * norm_w
torch.testing.assert_close(normed, ref, rtol=1e-6, atol=1e-6)
torch.testing.assert_close(project(normed, w, bias), F.linear(ref, w, bias), rtol=1e-5, atol=1e-5)
torch.testing.assert_close(linear(x[:, None], w, bias), F.linear(x[:, None], w, bias), rtol=1e-5, atol=1e-5)
# one fp16 row (the talker's step at one row in flight, on CUDA): every lane's fp32 sum of exact
# products, against fp64; shapes with and without whole tiles
from tts_kernels.linear import gemv
for n, k in ((48, 1024), (45, 100)):
    x16, w16 = torch.randn(1, k, generator=g).half(), (0.1 * torch.randn(n, k, generator=g)).half()
    exact = x16.double() @ w16.double().t()
    got = gemv(x16, w16)
    assert got.dtype == torch.float32 and got.shape == (1, n)
    torch.testing.assert_close(got.double(), exact, rtol=1e-6, atol=1e-6)
# a few fp16 rows (`project` gives it a decode step at 2-64 rows on CUDA) on the tensor cores, each program
# over all rows and the whole of K: fp32 sums of the exact products, against fp64
from tts_kernels.linear import gemm_rows
for rows in (2, 5, 16, 64):
    x16, w16 = torch.randn(rows, 256, generator=g).half(), (0.1 * torch.randn(48, 256, generator=g)).half()
    got = gemm_rows(x16, w16)
    assert got.dtype == torch.float32 and got.shape == (rows, 48)
    torch.testing.assert_close(got.double(), x16.double() @ w16.double().t(), rtol=1e-5, atol=1e-5)
# a narrow weight with partial sums over K slices: 64-row blocks, the parts summed in order by split
import tts_kernels.linear as linear_module
linear_module.GEMM_ROWS_PROGRAMS = 8   # (the real aim, 128 programs, needs wider weights)
x16, w16 = torch.randn(64, 1024, generator=g).half(), (0.1 * torch.randn(128, 1024, generator=g)).half()
parts = gemm_rows(x16, w16, partial_sums=True)
assert parts.shape == (4 * 64, 128)   # 2 blocks of 64 x 4 slices of 256
residual = torch.randn(64, 128, generator=g)
summed = residual.clone()
split(summed, torch.float32, delta=parts)
expected = residual + (((parts[:64] + parts[64:128]) + parts[128:192]) + parts[192:])   # parts first, in order
torch.testing.assert_close(summed, expected, rtol=0, atol=0)
torch.testing.assert_close(parts.view(4, 64, 128).double().sum(0), x16.double() @ w16.double().t(), rtol=1e-5,
                           atol=1e-5)
linear_module.GEMM_ROWS_PROGRAMS = 128
# a tile given by the caller (tools/gemm_bench.py) is the one launched, or refused where it cannot
# give what the caller takes
from tts_kernels.linear import RowsTile
torch.testing.assert_close(gemm_rows(x16, w16, partial_sums=True, tile=RowsTile(32, 2, 64)).view(2, 64, 128).sum(0),
                           gemm_rows(x16, w16), rtol=1e-5, atol=1e-5)
# the product taken as w @ x.T (swap): the same sums, in whole and in partial sums, at 64 and 5 rows
for x_rows in (x16, x16[:5]):
    for tile in (RowsTile(64, swap=True), RowsTile(64, 2, swap=True)):
        swapped = gemm_rows(x_rows, w16, partial_sums=tile.slices > 1, tile=tile)
        torch.testing.assert_close(swapped.view(tile.slices, -1, 128).sum(0), gemm_rows(x_rows, w16), rtol=1e-5,
                                   atol=1e-5)
for tile, partial in ((RowsTile(64, 4), False), (RowsTile(48), True), (RowsTile(64, 3), True)):
    try:
        gemm_rows(x16, w16, partial_sums=partial, tile=tile)
        raise AssertionError(f"{tile} launched")
    except ValueError as error:
        assert "does not cut a [128, 1024] weight" in str(error), error
gu = torch.randn(5, 2, 2 * 40, generator=g)
torch.testing.assert_close(silu_mul(gu), F.silu(gu[..., :40]) * gu[..., 40:], rtol=1e-6, atol=1e-6)
# the one-row gate/up GEMV that does the SiLU * up itself: the same sums and the same fp16 result
# as the GEMV then silu_mul, with and without whole tiles
from tts_kernels.swiglu import gemv_silu
for width, k in ((48, 1024), (45, 100)):
    x16, w16 = torch.randn(1, k, generator=g).half(), (0.1 * torch.randn(2 * width, k, generator=g)).half()
    got = gemv_silu(x16, w16)
    assert got.dtype == torch.float16 and got.shape == (1, width)
    assert torch.equal(got, silu_mul(gemv(x16, w16), torch.float16))
    exact = x16.double() @ w16.double().t()
    torch.testing.assert_close(got.double(), F.silu(exact[:, :width]) * exact[:, width:], rtol=1e-3, atol=1e-4)
# the same at a few rows (gemm_rows' gate/up projection, 2-64 rows in the engine): gemm_rows' sums
# on the same tile (its K chunk orders the sums) then silu_mul, on gemm_rows_silu's own tile
# (SILU_TILE: 32 weight rows, 64-wide K chunks), on 16 and 64 rows, and swapped
from tts_kernels.swiglu import SILU_TILE, gemm_rows_silu, silu_tile
assert silu_tile(2 * 64, 256) == SILU_TILE
for rows, tile in ((5, None), (5, RowsTile(16)), (40, RowsTile(64))):
    x16, w16 = torch.randn(rows, 256, generator=g).half(), (0.1 * torch.randn(2 * 64, 256, generator=g)).half()
    got = gemm_rows_silu(x16, w16, tile)
    assert got.dtype == torch.float16 and got.shape == (rows, 64)
    assert torch.equal(got, silu_mul(gemm_rows(x16, w16, tile=tile or SILU_TILE), torch.float16))
    swap = RowsTile(64, swap=True)
    assert torch.equal(gemm_rows_silu(x16, w16, swap), silu_mul(gemm_rows(x16, w16, tile=swap), torch.float16))
    exact = x16.double() @ w16.double().t()
    torch.testing.assert_close(got.double(), F.silu(exact[:, :64]) * exact[:, 64:], rtol=1e-3, atol=1e-4)

cfg = DecoderConfig(hidden_size=64, intermediate_size=96, num_layers=2, num_heads=8, num_kv_heads=2,
                    head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0, attention_bias=False)
torch.manual_seed(0)
plain = Decoder(cfg)
for p in plain.parameters():
    torch.nn.init.normal_(p, 0, 0.3) if p.dim() > 1 else torch.nn.init.normal_(p, 1, 0.1)
fused = Decoder(cfg)
fused.load_state_dict(plain.state_dict())
use_kernels(fused, True)
rows, capacity = 3, 24
fused.cache_rope(capacity)   # the engine's way: RoPE gathered from a table

def caches():
    return [StaticKV(rows, 2, capacity, cfg.head_dim, "cpu", torch.float32) for _ in range(cfg.num_layers)]

def run(model, kvs, x, at):
    s = x.shape[1]
    for kv in kvs:
        kv.at = at
    positions = kvs[0].positions(s)
    keys = torch.arange(at + s if isinstance(at, int) else capacity)   # what StaticKV.update returns
    mask = (keys[None, None, :] <= positions[:, :, None])[:, None]
    return model(x, positions, mask, kvs)

# the engine's prefill: prompts written into other cache rows, more queries than one tile holds
a, b = caches(), caches()
slots = torch.tensor([[2, 7], [0, 7]])[:, 0]   # a strided column, as the engine's admission makes
x = torch.randn(2, 20, 64, generator=g)
given = x.clone()
got = fused(x, torch.arange(20).expand(2, 20), None, [kv.for_rows(slots) for kv in b])
assert torch.equal(x, given)   # the residual stream starts in a buffer of its own
mask = torch.ones(20, 20, dtype=torch.bool).tril()[None, None]
torch.testing.assert_close(got, plain(x, torch.arange(20).expand(2, 20), mask, [kv.for_rows(slots) for kv in a]),
                           rtol=1e-5, atol=1e-5)
# its next chunk, attending to the cached keys of the first
x = torch.randn(2, 4, 64, generator=g)
positions = torch.arange(20, 24).expand(2, 4)
mask = torch.ones(4, 24, dtype=torch.bool).tril(20)[None, None]
torch.testing.assert_close(fused(x, positions, None, [kv.for_rows(slots, at=20) for kv in b]),
                           plain(x, positions, mask, [kv.for_rows(slots, at=20) for kv in a]), rtol=1e-5, atol=1e-5)
torch.testing.assert_close(b[0].k[slots], a[0].k[slots], rtol=1e-5, atol=1e-5)
assert not b[0].k[1].any(), "a row outside the prefill was written"
# a voice prefix (the engine's Prefill.voice_prefix): 5 shared positions through the fused layers
# alone into a cache of one row, copied into two slots, then a chunk of 6 from position 5: the
# whole prompts' outputs and cached keys through the plain layers
prefix, rest = torch.randn(1, 5, 64, generator=g), torch.randn(2, 6, 64, generator=g)
alone = [StaticKV(1, 2, 8, cfg.head_dim, "cpu", torch.float32) for _ in range(cfg.num_layers)]
fused(prefix, torch.arange(5)[None], None, alone)
a, b = caches(), caches()
for kv, one in zip(b, alone):
    kv.k[slots, :, :5], kv.v[slots, :, :5] = one.k[0, :, :5], one.v[0, :, :5]
got = fused(rest, torch.arange(5, 11).expand(2, 6), None, [kv.for_rows(slots, at=5) for kv in b])
whole = torch.cat([prefix.expand(2, 5, 64), rest], dim=1)
expected = plain(whole, torch.arange(11).expand(2, 11), torch.ones(11, 11, dtype=torch.bool).tril()[None, None],
                 [kv.for_rows(slots) for kv in a])
torch.testing.assert_close(got, expected[:, 5:], rtol=1e-5, atol=1e-5)
torch.testing.assert_close(b[0].k[slots, :, :11], a[0].k[slots, :, :11], rtol=1e-5, atol=1e-5)
# a packed prefill tile (tts_cli/engine/prefill.py): segments of 7, 4 and 9 tokens back to back in a
# tile of 24 (the last 4 unused) into slots 2, 0 and 1 from positions 0, 5 and 3 (the positions before
# them already cached), and an unused row: the fused layers give the plain ones' outputs and caches,
# and the plain packed path gives each segment's outputs alone
a, b = caches(), caches()
for kv_a, kv_b in zip(a, b):
    for name in ("k", "v"):
        getattr(kv_a, name).copy_(torch.randn(getattr(kv_a, name).shape, generator=g))
        getattr(kv_b, name).copy_(getattr(kv_a, name))
before = copy.deepcopy(a)
segments = [torch.tensor(t) for t in ([2, 0, 1, 0], [0, 5, 3, 0], [0, 7, 11, 0], [7, 4, 9, 0])]
x = torch.randn(1, 24, 64, generator=g)
positions = torch.cat([torch.arange(0, 7), torch.arange(5, 9), torch.arange(3, 12), torch.zeros(4, dtype=torch.long)])
got = fused(x, positions[None], None, [kv.for_segments(*segments, 9) for kv in b])
packed = plain(x, positions[None], None, [kv.for_segments(*segments, 9) for kv in a])
torch.testing.assert_close(got[:, :20], packed[:, :20], rtol=1e-5, atol=1e-5)
for kv_a, kv_b, kv_before in zip(a, b, before):
    torch.testing.assert_close(kv_b.k, kv_a.k, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kv_b.v, kv_a.v, rtol=1e-5, atol=1e-5)
    assert torch.equal(kv_a.k[0, :, :5], kv_before.k[0, :, :5]) and torch.equal(kv_a.k[2, :, 7:], kv_before.k[2, :, 7:])
    assert not torch.equal(kv_a.k[1, :, 3:12], kv_before.k[1, :, 3:12])
for row, at, first, count in zip(*(t[:3].tolist() for t in segments)):
    tokens = slice(first, first + count)
    mask = torch.ones(count, at + count, dtype=torch.bool).tril(at)[None, None]
    alone = plain(x[:, tokens], positions[None, tokens], mask,
                  [kv.for_rows(torch.tensor([row]), at=at) for kv in copy.deepcopy(before)])
    torch.testing.assert_close(packed[:, tokens], alone, rtol=1e-5, atol=1e-5)
# the code predictor's pattern: 2 tokens at 0, then one token per call at a shared offset
a, b = caches(), caches()
for step, at in enumerate([0, 2, 3, 4]):
    x = torch.randn(rows, 2 if at == 0 else 1, 64, generator=g)
    torch.testing.assert_close(run(fused, b, x, at), run(plain, a, x, at), rtol=1e-5, atol=1e-5)
# the talker's pattern: one token per row, each row at its own position
position = torch.tensor([5, 9, 13])
for _ in range(3):
    x = torch.randn(rows, 1, 64, generator=g)
    torch.testing.assert_close(run(fused, b, x, position.clone()), run(plain, a, x, position.clone()),
                               rtol=1e-5, atol=1e-5)
    position += 1
for p_kv, f_kv in zip(a, b):
    torch.testing.assert_close(f_kv.k, p_kv.k, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(f_kv.v, p_kv.v, rtol=1e-5, atol=1e-5)   # one merged GEMM: other sum order
# q/k/v as partial sums (gemm_rows' K slices: 2-64 fp16 rows on the GPU), which attention adds in
# order: the same keys, values and output as from their sum
from tts_kernels.attention import cached_attention
attention = fused.layers[0].self_attn
qkv_parts = torch.randn(3, rows, (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim, generator=g)
kv_summed, kv_parts = caches()[0], caches()[0]
def attend(qkv, kv, **launch):
    return cached_attention(qkv, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, attention.q_norm.weight,
                            attention.k_norm.weight, 1e-6, *fused.rope_tables[-1], kv.k, kv.v, torch.arange(rows),
                            torch.tensor([5, 9, 13]), 1, cfg.head_dim ** -0.5, **launch)
expected = attend((qkv_parts[0] + qkv_parts[1]) + qkv_parts[2], kv_summed)
assert torch.equal(attend(qkv_parts.reshape(3 * rows, -1), kv_parts), expected)
assert torch.equal(kv_parts.k, kv_summed.k) and torch.equal(kv_parts.v, kv_summed.v) and kv_parts.k.any()
# other key steps (tools/attention_bench.py times them): the same output but for the order of the
# softmax's steps
for block_k in (16, 64, 128):
    torch.testing.assert_close(attend(qkv_parts.reshape(3 * rows, -1), caches()[0], block_k=block_k), expected,
                               rtol=1e-5, atol=1e-5)

# the one-token kernel (the engine's against the code predictor's short caches from 64 rows) forced
# at these rows: the same keys and values written, the same output but for the order of the sums,
# over fp32 and fp16 caches
for dtype in (torch.float32, torch.float16):
    kv_general, kv_one = caches()[0], caches()[0]
    kv_general.k, kv_general.v = (torch.randn(kv_general.k.shape, generator=g).to(dtype) for _ in range(2))
    kv_one.k, kv_one.v = kv_general.k.clone(), kv_general.v.clone()
    general = attend(qkv_parts.reshape(3 * rows, -1), kv_general, dtype=dtype, decode=False)
    one = attend(qkv_parts.reshape(3 * rows, -1), kv_one, dtype=dtype, decode=True)
    assert torch.equal(kv_one.k, kv_general.k) and torch.equal(kv_one.v, kv_general.v)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(one.float(), general.float(), rtol=tolerance, atol=tolerance)

# fp16 weights (the engine's default on CUDA): every projection's input rounded once to fp16, fp16
# caches (the torch path rounds its keys and values there too), fp16 queries and probabilities
plain16, fused16 = copy.deepcopy(plain).half(), copy.deepcopy(fused).half()
use_kernels(fused16, True)
a, b = ([StaticKV(rows, 2, capacity, cfg.head_dim, "cpu", torch.float16) for _ in range(cfg.num_layers)]
        for _ in range(2))
worst = 1.0
for at in [0, 2, 3, 4]:
    x = torch.randn(rows, 2 if at == 0 else 1, 64, generator=g)
    got, ref = run(fused16, b, x, at), run(plain16, a, x, at)
    assert got.dtype == torch.float32 and got.shape == ref.shape
    worst = min(worst, F.cosine_similarity(got.flatten(1), ref.flatten(1)).min().item())
    assert (got - ref).abs().max() > 0, "fp16 inputs left no trace: the fp32 path ran"
assert worst > 0.99999, worst
# one token per row read from a table by the first kernels (x_rows), as the code predictor's
# positions take their codes' embeddings: the same as the gathered rows given
a, b = caches(), caches()
table, picks = torch.randn(11, 64, generator=g), torch.tensor([[4, 9], [0, 9], [4, 9]])[:, 0]   # strided
given = table.clone()
expected = run(plain, a, table[picks][:, None], 0)
for kv in b:
    kv.at = 0
got = fused(table, b[0].positions(1), None, b, x_rows=picks)
torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
assert torch.equal(table, given)
print("layer kernels ok")
"""

CONV_CHECK = """
# tts_kernels.conv against torch's convolutions and SnakeBeta, in fp32: a dilated causal conv with
# its history, a 1x1 conv with a residual, a transposed conv, a conv to one channel; outputs into
# slices of larger buffers, whose other frames must stay untouched.
import torch
import torch.nn.functional as F
from tts_cli.model.codec import CausalConv1d, CausalConvTranspose1d, SnakeBeta
from tts_kernels.conv import causal_conv

g = torch.Generator().manual_seed(0)
batch, frames, channels = 3, 37, 20   # channels: not a multiple of the kernel's K block
act = SnakeBeta(channels)
with torch.no_grad():
    act.alpha.normal_(0, 0.5, generator=g)
    act.beta.normal_(0, 0.5, generator=g)


def time_major(x):
    return x.transpose(1, 2)


for dilation in (1, 3):
    conv = CausalConv1d(channels, channels, 7, dilation=dilation)
    src = torch.randn(batch, conv.context + frames, channels, generator=g)   # history, then this call's inputs
    with torch.no_grad():
        expected = conv.conv(time_major(src))                                 # [B, C, frames]
    out = torch.full((batch, frames, channels), float("nan"))
    snaked = torch.zeros(batch, 5 + frames, channels)
    causal_conv(src, conv.tap_matrix(), conv.conv.bias, frames, dilation, out=out, snake=act.kernel_factors(channels),
                snake_out=snaked[:, 5:])
    torch.testing.assert_close(time_major(out), expected, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(time_major(snaked[:, 5:]), act(expected), rtol=1e-5, atol=1e-5)
    assert not snaked[:, :5].any()

pointwise = CausalConv1d(channels, 16, 1)
src, residual = torch.randn(batch, frames, channels, generator=g), torch.randn(batch, frames, 16, generator=g)
out = torch.empty(batch, frames, 16)
causal_conv(src, pointwise.tap_matrix(), pointwise.conv.bias, frames, residual=residual, out=out)
with torch.no_grad():
    torch.testing.assert_close(out, time_major(pointwise.conv(time_major(src))) + residual, rtol=1e-5, atol=1e-5)

up = CausalConvTranspose1d(channels, 8, 10, 5)
src = torch.randn(batch, 1 + frames, channels, generator=g)
out = torch.empty(batch, frames * 5, 8)
causal_conv(src, *up.block_matrix(), frames, out=out)
with torch.no_grad():
    full = up.conv(time_major(src))                  # the history frame's blocks come first
torch.testing.assert_close(time_major(out), full[..., 5:5 + frames * 5], rtol=1e-5, atol=1e-5)

to_wave = CausalConv1d(channels, 1, 7)
src = torch.randn(batch, 6 + frames, channels, generator=g)
out = torch.empty(batch, frames, 1)
causal_conv(src, to_wave.tap_matrix(), to_wave.conv.bias, frames, out=out)
with torch.no_grad():
    torch.testing.assert_close(time_major(out), to_wave.conv(time_major(src)), rtol=1e-5, atol=1e-5)
# dilated, fp16, the input rows and the waveform rows inside larger buffers (batch strides of their own)
to_wave = CausalConv1d(channels, 1, 7, dilation=2)
rows = torch.randn(batch, 12 + frames + 3, channels, generator=g).half()
waves = torch.full((batch, frames + 4, 1), float("nan"))
causal_conv(rows[:, :12 + frames], to_wave.tap_matrix().half(), to_wave.conv.bias, frames, 2, out=waves[:, 4:])
with torch.no_grad():
    expected = F.conv1d(time_major(rows[:, :12 + frames].float()), to_wave.conv.weight.half().float(),
                        to_wave.conv.bias, dilation=2)
torch.testing.assert_close(time_major(waves[:, 4:]), expected, rtol=1e-5, atol=1e-5)
assert waves[:, :4].isnan().all()
# more rows x frames than one interpreter tile (INTERPRETER_BLOCK_M), not a multiple of it, in both
# launches (the GEMM over every buffer frame and the taps' sums); 9 taps: 16 columns of partial sums
for taps, dilation, long_frames in ((7, 3, 700), (9, 2, 411)):
    to_wave = CausalConv1d(channels, 1, taps, dilation=dilation)
    rows = torch.randn(batch, to_wave.context + long_frames + 2, channels, generator=g)
    waves = torch.full((batch, long_frames + 1, 1), float("nan"))
    causal_conv(rows[:, :to_wave.context + long_frames], to_wave.tap_matrix(), to_wave.conv.bias, long_frames,
                dilation, out=waves[:, 1:])
    with torch.no_grad():
        expected = to_wave.conv(time_major(rows[:, :to_wave.context + long_frames]))
    torch.testing.assert_close(time_major(waves[:, 1:]), expected, rtol=1e-5, atol=1e-5)
    assert waves[:, :1].isnan().all()

# fp16 inputs and weights, fp16 snake_out: values beyond fp16's range are stored as infinities
src = torch.randn(batch, 6 + frames, channels, generator=g)
conv = CausalConv1d(channels, channels, 7)
with torch.no_grad():
    expected = act(F.conv1d(time_major(src.half().float()), conv.conv.weight.half().float(), conv.conv.bias))
snaked = torch.empty(batch, frames, channels, dtype=torch.float16)
causal_conv(src.half(), conv.tap_matrix().half(), conv.conv.bias, frames, snake=act.kernel_factors(channels),
            snake_out=snaked)
torch.testing.assert_close(time_major(snaked.float()), expected, rtol=2e-3, atol=2e-3)
with torch.no_grad():
    conv.conv.bias[3] = 1e6
causal_conv(src.half(), conv.tap_matrix().half(), conv.conv.bias, frames, snake=act.kernel_factors(channels),
            snake_out=snaked)
assert torch.isinf(snaked[:, :, 3]).all() and torch.isfinite(snaked[:, :, [0, 1, 2, 4]]).all()

try:
    causal_conv(src[:, 1:], to_wave.tap_matrix(), to_wave.conv.bias, frames, out=out)
except ValueError as e:
    assert "does not fit" in str(e), e
else:
    raise AssertionError("a source one frame short was accepted")
try:
    causal_conv(src.half(), conv.tap_matrix().half(), conv.conv.bias, frames, snake=act.kernel_factors(channels - 1),
                snake_out=snaked)
except ValueError as e:
    assert "factors [2, 20]" in str(e), e
else:
    raise AssertionError("SnakeBeta factors of the wrong width were accepted")
print("conv ok")
"""


CODEC_CHECK = """
# The codec as the engine runs it on CUDA (use_kernels: the vocoder time-major, one tts_kernels.conv
# launch per convolution; the upsampling's transposed convolutions as GEMMs) against the plain
# modules: in fp32 the same function; with fp16 inputs within fp16's rounding, and values beyond
# fp16's range refused.
import torch
from tts_cli.errors import CodecRangeError
from tts_cli.cli import BUNDLED_MODEL_DIR
from tts_cli.model.codec import load_codec
from tts_cli.model.transformer import use_kernels

codec = load_codec(BUNDLED_MODEL_DIR / "speech_tokenizer")
g = torch.Generator().manual_seed(0)
with torch.no_grad():
    for name, p in codec.named_parameters():   # nonzero biases and SnakeBeta factors that matter
        if p.dim() == 1:
            p.add_(0.1 * torch.randn(p.shape, generator=g))
# 3 frames: windows of 2 carry a history into a second, shorter call; each frame costs the
# interpreter ~1 s (tts_kernels.conv's tall tiles there)
codes = torch.randint(0, codec.config.codebook_size, (2, 3, 16), generator=g)


def streamed(window):
    state = codec.new_state(2)
    return torch.cat([codec.decode_step(codes[:, t:t + window], state) for t in range(0, codes.shape[1], window)], 1)


full, in_windows = codec.decode(codes), streamed(2)
codec.decoder.half = False
use_kernels(codec, True)
assert codec.decoder.fused and len(codec.decoder.convs) == 2 + 4 * 7
assert codec.decoder.convs[0].weight.dtype == torch.float32
torch.testing.assert_close(codec.decode(codes), full, rtol=1e-5, atol=2e-6)
for window in (1, 2):
    torch.testing.assert_close(streamed(window), in_windows, rtol=1e-5, atol=2e-6)

codec.decoder.half = True
use_kernels(codec, True)
assert codec.decoder.convs[0].weight.dtype == torch.float16
got = streamed(2)
snr = 10 * torch.log10(full.pow(2).sum() / (got - full).pow(2).sum())
assert snr > 40, f"fp16 vocoder: SNR {snr:.1f} dB"
assert codec.decoder.overflow.item() == 0
with torch.no_grad():
    codec.decoder[0].conv.bias.add_(1e5)   # the first convolution's outputs beyond fp16's range,
                                            # found as non-finite samples of the waveform
try:
    codec.decode(codes[:, :1])
except CodecRangeError as e:
    assert "beyond fp16's range" in str(e) and "--codec-precision fp32" in str(e), e
else:
    raise AssertionError("an fp16 overflow went unnoticed")
print("codec ok")
"""


WINDOW_ATTENTION_CHECK = """
# The codec transformer's streamed window attention as one kernel (tts_kernels.window_attention)
# against the torch module: rows at different positions (a fresh row, a partial window, a full one),
# calls of 1 to 8 frames; the same output and the same cache afterwards.
import torch
from tts_cli.cli import BUNDLED_MODEL_DIR
from tts_cli.model.codec import load_codec, sliding_window_mask
from tts_cli.model.transformer import rope_cos_sin
codec = load_codec(BUNDLED_MODEL_DIR / "speech_tokenizer")
attn = codec.pre_transformer.layers[0].self_attn
attn.prepare_fused()   # q, k and v as one projection, as the engine runs them
cfg = codec.config
g = torch.Generator().manual_seed(0)
rows = 3
state_p = codec.new_state(rows); state_f = codec.new_state(rows)
state_p.position[:] = torch.tensor([0, 5, 70]); state_f.position[:] = state_p.position
for key in state_p.history:   # random caches: what lies at negative positions must stay unseen
    if "self_attn" in key:
        state_p.history[key].normal_(generator=g); state_f.history[key].copy_(state_p.history[key])

for frames in [4, 1, 3, 4, 2, 8]:
    x = torch.randn(rows, frames, cfg.hidden_size, generator=g)
    positions = state_p.position[:, None] + torch.arange(frames)
    cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta, x.dtype)
    rope = cos[:, None], sin[:, None]
    mask = sliding_window_mask(positions, cfg.sliding_window - 1, cfg.sliding_window)
    attn.fused = False
    ref = attn(x, rope, mask, state_p)
    attn.fused = True
    got = attn(x, rope, mask, state_f)
    key = attn.state_key
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state_f.history[key], state_p.history[key], rtol=0, atol=0)
    state_p.position += frames; state_f.position += frames
# the one-warp kernel (the engine's from 64 rows of 4 frames) forced at these rows, against the
# tensor-core one: the same output but for the order of the sums, the same cache afterwards
from tts_kernels.window_attention import window_attention
cache = torch.randn(rows, 2, cfg.num_heads, cfg.sliding_window - 1, cfg.head_dim, generator=g)
start = torch.tensor([0, 9, 130])
for frames in [4, 1, 7]:
    q, k, v = (torch.randn(rows, frames, cfg.num_heads * cfg.head_dim, generator=g) for _ in range(3))
    cos, sin = rope_cos_sin(start[:, None] + torch.arange(frames), cfg.head_dim, cfg.rope_theta, torch.float32)
    caches = cache.clone(), cache.clone()
    outs = [window_attention(q, k, v, cos, sin, c, start, cfg.sliding_window, one_warp=w)
            for c, w in zip(caches, (False, True))]
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
    assert torch.equal(caches[1], caches[0]) and not torch.equal(caches[0], cache)
    start += frames
print("window attention ok")
"""


ADVANCE_CHECK = """
import copy
from types import SimpleNamespace
import torch
from tts_cli.engine.step import advance_slots
from tts_kernels.advance import advance

device = globals().get("DEVICE", "cpu")   # tests/test_gpu.py runs this on the GPU
g = torch.Generator().manual_seed(0)
rows, groups, vocab, width, eos = 9, 16, 37, 3000, 7
state = SimpleNamespace(
    g0=torch.randint(0, vocab, (rows,), generator=g), hidden=torch.randn(rows, width, generator=g),
    position=torch.randint(0, 50, (rows,), generator=g), frame=torch.randint(0, 5, (rows,), generator=g),
    cap=torch.full((rows,), 5), active=torch.rand(rows, generator=g) < 0.8,
    seen=torch.rand(rows, vocab, generator=g) < 0.3, out_codes=torch.zeros(rows, groups, dtype=torch.long),
    out_emit=torch.zeros(3, rows, dtype=torch.bool))
emit = state.active & (torch.rand(rows, generator=g) < 0.7)
drawn = torch.randint(0, vocab, (rows,), generator=g)
drawn[:2] = eos                                   # a slot that ends on EOS
state.frame[2:4] = state.cap[2:4] - 1             # slots that reach their cap
drawn[3] = eos                                    # ... one of them drawing EOS after its last frame
hidden_rows = torch.randn(rows, 2, width, generator=g)[:, -1]   # strided, as the talker's last position
codes = torch.randint(0, 2048, (rows, groups), generator=g)
state = SimpleNamespace(**{name: value.to(device) for name, value in vars(state).items()})
emit, drawn, hidden_rows, codes = (t.to(device) for t in (emit, drawn, hidden_rows, codes))
hidden_rows = torch.empty(rows, 2, width, device=device)[:, -1].copy_(hidden_rows)   # strided there too
expected = copy.deepcopy(state)
advance_slots(expected, emit, drawn, hidden_rows, codes, eos)
advance(state, emit, drawn, hidden_rows, codes, eos)
for name, value in vars(expected).items():
    assert torch.equal(getattr(state, name), value), name
assert expected.out_emit[1].sum() < expected.out_emit[0].sum() < rows   # the cases above happened
assert expected.out_emit[0][3] and expected.out_emit[2][3] and not expected.out_emit[1][3]   # EOS at the cap

# the start of the depth stage: who emits, the codebook-0 embeddings (the talker's codec_track)
from tts_cli.engine.step import start_frame_slots
from tts_kernels.advance import start_frame
talker = SimpleNamespace(codec_embedding=torch.nn.Embedding(vocab, width).to(device).half())
talker.codec_track = lambda ids: talker.codec_embedding(ids).float()
outputs = [(torch.zeros(rows, dtype=torch.bool, device=device), torch.zeros(rows, width, device=device))
           for _ in range(2)]
start_frame_slots(expected, talker, *outputs[0], eos)
start_frame(state, talker.codec_embedding.weight, *outputs[1], eos)
assert torch.equal(outputs[0][0], outputs[1][0]) and torch.equal(outputs[0][1], outputs[1][1])
assert torch.equal(outputs[0][0], expected.out_emit[1])

# the end of the depth stage: the frame's codes into the codec window, the talker's next input
from tts_cli.engine.step import emit_frame_slots
from tts_cli.model.depth import CodePredictor
from tts_kernels.advance import emit_frame
emit_next, code0_embed = outputs[0]
code_vocab = 23
tables = (torch.randn(15 * code_vocab, width, generator=g) * 0.1).half().to(device)
cp = SimpleNamespace(fused=True, fused_tables=(None, tables), cfg=SimpleNamespace(code_vocab_size=code_vocab))
cp.frame_embedding = lambda code0, codes: CodePredictor.frame_embedding(cp, code0, codes)
residual = torch.randint(0, code_vocab, (rows, 16), generator=g).to(device)[:, 1:]   # rows strided
pad_embed = torch.randn(1, width, generator=g).to(device)
results = []
for target in (expected, state):
    target.window_codes = torch.zeros(rows, 4, groups, dtype=torch.long, device=device)
    target.window_column = torch.tensor([2], device=device)
    results.append((torch.zeros(rows, groups, dtype=torch.long, device=device), torch.zeros(rows, width, device=device)))
emit_frame_slots(expected, emit_next, residual, results[0][0], cp, code0_embed, pad_embed, results[0][1])
emit_frame(state, emit_next, residual, results[1][0], tables, code0_embed, pad_embed, results[1][1])
assert torch.equal(results[0][0], results[1][0]) and torch.equal(expected.window_codes, state.window_codes)
assert torch.equal(state.window_codes[:, 2], results[0][0]) and (results[0][0][:, 0] == 0).any()
torch.testing.assert_close(results[1][1], results[0][1], rtol=1e-6, atol=1e-6)   # sums in torch's order or not
# each slot's own text vector (the streaming text mode's trailing text)
with_pad = results[1][1].clone()
text_rows = torch.randn(rows, width, generator=g).to(device)
emit_frame_slots(expected, emit_next, residual, results[0][0], cp, code0_embed, text_rows, results[0][1])
emit_frame(state, emit_next, residual, results[1][0], tables, code0_embed, text_rows, results[1][1])
torch.testing.assert_close(results[1][1], results[0][1], rtol=1e-6, atol=1e-6)
torch.testing.assert_close(results[1][1] - with_pad, text_rows - pad_embed, rtol=1e-5, atol=1e-5)
print("advance ok")
"""


def _interpret(check: str) -> str:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(
        [str(ROOT), str(ROOT / "kernels"), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, "-c", "import interpreter_once\n" + check], env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout


needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


@needs_triton
def test_rms_norm_kernel_equals_torch_in_the_interpreter():
    assert "rms_norm ok" in _interpret(RMS_NORM_CHECK)


@needs_triton
def test_fused_decoder_layers_equal_torch_in_the_interpreter():
    """Add + norm, silu * up, and whole decoder layers (norm + RoPE + cache write, cached attention,
    merged projections) against the torch reference, in both caching patterns the engine uses."""
    assert "layer kernels ok" in _interpret(LAYER_KERNELS_CHECK)


@needs_triton
def test_conv_kernel_equals_torch_in_the_interpreter():
    assert "conv ok" in _interpret(CONV_CHECK)


@needs_triton
def test_engine_codec_equals_the_plain_modules_in_the_interpreter():
    """Whole decode and streamed in windows of 1 and 2 frames (the convolutions' histories kept
    by the fused vocoder)."""
    assert "codec ok" in _interpret(CODEC_CHECK)


SAMPLER_CHECK = """
import torch
from tts_cli.model.sampler import RowSampling, SamplerSettings, choose
from tts_kernels.sampler import sample_rows

g = torch.Generator().manual_seed(0)
for vocab in (60, 300, 2048):   # 2048: the code predictor's vocabulary (the talker's 3072 is checked on the GPU)
    rows = 12
    logits = torch.randn(rows, vocab, generator=g) * 3
    logits[:4] = torch.randint(-3, 3, (4, vocab), generator=g).float()      # ties everywhere
    logits[4, : vocab // 2] = float("-inf")                                  # suppressed ids
    settings = [SamplerSettings(do_sample=i % 5 != 0, temperature=[1.0, 0.7, 1.3][i % 3],
                                top_k=[50, 0, 1, 3, vocab + 5, 7][i % 6], top_p=1.0) for i in range(rows)]
    sampling = RowSampling.stack(settings, "cpu")
    seeds = torch.randint(0, 2**62, (rows,), generator=g)
    for frame, group in ((0, 0), (torch.arange(rows) * 3 + 1, 15)):
        expected = choose(logits, sampling, seeds, frame, group, top_p=False)
        nonfinite = torch.zeros(1, dtype=torch.int32)
        got = sample_rows(logits, sampling.temperature, sampling.top_k, sampling.do_sample, seeds, frame, group,
                          nonfinite=nonfinite)
        assert torch.equal(got, expected), (vocab, group, got, expected)
        assert nonfinite.item() == 0
# NaN and +inf logits are counted (-inf, a suppressed id, is not)
logits[5, :3] = float("nan")
logits[6, 7] = float("inf")
nonfinite = torch.zeros(1, dtype=torch.int32)
sample_rows(logits, sampling.temperature, sampling.top_k, sampling.do_sample, seeds, 0, 1, nonfinite=nonfinite)
assert nonfinite.item() == 4, nonfinite

# the talker's processors in the same kernel (repetition penalty, EOS blocked while the frame drawn,
# frame + offset, is below min_new_tokens, suppressed ids): TalkerLogitsProcessor then choose
from tts_cli.model.sampler import TalkerLogitsProcessor
from tts_kernels.sampler import TalkerProcessing
vocab, eos = 1100, 1090   # the top 1024 ids suppressed, but EOS
process = TalkerLogitsProcessor(vocab, eos, "cpu")
logits = torch.randn(rows, vocab, generator=g) * 3
logits[:, eos] = 20.0     # EOS wins wherever it is not blocked
seen = torch.rand(rows, vocab, generator=g) < 0.2
penalty = torch.tensor([[1.0], [1.05], [1.3], [0.9]] * 3)
frame, min_new_tokens = torch.arange(rows) % 4, torch.full((rows,), 3)
expected = choose(process(logits, seen, frame + 1 < min_new_tokens, penalty), sampling, seeds, frame + 1, 0,
                  top_p=False)
got = sample_rows(logits, sampling.temperature, sampling.top_k, sampling.do_sample, seeds, frame, 0, frame_offset=1,
                  talker=TalkerProcessing(seen, penalty, min_new_tokens, process.suppressed, eos))
assert torch.equal(got, expected), (got, expected)
assert (got == eos).any() and (got != eos).any() and ((got < vocab - 1024) | (got == eos)).all()

# the top-k threshold itself: the k-th largest value with multiplicity, for every k of a row
import triton
import triton.language as tl
from tts_kernels.sampler import kth_largest


@triton.jit
def _kth(values_ptr, out_ptr, BLOCK: tl.constexpr):
    k = tl.program_id(0) + 1
    tl.store(out_ptr + k - 1, kth_largest(tl.load(values_ptr + tl.arange(0, BLOCK)), k))


for values in (torch.randn(64, generator=g) * 1e3, torch.randint(-2, 2, (64,), generator=g).float(),
               torch.tensor([float("-inf")] * 60 + [-0.0, 0.0, 1e-38, -3e38])):
    out = torch.empty(64)
    _kth[(64,)](values, out, BLOCK=64)
    assert torch.equal(out, values.sort(descending=True).values), (values, out)
print("sampler ok")
"""


@needs_triton
def test_sampler_kernel_draws_what_the_torch_sampler_draws_in_the_interpreter():
    """Temperature, top-k with ties, suppressed ids, greedy rows, the counter-based noise for one
    frame for all rows and for per-row frames; the count of NaN and +inf logits."""
    assert "sampler ok" in _interpret(SAMPLER_CHECK)


@needs_triton
def test_step_advance_kernel_updates_the_slots_as_torch_does_in_the_interpreter():
    """The end of the talker stage in one kernel (tts_kernels.advance) against advance_slots: slots
    that emit or not, inactive ones, one ending on EOS, ones reaching their cap, a strided state."""
    assert "advance ok" in _interpret(ADVANCE_CHECK)


@needs_triton
def test_codec_window_attention_kernel_equals_torch_in_the_interpreter():
    assert "window attention ok" in _interpret(WINDOW_ATTENTION_CHECK)


def test_kernels_are_not_used_off_cuda():
    import tts_kernels
    ok, why = tts_kernels.available("cpu")
    assert not ok and "CUDA" in why


def test_a_triton_without_what_the_kernels_use_is_a_fallback_with_the_reason(monkeypatch):
    """An older Triton (before PDL's gdc_* helpers) used to pass available() and then fail the engine
    with an ImportError when a kernel module was imported."""
    import tts_kernels
    pytest.importorskip("triton")
    monkeypatch.setitem(sys.modules, "tts_kernels.launch", None)   # as its `from triton... import gdc_*` fails
    ok, why = tts_kernels.available("cuda")
    assert not ok and why.startswith("this Triton (") and "lacks what the kernels use" in why


@needs_triton
def test_the_hopper_only_paths_step_aside_on_other_gpus_and_say_why(monkeypatch, caplog):
    """Selectors with a GPU faked (none here): an A100 and an H100 PCIe (114 SMs)."""
    import logging
    from types import SimpleNamespace

    import torch
    from tts_kernels import conv, depth_frame, launch

    gpu = {"capability": (8, 0), "sms": 108, "name": "NVIDIA A100-SXM4-80GB"}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: gpu["capability"])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: gpu["name"])
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: SimpleNamespace(
        major=gpu["capability"][0], minor=gpu["capability"][1], multi_processor_count=gpu["sms"]))
    cp = SimpleNamespace(decoder=SimpleNamespace(norm=SimpleNamespace(weight=SimpleNamespace(
        device=torch.device("cuda", 0)))))
    launch._capability.cache_clear()
    launch.pdl_possible.cache_clear()
    conv.tma_available.cache_clear()
    try:
        assert conv.tma_available(0) == (False, "NVIDIA A100-SXM4-80GB is not Hopper (sm_90)")
        assert depth_frame.unsupported(cp, 64) == "it is built and measured for Hopper (sm_90), not sm_80"
        with caplog.at_level(logging.INFO, logger="tts_kernels"):
            assert launch.pdl_possible(0) is False
        assert "launched without PDL (programmatic dependent launch needs sm_90; GPU 0 is sm_80)" in caplog.text
        gpu.update(capability=(9, 0), sms=114, name="NVIDIA H100 PCIe")
        assert depth_frame.unsupported(cp, 64) == "the GPU has 114 SMs, the kernel's tiles are planned for 128 or more"
        # Hopper with a Triton whose Gluon renamed what the TMA convolution calls (3.9: gl.barrier,
        # tma.async_load): conv.py's kernels instead, and why; with 3.6's names, the TMA kernel
        import triton
        try:
            from triton.experimental.gluon import language as gl
            from triton.experimental.gluon.language.nvidia.hopper import tma
        except ImportError:   # a Triton without Gluon (tma_available: "no Gluon")
            return
        for names_of_3_6 in (False, True):
            with monkeypatch.context() as names:
                if names_of_3_6:
                    names.setattr(gl, "thread_barrier", lambda: None, raising=False)
                    names.delattr(tma, "async_load", raising=False)
                else:
                    names.delattr(gl, "thread_barrier", raising=False)
                    names.setattr(tma, "async_load", lambda *args: None, raising=False)
                available, why = conv.tma_available.__wrapped__(0)
            assert available == names_of_3_6
            assert why == ("" if names_of_3_6 else "Triton " + triton.__version__ + "'s Gluon names its barrier and "
                           "TMA load otherwise than the 3.6 the kernel is written for")
    finally:
        launch._capability.cache_clear()
        launch.pdl_possible.cache_clear()
        conv.tma_available.cache_clear()   # (the faked GPUs' answers: not for later tests on a real one)


def test_a_convolution_past_the_kernels_int32_offsets_is_refused():
    """The convolution kernels address elements with int32 offsets (row x batch stride + ...): 2900
    rows of the vocoder's last block at a 4-frame window (7734 x 96 elements each) would wrap them and
    write other rows' audio. Refused before any launch (meta tensors: no memory); 2700 rows pass the
    check (and fail later, on the meta device)."""
    import torch
    from tts_kernels.conv import causal_conv

    def call(rows):
        src = torch.empty(rows, 6 + 7728, 96, dtype=torch.float16, device="meta")
        causal_conv(src, torch.empty(7 * 96, 96, dtype=torch.float16, device="meta"),
                    torch.empty(96, device="meta"), 7728, out=torch.empty(rows, 7728, 96, dtype=torch.float16,
                                                                            device="meta"))
    with pytest.raises(ValueError, match="2900 rows of 742464 elements: past the 2.31 elements"):
        call(2900)
    with pytest.raises(Exception) as other:
        call(2700)
    assert "2^31" not in str(other.value)


def test_tma_convolution_takes_only_the_convolutions_it_fits():
    """tts_kernels.conv_tma (Hopper only, not run here) takes fp16 convolutions whose rows TMA can
    address, whose rows are long enough to fill its M blocks and whose shapes it was measured faster
    on; conv.py's kernel takes the rest."""
    import torch
    pytest.importorskip("triton.experimental.gluon")
    from tts_kernels.conv_tma import MIN_FRAMES, fits
    half = torch.float16
    src, weight = torch.zeros(4, 6 + 7680, 96, dtype=half), torch.zeros(7 * 96, 96, dtype=half)
    assert fits(src, weight, 7680)
    assert not fits(src, weight, MIN_FRAMES - 1)                         # one row's frames too few
    assert not fits(src.float(), weight.float(), 7680)                   # fp32 vocoder
    assert not fits(torch.zeros(4, 6 + 7680, 192, dtype=half)[:, :, :96], weight, 7680)   # rows not contiguous
    assert not fits(torch.zeros(4, 6 + 7680, 80, dtype=half), torch.zeros(7 * 80, 96, dtype=half), 7680)
    assert not fits(src, torch.zeros(7 * 96, 1, dtype=half), 7680)       # the waveform: one channel
    assert not fits(src, torch.zeros(96, 7 * 96, dtype=half).t(), 7680)  # weight not contiguous
    wide = torch.zeros(4, 6 + 128, 768, dtype=half)
    assert not fits(wide, torch.zeros(7 * 768, 768, dtype=half), 128)   # faster in conv.py's kernel
    assert fits(wide, torch.zeros(2 * 768, 1920, dtype=half), 128)      # the transposed one, as two taps
    assert not fits(src, torch.zeros(96, 96, dtype=half), 7680)         # a 1x1 convolution: conv.py's kernel


def test_vocoder_epilogue_compiles_for_sm90_to_the_hardware_sine():
    """The SnakeBeta in a convolution's epilogue (conv.py's, which tts_kernels.conv_tma shares),
    compiled offline for sm_90 (tools/sm90_compile.py) for a 1x1 convolution: one hardware sine (MUFU)
    per value a thread stores, and no local memory. tl.sin there compiled to libdevice's exact sinf,
    whose large-argument path went through local memory, and took 13% of the vocoder's convolution
    time at 256 rows (docs/bench.md, 2026-12-04)."""
    import re
    result = subprocess.run([sys.executable, "tools/sm90_compile.py", "conv-1x1", "--channels", "96", "--rows", "256"],
                            cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "kernels"),
                                                                             str(ROOT / "tools")])))
    assert result.returncode == 0, result.stderr[-2000:]
    found = re.search(r"MUFU \([^)]*\) (\d+), local memory loads / stores (\d+) / (\d+)", result.stdout)
    assert found, result.stdout
    mufu, local_loads, local_stores = map(int, found.groups())
    assert mufu >= 16 and local_loads == local_stores == 0, result.stdout


def test_tma_convolution_splits_an_n_block_into_two_powers_of_two():
    """conv_tma runs an N block that is not a power of two (96 channels) as two wgmmas (64 + 32
    columns), none of them padding; other widths are refused by name."""
    pytest.importorskip("triton.experimental.gluon")
    from tts_kernels.conv_tma import split
    assert split(96) == (64, 32) and split(192) == (128, 64) and split(128) == (128, 0) and split(72) == (64, 8)
    for width in (100, 68):
        with pytest.raises(ValueError, match=f"an N block of {width} is not a power of two"):
            split(width)
