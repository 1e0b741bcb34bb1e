"""``python -m benchmarks run``: times ours beside FLA (and FlashKDA) and writes the results record
(JSON) and the page made from it (``report.render``).

Parts, each a section of the record:

* ``fwd`` / ``fwd-kimi``: ``chunk_kda`` forward under ``torch.inference_mode`` at the five shapes,
  g pre-computed / Kimi configuration; FlashKDA beside in the Kimi one. Each other library's
  output is compared with ours: ``||o_x - o_ours|| / ||o_ours||``.
* ``fwdbwd`` / ``fwdbwd-kimi``: forward + ``o.backward(do)``, the leaves' gradients reset by
  ``do_bench`` (``grad_to_none``).
* ``profile`` / ``profile-kimi``: GPU time a kernel of one forward + backward step of ours at
  (8, 4096, 16) (``torch.profiler``, mean of 3 steps).
* ``decode``: ``fused_recurrent_kda`` steps (T = 1, H = 32, float32 state, a new final state each
  step) at B = 1 .. 1024, the Kimi configuration at B = 1 and 64, and a CUDA-graph replay of the
  B = 1 step updating the state in place into a preallocated ``out=`` (FLA's
  ``fused_recurrent_kda_fwd``). The first case is timed once more ahead and dropped: the first
  host-bound case timed in a process reads slow for every library.
* ``throughput``: forward tokens/s at B * T = 32768, H = 32, T = 2048 .. 32768 (the plot).
* ``layer``: the KDA layer (``kda.layers.KimiDeltaAttention``) beside FLA's with the same weights:
  a training step and decode steps from a cache (``layer.py``).
* ``serving``: state pools addressed by slot indices: decode through bf16 and float32 pools, 32
  steps in one CUDA graph, prefill into the pool against gather + call + scatter, speculative
  decode against single steps (``serving.py``).
* ``compile``: a Kimi training step and a decode step of ours, eager beside ``torch.compile``
  and (decode) ``mode='reduce-overhead'`` (``compile.py``).

Each chunk row also holds the allocator peak of one call (inputs included) and the time floor
(``floors.py``).
"""
from __future__ import annotations

import datetime
import json
import subprocess
import sys
import time
from pathlib import Path

from . import cases, layer, serving
from . import compile as compile_part
from .floors import (
    BYTES_PER_S,
    FLOPS_PER_S,
    chunk_floor_ms,
    decode_floor_us,
    decode_state_bytes,
)

PARTS = ('fwd', 'fwd-kimi', 'fwdbwd', 'fwdbwd-kimi', 'profile', 'profile-kimi', 'decode', 'throughput', 'layer',
         'serving', 'compile')
ROOT = Path(__file__).resolve().parent.parent
DEFAULT_JSON = ROOT / 'benchmarks' / 'results.json'
DEFAULT_PAGE = ROOT / 'BENCHMARKS.md'
PROFILE_CASE = cases.ChunkCase('(8, 4096, 16)', 8, 4096, 16)
# Bound on ||o_x - o_ours|| / ||o_ours|| for two bf16 forwards of the same inputs to count as
# agreeing: ours and FLA's differ by ~5e-3 (two roundings of a bf16 output); FlashKDA keeps
# its state in bf16 between chunks, which may add to it.
AGREEMENT_BOUND = 2e-2


def describe(parts, quick: bool) -> list[str]:
    """What a run of ``parts`` would time, one line a part (``--dry-run``, the no-GPU message)."""
    shapes = quick_cases(quick, backward=False)
    labels = ', '.join(c.label for c in shapes)
    training_labels = ', '.join(c.label for c in quick_cases(quick, backward=True))
    lines = {
        'fwd': f"fwd: chunk_kda forward, g pre-computed, ours and FLA at {labels}",
        'fwd-kimi': f"fwd-kimi: chunk_kda forward, Kimi configuration, ours, FLA and FlashKDA at {labels}",
        'fwdbwd': f"fwdbwd: chunk_kda forward + backward, g pre-computed, ours and FLA at {training_labels}",
        'fwdbwd-kimi': ("fwdbwd-kimi: chunk_kda forward + backward, Kimi configuration, ours and FLA at "
                        f"{training_labels}"),
        'profile': f"profile: per-kernel GPU time of ours, one training step at {PROFILE_CASE.label}",
        'profile-kimi': "profile-kimi: the same in the Kimi configuration",
        'decode': (f"decode: fused_recurrent_kda step, H = {cases.DECODE_H}, B = "
                   f"{', '.join(map(str, decode_batches(quick)))}, Kimi at B = "
                   f"{', '.join(map(str, cases.DECODE_KIMI_BATCHES))}, CUDA-graph replay at B = 1, ours and FLA"),
        'throughput': (f"throughput: forward Mtok/s at B * T = {cases.PLOT_TOKENS}, H = {cases.PLOT_H}, "
                       f"T = {', '.join(map(str, throughput_lengths(quick)))}, ours and FLA (the plot)"),
        'layer': (f"layer: KimiDeltaAttention, hidden {layer.HIDDEN}, H = {layer.HEADS}, training step at "
                  f"({layer.train_batch(quick)}, {layer.TRAIN_T}), decode step at B = "
                  f"{', '.join(map(str, layer.decode_batches(quick)))} (eager and CUDA graph), ours and FLA"),
        'serving': (f"serving: state pools, H = {serving.DECODE_H}: decode step at B = "
                    f"{', '.join(map(str, serving.pool_batches(quick)))} (bf16 and float32 pools), "
                    f"{serving.GRAPH_LAYERS} steps at B = 1 in one CUDA graph, prefill N x T = "
                    f"{', '.join(f'{N} x {T}' for N, T in serving.prefill_cases(quick))} into the pool against "
                    f"gather + call + scatter, speculative T = {serving.SPEC_T} at N = {serving.SPEC_N} against "
                    f"{serving.SPEC_T} single steps, ours and FLA"),
        'compile': (f"compile: ours eager against torch.compile, Kimi training step at (1, "
                    f"{compile_part.QUICK_TRAIN_T if quick else compile_part.TRAIN_T}), decode step into a pool "
                    f"at B = {', '.join(map(str, compile_part.DECODE_BATCHES))} (also mode='reduce-overhead')"),
    }
    return [lines[p] for p in parts]


def quick_cases(quick: bool, backward: bool) -> list[cases.ChunkCase]:
    """The five shapes; with ``quick`` the first (and the varlen batch for the forward)."""
    shapes = cases.chunk_cases()
    if not quick:
        return shapes
    return shapes[:1] if backward else shapes[:1] + shapes[-1:]


def decode_batches(quick: bool) -> list[int]:
    return [1, 64] if quick else cases.DECODE_BATCHES


def throughput_lengths(quick: bool) -> list[int]:
    return [2048, 8192, 32768] if quick else cases.PLOT_T


def git_commit() -> str:
    """Short hash of HEAD, ``+dirty`` when tracked files differ; ``unknown`` without git."""
    try:
        head = subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(['git', 'status', '--porcelain', '--untracked-files=no'], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return 'unknown'
    return head + ('+dirty' if dirty else '')


# --------------------------------------------------------------------------------------------
# Chunk tables

def _time_chunk(fn, data, backward, bench):
    """(ms, peak GiB) of ``fn`` on ``data`` (``cases.ChunkInputs``)."""
    import torch

    from .timing import peak_gib
    if not backward:
        def call():
            return fn(**data.tensors, **data.options)
        with torch.inference_mode():
            return bench(call), peak_gib(call)
    # The leaves share the inputs' storage: the inputs are counted once in the peak.
    leaves = {n: x.detach().requires_grad_() for n, x in data.tensors.items()}
    do = torch.randn_like(data.tensors['v'])

    def step():
        o, _ = fn(**leaves, **data.options)
        o.backward(do)
    ms = bench(step, grad_to_none=list(leaves.values()))
    for x in leaves.values():
        x.grad = None
    return ms, peak_gib(step)


def _relative_diffs(impls, data):
    """``||o_x - o_ours|| / ||o_ours||`` for every other implementation that ran."""
    import torch
    diffs = {}
    with torch.inference_mode():
        ref = impls['ours'](**data.tensors, **data.options)[0].float()
        for name, fn in impls.items():
            if name == 'ours':
                continue
            try:
                o = fn(**data.tensors, **data.options)[0].float()
                diffs[name] = ((o - ref).norm() / ref.norm()).item()
            except Exception:  # noqa: BLE001  (its timing cell already holds the error)
                pass
            o = None
    return diffs


def chunk_section(impls: dict, config: str, backward: bool, bench, quick: bool, commit: str) -> dict:
    """One chunk table: ``impls`` maps a name to a ``chunk_kda``-like function or to an error."""
    from .timing import error_text, free_memory
    rows = []
    for case in quick_cases(quick, backward):
        t0 = time.time()
        data = cases.chunk_inputs(case, config)
        row = dict(case=case.label, B=case.B, T=case.T, H=case.H,
                   lengths=list(case.lengths) if case.lengths else None, ms={}, peak_gib={}, errors={})
        for name, fn in impls.items():
            if isinstance(fn, str):
                row['errors'][name] = fn
                continue
            try:
                row['ms'][name], row['peak_gib'][name] = _time_chunk(fn, data, backward, bench)
            except Exception as e:  # noqa: BLE001
                row['errors'][name] = error_text(e)
            free_memory()
        runnable = {n: f for n, f in impls.items() if not isinstance(f, str) and n not in row['errors']}
        if not backward and 'ours' in runnable:
            row['rel_diff_vs_ours'] = _relative_diffs(runnable, data)
        floor = chunk_floor_ms(case.tokens, case.H, backward=backward)
        row['floor_ms'] = dict(bytes=floor.bytes_part, flops=floor.flops_part)
        rows.append(row)
        data = None
        free_memory()
        print(f"  [{time.time() - t0:.0f} s] {case.label}: "
              + ', '.join(f"{n} {v:.3f} ms" for n, v in row['ms'].items())
              + ''.join(f"; {n}: {e}" for n, e in row['errors'].items()), file=sys.stderr, flush=True)
    return dict(kind='chunk', mode='fwdbwd' if backward else 'fwd', config=config, commit=commit,
                implementations=list(impls), rows=rows)


# --------------------------------------------------------------------------------------------
# Profile, decode, throughput

def profile_section(chunk_fn, config: str, commit: str, steps: int = 3) -> dict:
    """GPU time a kernel of one forward + backward step of ours at ``PROFILE_CASE``."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    data = cases.chunk_inputs(PROFILE_CASE, config)
    leaves = {n: x.detach().requires_grad_() for n, x in data.tensors.items()}
    do = torch.randn_like(data.tensors['v'])

    def step():
        for x in leaves.values():  # as do_bench's grad_to_none: no accumulation into .grad
            x.grad = None
        o, _ = chunk_fn(**leaves, **data.options)
        o.backward(do)
    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    events = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)
    rows = [dict(kernel=e.key, ms=e.device_time_total / steps / 1e3, launches=e.count // steps)
            for e in events if e.device_time_total > 0]
    return dict(kind='profile', config=config, commit=commit, case=PROFILE_CASE.label, rows=rows)


def decode_section(ours, fla, bench, quick: bool, commit: str) -> dict:
    """The decode table (see the module docstring); times in us."""
    import torch

    from .timing import error_text, free_memory, graph_replay_ms
    impls = {'ours': ours.recurrent or ours.description, 'FLA': fla.recurrent or fla.description}
    todo = [dict(case=str(B), B=B, config='g') for B in decode_batches(quick)]
    todo += [dict(case=f"{B}, Kimi configuration", B=B, config='kimi') for B in cases.DECODE_KIMI_BATCHES]
    rows = []

    def finish(row):
        floor = decode_floor_us(row['B'])
        row.update(floor_us=dict(bytes=floor.bytes_part, flops=floor.flops_part),
                   state_bytes=decode_state_bytes(row['B']))
        rows.append(row)

    with torch.inference_mode():
        for i, spec in enumerate([todo[0]] + todo):
            data = cases.decode_inputs(spec['B'], spec['config'])
            row = dict(spec, graph=False, us={}, errors={})
            for name, fn in impls.items():
                if isinstance(fn, str):
                    row['errors'][name] = fn
                    continue
                try:
                    row['us'][name] = bench(lambda fn=fn: fn(**data.kwargs, initial_state=data.state,
                                                             output_final_state=True)) * 1e3
                except Exception as e:  # noqa: BLE001
                    row['errors'][name] = error_text(e)
            if i > 0:
                finish(row)
            data = None
            free_memory()

        data = cases.decode_inputs(1)
        steps = {'ours': (ours.recurrent, ours), 'FLA': (fla.extras.get('serving_step'), fla)}
        row = dict(case='1, CUDA graph, state in place, out=', B=1, config='g', graph=True, us={}, errors={})
        for name, (fn, lib) in steps.items():
            if fn is None:
                row['errors'][name] = lib.description if not lib.available else 'no in-place step'
                continue
            state, out = data.state.clone(), torch.empty_like(data.kwargs['v'])
            try:
                row['us'][name] = graph_replay_ms(
                    lambda fn=fn, state=state, out=out: fn(**data.kwargs, initial_state=state, output_final_state=True,
                                                           inplace_final_state=True, out=out), bench) * 1e3
            except Exception as e:  # noqa: BLE001
                row['errors'][name] = error_text(e)
        finish(row)
        data = None
        free_memory()
    return dict(kind='decode', commit=commit, H=cases.DECODE_H, implementations=list(impls), rows=rows)


def throughput_section(impls: dict, bench, quick: bool, commit: str) -> dict:
    """Forward ms at B * T = ``PLOT_TOKENS`` for each T, g pre-computed."""
    import torch

    from .timing import error_text, free_memory
    rows = []
    for T in throughput_lengths(quick):
        B = cases.PLOT_TOKENS // T
        data = cases.chunk_inputs(cases.ChunkCase(f"({B}, {T}, {cases.PLOT_H})", B, T, cases.PLOT_H))
        row = dict(T=T, B=B, ms={}, errors={})
        for name, fn in impls.items():
            if isinstance(fn, str):
                row['errors'][name] = fn
                continue
            try:
                with torch.inference_mode():
                    row['ms'][name] = bench(lambda fn=fn: fn(**data.tensors, **data.options))
            except Exception as e:  # noqa: BLE001
                row['errors'][name] = error_text(e)
        rows.append(row)
        data = None
        free_memory()
    return dict(kind='throughput', commit=commit, tokens=cases.PLOT_TOKENS, H=cases.PLOT_H,
                implementations=list(impls), rows=rows)


# --------------------------------------------------------------------------------------------

def no_gpu_message(parts) -> str:
    return ("python -m benchmarks run needs a CUDA GPU and found none: it would time ours beside FLA "
            f"and FlashKDA ({', '.join(parts)}: chunk_kda forward and forward + backward at the five "
            "shapes, fused_recurrent_kda decode, forward throughput, the layer, state pools, torch.compile) "
            "and write the results JSON and BENCHMARKS.md; --dry-run lists every case. Nothing measured.")


def main(args) -> int:
    parts = args.parts
    if args.dry_run:
        print(f"would write {args.json} and {args.page}; implementations: ours (kda), FLA (fla.ops.kda, "
              f"own kernels: {' '.join(f'{k}={v}' for k, v in sorted(_fla_env().items()))}), FlashKDA "
              "(flash_kda) in fwd-kimi")
        for line in describe(parts, args.quick):
            print('  ' + line)
        return 0
    import torch
    if not torch.cuda.is_available():
        print(no_gpu_message(parts), file=sys.stderr)
        return 2
    return measure(args, parts)


def _fla_env() -> dict:
    from .libraries import FLA_OWN_KERNELS
    return FLA_OWN_KERNELS


def measure(args, parts) -> int:
    import torch
    import triton

    from . import libraries, report
    from .timing import FULL, QUICK, error_text, free_memory, make_bench, raise_clocks

    if args.warm_fla and not args.no_fla:
        from . import fla_warmup
        fla_warmup.warm_in_parallel(parts, args.warm_seconds, args.fla_picks)
    ours = libraries.load_ours()
    fla = libraries.Library('FLA', 'FLA not run (--no-fla)') if args.no_fla else libraries.load_fla()
    flashkda = (libraries.Library('FlashKDA', 'FlashKDA not run (--no-flashkda)') if args.no_flashkda
                else libraries.load_flashkda())
    settings = QUICK if args.quick else FULL
    bench = make_bench(settings)
    commit = git_commit()
    record = dict(
        format=1,
        command='python -m benchmarks run' + ''.join(f' {a}' for a in args.argv),
        commit=commit,
        date=datetime.date.today().isoformat(),
        gpu=f"{torch.cuda.get_device_name()} ({torch.cuda.get_device_properties(0).multi_processor_count} SMs)",
        versions=dict(torch=torch.__version__, triton=triton.__version__,
                      FLA=libraries.package_version('fla') if fla.available else None,
                      FlashKDA=libraries.package_version('flash_kda') if flashkda.available else None),
        libraries={lib.name: lib.description for lib in (ours, fla, flashkda)},
        fla_environment=dict(libraries.FLA_OWN_KERNELS),
        timing=settings.describe(),
        ceilings=dict(bytes_per_s=BYTES_PER_S, flops_per_s=FLOPS_PER_S),
        agreement_bound=AGREEMENT_BOUND,
        sections=[],
    )
    print(f"{record['gpu']}; " + '; '.join(record['libraries'].values()), flush=True)

    def chunk_impls(config, backward):
        impls = {'ours': ours.chunk or ours.description,
                 'FLA': fla.chunk or fla.description}
        if backward and args.fla_forward_only:
            impls['FLA'] = 'not run (--fla-forward-only)'
        if config == 'kimi' and not backward:
            impls['FlashKDA'] = flashkda.chunk or flashkda.description
        return impls

    makers = {
        'fwd': lambda: chunk_section(chunk_impls('g', False), 'g', False, bench, args.quick, commit),
        'fwd-kimi': lambda: chunk_section(chunk_impls('kimi', False), 'kimi', False, bench, args.quick, commit),
        'fwdbwd': lambda: chunk_section(chunk_impls('g', True), 'g', True, bench, args.quick, commit),
        'fwdbwd-kimi': lambda: chunk_section(chunk_impls('kimi', True), 'kimi', True, bench, args.quick, commit),
        'profile': lambda: profile_section(ours.chunk, 'g', commit),
        'profile-kimi': lambda: profile_section(ours.chunk, 'kimi', commit),
        'decode': lambda: decode_section(ours, fla, bench, args.quick, commit),
        'throughput': lambda: throughput_section(chunk_impls('g', False), bench, args.quick, commit),
        'layer': lambda: layer.layer_section(ours, fla, bench, args.quick, commit),
        'serving': lambda: serving.serving_section(ours, fla, bench, args.quick, commit),
        'compile': lambda: compile_part.compile_section(bench, args.quick, commit),
    }
    raise_clocks()
    json_path, page_path = Path(args.json), Path(args.page)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    failed = False
    for part in parts:
        t0 = time.time()
        try:
            section = makers[part]()
        except Exception as e:  # noqa: BLE001
            section = dict(kind='failed', part=part, commit=commit, error=error_text(e, 400))
            failed = True
            free_memory()
        record['sections'].append(section)
        print(f"{part}: {time.time() - t0:.0f} s", flush=True)
        # written after every part, so that a run cut short keeps what it measured
        json_path.write_text(json.dumps(record, indent=1) + '\n')
        report.write_page(record, json_path, page_path)
    print(f"written: {json_path}, {page_path}")
    return 1 if failed else 0
