"""Codec decoder: streaming == full causal decode, per-row reset, loader errors, golden audio."""
import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from tts_cli.errors import CheckpointError
from tts_cli.model.codec import (CausalConvTranspose1d, CodebookSum, CodecConfig, CodecDecoder, CodecState, fold_codebook,
                                 load_codec)

REPO = Path(__file__).resolve().parents[1]
GOLDEN = REPO / "tts_cli/assets/golden/tiny-1.7b-customvoice/records.safetensors"
GOLDEN_CHECKPOINT = REPO / "tts_cli/assets/tiny-1.7b-customvoice/speech_tokenizer"

# Tiny widths, but the real upsampling (1920 samples per frame) and 16 quantizers; grouped-query
# attention (2 heads, 1 kv head) to cover the general case.
TINY_CONFIG = {
    "output_sample_rate": 24000,
    "decode_upsample_rate": 1920,
    "decoder_config": {
        "codebook_size": 32, "codebook_dim": 16, "num_quantizers": 16, "latent_dim": 24,
        "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
        "sliding_window": 8, "rope_theta": 10000, "rms_norm_eps": 1e-5,
        "upsample_rates": [8, 5, 4, 3], "upsampling_ratios": [2, 2], "decoder_dim": 32,
        "hidden_act": "silu", "attention_bias": False, "layer_scale_initial_scale": 0.01,
    },
}


def tiny_config(**decoder_overrides) -> dict:
    config = copy.deepcopy(TINY_CONFIG)
    config["decoder_config"].update(decoder_overrides)
    return config


def random_codebooks(config: CodecConfig, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """The quantizer tensors of a checkpoint, named as in speech_tokenizer/model.safetensors."""
    n, d = config.codebook_size, config.codebook_dim // 2
    tensors = {}
    for group, count in (("rvq_first", 1), ("rvq_rest", config.num_quantizers - 1)):
        for i in range(count):
            prefix = f"decoder.quantizer.{group}.vq.layers.{i}._codebook."
            tensors[prefix + "embedding_sum"] = torch.randn(n, d, generator=generator)
            tensors[prefix + "cluster_usage"] = 0.5 + 3 * torch.rand(n, generator=generator)
        tensors[f"decoder.quantizer.{group}.output_proj.weight"] = (
            torch.randn(config.codebook_dim, d, 1, generator=generator) / d ** 0.5)
    return tensors


def fold_tables(config: CodecConfig, codebooks: dict[str, torch.Tensor]) -> torch.Tensor:
    tables = []
    for q in range(config.num_quantizers):
        group, i = ("rvq_first", 0) if q == 0 else ("rvq_rest", q - 1)
        prefix = f"decoder.quantizer.{group}.vq.layers.{i}._codebook."
        tables.append(fold_codebook(codebooks[prefix + "embedding_sum"], codebooks[prefix + "cluster_usage"],
                                    codebooks[f"decoder.quantizer.{group}.output_proj.weight"]))
    return torch.stack(tables)


def random_decoder(config_dict: dict, seed: int = 0) -> tuple[CodecDecoder, dict[str, torch.Tensor]]:
    """A decoder whose every parameter matters (no identity-like init) and whose output stays mostly
    inside [-1, 1], so the clamp does not hide differences; plus its codebook tensors."""
    config = CodecConfig.parse(config_dict, Path("config.json"))
    model = CodecDecoder(config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (nn.Conv1d, nn.Linear)):
                fan_in = module.weight[0].numel()
            elif isinstance(module, nn.ConvTranspose1d):  # each output sees in * kernel/stride inputs
                fan_in = module.weight.shape[0] * module.weight.shape[2] // module.stride[0]
            else:
                continue
            module.weight.copy_(torch.randn(module.weight.shape, generator=g) / fan_in ** 0.5)
            if module.bias is not None:
                module.bias.copy_(0.1 * torch.randn(module.bias.shape, generator=g))
        for name, p in model.named_parameters():
            if name.endswith((".alpha", ".beta")):
                p.copy_(torch.rand(p.shape, generator=g) - 0.5)
            elif name.endswith((".gamma", ".scale")):
                p.copy_(0.3 + 0.5 * torch.rand(p.shape, generator=g))
            elif "norm" in name and name.endswith(".weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("conv2.conv.weight"):  # keeps the residual stacks from blowing up
                p.mul_(0.3)
        model.decoder[-1].conv.weight.mul_(0.05)
        codebooks = random_codebooks(config, g)
        model.quantizer.tables.copy_(fold_tables(config, codebooks))
    return model.eval(), codebooks


def random_codes(config: CodecConfig, batch: int, frames: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, config.codebook_size, (batch, frames, config.num_quantizers), generator=g)


def rel_l2(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm()).item()


def stream(model: CodecDecoder, codes: torch.Tensor, chunks: list[int]) -> torch.Tensor:
    state = model.new_state(codes.shape[0])
    pieces, start = [], 0
    for k in chunks:
        pieces.append(model.decode_step(codes[:, start:start + k], state))
        start += k
    assert start == codes.shape[1]
    return torch.cat(pieces, dim=1)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """These tensors are tiny: intra-op threading only adds overhead (10x on a busy machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny(one_thread):
    return random_decoder(TINY_CONFIG)[0]


def test_output_length_and_range(tiny):
    assert tiny.samples_per_frame == 1920 and tiny.sample_rate == 24000
    wav = tiny.decode(random_codes(tiny.config, 2, 5, seed=1))
    assert wav.shape == (2, 5 * 1920) and wav.dtype == torch.float32
    assert wav.abs().max() <= 1
    # The test network must be neither silent nor saturated, or comparisons below would be vacuous.
    assert 0.05 < wav.std() and (wav.abs() == 1).float().mean() < 0.05


@pytest.mark.parametrize("window, frames", [(8, 30), (72, 90)])
def test_frame_by_frame_stream_equals_full_decode(window, frames):
    model, _ = random_decoder(tiny_config(sliding_window=window), seed=window)
    codes = random_codes(model.config, 2, frames, seed=2)
    full = model.decode(codes)
    assert rel_l2(stream(model, codes, [1] * frames), full) < 1e-5


def test_random_chunk_stream_equals_full_decode(tiny):
    codes = random_codes(tiny.config, 2, 40, seed=3)
    g = torch.Generator().manual_seed(3)
    chunks, left = [], 40
    while left:
        chunks.append(min(left, int(torch.randint(1, 12, (1,), generator=g))))
        left -= chunks[-1]
    assert len(chunks) > 3
    assert rel_l2(stream(tiny, codes, chunks), tiny.decode(codes)) < 1e-5


def test_codebook_sum_adds_each_quantizers_row_in_order():
    """One bag of the joined tables per frame: the same fp32 sum, bit for bit, as a lookup per
    quantizer added one after another (tables of very different scales, so an order change shows)."""
    g = torch.Generator().manual_seed(0)
    quantizers, size, dim = 16, 37, 24
    codebooks = CodebookSum(quantizers, size, dim)
    codebooks.tables = torch.randn(quantizers, size, dim, generator=g) * 10.0 ** torch.arange(-4, 4, 0.5)[:, None, None]
    codes = torch.randint(0, size, (3, 5, quantizers), generator=g)
    expected = codebooks.tables[0][codes[..., 0]]
    for q in range(1, quantizers):
        expected = expected + codebooks.tables[q][codes[..., q]]
    assert torch.equal(codebooks(codes), expected)


def test_transposed_convolutions_as_one_gemm_give_the_modules_output():
    """The engine's path for the transposed convolutions (a GEMM over each block's input frames,
    CausalConvTranspose1d.prepare_fused) against the plain modules: whole decode and streamed in
    uneven chunks. A separate model: the switch stays on the modules."""
    model, _ = random_decoder(TINY_CONFIG)
    codes = random_codes(model.config, 2, 12, seed=6)
    full, streamed = model.decode(codes), stream(model, codes, [1, 4, 2, 5])
    transposed = [m for m in model.modules() if isinstance(m, CausalConvTranspose1d)]
    assert {m.context for m in transposed} == {0, 1}   # the frame-rate upsampling and the vocoder's
    for module in transposed:
        module.prepare_fused()
        module.fused = True
    assert rel_l2(model.decode(codes), full) < 1e-5        # fp32 summation order
    assert rel_l2(stream(model, codes, [3, 1, 8]), streamed) < 1e-5


def test_reset_restarts_one_row_and_leaves_the_others(tiny):
    spf = tiny.samples_per_frame
    old = random_codes(tiny.config, 3, 25, seed=4)
    new = random_codes(tiny.config, 1, 18, seed=5)
    reset_at = 7  # row 1 switches to `new` after 7 frames; rows 0 and 2 go on with `old`
    state = tiny.new_state(3)
    first = tiny.decode_step(old[:, :reset_at], state)
    with pytest.raises(ValueError, match="1-D int64 tensor of row indices"):
        state.reset(torch.tensor([False, True, False]))   # a mask is refused, not read as indices
    state.reset(torch.tensor([1]))
    assert state.position.tolist() == [reset_at, 0, reset_at]
    codes = old[:, reset_at:].clone()
    codes[1] = new[0]
    rest = [tiny.decode_step(codes[:, t:t + k], state) for t, k in ((0, 1), (1, 4), (5, 1), (6, 12))]
    wav = torch.cat([first, *rest], dim=1)

    uninterrupted = tiny.decode(old)
    for row in (0, 2):
        assert rel_l2(wav[row], uninterrupted[row]) < 1e-5
    assert rel_l2(wav[1, reset_at * spf:], tiny.decode(new)[0]) < 1e-5
    assert torch.equal(state.position, torch.tensor([25, 18, 25]))


def test_state_holds_every_history():
    model, _ = random_decoder(tiny_config(sliding_window=8))
    state = model.new_state(3)
    assert isinstance(state, CodecState) and state.position.tolist() == [0, 0, 0]
    shapes = {name: tuple(t.shape) for name, t in state.history.items()}
    assert shapes["pre_conv"] == (3, 2, 16)   # time-major: [rows, frames, channels]
    assert shapes["pre_transformer.layers.1.self_attn"] == (3, 2, 1, 7, 8)  # kv heads, window - 1
    assert shapes["upsample.0.1.dwconv"] == (3, 6, 24)
    assert shapes["decoder.1.block.1"] == (3, 1, 32)  # transposed conv: previous input frame
    assert shapes["decoder.4.block.4.conv1"] == (3, 54, 2)  # k=7, dilation 9
    assert "upsample.0.0" not in shapes and "decoder.1.block.2.conv2" not in shapes  # no context


def write_checkpoint(directory: Path, config: dict, seed: int = 0) -> CodecDecoder:
    model, codebooks = random_decoder(config, seed)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    tensors = {"decoder." + name: t.contiguous() for name, t in model.state_dict().items()}
    # The encoder and the encode-only input projections are in real files and must be ignored.
    tensors["encoder.conv.weight"] = torch.zeros(3)
    tensors["decoder.quantizer.rvq_first.input_proj.weight"] = torch.zeros(8, 16, 1)
    save_file({**tensors, **codebooks}, str(directory / "model.safetensors"))
    return model


def test_load_codec_matches_the_in_memory_model(tmp_path):
    model = write_checkpoint(tmp_path, TINY_CONFIG)
    loaded = load_codec(tmp_path)
    assert not loaded.training and not any(p.requires_grad for p in loaded.parameters())
    codes = random_codes(model.config, 2, 12, seed=6)
    assert rel_l2(loaded.decode(codes), model.decode(codes)) < 1e-6
    half = load_codec(tmp_path, dtype=torch.bfloat16)
    assert half.quantizer.tables.dtype == torch.bfloat16
    assert rel_l2(half.decode(codes).float(), model.decode(codes)) < 0.1


def test_load_codec_errors_name_the_file(tmp_path):
    config_path = tmp_path / "config.json"
    weights_path = tmp_path / "model.safetensors"
    with pytest.raises(CheckpointError, match="config.json"):
        load_codec(tmp_path)

    write_checkpoint(tmp_path, TINY_CONFIG)
    config_path.write_text("{not json")
    with pytest.raises(CheckpointError, match=r"malformed JSON in .*config\.json"):
        load_codec(tmp_path)

    config = tiny_config()
    del config["decoder_config"]["sliding_window"]
    config_path.write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"config\.json -> decoder_config: missing field 'sliding_window'"):
        load_codec(tmp_path)

    config_path.write_text(json.dumps(TINY_CONFIG))
    weights = load_file(str(weights_path))
    weights_path.unlink()
    with pytest.raises(CheckpointError, match=r"missing file: .*model\.safetensors"):
        load_codec(tmp_path)

    weights_path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00garbage")
    with pytest.raises(CheckpointError, match=r"model\.safetensors: not a valid safetensors file"):
        load_codec(tmp_path)

    for name in ("decoder.pre_transformer.layers.1.mlp.up_proj.weight",
                 "decoder.quantizer.rvq_rest.vq.layers.14._codebook.cluster_usage"):
        save_file({k: v for k, v in weights.items() if k != name}, str(weights_path))
        with pytest.raises(CheckpointError, match=rf"model\.safetensors: tensor {name} is missing"):
            load_codec(tmp_path)

    name = "decoder.decoder.2.block.1.conv.weight"
    save_file({**weights, name: weights[name][:, :, :-1].contiguous()}, str(weights_path))
    with pytest.raises(CheckpointError, match=rf"tensor {name} has shape \[16, 8, 9\], expected \[16, 8, 10\]"):
        load_codec(tmp_path)


def test_golden_decode_matches_the_official_decoder():
    if not (GOLDEN.is_file() and GOLDEN_CHECKPOINT.is_dir()):
        pytest.skip(f"golden records not produced yet ({GOLDEN.relative_to(REPO)} "
                    f"or {GOLDEN_CHECKPOINT.relative_to(REPO)} missing)")
    records = load_file(str(GOLDEN))
    codes, want = records["codec.codes"], records["codec.wav"]
    model = load_codec(GOLDEN_CHECKPOINT)
    got = model.decode(codes[None].long())[0]
    assert got.shape == want.shape
    assert rel_l2(got, want.float()) < 1e-4


def test_codec_bench_cudnn_arm_is_the_causal_convolution():
    """tools/codec_bench.py --convs --cudnn times cuDNN on the time-major buffers seen as NHWC
    images: the same convolution (here on the CPU) as the module's, history included."""
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    from codec_bench import cudnn_conv
    from tts_cli.model.codec import CausalConv1d
    torch.manual_seed(0)
    conv, frames = CausalConv1d(6, 5, 7, dilation=3), 11
    src = torch.randn(2, conv.context + frames, 6)
    with torch.no_grad():
        expected = conv.conv(src.transpose(1, 2))                                      # [B, C_out, frames]
        got = cudnn_conv((src, conv.tap_matrix(), conv.conv.bias, frames, 3), {})()    # [B, C_out, 1, frames]
    assert got.shape == (2, 5, 1, frames)
    torch.testing.assert_close(got[:, :, 0], expected, rtol=1e-5, atol=1e-5)


def test_codec_bench_sums_the_convolutions_by_kind():
    """tools/codec_bench.py --convs ends with each kind's count, time and TFLOP/s (the total's from
    the summed FLOPs and times, not a mean of rates)."""
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    from codec_bench import conv_kind, kind_sums
    assert [conv_kind(0, 512, 1536, 1024), conv_kind(3, 96, 96, 96), conv_kind(9, 768, 1536, 1920),
            conv_kind(24, 96, 672, 96), conv_kind(30, 96, 672, 1)] == \
        ["pre-convolution", "1x1", "transposed", "7-tap", "one channel"]
    lines = kind_sums([("1x1", 100.0, 2e9), ("7-tap", 200.0, 8e9), ("1x1", 50.0, 1e9)]).splitlines()
    assert [line.split() for line in lines] == [["1x1", "2", "150", "us", "20", "TF/s"],
                                                ["7-tap", "1", "200", "us", "40", "TF/s"],
                                                ["all", "3", "350", "us", "31", "TF/s"]]
