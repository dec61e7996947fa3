"""Compile a Triton kernel launch for the H200 (sm_90) on a machine without a GPU, and say what the
compiler made of it: registers, stack and shared memory per CTA (cuobjdump), its SASS instructions
(with the hardware-function and local-memory ones), and counts of the PTX instructions that matter
(wgmma, cp.async, global and shared loads and stores, barriers).

The launch is captured from the real call on CPU tensors (its arguments intercepted before Triton
would need a driver), then compiled with the specialization a launch would get (16-byte aligned
pointers and integers divisible by 16), so kernel changes can be checked for spills or lost
tensor-core or async-copy use before spending device time.

    python tools/sm90_compile.py depth|attention|sampler|conv|conv-1x1|conv-tma|window
                                 |gemv|gemv-silu|gemm-rows|gemm-rows-silu
                                 [--rows 64] [--tokens 1] [--capacity 256]
                                 [--warps N] [--stages N] [--channels 96] [--shape 4096x2048]
                                 [--talker-precision fp16|bf16] [--maxnreg N] [--ptx OUT.ptx]

depth, attention: over the weights `--talker-precision` gives (fp16: fp16 cache and GEMM inputs;
bf16: bf16 cache, hi/lo parts); attention: the decoder layers' attention kernel at the 1.7B
talker's shapes, `--tokens` new tokens per row against `--capacity` cached positions (the code predictor's
16 and from 64 rows: its one-token kernel); sampler: one draw per row over the code predictor's 2048 ids;
attention `--stages N`: the general kernel's key steps loaded N - 1 ahead (cached_attention's stages;
default: the engine's, attention_stages);
conv: the vocoder's dilated convolution with its SnakeBeta epilogue (tts_kernels.conv), `--channels`
wide (96 .. 768), over 4 frames' samples per row, fp16 as the engine runs it; conv-1x1: a residual
unit's 1x1 convolution (the residual added, the output and its SnakeBeta written); conv-tma: the same
convolution as the Hopper kernel in Gluon (tts_kernels.conv_tma); gemv: the one-row
projection over an fp16 weight of `--shape`; gemv-silu: the one-row gate/up projection that does
the SiLU * up (`--shape` 2I x K); gemm-rows, gemm-rows-silu: the same at `--rows` rows (2-64 in the
engine); --maxnreg caps the registers per thread, as the launch option of that name does
(the compiler spills the rest). Kernels with programmatic dependent launch
(tts_kernels.launch) compile with it on, as the H200 runs them.
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from step_profile import parse_settings
from tts_cli.engine import DEFAULT_TALKER_PRECISION, TALKER_PRECISIONS
from tts_cli.synthesizer import weights_dtype

# The device's Triton (the H200 of docs/bench.md). Another version may compile the same kernel
# differently: the 64-row depth kernel takes 255 registers and 224 KB of shared memory under 3.9,
# 239 and 128 KB under 3.6. For the device's numbers: `pip install --target DIR triton==3.6.0`
# and put DIR first on PYTHONPATH.
DEVICE_TRITON = "3.6"
POINTER_TYPES = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", torch.int64: "*i64",
                 torch.int32: "*i32", torch.bool: "*i1", torch.uint8: "*u8", torch.int8: "*i8"}
INSTRUCTIONS = r"\b(wgmma\.mma_async|wgmma\.wait_group|mma\.sync|cp\.async\.bulk[\w.]*|cp\.async\.c[ag]|" \
               r"cp\.async\.wait_group|ld\.global[\w.]*|st\.global[\w.]*|ld\.shared[\w.]*|st\.shared[\w.]*|" \
               r"bar\.sync|atom[\w.]*|griddepcontrol\.\w+)"


def captured_launch(jit_fn, call) -> tuple[tuple, dict]:
    """The arguments `call()` launches `jit_fn` with (nothing runs)."""
    seen = {}
    original = jit_fn.run
    jit_fn.run = lambda *args, grid, warmup, **kwargs: seen.update(args=args, kwargs=kwargs)
    try:
        call()
    finally:
        jit_fn.run = original
    return seen["args"], seen["kwargs"]


def compile_for_sm90(jit_fn, args: tuple, kwargs: dict):
    kwargs = dict(kwargs)
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages", "maxnreg") if k in kwargs}
    if "launch_pdl" in kwargs:   # captured on CPU, where PDL is off; on the H200 it is on (tts_kernels.launch)
        kwargs.pop("launch_pdl")
        kwargs["PDL"] = options["launch_pdl"] = True
    values = dict(zip(jit_fn.arg_names, args), **kwargs, **options)   # a Gluon kernel has num_warps as an argument
    signature, constexprs, attrs = {}, {}, {}
    for i, (name, param) in enumerate(zip(jit_fn.arg_names, jit_fn.params)):
        value = values[name]
        if param.is_constexpr or (type(value) is int and value == 1):   # Triton specializes 1 too
            signature[name], constexprs[(i,)] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[name] = POINTER_TYPES[value.dtype]
            if value.data_ptr() % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            signature[name] = "i64" if abs(value) >= 2**31 else "i32"
            if value % 16 == 0 and not param.do_not_specialize:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[name] = "fp32"
        elif type(value).__name__ == "TensorDescriptor":   # a Gluon kernel's TMA descriptor
            block = ", ".join(map(str, value.block_shape))
            signature[name] = f"tensordesc<{POINTER_TYPES[value.base.dtype][1:]}[{block}],{value.layout!r}>"
        else:
            raise TypeError(f"argument {name}: {type(value).__name__}")
    if type(jit_fn).__name__ == "GluonJITFunction":
        from triton.experimental.gluon._runtime import GluonASTSource as source_type
        constexprs = {name: values[name] for name, kind in signature.items() if kind == "constexpr"}
    else:
        source_type = ASTSource
    return triton.compile(source_type(jit_fn, signature, constexprs=constexprs, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options=options)


def report(kernel) -> str:
    counts = collections.Counter(re.findall(INSTRUCTIONS, kernel.asm["ptx"]))
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        usage = subprocess.run([tool, "--dump-resource-usage", cubin.name], capture_output=True, text=True).stdout
        sass = subprocess.run([tool, "-sass", cubin.name], capture_output=True, text=True).stdout
    resources = re.search(r"REG:\d+ STACK:\d+ SHARED:\d+ LOCAL:\d+", usage)
    opcodes = collections.Counter(re.findall(r"^\s+/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", sass, re.M))
    lines = [f"resources per thread / CTA: {resources.group(0) if resources else usage.strip()}, "
             f"dynamic shared memory {kernel.metadata.shared} bytes, {kernel.metadata.num_warps} warps",
             f"SASS: {sum(opcodes.values())} instructions (in the code, not as run); MUFU (hardware exp, sine, "
             f"reciprocal) {opcodes['MUFU']}, local memory loads / stores {opcodes['LDL']} / {opcodes['STL']}"]
    lines += [f"  {name:32s} {count}" for name, count in sorted(counts.items())]
    return "\n".join(lines)


def launch_options(kwargs: dict, warps: int | None, stages: int | None) -> dict:
    """The captured launch's keyword arguments, with num_warps / num_stages replaced where given (else
    what the engine's launcher chose)."""
    return dict(kwargs, **({"num_warps": warps} if warps else {}), **({"num_stages": stages} if stages else {}))


def depth_launch(rows: int, warps: int | None, stages: int | None, dtype: torch.dtype, tiles: dict | None = None):
    """The persistent depth kernel's launch at the real 1.7B code-predictor shapes, weights of `dtype`,
    tiles: depth_schedule.Shapes fields to override."""
    import tts_kernels.depth_frame as depth_frame
    from tts_cli.engine.random_model import random_config
    from tts_cli.model.depth import CodePredictor
    from tts_cli.model.transformer import use_kernels
    cp = CodePredictor(random_config("1.7b")).to(dtype).eval()
    use_kernels(cp, True)
    frame = depth_frame.DepthFrame(cp, rows, sync=True, ctas=132, num_warps=warps, num_stages=stages, tiles=tiles)
    hidden = cp.decoder.cfg.hidden_size
    args, kwargs = captured_launch(depth_frame._depth_frame, lambda: frame.run(
        torch.zeros(2, rows, hidden), torch.ones(rows, 1), torch.full((rows,), 50), torch.ones(rows, dtype=torch.bool),
        torch.zeros(rows, dtype=torch.long), torch.zeros(rows, dtype=torch.long)))
    return depth_frame._depth_frame, args, kwargs


def attention_launch(rows: int, tokens: int, capacity: int, warps: int | None, stages: int | None,
                     dtype: torch.dtype):
    import tts_kernels.attention as attention
    from tts_kernels.linear import parts_of
    heads, kv_heads, head_dim = 16, 8, 128
    cache = torch.zeros(rows, kv_heads, capacity, head_dim, dtype=dtype)
    table = torch.zeros(capacity, head_dim)
    one_token = attention.takes_decode_kernel(rows, tokens, capacity)
    kernel = attention._decode_attention if one_token else attention._attention
    args, kwargs = captured_launch(kernel, lambda: attention.cached_attention(
        torch.zeros(parts_of(dtype) * rows * tokens, (heads + 2 * kv_heads) * head_dim), heads, kv_heads, head_dim,
        torch.ones(head_dim), torch.ones(head_dim), 1e-6, table, table, cache, cache.clone(), torch.arange(rows),
        torch.zeros(rows, dtype=torch.long), tokens, head_dim ** -0.5, dtype=dtype,
        **({} if one_token else {"stages": stages})))
    # --stages: the general kernel's key loop (its STAGES), the one-token kernel's num_stages
    return kernel, args, launch_options(kwargs, warps, stages if one_token else None)


PROJECTIONS = ("gemv", "gemv-silu", "gemm-rows", "gemm-rows-silu")


def projection_launch(which: str, n: int, k: int, rows: int, warps: int | None, stages: int | None,
                      tiles: dict | None = None):
    """A decode step's projection over an fp16 weight [n, k]: the one-row GEMV (a talker step at one
    row) or gemm_rows (2-64 rows); the -silu ones are the gate/up projections that do the SiLU * up
    (n = 2 I). The engine's tile (gemm-rows: as partial sums; gemm-rows-silu: swiglu.silu_tile); tiles:
    linear.RowsTile fields to override in it."""
    import dataclasses

    import tts_kernels.linear as linear
    import tts_kernels.swiglu as swiglu
    engine_tile = swiglu.silu_tile(n, k) if which == "gemm-rows-silu" else linear.rows_tile(n, k, partial_sums=True)
    tile = dataclasses.replace(engine_tile, **(tiles or {}))
    kernel, call = {"gemv": (linear._gemv, linear.gemv), "gemv-silu": (swiglu._gemv_silu, swiglu.gemv_silu),
                    "gemm-rows": (linear._gemm_rows, lambda x, w: linear.gemm_rows(x, w, True, tile)),
                    "gemm-rows-silu": (swiglu._gemm_rows_silu, lambda x, w: swiglu.gemm_rows_silu(x, w, tile))}[which]
    rows = 1 if which.startswith("gemv") else rows
    args, kwargs = captured_launch(kernel, lambda: call(
        torch.zeros(rows, k, dtype=torch.float16), torch.zeros(n, k, dtype=torch.float16)))
    return kernel, args, launch_options(kwargs, warps, stages)


def sampler_launch(rows: int, warps: int | None, stages: int | None):
    import tts_kernels.sampler as sampler
    args, kwargs = captured_launch(sampler._sample_rows, lambda: sampler.sample_rows(
        torch.zeros(rows, 2048), torch.ones(rows, 1), torch.full((rows,), 50), torch.ones(rows, dtype=torch.bool),
        torch.zeros(rows, dtype=torch.long), torch.zeros(rows, dtype=torch.long), 3))
    return sampler._sample_rows, args, launch_options(kwargs, warps, stages)


def conv_launch(rows: int, channels: int, warps: int | None, stages: int | None):
    """The engine's fp16 vocoder: fp16 input and weights, fp16 SnakeBeta output."""
    import tts_kernels.conv as conv
    frames = 4 * 1920 * 96 // channels
    weight, bias = torch.zeros(7 * channels, channels, dtype=torch.float16), torch.zeros(channels)
    args, kwargs = captured_launch(conv._causal_conv, lambda: conv.causal_conv(
        torch.zeros(rows, 54 + frames, channels, dtype=torch.float16), weight, bias, frames, 9,
        snake=torch.zeros(2, channels), snake_out=torch.zeros(rows, frames, channels, dtype=torch.float16)))
    return conv._causal_conv, args, launch_options(kwargs, warps, stages)


def conv_1x1_launch(rows: int, channels: int, warps: int | None, stages: int | None):
    """A residual unit's 1x1 convolution as the engine's fp16 vocoder runs it: adds the residual,
    writes the output and the next input's SnakeBeta."""
    import tts_kernels.conv as conv
    frames = 4 * 1920 * 96 // channels
    weight, bias = torch.zeros(channels, channels, dtype=torch.float16), torch.zeros(channels)
    stream = [torch.zeros(rows, frames, channels, dtype=torch.float16) for _ in range(4)]
    args, kwargs = captured_launch(conv._causal_conv, lambda: conv.causal_conv(
        stream[0], weight, bias, frames, residual=stream[1], out=stream[2], snake=torch.zeros(2, channels),
        snake_out=stream[3]))
    return conv._causal_conv, args, launch_options(kwargs, warps, stages)


def conv_tma_launch(rows: int, channels: int, warps: int | None, stages: int | None, tiles: dict[str, int]):
    """The same convolution as Gluon's TMA kernel (tts_kernels.conv_tma) at its tiles (warps, stages
    and `tiles`' block_m, block_n, block_k replaced where given)."""
    import tts_kernels.conv_tma as conv_tma
    frames = 4 * 1920 * 96 // channels
    weight, bias = torch.zeros(7 * channels, channels, dtype=torch.float16), torch.zeros(channels)
    block_m, block_n, block_k, tile_warps, tile_stages = conv_tma.tiles(channels, channels, 7)
    tile = (tiles.get("block_m", block_m), tiles.get("block_n", block_n), tiles.get("block_k", block_k),
            warps or tile_warps, stages or tile_stages)
    snake_out = torch.zeros(rows, frames, channels, dtype=torch.float16)
    args, kwargs = captured_launch(conv_tma._conv_tma, lambda: conv_tma.conv_tma(
        torch.zeros(rows, 54 + frames, channels, dtype=torch.float16), weight, bias, frames, 9, 7,
        (0, 0, 0, 0, snake_out.stride(0), channels), None, None, torch.zeros(2, channels), snake_out, tile))
    return conv_tma._conv_tma, args, kwargs


def window_launch(rows: int, tokens: int, warps: int | None, stages: int | None):
    """The codec transformer's window attention (16 heads of 64, window 72), `tokens` frames per row."""
    import tts_kernels.window_attention as window
    heads, head_dim = 16, 64
    x = torch.zeros(rows, tokens, heads * head_dim)
    rope = torch.zeros(rows, tokens, head_dim)
    kernel = window._window_attention_one_warp if window.takes_one_warp_kernel(rows, tokens) else \
        window._window_attention
    args, kwargs = captured_launch(kernel, lambda: window.window_attention(
        x, x.clone(), x.clone(), rope, rope.clone(), torch.zeros(rows, 2, heads, 71, head_dim),
        torch.zeros(rows, dtype=torch.long), 72))
    return kernel, args, launch_options(kwargs, warps, stages)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("kernel", choices=["depth", "attention", "sampler", "conv", "conv-1x1", "conv-tma", "window",
                                           *PROJECTIONS])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=1)
    parser.add_argument("--capacity", type=int, default=256,
                        help="attention: the cache's positions (256: a talker's; 16: the code predictor's)")
    parser.add_argument("--warps", type=int, help="default: what the engine's launcher takes")
    parser.add_argument("--stages", type=int)
    parser.add_argument("--channels", type=int, default=96)
    parser.add_argument("--shape", default="4096x2048", help="gemv, gemm-rows (and -silu): the weight's N x K")
    parser.add_argument("--talker-precision", default=DEFAULT_TALKER_PRECISION, choices=TALKER_PRECISIONS,
                        help="depth, attention: the weights' dtype, as the engine's --talker-precision")
    parser.add_argument("--tiles", default="", help="depth: depth_schedule.Shapes fields to override, "
                        "'field=value,...', e.g. 'gate_up_block_k=64'; gemm-rows (and -silu): linear.RowsTile's, "
                        "e.g. 'block_n=64,swap=1'; conv-tma: block_m, block_n, block_k, e.g. 'block_n=96'")
    parser.add_argument("--maxnreg", type=int, help="cap the registers per thread (ptxas spills the rest)")
    parser.add_argument("--ptx", help="also write the PTX here")
    args = parser.parse_args()
    dtype = weights_dtype("cuda", args.talker_precision)
    tiles = parse_settings(args.tiles)
    if args.kernel == "depth":
        launch = depth_launch(args.rows, args.warps, args.stages, dtype, tiles)
    elif args.kernel == "attention":
        launch = attention_launch(args.rows, args.tokens, args.capacity, args.warps, args.stages, dtype)
    elif args.kernel == "window":
        launch = window_launch(args.rows, args.tokens, args.warps, args.stages)
    elif args.kernel in PROJECTIONS:
        launch = projection_launch(args.kernel, *(int(v) for v in args.shape.split("x")), args.rows, args.warps,
                                   args.stages, tiles)
    elif args.kernel == "sampler":
        launch = sampler_launch(args.rows, args.warps, args.stages)
    elif args.kernel == "conv-tma":
        launch = conv_tma_launch(args.rows, args.channels, args.warps, args.stages, tiles)
    elif args.kernel == "conv-1x1":
        launch = conv_1x1_launch(args.rows, args.channels, args.warps, args.stages)
    else:
        launch = conv_launch(args.rows, args.channels, args.warps, args.stages)
    if args.maxnreg:
        launch = (*launch[:2], dict(launch[2], maxnreg=args.maxnreg))
    kernel = compile_for_sm90(*launch)
    if not triton.__version__.startswith(DEVICE_TRITON + "."):
        print(f"note: Triton {triton.__version__} here, {DEVICE_TRITON} on the device: its counts can differ "
              "(DEVICE_TRITON in this file)")
    print(report(kernel))
    if args.ptx:
        with open(args.ptx, "w") as f:
            f.write(kernel.asm["ptx"])


if __name__ == "__main__":
    main()
