"""GPU checks of the engine (skipped without CUDA; run through the device machine)."""
import contextlib
import copy
import dataclasses
import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from clone_cases import TINY_BASE, TINY_VOICE_DESIGN, clone_requests, design_requests, random_reference
from tts_cli.engine import (AUTO_ROWS, CODEC_GEMM_ROWS, DEFAULT_ENGINE_ROWS, MAX_PREFILL_GEMM_ROWS,
                            codec_gemm_scale)
from tts_cli.engine.random_model import build_random
from tts_cli.engine.runner import Engine, EngineRequest, PromptSource, use_fused_kernels
from tts_cli.engine.step import PaddedGEMMs
from tts_cli.model.codec import CodecState
from tts_cli.model.generate import RowInput, generate
from tts_cli.model.prompt import (assistant_text, build_prompt, prompt_embeddings, reference_text,
                                  trailing_text_embeddings)
from tts_cli.model.transformer import use_kernels
from tts_cli.request import Request
from tts_cli.synthesizer import (Synthesizer, code_predictor_settings, engine_audio, icl_codes, icl_cut,
                                  talker_settings)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
TINY = Path(__file__).resolve().parents[1] / "tts_cli" / "assets" / "tiny-1.7b-customvoice"
# The engine's slot counts whose numbers the GPU tests hold: --rows auto's choices, and 1024, the first above
# CODEC_GEMM_ROWS and MAX_PREFILL_GEMM_ROWS / 4 (a user's --rows 1024).
ROWS_CHECKED = sorted({*AUTO_ROWS, 1024})
TEXTS = ["The birch canoe slid on the smooth planks.", "Glue the sheet to the dark blue background.",
         "It's easy to tell the depth of a well.", "These days a chicken leg is a rare dish.",
         "Rice is often served in round bowls.", "The juice of lemons makes fine punch."]


@contextlib.contextmanager
def exact_fp32_math():
    """fp32 matmuls and convolutions computed exactly, restored afterwards so that later code sees the
    defaults: TF32 off (cuDNN convolutions default to it, ~1e-3, which would hide a streaming error)
    and cuDNN off, torch's own convolutions instead. cuDNN 9.19's fp32 convolution of the codec's
    pre-convolution (512 -> 1024 channels, 3 taps) over 102 input frames is wrong at 48, 64 and 128
    rows, with or without TF32 (15.2 dB against float64 on the CPU; right at 1-32 and 256 rows, over
    52 and 202 frames, and without cuDNN: 131.9 dB), H200, 2026-12-04, docs/numerics.md."""
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.backends.cudnn.enabled)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = torch.backends.cudnn.enabled = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.backends.cudnn.enabled = saved


@pytest.fixture
def exact_fp32():
    with exact_fp32_math():
        yield


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    return float(a @ b / (a.norm() * b.norm()))


@pytest.mark.parametrize("greedy, kernels", [(True, None), (False, None), (True, False)],
                         ids=["greedy", "sampled", "greedy-without-kernels"])
def test_graphed_engine_equals_the_plain_model_in_fp32(greedy, kernels, exact_fp32):
    """kernels False: the engine a CUDA GPU without (a recent enough) Triton runs, graphs over torch."""
    synth = Synthesizer.from_pretrained(TINY, device="cuda", dtype=torch.float32)
    sampling = synth.ckpt.sampling.greedy() if greedy else synth.ckpt.sampling
    frames = [12, 30, 7, 20, 25, 9]
    embeds = [prompt_embeddings(synth.model.talker, synth.prompt(Request(id=str(i), text=t, speaker="vivian")))
              for i, t in enumerate(TEXTS)]
    engine = Engine(synth.model, synth.codec, rows=4, context=128, talker_defaults=talker_settings(sampling),
                    cp_defaults=code_predictor_settings(sampling), use_graphs=True, fused_kernels=kernels)
    assert engine.step.graphs
    results = engine.run([EngineRequest(key=i, prompt_embeds=e, seed=7 + i, max_frames=f, min_new_tokens=f + 1)
                          for i, (e, f) in enumerate(zip(embeds, frames))])
    assert use_fused_kernels(synth.model, synth.codec, torch.device("cuda"), kernels) is (kernels is None)
    use_fused_kernels(synth.model, synth.codec, torch.device("cuda"), False)        # the reference does not
    for i, (r, e, f) in enumerate(zip(results, embeds, frames)):
        plain = generate(synth.model, [RowInput(e, 7 + i, f)], talker_settings(sampling),
                         code_predictor_settings(sampling), min_new_tokens=f + 1)[0]
        assert np.array_equal(r.codes, plain.codes.numpy()), f"row {i}"


def _real_shape_prompt(kind: str, synth: Synthesizer, cfg):
    """A prompt for the random 1.7B model (cfg): CustomVoice's, or a Base one cloning a random
    reference (clone_icl: 5 s of reference frames, the streaming text mode's default; clone_icl_long:
    20 s, non-streaming text, some 300 positions; clone_xvector: streaming text, its trailing text)."""
    if kind == "customvoice":
        return synth.prompt(Request(id="0", text=TEXTS[0], speaker="vivian"))
    frames = {"clone_icl": 62, "clone_icl_long": 250, "clone_xvector": None}[kind]
    reference = random_reference(cfg, frames, seed=5)
    icl = reference.codes is not None
    return build_prompt(cfg, synth.tokenize(assistant_text(" ".join(TEXTS[:2]))), None, "auto",
                        non_streaming_mode=kind == "clone_icl_long", speaker_embedding=reference.speaker_embedding,
                        reference_ids=synth.tokenize(reference_text(reference.text)) if icl else None,
                        reference_codes=reference.codes)


def _real_shape_row(model, prompt, frames: int, teacher_codes=None) -> RowInput:
    return RowInput(prompt_embeddings(model.talker, prompt, model.code_predictor), 0, frames,
                    teacher_codes=teacher_codes, trailing_text=trailing_text_embeddings(model.talker, prompt))


@pytest.mark.parametrize("prompt_kind", ["customvoice", "clone_icl", "clone_icl_long", "clone_xvector"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_engine_numerics_follow_fp32_teacher_forced_at_real_shapes(dtype, prompt_kind, exact_fp32):
    """The engine's numbers (16-bit weights, fp32 activations, the fused kernels on static caches)
    against the plain fp32 model on the same random 1.7B-shaped weights, both fed the fp32 model's
    own greedy codes: talker and code-predictor logits by cosine similarity (the engine issue's
    thresholds). The weights are bf16 values in both (in fp16: converted), as in the real checkpoint
    (stored in bf16): what is measured is the activations' rounding, not the weights'. Cloned
    voices: a random reference's frames and x-vector in the prompt, trailing text in the steps."""
    model16, _ = build_random("1.7b", "cuda", dtype)
    model32 = copy.deepcopy(model16).float()
    use_kernels(model16, True)
    synth = Synthesizer.from_pretrained(TINY)   # tokenizer and prompt rules only
    assert synth.cfg.im_start_id == model32.cfg.im_start_id
    prompt = _real_shape_prompt(prompt_kind, synth, model32.cfg)
    greedy = synth.ckpt.sampling.greedy()
    frames = 16
    ref = generate(model32, [_real_shape_row(model32, prompt, frames)],
                   talker_settings(greedy), code_predictor_settings(greedy), min_new_tokens=frames + 1, trace=True)[0]
    fast = generate(model16, [_real_shape_row(model16, prompt, frames, teacher_codes=ref.codes.cuda())],
                    talker_settings(greedy), code_predictor_settings(greedy), min_new_tokens=frames + 1, trace=True,
                    static_caches=True)[0]
    talker = min(_cosine(a, b) for a, b in zip(fast.talker_logits, ref.talker_logits))
    depth = min(_cosine(a, b) for a, b in zip(fast.cp_logits, ref.cp_logits))
    agree = np.mean([int(a.argmax() == b.argmax()) for a, b in zip(fast.talker_logits, ref.talker_logits)])
    print(f"engine ({dtype} weights, kernels, {prompt_kind}, {len(prompt)} prompt positions, "
          f"{len(prompt.trailing_text_ids)} trailing) vs fp32 teacher-forced: talker logits cosine min {talker:.7f}, "
          f"code predictor {depth:.6f}, talker argmax agreement {agree:.3f}")
    assert talker >= 0.9999 and depth >= 0.9995


@pytest.mark.parametrize("vocoder, rows, per_call", [
    ("torch", 4, 1), ("fp32", 4, 1), ("fp16", 4, 1), ("torch", 64, 4), ("fp32", 64, 4), ("fp16", 64, 4),
    ("fp16 without TMA", 64, 4)])
def test_streamed_codec_follows_full_fp32_decode(vocoder, rows, per_call, monkeypatch):
    """The codec streamed `per_call` frames per call (fp32 weights, TF32 matmuls and convolutions), as
    the plain modules and as the engine runs it (use_kernels: the time-major vocoder, its convolution
    inputs in fp32 with TF32 or in fp16; at 64 rows of 4 frames the one-warp window attention),
    against the plain modules' exact fp32 full decode: the engine issue's SNR >= 35 dB. "without TMA":
    every convolution through conv.py's kernel, as GPUs other than Hopper run the vocoder."""
    kernels = vocoder != "torch"
    if vocoder == "fp16 without TMA":
        from tts_kernels import conv
        monkeypatch.setattr(conv, "tma_available", lambda device_index: (False, "switched off by the test"))
        vocoder = "fp16"
    from tts_cli.synthesizer import allow_tf32
    _, codec = build_random("1.7b", "cuda", torch.float32)
    codes = torch.randint(0, 2048, (rows, 100, 16), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        with exact_fp32_math():
            full = codec.decode(codes)
        allow_tf32()
        codec.decoder.half = vocoder == "fp16"
        use_kernels(codec, kernels)
        state: CodecState = codec.new_state(rows)
        streamed = torch.cat([codec.decode_step(codes[:, t:t + per_call], state) for t in range(0, 100, per_call)],
                             dim=1)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
    snr = 10 * torch.log10(full.pow(2).sum() / (streamed - full).pow(2).sum())
    print(f"streamed codec (vocoder: {vocoder}, {rows} rows, {per_call} frames a call) vs full fp32 decode: "
          f"SNR {snr:.1f} dB")
    assert snr >= 35


@pytest.mark.parametrize("shape", [(64, 2048, 4096), (64, 6144, 2048), (16, 1024, 2048), (256, 2048, 4096)])
def test_projections_read_fp32_inputs_to_16_bits_over_bf16_weights(shape, exact_fp32):
    """The engine's projections (tts_kernels.linear: residual add + norm + split into bf16 halves,
    cuBLAS with fp32 output, halves summed by the reader) at real shapes against the exact fp32
    product of the same bf16 weights: within ~2^-16 relative, where rounding the input to bf16
    (what a bf16 GEMM does) costs ~2^-9."""
    from tts_kernels.linear import linear, project, split
    from tts_kernels.swiglu import silu_mul
    m, k, n = shape
    g = torch.Generator("cuda").manual_seed(0)
    x = torch.randn(m, k, device="cuda", generator=g) * 3
    delta = torch.randn(m, k, device="cuda", generator=g)
    w = (torch.randn(2 * n, k, device="cuda", generator=g) * 0.02).bfloat16()
    bias = (torch.randn(2 * n, device="cuda", generator=g) * 0.1).bfloat16()
    norm_w = (1 + 0.1 * torch.randn(k, device="cuda", generator=g)).bfloat16()
    wf, bf = w.float(), bias.float()
    added = x + delta
    normed = added * torch.rsqrt(added.pow(2).mean(-1, keepdim=True) + 1e-6) * norm_w.float()

    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()

    residual = x.clone()
    halves = split(residual, torch.bfloat16, norm_w, 1e-6, delta=torch.cat([delta.bfloat16().float(), delta - delta.bfloat16().float()]))
    gate_up = project(halves, w, bias)
    errors = {
        "residual add": rel(residual, added),
        "lone linear": rel(linear(x, w[:n], bias[:n]), F.linear(x, wf[:n], bf[:n])),
        "add + norm + projection": rel(gate_up[:m] + gate_up[m:], F.linear(normed, wf, bf)),
        "silu * up": rel(silu_mul(gate_up, torch.bfloat16).float().view(2, m, n).sum(0), F.silu(F.linear(normed, wf[:n], bf[:n])) * F.linear(normed, wf[n:], bf[n:])),
        "bf16 input (for scale)": rel(F.linear(x.bfloat16(), w[:n]).float(), F.linear(x, wf[:n])),
    }
    print(shape, {k: f"{v:.1e}" for k, v in errors.items()})
    assert max(v for k, v in errors.items() if "bf16" not in k) < 3e-5


def _fp16_operands(rows: int, n: int, k: int):
    """x [rows, k] and a weight [n, k] in fp16, seeded by rows."""
    g = torch.Generator("cuda").manual_seed(rows)
    return (torch.randn(rows, k, device="cuda", generator=g).half(),
            (torch.randn(n, k, device="cuda", generator=g) * 0.02).half())


@pytest.mark.parametrize("rows", [1, 8, 33, 64])
@pytest.mark.parametrize("shape", [(4096, 2048), (12288, 2048), (2048, 6144), (2048, 2048), (3072, 2048),
                                   (1024, 3072)])
def test_decode_step_projection_is_exact_products_summed_in_fp32(shape, rows):
    """A decode step's fp16 projection: at one row `project` runs tts_kernels.linear.gemv, at 2-64
    rows gemm_rows (also as partial sums over K slices). At the 1.7B shapes either is the fp64
    product of the same fp16 values within fp32 summation error, as cuBLAS's result is."""
    from tts_kernels.linear import gemm_rows, gemv, project
    n, k = shape
    x, w = _fp16_operands(rows, n, k)
    exact = x.double() @ w.double().t()
    relative = lambda out: ((out.double() - exact).abs().max() / exact.abs().max()).item()
    got = project(x, w)
    assert torch.equal(got, gemv(x, w) if rows == 1 else gemm_rows(x, w))
    error, error_cublas = relative(got), relative(torch.mm(x, w.t(), out_dtype=torch.float32))
    print(shape, rows, f"ours {error:.1e}, cuBLAS {error_cublas:.1e} of the largest output")
    assert error < (1e-6 if rows == 1 else 1e-5)
    if rows > 1:
        parts = gemm_rows(x, w, partial_sums=True)   # narrow weights: partial sums over K slices
        assert parts.shape[0] % rows == 0
        assert relative(parts.view(-1, rows, n).double().sum(0)) < 1e-5


def test_step_advance_kernel_updates_the_slots_as_torch_does():
    """tts_kernels.advance compiled, against advance_slots: tests/test_kernels.py's interpreter
    check, run on the GPU."""
    from test_kernels import ADVANCE_CHECK
    scope = {"DEVICE": "cuda"}
    exec(ADVANCE_CHECK, scope)
    assert scope["expected"].out_emit.any()


@pytest.mark.parametrize("rows", [1, 8, 33, 64])
@pytest.mark.parametrize("shape", [(12288, 2048), (6144, 1024)], ids=["talker", "code_predictor"])
def test_gate_up_projection_that_does_the_silu_gives_its_sums_then_silu_mul(shape, rows):
    """A decode step's fp16 gate/up projection does the SiLU * up itself (`project_silu`: at one row
    tts_kernels.swiglu.gemv_silu, at 2-64 rows gemm_rows_silu): bit for bit the projection kernel's
    sums (gemv, gemm_rows on gemm_rows_silu's tile), then silu_mul, at the 1.7B shapes."""
    from tts_kernels.linear import gemm_rows, gemv
    from tts_kernels.swiglu import project_silu, silu_mul, silu_tile
    x, w = _fp16_operands(rows, *shape)
    got = project_silu(x, w, torch.float16)
    expected = silu_mul(gemv(x, w) if rows == 1 else gemm_rows(x, w, tile=silu_tile(*shape)), torch.float16)
    print(shape, rows, f"largest difference {(got.float() - expected.float()).abs().max().item():.2e}")
    assert torch.equal(got, expected)


def test_fused_rms_norm_equals_torch_in_bf16():
    from tts_cli.model.transformer import RMSNorm
    g = torch.Generator("cuda").manual_seed(0)
    for width in (128, 1024, 2048):
        x = (torch.randn(64, 3, width, device="cuda", generator=g) * 3).bfloat16()
        norm = RMSNorm(width, 1e-6).cuda()
        with torch.no_grad():
            norm.weight.copy_(1 + 0.1 * torch.randn(width, device="cuda", generator=g))
        norm = norm.bfloat16()
        expected = norm(x)
        norm.fused = True
        got = norm(x)
        # fp32 sums in another order and Triton's sqrt/division vs torch's rsqrt move a few results
        # across a bf16 rounding boundary (measured on the H200: 0.00-0.01% of them, by one unit)
        differ = (got != expected).float().mean().item()
        print(f"width {width}: {differ:.2%} of bf16 results differ from torch's")
        torch.testing.assert_close(got.float(), expected.float(), rtol=2 ** -6, atol=1e-6)
        assert differ < 0.001


def _assert_graphed_engine_like_the_plain_model(checkpoint: Path, requests: list[Request], frames: int = 16,
                                                rows: int = DEFAULT_ENGINE_ROWS):
    """The synthesizer on CUDA (graphed engine of `rows` slots, fused kernels, fp32 weights and
    vocoder) against its plain path: the same codes, waveforms within 1e-5."""
    synth = Synthesizer.from_pretrained(checkpoint, device="cuda", dtype=torch.float32, engine_rows=rows)
    assert synth.uses_engine
    synth.codec_precision = "fp32"   # exact: the fp16 vocoder is held to an SNR in its own test
    fast = synth.synthesize(requests, max_frames=frames, min_new_tokens=frames + 1)
    assert synth._engine_now.step.graphs
    use_fused_kernels(synth.model, synth.codec, torch.device("cuda"), False)
    synth.uses_engine = False
    plain = synth.synthesize(requests, max_frames=frames, min_new_tokens=frames + 1)
    for a, b in zip(fast, plain):
        assert torch.equal(a.codes, b.codes), a.id
        assert a.audio.shape == b.audio.shape and np.linalg.norm(a.audio - b.audio) / np.linalg.norm(b.audio) < 1e-5


def test_synthesizer_on_cuda_runs_the_graphed_engine_like_the_plain_model(exact_fp32):
    requests = [Request(id=str(i), text=t, speaker="vivian", seed=i) for i, t in enumerate(TEXTS[:4])]
    _assert_graphed_engine_like_the_plain_model(TINY, requests)


def test_synthesizer_on_cuda_clones_and_designs_voices_like_the_plain_model(exact_fp32):
    """Base rows (ICL and x-vector only, both text modes: trailing text per slot in the graphed
    step, codec states primed with the references, the ICL cut) and VoiceDesign rows."""
    cfg = Synthesizer.from_pretrained(TINY_BASE).cfg
    _assert_graphed_engine_like_the_plain_model(TINY_BASE, clone_requests(cfg, long_frames=70), frames=11, rows=4)
    _assert_graphed_engine_like_the_plain_model(TINY_VOICE_DESIGN, design_requests(), rows=4)


PRELOAD_PROCESS = """
import json
import sys

import torch

from tts_cli.request import Request
from tts_cli.synthesizer import Synthesizer
from tts_kernels import preload

synth = Synthesizer.from_pretrained(sys.argv[1], device="cuda", dtype=torch.float32, engine_rows=4)
requests = [Request(id=str(i), text=text, speaker="vivian", seed=i) for i, text in enumerate(json.loads(sys.argv[2]))]
results = synth.synthesize(requests, max_frames=8, min_new_tokens=9)
print(json.dumps({"loaded": preload.loaded(), "at_launch": preload.loaded_at_launch(),
                  "codes": [result.codes.tolist() for result in results]}))
"""


def test_a_new_process_preloads_the_kernels_an_earlier_one_compiled(tmp_path):
    """Two processes on one new Triton cache (tts_kernels.preload): the first compiles each kernel at
    its launch and records them at exit; the second loads them while its checkpoint loads, so that
    none of its engine's launches loads a kernel itself, and computes the same codes."""
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "triton"), TTS_KERNEL_PRELOAD="1",
               PYTHONPATH=os.pathsep.join([str(root), str(root / "kernels"), os.environ.get("PYTHONPATH", "")]))
    runs = []
    for _ in range(2):
        run = subprocess.run([sys.executable, "-c", PRELOAD_PROCESS, str(TINY), json.dumps(TEXTS[:2])], env=env,
                             capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stderr[-3000:]
        runs.append(json.loads(run.stdout.strip().splitlines()[-1]))
    first, second = runs
    print({"first": first["loaded"], "compiled at launch": len(first["at_launch"]), "second": second["loaded"]})
    assert len(list((tmp_path / "triton").glob("tts-kernels-*.json"))) == 1
    assert first["loaded"] == 0 and first["at_launch"]
    assert second["loaded"] > 0
    assert second["at_launch"] == [], "kernels the preload did not load"
    assert second["codes"] == first["codes"]


def test_clone_icl_engine_audio_follows_full_fp32_decode_at_real_shapes():
    """ICL rows through the engine at the real 1.7B shapes (random fp16 weights, its default fp16
    vocoder on the codec's stream, 5 s references primed into the codec state): each row's audio
    against the exact fp32 full decode of its reference + its codes, cut as the official code
    cuts: the engine issue's SNR >= 35 dB for the streamed codec."""
    model, codec = build_random("1.7b", "cuda", torch.float16)
    synth = Synthesizer.from_pretrained(TINY)   # tokenizer and prompt rules only
    sampling = synth.ckpt.sampling
    references = [random_reference(model.cfg, 62 + i, seed=i) for i in range(2)]
    prompts = [build_prompt(model.cfg, synth.tokenize(assistant_text(t)), None, "auto",
                            non_streaming_mode=i % 3 == 0, speaker_embedding=references[i % 2].speaker_embedding,
                            reference_ids=synth.tokenize(reference_text(references[i % 2].text)),
                            reference_codes=references[i % 2].codes) for i, t in enumerate(TEXTS)]
    frames = [20 + 3 * i for i in range(len(prompts))]
    requests = [EngineRequest(key=i, prompt_embeds=prompt_embeddings(model.talker, p, model.code_predictor), seed=i,
                              max_frames=f, min_new_tokens=f + 1,
                              trailing_text=trailing_text_embeddings(model.talker, p), codec_prime=p.reference_codes)
                for i, (p, f) in enumerate(zip(prompts, frames))]
    engine = Engine(model, codec, rows=4, context=256, talker_defaults=talker_settings(sampling),
                    cp_defaults=code_predictor_settings(sampling), trailing_text=True)
    assert engine.codec_stream is not None and engine.step.graphs
    results = engine.run(requests)
    use_kernels(codec, False)
    codec.decoder.half = False
    with exact_fp32_math():
        for request, result in zip(requests, results):
            assert result.codes.shape[0] == request.max_frames
            prime = request.codec_prime.cpu()
            full = codec.decode(torch.cat((prime, torch.from_numpy(result.codes))).cuda()[None])[0].cpu().numpy()
            spf = codec.samples_per_frame
            ours = engine_audio(result, prime, spf)
            expected = full[icl_cut(prime.shape[0], prime.shape[0] + request.max_frames, full.shape[0]):]
            assert ours.shape == expected.shape
            snr = 10 * np.log10((expected ** 2).sum() / ((ours - expected) ** 2).sum())
            print(f"ICL row {request.key} ({prime.shape[0]} reference frames): streamed engine audio vs full fp32 "
                  f"decode: SNR {snr:.1f} dB")
            assert snr >= 35


def _real_decoder_pair(cfg, layers: int, dtype: torch.dtype):
    """A torch reference and a fused copy of `layers` layers of a real-shaped decoder in dtype, N(0, 0.02)
    (bf16 values in both dtypes)."""
    from tts_cli.model.transformer import Decoder, use_kernels
    cfg = dataclasses.replace(cfg, num_layers=layers)
    g = torch.Generator("cuda").manual_seed(0)
    with torch.device("cuda"):
        plain = Decoder(cfg)
    with torch.no_grad():
        for name, p in plain.named_parameters():
            p.copy_(torch.randn(p.shape, device="cuda", generator=g) * 0.02 if p.dim() > 1
                    else 1 + 0.1 * torch.randn(p.shape, device="cuda", generator=g))
    plain = plain.bfloat16().to(dtype).requires_grad_(False)
    fused = copy.deepcopy(plain)
    use_kernels(fused, True)
    return plain, fused


@pytest.mark.parametrize("rows", [64, 1])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("which", ["talker", "code_predictor"])
def test_fused_decoder_layers_follow_torch_at_real_shapes(which, dtype, rows, exact_fp32):
    """The engine's fused layers (tts_kernels) against the torch reference, both on 16-bit weights
    with fp32 activations and caches in the weights' dtype, in the caching pattern of each stack: a
    prefill of 30 tokens then single tokens at per-row positions (talker), 2 tokens then one per
    call at a shared offset (code predictor). They differ by the kernels' 16-bit queries and
    probabilities and the rounding of the projections' inputs (fp16, or bf16 halves). One row over
    fp16 takes the GEMV kernels (the gate/up one doing the SiLU * up)."""
    from tts_cli.engine.random_model import random_config
    from tts_cli.model.transformer import StaticKV
    cfg = getattr(random_config("1.7b"), which)
    plain, fused = _real_decoder_pair(cfg, 4, dtype)
    capacity = 64
    g = torch.Generator("cuda").manual_seed(1)
    kvs = {m: [StaticKV(rows, cfg.num_kv_heads, capacity, cfg.head_dim, "cuda", dtype)
               for _ in range(cfg.num_layers)] for m in ("plain", "fused")}

    def both(x, at):
        outs = []
        for model, key in ((plain, "plain"), (fused, "fused")):
            for kv in kvs[key]:
                kv.at = at.clone() if torch.is_tensor(at) else at
            positions = kvs[key][0].positions(x.shape[1])
            keys = torch.arange(capacity if torch.is_tensor(at) else at + x.shape[1], device="cuda")
            mask = (keys[None, None, :] <= positions[:, :, None])[:, None]
            outs.append(model(x, positions, mask, kvs[key]))
        return outs

    steps = ([(30, 0)] + [(1, torch.full((rows,), 30 + i, device="cuda") - torch.arange(rows, device="cuda") % 7)
                          for i in range(4)]) if which == "talker" else [(2, 0)] + [(1, i) for i in range(2, 16)]
    worst, largest = 1.0, 0.0
    for tokens, at in steps:
        x = torch.randn(rows, tokens, cfg.hidden_size, device="cuda", generator=g)
        ref, got = both(x, at)
        # per row, so that one row attending to the wrong keys cannot hide among 63 good ones
        worst = min([worst] + [_cosine(got[r], ref[r]) for r in range(rows)])
        largest = max(largest, (got.float() - ref.float()).abs().max().item())
    print(f"{which} {dtype} {rows} rows: fused vs torch, worst row cosine {worst:.7f}, largest difference {largest:.5f}")
    assert worst >= 0.99999


@pytest.mark.parametrize("channels, dilation, frames", [(96, 9, 7680), (768, 1, 128)])
def test_time_major_conv_kernel_follows_torch_at_vocoder_shapes(channels, dilation, frames):
    """tts_kernels.conv compiled for the GPU at the vocoder's first and last block widths (64 rows
    x 4 frames' samples): with fp32 inputs and without TF32 it is the fp32 convolution, with TF32
    the exact convolution of its inputs and weights rounded to the nearest TF32 value (not truncated);
    with fp16 inputs and weights (what the engine runs) within fp16's rounding. The SnakeBeta
    epilogue (hardware sine after range reduction) follows the torch module."""
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    from codec_bench import round_tf32
    from tts_cli.model.codec import CausalConv1d, SnakeBeta
    from tts_kernels.conv import causal_conv
    g = torch.Generator("cuda").manual_seed(0)
    conv = CausalConv1d(channels, channels, 7, dilation=dilation).cuda()
    act = SnakeBeta(channels).cuda()
    with torch.no_grad():
        act.alpha.normal_(0, 0.5, generator=g)
        act.beta.normal_(0, 0.5, generator=g)
    src = torch.randn(64, conv.context + frames, channels, device="cuda", generator=g)
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        for tf32 in (False, True):
            with exact_fp32_math(), torch.no_grad():
                expected = conv.conv(src.transpose(1, 2)).transpose(1, 2)
                snaked = act(expected.transpose(1, 2)).transpose(1, 2)
            torch.backends.cudnn.allow_tf32 = tf32
            out, snake_out = torch.empty(expected.shape, device="cuda"), torch.empty(expected.shape, device="cuda")
            causal_conv(src, conv.tap_matrix(), conv.conv.bias, frames, dilation, out=out,
                        snake=act.kernel_factors(channels), snake_out=snake_out)
            error = ((out - expected).norm() / expected.norm()).item()
            print(f"conv C={channels} d={dilation} tf32={tf32}: relative error {error:.2e}")
            assert error < (2e-3 if tf32 else 1e-5)
            if tf32:
                with exact_fp32_math(), torch.no_grad():
                    rounded = F.conv1d(round_tf32(src).transpose(1, 2), round_tf32(conv.conv.weight),
                                       conv.conv.bias, dilation=dilation).transpose(1, 2)
                error = ((out - rounded).norm() / rounded.norm()).item()
                print(f"  against the exact product of TF32-rounded operands: relative error {error:.2e}")
                # the tensor cores' fp32 sums are not IEEE's: 1.3e-5 over K = 7 x 768 (H200, 2026-12-04);
                # operands truncated to TF32 instead of rounded were ~3e-4 from the exact product
                assert error < 5e-5
            if not tf32:   # the hardware sine after range reduction: ~1e-6 absolute, times 1 / beta
                snake_error = ((snake_out - snaked).norm() / snaked.norm()).item()
                largest = (snake_out - snaked).abs().max().item()
                print(f"  SnakeBeta epilogue: relative error {snake_error:.2e}, largest difference {largest:.1e}")
                assert snake_error < 1e-5 and largest < 2e-4
        out16, snake16 = torch.empty(expected.shape, device="cuda"), torch.empty(expected.shape, device="cuda").half()
        causal_conv(src.half(), conv.tap_matrix().half(), conv.conv.bias, frames, dilation, out=out16,
                    snake=act.kernel_factors(channels), snake_out=snake16)
        error = ((out16 - expected).norm() / expected.norm()).item()
        snake_error = ((snake16.float() - snaked).norm() / snaked.norm()).item()
        print(f"conv C={channels} d={dilation} fp16: relative error {error:.2e}, of the SnakeBeta {snake_error:.2e}")
        assert error < 2e-3 and snake_error < 2e-3 and torch.isfinite(snake16).all()
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="the TMA convolution is for Hopper (sm_90)")
@pytest.mark.parametrize("c_in, n_out, taps, dilation, frames, residual, tile", [
    (96, 96, 7, 3, 7680, False, None),        # the last block's dilated convolutions
    (96, 96, 7, 3, 7680, False, (128, 128, 32, 8, 4)),   # 96 columns padded to 128, or split 64 + 32
    (96, 96, 7, 3, 7680, False, (128, 96, 32, 8, 4)),
    (192, 192, 7, 9, 2560, True, None),
    (192, 192, 7, 9, 2560, True, (128, 192, 32, 8, 3)),  # 128 + 64
    (1024, 1536, 7, 1, 4, False, None),       # the first convolution: 4 frames, tiles past a row's end
    (768, 1920, 2, 1, 128, False, None),      # a transposed convolution as two taps (N = stride x C_out)
])
def test_tma_conv_kernel_gives_the_triton_kernels_outputs(monkeypatch, c_in, n_out, taps, dilation, frames, residual,
                                                          tile):
    """tts_kernels.conv_tma (at its tile, or `tile`) against conv.py's kernel on the same fp16 inputs
    and weights (64 rows): the same sums over the taps and channel chunks (in the same order where
    the two BLOCK_K agree), the same epilogue (bias, residual, output, SnakeBeta). Rows of the batch
    after the first hold other values, so a tile that reads another row's frames would show."""
    import tts_kernels.conv as conv
    import tts_kernels.conv_tma as conv_tma
    if tile is not None:
        monkeypatch.setattr(conv_tma, "tiles", lambda *shape: tile)
    g = torch.Generator("cuda").manual_seed(0)
    context = (taps - 1) * dilation
    src = torch.randn(64, context + frames, c_in, device="cuda", generator=g).half()
    weight = (torch.randn(taps * c_in, n_out, device="cuda", generator=g) / (taps * c_in) ** 0.5).half()
    bias = torch.randn(n_out, device="cuda", generator=g)
    # a residual unit's 1x1 convolution reads and writes the residual stream in fp16 (the engine's)
    res = torch.randn(64, frames, n_out, device="cuda", generator=g).half() if residual else None
    out_dtype = torch.float16 if residual else torch.float32
    snake = conv.snake_factors(torch.randn(n_out, device="cuda", generator=g) * 0.5,
                               torch.randn(n_out, device="cuda", generator=g) * 0.5, 1e-9, n_out)
    results = {}
    for tma in (False, True):
        monkeypatch.setattr(conv, "takes_tma", lambda *args, tma=tma: tma)
        out = torch.full((64, frames, n_out), float("nan"), device="cuda", dtype=out_dtype)
        snake_out = torch.full((64, frames, n_out), float("nan"), device="cuda").half()
        conv.causal_conv(src, weight, bias, frames, dilation, residual=res, out=out, snake=snake, snake_out=snake_out)
        results[tma] = out, snake_out
    (out, snake_out), (out_tma, snake_tma) = results[False], results[True]
    assert torch.isfinite(out_tma).all() and torch.isfinite(snake_tma).all()
    largest = (out_tma.float() - out.float()).abs().max().item()
    snake_largest = (snake_tma.float() - snake_out.float()).abs().max().item()
    print(f"C_in {c_in} N {n_out} taps {taps}: largest difference {largest:.2e} (of {out.abs().max().item():.1f}), "
          f"SnakeBeta {snake_largest:.2e}; identical: {torch.equal(out_tma, out) and torch.equal(snake_tma, snake_out)}")
    half_apart = dict(rtol=2 ** -10, atol=1e-3)   # fp16 outputs: at most a rounding apart
    assert torch.allclose(out_tma.float(), out.float(), **half_apart) if out.dtype == torch.float16 \
        else largest <= 1e-5 * out.abs().max().item()
    assert torch.allclose(snake_tma.float(), snake_out.float(), **half_apart)


@pytest.mark.parametrize("codec_window", [2, 4])
def test_graphed_codec_window_gives_the_audio_of_window_1(codec_window, exact_fp32):
    """The codec every K steps over K frames (window column index advanced inside the captured
    depth graph) against K = 1, both graphed, fp32 without TF32: 6 requests through 4 slots."""
    synth = Synthesizer.from_pretrained(TINY, device="cuda", dtype=torch.float32)
    sampling = synth.ckpt.sampling
    frames = [12, 30, 7, 20, 27, 11]
    embeds = [prompt_embeddings(synth.model.talker, synth.prompt(Request(id=str(i), text=t, speaker="vivian")))
              for i, t in enumerate(TEXTS)]
    requests = [EngineRequest(key=i, prompt_embeds=e, seed=7 + i, max_frames=f, min_new_tokens=f + 1)
                for i, (e, f) in enumerate(zip(embeds, frames))]

    def run(window):
        engine = Engine(synth.model, synth.codec, rows=4, context=128, talker_defaults=talker_settings(sampling),
                        cp_defaults=code_predictor_settings(sampling), use_graphs=True, codec_window=window,
                        codec_precision="fp32")
        assert engine.step.graphs
        return engine.run(requests)

    per_frame, windowed = run(1), run(codec_window)
    for i, (w, f) in enumerate(zip(windowed, per_frame)):
        assert np.array_equal(w.codes, f.codes), f"request {i}"
        assert w.pcm.shape == f.pcm.shape, f"request {i}"
        assert np.linalg.norm(w.pcm - f.pcm) / np.linalg.norm(f.pcm) < 1e-5, f"request {i}"


def _assert_row_bit_identical_whatever_its_batch_mates_and_slot(checkpoint: Path, requests: list[Request]):
    """The engine's defaults (fp16 weights, CUDA graphs, fused kernels): the seeded requests[0]
    among the others, in another slot and another prefill tile, gives the same codes and the same
    PCM, bit for bit."""
    synth = Synthesizer.from_pretrained(checkpoint, device="cuda")
    sampling = synth.ckpt.sampling
    rows = [synth.row_input(r, 24) for r in requests]

    def run(order):
        engine = Engine(synth.model, synth.codec, rows=16, context=192, talker_defaults=talker_settings(sampling),
                        cp_defaults=code_predictor_settings(sampling),
                        trailing_text=any(row.trailing_text is not None for row in rows))
        queue = [EngineRequest(key=i, prompt_embeds=rows[i].prompt_embeds, seed=100 + i, max_frames=24,
                               min_new_tokens=25, trailing_text=rows[i].trailing_text,
                               codec_prime=icl_codes(requests[i].reference)) for i in order]
        return {r.key: r for r in engine.run(queue)}

    alone = run([0])
    first = run([0, 1, 2, 3])
    later = run([4, 5, 1, 2, 3, 0])      # request 0 in slot 5, prefilled with request 3
    for other in (first, later):
        assert np.array_equal(other[0].codes, alone[0].codes)
        assert np.array_equal(other[0].pcm, alone[0].pcm)


def test_seeded_row_is_bit_identical_whatever_its_batch_mates_and_slot():
    _assert_row_bit_identical_whatever_its_batch_mates_and_slot(
        TINY, [Request(id=str(i), text=t, speaker="vivian") for i, t in enumerate(TEXTS)])


def test_seeded_clone_row_is_bit_identical_whatever_its_batch_mates_and_slot():
    """An ICL row of the streaming text mode (trailing text, primed codec state) among other Base rows."""
    requests = clone_requests(Synthesizer.from_pretrained(TINY_BASE).cfg, long_frames=70)
    assert requests[0].reference.codes is not None and requests[0].non_streaming_mode is None
    _assert_row_bit_identical_whatever_its_batch_mates_and_slot(TINY_BASE, requests)


def test_cloned_voices_prefixes_give_the_numbers_of_whole_prompts_bit_for_bit():
    """The engine's defaults on the GPU (fp16 weights, CUDA graphs, fused kernels): each of the six
    kinds of Base row twice, with other texts, with voice prefixes (a cloned voice's x-vector's and ICL
    transcript's positions computed once per voice and copied into its slots) and without: the same
    codes and PCM, bit for bit (tests/test_engine_clone.py holds them on CPU within float rounding)."""
    synth = Synthesizer.from_pretrained(TINY_BASE, device="cuda")
    sampling = synth.ckpt.sampling
    kinds = clone_requests(synth.cfg, long_frames=70)
    cloned = [request for i, r in enumerate(kinds)   # each next to its twin: admitted together, they share it
              for request in (r, dataclasses.replace(r, id=f"{r.id}-again", text=kinds[(i + 3) % 6].text, seed=30 + i))]
    rows = [synth.row_input(r, 16) for r in cloned]
    keys = [synth.prompt(r).voice_prefix() for r in cloned]
    assert None not in keys and len(set(keys)) == 6

    def run(voice_prefixes):
        engine = Engine(synth.model, synth.codec, rows=8, context=192, talker_defaults=talker_settings(sampling),
                        cp_defaults=code_predictor_settings(sampling), trailing_text=True,
                        voice_prefixes=voice_prefixes)
        queue = [EngineRequest(key=i, prompt_embeds=row.prompt_embeds, seed=100 + i, max_frames=16, min_new_tokens=17,
                               trailing_text=row.trailing_text, codec_prime=icl_codes(r.reference), voice_prefix=key)
                 for i, (r, row, key) in enumerate(zip(cloned, rows, keys))]
        return engine, engine.run(queue)
    _, whole = run(False)
    engine, voiced = run(True)
    assert len(engine.prefill.voices) == 6
    for a, b in zip(voiced, whole):
        assert np.array_equal(a.codes, b.codes), f"request {a.key}"
        assert np.array_equal(a.pcm, b.pcm), f"request {a.key}"


def _random_1_7b_and_prompts():
    """Random fp16 weights at the real 1.7B shapes on the GPU, the bundled model's sampling settings,
    and TEXTS' CustomVoice prompts (vivian) through those weights."""
    model, codec = build_random("1.7b", "cuda", torch.float16)
    synth = Synthesizer.from_pretrained(TINY)   # tokenizer and prompt rules only
    embeds = [prompt_embeddings(model.talker, synth.prompt(Request(id=str(i), text=t, speaker="vivian")))
              for i, t in enumerate(TEXTS)]
    return model, codec, synth.ckpt.sampling, embeds


def test_seeded_row_is_bit_identical_whatever_its_batch_mates_at_256_rows():
    """At the real 1.7B shapes (random fp16 weights), 256 slots (the loop for the code predictor,
    the codec in line, the large-row GEMMs, voice prefixes: every prompt is vivian's): a seeded
    request alone, then in slot 200 of a full engine among 299 others that refill slots as they end,
    gives the same codes and PCM, bit for bit."""
    model, codec, sampling, embeds = _random_1_7b_and_prompts()
    engine = Engine(model, codec, rows=256, context=128, talker_defaults=talker_settings(sampling),
                    cp_defaults=code_predictor_settings(sampling))
    assert engine.voice_prefixes
    voice = Synthesizer.from_pretrained(TINY).prompt(Request(id="v", text=TEXTS[0], speaker="vivian")).voice_prefix()

    def request(key, frames):
        return EngineRequest(key=key, prompt_embeds=embeds[key % len(embeds)], seed=7 + key, max_frames=frames,
                             min_new_tokens=frames + 1, voice_prefix=voice)

    alone = engine.run([request(0, 30)])[0]
    others = [request(key, 6 + (5 * key) % 40) for key in range(1, 300)]
    crowded = {r.key: r for r in engine.run(others[:200] + [request(0, 30)] + others[200:])}[0]
    assert len(alone.codes) == 30
    assert np.array_equal(crowded.codes, alone.codes)
    assert np.array_equal(crowded.pcm, alone.pcm)


@pytest.mark.parametrize("voice", [False, True], ids=["whole", "after-voice-prefix"])
def test_a_prompt_prefills_to_the_same_numbers_in_every_tile_size_at_512_rows(voice):
    """At the real 1.7B shapes (random fp16 weights), 512 slots: the prefill's packed tiles of 256 to
    2048 tokens (tts_cli.engine.prefill_tiles_for; with voice prefixes over what follows the 8
    positions of the voice prefix, copied in first) give a prompt (one of two rounds, one of one) the
    same hidden state, logits and cached keys and values, bit for bit, whatever the tile's size, the
    prompt's place in it, its batch mates and its slot; after a voice prefix, those of the whole
    prompt's prefill (the path without voice prefixes)."""
    model, codec, sampling, embeds = _random_1_7b_and_prompts()
    engine = Engine(model, codec, rows=512, context=128, talker_defaults=talker_settings(sampling),
                    cp_defaults=code_predictor_settings(sampling), voice_prefixes=voice)
    prefill, start = engine.prefill, 8 if voice else 0
    assert prefill.sizes == (2048, 1792, 1536, 1280, 1024, 768, 512, 256)
    kv = engine.state.talker_kv
    sizes = []
    tile = prefill._tile
    prefill._tile = lambda size, inputs: (sizes.append(size), tile(size, inputs))[1]

    def run(prompts, probe_at, slot):
        slots = [(slot + 1 + i) % 512 for i in range(len(prompts))]
        slots[probe_at] = slot
        if voice:
            prefill.voice_prefix("vivian", embeds[0][:start], slots)
        hidden, logits = prefill([p[start:] for p in prompts], slots, [start] * len(prompts))
        length = prompts[probe_at].shape[0]
        return (hidden[probe_at].clone(), logits[probe_at].clone(),
                [torch.cat([layer.k[slot, :, :length], layer.v[slot, :, :length]]).clone() for layer in kv])

    for probe in (torch.cat(embeds[:2]), embeds[4]):
        assert (probe.shape[0] - start > 32) == (probe is not embeds[4])
        alone = run([probe], 0, 0)
        if voice:
            whole = torch.cat([embeds[0][:start], probe[start:]])   # the prompt the voice route ran
            hidden, logits = prefill([whole], [0], [0])
            expected = [hidden[0], logits[0], *(torch.cat([layer.k[0, :, :whole.shape[0]],
                                                           layer.v[0, :, :whole.shape[0]]]) for layer in kv)]
            for a, b in zip([*alone[:2], *alone[2]], expected):
                error = ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
                print(f"after the voice prefix against the whole prompt: {error:.1e} of the largest")
                assert torch.equal(a, b), "after the voice prefix against the whole prompt"
        for n, probe_at, slot in ((9, 8, 300), (23, 5, 17), (51, 50, 511), (64, 0, 64), (70, 66, 129),
                                  (160, 100, 3)):
            others = [embeds[(i * 5) % len(embeds)] for i in range(n - 1)]
            got = run(others[:probe_at] + [probe] + others[probe_at:], probe_at, slot)
            for a, b in zip([*got[:2], *got[2]], [*alone[:2], *alone[2]]):
                assert torch.equal(a, b), f"{n} prompts, the probe's place {probe_at}"
    print("tile sizes run:", sorted(set(sizes)))
    assert len(set(sizes)) >= 5 and {256, 2048} <= set(sizes)


@pytest.mark.parametrize("rows", [1024, 512, 128])
def test_tail_steps_give_every_request_the_codes_and_audio_of_the_full_step(rows):
    """At the real 1.7B shapes (random fp16 weights), 1024, 512 and 128 slots: 1800, 900 and 250
    requests of 6-45 frames with the engine's tail steps (512 at 1024 slots, 256, 128 then 64 rows; 64),
    their projections on cuBLAS padded to 256 GEMM rows (128: the full step's) and the code
    predictor's loop, and without: the same codes and PCM for every request, bit for bit. At 1024
    slots the full step runs the codec's GEMMs in two blocks of 512 rows and a tail of 512 as they
    are (tts_cli.engine.CODEC_GEMM_ROWS)."""
    model, codec, sampling, embeds = _random_1_7b_and_prompts()
    requests = [EngineRequest(key=key, prompt_embeds=embeds[key % len(embeds)], seed=11 + key,
                              max_frames=6 + (7 * key) % 40, min_new_tokens=47)
                for key in range({1024: 1800, 512: 900, 128: 250}[rows])]

    def run(tail_rows):
        engine = Engine(model, codec, rows=rows, context=128, talker_defaults=talker_settings(sampling),
                        cp_defaults=code_predictor_settings(sampling), tail_rows=tail_rows)
        results = engine.run(requests)
        steps = dict(engine.stats.steps_by_rows)
        del engine
        return results, steps
    full, full_steps = run(())
    tails, tail_steps = run(None)
    assert set(full_steps) == {rows} and set(tail_steps) == {n for n in (1024, 512, 256, 128, 64) if n <= rows}
    assert sum(tail_steps.values()) == full_steps[rows]
    for a, b in zip(tails, full):
        assert len(a.codes) == 6 + (7 * a.key) % 40
        assert np.array_equal(a.codes, b.codes), f"request {a.key}"
        assert np.array_equal(a.pcm, b.pcm), f"request {a.key}"


@pytest.mark.parametrize("rows", [64, 512])
def test_attention_with_keys_loaded_ahead_gives_the_same_output_and_caches(rows):
    """The talker's attention in a decode step (one token per row, fp16 caches of 256 positions at
    the 1.7B shapes, rows at positions 0-255) with its key steps loaded ahead (2 stages, what
    attention_stages gives these rows, and 3) and without: the same output and caches, bit for bit."""
    from tts_kernels.attention import attention_stages, cached_attention
    assert attention_stages(rows, 1) == 2
    heads, kv_heads, head_dim, context = 16, 8, 128, 256
    g = torch.Generator(device="cuda").manual_seed(rows)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, device="cuda", generator=g)
    cache = torch.randn(2, rows, kv_heads, context, head_dim, device="cuda", generator=g).half()
    angles = torch.arange(context, device="cuda")[:, None] * torch.rand(head_dim, device="cuda", generator=g)
    norm = torch.rand(head_dim, device="cuda", generator=g) + 0.5
    start = torch.randint(0, context, (rows,), device="cuda", generator=g)
    start[:2] = torch.tensor([0, context - 1])

    def attend(stages):
        k, v = cache[0].clone(), cache[1].clone()
        out = cached_attention(qkv, heads, kv_heads, head_dim, norm, norm, 1e-6, angles.cos(), angles.sin(), k, v,
                               torch.arange(rows, device="cuda"), start, 1, head_dim ** -0.5, torch.float16,
                               stages=stages)
        return out, k, v

    plain = attend(0)
    for stages in (2, 3):
        for got, expected in zip(attend(stages), plain):
            assert torch.equal(got, expected), f"{stages} stages"


def _encode_reference(device: str, seconds: float = 5.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The x-vector and codes the released encoder shapes (random weights, seed 0) make of a 5 s
    clip (two tones and noise, seeded) on `device`, in exact fp32: (x-vector [D], codes [frames, 16])
    on the CPU."""
    from tts_cli.engine.random_model import random_encoders
    speaker, codec = random_encoders("1.7b", "cpu")
    speaker, codec = speaker.to(device), codec.to(device)
    t = torch.arange(int(24000 * seconds)) / 24000
    clip = 0.3 * torch.sin(2 * torch.pi * 220 * t) + 0.2 * torch.sin(2 * torch.pi * 347 * t) \
        + 0.05 * torch.randn(t.shape[0], generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return speaker.embed(clip.to(device)).float().cpu(), codec.encode(clip.to(device)).cpu()


def test_reference_encoders_through_cudnn_give_the_cpu_encoding():
    """A cloned voice's reference is encoded on the GPU through cuDNN's convolutions (the speaker
    encoder's and the codec encoder's), which are wrong at some shapes (docs/numerics.md: the
    codec's pre-convolution at 48-128 rows of 100 frames). In exact fp32 with cuDNN on, one 5 s
    clip at the released shapes gives the CPU's x-vector and codes."""
    with exact_fp32_math():
        torch.backends.cudnn.enabled = True   # as the encoders run (the context restores it)
        gpu_vector, gpu_codes = _encode_reference("cuda")
    cpu_vector, cpu_codes = _encode_reference("cpu")
    cosine = _cosine(gpu_vector, cpu_vector)
    same = (gpu_codes == cpu_codes).float().mean().item()
    print(f"reference encoders, cuDNN against the CPU: x-vector cosine {cosine:.7f}, codes equal {same:.4f}")
    assert gpu_codes.shape == cpu_codes.shape == (63, 16)
    assert cosine > 0.99999 and same >= 0.99


@pytest.mark.parametrize("rows", ROWS_CHECKED)
def test_codec_row_is_bit_identical_in_any_slot(rows):
    """The engine's codec (fused, fp16 vocoder, TF32 as tts synth sets it, its GEMMs in blocks of at
    most CODEC_GEMM_ROWS rows as the engine runs them) at the real shapes and the slot counts --rows
    auto chooses from, and 1024: row 0's codes copied into two other slots of a batch of random codes
    give the same PCM there, bit for bit, over three streamed windows. With cuDNN's pre-convolution
    this failed at 256 rows (2026-12-03); at 1024 rows without the blocks, one GEMM (2026-12-04)."""
    model, codec = build_random("1.7b", "cuda", torch.float16)
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    try:
        codec.decoder.half = True
        use_fused_kernels(model, codec, torch.device("cuda"), True)
        g = torch.Generator(device="cuda").manual_seed(rows)
        state, copies = codec.new_state(rows), [rows // 2 + 1, rows - 1]
        for _ in range(3):
            codes = torch.randint(0, codec.config.codebook_size, (rows, 4, 16), device="cuda", generator=g)
            codes[copies] = codes[0].clone()
            with PaddedGEMMs(scale=codec_gemm_scale(rows, rows)):
                pcm = codec.decode_step(codes, state)
            for slot in copies:
                assert torch.equal(pcm[slot], pcm[0]), f"slot {slot} of {rows}"
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def _projection_weights(root: torch.nn.Module) -> list[torch.Tensor]:
    """Each distinct projection weight under root as the fused path multiplies it (merged q/k/v and
    gate/up included; the transposed convolutions' block matrices)."""
    found = {}
    for module in root.modules():
        merged = [getattr(module, name, None) for name in ("qkv", "gate_up")]
        weights = [m[0] for m in merged if isinstance(m, tuple)]
        weights += [module.weight] if isinstance(module, torch.nn.Linear) else []
        weights += [module.block_weight.t()] if hasattr(module, "block_weight") else []
        for weight in weights:
            found.setdefault((tuple(weight.shape), weight.dtype), weight)
    return list(found.values())


@pytest.mark.parametrize("rows", ROWS_CHECKED)
def test_projections_give_a_row_the_same_numbers_in_any_position(rows):
    """What batch-mate independence rests on beside fixed shapes (docs/design.md): at every --rows auto
    choice and 1024, each projection of the talker and code predictor (fp16 weights, through
    tts_kernels.linear as the engine calls them) at a decode step's rows and a prefill tile's
    (rows / 8 prompts x 32 positions, at most MAX_PREFILL_GEMM_ROWS), and each of the codec's (fp32,
    TF32) at 4, 8 and 16 frames per row of at most CODEC_GEMM_ROWS rows, gives an input row copied to
    other positions the same output there, bit for bit. (cuDNN's pre-convolution did not, at 256
    rows: test_codec_row_is_bit_identical_in_any_slot.)"""
    from tts_kernels.linear import project, split
    model, codec = build_random("1.7b", "cuda", torch.float16)
    use_fused_kernels(model, codec, torch.device("cuda"), True)
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    g = torch.Generator(device="cuda").manual_seed(rows)
    cases = [(w, m, lambda x, w=w: project(split(x, w.dtype), w)) for w in _projection_weights(model)
             for m in (rows, min(4 * rows, MAX_PREFILL_GEMM_ROWS))]
    # the vocoder's convolutions are tts_kernels.conv's, not cuBLAS's
    codec_weights = _projection_weights(codec.pre_transformer) + _projection_weights(codec.upsample)
    codec_rows = min(rows, CODEC_GEMM_ROWS)
    cases += [(w, m, lambda x, w=w: x @ w.t()) for w in codec_weights
              for m in (4 * codec_rows, 8 * codec_rows, 16 * codec_rows)]
    try:
        for weight, m, multiply in cases:
            x = torch.randn(m, weight.shape[1], device="cuda", generator=g)
            copies = [1, m // 2 + 3, m - 1]
            x[copies] = x[0].clone()
            out = multiply(x)
            for p in copies:
                assert torch.equal(out[p], out[0]), f"weight {list(weight.shape)} {weight.dtype}, M={m}: row {p}"
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved


def test_codec_on_its_own_stream_gives_the_audio_of_the_codec_in_line():
    """The codec on a stream of its own, beside the next window's steps (the default on CUDA),
    against everything in order on one stream, at the real 1.7B shapes (random fp16 weights, so
    that the codec runs long enough to overlap the steps): 96 requests of 6-40 frames through 64
    slots (refills reset a slot's codec state on the codec's stream), the same codes and PCM, bit
    for bit."""
    model, codec, sampling, embeds = _random_1_7b_and_prompts()
    frames = [6 + (7 * i) % 35 for i in range(96)]
    requests = [EngineRequest(key=i, prompt_embeds=embeds[i % len(embeds)], seed=i, max_frames=f,
                              min_new_tokens=f + 1) for i, f in enumerate(frames)]

    def run(codec_stream):
        engine = Engine(model, codec, rows=64, context=128, talker_defaults=talker_settings(sampling),
                        cp_defaults=code_predictor_settings(sampling), codec_stream=codec_stream)
        assert (engine.codec_stream is not None) == codec_stream
        return engine.run(requests)

    in_line, beside = run(False), run(True)
    assert [len(r.codes) for r in beside] == frames
    for i, (a, b) in enumerate(zip(beside, in_line)):
        assert np.array_equal(a.codes, b.codes) and np.array_equal(a.pcm, b.pcm), f"request {i}"


def test_one_row_engine_gives_the_same_audio_with_and_without_dependent_launches(monkeypatch):
    """At one row the talker's and code predictor's kernels launch with programmatic dependent
    launch on Hopper (tts_kernels.launch): the same requests give the same codes and PCM, bit for
    bit, with it and without it (the path of other GPUs)."""
    import tts_kernels.launch as launch
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("programmatic dependent launch needs sm_90 or later")
    synth = Synthesizer.from_pretrained(TINY, device="cuda")
    sampling = synth.ckpt.sampling
    embeds = [prompt_embeddings(synth.model.talker, synth.prompt(Request(id=str(i), text=t, speaker="vivian")))
              for i, t in enumerate(TEXTS[:3])]

    def run():
        engine = Engine(synth.model, synth.codec, rows=1, context=128, talker_defaults=talker_settings(sampling),
                        cp_defaults=code_predictor_settings(sampling))
        return engine.run([EngineRequest(key=i, prompt_embeds=e, seed=30 + i, max_frames=20, min_new_tokens=21)
                           for i, e in enumerate(embeds)])

    assert launch.programmatic(embeds[0])["launch_pdl"]
    with_pdl = run()
    monkeypatch.setattr(launch, "enabled", False)
    without = run()
    for a, b in zip(with_pdl, without):
        assert len(a.codes) == 20
        assert np.array_equal(a.codes, b.codes) and np.array_equal(a.pcm, b.pcm)


def test_engine_loop_never_makes_the_host_wait_for_the_gpu():
    """Admissions, releases and drains only queue work: no CUDA call that waits for the stream (a
    Python value assigned through an index is such a call: a blocking copy), so the host waits
    only on events: the step before's, and at a window boundary the flags of the window's last
    step. 6 requests of different lengths through 4 slots: admissions into freed slots, releases
    of slots nobody takes. Half of them come as a PromptSource, whose vectors the engine builds
    while it waits for the GPU; all have voice prefixes (copied into their slots, the rest prefilled
    in packed tiles)."""
    synth = Synthesizer.from_pretrained(TINY, device="cuda")
    sampling = synth.ckpt.sampling
    frames = [12, 30, 7, 20, 27, 11]
    prompts = [synth.prompt(Request(id=str(i), text=t, speaker="vivian")) for i, t in enumerate(TEXTS)]
    built = []

    def vectors(i):
        built.append(i)
        return prompt_embeddings(synth.model.talker, prompts[i]), None

    def requests():
        return [EngineRequest(key=i, prompt_embeds=None if i % 2 else prompt_embeddings(synth.model.talker, p),
                              source=PromptSource(len(p), False, functools.partial(vectors, i)), seed=i,
                              max_frames=f, min_new_tokens=f + 1, voice_prefix=p.voice_prefix())
                for i, (p, f) in enumerate(zip(prompts, frames))]
    engine = Engine(synth.model, synth.codec, rows=4, context=128, talker_defaults=talker_settings(sampling),
                    cp_defaults=code_predictor_settings(sampling), voice_prefixes=True)
    engine.run(requests())   # the first run captures the prefill's graphs and compiles the kernels
    fresh = requests()
    built.clear()
    torch.cuda.set_sync_debug_mode("error")
    try:
        results = engine.run(fresh)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert [len(r.codes) for r in results] == frames and built == [1, 3, 5]


@pytest.mark.parametrize("checkpoint", [TINY, TINY_BASE], ids=["customvoice", "base"])
def test_building_prompts_never_makes_the_host_wait_for_the_gpu(checkpoint):
    """Every kind of prompt (a named speaker; x-vector and ICL clones; both text modes, so trailing
    text vectors too) only queues GPU work: its ids go over from pinned memory and the special codec
    positions come from the host's list. The vectors are the CPU model's, to fp32 rounding."""
    gpu = Synthesizer.from_pretrained(checkpoint, device="cuda", dtype=torch.float32)
    cpu = Synthesizer.from_pretrained(checkpoint)
    requests = (clone_requests(cpu.cfg, long_frames=40) if checkpoint == TINY_BASE else
                [Request(id=str(i), text=t, speaker="vivian", non_streaming_mode=bool(i % 2))
                 for i, t in enumerate(TEXTS[:4])])
    gpu.row_input(requests[0])   # the first call loads the kernels and the pinned-memory pool
    if checkpoint == TINY_BASE:   # a speaker embedding already on the GPU (tts bench's clone workloads make one there)
        reference = requests[0].reference
        requests.append(dataclasses.replace(requests[0], id="on-gpu", reference=dataclasses.replace(
            reference, speaker_embedding=reference.speaker_embedding.cuda())))
    torch.cuda.set_sync_debug_mode("error")
    try:
        rows = [gpu.row_input(r) for r in requests]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for request, row in zip(requests, rows):
        expected = cpu.row_input(request)
        torch.testing.assert_close(row.prompt_embeds.cpu(), expected.prompt_embeds, rtol=1e-4, atol=1e-5)
        assert (row.trailing_text is None) == (expected.trailing_text is None)
        if row.trailing_text is not None:
            torch.testing.assert_close(row.trailing_text.cpu(), expected.trailing_text, rtol=1e-4, atol=1e-5)


def test_engine_refuses_audio_from_an_fp16_vocoder_overflow():
    """A vocoder value beyond fp16's range (here: a bias made huge) fails the run with an error that
    names the fp32 switch; with that switch the same run completes."""
    from tts_cli.errors import CodecRangeError
    synth = Synthesizer.from_pretrained(TINY, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        synth.codec.decoder[0].conv.bias.add_(1e5)
    requests = [Request(id=str(i), text=t, speaker="vivian", seed=i) for i, t in enumerate(TEXTS[:2])]
    with pytest.raises(CodecRangeError, match="--codec-precision fp32"):
        synth.synthesize(requests, max_frames=8, min_new_tokens=9)
    synth.codec_precision = "fp32"   # the next call builds its engine with it
    assert len(synth.synthesize(requests, max_frames=8, min_new_tokens=9)) == 2


def test_engine_refuses_audio_from_an_fp16_talker_overflow():
    """An activation beyond fp16's range in the talker (here: a norm weight made huge) becomes NaN
    logits: with fp16 weights the run fails with an error that names the bf16 switch; with bf16
    weights (the switch) the same run completes."""
    from tts_cli.errors import NonFiniteError
    requests = [Request(id=str(i), text=t, speaker="vivian", seed=i) for i, t in enumerate(TEXTS[:2])]
    for dtype in (torch.float16, torch.bfloat16):
        synth = Synthesizer.from_pretrained(TINY, device="cuda", dtype=dtype)
        with torch.no_grad():
            synth.model.talker.decoder.layers[1].post_attention_layernorm.weight.mul_(1e6)
        if dtype == torch.float16:
            with pytest.raises(NonFiniteError, match="--talker-precision bf16"):
                synth.synthesize(requests, max_frames=8, min_new_tokens=9)
        else:
            assert len(synth.synthesize(requests, max_frames=8, min_new_tokens=9)) == 2


def test_engine_refuses_audio_from_an_fp16_code_predictor_overflow():
    """As above, in the code predictor (whose logits the persistent depth kernel draws from, by
    default over fp16 weights on the H200): the run fails with the error that names the bf16 switch."""
    from tts_cli.errors import NonFiniteError
    requests = [Request(id=str(i), text=t, speaker="vivian", seed=i) for i, t in enumerate(TEXTS[:2])]
    synth = Synthesizer.from_pretrained(TINY, device="cuda", dtype=torch.float16)
    with torch.no_grad():
        synth.model.code_predictor.decoder.layers[1].post_attention_layernorm.weight.mul_(1e6)
    with pytest.raises(NonFiniteError, match="--talker-precision bf16"):
        synth.synthesize(requests, max_frames=8, min_new_tokens=9)


@pytest.mark.parametrize("kind", ["customvoice", "clone", "design"])
def test_same_requests_twice_give_bit_identical_audio(kind):
    checkpoint = {"customvoice": TINY, "clone": TINY_BASE, "design": TINY_VOICE_DESIGN}[kind]
    synth = Synthesizer.from_pretrained(checkpoint, device="cuda")
    requests = {"customvoice": lambda: [Request(id=str(i), text=t, speaker="vivian", seed=i)
                                        for i, t in enumerate(TEXTS)],
                "clone": lambda: clone_requests(synth.cfg, long_frames=70), "design": design_requests}[kind]()
    first = synth.synthesize(requests, max_frames=20, min_new_tokens=21)
    second = synth.synthesize(requests, max_frames=20, min_new_tokens=21)
    for a, b in zip(first, second):
        assert torch.equal(a.codes, b.codes) and np.array_equal(a.audio, b.audio)


def test_sampler_kernel_draws_what_the_torch_sampler_draws_at_real_vocab_sizes():
    from tts_cli.model.sampler import RowSampling, SamplerSettings, choose
    from tts_kernels.sampler import sample_rows
    g = torch.Generator("cuda").manual_seed(0)
    rows = 64
    settings = [SamplerSettings(do_sample=i % 9 != 0, temperature=[0.9, 0.7, 1.3][i % 3],
                                top_k=[50, 0, 1, 3, 5000, 7][i % 6], top_p=1.0) for i in range(rows)]
    sampling = RowSampling.stack(settings, "cuda")
    seeds = torch.randint(0, 2**62, (rows,), device="cuda", generator=g)
    frames = torch.randint(0, 500, (rows,), device="cuda", generator=g)
    differ = 0
    for vocab in (2048, 3072):
        for group in range(16):
            logits = torch.randn(rows, vocab, device="cuda", generator=g) * 4
            logits[:8] = logits[:8].bfloat16().float()                  # bf16-like values: many ties
            logits[8:12, vocab - 1024:] = float("-inf")                  # suppressed ids
            expected = choose(logits, sampling, seeds, frames, group, top_p=False)
            got = sample_rows(logits, sampling.temperature, sampling.top_k, sampling.do_sample, seeds, frames, group)
            differ += int((got != expected).sum())
    assert differ == 0, f"{differ} of {2 * 16 * rows} draws differ"


def test_talker_draw_with_its_processors_in_the_sampler_kernel_is_the_torch_draw():
    """The talker's processors (repetition penalty, EOS blocked below min_new_tokens, suppressed
    ids) in the sampler kernel, compiled (libdevice's division), against TalkerLogitsProcessor then
    choose, at the talker's 3072 ids and 64 rows, over 16 frames."""
    from tts_cli.model.sampler import RowSampling, SamplerSettings, TalkerLogitsProcessor, choose
    from tts_kernels.sampler import TalkerProcessing, sample_rows
    g = torch.Generator("cuda").manual_seed(0)
    rows, vocab, eos = 64, 3072, 2150
    settings = [SamplerSettings(do_sample=i % 9 != 0, temperature=[0.9, 0.7, 1.3][i % 3], top_k=[50, 0, 1, 3][i % 4],
                                top_p=1.0, repetition_penalty=[1.05, 1.0, 1.3][i % 3]) for i in range(rows)]
    sampling = RowSampling.stack(settings, "cuda")
    process = TalkerLogitsProcessor(vocab, eos, "cuda")
    seeds = torch.randint(0, 2**62, (rows,), device="cuda", generator=g)
    min_new_tokens = torch.randint(0, 4, (rows,), device="cuda", generator=g)
    seen = torch.zeros(rows, vocab, dtype=torch.bool, device="cuda")
    differ = eos_drawn = 0
    for frame in range(16):
        frames = torch.full((rows,), frame, device="cuda")
        logits = torch.randn(rows, vocab, device="cuda", generator=g) * 4
        logits[:, eos] += 12   # EOS often the best, so that its block matters
        expected = choose(process(logits, seen, frames + 1 < min_new_tokens, sampling.repetition_penalty), sampling,
                          seeds, frames + 1, 0, top_p=False)
        got = sample_rows(logits, sampling.temperature, sampling.top_k, sampling.do_sample, seeds, frames, 0,
                          frame_offset=1, talker=TalkerProcessing(seen, sampling.repetition_penalty, min_new_tokens,
                                                                  process.suppressed, eos))
        differ += int((got != expected).sum())
        eos_drawn += int((expected == eos).sum())
        seen.scatter_(1, expected[:, None], True)
    assert differ == 0, f"{differ} of {16 * rows} draws differ"
    assert 0 < eos_drawn < 16 * rows


@pytest.mark.parametrize("size, rows, dtype", [("1.7b", 13, torch.float16), ("1.7b", 29, torch.float16), ("1.7b", 64, torch.float16),
                                               ("1.7b", 64, torch.bfloat16), ("0.6b", 64, torch.float16)])
def test_depth_kernel_follows_the_loop_at_real_shapes(size, rows, dtype):
    """The persistent depth kernel against the engine's code-predictor loop (random 1.7B and 0.6B
    shapes, fp16 and bf16 weights; the 0.6B code predictor has no input projection): with the loop's codes given, logits within 1% of the largest logit and the draws from
    both agree but for near-ties; sampled, every in-kernel draw is the sampler kernel's draw from the kernel's
    logits; two runs are bit-identical (tools/depth_bench.py also times it)."""
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    import depth_bench
    model, _ = build_random(size, "cuda", dtype)
    use_kernels(model, True)
    result = depth_bench.compare(model.code_predictor, model.talker, rows)
    print(result)
    assert result["logit_error_of_max"] <= 0.01
    assert result["greedy_agreement"] >= 0.98   # near-ties flip (sampled draws: 0.9875-1.0); a broken frame: ~0.14
    assert result["kernel_draws_equal_sampler"] and result["two_runs_identical"]
