"""``chunk_kda`` prefill on a state pool (docs/API.md, "State pools"): ``initial_state_indices``,
``has_initial_state``, ``inplace_final_state``, padding slots, 16-bit pools, chunked prefill,
and malformed calls refused with nothing written.

Every CPU test runs on both paths (the ``path`` fixture): the Triton kernels in the interpreter
(float32 inputs) and the PyTorch path. The oracle is the float64 recurrence applied slot by slot
(``oracle_pool`` of ``test_serving_decode``). Pools are poisoned: every slot a call does not
address holds NaN and must come back bit for bit.
"""
from __future__ import annotations

import pytest
import torch

import kda.ops.chunk.api as api
from kda import chunk_kda
from kda.ops.utils import INTERPRET
from conftest import make_cu_seqlens, make_inputs, make_state, rel_err, requires_cuda
from test_serving_decode import assert_pool, assert_rounded_once, oracle_pool, poisoned_pool

TOL = 1e-5


def _must_not_run(*args, **kwargs):
    raise AssertionError("this code path must not run in this test")


@pytest.fixture(params=['kernel', 'torch'])
def path(request, monkeypatch):
    """The interpreted kernels (the PyTorch path made to raise) or the PyTorch path (the forward
    launcher made to raise)."""
    if request.param == 'kernel':
        if not INTERPRET:
            pytest.skip("the kernel path needs TRITON_INTERPRET=1 on CPU")
        monkeypatch.setattr(api, 'chunk_kda_reference', _must_not_run)
        monkeypatch.setattr(api, 'pooled_kda', _must_not_run)
    else:
        monkeypatch.setattr(api, 'use_kernels', lambda x: False)
        monkeypatch.setattr(api, 'chunk_kda_fwd', _must_not_run)
    return request.param


def varlen_inputs(lengths, H=1, HV=2, K=16, V=16):
    return make_inputs(1, sum(lengths), H, HV, K, V), make_cu_seqlens(lengths)


CASES = {
    # name: (lengths, fixed batch B or None, slots, has_initial_state, vfirst, chunk_size)
    'varlen_padding_has_initial': ([70, 0, 33, 9], None, [5, 2, -1, 0], [True, True, True, False], False, 64),
    'varlen_vfirst_chunk32': ([40, 17, 64], None, [1, -3, 6], None, True, 32),
    'fixed_batch_gva': ([37], 3, [6, 0, -1], [False, True, True], False, 64),
}


@pytest.mark.parametrize('idx_dtype', [torch.int32, torch.int64])
@pytest.mark.parametrize('cfg', CASES.values(), ids=CASES.keys())
def test_pool_prefill_matches_oracle(path, cfg, idx_dtype):
    """Sequence n starts from pool[idx[n]] (zeros where has_initial_state is False) and its
    final state lands there; padding gives zero outputs and touches nothing; the poisoned slots
    stay NaN and no NaN reaches a live output."""
    lengths, B, slots, has_init, vfirst, chunk = cfg
    P, HV = 7, 4 if B else 2
    if B:
        x, cu = make_inputs(B, lengths[0], 2, HV, 16, 16), None
    else:
        x, cu = varlen_inputs(lengths, HV=HV)
    idx = torch.tensor(slots, dtype=idx_dtype)
    hi = None if has_init is None else torch.tensor(has_init)
    # A slot with has_initial_state False is not read: poisoned too.
    read = [s for n, s in enumerate(slots) if s >= 0 and (hi is None or hi[n])]
    pool = poisoned_pool(P, HV, 16, 16, read, vfirst)
    start = pool.clone()
    if hi is not None:
        start[idx[~hi]] = 0.
    ref_o, ref_pool = oracle_pool(x, start, idx, cu_seqlens=cu, state_v_first=vfirst)
    ref_pool[[s for s in range(P) if s not in slots]] = float('nan')
    o, ht = chunk_kda(**x, initial_state=pool, output_final_state=True, initial_state_indices=idx,
                      has_initial_state=hi, inplace_final_state=True, cu_seqlens=cu, state_v_first=vfirst,
                      chunk_size=chunk)
    assert ht is pool
    assert torch.isfinite(o).all(), "a padding row's output must be 0, a live one finite"
    assert rel_err(o, ref_o) < TOL, f"outputs rel err {rel_err(o, ref_o):.3e}"
    assert_pool(pool, ref_pool, idx, 'pool')


def test_pool_prefill_equals_gather_call_scatter(path):
    """The pool call equals gathering the slots, a plain call and scattering the final states,
    bit for bit (outputs and pool)."""
    x, cu = varlen_inputs([50, 3, 0, 70], HV=2)
    idx = torch.tensor([3, 8, 5, 1])
    pool = make_state(9, 2, 16, 16)
    gathered = pool[idx].clone()
    o_ref, ht_ref = chunk_kda(**x, initial_state=gathered, output_final_state=True, cu_seqlens=cu)
    scattered = pool.clone()
    scattered[idx] = ht_ref
    o, _ = chunk_kda(**x, initial_state=pool, initial_state_indices=idx, inplace_final_state=True,
                     cu_seqlens=cu)
    assert torch.equal(o, o_ref), "outputs differ from gather + call"
    assert torch.equal(pool, scattered), "pool differs from gather + call + scatter"


def _prefill_in_parts(x, lengths, cuts, pool, idx):
    """Four calls, call p over tokens [cut[p], cut[p + 1]) of every sequence, the state carried
    in ``pool``; returns the outputs in ``x``'s token order."""
    outs = []
    for part in range(4):
        spans = [(sum(lengths[:n]) + c[part], sum(lengths[:n]) + c[part + 1]) for n, c in enumerate(cuts)]
        piece = {name: torch.cat([t[:, a:b] for a, b in spans], 1) for name, t in x.items()}
        cu = make_cu_seqlens([b - a for a, b in spans])
        o, _ = chunk_kda(**piece, initial_state=pool, initial_state_indices=idx, inplace_final_state=True,
                         cu_seqlens=cu, chunk_size=32)
        outs.append([o[:, cu[n]:cu[n + 1]] for n in range(len(lengths))])
    return torch.cat([torch.cat([outs[p][n] for p in range(4)], 1) for n in range(len(lengths))], 1)


def test_chunked_prefill_equals_one_call(path):
    """Four calls, each over the next part of every sequence (one part empty), carrying the
    state in the pool, equal one call bit for bit where the parts end on chunk boundaries: the
    same steps on the same chunks."""
    lengths = [128, 96]
    x, cu = varlen_inputs(lengths, HV=2)
    idx = torch.tensor([4, 1])
    pool = make_state(6, 2, 16, 16)
    one = pool.clone()
    o_one, _ = chunk_kda(**x, initial_state=one, initial_state_indices=idx, inplace_final_state=True,
                         cu_seqlens=cu, chunk_size=32)
    carried = pool.clone()
    o_parts = _prefill_in_parts(x, lengths, [[0, 32, 64, 96, 128], [0, 32, 32, 64, 96]], carried, idx)
    assert torch.equal(o_parts, o_one) and torch.equal(carried, one), "chunk-aligned parts differ from one call"


@pytest.mark.slow
def test_ragged_chunked_prefill_matches_oracle(path):
    """Parts that end inside chunks (a single token, an empty one): within rounding of the
    float64 oracle of the whole sequences."""
    lengths = [128, 96]
    x, cu = varlen_inputs(lengths, HV=2)
    idx = torch.tensor([4, 1])
    pool = make_state(6, 2, 16, 16)
    ref_o, ref_pool = oracle_pool(x, pool, idx, cu_seqlens=cu)
    o = _prefill_in_parts(x, lengths, [[0, 5, 50, 51, 128], [0, 37, 37, 70, 96]], pool, idx)
    assert rel_err(o, ref_o) < TOL and rel_err(pool[idx], ref_pool[idx]) < TOL


@pytest.mark.parametrize('dtype', [torch.bfloat16, pytest.param(torch.float16, marks=pytest.mark.slow)])
def test_16bit_pool_prefill(path, dtype):
    """A 16-bit pool: outputs as from the float32 pool of the same values, stored states that
    float32 result rounded once, both within a 16-bit rounding of the oracle; a new final state
    is float32 unless final_state_dtype asks."""
    x, cu = varlen_inputs([45, 20], HV=2)
    idx = torch.tensor([2, 0])
    pool16 = poisoned_pool(4, 2, 16, 16, [0, 2], dtype=dtype)
    pool32 = pool16.float()
    ref_o, ref_pool = oracle_pool(x, pool16, idx, cu_seqlens=cu)
    o16, _ = chunk_kda(**x, initial_state=pool16, initial_state_indices=idx, inplace_final_state=True, cu_seqlens=cu)
    o32, _ = chunk_kda(**x, initial_state=pool32, initial_state_indices=idx, inplace_final_state=True, cu_seqlens=cu)
    assert torch.equal(o16, o32)
    assert_rounded_once(pool16[[0, 2]], pool32[[0, 2]], path)
    assert_pool(pool16, ref_pool, idx, '16-bit pool', tol=torch.finfo(dtype).eps)
    h0 = make_state(2, 2, 16, 16, dtype=dtype)
    _, ht = chunk_kda(**x, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    _, ht16 = chunk_kda(**x, initial_state=h0, output_final_state=True, cu_seqlens=cu, final_state_dtype=dtype)
    assert ht.dtype == torch.float32 and ht16.dtype == dtype
    assert_rounded_once(ht16, ht, path)


def test_inplace_without_indices(path):
    """inplace_final_state=True without indices overwrites initial_state [N, ...] with the
    final state the plain call returns, bit for bit."""
    x = make_inputs(2, 40, 1, 2, 16, 16)
    h0 = make_state(2, 2, 16, 16)
    _, ht = chunk_kda(**x, initial_state=h0.clone(), output_final_state=True)
    state = h0.clone()
    _, returned = chunk_kda(**x, initial_state=state, output_final_state=True, inplace_final_state=True)
    assert returned is state and torch.equal(state, ht)


def test_slot_past_pool_nan_and_untouched(path):
    """A slot >= P gives its sequence NaN outputs and writes nothing."""
    x, cu = varlen_inputs([20, 30], HV=2)
    pool = poisoned_pool(3, 2, 16, 16, [1])
    before = pool.clone()
    o, _ = chunk_kda(**x, initial_state=pool, initial_state_indices=torch.tensor([1, 3]),
                     inplace_final_state=True, cu_seqlens=cu)
    assert torch.isfinite(o[:, :20]).all() and torch.isnan(o[:, 20:]).all()
    assert torch.equal(pool[[0, 2]].isnan(), before[[0, 2]].isnan())


def _malformed():
    idx = torch.tensor([0, 1])
    return {
        # name: (keyword arguments, error, message)
        'indices without inplace': (dict(initial_state_indices=idx, inplace_final_state=False), ValueError,
                                    'requires inplace_final_state=True'),
        'indices float': (dict(initial_state_indices=idx.float()), TypeError, 'int32 or int64'),
        'indices [N + 1]': (dict(initial_state_indices=torch.tensor([0, 1, 2])), ValueError, r'shape \[2\]'),
        'indices 2-D': (dict(initial_state_indices=idx[:, None]), ValueError, r'shape \[2\]'),
        'indices on another device': (dict(initial_state_indices=idx.to('meta')), ValueError, 'must be on cpu'),
        'duplicate live slots': (dict(initial_state_indices=torch.tensor([4, 4])), ValueError, r'slots \[4\]'),
        'has_initial int': (dict(initial_state_indices=idx, has_initial_state=torch.tensor([1, 0])), TypeError,
                            'has_initial_state must be a bool'),
        'has_initial [N + 1]': (dict(initial_state_indices=idx, has_initial_state=torch.ones(3, dtype=torch.bool)),
                                ValueError, r'has_initial_state must have shape \[2\]'),
        'has_initial without indices': (dict(has_initial_state=torch.ones(2, dtype=torch.bool),
                                             initial_state='per sequence'), ValueError,
                                        'requires initial_state_indices'),
        'pool not contiguous in slots': (dict(initial_state_indices=idx, initial_state='strided'), ValueError,
                                         'contiguous'),
        'pool wrong layout': (dict(initial_state_indices=idx, initial_state='transposed'), ValueError,
                              'state pool'),
        'needs grad': (dict(initial_state_indices=idx, q_grad=True), ValueError, 'forward only'),
        'final_state_dtype in place': (dict(initial_state_indices=idx, final_state_dtype=torch.float16),
                                       ValueError, 'final_state_dtype'),
        'inplace str': (dict(inplace_final_state='yes', initial_state='per sequence'), TypeError,
                        'inplace_final_state'),
    }


@pytest.mark.parametrize('case', list(_malformed()))
def test_malformed_refused_nothing_written(path, case):
    """Each malformed pool call raises before anything runs and leaves the pool bit for bit."""
    kw, error, message = _malformed()[case]
    kw = dict(dict(inplace_final_state=True), **kw)
    x, cu = varlen_inputs([10, 20], HV=2)
    pool = make_state(6, 2, 16, 16)
    shape = kw.pop('initial_state', None)
    if shape == 'strided':
        pool = make_state(12, 2, 16, 16)[::2]
    elif shape == 'transposed':
        pool = make_state(6, 2, 16, 17)
    elif shape == 'per sequence':
        pool = make_state(2, 2, 16, 16)
    if kw.pop('q_grad', False):
        x['q'].requires_grad_()
    before = pool.clone()
    with pytest.raises(error, match=message):
        chunk_kda(**x, initial_state=pool, cu_seqlens=cu, **kw)
    assert torch.equal(pool, before), "a refused call wrote into the pool"


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize('lengths', [[512] * 8, [4096, 1000, 37, 3000]], ids=['8x512', 'mixed'])
def test_cuda_bf16_pool_prefill(lengths):
    """bf16 inputs and a bf16 pool at H = 32, K = V = 128, padding included: equal to gather +
    call + scatter (bit for bit: the same sweep), and the untouched slots unchanged."""
    H, K, V, P = 32, 128, 128, 20
    x = make_inputs(1, sum(lengths), H, H, K, V, dtype=torch.bfloat16, gate_dtype=torch.float32, device='cuda')
    cu = make_cu_seqlens(lengths, device='cuda')
    idx = torch.randperm(P, device='cuda')[:len(lengths)]
    idx[1] = -1
    pool = make_state(P, H, K, V, device='cuda', dtype=torch.bfloat16)
    before = pool.clone()
    gathered = torch.where((idx >= 0)[:, None, None, None], before[idx.clamp(min=0)], 0)
    o_ref, ht = chunk_kda(**x, initial_state=gathered, output_final_state=True, cu_seqlens=cu,
                          use_qk_l2norm_in_kernel=True)
    o, _ = chunk_kda(**x, initial_state=pool, initial_state_indices=idx, inplace_final_state=True,
                     cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
    live = idx >= 0
    seq = torch.repeat_interleave(torch.arange(len(lengths), device='cuda'), cu.diff())
    assert torch.equal(o[0, live[seq]], o_ref[0, live[seq]]) and (o[0, ~live[seq]] == 0).all()
    assert torch.equal(pool[idx[live]], ht[live].to(torch.bfloat16))
    rest = torch.ones(P, dtype=torch.bool, device='cuda')
    rest[idx[live]] = False
    assert torch.equal(pool[rest], before[rest])
