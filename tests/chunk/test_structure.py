"""Structural properties of ``chunk_kda``: causality, sequences isolated from each other in a
varlen batch, every element of every allocation written, a sequence split in two, the varlen
chunk map, and non-contiguous inputs and ``cu_seqlens`` read by value."""
from __future__ import annotations

import math

import pytest
import torch

import kda.ops.chunk.layout as chunk_map
from kda import chunk_kda
from conftest import make_cu_seqlens, make_inputs, make_state, reference64, rel_err
from chunk_helpers import (KDEV, TOL, assert_errs, check_case, errors, lengths_to_cu, on_device, patch_chunk,
                           requires_kernels, run_chunk, run_ref)

# Every kernel load and store of these tests is bounds-checked in the interpreter.
pytestmark = pytest.mark.usefixtures('bounds_checked_memory')


@pytest.mark.slow
@requires_kernels
@pytest.mark.parametrize('t,chunk_size', [(20, 32), (37, 32), (40, 64)])
@pytest.mark.parametrize('kind', ['random', 'large', 'bounded_gate'])
def test_causality(t, chunk_size, kind):
    """Changing q, k, v, g, beta at positions > t leaves outputs at positions <= t bit-identical,
    also when t falls inside a chunk (future gates, keys and values must not leak through the
    in-chunk matrices, the solve or the masked tiles). 'bounded_gate': the lower-bound gate, whose
    diagonal blocks take the factored tensor-core path (raw gates, future ones saturating at -5)."""
    B, T, H, HV, K, V = 1, 45, 1, 2, 32, 32
    x = make_inputs(B, T, H, HV, K, V)
    y = make_inputs(B, T, H, HV, K, V)          # fresh values for the future
    opts = {}
    if kind == 'large':                          # large but finite everywhere downstream
        y['v'] = y['v'] * 1e15
        y['q'] = y['q'] * 1e8
        y['g'] = torch.where(torch.rand_like(y['g']) < 0.3, torch.full_like(y['g'], -1e4), y['g'] * 30)
        y['beta'] = torch.ones_like(y['beta'])
    if kind == 'bounded_gate':
        x['g'], y['g'] = torch.randn_like(x['g']), 50 * torch.rand_like(y['g'])
        opts = dict(use_gate_in_kernel=True, A_log=torch.zeros(HV, device=KDEV), lower_bound=-5.0,
                    safe_gate=True)
    z = {n: torch.cat([x[n][:, :t + 1], y[n][:, t + 1:]], 1) for n in x}
    s0 = make_state(B, HV, K, V)
    with torch.no_grad():
        o1, _ = chunk_kda(**on_device(x, KDEV), initial_state=s0.to(KDEV), chunk_size=chunk_size, **opts)
        o2, _ = chunk_kda(**on_device(z, KDEV), initial_state=s0.to(KDEV), chunk_size=chunk_size, **opts)
    assert torch.isfinite(o2).all()
    assert torch.equal(o1[:, :t + 1], o2[:, :t + 1]), \
        f"outputs at <= t changed: max diff {(o1[:, :t + 1] - o2[:, :t + 1]).abs().max()}"
    assert not torch.equal(o1[:, t + 1:], o2[:, t + 1:])   # the perturbation was real


@requires_kernels
def test_sequences_are_isolated():
    """In a varlen batch, changing one sequence's tokens leaves every other sequence's outputs and
    final state bit-identical (no leak across cu_seqlens boundaries inside a chunk)."""
    lengths = [13, 0, 27, 1, 29]
    cu = lengths_to_cu(lengths)
    HV, K, V = 2, 32, 32
    x = make_inputs(1, sum(lengths), 1, HV, K, V)
    s0 = make_state(len(lengths), HV, K, V)
    n = 2
    bos, eos = cu[n].item(), cu[n + 1].item()
    y = {name: t.clone() for name, t in x.items()}
    fresh = make_inputs(1, sum(lengths), 1, HV, K, V)
    for name in y:
        y[name][:, bos:eos] = fresh[name][:, bos:eos]
    with torch.no_grad():
        o1, h1 = chunk_kda(**on_device(x, KDEV), initial_state=s0.to(KDEV), output_final_state=True,
                           cu_seqlens=cu.to(KDEV), chunk_size=32)
        o2, h2 = chunk_kda(**on_device(y, KDEV), initial_state=s0.to(KDEV), output_final_state=True,
                           cu_seqlens=cu.to(KDEV), chunk_size=32)
    keep = torch.ones(sum(lengths), dtype=torch.bool)
    keep[bos:eos] = False
    assert torch.equal(o1[:, keep.to(o1.device)], o2[:, keep.to(o2.device)])
    others = [i for i in range(len(lengths)) if i != n]
    assert torch.equal(h1[others], h2[others])
    assert not torch.equal(h1[n], h2[n])


GUARD = 1 << 16   # elements of NaN after every poisoned allocation


@pytest.fixture
def poisoned_allocations(monkeypatch):
    """Makes every torch.empty / torch.empty_like return NaN-filled memory followed by a NaN guard
    region (the tensor is the head of a larger NaN buffer). Returns the list of shapes allocated."""
    real_empty = torch.empty
    calls = []

    def empty(*size, dtype=None, device=None, **kw):
        if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
            size = tuple(size[0])
        n = math.prod(size)
        buf = real_empty(n + GUARD, dtype=dtype, device=device, **kw)
        if buf.is_floating_point():
            buf.fill_(float('nan'))
        calls.append(tuple(size))
        return buf[:n].view(size)

    def empty_like(x, dtype=None, device=None, **kw):
        return empty(tuple(x.shape), dtype=x.dtype if dtype is None else dtype,
                     device=x.device if device is None else device)

    monkeypatch.setattr(torch, 'empty', empty)
    monkeypatch.setattr(torch, 'empty_like', empty_like)
    return calls


@pytest.mark.slow
@requires_kernels
@pytest.mark.parametrize('lengths,chunk_size', [([0, 1, 19, 25], 32), ([5, 0, 65], 64), (None, 32)])
def test_every_element_written(poisoned_allocations, lengths, chunk_size):
    """The launchers allocate with torch.empty: every float allocation is poisoned with NaN and
    followed by a NaN guard region. Outputs, final state and gradients must come out finite and
    correct for partial chunks and varlen: every element is written, no unwritten scratch (e.g. the
    never-stored blocks above the diagonal of the in-chunk matrices) leaks into a result, and no
    read past the end of a buffer (the last, partial chunk) reaches a result. (In the interpreter
    every load and store is also bounds-checked: ``bounds_checked_memory``.)"""
    if lengths is None:
        check_case(2, 45, 1, 2, 32, 32, chunk_size=chunk_size)
    else:
        check_case(1, 0, 1, 2, 32, 32, chunk_size=chunk_size, lengths=lengths)
    assert len(poisoned_allocations) >= 10       # the poison reached the launchers' allocations


@pytest.mark.slow
@requires_kernels
@pytest.mark.parametrize('T,t1,chunk_size', [(70, 37, 32), (70, 45, 64)])
def test_split_sequence(T, t1, chunk_size):
    """One call over [0, T) equals [0, t1) then [t1, T) with the first call's final state as the
    second's initial state (t1 not a multiple of the chunk), for outputs and final state."""
    B, H, HV, K, V = 2, 1, 2, 32, 32
    x = on_device(make_inputs(B, T, H, HV, K, V), KDEV)
    s0 = make_state(B, HV, K, V).to(KDEV)
    with torch.no_grad():
        o, ht = chunk_kda(**x, initial_state=s0, output_final_state=True, chunk_size=chunk_size)
        oa, ha = chunk_kda(**{n: t[:, :t1] for n, t in x.items()}, initial_state=s0,
                           output_final_state=True, chunk_size=chunk_size)
        ob, hb = chunk_kda(**{n: t[:, t1:] for n, t in x.items()}, initial_state=ha,
                           output_final_state=True, chunk_size=chunk_size)
    ro, rht = reference64(**on_device(x, 'cpu'), initial_state=s0.cpu())
    errs = {'o split-vs-one': rel_err(torch.cat([oa, ob], 1), o), 'ht split-vs-one': rel_err(hb, ht),
            'o': rel_err(o, ro), 'ht': rel_err(ht, rht), 'o split': rel_err(torch.cat([oa, ob], 1), ro)}
    assert_errs(errs, TOL, f"split T={T} at {t1}")


@pytest.mark.parametrize('dtype', [torch.int32, torch.int64])
def test_chunk_layout_varlen(monkeypatch, dtype):
    """The varlen chunk map: (first row, valid rows) per global chunk, each sequence's first chunk, and
    the sweeps' start order, most chunks first with ties in sequence order. A wrong order is not
    caught by the numerical tests when it is a permutation (every sequence still runs), so the
    order itself is pinned here."""
    patch_chunk(monkeypatch, '_last_varlen_layout', None)   # built from this dtype
    offsets = [0, 70, 70, 71, 200, 264]          # lengths 70, 0, 1, 129, 64 -> chunks 2, 0, 1, 3, 1
    layout = chunk_map.chunk_layout(1, 264, 64, offsets, torch.tensor(offsets, dtype=dtype).to(KDEV))
    assert (layout.BT, layout.NT, layout.total) == (64, 0, 7)
    assert layout.rows.tolist() == [[0, 64], [64, 6], [70, 1], [71, 64], [135, 64], [199, 1], [200, 64]]
    assert layout.offsets.tolist() == [0, 2, 2, 3, 6, 7]
    assert layout.order.tolist() == [3, 0, 2, 4, 1]
    assert all(t.dtype == torch.int32 for t in (layout.rows, layout.offsets, layout.order))
    fixed = chunk_map.chunk_layout(2, 130, 64, None, None)
    assert (fixed.NT, fixed.total, fixed.rows, fixed.order) == (3, 6, None, None)


def test_chunk_layout_reused():
    """The last varlen map is returned again for the same host offsets and chunk size, and only
    then: other offsets, another chunk size or the same values in a new tensor (kept: the map
    depends on the values only) give the map of what was asked."""
    offsets = [0, 70, 70, 71, 200, 264]
    cu = torch.tensor(offsets, dtype=torch.int32).to(KDEV)
    first = chunk_map.chunk_layout(1, 264, 64, offsets, cu)
    assert chunk_map.chunk_layout(1, 264, 64, list(offsets), cu.clone()) is first
    moved = [0, 70, 71, 72, 200, 264]
    cu.copy_(torch.tensor(moved, dtype=torch.int32))
    layout = chunk_map.chunk_layout(1, 264, 64, moved, cu)
    assert layout.rows.tolist() == [[0, 64], [64, 6], [70, 1], [71, 1], [72, 64], [136, 64], [200, 64]]
    assert layout.offsets.tolist() == [0, 2, 3, 4, 6, 7]
    other = chunk_map.chunk_layout(1, 264, 32, moved, cu)
    assert other.BT == 32 and other.total == 11 and other.rows[:3].tolist() == [[0, 32], [32, 32], [64, 6]]


def _strided(x: torch.Tensor) -> torch.Tensor:
    """A non-contiguous view (every other element of a wider last dim) holding x's values."""
    y = torch.zeros(*x.shape[:-1], 2 * x.shape[-1], dtype=x.dtype, device=x.device)
    y[..., ::2] = x
    return y[..., ::2]


@requires_kernels
def test_non_contiguous_inputs():
    """Transposed / sliced views give exactly the result of their dense copies (outputs, final
    state and every gradient)."""
    B, T, H, HV, K, V = 1, 40, 2, 2, 32, 16
    base = on_device(make_inputs(B, T, H, HV, K, V), KDEV)
    views = dict(
        q=base['q'].transpose(1, 2).contiguous().transpose(1, 2),                 # transposed
        k=_strided(base['k']),                                                    # sliced
        v=base['v'].permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2),
        g=base['g'].transpose(-1, -2).contiguous().transpose(-1, -2),
        beta=_strided(base['beta']))
    s0 = make_state(B, HV, K, V, state_v_first=True).to(KDEV).transpose(-1, -2)  # [B, HV, K, V] view
    assert not any(t.is_contiguous() for t in views.values()) and not s0.is_contiguous()
    dense = {n: t.contiguous() for n, t in views.items()}
    o1, h1, g1, do, dht = run_chunk(views, s0, chunk_size=32)
    o2, h2, g2, _, _ = run_chunk(dense, s0.contiguous(), chunk_size=32, do=do, dht=dht)
    assert torch.equal(o1, o2) and torch.equal(h1, h2)
    for n in g1:
        assert torch.equal(g1[n], g2[n]), f"d{n} differs for a non-contiguous input"
    ro, rht, rgd = run_ref(dense, s0, do, dht)
    assert_errs(errors(o1, h1, g1, ro, rht, rgd), TOL, "non-contiguous")


@requires_kernels
def test_non_contiguous_cu_seqlens():
    """A strided cu_seqlens view is read by value, not by its storage."""
    lengths = [5, 0, 30, 1]
    cu = make_cu_seqlens(lengths)
    padded = torch.stack([cu, torch.full_like(cu, 10 ** 6)], 1).reshape(-1)   # junk between values
    strided = padded[::2]
    assert torch.equal(strided, cu) and not strided.is_contiguous()
    T, HV, K, V = sum(lengths), 2, 32, 16
    x = on_device(make_inputs(1, T, 1, HV, K, V), KDEV)
    with torch.no_grad():
        o1, h1 = chunk_kda(**x, cu_seqlens=strided.to(KDEV), output_final_state=True, chunk_size=32)
        o2, h2 = chunk_kda(**x, cu_seqlens=cu.to(KDEV), output_final_state=True, chunk_size=32)
    assert torch.equal(o1, o2) and torch.equal(h1, h2), "a strided cu_seqlens changed the result"
