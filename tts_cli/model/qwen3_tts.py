"""The whole Qwen3-TTS model (talker + code predictor) and its weight loading. A Base checkpoint's
speaker encoder (`speaker_encoder.*`) is not part of it: the speaker encoder loads those tensors
(Checkpoint.speaker_encoder_tensors); here they are only required present (Base) or absent."""
from __future__ import annotations

import logging

import torch
from torch import nn

from tts_cli.checkpoint import BASE, SPEAKER_ENCODER_PREFIX, Checkpoint, ModelConfig
from tts_cli.errors import CheckpointError
from tts_cli.model.depth import CodePredictor
from tts_cli.model.talker import Talker

log = logging.getLogger(__name__)

# official key prefix -> our module path (longest prefixes first)
_KEY_PREFIXES = (
    ("talker.code_predictor.small_to_mtp_projection.", "code_predictor.input_projection."),
    ("talker.code_predictor.model.codec_embedding.", "code_predictor.codec_embeddings."),
    ("talker.code_predictor.model.layers.", "code_predictor.decoder.layers."),
    ("talker.code_predictor.model.norm.", "code_predictor.decoder.norm."),
    ("talker.code_predictor.lm_head.", "code_predictor.heads."),
    ("talker.model.text_embedding.", "talker.text_embedding."),
    ("talker.model.codec_embedding.", "talker.codec_embedding."),
    ("talker.model.layers.", "talker.decoder.layers."),
    ("talker.model.norm.", "talker.decoder.norm."),
    ("talker.text_projection.", "talker.text_projection."),
    ("talker.codec_head.", "talker.codec_head."),
)


def beyond_fp16(module: nn.Module) -> str | None:
    """The name of the first weight with a value beyond fp16's range (65504), or None."""
    for name, p in module.named_parameters():
        if p.is_floating_point() and p.abs().amax() > torch.finfo(torch.float16).max:
            return name
    return None


def official_to_local(key: str) -> str | None:
    for official, local in _KEY_PREFIXES:
        if key.startswith(official):
            return local + key[len(official):]
    return None


class Qwen3TTS(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.talker = Talker(cfg)
        self.code_predictor = CodePredictor(cfg)

    @classmethod
    def from_checkpoint(cls, ckpt: Checkpoint, device="cpu", dtype=torch.float32) -> "Qwen3TTS":
        """dtype float16: the stored (bf16) weights converted, unless one lies beyond fp16's range:
        then they stay bf16 (logged)."""
        with torch.device("meta"):
            model = cls(ckpt.config)
        source = ckpt.root / "model.safetensors"
        model.load_official_state(ckpt.tensors(), source=source)
        model = model.to(device=device)
        if dtype == torch.float16 and (beyond := beyond_fp16(model)) is not None:
            log.warning("%s: %s has values beyond fp16's range (65504): the talker and code predictor "
                        "run on bf16 weights instead", source, beyond)
            dtype = torch.bfloat16
        return model.to(dtype=dtype).eval().requires_grad_(False)

    def load_official_state(self, tensors: dict[str, torch.Tensor], source) -> None:
        """Loads official-layout tensors, naming any missing, unexpected or misshapen tensor."""
        expected = self.state_dict()
        local: dict[str, torch.Tensor] = {}
        base = self.cfg.model_type == BASE
        if base and not any(key.startswith(SPEAKER_ENCODER_PREFIX) for key in tensors):
            raise CheckpointError(f"{source}: a Base checkpoint without {SPEAKER_ENCODER_PREFIX}* tensors "
                                  "(the speaker encoder, which voice cloning needs)")
        for key, tensor in tensors.items():
            if base and key.startswith(SPEAKER_ENCODER_PREFIX):
                continue   # the speaker encoder's, loaded by it
            name = official_to_local(key)
            if name is None:
                raise CheckpointError(f"{source}: unexpected tensor '{key}' (not part of a {self.cfg.kind_name} "
                                      "model)")
            if name not in expected:
                raise CheckpointError(f"{source}: unexpected tensor '{key}' for this config.json")
            if tuple(tensor.shape) != tuple(expected[name].shape):
                raise CheckpointError(f"{source}: tensor '{key}' has shape {tuple(tensor.shape)}, "
                                      f"config.json implies {tuple(expected[name].shape)}")
            local[name] = tensor
        missing = sorted(set(expected) - set(local))
        if missing:
            inverse = {loc: off for off, loc in _KEY_PREFIXES}
            first = missing[0]
            official = next((inverse[p] + first[len(p):] for p in inverse if first.startswith(p)), first)
            raise CheckpointError(f"{source}: missing tensor '{official}'"
                                  + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""))
        self.load_state_dict(local, assign=True)
