"""Launch settings timed end to end: the whole inference forward under ``kda.ops.chunk``'s tables
edited in place, on a GPU (one device call).

    python benchmarks/sweep_forward.py [--variants main,pair_s2,...] [--rounds 2]

``sweep.py`` times one stage's kernel in a training step under the profiler; that misses the
inference-only builds (the pair products that normalize q and k, ``pair_fwd_norms``) and what a
kernel costs beside the others, e.g. stage 1 beside the state sweeps of the segmented forward
(``forward_segments``). This times ``chunk_kda``'s inference forward instead (``bench.py``'s
inputs and ``do_bench`` settings, bf16, K = V = 128, l2norm in the kernel), g pre-computed and the
Kimi configuration, every variant in one process, the rounds interleaved. Each variant's outputs
are compared with the first's (a launch setting may change the bits: sums in another order).
``beta_given`` is not a setting: the Kimi configuration with beta handed over already activated in
float32, the bound of what forming beta costs the forward.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / 'benchmarks'))
import bench  # noqa: E402
from kda import chunk_kda  # noqa: E402
from kda.ops.chunk import tuning as chunk_ops  # noqa: E402


def pair(stage, BK, warps, stages, maxnreg=None):
    return {('TUNING', stage): dict(BK=BK, num_warps=warps, num_stages=stages, maxnreg=maxnreg)}


def few_programs(**kw):
    return {('FEW_PROGRAMS', 'state_output'): dict(BV=32, num_stages=2) | kw}


# name: {(table in kda.ops.chunk, key): entry}; 'main' is the tables as committed.
VARIANTS = {
    'main': {},
    'beta_given': {},
    'pair_s3': pair('pair_fwd_norms', 32, 1, 3), 'pair_s4': pair('pair_fwd_norms', 32, 1, 4),
    'pair_bk16': pair('pair_fwd_norms', 16, 1, 3), 'pair_w2': pair('pair_fwd_norms', 32, 2, 3),
    'pair_bk64_w4': pair('pair_fwd_norms', 64, 4, 2),
    # At most 200 registers, 5 one-warp programs fit in the half of an SM's registers that a
    # few-program sweep program leaves (10 an SM alone, against 8 at 255).
    'pair_r200': pair('pair_fwd_norms', 32, 1, 2, 200), 'pair_r200_s3': pair('pair_fwd_norms', 32, 1, 3, 200),
    'cumsum_raw_bk128_w4': {('TUNING', 'cumsum_raw'): dict(BK=128, num_warps=4)},
    'cumsum_raw_w4': {('TUNING', 'cumsum_raw'): dict(BK=64, num_warps=4)},
    'few_s3': few_programs(num_stages=3), 'few_s1': few_programs(num_stages=1),
    'few_w2': few_programs(num_warps=2), 'few_bv16': few_programs(BV=16),
}
SHAPES = [(1, 32768, 32), (8, 4096, 16), (1, 8192, 96)]


def configure(edits, committed):
    """The committed tables, then ``edits`` on top."""
    for (table, key), entry in committed.items():
        getattr(chunk_ops, table)[key] = dict(entry)
    for (table, key), entry in edits.items():
        getattr(chunk_ops, table)[key] = dict(entry)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--variants', default=','.join(VARIANTS))
    p.add_argument('--rounds', type=int, default=2)
    args = p.parse_args()
    names = args.variants.split(',')
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; expected some of {', '.join(VARIANTS)}")
    committed = {(t, k): dict(getattr(chunk_ops, t)[k])
                 for edits in VARIANTS.values() for t, k in edits}
    time_it = bench._bench_setup(False)
    cases = [(s, gate) for s in SHAPES for gate in (True, False)]
    inputs = {(s, gate): bench._chunk_inputs(*s, gate=gate) for s, gate in cases}

    def call(name, s, gate):
        inp, opts = inputs[s, gate]
        if name == 'beta_given' and gate:
            inp = dict(inp, beta=torch.sigmoid(inp['beta'].float()))
            opts = dict(opts, use_beta_sigmoid_in_kernel=False)
        return lambda: chunk_kda(**inp, **opts)[0]

    first = {}
    times = {}
    with torch.inference_mode():
        for name in names:                      # compile, and compare outputs
            configure(VARIANTS[name], committed)
            for case in cases:
                o = call(name, *case)().float()
                ref = first.setdefault(case, o)
                diff = ((o - ref).norm() / ref.norm()).item()
                if diff:
                    print(f"{name} {case}: outputs differ from {names[0]}'s by {diff:.1e} (relative norm)")
        for _ in range(args.rounds):
            for name in names:
                configure(VARIANTS[name], committed)
                for case in cases:
                    times.setdefault((name, case), []).append(time_it(call(name, *case)))
    configure({}, committed)
    mean = {key: sum(v) / len(v) for key, v in times.items()}
    print('| variant | ' + ' | '.join(f"{s} {'Kimi' if g else 'g'} ms" for s, g in cases) + ' |')
    print('| --- ' * (len(cases) + 1) + '|')
    for name in names:
        cells = [f"{mean[name, c]:.3f}" + ('' if name == names[0] else f" ({mean[name, c] - mean[names[0], c]:+.3f})")
                 for c in cases]
        print(f'| {name} | ' + ' | '.join(cells) + ' |')


if __name__ == '__main__':
    main()
