"""What slows stage 1 beside the state sweep? Times the pair products and the solve of one forward
segment alone and beside synthetic neighbours that each load the GPU one way (one device call).

    python benchmarks/contention.py [--tokens 9024] [--heads 32]

In the segmented forward at (1, 32768, 32) the pair products take 1.6-1.9x their time alone while
the few-program sweep runs beside them (BENCHMARKS.md note 133), and giving them a fifth program an
SM (the sweep capped at 192 registers) did not help, so registers are not the cause. Each
neighbour here is 128 programs of 4 warps, as that sweep is, launched on a side stream first:
``memory`` streams bf16 from a region of its own (it prints its bandwidth alone), ``tensor`` chains
[64, 64] tensor-core products on register operands, ``idle`` runs a dependent integer chain (it
holds its SM slots and issues little). The slowdown beside each says which resource the pair
products share with the sweep. A neighbour must outlast the pair products it sits beside: the
script says so where one did not (raise ``--scale``).

Written in the twenty-fourth session, whose device time ran out before it could run: its first
run is its test.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kda.ops import chunk as chunk_ops  # noqa: E402

NEIGHBOURS = {'memory': 0, 'tensor': 1, 'idle': 2}
PROGRAMS, WARPS, STREAM_BLOCK = 128, 4, 4096


@triton.jit
def neighbour_kernel(x, out, n_iters, MODE: tl.constexpr, BLOCK: tl.constexpr):
    """One program of a neighbour (module docstring); ``out`` keeps each result live."""
    pid = tl.program_id(0)
    if MODE == 0:
        o = tl.arange(0, BLOCK)
        base = pid.to(tl.int64) * n_iters * BLOCK
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for i in range(n_iters):
            acc += tl.load(x + base + i * BLOCK + o).to(tl.float32)
        tl.store(out + pid * BLOCK + o, acc)
    elif MODE == 1:
        r = tl.arange(0, 64)
        a = tl.load(x + r[:, None] * 64 + r[None, :])
        b = tl.load(x + 4096 + r[:, None] * 64 + r[None, :])
        acc = tl.zeros([64, 64], dtype=tl.float32)
        for i in range(n_iters):
            acc = tl.dot(a, b, acc)
        tl.store(out + pid * 4096 + r[:, None] * 64 + r[None, :], acc)
    else:
        v = pid
        for i in range(n_iters):
            v = (v * 1103515245 + 12345) & 0x7fffffff
        tl.store(out + pid, v.to(tl.float32))


def elapsed_ms(fn, stream=None) -> float:
    """GPU time of ``fn``'s launches, between events on ``stream`` (default: the current one)."""
    stream = stream or torch.cuda.current_stream()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(stream)
    fn()
    end.record(stream)
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def median(xs):
    return sorted(xs)[len(xs) // 2]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--tokens', type=int, default=9024,
                   help="the segment's tokens (the first segment's at (1, 32768, 32))")
    p.add_argument('--heads', type=int, default=32)
    p.add_argument('--scale', type=float, default=1.0, help="neighbours' length (default ~1 ms each alone)")
    p.add_argument('--reps', type=int, default=11)
    args = p.parse_args(argv)
    dev, K, T, H = 'cuda', 128, args.tokens, args.heads
    gen = torch.Generator(device=dev).manual_seed(0)
    q, k = (F.normalize(torch.randn(1, T, H, K, device=dev, generator=gen), dim=-1).bfloat16()
            for _ in range(2))
    g = (F.logsigmoid(torch.randn(1, T, H, K, device=dev, generator=gen) + 3) * 2).contiguous()
    beta = torch.rand(1, T, H, device=dev, generator=gen)
    layout = chunk_ops.chunk_layout(1, T, 64, None, None)
    s1 = chunk_ops.stage1_buffers(1, T, H, K, 64, dev, torch.bfloat16)
    chunk_ops.stage1_cumsum(q, k, g, K ** -0.5, layout, None, H, s1, decayed=False)

    def stage1():
        chunk_ops.stage1_matrices(q, k, beta, K ** -0.5, layout, H, s1)

    iters = {'memory': int(2048 * args.scale), 'tensor': int(20000 * args.scale),
             'idle': int(200000 * args.scale)}
    x = torch.ones(PROGRAMS * STREAM_BLOCK * iters['memory'] + 8192, device=dev, dtype=torch.bfloat16)
    out = torch.empty(PROGRAMS * STREAM_BLOCK, device=dev)
    side = torch.cuda.Stream()

    def neighbour(name, n, stream):
        with torch.cuda.stream(stream):
            neighbour_kernel[(PROGRAMS,)](x, out, n, MODE=NEIGHBOURS[name],
                                          BLOCK=STREAM_BLOCK if name == 'memory' else 64, num_warps=WARPS)

    stage1()
    alone = median([elapsed_ms(stage1) for _ in range(args.reps)])
    print(f'pair products + solve, {T} tokens x {H} heads, alone: {alone * 1e3:.0f} us')
    for name, n in iters.items():
        neighbour(name, 1, side)
        torch.cuda.synchronize()
        own = median([elapsed_ms(lambda: neighbour(name, n, side), side) for _ in range(3)])
        rate = (f', {PROGRAMS * n * STREAM_BLOCK * 2 / own / 1e9:.2f} TB/s' if name == 'memory' else '')
        beside, outlasted = [], True
        for _ in range(args.reps):
            torch.cuda.synchronize()
            n_start = torch.cuda.Event(enable_timing=True)
            n_end = torch.cuda.Event(enable_timing=True)
            n_start.record(side)
            neighbour(name, n, side)
            n_end.record(side)
            # ~50 us on the current stream, so that the neighbour's programs hold their SMs first
            # (torch's private sleep kernel: cycles, ~2 GHz).
            torch.cuda._sleep(100_000)
            s_start = torch.cuda.Event(enable_timing=True)
            s_end = torch.cuda.Event(enable_timing=True)
            s_start.record()
            stage1()
            s_end.record()
            torch.cuda.synchronize()
            beside.append(s_start.elapsed_time(s_end))
            outlasted &= n_start.elapsed_time(n_end) >= n_start.elapsed_time(s_end)
        t = median(beside)
        print(f'beside {name:>6} (alone {own * 1e3:.0f} us{rate}): {t * 1e3:.0f} us, {t / alone:.2f}x'
              + ('' if outlasted else '  [the neighbour ended first: raise --scale]'))


if __name__ == '__main__':
    main()
