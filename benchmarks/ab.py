"""A/B timing of versions of ``kda`` on one GPU, each version in processes of its own (their
module names collide), on ``bench.py``'s inputs; then a bit-for-bit comparison of their outputs
and gradients on a small varlen batch.

    git archive <rev> kda | tar -x -C <dir>         (a folder per version; carry it to the GPU)
    python benchmarks/ab.py A=<dir> B=. [--modes fwd,fwdbwd] [--shapes 0,4] [--rounds 2]
                            [--head-dims 128,64] [--dtype fp32]

A folder holds a ``kda/`` package; ``.`` is the working tree. Each round starts one process per
version, in the order given, and times every (mode, shape) with ``bench.py``'s ``do_bench``
settings (median). The table gives each version's mean over the rounds and, for the later
versions, the difference from the first. Modes: ``fwd`` (inference), ``fwdbwd`` (forward +
backward), with the ``gate_`` prefix the Kimi configuration. Shapes: ``bench.py``'s
``CHUNK_SHAPES`` by index, then the varlen batch. The comparison covers ``o`` under inference,
``o``, the final state and every input's gradient in training, both configurations. Written
because the session that first needed it lost its scratch copy with the checkout.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent
MODES = ('fwd', 'gate_fwd', 'fwdbwd', 'gate_fwdbwd')
# --dtype: the inputs' dtype (q, k, v, and beta and the raw gate where bench.py gives them in bf16).
DTYPES = {'bf16': 'bfloat16', 'fp32': 'float32'}


def shapes():
    """``(name, B, T, H, lengths)`` of bench.py's chunk shapes, then its varlen batch."""
    sys.path.insert(0, str(BENCHMARKS))
    from bench import CHUNK_SHAPES, VARLEN_H, VARLEN_LENGTHS
    out = [(str(s), *s, None) for s in CHUNK_SHAPES]
    return out + [('varlen', 1, sum(VARLEN_LENGTHS), VARLEN_H, VARLEN_LENGTHS)]


def worker(tree: str, modes: list[str], picked: list[int], save: str | None,
           dims: tuple[int, int] = (128, 128), dtype: str = 'bf16'):
    """Times ``modes`` x ``picked`` shapes with the ``kda`` under ``tree``; prints one JSON line."""
    tree = str(Path(tree).resolve())
    sys.path.insert(0, tree)
    import torch
    import kda
    if not kda.__file__.startswith(tree):
        raise SystemExit(f"imported {kda.__file__}, not the kda under {tree}")
    from kda import chunk_kda
    sys.path.insert(1, str(BENCHMARKS))
    from bench import _bench_setup, _chunk_inputs
    dtype = getattr(torch, DTYPES[dtype])
    bench = _bench_setup(False)
    times = {}
    for mode in modes:
        for i in picked:
            name, B, T, H, lengths = shapes()[i]
            inp, opts = _chunk_inputs(B, T, H, lengths, gate=mode.startswith('gate'), K=dims[0],
                                      V=dims[1], dtype=dtype)
            if 'bwd' not in mode:
                with torch.inference_mode():
                    ms = bench(lambda: chunk_kda(**inp, **opts))
            else:
                leaves = {n: x.detach().requires_grad_() for n, x in inp.items()}
                do = torch.randn_like(inp['v'])

                def step():
                    o, _ = chunk_kda(**leaves, **opts)
                    o.backward(do)
                ms = bench(step, grad_to_none=list(leaves.values()))
                del leaves, do
            times[f'{mode} {name}'] = ms
            del inp
            torch.cuda.empty_cache()
    if save:
        out = {}
        for gate in (False, True):
            inp, opts = _chunk_inputs(1, 3000, 8, [700, 1500, 800], gate=gate, K=dims[0], V=dims[1],
                                      dtype=dtype)
            with torch.inference_mode():
                out[f'gate={gate} o inference'] = chunk_kda(**inp, **opts)[0]
            leaves = {n: x.detach().requires_grad_() for n, x in inp.items()}
            o, ht = chunk_kda(**leaves, **opts, output_final_state=True)
            (o.float().square().sum() + ht.sum()).backward()
            out[f'gate={gate} o'], out[f'gate={gate} ht'] = o.detach(), ht.detach()
            out.update({f'gate={gate} d{n}': x.grad for n, x in leaves.items()})
        torch.save(out, save)
    print('AB ' + json.dumps(times), flush=True)


def compare(first: str, other: str) -> list[str]:
    """Names of the saved tensors that differ in any bit between two versions' saves."""
    import torch
    a, b = torch.load(first), torch.load(other)
    return [n for n in a if not torch.equal(a[n], b[n])]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('versions', nargs='*', metavar='LABEL=DIR')
    p.add_argument('--modes', default=','.join(MODES))
    p.add_argument('--shapes', default=None, help='indices into the shape list (default: all)')
    p.add_argument('--rounds', type=int, default=2)
    p.add_argument('--head-dims', default='128,128', metavar='K,V')
    p.add_argument('--dtype', default='bf16', choices=sorted(DTYPES))
    p.add_argument('--worker', default=None, help=argparse.SUPPRESS)
    p.add_argument('--save', default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    modes = [m for m in args.modes.split(',') if m]
    if any(m not in MODES for m in modes):
        p.error(f"--modes takes {', '.join(MODES)}; got {args.modes!r}")
    picked = (list(range(len(shapes()))) if args.shapes is None
              else [int(i) for i in args.shapes.split(',')])
    try:
        dims = tuple(int(x) for x in args.head_dims.split(','))
    except ValueError:
        dims = ()
    if len(dims) != 2:
        p.error(f"--head-dims takes two integers K,V; got {args.head_dims!r}")
    if args.worker is not None:
        return worker(args.worker, modes, picked, args.save, dims, args.dtype)
    if len(args.versions) < 2 or any('=' not in v for v in args.versions):
        p.error("give at least two versions as LABEL=DIR")
    versions = dict(v.split('=', 1) for v in args.versions)
    times = {label: {} for label in versions}
    saves = {}
    tmp = tempfile.mkdtemp(prefix='kda-ab-')
    for r in range(args.rounds):
        for label, tree in versions.items():
            cmd = [sys.executable, __file__, '--worker', tree, '--modes', ','.join(modes),
                   '--shapes', ','.join(map(str, picked)), '--head-dims', args.head_dims,
                   '--dtype', args.dtype]
            if r == 0:
                saves[label] = os.path.join(tmp, f'{label}.pt')
                cmd += ['--save', saves[label]]
            run = subprocess.run(cmd, capture_output=True, text=True)
            line = [x for x in run.stdout.splitlines() if x.startswith('AB ')]
            if run.returncode != 0 or not line:
                raise SystemExit(f"{label} (round {r}) failed:\n{run.stderr[-3000:]}")
            for key, ms in json.loads(line[-1][3:]).items():
                times[label].setdefault(key, []).append(ms)
            print(f"round {r} {label}: " + ', '.join(f'{k} {v:.4f}' for k, v in
                                                     json.loads(line[-1][3:]).items()), flush=True)
    labels = list(versions)
    base = labels[0]
    print('\n| mode, shape | ' + ' | '.join(f'{x} ms' for x in labels)
          + ''.join(f' | {x} - {base}' for x in labels[1:]) + ' |')
    print('| --- ' * (2 * len(labels)) + '|')
    for key in times[base]:
        mean = {x: sum(times[x][key]) / len(times[x][key]) for x in labels}
        print(f'| {key} | ' + ' | '.join(f'{mean[x]:.4f}' for x in labels)
              + ''.join(f' | {mean[x] - mean[base]:+.4f}' for x in labels[1:]) + ' |')
    for x in labels[1:]:
        differ = compare(saves[base], saves[x])
        print(f"\n{x} against {base}: " + (f"differ in {', '.join(differ)}" if differ
                                              else "outputs and gradients bit for bit the same"))


if __name__ == '__main__':
    main()
