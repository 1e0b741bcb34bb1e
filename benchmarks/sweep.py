"""Launch-configuration sweep of the chunk kernels on a GPU (one device call).

    python benchmarks/sweep.py [--stages pair_fwd,pair_bwd,...] [--jobs 12]

For every stage of ``kda.ops.chunk.TUNING`` and every candidate configuration below, it sets that
stage's entry, runs one forward + backward step of ``chunk_kda`` (bf16, K = V = 128, l2norm in
kernel, g pre-computed) under ``torch.profiler`` and reports the stage kernel's GPU time per call.
Kernels are first compiled by ``--jobs`` parallel processes into a shared Triton cache (compiles
are single-threaded and dominate the wall time), then timed one configuration at a time.
The launcher's own rules still apply on top of a candidate (e.g. ``chunk_kda_fwd`` halves the
state carry's slice when there are fewer programs than SMs), so two candidates can time the same
kernel; the table prints what was asked for.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kda import chunk_kda  # noqa: E402
sys.path.insert(0, str(ROOT / 'benchmarks'))
import bench  # noqa: E402
from kda.ops.chunk import tuning as chunk_ops  # noqa: E402

# Candidates for the state sweeps' shape-dependent tables, as (table in kda.ops.chunk, its key):
# FEW_PROGRAMS (fewer programs than SMs) and WIDE_SLICES (the fused forward sweep otherwise,
# 16-bit inputs, K <= 128). Every other stage's candidates go to TUNING under its own name.
TABLES = {'state_fwd_few': ('FEW_PROGRAMS', 'state_fwd'), 'state_bwd_few': ('FEW_PROGRAMS', 'state_bwd'),
          'state_output_few': ('FEW_PROGRAMS', 'state_output'),
          'state_output_wide': ('WIDE_SLICES', 'state_output')}
KERNELS = {'cumsum': 'chunk_cumsum_kernel', 'cumsum_raw': 'chunk_cumsum_kernel',
           'cumsum_decayed': 'chunk_cumsum_kernel', 'cumsum_raw_decayed': 'chunk_cumsum_kernel',
           'pair_fwd': 'chunk_pair_fwd_kernel',
           'solve': 'chunk_solve_kernel', 'state_fwd': 'chunk_state_fwd_kernel',
           'state_output': 'chunk_state_output_fwd_kernel', 'state_bwd': 'chunk_state_bwd_kernel',
           'intra_bwd': 'chunk_intra_bwd_kernel', 'pair_bwd': 'chunk_pair_bwd_kernel',
           'pair_bwd_bounded': 'chunk_pair_bwd_kernel',
           'gate_bwd': 'chunk_gate_bwd_kernel', 'gate_bwd_raw': 'chunk_gate_bwd_kernel'}


def cfg(BK=None, BV=None, w=4, s=2, r=None):
    return dict(BK=BK, BV=BV, num_warps=w, num_stages=s, maxnreg=r)


CANDIDATES = {
    # The cumsum's forward build (c only) and the backward recompute's (c and the decayed keys
    # and queries), each with a TUNING entry of its own; the time is the mean of a step's two
    # launches of the kernel, one of them at the other entry's setting.
    'cumsum': [cfg(64, None, 4, 2), cfg(64, None, 4, 2, 96), cfg(64, None, 2, 2), cfg(32, None, 4, 2, 64)],
    'cumsum_decayed': [cfg(64, None, 4, 2), cfg(64, None, 4, 2, 96), cfg(64, None, 2, 2),
                       cfg(32, None, 4, 2, 64)],
    # The raw gate's builds (Kimi configuration).
    'cumsum_raw': [cfg(64, None, 2, 2), cfg(64, None, 4, 2, 96), cfg(64, None, 4, 2), cfg(128, None, 4, 2)],
    'cumsum_raw_decayed': [cfg(64, None, 4, 2, 96), cfg(64, None, 4, 2), cfg(64, None, 8, 2), cfg(32, None, 4, 2),
                           cfg(32, None, 2, 2), cfg(128, None, 8, 2)],
    'pair_fwd': [cfg(32, None, 1, 3), cfg(32, None, 1, 4), cfg(32, None, 1, 2), cfg(32, None, 1, 3, 192),
                 cfg(32, None, 2, 3), cfg(32, None, 2, 3, 128), cfg(64, None, 1, 3), cfg(16, None, 1, 3)],
    'solve': [cfg(None, None, 2, 2), cfg(None, None, 1, 2), cfg(None, None, 4, 2)],
    # Square tiles only (kda.ops.chunk.launch_config says why).
    'intra_bwd': [cfg(64, 64, 8, 1), cfg(64, 64, 8, 2), cfg(64, 64, 4, 1), cfg(64, 64, 8, 1, 128),
                  cfg(32, 32, 4, 1), cfg(32, 32, 4, 1, 208)],
    'pair_bwd': [cfg(64, None, 4, 2, 168), cfg(64, None, 4, 3, 168), cfg(64, None, 4, 2, 128),
                 cfg(64, None, 4, 2, 144), cfg(32, None, 4, 2, 128), cfg(64, None, 8, 2, 128)],
    'pair_bwd_bounded': [cfg(64, None, 4, 2, 128), cfg(64, None, 4, 2, 168), cfg(64, None, 4, 3, 168),
                         cfg(64, None, 4, 2, 112), cfg(64, None, 4, 3, 128)],
    'gate_bwd': [cfg(64, None, 4, 2), cfg(64, None, 2, 2), cfg(128, None, 4, 2), cfg(32, None, 4, 2),
                 cfg(32, None, 2, 2)],
    'gate_bwd_raw': [cfg(32, None, 2, 2), cfg(32, None, 1, 2), cfg(64, None, 2, 2), cfg(32, None, 4, 2),
                     cfg(16, None, 2, 2)],
    # FEW_PROGRAMS entries (the state sweeps where (sequence, head) pairs x value slices < SMs).
    # One stage is not offered for the carry and the gradient sweep: with 16-bit inputs the launcher
    # raises it to 2 (it faulted on the H200, see kda.ops.chunk.state_launch_config).
    'state_fwd_few': [cfg(None, 16, 4, 2), cfg(None, 32, 4, 2), cfg(None, 16, 8, 2), cfg(None, 16, 4, 3)],
    'state_bwd_few': [cfg(None, 32, 8, 3), cfg(None, 16, 8, 3), cfg(None, 32, 4, 2), cfg(None, 32, 8, 2)],
    'state_fwd': [cfg(None, 64, 4, 2), cfg(None, 64, 8, 2), cfg(None, 32, 4, 2), cfg(None, 64, 4, 3)],
    'state_bwd': [cfg(None, 64, 4, 2), cfg(None, 64, 8, 2), cfg(None, 32, 4, 2), cfg(None, 64, 4, 3)],
    # The fused forward sweep: at this script's bf16 K = V = 128 steps it launches WIDE_SLICES'
    # setting, so TUNING's entry (float32, V <= 64, K = 256, and the unit the launcher counts
    # programs in) is not swept here: its candidates would all launch the same kernel.
    'state_output_wide': [cfg(None, 128, 8, 2), cfg(None, 128, 8, 1), cfg(None, 128, 8, 3), cfg(None, 64, 4, 1)],
    'state_output_few': [cfg(None, 16, 4, 2), cfg(None, 32, 4, 2), cfg(None, 16, 8, 2), cfg(None, 16, 4, 3),
                         cfg(None, 64, 4, 2), cfg(None, 64, 4, 1), cfg(None, 32, 4, 1)],
}
# (B, T, H, Kimi lower-bound gate)
SHAPES = {stage: [(8, 4096, 16, False)] for stage in CANDIDATES}
SHAPES['state_fwd'] = SHAPES['state_bwd'] = [(8, 4096, 16, False), (1, 8192, 96, False)]
SHAPES['state_output_wide'] = [(8, 4096, 16, False), (1, 8192, 96, False)]
SHAPES['state_fwd_few'] = SHAPES['state_bwd_few'] = SHAPES['state_output_few'] = [(1, 32768, 32, False)]
# The lower-bound gate compiles the pair gradients without their diagonal fallback.
SHAPES['pair_bwd_bounded'] = [(8, 4096, 16, True)]
# The raw gate's builds do the activation (and its gradient) too.
SHAPES['gate_bwd_raw'] = SHAPES['cumsum_raw'] = SHAPES['cumsum_raw_decayed'] = [(8, 4096, 16, True)]


def inputs(B, T, H, gate=False):
    """bench.py's inputs (bf16, K = V = 128); ``gate``: the Kimi lower-bound gate configuration."""
    inp, opts = bench._chunk_inputs(B, T, H, gate=gate)
    leaves = {n: x.detach().requires_grad_() for n, x in inp.items()}
    return (leaves, opts), torch.randn_like(leaves['v'])


def step(leaves_opts, do):
    leaves, opts = leaves_opts
    o, _ = chunk_kda(**leaves, **opts)
    o.backward(do)


def jobs():
    return [(stage, i, shape) for stage in CANDIDATES for i in range(len(CANDIDATES[stage]))
            for shape in SHAPES[stage]]


def kernel_ms(stage, leaves, do, reps=3):
    from torch.profiler import ProfilerActivity, profile
    step(leaves, do)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            step(leaves, do)
        torch.cuda.synchronize()
    for e in prof.key_averages():
        if e.key.startswith(KERNELS[table_entry(stage)[1]]):
            return e.device_time_total / 1e3 / e.count
    return float('nan')


def table_entry(stage):
    """``(table name in kda.ops.chunk, key)`` that ``stage``'s candidates replace (``TABLES``)."""
    return TABLES.get(stage, ('TUNING', stage))


def use_candidate(stage, c):
    """Puts candidate c of ``stage`` in place (``table_entry``); returns the function that puts the
    old entry back."""
    name, key = table_entry(stage)
    table = getattr(chunk_ops, name)
    old = table[key]
    table[key] = CANDIDATES[stage][c]

    def restore():
        table[key] = old
    return restore


def main():
    p = argparse.ArgumentParser()
    p.add_argument('--stages', default=','.join(CANDIDATES))
    p.add_argument('--jobs', type=int, default=12)
    p.add_argument('--compile-shard', default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    stages = args.stages.split(',')
    unknown = sorted(set(stages) - set(CANDIDATES))
    if unknown:
        raise SystemExit(f"--stages: unknown {unknown}; expected some of {', '.join(CANDIDATES)}")
    todo = [j for j in jobs() if j[0] in stages]

    if args.compile_shard is not None:
        i, n = map(int, args.compile_shard.split('/'))
        for stage, c, shape in todo[i::n]:
            restore = use_candidate(stage, c)
            try:
                leaves, do = inputs(*shape)
                step(leaves, do)
                torch.cuda.synchronize()
            except Exception:  # noqa: BLE001  (reported by the timing pass)
                pass
            restore()
        return

    os.environ.setdefault('TRITON_CACHE_DIR', tempfile.mkdtemp(prefix='sweep_cache_'))
    t0 = time.time()
    procs = [subprocess.Popen([sys.executable, __file__, '--stages', args.stages,
                               '--compile-shard', f'{i}/{args.jobs}'], env=os.environ)
             for i in range(args.jobs)]
    for pr in procs:
        pr.wait()
    print(f"compiled {len(todo)} configurations in {time.time() - t0:.0f} s", flush=True)

    print('| stage | (B, T, H, gate) | BK | BV | warps | stages | maxnreg | kernel ms |')
    print('| --- | --- | --- | --- | --- | --- | --- | --- |')
    for stage, c, shape in todo:
        restore = use_candidate(stage, c)
        try:
            leaves, do = inputs(*shape)
            ms = f"{kernel_ms(stage, leaves, do):.3f}"
        except Exception as e:  # noqa: BLE001
            ms = f"error: {type(e).__name__}: {str(e)[:80]}".replace('\n', ' ')
        restore()
        leaves = do = None
        torch.cuda.empty_cache()
        k = CANDIDATES[stage][c]
        print(f"| {stage} | {shape} | {k['BK']} | {k['BV']} | {k['num_warps']} | {k['num_stages']} "
              f"| {k['maxnreg']} | {ms} |", flush=True)


if __name__ == '__main__':
    main()
