"""The Qwen3-TTS 12 Hz codec decoder: codes [B, T, num_quantizers] -> 24 kHz waveform [B, T * 1920].

Same math as the official `Qwen3TTSTokenizerV2Decoder.forward`. Per frame: sum of the codebook
vectors of its 16 codes -> causal conv (k=3) -> sliding-window transformer -> twice (transposed conv
x2 + ConvNeXt block) -> causal conv (k=7) -> per upsample rate: SnakeBeta, causal transposed conv,
three dilated residual units -> SnakeBeta -> causal conv to one channel -> clamp(-1, 1).

Causality: convs pad on the left only, transposed convs drop their right overhang and attention
sees the last `sliding_window` frames only, so output sample n depends on frames <= n // 1920 alone.
The decoder therefore streams exactly: `decode_step` keeps, per batch row, the inputs each layer
still needs from earlier calls (a `CodecState`) and continues every row where it stopped. `decode`
runs the same modules on the whole sequence with an empty history (zero left padding).

Difference to the official `Qwen3TTSTokenizerV2Model.decode`: it calls `chunked_decode`, which
decodes chunks of 300 frames, each with only 25 frames of recomputed left context, and keeps RoPE
positions restarting at 0 per chunk. Up to 300 frames that is the full causal decode; beyond, each
chunk misses the history older than those 25 frames (the transformer alone looks back
num_layers * (sliding_window - 1) = 568 frames, the convs further), so later samples differ slightly.
`decode` and `decode_step` compute the exact causal function, i.e. the official `forward` on the
whole sequence, whatever the length or the chunking of the calls.

Module and parameter names mirror the checkpoint ("decoder." + name), so every parameter loads from
the tensor of the same name; only the codebooks are transformed, into lookup tables, at load time.
Every module's forward takes `(x, state)`: `state` is None for a whole-sequence decode, else the
CodecState to read and update; stateless modules ignore it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from tts_cli.config_file import ConfigFields, read_json
from tts_cli.errors import CheckpointError, CodecRangeError
from tts_cli.model.transformer import RMSNorm, SwiGLU, apply_rope, merge_linears, rope_cos_sin

# Architecture constants of the official decoder (not in config.json).
PRE_CONV_KERNEL = 3
CONV_KERNEL = 7
RESIDUAL_DILATIONS = (1, 3, 9)
CONVNEXT_EXPANSION = 4
CONVNEXT_NORM_EPS = 1e-6
SNAKE_EPS = 1e-9
CLUSTER_USAGE_MIN = 1e-5


# ---------------------------------------------------------------------------------------------
# Config


@dataclass(frozen=True)
class CodecConfig:
    """Decoder hyper-parameters, read from speech_tokenizer/config.json."""

    num_quantizers: int
    codebook_size: int
    codebook_dim: int  # width of a frame's summed code vector; each codebook is half as wide
    latent_dim: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    sliding_window: int  # a query at frame t attends to frames t - sliding_window + 1 .. t
    rope_theta: float
    rms_norm_eps: float
    attention_bias: bool
    upsampling_ratios: tuple[int, ...]  # frame-rate upsampling (transposed conv + ConvNeXt)
    upsample_rates: tuple[int, ...]  # vocoder blocks; channels halve at each
    decoder_dim: int
    sample_rate: int

    @property
    def samples_per_frame(self) -> int:
        return math.prod(self.upsampling_ratios) * math.prod(self.upsample_rates)

    @classmethod
    def parse(cls, config: dict, path: Path) -> CodecConfig:
        """From the parsed speech_tokenizer/config.json; CheckpointError names a missing or bad field."""
        top = ConfigFields(config, str(path))
        decoder = top.sub("decoder_config")
        hidden_size = decoder.get("hidden_size", int, minimum=1)
        num_heads = decoder.get("num_attention_heads", int, minimum=1)
        num_kv_heads = decoder.get("num_key_value_heads", int, minimum=1)
        if num_heads % num_kv_heads:
            raise CheckpointError(f"{decoder.where}: num_attention_heads ({num_heads}) is not a multiple of "
                                  f"num_key_value_heads ({num_kv_heads})")
        if decoder.get("hidden_act", str, "silu") != "silu":
            raise CheckpointError(f"{decoder.where}: hidden_act is not supported (only 'silu')")
        codebook_dim = decoder.get("codebook_dim", int, minimum=2)
        if codebook_dim % 2:
            raise CheckpointError(f"{decoder.where}: codebook_dim must be even, got {codebook_dim}")
        parsed = cls(
            num_quantizers=decoder.get("num_quantizers", int, minimum=2),
            codebook_size=decoder.get("codebook_size", int, minimum=1),
            codebook_dim=codebook_dim,
            latent_dim=decoder.get("latent_dim", int, minimum=1),
            hidden_size=hidden_size,
            intermediate_size=decoder.get("intermediate_size", int, minimum=1),
            num_layers=decoder.get("num_hidden_layers", int, minimum=1),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            # The official attention falls back to hidden_size // heads when head_dim is absent.
            head_dim=decoder.get("head_dim", int, hidden_size // num_heads, minimum=1),
            sliding_window=decoder.get("sliding_window", int, minimum=1),
            rope_theta=decoder.get("rope_theta", float, minimum=0),
            rms_norm_eps=decoder.get("rms_norm_eps", float, minimum=0),
            attention_bias=decoder.get("attention_bias", bool, False),
            upsampling_ratios=decoder.int_list("upsampling_ratios"),
            upsample_rates=decoder.int_list("upsample_rates"),
            decoder_dim=decoder.get("decoder_dim", int, minimum=1),
            sample_rate=top.get("output_sample_rate", int, minimum=1),
        )
        declared = top.get("decode_upsample_rate", int, parsed.samples_per_frame)
        if declared != parsed.samples_per_frame:
            raise CheckpointError(f"{path}: decode_upsample_rate is {declared} but upsampling_ratios x "
                                  f"upsample_rates give {parsed.samples_per_frame} samples per frame")
        return parsed


# ---------------------------------------------------------------------------------------------
# Streaming state


@dataclass
class CodecState:
    """Per-row streaming state of a CodecDecoder; row b of every tensor belongs to batch slot b.

    position: [B] int64, frames decoded so far by each row (= the RoPE position of its next frame).
    history: one [B, ...] tensor per stateful module, keyed by the module's name:
      causal convs: their last (kernel - 1) * dilation inputs [B, (kernel - 1) * dilation, C_in];
      transposed convs with kernel 2 * stride: their last input frame [B, 1, C_in];
      (time-major, as the fused vocoder reads its inputs: tts_kernels.conv)
      attention layers: their last sliding_window - 1 rotated keys and values
      [B, 2, kv_heads, sliding_window - 1, head_dim] (a row holds real ones only in its last
      min(position, sliding_window - 1) slots).
    The tensors are updated in place, so their storage stays fixed across calls.
    """

    position: torch.Tensor
    history: dict[str, torch.Tensor]

    @property
    def batch_size(self) -> int:
        return self.position.shape[0]

    def reset(self, rows: torch.Tensor) -> None:
        """Restart rows [n] (int64 row indices: new requests take those slots).

        Zero history is exactly the zero left padding a fresh decode sees; the attention window
        needs no clearing (position 0 masks it out) but is zeroed too, for uniformity. Each buffer
        is cleared by index, touching only those rows (a bool mask over every row cost ~10 us per
        buffer at 64 rows, ~0.3 ms per admission on the H200: tools/step_profile.py)."""
        if rows.dtype != torch.int64 or rows.dim() != 1:
            raise ValueError(f"reset takes a 1-D int64 tensor of row indices, got {rows.dtype} {list(rows.shape)}")
        rows = rows.to(self.position.device)
        for buffer in self.history.values():
            buffer.index_fill_(0, rows, 0)
        self.position.index_fill_(0, rows, 0)


class StatefulModule(nn.Module):
    """A module that, when streaming, needs inputs from previous calls. `state_key` (its module name,
    set by CodecDecoder) is where its tensor lives in CodecState.history."""

    state_key: str = ""
    context: int = 0   # for convolutions: how many earlier input frames an output frame reads

    def init_state(self, batch_size: int, device: torch.device, dtype: torch.dtype) -> Optional[torch.Tensor]:
        """The all-zero history of `batch_size` fresh rows, or None if the module needs none."""
        raise NotImplementedError

    def prepend_history(self, x: torch.Tensor, state: Optional[CodecState]) -> torch.Tensor:
        """x [B, C, T] preceded by its `context` previous inputs: zeros for a whole sequence, the
        stored ones when streaming (which then become the last `context` inputs seen)."""
        if self.context == 0:
            return x
        batch, channels, frames = x.shape
        joined = self.input_buffer(batch, channels, frames, state, x)
        joined[:, self.context:] = x.transpose(1, 2)
        self.keep_history(joined, state)
        return joined.transpose(1, 2)

    def input_buffer(self, batch: int, channels: int, frames: int, state: Optional[CodecState],
                     like: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """A time-major buffer [B, context + frames, C] (of like's dtype, or `dtype`) for the inputs of
        a call, its first `context` frames holding the previous inputs (zeros for a whole sequence);
        the rest is for the caller to write."""
        joined = like.new_empty(batch, self.context + frames, channels, dtype=dtype)
        if self.context:
            joined[:, :self.context] = 0 if state is None else state.history[self.state_key]
        return joined

    def keep_history(self, joined: torch.Tensor, state: Optional[CodecState]) -> None:
        """When streaming, the last `context` inputs of a filled input buffer become the history."""
        if state is not None and self.context:
            state.history[self.state_key].copy_(joined[:, joined.shape[1] - self.context:])


# ---------------------------------------------------------------------------------------------
# Convolutional parts (activations [B, C, T])


def _zero_inputs(conv: nn.Module, context: int, batch_size: int, device, dtype) -> Optional[torch.Tensor]:
    """`context` zero input frames of `conv` per row (time-major), or None when it needs no history."""
    if context == 0:
        return None
    return torch.zeros(batch_size, context, conv.in_channels, device=device, dtype=dtype)


class CausalConv1d(StatefulModule):
    """Conv1d padded on the left only: output t sees inputs t - (kernel - 1) * dilation .. t.

    Fused (the engine, use_kernels; the vocoder's convolutions run inside the vocoder's own fused
    path instead): time-major, as tts_kernels.conv's GEMM, or for a depthwise convolution one
    product per tap added in tap order. Either way a row's output does not depend on the other
    rows of the batch. cuDNN's does not promise that: on the H200 at 256 rows (not at 64 or 512)
    the algorithm it chose for the pre-convolution gave the same codes a different output in
    another slot (2026-12-03, tests/test_gpu.py). Nor is cuDNN 9.19 always right: its fp32
    pre-convolution over 100 frames at 48, 64 and 128 rows is off by 15 dB, so the GPU tests'
    exact references run without cuDNN (docs/numerics.md)."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, dilation: int = 1,
                 groups: int = 1):
        super().__init__()
        self.conv = nn.Conv1d(in_channels, out_channels, kernel_size, dilation=dilation, groups=groups)
        if groups not in (1, in_channels):
            raise ValueError(f"groups must be 1 or the input channels ({in_channels}), got {groups}")
        self.fused = False
        self.context = (kernel_size - 1) * dilation

    def init_state(self, batch_size, device, dtype):
        return _zero_inputs(self.conv, self.context, batch_size, device, dtype)

    def forward(self, x: torch.Tensor, state: Optional[CodecState]) -> torch.Tensor:
        if self.fused:
            return self._forward_time_major(x, state)
        return self.conv(self.prepend_history(x, state))

    def _forward_time_major(self, x: torch.Tensor, state: Optional[CodecState]) -> torch.Tensor:
        batch, channels, frames = x.shape
        joined = self.input_buffer(batch, channels, frames, state, x)
        joined[:, self.context:] = x.transpose(1, 2)
        self.keep_history(joined, state)
        dilation = self.conv.dilation[0]
        if self.conv.groups == 1:
            from tts_kernels.conv import causal_conv
            out = x.new_empty(batch, frames, self.conv.out_channels)
            causal_conv(joined, self.tap_matrix(), self.conv.bias, frames, dilation, out=out)
        else:
            weight = self.conv.weight[:, 0]   # [C, kernel]
            out = self.conv.bias + joined[:, :frames] * weight[:, 0]
            for k in range(1, weight.shape[1]):
                out += joined[:, k * dilation:k * dilation + frames] * weight[:, k]
        return out.transpose(1, 2)

    def tap_matrix(self) -> torch.Tensor:
        """The weight as [kernel * C_in, C_out], row k * C_in + c for tap k, input channel c: the
        time-major GEMM of tts_kernels.conv."""
        assert self.conv.groups == 1, "grouped convolutions have no single tap matrix"
        return self.conv.weight.permute(2, 1, 0).flatten(0, 1).contiguous()


class CausalConvTranspose1d(StatefulModule):
    """ConvTranspose1d (kernel k, stride s) emitting exactly s samples per input frame.

    Output block j (samples j*s .. j*s + s - 1) sums the contributions of input frames
    j - context .. j, context = ceil(k / s) - 1. The k - s overhang of the last frame, which later
    frames would complete, is dropped (the official right trim), so nothing waits for the future."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int):
        super().__init__()
        self.conv = nn.ConvTranspose1d(in_channels, out_channels, kernel_size, stride=stride)
        self.stride = stride
        self.context = -(-kernel_size // stride) - 1
        # The engine switches this on: one GEMM instead of cuDNN's transposed convolution, which
        # took 2.2 ms of the H200's 19 ms codec call at 64 rows x 4 frames (tools/codec_bench.py).
        self.fused = False

    def init_state(self, batch_size, device, dtype):
        return _zero_inputs(self.conv, self.context, batch_size, device, dtype)

    def prepare_fused(self) -> None:
        self.block_weight, self.block_bias = self.block_matrix()

    def block_matrix(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The weight as one matrix [taps * C_in, stride * C_out] and the bias for its columns:
        output block j is the input frames j - context .. j (the taps) side by side, times this
        matrix; tap i reaches sample p of the block through kernel position (context - i) * stride + p.
        Column p * C_out + c is sample p in channel c."""
        weight = self.conv.weight                                  # [C_in, C_out, kernel]
        taps = self.context + 1
        weight = F.pad(weight, (0, taps * self.stride - weight.shape[-1]))
        per_tap = [weight[..., (self.context - i) * self.stride:(self.context - i + 1) * self.stride]
                   for i in range(taps)]                           # each [C_in, C_out, stride]
        return (torch.stack(per_tap).transpose(2, 3).flatten(2).flatten(0, 1).contiguous(),
                self.conv.bias.repeat(self.stride))

    def forward(self, x: torch.Tensor, state: Optional[CodecState]) -> torch.Tensor:
        batch, _, frames = x.shape
        x = self.prepend_history(x, state)
        if self.fused:
            time_major = x.transpose(1, 2)
            taps = torch.cat([time_major[:, i:i + frames] for i in range(self.context + 1)], dim=2)
            blocks = torch.addmm(self.block_bias, taps.view(batch * frames, -1), self.block_weight)
            return blocks.view(batch, frames * self.stride, -1).transpose(1, 2).contiguous()
        y = self.conv(x)
        # The blocks of the history frames were emitted by the previous call.
        return y[..., self.context * self.stride:(self.context + frames) * self.stride]


class SnakeBeta(nn.Module):
    """x + sin^2(x * e^alpha) / (e^beta + eps), per channel (alpha, beta are stored as logs)."""

    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(channels))
        self.beta = nn.Parameter(torch.zeros(channels))

    def forward(self, x: torch.Tensor, state: Optional[CodecState] = None) -> torch.Tensor:
        alpha = self.alpha.exp()[:, None]
        beta = self.beta.exp()[:, None]
        return x + (1.0 / (beta + SNAKE_EPS)) * torch.sin(x * alpha).pow(2)

    def kernel_factors(self, n_out: int) -> torch.Tensor:
        """What tts_kernels.conv.causal_conv takes as `snake` for an output of n_out columns."""
        from tts_kernels.conv import snake_factors
        return snake_factors(self.alpha.detach(), self.beta.detach(), SNAKE_EPS, n_out)


class Chain(nn.ModuleList):
    """Runs its modules in order, handing each the streaming state."""

    def forward(self, x: torch.Tensor, state: Optional[CodecState]) -> torch.Tensor:
        for module in self:
            x = module(x, state)
        return x


class ConvNeXtBlock(nn.Module):
    """x + gamma * pwconv2(gelu(pwconv1(LayerNorm(causal depthwise conv(x)))))."""

    def __init__(self, channels: int):
        super().__init__()
        self.dwconv = CausalConv1d(channels, channels, CONV_KERNEL, groups=channels)
        self.norm = nn.LayerNorm(channels, eps=CONVNEXT_NORM_EPS)
        self.pwconv1 = nn.Linear(channels, CONVNEXT_EXPANSION * channels)
        self.pwconv2 = nn.Linear(CONVNEXT_EXPANSION * channels, channels)
        self.gamma = nn.Parameter(torch.ones(channels))

    def forward(self, x: torch.Tensor, state: Optional[CodecState]) -> torch.Tensor:
        h = self.dwconv(x, state).transpose(1, 2)  # LayerNorm and Linear act on the channel axis
        h = self.pwconv2(F.gelu(self.pwconv1(self.norm(h))))
        return x + (self.gamma * h).transpose(1, 2)


class ResidualUnit(nn.Module):
    """x + conv_1x1(snake(dilated causal conv(snake(x))))."""

    def __init__(self, channels: int, dilation: int):
        super().__init__()
        self.act1 = SnakeBeta(channels)
        self.conv1 = CausalConv1d(channels, channels, CONV_KERNEL, dilation=dilation)
        self.act2 = SnakeBeta(channels)
        self.conv2 = CausalConv1d(channels, channels, 1)

    def forward(self, x: torch.Tensor, state: Optional[CodecState]) -> torch.Tensor:
        h = self.conv1(self.act1(x), state)
        return x + self.conv2(self.act2(h), state)


class DecoderBlock(nn.Module):
    """SnakeBeta, causal transposed conv (time x rate, channels in -> out), dilated residual units."""

    def __init__(self, in_channels: int, out_channels: int, rate: int):
        super().__init__()
        # One Chain under `.block` so that parameter names match the checkpoint's.
        self.block = Chain([
            SnakeBeta(in_channels),
            CausalConvTranspose1d(in_channels, out_channels, 2 * rate, rate),
            *(ResidualUnit(out_channels, dilation) for dilation in RESIDUAL_DILATIONS),
        ])

    def forward(self, x: torch.Tensor, state: Optional[CodecState]) -> torch.Tensor:
        return self.block(x, state)


@dataclass
class TimeMajorConv:
    """One convolution of the fused vocoder: the GEMM of tts_kernels.conv and what its epilogue does."""

    module: StatefulModule           # whose history heads the input buffer
    weight: torch.Tensor             # [taps * C_in, N]
    bias: torch.Tensor               # [N]
    dilation: int
    stride: int                      # output frames per input frame
    out_channels: int
    adds_residual: bool              # a residual unit's output: + the unit's input
    keeps_output: bool               # the output is read again (the next units' residual, the waveform)
    snake: Optional[torch.Tensor]    # the factors of the output's SnakeBeta (written as the next input)


class Vocoder(Chain):
    """Latent frames [B, latent, T] -> waveform [B, 1, T * prod(upsample_rates)]: causal conv (k=7),
    the DecoderBlocks, SnakeBeta, causal conv to one channel.

    Fused (the engine, use_kernels): the same function time-major, one kernel per convolution
    (tts_kernels.conv), each SnakeBeta in the epilogue of the convolution before it and written
    straight after the next convolution's history; no layout changes, no joining copies. With
    `half` (the default) the convolutions' inputs and weights are fp16 and so is the residual stream
    they read and write (fp32 accumulation and epilogue; biases and the waveform fp32). A value
    beyond fp16's range becomes an infinity and, through the later convolutions, infinities or NaN
    in the waveform (tts_kernels.conv), so
    `overflow` (int32 [1]) counts the waveform's non-finite samples, once per call: a whole decode
    then raises CodecRangeError, a streamed one leaves the check to its caller (the engine zeroes
    the count per run and reads it with each window's PCM)."""

    def __init__(self, modules):
        super().__init__(modules)
        self.fused = False
        self.half = True
        self.convs: list[TimeMajorConv] = []
        self.overflow: Optional[torch.Tensor] = None

    def prepare_fused(self) -> None:
        first, *blocks, final_act, last = self
        if first.conv.weight.dtype != torch.float32:
            raise ValueError(f"the fused vocoder runs from float32 weights, not {first.conv.weight.dtype}")
        dtype = torch.float16 if self.half else torch.float32
        self.overflow = torch.zeros(1, dtype=torch.int32, device=first.conv.weight.device)

        def conv(module: CausalConv1d, snake: Optional[SnakeBeta], **kind) -> TimeMajorConv:
            n_out = module.conv.out_channels
            return TimeMajorConv(module, module.tap_matrix().to(dtype), module.conv.bias, module.conv.dilation[0],
                                 1, n_out, snake=snake.kernel_factors(n_out) if snake is not None else None, **kind)

        convs = []
        acts = [block.block[0] for block in blocks] + [final_act]   # the SnakeBeta before each block's input
        convs.append(conv(first, adds_residual=False, keeps_output=False, snake=acts[0]))
        for block, next_act in zip(blocks, acts[1:]):
            _, upsample, *units = block.block
            weight, bias = upsample.block_matrix()
            convs.append(TimeMajorConv(upsample, weight.to(dtype), bias, 1, upsample.stride,
                                       upsample.conv.out_channels, adds_residual=False, keeps_output=True,
                                       snake=units[0].act1.kernel_factors(weight.shape[1])))
            for i, unit in enumerate(units):
                last_unit = i + 1 == len(units)
                convs.append(conv(unit.conv1, adds_residual=False, keeps_output=False, snake=unit.act2))
                # the last unit's output is only read through its SnakeBeta (the next block's input)
                convs.append(conv(unit.conv2, adds_residual=True, keeps_output=not last_unit,
                                  snake=next_act if last_unit else units[i + 1].act1))
        convs.append(conv(last, adds_residual=False, keeps_output=True, snake=None))
        self.convs = convs

    def forward(self, x: torch.Tensor, state: Optional[CodecState]) -> torch.Tensor:
        if self.fused:
            return self._forward_fused(x, state)
        return super().forward(x, state)

    def _forward_fused(self, x: torch.Tensor, state: Optional[CodecState]) -> torch.Tensor:
        from tts_kernels.conv import causal_conv
        batch, channels, frames = x.shape
        dtype = self.convs[0].weight.dtype
        if state is None:   # a whole decode checks its own values (a stream's caller counts per run)
            self.overflow.zero_()
        first = self.convs[0].module
        inputs = first.input_buffer(batch, channels, frames, state, x, dtype)
        inputs[:, first.context:] = x.transpose(1, 2)
        first.keep_history(inputs, state)
        residual = out = None
        for conv, following in zip(self.convs, self.convs[1:] + [None]):
            out_frames = frames * conv.stride
            # the residual stream in the convolutions' dtype (half the bytes the 1x1 convolutions
            # move, their bound), the waveform in fp32
            out_dtype = dtype if following is not None else x.dtype
            out = x.new_empty(batch, out_frames, conv.out_channels, dtype=out_dtype) if conv.keeps_output else None
            next_inputs = None
            if following is not None:
                next_inputs = following.module.input_buffer(batch, conv.out_channels, out_frames, state, x, dtype)
            causal_conv(inputs, conv.weight, conv.bias, frames, conv.dilation,
                        residual=residual if conv.adds_residual else None, out=out,
                        snake=conv.snake,
                        snake_out=next_inputs[:, following.module.context:] if following is not None else None)
            if following is not None:
                following.module.keep_history(next_inputs, state)
            if conv.keeps_output:
                residual = out
            inputs, frames = next_inputs, out_frames
        if dtype == torch.float16:
            self.overflow.add_(torch.isfinite(out).logical_not().sum(dtype=torch.int32))
        if state is None:
            self.check_range()
        return out.transpose(1, 2)

    def check_range(self, overflow: Optional[int] = None) -> None:
        """Raises CodecRangeError if the fp16 vocoder has met values beyond fp16's range (`overflow`:
        the count of non-finite waveform samples as read by the caller; default: read now, which
        waits for the GPU)."""
        count = int(self.overflow.item()) if overflow is None else overflow
        if count:
            raise CodecRangeError(
                f"the codec's fp16 vocoder met values beyond fp16's range (65504), which left {count} "
                f"non-finite waveform samples: this audio would be wrong, so it is refused; "
                f"--codec-precision fp32 runs the vocoder in fp32")


# ---------------------------------------------------------------------------------------------
# Transformer (activations [B, T, C])


class LayerScale(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * x


def sliding_window_mask(positions: torch.Tensor, cached: int, window: int) -> torch.Tensor:
    """Bool [B, 1, T, cached + T]: which keys each query attends to.

    positions [B, T] are the queries' frame positions; the keys are `cached` frames from the
    state followed by the T new ones. A query at p sees keys at p - window + 1 .. p that exist:
    keys at negative positions are the empty cache slots of rows that started recently."""
    frames = positions.shape[1]
    key_positions = positions[:, :1] - cached + torch.arange(cached + frames, device=positions.device)
    key_positions = key_positions[:, None, :]
    distance = positions[:, :, None] - key_positions
    visible = (distance >= 0) & (distance < window) & (key_positions >= 0)
    return visible[:, None]


class SlidingWindowAttention(StatefulModule):
    def __init__(self, config: CodecConfig):
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.window = config.sliding_window
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, config.num_heads * config.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, config.num_kv_heads * config.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, config.num_kv_heads * config.head_dim, bias=bias)
        self.o_proj = nn.Linear(config.num_heads * config.head_dim, config.hidden_size, bias=bias)
        self.fused = False   # the engine switches this on: tts_kernels.window_attention when streaming
        self.qkv = None      # (weight, bias) of q, k, v as one projection, once merged (prepare_fused)

    def prepare_fused(self) -> None:
        self.qkv = merge_linears([self.q_proj, self.k_proj, self.v_proj], self.qkv)

    def init_state(self, batch_size, device, dtype):
        # The newest frame is always part of the call, so window - 1 older ones suffice. They form a
        # ring: the key and value at position p sit in slot p % (window - 1), so that a call writes
        # only its new frames.
        return torch.zeros(batch_size, 2, self.num_kv_heads, self.window - 1, self.head_dim,
                           device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor,
                state: Optional[CodecState]) -> torch.Tensor:
        batch, frames, _ = x.shape
        if self.fused and state is not None and frames < self.window and self.num_kv_heads == self.num_heads:
            from tts_kernels.window_attention import window_attention
            # the rows' positions: the state's (it advances after the whole call)
            q, k, v = F.linear(x, *self.qkv).split(self.num_heads * self.head_dim, dim=-1)
            out = window_attention(q, k, v, rope[0][:, 0], rope[1][:, 0], state.history[self.state_key],
                                   state.position, self.window)
            return self.o_proj(out)
        q = self.q_proj(x).view(batch, frames, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, frames, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, frames, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if state is not None:
            cache, kept = state.history[self.state_key], self.window - 1
            # the ring's keys and values oldest first: positions start - kept .. start - 1
            older = (state.position[:, None] + torch.arange(-kept, 0, device=x.device)) % kept
            cached = cache.gather(3, older[:, None, None, :, None].expand(-1, 2, cache.shape[2], -1, cache.shape[4]))
            k = torch.cat([cached[:, 0], k], dim=2)
            v = torch.cat([cached[:, 1], v], dim=2)
            stay = min(frames, kept)   # the new frames still in the window after this call
            arriving = (state.position[:, None] + torch.arange(frames - stay, frames, device=x.device)) % kept
            arriving = arriving[:, None, :, None].expand(-1, cache.shape[2], -1, cache.shape[4])
            cache[:, 0].scatter_(2, arriving, k[:, :, k.shape[2] - stay:])
            cache[:, 1].scatter_(2, arriving, v[:, :, v.shape[2] - stay:])
        # Written out rather than scaled_dot_product_attention: with a mask and fp32, SDPA's CUDA
        # kernel took 80.6 us per layer for 64 rows x 4 frames on the H200, these two matmuls
        # 36.5 + 20.7 us (tools/step_profile.py; docs/bench.md at 0bca9b7, 2026-11-30).
        if self.num_kv_heads != self.num_heads:   # grouped-query: each kv head serves consecutive query heads
            groups = self.num_heads // self.num_kv_heads
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        scores = (q @ k.transpose(2, 3)) * self.head_dim ** -0.5
        probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
        return self.o_proj((probs @ v).transpose(1, 2).reshape(batch, frames, -1))


class TransformerLayer(nn.Module):
    """Pre-norm block with LayerScale on both residual branches."""

    def __init__(self, config: CodecConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = SlidingWindowAttention(config)
        self.self_attn_layer_scale = LayerScale(config.hidden_size)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size)
        self.mlp_layer_scale = LayerScale(config.hidden_size)

    def forward(self, x, rope, mask, state: Optional[CodecState]) -> torch.Tensor:
        x = x + self.self_attn_layer_scale(self.self_attn(self.input_layernorm(x), rope, mask, state))
        return x + self.mlp_layer_scale(self.mlp(self.post_attention_layernorm(x)))


class Transformer(nn.Module):
    def __init__(self, config: CodecConfig):
        super().__init__()
        self.config = config
        self.input_proj = nn.Linear(config.latent_dim, config.hidden_size)
        self.layers = nn.ModuleList(TransformerLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.output_proj = nn.Linear(config.hidden_size, config.latent_dim)

    def forward(self, x: torch.Tensor, start: torch.Tensor, state: Optional[CodecState]) -> torch.Tensor:
        """x [B, T, latent_dim]; start [B]: position of each row's first frame in x."""
        positions = start[:, None] + torch.arange(x.shape[1], device=x.device)
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, x.dtype)
        rope = cos[:, None], sin[:, None]  # broadcast over heads
        cached = 0 if state is None else self.config.sliding_window - 1
        mask = sliding_window_mask(positions, cached, self.config.sliding_window)
        h = self.input_proj(x)
        for layer in self.layers:
            h = layer(h, rope, mask, state)
        return self.output_proj(self.norm(h))


# ---------------------------------------------------------------------------------------------
# Codebooks


class CodebookSum(nn.Module):
    """A frame's code vector: sum over quantizers q of tables[q, code_q].

    tables[q] is codebook q already passed through its 1x1 output projection (the official
    projects the sum of codebook vectors; projecting each first is the same linear map)."""

    def __init__(self, num_quantizers: int, codebook_size: int, dim: int):
        super().__init__()
        self.register_buffer("tables", torch.zeros(num_quantizers, codebook_size, dim), persistent=False)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [B, T, Q] -> [B, T, dim]: one bag of Q rows of the joined tables per frame, summed
        in quantizer order (two kernels on the GPU, where a lookup and an add per quantizer were 31)."""
        quantizers, size, dim = self.tables.shape
        rows = codes + torch.arange(0, quantizers * size, size, device=codes.device)
        return F.embedding_bag(rows.reshape(-1, quantizers), self.tables.view(quantizers * size, dim),
                               mode="sum").view(*codes.shape[:-1], dim)


def fold_codebook(embedding_sum: torch.Tensor, cluster_usage: torch.Tensor,
                  output_proj: torch.Tensor) -> torch.Tensor:
    """One quantizer's lookup table [codebook_size, out_dim] from its checkpoint tensors
    (embedding_sum [N, d], cluster_usage [N], output_proj weight [out_dim, d, 1])."""
    codebook = embedding_sum / cluster_usage.clamp(min=CLUSTER_USAGE_MIN)[:, None]
    return codebook @ output_proj[:, :, 0].T


# ---------------------------------------------------------------------------------------------
# Decoder


class CodecDecoder(nn.Module):
    def __init__(self, config: CodecConfig):
        super().__init__()
        self.config = config
        self.samples_per_frame = config.samples_per_frame
        self.sample_rate = config.sample_rate
        latent = config.latent_dim
        self.quantizer = CodebookSum(config.num_quantizers, config.codebook_size, config.codebook_dim)
        self.pre_conv = CausalConv1d(config.codebook_dim, latent, PRE_CONV_KERNEL)
        self.pre_transformer = Transformer(config)
        self.upsample = Chain(
            Chain([CausalConvTranspose1d(latent, latent, ratio, ratio), ConvNeXtBlock(latent)])
            for ratio in config.upsampling_ratios
        )
        channels = [config.decoder_dim // 2 ** i for i in range(len(config.upsample_rates) + 1)]
        self.decoder = Vocoder([
            CausalConv1d(latent, channels[0], CONV_KERNEL),
            *(DecoderBlock(channels[i], channels[i + 1], rate) for i, rate in enumerate(config.upsample_rates)),
            SnakeBeta(channels[-1]),
            CausalConv1d(channels[-1], 1, CONV_KERNEL),
        ])
        for name, module in self.named_modules():
            if isinstance(module, StatefulModule):
                module.state_key = name

    def new_state(self, batch_size: int) -> CodecState:
        """Streaming state for `batch_size` rows, each at the start of an utterance."""
        weight = self.pre_conv.conv.weight
        history = {}
        for module in self.modules():
            if isinstance(module, StatefulModule):
                buffer = module.init_state(batch_size, weight.device, weight.dtype)
                if buffer is not None:
                    history[module.state_key] = buffer
        position = torch.zeros(batch_size, dtype=torch.long, device=weight.device)
        return CodecState(position=position, history=history)

    def forward(self, codes: torch.Tensor, state: Optional[CodecState] = None) -> torch.Tensor:
        """codes [B, T, num_quantizers] -> waveform [B, T * samples_per_frame] in [-1, 1].

        With `state`, the frames continue each row's stream (and the state advances); without,
        they are whole utterances."""
        if codes.dim() != 3 or codes.shape[2] != self.config.num_quantizers or codes.shape[1] == 0:
            raise ValueError(f"codes must be [batch, frames >= 1, {self.config.num_quantizers}], "
                             f"got {list(codes.shape)}")
        batch, frames, _ = codes.shape
        if state is not None and state.batch_size != batch:
            raise ValueError(f"codes have {batch} rows but the state has {state.batch_size}")
        x = self.quantizer(codes).transpose(1, 2)
        x = self.pre_conv(x, state).transpose(1, 2)
        start = state.position if state is not None else torch.zeros(batch, dtype=torch.long, device=codes.device)
        x = self.pre_transformer(x, start, state).transpose(1, 2)
        x = self.upsample(x, state)
        wav = self.decoder(x, state)
        if state is not None:
            state.position += frames
        return wav.squeeze(1).clamp(-1, 1)

    @torch.no_grad()
    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """Whole utterances: codes [B, T, 16] -> [B, T * 1920], one causal pass (no chunking).

        Codes must lie in [0, codebook_size). For rows of different lengths, pad with any valid
        code and cut each row to its own frames * 1920 samples: causality keeps padding from
        affecting earlier samples (the official decode pads with -1, clamped to 0, and cuts too)."""
        return self(codes)

    @torch.no_grad()
    def decode_step(self, codes: torch.Tensor, state: CodecState) -> torch.Tensor:
        """The next K >= 1 frames of every row: codes [B, K, 16] -> [B, K * 1920]; advances `state`."""
        return self(codes, state)


# ---------------------------------------------------------------------------------------------
# Loading


def load_codec(speech_tokenizer_dir: Path, device="cpu", dtype: torch.dtype = torch.float32) -> CodecDecoder:
    """The decoder of a checkpoint's speech_tokenizer/ (config.json + the decoder.* tensors of
    model.safetensors), in eval mode on `device` in `dtype`. CheckpointError names the file at fault."""
    directory = Path(speech_tokenizer_dir)
    config_path = directory / "config.json"
    config = CodecConfig.parse(read_json(config_path), config_path)
    device = torch.device(device)
    with torch.device("meta"):  # allocation only; every value comes from the checkpoint
        model = CodecDecoder(config)
    weights, tables = _read_decoder_tensors(directory / "model.safetensors", model, device)
    model.load_state_dict({name: t.to(dtype) for name, t in weights.items()}, assign=True)
    model.quantizer.tables = tables.to(dtype)
    return model.eval().requires_grad_(False)


def _read_decoder_tensors(path: Path, model: CodecDecoder, device: torch.device):
    """Every parameter of `model` from the tensor "decoder." + its name, and the folded codebook
    tables [Q, codebook_size, codebook_dim] (computed in fp32)."""
    if not path.is_file():
        raise CheckpointError(f"missing file: {path}")
    try:
        handle = safe_open(str(path), framework="pt", device=str(device))
    except Exception as e:  # safetensors raises its own error types for a corrupt header
        raise CheckpointError(f"{path}: not a valid safetensors file ({e})") from e
    with handle as file:
        names = set(file.keys())

        def tensor(name: str, shape: tuple[int, ...]) -> torch.Tensor:
            key = "decoder." + name
            if key not in names:
                raise CheckpointError(f"{path}: tensor {key} is missing")
            try:
                value = file.get_tensor(key)
            except Exception as e:
                raise CheckpointError(f"{path}: tensor {key} cannot be read ({e})") from e
            if tuple(value.shape) != tuple(shape):
                raise CheckpointError(f"{path}: tensor {key} has shape {list(value.shape)}, "
                                      f"expected {list(shape)}")
            return value

        weights = {name: tensor(name, p.shape) for name, p in model.state_dict().items()}
        config = model.config
        n, d, out = config.codebook_size, config.codebook_dim // 2, config.codebook_dim
        tables = []
        # The official decoder splits the quantizers into one "first" (semantic) and the rest,
        # each group with its own output projection.
        for q in range(config.num_quantizers):
            group, index = ("rvq_first", 0) if q == 0 else ("rvq_rest", q - 1)
            codebook = f"quantizer.{group}.vq.layers.{index}._codebook."
            tables.append(fold_codebook(
                tensor(codebook + "embedding_sum", (n, d)).float(),
                tensor(codebook + "cluster_usage", (n,)).float(),
                tensor(f"quantizer.{group}.output_proj.weight", (out, d, 1)).float(),
            ))
    return weights, torch.stack(tables)
