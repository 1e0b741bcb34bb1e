"""The PyTorch references: the naive recurrence (the oracle) checked against closed forms, and the
chunked WY/UT algebra (``chunk_kda_reference``) checked against the oracle in float64."""
from __future__ import annotations

import pytest
import torch

from kda import chunk_kda_reference, naive_recurrent_kda
from kda.reference import _poison_bad_decays
from conftest import make_cu_seqlens, make_inputs, make_state, rel_err

F64 = torch.float64


def inputs64(*shape, **kw):
    return make_inputs(*shape, dtype=F64, **kw)


# ---------------------------------------------------------------- the oracle against closed forms


def test_naive_single_step_closed_form():
    """One token from a random state, written as matrices: S1 = D S0 + beta k (v - (D S0)^T k)^T,
    o = S1^T (scale q). Checks the order (the correction is measured after the decay) and scale."""
    B, H, K, V = 2, 3, 5, 4
    x = inputs64(B, 1, H, H, K, V)
    S0 = make_state(B, H, K, V, dtype=F64)
    scale = 0.37
    o, S1 = naive_recurrent_kda(**x, scale=scale, initial_state=S0, output_final_state=True)
    q, k, v, g, beta = (x[n][:, 0] for n in ('q', 'k', 'v', 'g', 'beta'))
    DS = S0 * g.exp()[..., None]                                      # [B, H, K, V]
    pred = torch.einsum('bhkv,bhk->bhv', DS, k)
    S_exp = DS + torch.einsum('bhk,bhv->bhkv', k, beta[..., None] * (v - pred))
    o_exp = torch.einsum('bhkv,bhk->bhv', S_exp, scale * q)
    assert rel_err(S1, S_exp) < 1e-14, f"final state vs closed form: {rel_err(S1, S_exp):.3e}"
    assert rel_err(o[:, 0], o_exp) < 1e-14, f"output vs closed form: {rel_err(o[:, 0], o_exp):.3e}"


def test_naive_pure_decay_closed_form():
    """With beta = 0 nothing is written: S_t = Diag(exp(g_1 + ... + g_t)) S_0, default scale K^-0.5."""
    B, T, H, HV, K, V = 1, 6, 1, 2, 4, 3
    x = inputs64(B, T, H, HV, K, V)
    x['beta'].zero_()
    S0 = make_state(B, HV, K, V, dtype=F64)
    o, ST = naive_recurrent_kda(**x, initial_state=S0, output_final_state=True)
    c = x['g'].cumsum(1)                                              # [B, T, HV, K]
    St = S0[:, None] * c.exp()[..., None]                             # [B, T, HV, K, V]
    q = x['q'].repeat_interleave(HV // H, dim=2) * K ** -0.5
    o_exp = torch.einsum('bthkv,bthk->bthv', St, q)
    assert rel_err(o, o_exp) < 1e-14, f"pure decay output: {rel_err(o, o_exp):.3e}"
    assert rel_err(ST, St[:, -1]) < 1e-14, f"pure decay state: {rel_err(ST, St[:, -1]):.3e}"


def test_naive_delta_rule_stores_orthonormal_keys():
    """No decay, beta = 1, orthonormal keys: the state memorizes v exactly, so querying with
    k_i / scale returns v_i (last write wins for a repeated key)."""
    K, V = 6, 3
    keys = torch.linalg.qr(torch.randn(K, K, dtype=F64))[0].T        # rows orthonormal
    T = 4
    k = keys[[0, 1, 2, 1]].view(1, T, 1, K)
    v = torch.randn(1, T, 1, V, dtype=F64)
    g = torch.zeros(1, T, 1, K, dtype=F64)
    beta = torch.ones(1, T, 1, dtype=F64)
    _, S = naive_recurrent_kda(k, k, v, g, beta, output_final_state=True)
    recalled = S[0, 0].T @ keys[:3].T                                 # [V, 3]
    expected = torch.stack([v[0, 0, 0], v[0, 3, 0], v[0, 2, 0]], 1)
    assert rel_err(recalled, expected) < 1e-13, f"recall: {rel_err(recalled, expected):.3e}"


def test_naive_gva_equals_repeated_heads():
    """HV = 4 H: value head hv reads q/k head hv // 4, i.e. the same as repeating q and k."""
    B, T, H, HV, K, V = 2, 5, 2, 8, 4, 3
    x = inputs64(B, T, H, HV, K, V)
    S0 = make_state(B, HV, K, V, dtype=F64)
    o, S = naive_recurrent_kda(**x, initial_state=S0, output_final_state=True)
    xr = dict(x, q=x['q'].repeat_interleave(4, dim=2), k=x['k'].repeat_interleave(4, dim=2))
    o2, S2 = naive_recurrent_kda(**xr, initial_state=S0, output_final_state=True)
    assert rel_err(o, o2) < 1e-15 and rel_err(S, S2) < 1e-15, "GVA head mapping differs from repeat_interleave"
    # and a wrong mapping (hv % H) would differ:
    xw = dict(x, q=x['q'].repeat(1, 1, 4, 1), k=x['k'].repeat(1, 1, 4, 1))
    o3, _ = naive_recurrent_kda(**xw, initial_state=S0, output_final_state=True)
    assert rel_err(o3, o) > 1e-3, "test cannot tell head mappings apart"


def test_naive_varlen_equals_separate_calls():
    """Packed sequences (with an empty and a length-1 one) equal one call per sequence."""
    lengths = [5, 0, 1, 9, 3]
    T, H, HV, K, V = sum(lengths), 1, 2, 5, 3
    x = inputs64(1, T, H, HV, K, V)
    cu = make_cu_seqlens(lengths)
    S0 = make_state(len(lengths), HV, K, V, dtype=F64)
    o, S = naive_recurrent_kda(**x, initial_state=S0, output_final_state=True, cu_seqlens=cu)
    assert o.shape == (1, T, HV, V) and S.shape == (len(lengths), HV, K, V), "varlen output shapes"
    for n, (bos, eos) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        xs = {name: t[:, bos:eos] for name, t in x.items()}
        on, Sn = naive_recurrent_kda(**xs, initial_state=S0[n:n + 1], output_final_state=True)
        assert torch.equal(o[:, bos:eos], on), f"sequence {n}: output differs from a separate call"
        assert torch.equal(S[n:n + 1], Sn), f"sequence {n}: final state differs from a separate call"
    assert torch.equal(S[1], S0[1]), "an empty sequence must return its initial state unchanged"


def test_naive_l2norm_option():
    """use_qk_l2norm_in_kernel equals normalizing q and k by x / sqrt(sum x^2 + 1e-6) first."""
    B, T, H, K, V = 1, 4, 2, 6, 3
    x = inputs64(B, T, H, H, K, V, normalize_k=False)
    o, S = naive_recurrent_kda(**x, use_qk_l2norm_in_kernel=True, output_final_state=True)
    n = lambda t: t / torch.sqrt((t * t).sum(-1, keepdim=True) + 1e-6)  # noqa: E731
    o2, S2 = naive_recurrent_kda(**dict(x, q=n(x['q']), k=n(x['k'])), output_final_state=True)
    assert rel_err(o, o2) < 1e-14 and rel_err(S, S2) < 1e-14, "l2norm option differs from manual normalization"


def test_naive_state_v_first_is_transpose():
    B, T, H, K, V = 2, 3, 1, 5, 3
    x = inputs64(B, T, H, H, K, V)
    S0 = make_state(B, H, K, V, dtype=F64)
    o, S = naive_recurrent_kda(**x, initial_state=S0, output_final_state=True)
    o2, S2 = naive_recurrent_kda(**x, initial_state=S0.transpose(-1, -2).contiguous(),
                                 output_final_state=True, state_v_first=True)
    assert torch.equal(o, o2), "state_v_first changed the output"
    assert S2.shape == (B, H, V, K) and torch.equal(S2, S.transpose(-1, -2)), "state_v_first final state layout"


def test_naive_dtypes_and_none_state():
    x = make_inputs(1, 3, 1, 1, 4, 4, dtype=torch.bfloat16, gate_dtype=torch.float32)
    o, S = naive_recurrent_kda(**x)
    assert S is None, "final state must be None unless output_final_state=True"
    assert o.dtype == torch.bfloat16, f"output must have q's dtype, got {o.dtype}"
    _, S = naive_recurrent_kda(**x, output_final_state=True)
    assert S.dtype == torch.float32, f"final state must be float32, got {S.dtype}"


# ------------------------------------------------------------------ chunk algebra vs the oracle

CHUNK_CASES = [
    # chunk_size, B, T, H, HV, K, V
    (4, 2, 37, 1, 2, 12, 7),
    (16, 1, 37, 2, 4, 60, 48),
    (32, 2, 37, 2, 2, 32, 100),
    (64, 1, 133, 1, 1, 20, 16),
    (64, 2, 7, 1, 4, 8, 8),
]


@pytest.mark.parametrize('chunk_size,B,T,H,HV,K,V', CHUNK_CASES)
@pytest.mark.parametrize('state_v_first', [False, True])
def test_chunk_reference_matches_naive(chunk_size, B, T, H, HV, K, V, state_v_first):
    x = inputs64(B, T, H, HV, K, V)
    S0 = make_state(B, HV, K, V, state_v_first=state_v_first, dtype=F64)
    kw = dict(scale=0.3, initial_state=S0, output_final_state=True, state_v_first=state_v_first)
    o_ref, S_ref = naive_recurrent_kda(**x, **kw)
    o, S = chunk_kda_reference(**x, **kw, chunk_size=chunk_size)
    assert rel_err(o, o_ref) < 1e-12, f"chunk {chunk_size} output: {rel_err(o, o_ref):.3e}"
    assert rel_err(S, S_ref) < 1e-12, f"chunk {chunk_size} final state: {rel_err(S, S_ref):.3e}"


@pytest.mark.parametrize('chunk_size', [4, 16, 32, 64])
def test_chunk_reference_varlen(chunk_size):
    lengths = [37, 0, 1, 70, 5]
    T, H, HV, K, V = sum(lengths), 1, 2, 16, 12
    x = inputs64(1, T, H, HV, K, V)
    cu = make_cu_seqlens(lengths)
    S0 = make_state(len(lengths), HV, K, V, dtype=F64)
    kw = dict(initial_state=S0, output_final_state=True, cu_seqlens=cu)
    o_ref, S_ref = naive_recurrent_kda(**x, **kw)
    o, S = chunk_kda_reference(**x, **kw, chunk_size=chunk_size)
    assert rel_err(o, o_ref) < 1e-12, f"varlen chunk {chunk_size} output: {rel_err(o, o_ref):.3e}"
    assert rel_err(S, S_ref) < 1e-12, f"varlen chunk {chunk_size} state: {rel_err(S, S_ref):.3e}"
    assert torch.equal(S[1], S0[1]), "an empty sequence must keep its initial state"


@pytest.mark.parametrize('chunk_size', [4, 16, 32, 64])
def test_chunk_reference_strong_decay(chunk_size):
    """log-decays of -20 per step, -25 and -1e4: the chunk form must stay finite and exact
    (every exponent it evaluates is <= 0)."""
    B, T, H, HV, K, V = 2, 45, 1, 2, 16, 8
    x = inputs64(B, T, H, HV, K, V, strong_decay=True)
    S0 = make_state(B, HV, K, V, dtype=F64)
    kw = dict(initial_state=S0, output_final_state=True)
    o_ref, S_ref = naive_recurrent_kda(**x, **kw)
    o, S = chunk_kda_reference(**x, **kw, chunk_size=chunk_size)
    assert torch.isfinite(o).all() and torch.isfinite(S).all(), "strong decay produced inf/NaN"
    # Every exponent is a sum of the steps it spans alone (observed errors <= 3e-16 over 40 seeds).
    # Differences c_i - c_j of in-chunk cumulative sums, which reach ~-2e5 here, would carry
    # ~|c| * 2^-52 of absolute rounding into an exponent (errors up to ~2e-12).
    assert rel_err(o, o_ref) < 1e-14, f"strong decay output: {rel_err(o, o_ref):.3e}"
    assert rel_err(S, S_ref) < 1e-14, f"strong decay state: {rel_err(S, S_ref):.3e}"


@pytest.mark.parametrize('row', [0, 7, 15])
def test_chunk_reference_minus_inf_with_gradients(row):
    """g = -inf (a decay factor of exactly 0) at the first, a middle and the last row of a chunk,
    in half the key channels of one head: outputs, final state and every gradient equal the
    recurrence's (whose own gradients are finite), none NaN."""
    B, T, H, HV, K, V, chunk_size = 1, 40, 1, 2, 8, 4, 16
    x = inputs64(B, T, H, HV, K, V)
    x['g'][0, chunk_size + row, 1, :K // 2] = -torch.inf
    S0 = make_state(B, HV, K, V, dtype=F64)
    do, dht = torch.randn(B, T, HV, V, dtype=F64), torch.randn(B, HV, K, V, dtype=F64)

    def run(fn, **kw):
        leaves = [t.clone().requires_grad_() for t in (*x.values(), S0)]
        o, S = fn(*leaves[:5], initial_state=leaves[5], output_final_state=True, **kw)
        grads = torch.autograd.grad((o * do).sum() + (S * dht).sum(), leaves)
        return [o, S, *grads]
    names = ['o', 'final_state', 'dq', 'dk', 'dv', 'dg', 'dbeta', 'dinitial_state']
    expected = run(naive_recurrent_kda)
    got = run(chunk_kda_reference, chunk_size=chunk_size)
    for name, e, r in zip(names, got, expected):
        assert torch.isfinite(r).all(), f"the recurrence's own {name} is not finite"
        assert rel_err(e, r) < 1e-13, f"-inf at row {row}: {name} {rel_err(e, r):.3e}"


def test_bad_log_decay_marks_from_block_start():
    """The out-of-contract policy (kda/reference.py): a head is poisoned, g NaN, from the first
    token of the block (the chunk; a single token for the recurrence) holding its first log-decay
    > 0 or NaN; -inf and 0 are inside the contract."""
    g = -torch.rand(10, 4, 3, dtype=F64)
    g[2, 0, :] = -torch.inf
    g[3, 0, 1] = 0.0
    g[5, 1, 2] = 0.5
    g[7, 2, 0] = torch.nan
    g[9, 2, 0] = 0.5
    for block, first in ((4, [10, 4, 4, 10]), (1, [10, 5, 7, 10])):
        poisoned_g, poisoned = _poison_bad_decays(g, block)
        expected = torch.arange(10)[:, None] >= torch.tensor(first)[None]
        assert torch.equal(poisoned, expected), f"block {block}: poisoned tokens {poisoned.T}"
        assert torch.isnan(poisoned_g[expected]).all(), f"block {block}: poisoned g not NaN"
        assert torch.equal(poisoned_g[~expected], g[~expected]), f"block {block}: other g changed"


@pytest.mark.parametrize('chunk_size', [16, 64])
def test_chunk_reference_l2norm(chunk_size):
    B, T, H, HV, K, V = 1, 50, 2, 2, 24, 10
    x = inputs64(B, T, H, HV, K, V, normalize_k=False)
    kw = dict(output_final_state=True, use_qk_l2norm_in_kernel=True)
    o_ref, S_ref = naive_recurrent_kda(**x, **kw)
    o, S = chunk_kda_reference(**x, **kw, chunk_size=chunk_size)
    assert rel_err(o, o_ref) < 1e-12, f"l2norm output: {rel_err(o, o_ref):.3e}"
    assert rel_err(S, S_ref) < 1e-12, f"l2norm state: {rel_err(S, S_ref):.3e}"


# -------------------------------------------------------------------------------- gradients


def _grad_inputs(l2norm: bool):
    B, T, H, HV, K, V = 1, 3, 1, 2, 3, 2
    x = inputs64(B, T, H, HV, K, V, normalize_k=not l2norm)
    S0 = make_state(B, HV, K, V, dtype=F64)
    return [t.clone().requires_grad_() for t in (x['q'], x['k'], x['v'], x['g'], x['beta'], S0)]


@pytest.mark.parametrize('l2norm', [False, True])
def test_naive_gradcheck(l2norm):
    """Gradients of the oracle in q, k, v, g, beta and initial_state, through o and the final state."""
    args = _grad_inputs(l2norm)

    def f(q, k, v, g, beta, S0):
        return naive_recurrent_kda(q, k, v, g, beta, initial_state=S0, output_final_state=True,
                                   use_qk_l2norm_in_kernel=l2norm)
    assert torch.autograd.gradcheck(f, args), "naive_recurrent_kda gradcheck failed"

    # A loss through the final state alone reaches every input but q (S does not depend on q).
    _, S = f(*args)
    (S * torch.randn_like(S)).sum().backward()
    for name, t in zip('k v g beta initial_state'.split(), args[1:]):
        assert t.grad is not None and t.grad.abs().max() > 0, f"no gradient for {name} through the final state"
    assert args[0].grad is None or args[0].grad.abs().max() == 0, "q must not influence the final state"


def test_chunk_reference_gradcheck():
    args = _grad_inputs(False)

    def f(q, k, v, g, beta, S0):
        return chunk_kda_reference(q, k, v, g, beta, initial_state=S0, output_final_state=True,
                                   chunk_size=2)
    assert torch.autograd.gradcheck(f, args), "chunk_kda_reference gradcheck failed"
