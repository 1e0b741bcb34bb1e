"""``python -m benchmarks compare``: A/B timing of versions of ``kda`` on one GPU, on the run's
inputs, then a bit-for-bit comparison of their outputs and gradients.

    python -m benchmarks compare A=<rev or dir> B=. [--same-process] [--modes fwd,fwdbwd]
                                 [--shapes 0,4] [--rounds 2] [--head-dims 128,64] [--dtype fp32]

A version is a folder holding a ``kda/`` package (``.`` is the working tree) or a git revision,
whose ``kda/`` is extracted with ``git archive`` into a temporary folder. Rounds interleave the
versions so that drift of the card's clock spreads over all of them:

* by default each round starts one process a version (their module names collide), in the
  order given;
* ``--same-process``: every version imported into one process (each ``kda`` loaded under its own
  copy of the module tree) and timed round by round there.

Each (mode, shape) is timed with the run's ``do_bench`` settings (median); the table gives each
version's mean over the rounds and, for the later versions, the difference from the first.
Modes: ``fwd`` (inference), ``fwdbwd`` (forward + backward), with ``-kimi`` the Kimi
configuration. Shapes: indices into the five benchmark shapes (the last is the varlen batch).
The bit comparison covers ``o`` under inference, and in training ``o``, the final state and every
input's gradient, both configurations, on a small varlen batch.
"""
from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from . import cases

MODES = ('fwd', 'fwd-kimi', 'fwdbwd', 'fwdbwd-kimi')
# The inputs' dtype (q, k, v, and beta and the raw gate where the run gives them in bf16).
DTYPES = {'bf16': 'bfloat16', 'fp32': 'float32'}
ROOT = Path(__file__).resolve().parent.parent
COMPARED_CASE = cases.ChunkCase('varlen (700, 1500, 800), H = 8', 1, 3000, 8, (700, 1500, 800))


def resolve_version(spec: str, scratch: Path) -> str:
    """A folder holding ``kda/`` as given, else a git revision extracted under ``scratch``."""
    if (Path(spec) / 'kda' / '__init__.py').exists():
        return str(Path(spec).resolve())
    dest = scratch / spec.replace('/', '_')
    dest.mkdir(parents=True, exist_ok=True)
    try:
        archive = subprocess.run(['git', 'archive', spec, 'kda'], cwd=ROOT, capture_output=True, check=True)
    except (OSError, subprocess.CalledProcessError) as e:
        raise SystemExit(f"version {spec!r}: neither a folder holding kda/ nor a git revision ({e})") from None
    subprocess.run(['tar', '-x', '-C', str(dest)], input=archive.stdout, check=True)
    return str(dest)


def import_kda_from(tree: str):
    """``kda.chunk_kda`` of the ``kda`` under ``tree``, imported afresh; the module tree is taken out
    of ``sys.modules`` again so that another version can be imported beside it."""
    def drop():
        for name in [m for m in sys.modules if m == 'kda' or m.startswith('kda.')]:
            del sys.modules[name]
    drop()
    sys.path.insert(0, tree)
    try:
        kda = importlib.import_module('kda')
    finally:
        sys.path.remove(tree)
    if not kda.__file__.startswith(tree):
        raise SystemExit(f"imported {kda.__file__}, not the kda under {tree}")
    chunk_kda = kda.chunk_kda
    drop()
    return chunk_kda


def _inputs(case, mode: str, dims, dtype: str):
    import torch
    return cases.chunk_inputs(case, 'kimi' if mode.endswith('kimi') else 'g', K=dims[0], V=dims[1],
                              dtype=getattr(torch, DTYPES[dtype]))


def time_modes(chunk_kda, modes, picked, dims, dtype, bench) -> dict:
    """``{'mode shape': ms}`` for every mode and picked shape."""
    import torch
    shapes = cases.chunk_cases()
    times = {}
    for mode in modes:
        for i in picked:
            data = _inputs(shapes[i], mode, dims, dtype)
            if not mode.startswith('fwdbwd'):
                with torch.inference_mode():
                    ms = bench(lambda: chunk_kda(**data.tensors, **data.options))
            else:
                leaves = {n: x.detach().requires_grad_() for n, x in data.tensors.items()}
                do = torch.randn_like(data.tensors['v'])

                def step():
                    o, _ = chunk_kda(**leaves, **data.options)
                    o.backward(do)
                ms = bench(step, grad_to_none=list(leaves.values()))
                leaves = do = None
            times[f'{mode} {shapes[i].label}'] = ms
            data = None
            torch.cuda.empty_cache()
    return times


def outputs(chunk_kda, dims, dtype) -> dict:
    """The tensors the bit comparison covers, on ``COMPARED_CASE``."""
    import torch
    out = {}
    for mode in ('fwd', 'fwd-kimi'):
        data = _inputs(COMPARED_CASE, mode, dims, dtype)
        with torch.inference_mode():
            out[f'{mode} o inference'] = chunk_kda(**data.tensors, **data.options)[0]
        leaves = {n: x.detach().requires_grad_() for n, x in data.tensors.items()}
        o, ht = chunk_kda(**leaves, **data.options, output_final_state=True)
        (o.float().square().sum() + ht.sum()).backward()
        out[f'{mode} o'], out[f'{mode} ht'] = o.detach(), ht.detach()
        out.update({f'{mode} d{n}': x.grad for n, x in leaves.items()})
    return out


def differing(first: dict, other: dict) -> list[str]:
    """Names of the tensors that differ in any bit."""
    import torch
    return [n for n in first if not torch.equal(first[n], other[n])]


def worker(args, modes, picked, dims) -> int:
    """One version in this process: prints its times as one JSON line, saves its outputs."""
    import torch

    from .timing import FULL, make_bench
    chunk_kda = import_kda_from(str(Path(args.worker).resolve()))
    times = time_modes(chunk_kda, modes, picked, dims, args.dtype, make_bench(FULL))
    if args.save:
        torch.save(outputs(chunk_kda, dims, args.dtype), args.save)
    print('AB ' + json.dumps(times), flush=True)
    return 0


def print_table(times: dict, labels: list[str], saved: dict) -> None:
    base = labels[0]
    print('\n| mode, shape | ' + ' | '.join(f'{x} ms' for x in labels)
          + ''.join(f' | {x} - {base}' for x in labels[1:]) + ' |')
    print('|' + ' --- |' * (2 * len(labels)))
    for key in times[base]:
        mean = {x: sum(times[x][key]) / len(times[x][key]) for x in labels}
        print(f'| {key} | ' + ' | '.join(f'{mean[x]:.4f}' for x in labels)
              + ''.join(f' | {mean[x] - mean[base]:+.4f}' for x in labels[1:]) + ' |')
    for x in labels[1:]:
        differ = differing(saved[base], saved[x])
        print(f"\n{x} against {base}: " + (f"differ in {', '.join(differ)}" if differ
                                              else "outputs and gradients bit for bit the same"))


def in_processes(versions: dict, args, modes, picked, scratch: Path) -> None:
    import torch
    times = {label: {} for label in versions}
    saves = {}
    for r in range(args.rounds):
        for label, tree in versions.items():
            cmd = [sys.executable, '-m', 'benchmarks', 'compare', '--worker', tree, '--modes', ','.join(modes),
                   '--shapes', ','.join(map(str, picked)), '--head-dims', args.head_dims, '--dtype', args.dtype]
            if r == 0:
                saves[label] = str(scratch / f'{label}.pt')
                cmd += ['--save', saves[label]]
            run = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=False)
            line = [x for x in run.stdout.splitlines() if x.startswith('AB ')]
            if run.returncode != 0 or not line:
                raise SystemExit(f"{label} (round {r}) failed:\n{run.stderr[-3000:]}")
            result = json.loads(line[-1][3:])
            for key, ms in result.items():
                times[label].setdefault(key, []).append(ms)
            print(f"round {r} {label}: " + ', '.join(f'{k} {v:.4f}' for k, v in result.items()), flush=True)
    print_table(times, list(versions), {label: torch.load(path) for label, path in saves.items()})


def in_one_process(versions: dict, args, modes, picked, dims) -> None:
    from .timing import FULL, make_bench
    fns = {label: import_kda_from(tree) for label, tree in versions.items()}
    bench = make_bench(FULL)
    saved = {label: outputs(fn, dims, args.dtype) for label, fn in fns.items()}
    times = {label: {} for label in versions}
    for r in range(args.rounds):
        for label, fn in fns.items():
            result = time_modes(fn, modes, picked, dims, args.dtype, bench)
            for key, ms in result.items():
                times[label].setdefault(key, []).append(ms)
            print(f"round {r} {label}: " + ', '.join(f'{k} {v:.4f}' for k, v in result.items()), flush=True)
    print_table(times, list(versions), saved)


def parse(args, error):
    """(modes, picked shape indices, (K, V)) from the options, ``error`` on a bad one."""
    modes = [m for m in args.modes.split(',') if m]
    if not modes or any(m not in MODES for m in modes):
        error(f"--modes takes some of {', '.join(MODES)}; got {args.modes!r}")
    count = len(cases.chunk_cases())
    try:
        picked = list(range(count)) if args.shapes is None else [int(i) for i in args.shapes.split(',')]
    except ValueError:
        picked = [-1]
    if any(not 0 <= i < count for i in picked):
        error(f"--shapes takes indices 0..{count - 1}; got {args.shapes!r}")
    try:
        dims = tuple(int(x) for x in args.head_dims.split(','))
    except ValueError:
        dims = ()
    if len(dims) != 2:
        error(f"--head-dims takes two integers K,V; got {args.head_dims!r}")
    return modes, picked, dims


def main(args, error) -> int:
    modes, picked, dims = parse(args, error)
    if args.worker is not None:
        return worker(args, modes, picked, dims)
    if len(args.versions) < 2 or any('=' not in v for v in args.versions):
        error("give at least two versions as LABEL=REV or LABEL=DIR")
    import torch
    if not torch.cuda.is_available():
        print("python -m benchmarks compare needs a CUDA GPU (none found); it would time "
              f"{', '.join(modes)} at shapes {picked} for {', '.join(args.versions)}. Nothing measured.",
              file=sys.stderr)
        return 2
    scratch = Path(tempfile.mkdtemp(prefix='kda-compare-'))
    versions = {label: resolve_version(spec, scratch) for label, spec in (v.split('=', 1) for v in args.versions)}
    os.environ.setdefault('PYTHONUNBUFFERED', '1')
    if args.same_process:
        in_one_process(versions, args, modes, picked, dims)
    else:
        in_processes(versions, args, modes, picked, scratch)
    return 0
