"""The codec's precision options on a GPU: SNR against the exact fp32 full decode, and time per
streamed call of the engine's shape (rows x K frames), random weights at the real 1.7B codec
shapes (tts_cli.engine.random_model). GPU only; prints one line per option.

    python tools/codec_bench.py [--rows 64] [--window 4]
    python tools/codec_bench.py --profile [--compile]   # the torch modules (fp32 + TF32) vs the
                                                        # engine's kernels (fp16 vocoder): eager,
                                                        # graphed, profile
    python tools/codec_bench.py --emulate               # CPU: mixed precisions' SNR (below)
    python tools/codec_bench.py --convs [--tiles BM,BN,BK,WARPS,STAGES ...] [--only 16,23]
                                                        # each vocoder convolution of one engine
                                                        # call alone (fp16 vocoder), at the tree's
                                                        # tiles and at each --tiles given

--emulate runs anywhere (CPU here): the vocoder's convolutions with their inputs and weights
rounded to TF32 / bf16 / fp16 and optionally their outputs too, or the residual stream (each
residual unit's and transposed convolution's output) rounded, the rest (the transformer, the
upsampling) exact fp32, decoded as streamed windows of --window frames; SNR
against the exact fp32 full decode. What a mixed-precision codec would cost in quality before any
kernel for it is written (speed is not emulated).
"""
from __future__ import annotations

import argparse
import copy
import time

import torch

from tts_cli.engine.graphs import capture
from tts_cli.engine.random_model import build_random
from tts_cli.model.codec import CausalConvTranspose1d, ResidualUnit
from tts_cli.model.transformer import use_kernels


def snr_db(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float(10 * torch.log10(ref.pow(2).sum() / (got.float() - ref).pow(2).sum()))


def streamed(codec, codes: torch.Tensor, window: int, step=None) -> torch.Tensor:
    """codes decoded `window` frames per call by `step` (default: codec.decode_step)."""
    step = step or codec.decode_step
    state = codec.new_state(codes.shape[0])
    return torch.cat([step(codes[:, t:t + window], state).float() for t in range(0, codes.shape[1], window)], dim=1)


def per_call_ms(codec, rows: int, window: int, calls: int = 20) -> float:
    state = codec.new_state(rows)
    codes = torch.randint(0, 2048, (rows, window, 16), device="cuda")
    for _ in range(3):
        codec.decode_step(codes, state)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        codec.decode_step(codes, state)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1000


def module_times(codec, rows: int, window: int) -> None:
    """CUDA time of each top-level codec part and of each vocoder block's parts that runs (events
    around the modules of one eager call, so launch gaps count; the fused vocoder runs as a whole)."""
    parts = {"quantizer": codec.quantizer, "pre_conv": codec.pre_conv, "transformer": codec.pre_transformer,
             "upsample": codec.upsample, "vocoder": codec.decoder}
    for i, module in enumerate(codec.decoder):
        parts[f"decoder.{i}"] = module
        if hasattr(module, "block"):
            for j, sub in enumerate(module.block):
                parts[f"decoder.{i}.{j}:{type(sub).__name__}"] = sub
    events, hooks = {}, []
    for name, module in parts.items():
        def before(module, args, name=name):
            events[name] = [torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)]
            events[name][0].record()
        hooks.append(module.register_forward_pre_hook(before))
        hooks.append(module.register_forward_hook(lambda module, args, out, name=name: events[name][1].record()))
    state = codec.new_state(rows)
    codes = torch.randint(0, 2048, (rows, window, 16), device="cuda")
    with torch.no_grad():
        for _ in range(4):
            codec.decode_step(codes, state)
        torch.cuda.synchronize()
    for name, (start, end) in events.items():
        print(f"  {name:40s} {start.elapsed_time(end):8.3f} ms", flush=True)
    for hook in hooks:
        hook.remove()


def graphed_call_ms(codec, rows: int, window: int, replays: int = 50, step=None) -> float:
    """Time per call of `step` (default: codec.decode_step) replayed from a CUDA graph, as the
    engine's codec stage runs it."""
    step = step or codec.decode_step
    state = codec.new_state(rows)
    codes = torch.randint(0, 2048, (rows, window, 16), device="cuda")
    with torch.no_grad():
        for _ in range(3):
            step(codes, state)
        torch.cuda.synchronize()
        graph, _ = capture(lambda: step(codes, state))
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays


def profile(codec, ref: torch.Tensor, codes: torch.Tensor, rows: int, window: int, compiled: bool) -> None:
    """The codec (fp32 + TF32) with the torch modules and with the engine's kernels (the vocoder's
    convolutions with fp16 inputs: Vocoder.half): SNR against the exact fp32 full decode, eager
    time per call and per module, time per call replayed from a CUDA graph (as the engine runs it);
    with `compiled`, torch.compile of the plain modules (SnakeBeta in torch, so that inductor fuses
    it with the bias and residual adds around it) with and without the GEMM path for the transposed
    convolutions; last, with the kernels on, the GPU time per kernel and per torch op with its
    input shapes."""
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    for kernels in (False, True):
        use_kernels(codec, kernels)
        with torch.no_grad():
            quality = snr_db(streamed(codec, codes, window), ref)
        ms = per_call_ms(codec, rows, window)
        print(f"{'kernels' if kernels else 'torch'}: SNR {quality:5.1f} dB   {ms:6.2f} ms per call of {rows} rows x "
              f"{window} frames ({ms / window:5.2f} ms per step), eager", flush=True)
        module_times(codec, rows, window)
        ms = graphed_call_ms(codec, rows, window)
        print(f"{'kernels' if kernels else 'torch'}: graphed {ms:6.2f} ms per call ({ms / window:5.2f} ms per step)",
              flush=True)
    transposed = [m for m in codec.modules() if isinstance(m, CausalConvTranspose1d)]
    if compiled:
        use_kernels(codec, False)
        for gemm in (True, False):
            for module in transposed:
                module.prepare_fused()
                module.fused = gemm
            torch._dynamo.reset()
            step = torch.compile(codec.decode_step, dynamic=False)
            start = time.perf_counter()
            with torch.no_grad():
                quality = snr_db(streamed(codec, codes, window, step), ref)
            compile_s = time.perf_counter() - start
            ms = graphed_call_ms(codec, rows, window, step=step)
            print(f"graphed, torch.compile of the plain modules, transposed convolutions "
                  f"{'as GEMMs' if gemm else 'cuDNN'}: SNR {quality:5.1f} dB, {ms:6.2f} ms per call "
                  f"({ms / window:5.2f} ms per step), first calls with compiling {compile_s:.0f} s", flush=True)
    use_kernels(codec, True)
    from torch.profiler import ProfilerActivity, profile as torch_profile
    state = codec.new_state(rows)
    step_codes = torch.randint(0, 2048, (rows, window, 16), device="cuda")
    with torch.no_grad():
        codec.decode_step(step_codes, state)
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
            codec.decode_step(step_codes, state)
            torch.cuda.synchronize()
    events = prof.key_averages()
    print(events.table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=70), flush=True)
    print(prof.key_averages(group_by_input_shape=True).table(sort_by="cuda_time_total", row_limit=40,
                                                            max_name_column_width=40, max_shapes_column_width=90),
          flush=True)


def cudnn_conv(args, kwargs):
    """The same convolution through cuDNN (torch's conv2d, cudnn.benchmark): the time-major src
    [B, L, C] is an NHWC image of height 1 as it lies, the weight [taps * C, N] laid out as NHWC
    [N, C, 1, taps] once; no epilogue (bias only: no residual, no SnakeBeta)."""
    import torch.nn.functional as F
    src, weight, bias, frames = args[:4]
    dilation = args[4] if len(args) > 4 else kwargs.get("dilation", 1)
    c_in, n = src.shape[2], weight.shape[1]
    taps = weight.shape[0] // c_in
    image = src.unsqueeze(1).permute(0, 3, 1, 2)   # [B, C, 1, L], channels_last strides: no copy
    kernel = weight.view(taps, c_in, n).permute(2, 1, 0).unsqueeze(2).contiguous(memory_format=torch.channels_last)
    bias = bias.to(src.dtype)
    return lambda: F.conv2d(image, kernel, bias, dilation=(1, dilation))


def conv_kind(index: int, c_in: int, k: int, n: int) -> str:
    """What a vocoder convolution of --convs is, by its place and weight [k = taps * c_in, n]."""
    taps = k // c_in
    if index == 0:
        return "pre-convolution"
    if n == 1:
        return "one channel"
    return {1: "1x1", 2: "transposed"}.get(taps, f"{taps}-tap")


def kind_sums(timed: list[tuple[str, float, float]]) -> str:
    """timed: (kind, us, FLOPs) per convolution -> one line per kind and the total: count, us, TF/s."""
    kinds: dict[str, list[float]] = {}
    for kind, us, flops in timed:
        count, total_us, total_flops = kinds.get(kind, [0, 0.0, 0.0])
        kinds[kind] = [count + 1, total_us + us, total_flops + flops]
    kinds["all"] = [len(timed), sum(t[1] for t in timed), sum(t[2] for t in timed)]
    return "\n".join(f"  {kind:16s} {count:3d} {us:8.0f} us {flops / us / 1e6:5.0f} TF/s"
                     for kind, (count, us, flops) in kinds.items())


def conv_times(codec, rows: int, window: int, sweep: list[tuple[int, ...]], only: set[int] | None = None,
               cudnn: bool = False) -> None:
    """--convs: the tts_kernels.conv launches of one engine codec call (rows x window frames, fp16
    vocoder), recorded with their arguments, then each timed alone (those in `only`, if given):
    us (median of three runs of 10 launches), TFLOP/s, and TB/s of the bytes it must move (input
    once, outputs, residual), then the sums by kind (kind_sums). cudnn: each also through cuDNN
    (cudnn_conv)."""
    import tts_kernels.conv as conv
    from step_profile import median_ms
    if conv.tma_available(torch.cuda.current_device())[0]:
        import tts_kernels.conv_tma as conv_tma
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    use_kernels(codec, True)
    calls, launch = [], conv.causal_conv

    def record(*args, **kwargs):
        calls.append((args, kwargs))
        launch(*args, **kwargs)

    state = codec.new_state(rows)
    codes = torch.randint(0, 2048, (rows, window, 16), device="cuda")
    with torch.no_grad():
        codec.decode_step(codes, state)
        conv.causal_conv = record
        try:
            codec.decode_step(codes, state)
        finally:
            conv.causal_conv = launch
    torch.cuda.synchronize()

    def us(args, kwargs) -> float:
        launch(*args, **kwargs)
        return median_ms(lambda: [launch(*args, **kwargs) for _ in range(10)], 3) * 100

    print(f"{len(calls)} convolutions per call of {rows} rows x {window} frames (flags: r = adds the residual, "
          f"o = writes out, s = writes the next input's SnakeBeta)", flush=True)
    total = cudnn_total = 0.0
    timed = []
    for i, (args, kwargs) in enumerate(calls):
        if only is not None and i not in only:
            continue
        src, weight, _, frames = args[:4]
        written = [kwargs[k] for k in ("residual", "out", "snake_out") if kwargs.get(k) is not None]
        flags = "".join(f for f, k in (("r", "residual"), ("o", "out"), ("s", "snake_out")) if kwargs.get(k) is not None)
        m, (k, n) = src.shape[0] * frames, weight.shape
        moved = src.numel() * src.element_size() + sum(m * n * x.element_size() for x in written)
        c_in = src.shape[2]
        tma = conv.takes_tma(src, weight, frames)
        if n == 1:
            kind = f"one channel, {conv.tiles(c_in, 8, 1, src.dtype == torch.float16)} then the taps' sums"
        elif tma:
            kind = f"TMA {conv_tma.tiles(c_in, n, k // c_in)}"
        else:
            kind = conv.tiles(c_in, n, k // c_in, src.dtype == torch.float16)
        t = us(args, kwargs)
        total += t
        timed.append((conv_kind(i, c_in, k, n), t, 2 * m * k * n))
        line = (f"{i:2d} src {tuple(src.shape)} w {tuple(weight.shape)} d={args[4]} {flags:3s} {t:7.1f} us "
                f"{2 * m * k * n / t / 1e6:5.0f} TF/s {moved / t / 1e6:5.2f} TB/s  {kind}")
        if sweep:
            # the tile goes to whichever kernel takes the convolution (conv.py's, or conv_tma's on sm_90;
            # for the waveform's, its GEMM)
            kernel = conv_tma if tma else conv
            saved = kernel.tiles
            for tiles in sweep:
                kernel.tiles = lambda *shape, tiles=tiles: tiles
                try:
                    line += f"\n     {tiles}: {us(args, kwargs):7.1f} us"
                except Exception as error:   # e.g. a tile that needs more shared memory than there is
                    line += f"\n     {tiles}: {type(error).__name__}"
                finally:
                    kernel.tiles = saved
        if cudnn and n > 1:
            torch.backends.cudnn.benchmark = True
            run = cudnn_conv(args, kwargs)
            run()
            t_cudnn = median_ms(lambda: [run() for _ in range(10)], 3) * 100
            cudnn_total += t_cudnn
            line += f"\n     cuDNN NHWC: {t_cudnn:7.1f} us {2 * m * k * n / t_cudnn / 1e6:5.0f} TF/s"
        print(line, flush=True)
    cudnn_sum = f"; cuDNN (more than one channel, no epilogue): {cudnn_total:.0f} us" if cudnn else ""
    listed = "listed " if only is not None else ""
    print(f"sum over the {listed}launches at the tree's tiles: {total:.0f} us{cudnn_sum}", flush=True)
    print(f"by kind (count, us, TF/s), at the tree's tiles:\n{kind_sums(timed)}", flush=True)


def round_tf32(x: torch.Tensor) -> torch.Tensor:
    """fp32 rounded to TF32's 10 mantissa bits, half-way cases away from zero (as tts_kernels.conv
    rounds the fp32 vocoder's operands; tests/test_gpu.py checks that kernel against it)."""
    bits = x.contiguous().view(torch.int32)
    return ((bits + 0x1000) & ~0x1FFF).view(torch.float32)


def emulate(rows: int, window: int) -> None:
    """--emulate (module doc)."""
    from torch import nn
    import torch.nn.functional as F
    _, codec = build_random("1.7b", "cpu", torch.float32)
    codes = torch.randint(0, 2048, (rows, 6 * window, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = codec.decode(codes)
    same = lambda x: x
    rounding = {"tf32": round_tf32, "bf16": lambda x: x.bfloat16().float(), "fp16": lambda x: x.half().float()}
    # (rounding, outputs rounded too, the residual stream rounded: each residual unit's and
    # transposed convolution's output stored in that precision, as an engine with 16-bit residual
    # buffers would)
    arms = [("tf32", False, False), ("bf16", False, False), ("bf16", True, False), ("fp16", False, False),
            ("fp16", True, False), ("fp16", False, True)]
    unit_forward = ResidualUnit.forward
    for name, outputs, stream in arms:
        cast_in, cast_out = rounding[name], rounding[name] if outputs else same
        cast_stream = rounding[name] if stream else same
        ResidualUnit.forward = lambda self, x, state: cast_stream(unit_forward(self, x, state))

        def conv(self, x):
            return cast_out(F.conv1d(cast_in(x), cast_in(self.weight), self.bias, self.stride, self.padding,
                                     self.dilation, self.groups))

        def transposed(self, x, output_size=None):
            return cast_stream(cast_out(F.conv_transpose1d(cast_in(x), cast_in(self.weight), self.bias,
                                                           self.stride, self.padding, 0, self.groups, self.dilation)))

        for module in codec.decoder.modules():
            if isinstance(module, nn.ConvTranspose1d):
                module.forward = transposed.__get__(module)
            elif isinstance(module, nn.Conv1d):
                module.forward = conv.__get__(module)
        with torch.no_grad():
            quality = snr_db(streamed(codec, codes, window), ref)
        print(f"vocoder convolutions with {name} inputs and weights, {name if outputs else 'fp32'} outputs"
              f"{f', the residual stream in {name}' if stream else ''}: streamed SNR {quality:5.1f} dB", flush=True)
    ResidualUnit.forward = unit_forward


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, help="default: 64 on the GPU, 2 with --emulate")
    parser.add_argument("--window", type=int, default=4)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--compile", action="store_true", help="with --profile: torch.compile variants too")
    parser.add_argument("--emulate", action="store_true", help="CPU: mixed precisions' SNR (module doc)")
    parser.add_argument("--convs", action="store_true", help="each vocoder convolution alone (module doc)")
    parser.add_argument("--tiles", nargs="*", default=[], metavar="BM,BN,BK,WARPS,STAGES",
                        help="with --convs: time every convolution at these tiles too")
    parser.add_argument("--only", help="with --convs: time only these convolutions (their numbers, e.g. 16,23)")
    parser.add_argument("--cudnn", action="store_true", help="with --convs: each through cuDNN too (NHWC, no epilogue)")
    args = parser.parse_args()
    if args.emulate:
        emulate(args.rows or 2, args.window)
        return
    args.rows = args.rows or 64
    _, codec32 = build_random("1.7b", "cuda", torch.bfloat16)
    if args.convs:
        conv_times(codec32, args.rows, args.window, [tuple(int(v) for v in t.split(",")) for t in args.tiles],
                   {int(i) for i in args.only.split(",")} if args.only else None, cudnn=args.cudnn)
        return
    # the profile's SNR runs in calls of the timed shape, so that a compiled step compiles once
    shape = (args.rows, 6 * args.window, 16) if args.profile else (4, 96, 16)
    codes = torch.randint(0, 2048, shape, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    # the reference without cuDNN, whose fp32 pre-convolution is wrong at some shapes (docs/numerics.md)
    with torch.no_grad(), torch.backends.cudnn.flags(enabled=False, allow_tf32=False):
        ref = codec32.decode(codes)
    if args.profile:
        profile(codec32, ref, codes, args.rows, args.window, args.compile)
        return
    options = {}
    for name, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
        codec = copy.deepcopy(codec32).to(dtype)
        codec.quantizer.tables = codec32.quantizer.tables.to(dtype)
        options[name] = (codec, False)
    options["fp32"] = (codec32, False)
    options["fp32 + TF32"] = (codec32, True)
    for benchmark in (False, True):
        torch.backends.cudnn.benchmark = benchmark
        for name, (codec, tf32) in options.items():
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = tf32
            with torch.no_grad():
                quality = snr_db(streamed(codec, codes, args.window), ref)
                ms = per_call_ms(codec, args.rows, args.window)
            print(f"cudnn.benchmark {benchmark!s:5}  {name:12s} SNR {quality:5.1f} dB   {ms:6.2f} ms per call of "
                  f"{args.rows} rows x {args.window} frames ({ms / args.window:5.2f} ms per step)", flush=True)


if __name__ == "__main__":
    main()
