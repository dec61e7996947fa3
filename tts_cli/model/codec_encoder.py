"""The Qwen3-TTS 12 Hz codec encoder: 24 kHz mono waveform -> codes [frames, 16] (reference audio
for voice cloning in ICL mode).

Same function as the official `Qwen3TTSTokenizer.encode` (qwen-tts-hf 0.1.1.post1) for one clip:

- Input: float32 mono at 24 kHz. The official wrapper downmixes by averaging the channels and
  resamples other rates with librosa.resample (soxr "soxr_hq"); the feature extractor
  (EncodecFeatureExtractor) neither normalises nor pads a single clip. The model runs in the
  speech tokenizer's dtype (the one the main model was loaded in); `encode` uses this module's.
- Its encoder is transformers' `MimiModel` (`Qwen3TTSTokenizerV2Encoder`), of which the official
  uses the encoding half: a SEANet conv stack (causal convs: left padding kernel - stride, zeros;
  right padding up to a multiple of the stride; ELU; strided downsampling by the reversed
  upsampling_ratios, 960x in all) -> a causal transformer at 25 Hz (LayerNorm, RoPE, GELU MLP,
  layer scales) -> a causal strided conv to 12.5 Hz (replicate padding) -> a split residual VQ:
  codebook 0 from the semantic quantizer, codebooks 1.. from the acoustic one, each projecting
  the same embedding with its own 1x1 input projection, then nearest codebook vector by Euclidean
  distance (torch.cdist) and subtraction, codebook by codebook.
- Attention: the official loader (`restore_mimi_full_attention`) replaces the config's
  sliding_window (250) by max_position_embeddings (8000 frames = 320 s), as transformers 4.57.3
  behaved; this module does the same.
- Output: the first encoder_valid_num_quantizers (16) of the num_quantizers (32) codebooks (the
  residual chain makes them independent of the rest, which are not computed), and the first
  ceil(samples / encode_downsample_rate) frames (1920 samples per frame).

Batches: the official encodes a list of clips right-padded with zeros to the longest. Causality
keeps the shorter clips' codes the same as alone except possibly the last frame (the downsampling
conv sees the padding's encoding instead of its replicate padding). `encode` takes one clip.

Module and parameter names are the official ones under "encoder." in speech_tokenizer/
model.safetensors, so every tensor loads by name (the decoding half's quantizer output projections,
the codebooks past the 16th and the `initialized` flags are not used).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from tts_cli.config_file import ConfigFields, read_json
from tts_cli.checkpoint import check_tensors
from tts_cli.errors import CheckpointError
from tts_cli.model.codec import LayerScale

CHECKPOINT_PREFIX = "encoder."
CLUSTER_USAGE_MIN = 1e-5  # the codebook vectors are embed_sum / max(cluster_usage, this)
DOWNSAMPLE_STRIDE = 2     # the official Mimi downsampling conv's stride (fixed there)


# ---------------------------------------------------------------------------------------------
# Config


@dataclass(frozen=True)
class CodecEncoderConfig:
    """Encoder hyper-parameters from speech_tokenizer/config.json: `encoder_config` (a MimiConfig:
    its defaults fill absent fields) and the top-level sample rate, samples per frame and count of
    codebooks kept."""

    sample_rate: int = 24000
    samples_per_frame: int = 1920          # top-level encode_downsample_rate
    valid_quantizers: int = 16             # top-level encoder_valid_num_quantizers
    num_quantizers: int = 32
    num_semantic_quantizers: int = 1
    codebook_size: int = 2048
    codebook_dim: int = 256
    vq_hidden_size: int = 256              # vector_quantization_hidden_dimension
    hidden_size: int = 512
    num_filters: int = 64
    num_residual_layers: int = 1
    upsampling_ratios: tuple[int, ...] = (8, 6, 5, 4)
    kernel_size: int = 7
    last_kernel_size: int = 3
    residual_kernel_size: int = 3
    dilation_growth_rate: int = 2
    compress: int = 2
    pad_mode: str = "constant"
    num_layers: int = 8
    num_heads: int = 8
    num_kv_heads: int = 8
    head_dim: int = 64
    intermediate_size: int = 2048
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    attention_window: int = 8000           # max_position_embeddings (see the module docstring)
    attention_bias: bool = False
    frame_rate: float = 12.5

    @property
    def conv_hop(self) -> int:
        """Samples per frame of the SEANet stack (960: 25 Hz)."""
        return math.prod(self.upsampling_ratios)

    @property
    def downsample_kernel(self) -> int:
        return 2 * int(math.ceil(self.sample_rate / self.conv_hop) / self.frame_rate)

    @classmethod
    def parse(cls, config: dict, path: Path | str) -> CodecEncoderConfig:
        """From the parsed speech_tokenizer/config.json; CheckpointError names a missing or bad field."""
        top = ConfigFields(config, str(path))
        enc = top.sub("encoder_config")
        d = cls()
        hidden_size = enc.get("hidden_size", int, d.hidden_size, minimum=1)
        num_heads = enc.get("num_attention_heads", int, d.num_heads, minimum=1)
        num_kv_heads = enc.get("num_key_value_heads", int, d.num_kv_heads, minimum=1)
        if num_heads % num_kv_heads:
            raise CheckpointError(f"{enc.where}: num_attention_heads ({num_heads}) is not a multiple of "
                                  f"num_key_value_heads ({num_kv_heads})")
        if enc.get("hidden_act", str, "gelu") != "gelu":
            raise CheckpointError(f"{enc.where}: hidden_act is not supported (only 'gelu')")
        if enc.get("use_causal_conv", bool, True) is not True:
            raise CheckpointError(f"{enc.where}: only causal convs (use_causal_conv true) are supported")
        if enc.get("use_conv_shortcut", bool, False) is not False:
            raise CheckpointError(f"{enc.where}: use_conv_shortcut is not supported")
        if enc.get("audio_channels", int, 1) != 1:
            raise CheckpointError(f"{enc.where}: only mono (audio_channels 1) is supported")
        pad_mode = enc.get("pad_mode", str, d.pad_mode)
        if pad_mode not in ("constant", "replicate"):
            raise CheckpointError(f"{enc.where}: pad_mode {pad_mode!r} is not supported")
        rope = enc.get("rope_parameters", dict, {})
        if rope.get("rope_type", "default") != "default":
            raise CheckpointError(f"{enc.where}: rope_type {rope.get('rope_type')!r} is not supported")
        rope_theta = enc.get("rope_theta", float, float(rope.get("rope_theta", d.rope_theta)), minimum=0)
        ratios = enc.int_list("upsampling_ratios") if "upsampling_ratios" in enc.data else d.upsampling_ratios
        sample_rate = enc.get("sampling_rate", int, d.sample_rate, minimum=1)
        hop = math.prod(ratios)
        # MimiConfig.frame_rate: the stored value ("_frame_rate", older files "frame_rate"), else
        # the sample rate over the whole stack's stride (SEANet x downsampling).
        computed_rate = sample_rate / (hop * DOWNSAMPLE_STRIDE)
        frame_rate = enc.get("_frame_rate", float, enc.get("frame_rate", float, computed_rate))
        parsed = cls(
            sample_rate=top.get("input_sample_rate", int, sample_rate, minimum=1),
            samples_per_frame=top.get("encode_downsample_rate", int, minimum=1),
            valid_quantizers=top.get("encoder_valid_num_quantizers", int, minimum=1),
            num_quantizers=enc.get("num_quantizers", int, d.num_quantizers, minimum=1),
            num_semantic_quantizers=enc.get("num_semantic_quantizers", int, d.num_semantic_quantizers, minimum=1),
            codebook_size=enc.get("codebook_size", int, d.codebook_size, minimum=1),
            codebook_dim=enc.get("codebook_dim", int, hidden_size, minimum=1),
            vq_hidden_size=enc.get("vector_quantization_hidden_dimension", int, d.vq_hidden_size, minimum=1),
            hidden_size=hidden_size,
            num_filters=enc.get("num_filters", int, d.num_filters, minimum=1),
            num_residual_layers=enc.get("num_residual_layers", int, d.num_residual_layers, minimum=0),
            upsampling_ratios=ratios,
            kernel_size=enc.get("kernel_size", int, d.kernel_size, minimum=1),
            last_kernel_size=enc.get("last_kernel_size", int, d.last_kernel_size, minimum=1),
            residual_kernel_size=enc.get("residual_kernel_size", int, d.residual_kernel_size, minimum=1),
            dilation_growth_rate=enc.get("dilation_growth_rate", int, d.dilation_growth_rate, minimum=1),
            compress=enc.get("compress", int, d.compress, minimum=1),
            pad_mode=pad_mode,
            num_layers=enc.get("num_hidden_layers", int, d.num_layers, minimum=0),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=enc.get("head_dim", int, hidden_size // num_heads, minimum=1),
            intermediate_size=enc.get("intermediate_size", int, d.intermediate_size, minimum=1),
            norm_eps=enc.get("norm_eps", float, d.norm_eps, minimum=0),
            rope_theta=rope_theta,
            attention_window=enc.get("max_position_embeddings", int, d.attention_window, minimum=1),
            attention_bias=enc.get("attention_bias", bool, d.attention_bias),
            frame_rate=frame_rate,
        )
        if not parsed.num_semantic_quantizers <= parsed.valid_quantizers <= parsed.num_quantizers:
            raise CheckpointError(f"{path}: encoder_valid_num_quantizers ({parsed.valid_quantizers}) must lie "
                                  f"between num_semantic_quantizers and num_quantizers of encoder_config")
        stride = hop * DOWNSAMPLE_STRIDE
        if parsed.samples_per_frame != stride:
            raise CheckpointError(f"{path}: encode_downsample_rate is {parsed.samples_per_frame} but the encoder's "
                                  f"strides give {stride} samples per frame")
        return parsed


# ---------------------------------------------------------------------------------------------
# SEANet conv stack


class CausalConv1d(nn.Module):
    """Conv1d padded on the left by (effective kernel - stride) samples and on the right up to a
    whole number of strides, so that output frame t depends on input samples < (t + 1) * stride."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int = 1, dilation: int = 1,
                 bias: bool = True, pad_mode: str = "constant"):
        super().__init__()
        self.conv = nn.Conv1d(in_channels, out_channels, kernel_size, stride, dilation=dilation, bias=bias)
        self.stride = stride
        self.left_padding = (kernel_size - 1) * dilation + 1 - stride
        self.pad_mode = pad_mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        length = x.shape[-1]
        right_padding = -length % self.stride
        return self.conv(F.pad(x, (self.left_padding, right_padding), mode=self.pad_mode))


class ResnetBlock(nn.Module):
    """x + conv_1x1(ELU(conv_k_dilated(ELU(x)))), the inner width dim // compress. The list
    positions mirror the official (ELU, conv, ELU, conv) so the convs are block.1 and block.3."""

    def __init__(self, config: CodecEncoderConfig, dim: int, dilation: int):
        super().__init__()
        hidden = dim // config.compress
        self.block = nn.ModuleList([
            nn.ELU(),
            CausalConv1d(dim, hidden, config.residual_kernel_size, dilation=dilation, pad_mode=config.pad_mode),
            nn.ELU(),
            CausalConv1d(hidden, dim, 1, pad_mode=config.pad_mode),
        ])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x
        for layer in self.block:
            y = layer(y)
        return x + y


class SEANetEncoder(nn.Module):
    """Waveform [B, 1, T] -> [B, hidden_size, ceil(T / 960)]: a conv, then per downsampling ratio
    (the reversed upsampling_ratios) residual blocks, ELU and a strided conv doubling the width,
    then ELU and a final conv. `layers` keeps the official list positions (ELUs included)."""

    def __init__(self, config: CodecEncoderConfig):
        super().__init__()
        mode = config.pad_mode
        width = config.num_filters
        layers: list[nn.Module] = [CausalConv1d(1, width, config.kernel_size, pad_mode=mode)]
        for ratio in reversed(config.upsampling_ratios):
            for j in range(config.num_residual_layers):
                layers.append(ResnetBlock(config, width, config.dilation_growth_rate ** j))
            layers += [nn.ELU(), CausalConv1d(width, width * 2, 2 * ratio, stride=ratio, pad_mode=mode)]
            width *= 2
        layers += [nn.ELU(), CausalConv1d(width, config.hidden_size, config.last_kernel_size, pad_mode=mode)]
        self.layers = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


# ---------------------------------------------------------------------------------------------
# Transformer (25 Hz)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


class Attention(nn.Module):
    def __init__(self, config: CodecEncoderConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.window = config.attention_window
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, frames, _ = x.shape

        def heads(proj: nn.Linear, count: int) -> torch.Tensor:
            return proj(x).view(batch, frames, count, self.head_dim).transpose(1, 2)

        q = heads(self.q_proj, self.num_heads)
        k, v = heads(self.k_proj, self.num_kv_heads), heads(self.v_proj, self.num_kv_heads)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        group = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        if frames <= self.window:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.head_dim ** -0.5)
        else:
            # A query at frame t sees frames t - window + 1 .. t.
            distance = torch.arange(frames, device=x.device)[:, None] - torch.arange(frames, device=x.device)
            visible = (distance >= 0) & (distance < self.window)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=self.head_dim ** -0.5)
        return self.o_proj(out.transpose(1, 2).reshape(batch, frames, -1))


class MLP(nn.Module):
    def __init__(self, config: CodecEncoderConfig):
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class TransformerLayer(nn.Module):
    """Pre-norm (LayerNorm) attention and MLP, each residual branch scaled per channel."""

    def __init__(self, config: CodecEncoderConfig):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=config.norm_eps)
        self.self_attn = Attention(config)
        self.self_attn_layer_scale = LayerScale(config.hidden_size)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size, eps=config.norm_eps)
        self.mlp = MLP(config)
        self.mlp_layer_scale = LayerScale(config.hidden_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn_layer_scale(self.self_attn(self.input_layernorm(x), cos, sin))
        return x + self.mlp_layer_scale(self.mlp(self.post_attention_layernorm(x)))


class Transformer(nn.Module):
    def __init__(self, config: CodecEncoderConfig):
        super().__init__()
        self.layers = nn.ModuleList(TransformerLayer(config) for _ in range(config.num_layers))
        self.head_dim, self.rope_theta = config.head_dim, config.rope_theta

    def rope(self, frames: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [frames, head_dim] at positions 0.., computed in fp32 (the rotated halves share
        one frequency each)."""
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=device) / self.head_dim
        inverse_frequency = 1.0 / (self.rope_theta ** exponents)
        angles = torch.arange(frames, dtype=torch.float32, device=device)[:, None] * inverse_frequency
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[B, frames, hidden] -> same shape."""
        cos, sin = self.rope(x.shape[1], x.device, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return x


# ---------------------------------------------------------------------------------------------
# Split residual vector quantizer


class Codebook(nn.Module):
    def __init__(self, config: CodecEncoderConfig):
        super().__init__()
        self.register_buffer("embed_sum", torch.zeros(config.codebook_size, config.codebook_dim))
        self.register_buffer("cluster_usage", torch.ones(config.codebook_size))

    def vectors(self) -> torch.Tensor:
        return self.embed_sum / self.cluster_usage.clamp(min=CLUSTER_USAGE_MIN)[:, None]


class VectorQuantizer(nn.Module):
    def __init__(self, config: CodecEncoderConfig):
        super().__init__()
        self.codebook = Codebook(config)


class ResidualVectorQuantizer(nn.Module):
    """A 1x1 input projection (when the VQ width differs from the encoder's), then `count`
    codebooks in turn, each quantizing what the previous ones left."""

    def __init__(self, config: CodecEncoderConfig, count: int):
        super().__init__()
        self.input_proj = None
        if config.vq_hidden_size != config.hidden_size:
            self.input_proj = nn.Conv1d(config.hidden_size, config.vq_hidden_size, 1, bias=False)
        self.layers = nn.ModuleList(VectorQuantizer(config) for _ in range(count))

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """[B, hidden, frames] -> codes [B, count, frames]."""
        residual = x if self.input_proj is None else self.input_proj(x)
        codes = []
        for layer in self.layers:
            vectors = layer.codebook.vectors()
            flat = residual.transpose(1, 2).reshape(-1, residual.shape[1])
            nearest = torch.cdist(flat[None].float(), vectors[None].float())[0].argmin(dim=-1)
            nearest = nearest.view(residual.shape[0], residual.shape[2])
            residual = residual - F.embedding(nearest, vectors).transpose(1, 2)
            codes.append(nearest)
        return torch.stack(codes, dim=1)


class SplitResidualVectorQuantizer(nn.Module):
    def __init__(self, config: CodecEncoderConfig):
        super().__init__()
        semantic = config.num_semantic_quantizers
        self.semantic_residual_vector_quantizer = ResidualVectorQuantizer(config, semantic)
        self.acoustic_residual_vector_quantizer = ResidualVectorQuantizer(config, config.valid_quantizers - semantic)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        codes = [self.semantic_residual_vector_quantizer.encode(x)]
        if self.acoustic_residual_vector_quantizer.layers:
            codes.append(self.acoustic_residual_vector_quantizer.encode(x))
        return torch.cat(codes, dim=1)


# ---------------------------------------------------------------------------------------------
# Encoder


class CodecEncoder(nn.Module):
    """Waveform -> 12.5 Hz codes, with the official parameter names (checkpoint prefix "encoder.")."""

    def __init__(self, config: CodecEncoderConfig):
        super().__init__()
        self.config = config
        self.encoder = SEANetEncoder(config)
        self.encoder_transformer = Transformer(config)
        self.downsample = CausalConv1d(config.hidden_size, config.hidden_size, config.downsample_kernel,
                                       stride=DOWNSAMPLE_STRIDE, bias=False, pad_mode="replicate")
        self.quantizer = SplitResidualVectorQuantizer(config)

    def forward(self, waveforms: torch.Tensor) -> torch.Tensor:
        """[B, T] waveforms (no padding) -> codes [B, valid_quantizers, ceil(T / 1920)] (all frames
        the stack makes; `encode` keeps the official count)."""
        x = self.encoder(waveforms[:, None].to(self.downsample.conv.weight.dtype))
        x = self.encoder_transformer(x.transpose(1, 2)).transpose(1, 2)
        return self.quantizer.encode(self.downsample(x))

    @torch.inference_mode()
    def encode(self, waveform: torch.Tensor) -> torch.Tensor:
        """Codes LongTensor [frames, valid_quantizers] (this module's device) of one clip: float
        mono [T] at 24 kHz; frames = ceil(T / samples_per_frame)."""
        if waveform.dim() != 1 or waveform.shape[0] == 0:
            raise ValueError(f"expected a non-empty mono waveform [samples], got shape {list(waveform.shape)}")
        codes = self(waveform[None].to(self.downsample.conv.weight.device))[0]
        frames = -(-waveform.shape[0] // self.config.samples_per_frame)
        return codes[:, :frames].transpose(0, 1).contiguous()

    @classmethod
    def from_state_dict(cls, config: CodecEncoderConfig, state: dict[str, torch.Tensor],
                        device="cpu", dtype: torch.dtype = torch.float32) -> CodecEncoder:
        """From tensors named as the official encoder's (checkpoint prefix "encoder." stripped); tensors
        this module does not use are ignored. CheckpointError names a missing or misshapen tensor.
        Eval mode, no gradients."""
        with torch.device("meta"):
            model = cls(config)
        check_tensors(model, state, "codec encoder")
        model.load_state_dict({k: state[k].to(device=device, dtype=dtype) for k in model.state_dict()}, assign=True)
        return model.eval().requires_grad_(False)


def load_codec_encoder(speech_tokenizer_dir: str | Path, device="cpu",
                       dtype: torch.dtype = torch.float32) -> CodecEncoder:
    """The encoder of a checkpoint's speech_tokenizer/ (config.json + the encoder.* tensors of
    model.safetensors), in eval mode on `device` in `dtype`. CheckpointError names the file at fault."""
    directory = Path(speech_tokenizer_dir)
    config_path = directory / "config.json"
    config = CodecEncoderConfig.parse(read_json(config_path), config_path)
    path = directory / "model.safetensors"
    if not path.is_file():
        raise CheckpointError(f"missing file: {path}")
    with torch.device("meta"):
        wanted = set(CodecEncoder(config).state_dict())
    try:
        with safe_open(str(path), framework="pt", device="cpu") as file:
            names = [k for k in file.keys() if k.startswith(CHECKPOINT_PREFIX) and k[len(CHECKPOINT_PREFIX):] in wanted]
            state = {k[len(CHECKPOINT_PREFIX):]: file.get_tensor(k) for k in names}
    except Exception as e:  # safetensors raises its own error types for a corrupt file
        raise CheckpointError(f"{path}: cannot be read ({e})") from e
    try:
        return CodecEncoder.from_state_dict(config, state, device=device, dtype=dtype)
    except CheckpointError as e:
        raise CheckpointError(f"{path}: {e}") from None
