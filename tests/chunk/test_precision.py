"""``chunk_kda`` at the edges of its number formats: strong decay (bound ``TOL + 2 * floor``, the
floor being the float32 cumulative decay's own error), float16 and bf16 inputs (``lowp_bound``),
and a bad log-decay (g > 0 or NaN), which must come out NaN, never silently clamped."""
from __future__ import annotations

import pytest
import torch

from kda import chunk_kda
from conftest import make_inputs, make_state, reference64, rel_err
from chunk_helpers import (KDEV, TOL, assert_errs, check_lowp, cumsum_floor, errors, lengths_to_cu, on_device,
                           requires_bf16_kernels, requires_kernels, run_chunk, run_ref)

# Every kernel load and store of these tests is bounds-checked in the interpreter.
pytestmark = pytest.mark.usefixtures('bounds_checked_memory')


def _strong_gates(x, K):
    g = x['g']
    T = g.shape[1]
    g[:, 3:23, :, :K // 3] = -20.          # a stretch of -20 per step on a third of the channels
    g[:, 7, :, K // 2] = -1e3               # single big drops, followed by mild decay
    g[:, 17, 0, K // 2 + 1] = -1e4
    g[:, 30, 1, :] = -1e4                   # a full reset of one value head
    if T > 50:
        g[:, 45:60, 0, K - 4:] = -20.
        g[:, 50, :, 2] = -1e3
    return x


@pytest.mark.slow
@requires_kernels
@pytest.mark.parametrize('chunk_size,pattern,lengths', [
    (64, 'stretch', None), (32, 'stretch', None), (64, 'conftest', None), (32, 'stretch', [21, 43])])
def test_strong_decay(chunk_size, pattern, lengths):
    """Outputs and gradients stay finite and correct under -20 stretches and -1e3/-1e4 steps.

    Bound: ``TOL + 2 * floor`` per quantity, ``floor`` being the error of exact (float64)
    arithmetic on the kernel's float32 cumulative decays (``cumsum_floor``). With mild gates the
    floor is ~1e-7 and the bound is TOL; observed floors here reach ~1e-5 .. 4e-5 (conftest's
    pattern: -1e4 on every other token of a quarter of the channels, i.e. the clamped -104 steps
    push the in-chunk sum to ~-3300 where float32's ulp is 2.4e-4).
    """
    HV, K, V = 2, 32, 32
    if lengths is None:
        B, T, cu = 1, 64, None
    else:
        B, T, cu = 1, sum(lengths), lengths_to_cu(lengths)
    N = B if cu is None else len(lengths)
    x = make_inputs(B, T, 1, HV, K, V, strong_decay=(pattern == 'conftest'))
    if pattern == 'stretch':
        x = _strong_gates(x, K)
    s0 = make_state(N, HV, K, V)
    o, ht, gd, do, dht = run_chunk(x, s0, cu_seqlens=cu, chunk_size=chunk_size)
    ro, rht, rgd = run_ref(x, s0, do, dht, cu_seqlens=cu)
    errs = errors(o, ht, gd, ro, rht, rgd)
    fo, fht, fgd = cumsum_floor(x, s0, do, dht, chunk_size, cu_seqlens=cu)
    floor = errors(fo, fht, fgd, ro, rht, rgd)
    print("\nfloat32-cumsum floor: " + ' '.join(f"{n}={e:.1e}" for n, e in floor.items()))
    assert_errs(errs, {n: TOL + 2 * f for n, f in floor.items()}, f"strong decay {pattern} BT={chunk_size}")
    # Below the clamp (LOG_DECAY_FLOOR, -104) the gradient is exactly 0, as exp(g) (...) is in
    # float32; the kernel's rounding residue there (~1e-7, far inside the bound above) would pass.
    clamped = x['g'] < -104
    assert clamped.any() and (gd['g'][clamped] == 0).all(), \
        f"dg below the clamp: {gd['g'][clamped].abs().max():.1e}"


@pytest.mark.slow
@requires_kernels
@pytest.mark.parametrize('dtype', [torch.float16, pytest.param(torch.bfloat16, marks=requires_bf16_kernels)])
@pytest.mark.parametrize('gate_dtype,grads', [(None, False), (torch.float32, True)])
def test_low_precision(dtype, gate_dtype, grads):
    check_lowp(dtype, gate_dtype, 2, 70, 1, 2, 32, 32, chunk_size=64, grads=grads)


@pytest.mark.slow
@requires_kernels
@pytest.mark.parametrize('dtype', [torch.float16, pytest.param(torch.bfloat16, marks=requires_bf16_kernels)])
@pytest.mark.parametrize('K,V', [(16, 32), (32, 64)])
def test_low_precision_head_dims(dtype, K, V):
    """Gradients at head dims whose tiles differ between K and V: on the H200, bf16 K = 16 with
    V = 32 faulted in the per-chunk gradient kernel (non-square tiles, kda/ops/chunk/launch.py). Two
    pairs only: each compiles every chunk kernel anew, ~100 s a case on the GPU host with the
    suite's other shards beside it (four pairs took the final suite past its limit)."""
    check_lowp(dtype, torch.float32, 1, 70, 1, 2, K, V, chunk_size=64, grads=True)


@requires_kernels
@pytest.mark.parametrize('bad', [0.5, float('nan')])
def test_bad_log_decay_is_loud(bad):
    """g > 0 (against the contract) or NaN in g: the chunk containing it and everything after are
    NaN for that head, earlier chunks stay exact, other heads are untouched; never a silently
    clamped answer."""
    B, T, HV, K, V = 1, 70, 2, 32, 32
    x = on_device(make_inputs(B, T, 1, HV, K, V), KDEV)
    x['g'] = x['g'].clone()
    x['g'][0, 40, 1, 3] = bad
    with torch.no_grad():
        o, ht = chunk_kda(**x, chunk_size=32, output_final_state=True)
    ro, _ = reference64(**on_device(x, 'cpu'))
    o = o.cpu()
    assert torch.isnan(o[0, 32:, 1]).all(), "outputs from the bad chunk on must be NaN"
    assert torch.isnan(ht[0, 1]).all(), "the final state of the bad head must be NaN"
    assert rel_err(o[0, :32], ro[0, :32]) < TOL, "outputs before the bad chunk changed"
    assert torch.isfinite(o[0, :, 0]).all() and torch.isfinite(ht[0, 0]).all(), \
        "the other head must be unaffected"
