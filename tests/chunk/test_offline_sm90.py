"""What only a compile for the H100/H200 (sm_90) shows, checked without a GPU: every chunk kernel's
shared memory at its launch configuration, float32 products off the tensor cores, and where the
programmatic-dependent-launch instructions sit. The builds come from one run of
``sm90_builds.py`` (a process of its own, the interpreter off), shared by the tests here; CI's
parallel run (``--dist loadfile``) keeps a file's tests on one worker, so the builds are compiled
once.
"""
from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kda.ops.offline import H200_SHARED_MEMORY

PROGRAM = Path(__file__).resolve().parent / 'sm90_builds.py'
ROOT = PROGRAM.parents[2]
# The cases sm90_builds.cases() lists.
CASES = 66

# Slow: 65 compiles (minutes on two cores), in the full tier only.
pytestmark = pytest.mark.slow


@functools.cache
def sm90_builds() -> list[dict]:
    """The records of ``sm90_builds.py`` (a build a case: ``stage``, ``dtype``, ``K``, ``few``,
    ``transposed``, ``config``, ``shared``, ``tensor_core_products``, ``dependent_launch_order``),
    compiled once for the tests that read them."""
    env = {n: x for n, x in os.environ.items() if n != 'TRITON_INTERPRET'}
    env['PYTHONPATH'] = os.pathsep.join([str(ROOT)] + [p for p in [env.get('PYTHONPATH')] if p])
    run = subprocess.run([sys.executable, str(PROGRAM)], env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    records = json.loads(run.stdout.strip().splitlines()[-1])['records']
    assert len(records) == CASES
    return records


def case(record: dict) -> tuple:
    return tuple(record[n] for n in ('stage', 'dtype', 'K', 'few', 'transposed'))


def test_launch_shared_memory():
    """Every chunk kernel's launch configuration fits the H200's shared memory, checked by
    compiling for sm_90 without a GPU. No interpreter can see this: a launch table that gave the
    gradient sweep 3 stages with few programs made float32 inputs ask 256 KiB on the GPU, where 5
    tests failed. A launch-table change that a bf16 sweep picked is checked in float32 here."""
    too_big = [(case(r), r['config'], r['shared']) for r in sm90_builds() if r['shared'] > H200_SHARED_MEMORY]
    assert not too_big, f"over {H200_SHARED_MEMORY} B of shared memory: {too_big}"


def test_float32_products_are_exact():
    """With float32 inputs every chunk kernel's matrix products are exact float32 (``mm``,
    ``mm_fine``: ``input_precision="ieee"``, on the FMA units): as compiled for sm_90, no
    tensor-core instruction at all (tf32, or operands rounded to 16 bits). No CPU numerical
    test can see this: the interpreter's dot is numpy's matmul whatever precision it is asked
    for, and a product quietly rounded to tf32 (~1e-3 relative error) passed every interpreter
    test (a helper's mutation of ``mm``). The bf16 builds show that the count sees them at all.
    One build a kernel: a product only in a branch of another build's flags is not seen."""
    counts = {case(r): r['tensor_core_products'] for r in sm90_builds()}
    exact = {key: n for key, n in counts.items() if key[1] == 'torch.float32'}
    assert exact and not any(exact.values()), {key: n for key, n in exact.items() if n}
    # Every bf16 build with matrix products (all but the cumsum's and the gate gradient's).
    assert all(n for key, n in counts.items()
               if key[1] == 'torch.bfloat16' and not key[0].startswith(('cumsum', 'gate_bwd'))), counts


def test_dependent_launch_order():
    """The in-chunk kernels as compiled for sm_90 (PDL on, ``kda/ops/chunk/intra.py``,
    ``pair_products_and_solve``): the pair products and the solve of the inference forward with
    l2norm in the kernel, which may start before the kernel ahead of them has finished, write
    nothing to global memory before their griddepcontrol.wait and read nothing before it but, in the L2NORM build, their
    own q and k rows for the norms and, in the varlen builds, the chunk map (by source line;
    cp.async, TMA and atomics count); the wait is in no loop or branch; each releases its
    dependents after its wait; the cumsum, not launched early, releases them without waiting. A
    wait moved below a load or a store, into the key loop, or dropped, fails here; no
    interpreter run can see it. Read from the Triton that runs the test (the GPU host's 3.6
    there, CI's newer one here)."""
    stages = ('cumsum', 'cumsum_raw', 'pair_fwd_norms', 'pair_fwd_norms_near', 'solve',
              'pair_fwd_norms_varlen', 'solve_varlen')
    order = {(r['stage'], r['dtype']): r['dependent_launch_order'] for r in sm90_builds() if r['stage'] in stages}
    assert len(order) == 15, sorted(order)   # pair_fwd_norms in float16 too
    for (stage, dtype), o in order.items():
        if stage.startswith('cumsum'):
            assert o['release'] and not o['wait'], (stage, dtype, o)
            continue
        assert o['wait'] and o['release_after_wait'] and o['stores'] == 0, (stage, dtype, o)
        assert not o['unexplained'] and not o['back_edges'] and not o['skips'], (stage, dtype, o)
        # The norms' loads (and the varlen chunk map's beside them): that the count sees loads at
        # all. The solve waits first, before its chunk map too.
        assert (o['loads'] > 0) == stage.startswith('pair_fwd_norms'), (stage, dtype, o)
