"""Runs FLA's autotuner ahead of ``bench.py``, so that the timing process finds FLA's picks cached.

    python benchmarks/warm_fla.py CASE [CASE ...]       CASE: {fwd,gate_fwd,fwdbwd,gate_fwdbwd}:B,T,H
                                                        or {fwd,gate_fwd,fwdbwd,gate_fwdbwd}:varlen

FLA 0.6.0 autotunes its kernels on first use for each new tuning key (head count, varlen, gate
options) and caches the winners on disk (``FLA_CACHE_RESULTS=1``, its default, through Triton's
``cache_results``). On a fresh H200 that costs 60-100 s per head count (first GPU session:
bench.py spent 77-101 s per forward shape, nearly all of it FLA's tuning). Several of these
processes started side by side let those compiles run in parallel; ``bench.py`` then times FLA
with the configurations its own autotuner chose. Nothing here is timed.
"""
from __future__ import annotations

import sys
import time

import torch

import bench


def main(cases):
    fla, desc = bench._import_fla()
    if fla is None:
        raise SystemExit(desc)
    for case in cases:
        kind, shape = case.split(':')
        t0 = time.time()
        if shape == 'varlen':
            B, T, H, lengths = 1, sum(bench.VARLEN_LENGTHS), bench.VARLEN_H, bench.VARLEN_LENGTHS
        else:
            (B, T, H), lengths = map(int, shape.split(',')), None
        inp, opts = bench._chunk_inputs(B, T, H, lengths, gate=kind.startswith('gate_'))
        if kind.endswith('fwdbwd'):
            leaves = {n: x.detach().requires_grad_() for n, x in inp.items()}
            o, _ = fla.chunk_kda(**leaves, **opts)
            o.backward(torch.randn_like(o))
        else:
            with torch.inference_mode():
                fla.chunk_kda(**inp, **opts)
        torch.cuda.synchronize()
        print(f"warm {case}: {time.time() - t0:.0f} s", flush=True)


if __name__ == '__main__':
    main(sys.argv[1:])
