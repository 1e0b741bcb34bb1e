"""``python -m benchmarks tune``: launch-setting sweeps of our kernels on a GPU.

* ``stages``: for every stage of the chunk launch tables and every candidate below, that entry
  set, one forward + backward step of ``chunk_kda`` (bf16, K = V = 128, l2norm in the kernel) run
  under ``torch.profiler``; reports the stage kernel's GPU time a call. Kernels are first compiled
  by ``--jobs`` parallel processes into a shared Triton cache (compiles are single-threaded and
  dominate the wall time), then timed one candidate at a time. The launcher's own rules still
  apply on top of a candidate (e.g. the state carry's slice halved with fewer programs than SMs),
  so two candidates can time the same kernel; the table prints what was asked for.
* ``forward``: end to end, the inference forward under edited tables (``FORWARD_VARIANTS``), g
  pre-computed and Kimi, every variant in one process, rounds interleaved; each variant's
  outputs compared with the first's (a launch setting may reorder sums). ``stages`` misses the
  inference-only builds and what a kernel costs beside the others; this does not.
  ``beta_given`` is not a setting: the Kimi configuration with beta handed over already activated
  in float32, the bound of what forming beta costs.
* ``segments``: the segmented forward's schedules (``segment_bounds(T, BT, segments, ratio)``,
  ratio > 1: growing segments) against the library's ("lib"), B = 1, both configurations, rounds
  interleaved; every schedule must give the library's bits. ``--timeline`` prints first the
  kernels of ``--calls`` Kimi forwards launched back to back (stream, start, end in us), where
  the later calls show where the GPU itself idles.
* ``decode``: (value columns a program, warps) of the decode kernel at B = 1, 64, 256, eagerly (a
  new final state each step) and as a CUDA-graph replay (state in place, ``out=``); TB/s of the
  state read + written.

Every sweep edits the library's tables through ``tools/kda_internals.py`` and restores them.
"""
from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from . import cases

ROOT = Path(__file__).resolve().parent.parent

# Candidates for the state sweeps' shape-dependent tables, as (table, key): FEW_PROGRAMS (fewer
# programs than SMs) and WIDE_SLICES (the fused forward sweep otherwise, 16-bit inputs,
# K <= 128). Every other stage's candidates go to TUNING under its own name.
STAGE_TABLES = {'state_fwd_few': ('FEW_PROGRAMS', 'state_fwd'), 'state_bwd_few': ('FEW_PROGRAMS', 'state_bwd'),
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


STAGE_CANDIDATES = {
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
    # Square tiles only (the launcher's launch_config says why).
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
    # One stage is not offered for the carry and the gradient sweep: with 16-bit inputs the
    # launcher raises it to 2 (one stage faults on the H200, see tools/uniform_regs.py).
    'state_fwd_few': [cfg(None, 16, 4, 2), cfg(None, 32, 4, 2), cfg(None, 16, 8, 2), cfg(None, 16, 4, 3)],
    'state_bwd_few': [cfg(None, 32, 8, 3), cfg(None, 16, 8, 3), cfg(None, 32, 4, 2), cfg(None, 32, 8, 2)],
    'state_fwd': [cfg(None, 64, 4, 2), cfg(None, 64, 8, 2), cfg(None, 32, 4, 2), cfg(None, 64, 4, 3)],
    'state_bwd': [cfg(None, 64, 4, 2), cfg(None, 64, 8, 2), cfg(None, 32, 4, 2), cfg(None, 64, 4, 3)],
    # The fused forward sweep: at bf16 K = V = 128 steps it launches WIDE_SLICES' setting, so
    # TUNING's entry (float32, V <= 64, K = 256, and the unit the launcher counts programs in) is
    # not swept here: its candidates would all launch the same kernel.
    'state_output_wide': [cfg(None, 128, 8, 2), cfg(None, 128, 8, 1), cfg(None, 128, 8, 3), cfg(None, 64, 4, 1)],
    'state_output_few': [cfg(None, 16, 4, 2), cfg(None, 32, 4, 2), cfg(None, 16, 8, 2), cfg(None, 16, 4, 3),
                         cfg(None, 64, 4, 2), cfg(None, 64, 4, 1), cfg(None, 32, 4, 1)],
}
# (B, T, H, Kimi configuration) a stage is timed at.
STAGE_SHAPES = {stage: [(8, 4096, 16, False)] for stage in STAGE_CANDIDATES}
STAGE_SHAPES['state_fwd'] = STAGE_SHAPES['state_bwd'] = [(8, 4096, 16, False), (1, 8192, 96, False)]
STAGE_SHAPES['state_output_wide'] = [(8, 4096, 16, False), (1, 8192, 96, False)]
STAGE_SHAPES['state_fwd_few'] = STAGE_SHAPES['state_bwd_few'] = STAGE_SHAPES['state_output_few'] = [
    (1, 32768, 32, False)]
# The lower-bound gate compiles the pair gradients without their diagonal fallback.
STAGE_SHAPES['pair_bwd_bounded'] = [(8, 4096, 16, True)]
# The raw gate's builds do the activation (and its gradient) too.
STAGE_SHAPES['gate_bwd_raw'] = STAGE_SHAPES['cumsum_raw'] = STAGE_SHAPES['cumsum_raw_decayed'] = [
    (8, 4096, 16, True)]


def _pair(stage, BK, warps, stages, maxnreg=None):
    return {('TUNING', stage): dict(BK=BK, num_warps=warps, num_stages=stages, maxnreg=maxnreg)}


def _few_programs(**kw):
    return {('FEW_PROGRAMS', 'state_output'): dict(BV=32, num_stages=2) | kw}


# name: {(table, key): entry}; 'main' is the tables as they are.
FORWARD_VARIANTS = {
    'main': {},
    'beta_given': {},
    'pair_s3': _pair('pair_fwd_norms', 32, 1, 3), 'pair_s4': _pair('pair_fwd_norms', 32, 1, 4),
    'pair_bk16': _pair('pair_fwd_norms', 16, 1, 3), 'pair_w2': _pair('pair_fwd_norms', 32, 2, 3),
    'pair_bk64_w4': _pair('pair_fwd_norms', 64, 4, 2),
    # At most 200 registers, 5 one-warp programs fit in the half of an SM's registers that a
    # few-program sweep program leaves (10 an SM alone, against 8 at 255).
    'pair_r200': _pair('pair_fwd_norms', 32, 1, 2, 200), 'pair_r200_s3': _pair('pair_fwd_norms', 32, 1, 3, 200),
    'cumsum_raw_bk128_w4': {('TUNING', 'cumsum_raw'): dict(BK=128, num_warps=4)},
    'cumsum_raw_w4': {('TUNING', 'cumsum_raw'): dict(BK=64, num_warps=4)},
    'few_s3': _few_programs(num_stages=3), 'few_s1': _few_programs(num_stages=1),
    'few_w2': _few_programs(num_warps=2), 'few_bv16': _few_programs(BV=16),
}
FORWARD_SHAPES = [(1, 32768, 32), (8, 4096, 16), (1, 8192, 96)]

DECODE_CANDIDATES = [(32, 4), (16, 2), (16, 4), (32, 2), (32, 8), (64, 4), (64, 8), (8, 1), (8, 2)]
DECODE_TUNED_BATCHES = [1, 64, 256]


def _case(B, T, H):
    return cases.ChunkCase(f"({B}, {T}, {H})", B, T, H)


# --------------------------------------------------------------------------------------------
# stages

def _stage_entry(stage):
    """``(table, key)`` that ``stage``'s candidates replace."""
    return STAGE_TABLES.get(stage, ('TUNING', stage))


def _use_candidate(stage, index):
    """Puts candidate ``index`` of ``stage`` in place; returns the function that puts the old
    entry back."""
    from tools.kda_internals import LAUNCH_TABLES
    name, key = _stage_entry(stage)
    table = LAUNCH_TABLES[name]
    old = table[key]
    table[key] = STAGE_CANDIDATES[stage][index]

    def restore():
        table[key] = old
    return restore


def _training_step(shape):
    """A forward + backward step at ``(B, T, H, kimi)``."""
    import torch

    from kda import chunk_kda
    B, T, H, kimi = shape
    data = cases.chunk_inputs(_case(B, T, H), 'kimi' if kimi else 'g')
    leaves = {n: x.detach().requires_grad_() for n, x in data.tensors.items()}
    do = torch.randn_like(leaves['v'])

    def step():
        o, _ = chunk_kda(**leaves, **data.options)
        o.backward(do)
    return step


def _kernel_ms(stage, step, reps=3):
    import torch
    from torch.profiler import ProfilerActivity, profile
    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            step()
        torch.cuda.synchronize()
    for e in prof.key_averages():
        if e.key.startswith(KERNELS[_stage_entry(stage)[1]]):
            return e.device_time_total / 1e3 / e.count
    return float('nan')


def stages(args, error) -> int:
    import torch
    names = args.stages.split(',')
    unknown = sorted(set(names) - set(STAGE_CANDIDATES))
    if unknown:
        error(f"--stages: unknown {unknown}; expected some of {', '.join(STAGE_CANDIDATES)}")
    todo = [(stage, i, shape) for stage in names for i in range(len(STAGE_CANDIDATES[stage]))
            for shape in STAGE_SHAPES[stage]]
    if args.compile_shard is not None:
        shard, count = map(int, args.compile_shard.split('/'))
        for stage, i, shape in todo[shard::count]:
            restore = _use_candidate(stage, i)
            try:
                _training_step(shape)()
                torch.cuda.synchronize()
            except Exception:  # noqa: BLE001  (reported by the timing pass)
                pass
            restore()
        return 0
    os.environ.setdefault('TRITON_CACHE_DIR', tempfile.mkdtemp(prefix='tune_cache_'))
    t0 = time.time()
    procs = [subprocess.Popen([sys.executable, '-m', 'benchmarks', 'tune', 'stages', '--stages', args.stages,
                               '--compile-shard', f'{i}/{args.jobs}'], env=os.environ, cwd=ROOT)
             for i in range(args.jobs)]
    for proc in procs:
        proc.wait()
    print(f"compiled {len(todo)} configurations in {time.time() - t0:.0f} s", flush=True)
    print('| stage | (B, T, H, Kimi) | BK | BV | warps | stages | maxnreg | kernel ms |')
    print('|' + ' --- |' * 8)
    for stage, i, shape in todo:
        restore = _use_candidate(stage, i)
        try:
            ms = f"{_kernel_ms(stage, _training_step(shape)):.3f}"
        except Exception as e:  # noqa: BLE001
            ms = f"error: {type(e).__name__}: {str(e)[:80]}".replace('\n', ' ')
        restore()
        torch.cuda.empty_cache()
        c = STAGE_CANDIDATES[stage][i]
        print(f"| {stage} | {shape} | {c['BK']} | {c['BV']} | {c['num_warps']} | {c['num_stages']} "
              f"| {c['maxnreg']} | {ms} |", flush=True)
    return 0


# --------------------------------------------------------------------------------------------
# forward

def forward(args, error) -> int:
    import torch

    from kda import chunk_kda
    from tools.kda_internals import LAUNCH_TABLES

    from .timing import FULL, make_bench
    names = args.variants.split(',')
    unknown = sorted(set(names) - set(FORWARD_VARIANTS))
    if unknown:
        error(f"--variants: unknown {unknown}; expected some of {', '.join(FORWARD_VARIANTS)}")
    as_is = {(t, k): dict(LAUNCH_TABLES[t][k]) for edits in FORWARD_VARIANTS.values() for t, k in edits}

    def configure(edits):
        for (table, key), entry in (as_is | edits).items():
            LAUNCH_TABLES[table][key] = dict(entry)

    bench = make_bench(FULL)
    todo = [(shape, config) for shape in FORWARD_SHAPES for config in ('kimi', 'g')]
    inputs = {(s, c): cases.chunk_inputs(_case(*s), c) for s, c in todo}

    def call(name, shape, config):
        data = inputs[shape, config]
        tensors, options = data.tensors, data.options
        if name == 'beta_given' and config == 'kimi':
            tensors = dict(tensors, beta=torch.sigmoid(tensors['beta'].float()))
            options = dict(options, use_beta_sigmoid_in_kernel=False)
        return lambda: chunk_kda(**tensors, **options)[0]

    first, times = {}, {}
    try:
        with torch.inference_mode():
            for name in names:  # compiles, and compares outputs
                configure(FORWARD_VARIANTS[name])
                for case in todo:
                    o = call(name, *case)().float()
                    ref = first.setdefault(case, o)
                    diff = ((o - ref).norm() / ref.norm()).item()
                    if diff:
                        print(f"{name} {case}: outputs differ from {names[0]}'s by {diff:.1e} (relative norm)")
            for _ in range(args.rounds):
                for name in names:
                    configure(FORWARD_VARIANTS[name])
                    for case in todo:
                        times.setdefault((name, case), []).append(bench(call(name, *case)))
    finally:
        configure({})
    mean = {key: sum(v) / len(v) for key, v in times.items()}
    print('| variant | ' + ' | '.join(f"{s} {'Kimi' if c == 'kimi' else 'g'} ms" for s, c in todo) + ' |')
    print('|' + ' --- |' * (len(todo) + 1))
    for name in names:
        cells = [f"{mean[name, c]:.3f}" + ('' if name == names[0] else f" ({mean[name, c] - mean[names[0], c]:+.3f})")
                 for c in todo]
        print(f'| {name} | ' + ' | '.join(cells) + ' |')
    return 0


# --------------------------------------------------------------------------------------------
# segments

def _fixed_schedule(sched, B, T, HV, K, V, layout, *rest):
    """``forward_segments``' stand-in: ``sched = (segments, ratio)`` for ``segment_bounds``."""
    from tools.kda_internals import segment_bounds
    return segment_bounds(T, layout.BT, *sched)


def segments(args, error) -> int:
    import torch

    from kda import chunk_kda
    from tools.kda_internals import (
        chunk_layout,
        forward_segments,
        replaced_forward_segments,
    )

    from .timing import FULL, make_bench
    schedules = [('lib', None)] + [(f'{s}x{r}', (int(s), float(r)))
                                   for s in args.segments.split(',') for r in args.ratios.split(',')]
    try:
        shapes = [tuple(int(x) for x in shape.split(',')) for shape in args.shapes]
    except ValueError:
        error(f"--shapes takes B,T,H triples; got {args.shapes}")
    if any(len(s) != 3 or s[0] != 1 for s in shapes):
        error('the forward is segmented for one sequence only: give shapes B,T,H with B = 1')
    bench = make_bench(FULL)
    for B, T, H in shapes:
        if args.timeline:
            _timeline(B, T, H, args.calls)
        for config in ('g', 'kimi'):
            data = cases.chunk_inputs(_case(B, T, H), config)
            times = {name: [] for name, _ in schedules}
            ref = None
            for _ in range(args.rounds):
                for name, sched in schedules:
                    schedule = forward_segments if sched is None else functools.partial(_fixed_schedule, sched)
                    with replaced_forward_segments(schedule), torch.inference_mode():
                        o = chunk_kda(**data.tensors, **data.options)[0]
                        if ref is None:
                            ref = o
                        elif not torch.equal(o, ref):
                            raise SystemExit(f'({B},{T},{H}) {config} {name}: outputs differ from lib')
                        times[name].append(bench(lambda: chunk_kda(**data.tensors, **data.options)))
            base = sum(times['lib']) / len(times['lib'])
            picked = forward_segments(B, T, H, cases.HEAD_DIM, cases.HEAD_DIM,
                                      chunk_layout(B, T, cases.CHUNK, None, None), None, False,
                                      data.tensors['q'].device)
            print(f'## ({B},{T},{H}) {cases.CONFIG_TITLES[config]}: lib {base:.3f} ms ({picked})')
            for name, ts in sorted(times.items(), key=lambda kv: sum(kv[1])):
                ms = sum(ts) / len(ts)
                print(f'{name:>8} {ms:.3f} ms ({ms - base:+.3f})  rounds ' + ' '.join(f'{t:.3f}' for t in ts))
            data = ref = None
            torch.cuda.empty_cache()
    return 0


def _timeline(B, T, H, calls):
    """Prints the kernels of ``calls`` Kimi inference forwards at (B, T, H), launched back to back,
    in the order they started."""
    import torch

    from kda import chunk_kda
    data = cases.chunk_inputs(_case(B, T, H), 'kimi')
    with torch.inference_mode():
        for _ in range(3):
            chunk_kda(**data.tensors, **data.options)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                chunk_kda(**data.tensors, **data.options)
            torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix='.json') as f:
        prof.export_chrome_trace(f.name)
        with open(f.name) as trace:
            events = json.load(trace)['traceEvents']
    kernels = sorted((e for e in events if e.get('cat') == 'kernel'), key=lambda e: e['ts'])
    t0 = kernels[0]['ts']
    print(f'## timeline ({B},{T},{H}) {calls} Kimi inference forwards: stream start end dur (us) kernel')
    for e in kernels:
        print(f"{e['args'].get('stream', '?'):>4} {e['ts'] - t0:8.1f} {e['ts'] + e['dur'] - t0:8.1f} "
              f"{e['dur']:7.1f} {e['name'][:60]}")


# --------------------------------------------------------------------------------------------
# decode

def decode(args, error) -> int:
    import torch
    import triton.testing

    from kda import fused_recurrent_kda
    from tools.kda_internals import DECODE_TUNING

    from .floors import decode_state_bytes
    from .timing import graph_replay_ms

    def time_us(fn):
        return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode='median') * 1e3

    as_is = dict(DECODE_TUNING)
    print('| BV | warps | B | eager us | graph us | graph TB/s |')
    print('|' + ' --- |' * 6)
    try:
        with torch.inference_mode():
            for BV, warps in DECODE_CANDIDATES:
                DECODE_TUNING.update(BV=BV, num_warps=warps)
                for B in DECODE_TUNED_BATCHES:
                    data = cases.decode_inputs(B)
                    eager = time_us(lambda: fused_recurrent_kda(**data.kwargs, initial_state=data.state,
                                                                output_final_state=True))
                    state, out = data.state.clone(), torch.empty_like(data.kwargs['v'])
                    graph = graph_replay_ms(lambda: fused_recurrent_kda(
                        **data.kwargs, initial_state=state, output_final_state=True, inplace_final_state=True,
                        out=out), lambda f: time_us(f) / 1e3) * 1e3
                    print(f"| {BV} | {warps} | {B} | {eager:.1f} | {graph:.1f} | "
                          f"{decode_state_bytes(B) / (graph * 1e-6) / 1e12:.2f} |", flush=True)
    finally:
        DECODE_TUNING.update(as_is)
    return 0


SWEEPS = {'stages': stages, 'forward': forward, 'segments': segments, 'decode': decode}


def main(args, error) -> int:
    import torch
    if not torch.cuda.is_available():
        print(f"python -m benchmarks tune {args.sweep} needs a CUDA GPU (none found): it times launch "
              "settings of our kernels. Nothing measured.", file=sys.stderr)
        return 2
    return SWEEPS[args.sweep](args, error)
