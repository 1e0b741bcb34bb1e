"""``fused_recurrent_kda`` as a serving engine calls it (docs/API.md, "State pools"): a state pool
addressed by ``ssm_state_indices``, padding slots, speculative decoding, per-channel beta,
16-bit pools, and malformed calls refused with nothing written.

Every CPU test runs on both paths (the ``path`` fixture): the Triton kernel in the interpreter
and the PyTorch path. The oracle is the float64 recurrence applied slot by slot
(``oracle_pool`` / ``oracle_speculative``, written here independently of ``kda.reference``'s pool
helpers). Pools are poisoned: every slot the call does not address holds NaN and must come back
bit for bit.
"""
from __future__ import annotations

import pytest
import torch

import kda.ops.fused_recurrent as fr
from kda import fused_recurrent_kda, naive_recurrent_kda
from kda.ops.utils import INTERPRET
from conftest import make_cu_seqlens, make_inputs, make_state, rel_err, requires_cuda, to64

TOL = 1e-5


def _must_not_run(*args, **kwargs):
    raise AssertionError("this code path must not run in this test")


class _NoLaunch:
    def __getitem__(self, grid):
        return _must_not_run


@pytest.fixture(params=['kernel', 'torch'])
def path(request, monkeypatch):
    """The interpreted kernel (the PyTorch path made to raise) or the PyTorch path (the launch
    made to raise)."""
    if request.param == 'kernel':
        if not INTERPRET:
            pytest.skip("the kernel path needs TRITON_INTERPRET=1 on CPU")
        monkeypatch.setattr(fr, '_torch_path', _must_not_run)
    else:
        monkeypatch.setattr(fr, 'use_kernels', lambda x: False)
        monkeypatch.setattr(fr, 'fused_recurrent_kda_kernel', _NoLaunch())
    return request.param


def poisoned_pool(P, HV, K, V, live_slots, vfirst=False, dtype=torch.float32):
    """A pool whose addressed slots hold a random state and every other slot NaN."""
    pool = torch.full((P, HV, V, K) if vfirst else (P, HV, K, V), float('nan'), dtype=dtype)
    for s in live_slots:
        pool[s] = make_state(1, HV, K, V, state_v_first=vfirst, dtype=dtype)[0]
    return pool


def sequences(x, cu_seqlens):
    """(batch row, first token, end) of every sequence."""
    B, T = x['q'].shape[:2]
    if cu_seqlens is None:
        return [(b, 0, T) for b in range(B)]
    c = cu_seqlens.tolist()
    return [(0, c[n], c[n + 1]) for n in range(len(c) - 1)]


def oracle_pool(x, pool, slots, cu_seqlens=None, **kw):
    """Float64 outputs and pool after the call, sequence by sequence: slot < 0 zero outputs,
    slot >= P NaN outputs, else the recurrence from pool[slot] written back."""
    o = torch.zeros(x['v'].shape, dtype=torch.float64)
    after = to64(pool).clone()
    for n, (b, t0, t1) in enumerate(sequences(x, cu_seqlens)):
        s = int(slots[n])
        if s < 0:
            continue
        if s >= pool.shape[0]:
            o[b, t0:t1] = float('nan')
            continue
        seq = {name: to64(t[b:b + 1, t0:t1]) for name, t in x.items()}
        o_n, S = naive_recurrent_kda(**seq, initial_state=after[s:s + 1], output_final_state=True, **kw)
        o[b, t0:t1] = o_n[0]
        after[s] = S[0]
    return o, after


def oracle_speculative(x, pool, slots, accepted, cu_seqlens=None, **kw):
    """Float64 speculative decoding: from slot[n, accepted[n] - 1], the state after token t
    into slot[n, t], one token at a time."""
    o = torch.zeros(x['v'].shape, dtype=torch.float64)
    after = to64(pool).clone()
    for n, (b, t0, t1) in enumerate(sequences(x, cu_seqlens)):
        s = int(slots[n, int(accepted[n]) - 1])
        if s < 0:
            continue
        S = after[s:s + 1].clone()
        for t in range(t0, t1):
            tok = {name: to64(v[b:b + 1, t:t + 1]) for name, v in x.items()}
            o_t, S = naive_recurrent_kda(**tok, initial_state=S, output_final_state=True, **kw)
            o[b, t] = o_t[0, 0]
            w = int(slots[n, t - t0])
            if w >= 0:
                after[w] = S[0]
    return o, after


def assert_pool(pool, expected, slots, what, tol=TOL):
    """Addressed live slots within ``tol`` of the oracle; every other slot bit for bit as before
    (NaN where poisoned)."""
    live = sorted({int(s) for s in torch.as_tensor(slots).flatten().tolist() if 0 <= s < pool.shape[0]})
    e = rel_err(pool[live], expected[live])
    assert e < tol, f"{what}: written slots rel err {e:.3e}"
    rest = [s for s in range(pool.shape[0]) if s not in live]
    same = torch.equal(pool[rest].isnan(), expected[rest].isnan()) and torch.equal(
        pool[rest].nan_to_num(7.), expected[rest].to(pool.dtype).nan_to_num(7.))
    assert same, f"{what}: slots {rest} not addressed (or padding) were modified"


def assert_rounded_once(stored, exact32, path):
    """``stored`` (16 bits) is the float32 result rounded once: to nearest on the PyTorch path
    (and on a GPU); Triton's interpreter converts float32 to bfloat16 by truncation, so there
    either neighbour of the float32 value is accepted. A state rounded at every token would
    stray further."""
    if path == 'torch':
        assert torch.equal(stored, exact32.to(stored.dtype)), "stored states must be rounded once, to nearest"
        return
    ulp = torch.finfo(stored.dtype).eps * exact32.abs()
    gap = (stored.float() - exact32).abs()
    assert (gap <= ulp).all(), f"stored states {gap.max():.3e} from the float32 result, more than an ulp"


# ------------------------------------------------------------------------ pool with padding

CASES = {
    # name: (B, T, H, HV, K, V, varlen lengths or None, vfirst, slots, channel beta)
    'decode_padding_first_last': (4, 1, 1, 2, 16, 24, None, False, [-1, 6, 0, -1], False),
    'prefill_gva_vfirst': (3, 5, 1, 2, 20, 16, None, True, [3, -1, 1], False),
    'varlen_padding': (1, None, 1, 2, 16, 16, [3, 0, 2, 4], False, [2, 5, -1, 0], False),
    'channel_beta': (3, 3, 1, 2, 16, 40, None, False, [4, -7, 2], True),
}


@pytest.mark.parametrize('idx_dtype', [torch.int32, torch.int64])
@pytest.mark.parametrize('cfg', CASES.values(), ids=CASES.keys())
def test_pool_matches_oracle(path, cfg, idx_dtype):
    """Each sequence's slot against the float64 recurrence from that slot; padding (negative
    slots, -1 and below) gives zero outputs and reads or writes nothing: the NaN-poisoned slots
    stay NaN and no NaN reaches a live output."""
    B, T, H, HV, K, V, lengths, vfirst, slots, channel = cfg
    P = 7
    cu = None
    if lengths is not None:
        T, cu = sum(lengths), make_cu_seqlens(lengths)
    x = make_inputs(B, T, H, HV, K, V)
    if channel:
        x['beta'] = torch.rand(B, T, HV, V)
    idx = torch.tensor(slots, dtype=idx_dtype)
    pool = poisoned_pool(P, HV, K, V, [s for s in slots if s >= 0], vfirst)
    ref_o, ref_pool = oracle_pool(x, pool, idx, cu_seqlens=cu, state_v_first=vfirst)
    out = torch.full((B, T, HV, V), float('nan'))
    o, ht = fused_recurrent_kda(**x, initial_state=pool, output_final_state=True, inplace_final_state=True,
                                ssm_state_indices=idx, out=out, cu_seqlens=cu, state_v_first=vfirst)
    assert ht is pool and o is out
    assert torch.isfinite(o).all(), "a padding row's output must be 0, a live one finite"
    assert rel_err(o, ref_o) < TOL, f"outputs rel err {rel_err(o, ref_o):.3e}"
    assert_pool(pool, ref_pool, idx, 'pool')


@pytest.mark.parametrize('which', ['decode', 'speculative'])
def test_slot_past_pool_is_nan_and_touches_nothing(path, which):
    """A live slot >= P (read or write position) gives its sequence's outputs NaN (loud, with no
    device sync) and writes nothing; the other sequences are computed as usual."""
    B, H, HV, K, V, P = 3, 1, 2, 16, 16, 5
    T = 1 if which == 'decode' else 3
    x = make_inputs(B, T, H, HV, K, V)
    if which == 'decode':
        idx, kw = torch.tensor([1, P, 2 ** 40]), {}
        live = [1]
    else:
        # Sequence 1 reads slot P; sequence 2 reads slot 4 and would write its second state to P + 3.
        idx = torch.tensor([[0, 1, 2], [P, -1, -1], [4, P + 3, 3]])
        kw = dict(num_accepted_tokens=torch.tensor([2, 1, 1]))
        live = [0, 1, 2, 3, 4]
    pool = poisoned_pool(P, HV, K, V, live)
    before = pool.clone()
    o, _ = fused_recurrent_kda(**x, initial_state=pool, inplace_final_state=True, ssm_state_indices=idx, **kw)
    assert torch.isfinite(o[0]).all()
    assert torch.isnan(o[1]).all(), "a sequence whose slot is past the pool must give NaN outputs"
    if which == 'decode':
        assert torch.isnan(o[2]).all()
        assert torch.equal(pool[[0, 2, 3, 4]].isnan(), before[[0, 2, 3, 4]].isnan())
    else:
        assert torch.isfinite(o[2, [0, 2]]).all() and torch.isnan(o[2, 1]).all(), \
            "only the token whose state could not be stored is flagged"
    assert not torch.equal(pool[1 if which == 'decode' else 3], before[1 if which == 'decode' else 3])


# ------------------------------------------------------------------------ speculative decoding

@pytest.mark.parametrize('varlen', [False, True])
def test_speculative_matches_oracle(path, varlen):
    """ssm_state_indices [N, T_idx] with num_accepted_tokens: each sequence starts from the
    state after its last accepted token and stores the state after every token; a padding row
    (every slot -1) and a padding write slot are skipped. Against the float64 oracle; the
    poisoned slots stay NaN."""
    H, HV, K, V, P = 1, 2, 16, 20, 16
    idx = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7], [-1, -1, -1, -1], [8, 9, -1, 10]])
    accepted = torch.tensor([2, 4, 1, 1])
    if varlen:
        lengths = [4, 2, 3, 4]
        B, T, cu = 1, sum(lengths), make_cu_seqlens(lengths)
    else:
        B, T, cu = 4, 4, None
    x = make_inputs(B, T, H, HV, K, V)
    # Readable slots hold states; the rest (including those only written) NaN.
    pool = poisoned_pool(P, HV, K, V, [1, 7, 8])
    ref_o, ref_pool = oracle_speculative(x, pool, idx, accepted, cu_seqlens=cu)
    o, _ = fused_recurrent_kda(**x, initial_state=pool, inplace_final_state=True, ssm_state_indices=idx,
                               num_accepted_tokens=accepted, cu_seqlens=cu)
    assert torch.isfinite(o).all()
    assert rel_err(o, ref_o) < TOL, f"outputs rel err {rel_err(o, ref_o):.3e}"
    # Varlen: sequence 1 has 2 tokens, so slots 6 and 7 (read, not written) must stay as they were.
    written = [0, 1, 2, 3, 4, 5, 8, 9, 10] if varlen else [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    assert_pool(pool, ref_pool, written, 'speculative pool')


def test_speculative_equals_single_steps(path):
    """A speculative call over T = 3 tokens equals three single-token calls with 1-D indices
    (slot idx[n, t - 1] to idx[n, t] by copying), bit for bit on the outputs and stored states."""
    B, T, H, HV, K, V, P = 3, 3, 1, 2, 16, 24, 12
    x = make_inputs(B, T, H, HV, K, V)
    idx = torch.tensor([[0, 1, 2], [5, 4, 3], [9, 10, 11]])
    accepted = torch.tensor([3, 1, 2])
    pool = make_state(P, HV, K, V)
    spec = pool.clone()
    o_spec, _ = fused_recurrent_kda(**x, initial_state=spec, inplace_final_state=True,
                                    ssm_state_indices=idx, num_accepted_tokens=accepted)
    steps, outs = pool.clone(), []
    current = idx[torch.arange(B), accepted - 1]
    for t in range(T):
        steps[idx[:, t]] = steps[current]
        o_t, _ = fused_recurrent_kda(**{n: v[:, t:t + 1] for n, v in x.items()}, initial_state=steps,
                                     inplace_final_state=True, ssm_state_indices=idx[:, t])
        outs.append(o_t)
        current = idx[:, t]
    assert torch.equal(o_spec, torch.cat(outs, 1)), "speculative outputs differ from single steps"
    assert torch.equal(spec, steps), "speculative stored states differ from single steps"


# ----------------------------------------------------------------------------- 16-bit pools

@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16])
def test_16bit_pool_rounds_once(path, dtype):
    """A 16-bit pool is read into float32 and each stored state rounded once: the stored slots
    equal the float32 pool's results (from the same values) rounded, bit for bit, and the outputs
    equal the float32 pool's; both within a 16-bit rounding of the float64 oracle."""
    B, T, H, HV, K, V, P = 3, 4, 1, 2, 16, 16, 6
    x = make_inputs(B, T, H, HV, K, V)
    idx = torch.tensor([4, -1, 1])
    pool16 = poisoned_pool(P, HV, K, V, [1, 4], dtype=dtype)
    pool32 = pool16.float()
    ref_o, ref_pool = oracle_pool(x, pool16, idx)
    o16, _ = fused_recurrent_kda(**x, initial_state=pool16, inplace_final_state=True, ssm_state_indices=idx)
    o32, _ = fused_recurrent_kda(**x, initial_state=pool32, inplace_final_state=True, ssm_state_indices=idx)
    assert pool16.dtype == dtype
    assert torch.equal(o16, o32), "the outputs depend only on the values read, not the pool's dtype"
    assert_rounded_once(pool16[[1, 4]], pool32[[1, 4]], path)
    assert_pool(pool16, ref_pool, idx, '16-bit pool', tol=torch.finfo(dtype).eps)


@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16])
def test_final_state_dtype(path, dtype):
    """A new final state is float32 unless final_state_dtype asks: then the float32 one rounded;
    a 16-bit initial state (not in place) still gives a float32 final state by default."""
    B, T, H, HV, K, V = 2, 3, 1, 2, 16, 16
    x = make_inputs(B, T, H, HV, K, V)
    h0 = make_state(B, HV, K, V, dtype=dtype)
    _, ht32 = fused_recurrent_kda(**x, initial_state=h0, output_final_state=True)
    _, ht16 = fused_recurrent_kda(**x, initial_state=h0, output_final_state=True, final_state_dtype=dtype)
    assert ht32.dtype == torch.float32 and ht16.dtype == dtype
    assert_rounded_once(ht16, ht32, path)


# --------------------------------------------------------------------------- malformed calls

def _malformed(P=6, B=3, T=2, HV=2, K=16, V=16):
    x = make_inputs(B, T, 1, HV, K, V)
    good = torch.tensor([0, 1, 2])
    spec = torch.tensor([[0, 1], [2, 3], [4, 5]])
    return x, {
        # name: (keyword arguments, error, message)
        'index float': (dict(ssm_state_indices=good.float()), TypeError, 'int32 or int64'),
        'index [N + 1]': (dict(ssm_state_indices=torch.tensor([0, 1, 2, 3])), ValueError, r'shape \[3\]'),
        'index on another device': (dict(ssm_state_indices=good.to('meta')), ValueError, 'must be on cpu'),
        'duplicate live slots': (dict(ssm_state_indices=torch.tensor([1, -1, 1])), ValueError, r'slots \[1\]'),
        'spec duplicate slots': (dict(ssm_state_indices=torch.tensor([[0, 1], [1, 2], [3, 4]]),
                                      num_accepted_tokens=torch.tensor([1, 1, 1])), ValueError, r'slots \[1\]'),
        'accepted 0': (dict(ssm_state_indices=spec, num_accepted_tokens=torch.tensor([1, 0, 1])),
                       ValueError, r'num_accepted_tokens must lie in \[1, 2\]'),
        'accepted > T_idx': (dict(ssm_state_indices=spec, num_accepted_tokens=torch.tensor([1, 3, 1])),
                             ValueError, r'num_accepted_tokens must lie in \[1, 2\]'),
        'accepted float': (dict(ssm_state_indices=spec, num_accepted_tokens=torch.tensor([1., 1., 1.])),
                           TypeError, 'num_accepted_tokens must be int32 or int64'),
        'accepted [N - 1]': (dict(ssm_state_indices=spec, num_accepted_tokens=torch.tensor([1, 1])),
                             ValueError, r'num_accepted_tokens must have shape \[3\]'),
        'accepted with 1-D index': (dict(ssm_state_indices=good, num_accepted_tokens=torch.tensor([1, 1, 1])),
                                    ValueError, r'shape \[N, T_idx\]'),
        'accepted without index': (dict(ssm_state_indices=None, num_accepted_tokens=torch.tensor([1, 1, 1])),
                                   ValueError, 'requires ssm_state_indices'),
        '2-D index without accepted': (dict(ssm_state_indices=spec), ValueError, 'requires num_accepted_tokens'),
        'index columns < T': (dict(ssm_state_indices=spec[:, :1], num_accepted_tokens=torch.tensor([1, 1, 1])),
                              ValueError, 'T_idx >= 2'),
        'pool not contiguous in slots': (dict(ssm_state_indices=good, initial_state='strided'), ValueError,
                                         'contiguous'),
        'final_state_dtype in place': (dict(ssm_state_indices=good, final_state_dtype=torch.bfloat16),
                                       ValueError, 'final_state_dtype'),
        'final_state_dtype int': (dict(ssm_state_indices=good, final_state_dtype=torch.int32),
                                  TypeError, 'final_state_dtype'),
        'channel beta wrong V': (dict(ssm_state_indices=good, beta=torch.rand(B, T, HV, V + 1)), ValueError,
                                 'beta must have shape'),
    }


@pytest.mark.parametrize('case', list(_malformed()[1]))
def test_malformed_refused_nothing_written(path, case):
    """Every malformed serving call raises before any kernel runs, naming the argument, and
    leaves the pool and out bit for bit as they were."""
    x, cases = _malformed()
    kw, error, message = cases[case]
    kw = dict(kw)
    pool = make_state(6, 2, 16, 16)
    if kw.get('initial_state') == 'strided':
        pool = make_state(12, 2, 16, 16)[::2]
        kw.pop('initial_state')
    x = dict(x, beta=kw.pop('beta', x['beta']))
    before = pool.clone()
    out = torch.full(x['v'].shape, 3.0)
    with pytest.raises(error, match=message):
        fused_recurrent_kda(**x, initial_state=pool, inplace_final_state=True, out=out, **kw)
    assert torch.equal(pool, before) and (out == 3.0).all(), "a refused call wrote something"


# ------------------------------------------------------------------------------------ CUDA

@requires_cuda
@pytest.mark.gpu
def test_cuda_bf16_pool_decode_real_size():
    """B = 64, H = 32, K = V = 128, a bf16 pool of 96 slots with padding rows: the outputs and
    stored slots against the float64 oracle within a bf16 rounding; untouched slots bit for bit."""
    B, H, K, V, P = 64, 32, 128, 128, 96
    x = make_inputs(B, 1, H, H, K, V, dtype=torch.bfloat16, gate_dtype=torch.float32, device='cuda')
    idx = torch.randperm(P, device='cuda')[:B]
    idx[::9] = -1
    pool = make_state(P, H, K, V, device='cuda', dtype=torch.bfloat16)
    before = pool.clone()
    o, _ = fused_recurrent_kda(**x, initial_state=pool, inplace_final_state=True, ssm_state_indices=idx)
    ref_o, ref_pool = oracle_pool({n: t.cpu() for n, t in x.items()}, before.cpu(), idx.cpu())
    assert rel_err(o.cpu(), ref_o) < 1e-2
    live = idx[idx >= 0]
    assert rel_err(pool[live].cpu(), ref_pool[live.cpu()]) < 1e-2
    rest = torch.ones(P, dtype=torch.bool, device='cuda')
    rest[live] = False
    assert torch.equal(pool[rest], before[rest])


@requires_cuda
@pytest.mark.gpu
def test_cuda_graph_speculative_decode():
    """One speculative step (T = 4) captured in a CUDA graph, replayed with new indices, accepted
    counts and inputs written in place: equal to the eager call each time."""
    B, T, H, K, V, P = 8, 4, 4, 64, 64, 48
    dev = 'cuda'
    x = make_inputs(B, T, H, H, K, V, dtype=torch.bfloat16, gate_dtype=torch.float32, device=dev)
    pool = make_state(P, H, K, V, device=dev)
    idx = torch.randperm(P, device=dev)[:B * T].view(B, T).contiguous()
    accepted = torch.ones(B, dtype=torch.int32, device=dev)
    out = torch.empty(B, T, H, V, dtype=torch.bfloat16, device=dev)

    def step():
        fused_recurrent_kda(**x, initial_state=pool, inplace_final_state=True, ssm_state_indices=idx,
                            num_accepted_tokens=accepted, out=out)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(3):
        new = make_inputs(B, T, H, H, K, V, dtype=torch.bfloat16, gate_dtype=torch.float32, device=dev)
        for name in x:
            x[name].copy_(new[name])
        idx.copy_(torch.randperm(P, device=dev)[:B * T].view(B, T))
        idx[0] = -1
        accepted.copy_(torch.randint(1, T + 1, (B,), device=dev))
        pool.copy_(make_state(P, H, K, V, device=dev))
        eager = pool.clone()
        graph.replay()
        o_e, _ = fused_recurrent_kda(**{n: t.clone() for n, t in x.items()}, initial_state=eager,
                                     inplace_final_state=True, ssm_state_indices=idx.clone(),
                                     num_accepted_tokens=accepted.clone())
        torch.cuda.synchronize()
        assert torch.equal(out, o_e) and torch.equal(pool, eager)
        assert (out[0] == 0).all()
