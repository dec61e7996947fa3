"""How fast can one phase of a persistent kernel be handed to the next on the H200, with and without the
task's weight tile landing in shared memory before it waits? A measurement for the depth kernel (issue 4):
its Triton version spends ~4 us per phase (a ~0.75 us hand-off and a task body that is a chain of dependent
loads, docs/bench.md), 591 phases per frame.

A Gluon kernel (Triton >= 3.6, Hopper) runs a chain of `--phases` phases shaped like the depth kernel's o
projection: 64 rows, N 1024, K 2048, 16 n tiles x 8 K splits = 128 tasks per phase, one launch of one CTA
per SM, tasks round-robin. Each task waits on a global counter for the whole phase before, brings its
input chunk [64, 256] and weight tile [64, 256] in by TMA, multiplies them with one wgmma, stores fp32
partial sums and signals. PREFETCH=1: a CTA issues its next task's weight copy (double-buffered) before
it waits; PREFETCH=0: after. Every phase has its own weights (80 x 4 MB, more than L2), as the depth
kernel's layers and positions do. PAYLOAD=0: the same chain of waits and signals with nothing
between them (no copies, product or store), the hand-off alone. Prints us per phase of each setting
(alternated) and the largest difference of the last phase's partials from torch.

    PYTHONPATH=.:kernels:tools python tools/phase_chain_bench.py [--phases 80] [--replays 50]   # on the GPU (or pip install -e .)
    python tools/phase_chain_bench.py --compile                         # sm_90, no GPU: registers, shared memory

`--compile` needs the device's Triton (3.6) first on PYTHONPATH for the device's numbers
(tools/sm90_compile.py: DEVICE_TRITON).
"""
import argparse

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (tma, mbarrier, fence_async_shared, warpgroup_mma,
                                                              warpgroup_mma_wait)

ROWS, N, K, BN, BK = 64, 1024, 2048, 64, 256
FIELDS = 4   # phase, weight row, k0, output offset
# (PAYLOAD, PREFETCH) in the order run_on_gpu alternates them: the task's work with its weights
# copied after / before the wait, then the hand-off alone
SETTINGS = [(1, 0), (1, 1), (0, 0)] * 2


@gluon.jit
def phase_chain(table_ptr, counters_ptr, x_desc, w_desc, part_ptr, tasks_per_phase,
                MAX_TASKS: gl.constexpr, PREFETCH: gl.constexpr, OUT_STRIDE: gl.constexpr,
                PAYLOAD: gl.constexpr, num_warps: gl.constexpr):
    BM: gl.constexpr = x_desc.block_shape[0]
    TILE_N: gl.constexpr = w_desc.block_shape[0]
    cta = gl.program_id(0)
    x_smem = gl.allocate_shared_memory(x_desc.dtype, x_desc.block_shape, x_desc.layout)
    w_smem = gl.allocate_shared_memory(w_desc.dtype, [2] + w_desc.block_shape, w_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [3, 1], mbarrier.MBarrierLayout())   # weight slots 0, 1; x
    for i in gl.static_range(3):
        mbarrier.init(bars.index(i), count=1)
    fence_async_shared()
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, TILE_N, 16])
    rows = gl.arange(0, BM, layout=gl.SliceLayout(1, acc_layout))
    cols = gl.arange(0, TILE_N, layout=gl.SliceLayout(0, acc_layout))
    first = table_ptr + cta * MAX_TASKS * 4   # 4 fields a task (FIELDS)
    if PREFETCH and PAYLOAD:
        if gl.load(first) >= 0:
            mbarrier.expect(bars.index(0), w_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(w_desc, [gl.load(first + 1), gl.load(first + 2)], bars.index(0),
                                            w_smem.index(0))
    for t in range(MAX_TASKS):
        task = first + t * 4
        phase = gl.load(task)
        if phase >= 0:
            slot = t % 2
            if PAYLOAD:
                if PREFETCH:   # the next task's weights, into the other slot, before this task waits
                    if t + 1 < MAX_TASKS:
                        if gl.load(task + 4) >= 0:
                            mbarrier.expect(bars.index(1 - slot), w_desc.block_type.nbytes)
                            tma.async_copy_global_to_shared(w_desc, [gl.load(task + 5), gl.load(task + 6)],
                                                            bars.index(1 - slot), w_smem.index(1 - slot))
            if phase > 0:
                seen = gl.atomic_add(counters_ptr + phase - 1, 0, sem="acquire", scope="gpu")
                while seen < tasks_per_phase:
                    seen = gl.atomic_add(counters_ptr + phase - 1, 0, sem="acquire", scope="gpu")
            if PAYLOAD:
                if not PREFETCH:
                    mbarrier.expect(bars.index(slot), w_desc.block_type.nbytes)
                    tma.async_copy_global_to_shared(w_desc, [gl.load(task + 1), gl.load(task + 2)], bars.index(slot),
                                                    w_smem.index(slot))
                mbarrier.expect(bars.index(2), x_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(x_desc, [0, gl.load(task + 2)], bars.index(2), x_smem)
                mbarrier.wait(bars.index(2), phase=t & 1)
                mbarrier.wait(bars.index(slot), phase=(t // 2) & 1)
                acc = gl.zeros([BM, TILE_N], gl.float32, layout=acc_layout)
                acc = warpgroup_mma(x_smem, w_smem.index(slot).permute((1, 0)), acc, is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
                out = part_ptr + gl.multiple_of(gl.load(task + 3), 16)   # output offsets are multiples of 64
                gl.store(out + gl.expand_dims(rows, 1) * OUT_STRIDE + gl.expand_dims(cols, 0), acc)
            gl.thread_barrier()
            gl.atomic_add(counters_ptr + phase, 1, sem="release", scope="gpu")
    for i in gl.static_range(3):
        mbarrier.invalidate(bars.index(i))


def table(phases: int, ctas: int):
    """[ctas, max tasks, FIELDS] int32 (padding: phase -1) and tasks per phase; tasks round-robin over CTAs."""
    import torch
    splits = K // BK
    per_phase = N // BN * splits
    lists = [[] for _ in range(ctas)]
    for p in range(phases):
        for tile in range(per_phase):
            n0, split = tile // splits * BN, tile % splits
            lists[tile % ctas].append((p, p * N + n0, split * BK, split * ROWS * N + n0))
    most = max(len(l) for l in lists)
    out = torch.full((ctas, most, FIELDS), -1, dtype=torch.int32)
    for c, l in enumerate(lists):
        if l:
            out[c, :len(l)] = torch.tensor(l, dtype=torch.int32)
    return out, most, per_phase


def shared_layout(block: list[int]):
    """The shared-memory layout of an fp16 TMA tile (what wgmma reads)."""
    return gl.NVMMASharedLayout.get_default_for(block, gl.float16)


def descriptor_type(block: list[int]) -> str:
    """The signature string of an fp16 TMA descriptor argument of this block (what a launch would mangle)."""
    return f"tensordesc<fp16[{', '.join(map(str, block))}],{shared_layout(block)!r}>"


def compile_offline() -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from sm90_compile import report
    names = phase_chain.arg_names
    signature = {"table_ptr": "*i32", "counters_ptr": "*i32", "x_desc": descriptor_type([ROWS, BK]),
                 "w_desc": descriptor_type([BN, BK]), "part_ptr": "*fp32", "tasks_per_phase": "i32",
                 "MAX_TASKS": "constexpr", "PREFETCH": "constexpr", "OUT_STRIDE": "constexpr", "PAYLOAD": "constexpr",
                 "num_warps": "constexpr"}
    # attrs are keyed by argument index: names are silently ignored (Triton 3.6)
    aligned = {(names.index(name),): [["tt.divisibility", 16]] for name in ("table_ptr", "counters_ptr", "part_ptr")}
    for payload, prefetch in dict.fromkeys(SETTINGS):   # each setting once
        source = GluonASTSource(phase_chain, signature, attrs=aligned,
                                constexprs={"MAX_TASKS": 80, "PREFETCH": prefetch, "OUT_STRIDE": N, "PAYLOAD": payload,
                                            "num_warps": 4})
        kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
        print(f"PAYLOAD={payload} PREFETCH={prefetch}: {report(kernel)}")


def run_on_gpu(phases: int, replays: int) -> None:
    import torch
    from step_profile import median_ms
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    ctas = torch.cuda.get_device_properties(0).multi_processor_count
    tasks, most, per_phase = table(phases, ctas)
    tasks = tasks.cuda()
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(ROWS, K, device="cuda", generator=g).half()
    w = (torch.randn(phases * N, K, device="cuda", generator=g) * 0.02).half()
    part = torch.zeros(K // BK, ROWS, N, device="cuda")
    x_desc = TensorDescriptor.from_tensor(x, [ROWS, BK], shared_layout([ROWS, BK]))
    w_desc = TensorDescriptor.from_tensor(w, [BN, BK], shared_layout([BN, BK]))
    counters = torch.zeros(phases, dtype=torch.int32, device="cuda")
    expected = torch.stack([(x[:, s * BK:(s + 1) * BK].float() @ w[(phases - 1) * N:, s * BK:(s + 1) * BK].float().t())
                            for s in range(K // BK)])
    for payload, prefetch in SETTINGS:
        launch = lambda: (counters.zero_(), phase_chain[(ctas,)](tasks, counters, x_desc, w_desc, part, per_phase,
                                                                  MAX_TASKS=most, PREFETCH=prefetch, OUT_STRIDE=N,
                                                                  PAYLOAD=payload, num_warps=4))
        part.zero_()
        launch()
        torch.cuda.synchronize()
        # the last phase's partials (every phase writes part); without a payload nothing is written
        error = float((part - (expected if payload else 0)).abs().max())
        us = median_ms(launch, replays) * 1000
        print(f"PAYLOAD={payload} PREFETCH={prefetch}: {us:.1f} us for {phases} phases, {us / phases:.2f} us per "
              f"phase (largest difference from torch {error:.2e})", flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--compile", action="store_true", help="compile for sm_90 offline and report; no GPU")
    ap.add_argument("--phases", type=int, default=80)
    ap.add_argument("--replays", type=int, default=50)
    args = ap.parse_args()
    compile_offline() if args.compile else run_on_gpu(args.phases, args.replays)
