"""The speaker encoder of the Qwen3-TTS Base checkpoints: 24 kHz mono waveform -> x-vector [enc_dim].

Same function as the official `Qwen3TTSForConditionalGeneration.extract_speaker_embedding`
(qwen-tts-hf 0.1.1.post1), which voice cloning uses for the reference audio:

- Input: float32 mono at 24 kHz (the official asserts sr == 24000; its caller
  `create_voice_clone_prompt` first downmixes by averaging the channels and resamples other rates
  with librosa.resample, i.e. soxr "soxr_hq"). No loudness normalisation, no trimming, no padding
  to a minimum length.
- Log-mel front end (official `mel_spectrogram`), always in fp32: reflect-pad (n_fft - hop) / 2 =
  384 samples on each side, STFT with n_fft 1024, hop 256, a periodic Hann window of 1024, no
  centering; magnitude sqrt(re^2 + im^2 + 1e-9); a 128-band Slaney mel filterbank over 0..12 kHz
  (librosa.filters.mel's default: Slaney mel scale, Slaney area normalisation), computed here
  (`slaney_mel_filterbank`) instead of calling librosa; log(clamp(mel, min=1e-5)). A clip of T
  samples gives (T + 768 - 1024) // 256 + 1 = T // 256 frames.
- ECAPA-TDNN (official `Qwen3TTSSpeakerEncoder`): a TDNN block, SE-Res2Net blocks, multi-layer
  feature aggregation over the SE-Res2Net outputs, attentive statistics pooling over all frames
  (no padding mask), a 1x1 conv to enc_dim. Every conv has padding "same" with reflect padding.
  The official runs it in the model's dtype (bf16 for the released checkpoints) on fp32 mels cast
  to that dtype; `SpeakerEncoder.embed` does the same with this module's dtype.

Module and parameter names are the official ones, so the module loads the checkpoint's
`speaker_encoder.*` tensors with the prefix stripped. `speaker_encoder_config` of the released
Base config.json sets only enc_dim (the talker's hidden size: 2048 for 1.7B, 1024 for 0.6B) and
sample_rate; every other field takes the official default.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from tts_cli.config_file import ConfigFields
from tts_cli.errors import CheckpointError

CHECKPOINT_PREFIX = "speaker_encoder."

# The mel front end of the official extract_speaker_embedding (fixed there, not in config.json).
SAMPLE_RATE = 24000
N_FFT = 1024
HOP_LENGTH = 256
WIN_LENGTH = 1024
N_MELS = 128
F_MIN = 0.0
F_MAX = 12000.0
MAGNITUDE_EPS = 1e-9
LOG_CLAMP_MIN = 1e-5
STD_CLAMP_MIN = 1e-12  # attentive statistics pooling: variance floor before the sqrt


# ---------------------------------------------------------------------------------------------
# Mel front end


# Slaney's mel scale: linear below 1 kHz (200/3 Hz per mel), logarithmic above (27 mels per
# factor 6.4).
MEL_LINEAR_HZ = 200.0 / 3
MEL_LOG_START_HZ = 1000.0
MEL_LOG_START = MEL_LOG_START_HZ / MEL_LINEAR_HZ
MEL_LOG_STEP = math.log(6.4) / 27.0


def _hz_to_slaney_mel(hz: torch.Tensor) -> torch.Tensor:
    logarithmic = MEL_LOG_START + torch.log(hz.clamp(min=MEL_LOG_START_HZ) / MEL_LOG_START_HZ) / MEL_LOG_STEP
    return torch.where(hz >= MEL_LOG_START_HZ, logarithmic, hz / MEL_LINEAR_HZ)


def _slaney_mel_to_hz(mel: torch.Tensor) -> torch.Tensor:
    logarithmic = MEL_LOG_START_HZ * torch.exp(MEL_LOG_STEP * (mel - MEL_LOG_START))
    return torch.where(mel >= MEL_LOG_START, logarithmic, mel * MEL_LINEAR_HZ)


def slaney_mel_filterbank(sample_rate: int = SAMPLE_RATE, n_fft: int = N_FFT, n_mels: int = N_MELS,
                          f_min: float = F_MIN, f_max: float = F_MAX) -> torch.Tensor:
    """float32 [n_mels, n_fft // 2 + 1]: triangular filters with corners equally spaced on the
    Slaney mel scale, each scaled to unit area (2 / bandwidth in Hz), as librosa.filters.mel with
    its defaults (htk=False, norm="slaney"). Computed in float64 like librosa, then rounded the
    way librosa does (each filter row to float32, then the area scaling rounded again)."""
    fft_hz = torch.arange(n_fft // 2 + 1, dtype=torch.float64) / (n_fft * (1.0 / sample_rate))
    low, high = _hz_to_slaney_mel(torch.tensor([f_min, f_max], dtype=torch.float64)).tolist()
    # numpy.linspace's arithmetic (start + i * step, the end point exact), which librosa uses.
    step = (high - low) / (n_mels + 1)
    corner_mel = torch.arange(n_mels + 2, dtype=torch.float64) * step + low
    corner_mel[-1] = high
    corner_hz = _slaney_mel_to_hz(corner_mel)
    widths = corner_hz.diff()
    offsets = corner_hz[:, None] - fft_hz[None, :]
    rising = -offsets[:-2] / widths[:-1, None]
    falling = offsets[2:] / widths[1:, None]
    filters = torch.minimum(rising, falling).clamp(min=0).to(torch.float32)
    area_scale = 2.0 / (corner_hz[2:] - corner_hz[:-2])
    return (filters.to(torch.float64) * area_scale[:, None]).to(torch.float32)


def log_mel_spectrogram(waveform: torch.Tensor, filterbank: torch.Tensor | None = None) -> torch.Tensor:
    """float32 [B, T // 256, n_mels] from a 24 kHz waveform [T] or [B, T], computed in fp32 on the
    waveform's device."""
    if filterbank is None:
        filterbank = slaney_mel_filterbank()
    audio = waveform.to(torch.float32)
    if audio.dim() == 1:
        audio = audio[None]
    side = (N_FFT - HOP_LENGTH) // 2
    audio = F.pad(audio[:, None], (side, side), mode="reflect")[:, 0]
    window = torch.hann_window(WIN_LENGTH, device=audio.device)
    spectrum = torch.stft(audio, N_FFT, hop_length=HOP_LENGTH, win_length=WIN_LENGTH, window=window,
                          center=False, normalized=False, onesided=True, return_complex=True)
    magnitude = torch.sqrt(torch.view_as_real(spectrum).pow(2).sum(-1) + MAGNITUDE_EPS)
    mel = torch.matmul(filterbank.to(audio.device), magnitude)
    return torch.log(mel.clamp(min=LOG_CLAMP_MIN)).transpose(1, 2)


# ---------------------------------------------------------------------------------------------
# Config


@dataclass(frozen=True)
class SpeakerEncoderConfig:
    """`speaker_encoder_config` of a Base checkpoint's config.json (official defaults for the
    fields the released files leave out)."""

    enc_dim: int = 1024
    mel_dim: int = N_MELS
    enc_channels: tuple[int, ...] = (512, 512, 512, 512, 1536)
    enc_kernel_sizes: tuple[int, ...] = (5, 3, 3, 3, 1)
    enc_dilations: tuple[int, ...] = (1, 2, 3, 4, 1)
    enc_attention_channels: int = 128
    enc_res2net_scale: int = 8
    enc_se_channels: int = 128
    sample_rate: int = SAMPLE_RATE

    @classmethod
    def parse(cls, config: dict, path: Path | str) -> SpeakerEncoderConfig:
        """From the parsed main config.json; CheckpointError names a missing or bad field."""
        return cls.from_fields(ConfigFields(config, str(path)).sub("speaker_encoder_config"))

    @classmethod
    def from_fields(cls, fields: ConfigFields) -> SpeakerEncoderConfig:
        """From the `speaker_encoder_config` object (its missing fields take the official defaults)."""
        default = cls()

        def ints(key: str) -> tuple[int, ...]:
            return fields.int_list(key) if key in fields.data else getattr(default, key)

        parsed = cls(
            enc_dim=fields.get("enc_dim", int, default.enc_dim, minimum=1),
            mel_dim=fields.get("mel_dim", int, default.mel_dim, minimum=1),
            enc_channels=ints("enc_channels"),
            enc_kernel_sizes=ints("enc_kernel_sizes"),
            enc_dilations=ints("enc_dilations"),
            enc_attention_channels=fields.get("enc_attention_channels", int, default.enc_attention_channels,
                                              minimum=1),
            enc_res2net_scale=fields.get("enc_res2net_scale", int, default.enc_res2net_scale, minimum=1),
            enc_se_channels=fields.get("enc_se_channels", int, default.enc_se_channels, minimum=1),
            sample_rate=fields.get("sample_rate", int, default.sample_rate, minimum=1),
        )
        parsed.check(fields.where)
        return parsed

    def check(self, where: str) -> None:
        """The structural constraints of the official module and of its fixed mel front end."""
        layers = len(self.enc_channels)
        if layers < 3 or len(self.enc_kernel_sizes) != layers or len(self.enc_dilations) != layers:
            raise CheckpointError(f"{where}: enc_channels, enc_kernel_sizes and enc_dilations must have the "
                                  f"same length (at least 3)")
        if self.mel_dim != N_MELS or self.sample_rate != SAMPLE_RATE:
            raise CheckpointError(f"{where}: the official front end makes {N_MELS} mel bands at {SAMPLE_RATE} Hz; "
                                  f"got mel_dim {self.mel_dim}, sample_rate {self.sample_rate}")
        if sum(self.enc_channels[1:-1]) != self.enc_channels[-1]:
            raise CheckpointError(f"{where}: enc_channels[-1] must be the sum of the SE-Res2Net widths (the "
                                  f"aggregation's input), got {list(self.enc_channels)}")
        for i in range(1, layers - 1):
            if self.enc_channels[i] != self.enc_channels[i - 1] or self.enc_channels[i] % self.enc_res2net_scale:
                raise CheckpointError(f"{where}: SE-Res2Net block {i} needs enc_channels[{i}] equal to the "
                                      f"previous width and divisible by enc_res2net_scale")


# ---------------------------------------------------------------------------------------------
# ECAPA-TDNN


class TimeDelayNetBlock(nn.Module):
    """Conv1d ("same" length, reflect padding) + ReLU."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, dilation: int):
        super().__init__()
        self.conv = nn.Conv1d(in_channels, out_channels, kernel_size, dilation=dilation, padding="same",
                              padding_mode="reflect")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.conv(x))


class Res2NetBlock(nn.Module):
    """Channels in `scale` groups: group 0 passes through, group 1 goes through its TDNN, each
    later group through its TDNN after adding the previous group's output."""

    def __init__(self, channels: int, scale: int, kernel_size: int, dilation: int):
        super().__init__()
        width = channels // scale
        self.scale = scale
        self.blocks = nn.ModuleList(TimeDelayNetBlock(width, width, kernel_size, dilation) for _ in range(scale - 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        groups = x.chunk(self.scale, dim=1)
        outputs = [groups[0]]
        previous = None
        for block, group in zip(self.blocks, groups[1:]):
            previous = block(group if previous is None else group + previous)
            outputs.append(previous)
        return torch.cat(outputs, dim=1)


class SqueezeExcitationBlock(nn.Module):
    """Channel gates from the time average: sigmoid(conv2(relu(conv1(mean))))."""

    def __init__(self, channels: int, se_channels: int):
        super().__init__()
        self.conv1 = nn.Conv1d(channels, se_channels, 1)
        self.conv2 = nn.Conv1d(se_channels, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gates = torch.sigmoid(self.conv2(F.relu(self.conv1(x.mean(dim=2, keepdim=True)))))
        return x * gates


class SqueezeExcitationRes2NetBlock(nn.Module):
    """x + SE(TDNN_1x1(Res2Net(TDNN_1x1(x))))."""

    def __init__(self, channels: int, scale: int, se_channels: int, kernel_size: int, dilation: int):
        super().__init__()
        self.tdnn1 = TimeDelayNetBlock(channels, channels, 1, 1)
        self.res2net_block = Res2NetBlock(channels, scale, kernel_size, dilation)
        self.tdnn2 = TimeDelayNetBlock(channels, channels, 1, 1)
        self.se_block = SqueezeExcitationBlock(channels, se_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.se_block(self.tdnn2(self.res2net_block(self.tdnn1(x))))


def _weighted_statistics(x: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per channel mean and standard deviation over time, under weights summing to 1 over time."""
    mean = (weights * x).sum(dim=2)
    variance = (weights * (x - mean[:, :, None]).pow(2)).sum(dim=2)
    return mean, variance.clamp(min=STD_CLAMP_MIN).sqrt()


class AttentiveStatisticsPooling(nn.Module):
    """[B, C, T] -> [B, 2C, 1]: mean and std over time, weighted by a per-channel softmax over time
    of attention scores computed from each frame and the clip's global (uniform) mean and std."""

    def __init__(self, channels: int, attention_channels: int):
        super().__init__()
        self.tdnn = TimeDelayNetBlock(channels * 3, attention_channels, 1, 1)
        self.conv = nn.Conv1d(attention_channels, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        frames = x.shape[2]
        uniform = torch.full((1, 1, frames), 1.0 / frames, dtype=x.dtype, device=x.device)
        mean, std = _weighted_statistics(x, uniform)
        context = torch.cat([x, mean[:, :, None].expand_as(x), std[:, :, None].expand_as(x)], dim=1)
        attention = torch.softmax(self.conv(torch.tanh(self.tdnn(context))), dim=2)
        mean, std = _weighted_statistics(x, attention)
        return torch.cat([mean, std], dim=1)[:, :, None]


class SpeakerEncoder(nn.Module):
    """ECAPA-TDNN x-vector extractor with the official parameter names."""

    def __init__(self, config: SpeakerEncoderConfig):
        super().__init__()
        config.check("SpeakerEncoderConfig")
        self.config = config
        channels, kernels, dilations = config.enc_channels, config.enc_kernel_sizes, config.enc_dilations
        blocks: list[nn.Module] = [TimeDelayNetBlock(config.mel_dim, channels[0], kernels[0], dilations[0])]
        for i in range(1, len(channels) - 1):
            blocks.append(SqueezeExcitationRes2NetBlock(channels[i], config.enc_res2net_scale,
                                                        config.enc_se_channels, kernels[i], dilations[i]))
        self.blocks = nn.ModuleList(blocks)
        self.mfa = TimeDelayNetBlock(channels[-1], channels[-1], kernels[-1], dilations[-1])
        self.asp = AttentiveStatisticsPooling(channels[-1], config.enc_attention_channels)
        self.fc = nn.Conv1d(channels[-1] * 2, config.enc_dim, 1)

    def forward(self, mels: torch.Tensor) -> torch.Tensor:
        """[B, frames, mel_dim] log-mels -> [B, enc_dim] in this module's dtype."""
        x = mels.to(self.fc.weight.dtype).transpose(1, 2)
        outputs = []
        for block in self.blocks:
            x = block(x)
            outputs.append(x)
        x = self.mfa(torch.cat(outputs[1:], dim=1))
        return self.fc(self.asp(x))[:, :, 0]

    @torch.inference_mode()
    def embed(self, waveform: torch.Tensor) -> torch.Tensor:
        """x-vector [enc_dim] (this module's dtype and device) of one clip: float mono [T] at 24 kHz."""
        if waveform.dim() != 1:
            raise ValueError(f"expected a mono waveform [samples], got shape {list(waveform.shape)}")
        if waveform.shape[0] < self.min_samples:
            raise ValueError(f"waveform of {waveform.shape[0]} samples is too short for the speaker encoder "
                             f"(at least {self.min_samples})")
        device = self.fc.weight.device
        mels = log_mel_spectrogram(waveform.to(device), self.mel_filterbank)
        return self(mels)[0]

    @property
    def min_samples(self) -> int:
        """The shortest clip the official function accepts: every reflect-padded conv needs more
        mel frames than its one-sided padding."""
        c = self.config
        widest = max(d * (k - 1) - d * (k - 1) // 2 for k, d in zip(c.enc_kernel_sizes, c.enc_dilations))
        return HOP_LENGTH * (widest + 1)

    @property
    def mel_filterbank(self) -> torch.Tensor:
        return slaney_mel_filterbank(self.config.sample_rate, N_FFT, self.config.mel_dim, F_MIN, F_MAX)

    @classmethod
    def from_state_dict(cls, config: SpeakerEncoderConfig, state: dict[str, torch.Tensor],
                        device="cpu", dtype: torch.dtype = torch.float32) -> SpeakerEncoder:
        """From tensors named as the official module's (checkpoint prefix stripped); CheckpointError
        names a missing or misshapen tensor. Eval mode, no gradients."""
        with torch.device("meta"):
            model = cls(config)
        from tts_cli.checkpoint import check_tensors   # checkpoint.py parses this module's config
        check_tensors(model, state, "speaker encoder")
        model.load_state_dict({k: state[k].to(device=device, dtype=dtype) for k in model.state_dict()}, assign=True)
        return model.eval().requires_grad_(False)


def load_speaker_encoder(config: dict, tensors: dict[str, torch.Tensor], config_path: Path | str = "config.json",
                         device="cpu", dtype: torch.dtype = torch.float32) -> SpeakerEncoder:
    """The speaker encoder of a Base checkpoint: `config` is its parsed config.json, `tensors` its
    model.safetensors tensors (the `speaker_encoder.*` ones are used)."""
    if "speaker_encoder_config" not in config:
        raise CheckpointError(f"{config_path}: no speaker_encoder_config (only Base checkpoints have a "
                              f"speaker encoder)")
    parsed = SpeakerEncoderConfig.parse(config, config_path)
    state = {k[len(CHECKPOINT_PREFIX):]: v for k, v in tensors.items() if k.startswith(CHECKPOINT_PREFIX)}
    return SpeakerEncoder.from_state_dict(parsed, state, device=device, dtype=dtype)
