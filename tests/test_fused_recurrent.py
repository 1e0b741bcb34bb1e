"""``fused_recurrent_kda`` against the float64 oracle.

Every CPU test runs on both paths of the launcher (the ``path`` fixture):

* ``kernel``: the Triton kernel through the interpreter (needs ``TRITON_INTERPRET=1``, skipped
  otherwise); the PyTorch fallback is made to raise, so the kernel really ran.
* ``torch``: the PyTorch CPU path (``use_kernels`` patched to False); the kernel launch raises.

float32 results must agree with ``naive_recurrent_kda`` in float64 to a relative error of 1e-5.
The CUDA tests at the end (bf16 at real sizes, CUDA-graph capture) are skipped without a GPU.
"""
from __future__ import annotations

import pytest
import torch

import kda.ops.fused_recurrent as fr
from kda import fused_recurrent_kda, naive_recurrent_kda
from kda.ops.utils import INTERPRET
from conftest import (make_cu_seqlens, make_inputs, make_state, reference64, rel_err,
                      requires_cuda, to64)

TOL = 1e-5


def _must_not_run(*args, **kwargs):
    raise AssertionError("this code path must not run in this test")


class _NoLaunch:
    def __getitem__(self, grid):
        return _must_not_run


@pytest.fixture(params=['kernel', 'torch'])
def path(request, monkeypatch):
    """Runs the test once through the interpreted Triton kernel and once through the PyTorch path."""
    if request.param == 'kernel':
        if not INTERPRET:
            pytest.skip("the kernel path needs TRITON_INTERPRET=1 on CPU")
        monkeypatch.setattr(fr, '_torch_path', _must_not_run)
    else:
        monkeypatch.setattr(fr, 'use_kernels', lambda x: False)
        monkeypatch.setattr(fr, 'fused_recurrent_kda_kernel', _NoLaunch())
    return request.param


def nan_like(shape, dtype=torch.float32):
    return torch.full(shape, float('nan'), dtype=dtype)


def check(o, ht, ref_o, ref_ht, what='', tol=TOL):
    """Output and final state finite and within `tol` (relative error norm) of the reference."""
    assert torch.isfinite(o).all(), f"{what}: output has {(~torch.isfinite(o)).sum()} non-finite entries"
    e = rel_err(o, ref_o)
    assert e < tol, f"{what}: output rel err {e:.3e} >= {tol:g}"
    if ref_ht is not None:
        assert ht is not None, f"{what}: final state missing"
        assert ht.dtype == torch.float32, f"{what}: final state dtype {ht.dtype}, expected float32"
        assert torch.isfinite(ht).all(), f"{what}: final state has non-finite entries"
        e = rel_err(ht, ref_ht)
        assert e < tol, f"{what}: final state rel err {e:.3e} >= {tol:g}"


# --------------------------------------------------------------------------- plain correctness

CONFIGS = {
    # name: (B, T, H, HV, K, V, with initial state, state_v_first, scale)
    'K60_V48': (2, 7, 2, 2, 60, 48, True, False, None),
    'gva2_K32_V100_T37': (1, 37, 1, 2, 32, 100, True, False, 0.2),
    'gva4_decode_vfirst': (3, 1, 1, 4, 16, 16, True, True, None),
    'no_state_vfirst_gva2': (2, 5, 2, 4, 60, 48, False, True, 1.0),
    'K256_V40': (1, 3, 1, 1, 256, 40, True, False, 0.05),
}


@pytest.mark.parametrize('cfg', CONFIGS.values(), ids=CONFIGS.keys())
def test_matches_reference(path, cfg):
    B, T, H, HV, K, V, with_state, vfirst, scale = cfg
    x = make_inputs(B, T, H, HV, K, V)
    h0 = make_state(B, HV, K, V, state_v_first=vfirst) if with_state else None
    h0_copy = None if h0 is None else h0.clone()
    kw = dict(scale=scale, initial_state=h0, state_v_first=vfirst)
    o, ht = fused_recurrent_kda(**x, **kw, output_final_state=True)
    ref_o, ref_ht = reference64(**x, **kw)
    assert o.shape == (B, T, HV, V) and o.dtype == torch.float32, f"output {tuple(o.shape)} {o.dtype}"
    assert ht.shape == ref_ht.shape, f"final state shape {tuple(ht.shape)}, expected {tuple(ref_ht.shape)}"
    check(o, ht, ref_o, ref_ht, str(cfg))
    if h0 is not None:
        assert torch.equal(h0, h0_copy), "initial_state was modified without inplace_final_state"
    o2, ht2 = fused_recurrent_kda(**x, **kw)
    assert ht2 is None, "final state must be None unless output_final_state=True"
    assert torch.equal(o2, o), "output_final_state changed the output"


def test_scale_is_used(path):
    """An explicit scale multiplies the output (o is linear in scale); the default is K^-0.5."""
    x = make_inputs(1, 4, 1, 1, 12, 8)
    o_def, _ = fused_recurrent_kda(**x)
    o_s, _ = fused_recurrent_kda(**x, scale=3.0)
    e = rel_err(o_s, o_def * (3.0 / 12 ** -0.5))
    assert e < TOL, f"scale=3 vs default: rel err {e:.3e}"


def test_strong_decay(path):
    """-20 on every step of a head, -25 on some tokens, -1e4 on some channels: finite and exact."""
    B, T, H, HV, K, V = 2, 37, 1, 2, 60, 48
    x = make_inputs(B, T, H, HV, K, V, strong_decay=True)
    h0 = 10 * make_state(B, HV, K, V)
    o, ht = fused_recurrent_kda(**x, initial_state=h0, output_final_state=True)
    check(o, ht, *reference64(**x, initial_state=h0), 'strong decay')


@pytest.mark.parametrize('H,HV', [(2, 2), (1, 4)])
def test_l2norm_in_kernel(path, H, HV):
    B, T, K, V = 2, 9, 60, 48
    x = make_inputs(B, T, H, HV, K, V, normalize_k=False)      # raw q, k with norms ~ 2 sqrt(K)
    h0 = make_state(B, HV, K, V)
    kw = dict(initial_state=h0, use_qk_l2norm_in_kernel=True, scale=0.5)
    o, ht = fused_recurrent_kda(**x, **kw, output_final_state=True)
    check(o, ht, *reference64(**x, **kw), 'l2norm')


def round_to_bf16(x: torch.Tensor, mode: str) -> torch.Tensor:
    """float32 -> bf16 with round-to-nearest-even ('rtne') or round-toward-zero ('rtz')."""
    x = x.float().contiguous()
    if mode == 'rtz':                       # drop the low 16 bits: exactly representable in bf16
        x = (x.view(torch.int32) & -65536).view(torch.float32)
    return x.to(torch.bfloat16)


def test_bf16_inputs(path):
    """bf16 q, k, v (float32 g, beta): the error vs the exact answer (float64 on the bf16 values)
    may be at most twice the reference's own error when it computes the same bf16 inputs in float32
    and rounds its output to bf16 -- both are dominated by that final rounding (see the CUDA test).
    The Triton interpreter converts float32 -> bf16 by truncation (its create_fp_trunc ignores the
    rounding mode; compiled kernels round to nearest even), so on the interpreter the yardstick is
    the reference rounded the same way: a truncated output is ~2x further off than a rounded one."""
    B, T, H, HV, K, V = 2, 6, 1, 2, 32, 40
    x = make_inputs(B, T, H, HV, K, V, dtype=torch.bfloat16, gate_dtype=torch.float32)
    h0 = make_state(B, HV, K, V)
    o, ht = fused_recurrent_kda(**x, initial_state=h0, output_final_state=True)
    assert o.dtype == torch.bfloat16, f"output must have q's dtype bf16, got {o.dtype}"
    ref_o, ref_ht = reference64(**x, initial_state=h0)
    r32_o, _ = naive_recurrent_kda(**{n: t.float() for n, t in x.items()}, initial_state=h0)
    r_o = round_to_bf16(r32_o, 'rtz' if path == 'kernel' else 'rtne')
    err, err_ref = rel_err(o, ref_o), rel_err(r_o, ref_o)
    assert err <= 2 * err_ref + 1e-6, f"bf16 output rel err {err:.3e} > 2 x reference's {err_ref:.3e}"
    assert rel_err(ht, ref_ht) < TOL, f"float32 state from bf16 inputs: {rel_err(ht, ref_ht):.3e}"


# ------------------------------------------------------------------------------------- varlen

@pytest.mark.parametrize('vfirst,cu_dtype', [(False, torch.int64), (True, torch.int64), (False, torch.int32)],
                         ids=['kv', 'vfirst', 'int32'])
def test_varlen(path, vfirst, cu_dtype):
    """Packed sequences with an empty and a length-1 sequence; out= poisoned with NaN."""
    lengths = [5, 0, 1, 13, 7]
    T, H, HV, K, V, N = sum(lengths), 1, 2, 60, 48, len(lengths)
    x = make_inputs(1, T, H, HV, K, V)
    cu = make_cu_seqlens(lengths, dtype=cu_dtype)
    h0 = make_state(N, HV, K, V, state_v_first=vfirst)
    out = nan_like((1, T, HV, V))
    kw = dict(initial_state=h0, cu_seqlens=cu, state_v_first=vfirst, scale=0.3)
    host = dict(cu_seqlens_cpu=cu.clone()) if vfirst else {}     # the host copy, when given, is used
    o, ht = fused_recurrent_kda(**x, **kw, **host, output_final_state=True, out=out)
    assert o.data_ptr() == out.data_ptr(), "the output must be written into out="
    check(o, ht, *reference64(**x, **kw), 'varlen')
    assert torch.equal(ht[1], h0[1]), "the empty sequence must return its initial state unchanged"
    # and each sequence on its own gives the same thing
    for n, (bos, eos) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        if eos > bos:
            on, hn = fused_recurrent_kda(**{k_: t[:, bos:eos] for k_, t in x.items()}, scale=0.3,
                                         initial_state=h0[n:n + 1], state_v_first=vfirst,
                                         output_final_state=True)
            assert rel_err(o[:, bos:eos], on) < 1e-6 and rel_err(ht[n:n + 1], hn) < 1e-6, \
                f"sequence {n}: packed and separate calls differ"


# ------------------------------------------------------------------ every element is written

def test_out_every_element_written(path):
    """out= poisoned with NaN, V = 100 (several value tiles, a partial one), GVA: no NaN left."""
    B, T, H, HV, K, V = 2, 5, 1, 2, 20, 100
    x = make_inputs(B, T, H, HV, K, V)
    out = nan_like((B, T, HV, V))
    o, ht = fused_recurrent_kda(**x, output_final_state=True, out=out)
    assert o is out or o.data_ptr() == out.data_ptr(), "the output must be written into out="
    assert not torch.isnan(out).any(), f"{torch.isnan(out).sum()} output elements were never written"
    check(out, ht, *reference64(**x), 'out=')


# --------------------------------------------------------------------------- decode and serving

@pytest.mark.parametrize('inplace', [False, True])
def test_decode_loop_equals_one_call(path, inplace):
    """T decode steps (T = 1 each, state handed along) equal one call over the T tokens."""
    B, T, H, HV, K, V = 2, 9, 1, 2, 60, 48
    x = make_inputs(B, T, H, HV, K, V)
    h0 = make_state(B, HV, K, V)
    o_all, ht_all = fused_recurrent_kda(**x, initial_state=h0, output_final_state=True)
    state, outs = h0.clone(), []
    for t in range(T):
        step = {n: v[:, t:t + 1] for n, v in x.items()}
        o_t, new = fused_recurrent_kda(**step, initial_state=state, output_final_state=True,
                                       inplace_final_state=inplace)
        if inplace:
            assert new is state, "inplace_final_state=True must return initial_state itself"
        state = new
        outs.append(o_t)
    o_loop = torch.cat(outs, 1)
    assert rel_err(o_loop, o_all) < 1e-6, f"decode loop vs one call: output {rel_err(o_loop, o_all):.3e}"
    assert rel_err(state, ht_all) < 1e-6, f"decode loop vs one call: state {rel_err(state, ht_all):.3e}"
    check(o_loop, state, *reference64(**x, initial_state=h0), 'decode loop')


@pytest.mark.parametrize('vfirst', [False, True])
@pytest.mark.parametrize('output_final_state', [False, True])
def test_inplace_final_state(path, vfirst, output_final_state):
    B, T, H, HV, K, V = 2, 4, 1, 2, 16, 40
    x = make_inputs(B, T, H, HV, K, V)
    h0 = make_state(B, HV, K, V, state_v_first=vfirst)
    ref_o, ref_ht = reference64(**x, initial_state=h0, state_v_first=vfirst)
    state = h0.clone()
    o, ht = fused_recurrent_kda(**x, initial_state=state, output_final_state=output_final_state,
                                inplace_final_state=True, state_v_first=vfirst)
    if output_final_state:
        assert ht is state, "with inplace_final_state the returned final state is initial_state"
    else:
        assert ht is None, "final state must be None unless output_final_state=True"
    check(o, state, ref_o, ref_ht, 'inplace')


def test_l2norm_zero_and_tiny_rows(path):
    """use_qk_l2norm_in_kernel on zero rows of q and k (and k rows with a sum of squares near the
    1e-6 epsilon): finite, and as the reference's x / sqrt(sum x^2 + 1e-6). Random rows (sums
    ~1e2) cannot tell the epsilon from none (a helper's mutation dropping it in this kernel:
    NaN here, every other test passed)."""
    B, T, H, HV, K, V = 2, 6, 1, 2, 60, 48
    x = make_inputs(B, T, H, HV, K, V, normalize_k=False)
    x['q'][:, 1] = 0.
    x['k'][:, 3] = 0.
    x['q'][:, 4] = x['k'][:, 4] = 0.
    x['k'][:, 5] *= 1e-4
    kw = dict(initial_state=make_state(B, HV, K, V), use_qk_l2norm_in_kernel=True, scale=0.5)
    o, ht = fused_recurrent_kda(**x, **kw, output_final_state=True)
    check(o, ht, *reference64(**x, **kw), 'l2norm zero rows')


@pytest.mark.parametrize('B,T', [(0, 3), (2, 0)])
def test_empty_batch_or_sequence(path, B, T):
    """No batch rows, or no tokens: an empty output and the initial state back (B = 0 raised on
    the PyTorch path: the reference stacked no sequences)."""
    HV, K, V = 2, 16, 8
    h0 = make_state(B, HV, K, V)
    o, ht = fused_recurrent_kda(**make_inputs(B, T, 1, HV, K, V), initial_state=h0, output_final_state=True)
    assert o.shape == (B, T, HV, V) and torch.equal(ht, h0)


@pytest.mark.parametrize('pool', [False, True])
def test_inplace_writes_are_seen_by_autograd(path, pool):
    """The kernel writes ``out`` and the state (or the pool) in place behind autograd's back: their
    version counters must move as a PyTorch in-place op's would, so that a backward which saved
    them raises instead of silently using the new values (review: chunk_kda's dq, through an
    initial state that a later decode step updated in place, came out 80 % off without an error)."""
    B, T, H, HV, K, V = 2, 3, 1, 1, 16, 16
    x = make_inputs(B, T, H, HV, K, V)
    state = make_state(3 if pool else B, HV, K, V)
    out = torch.empty(B, T, HV, V)
    w = torch.randn(1, requires_grad=True)
    losses = {'initial_state': (w * state).sum(), 'out': (w * out).sum()}  # each saved for dw
    extra = dict(ssm_state_indices=torch.tensor([2, 0])) if pool else {}
    fused_recurrent_kda(**x, initial_state=state, inplace_final_state=True, out=out, **extra)
    for name, loss in losses.items():
        with pytest.raises(RuntimeError, match='modified by an inplace operation'):
            loss.backward()


@pytest.mark.parametrize('varlen', [False, True])
@pytest.mark.parametrize('idx_dtype', [torch.int64, torch.int32])
def test_ssm_state_indices(path, varlen, idx_dtype):
    """A pool of P = 7 slots, N = 3 sequences using slots [5, 0, 3]: those are updated, the
    others are untouched (bitwise)."""
    P, H, HV, K, V = 7, 1, 2, 20, 40
    if varlen:
        lengths = [3, 0, 1]
        x = make_inputs(1, sum(lengths), H, HV, K, V)
        extra = dict(cu_seqlens=make_cu_seqlens(lengths))
        B, T = 1, sum(lengths)
    else:
        B, T = 3, 4
        x = make_inputs(B, T, H, HV, K, V)
        extra = {}
    idx = torch.tensor([5, 0, 3], dtype=idx_dtype)
    pool = make_state(P, HV, K, V)
    pool0 = pool.clone()
    out = nan_like((B, T, HV, V))
    o, ht = fused_recurrent_kda(**x, initial_state=pool, output_final_state=True, inplace_final_state=True,
                                ssm_state_indices=idx, out=out, **extra)
    assert ht is pool, "with inplace_final_state the returned final state is the pool"
    ref_o, ref_ht = reference64(**x, initial_state=pool0[idx.long()], **extra)
    check(out, pool[idx.long()], ref_o, ref_ht, 'state pool')
    others = [s for s in range(P) if s not in idx.tolist()]
    assert torch.equal(pool[others], pool0[others]), "slots not in ssm_state_indices were modified"


def test_decode_loop_with_state_pool(path):
    """Decode steps through a state pool equal one call from the gathered initial states."""
    P, B, T, H, HV, K, V = 6, 2, 5, 1, 2, 16, 40
    x = make_inputs(B, T, H, HV, K, V)
    pool = make_state(P, HV, K, V)
    pool0 = pool.clone()
    idx = torch.tensor([4, 1])
    outs = []
    for t in range(T):
        o_t, _ = fused_recurrent_kda(**{n: v[:, t:t + 1] for n, v in x.items()}, initial_state=pool,
                                     inplace_final_state=True, ssm_state_indices=idx)
        outs.append(o_t)
    check(torch.cat(outs, 1), pool[idx], *reference64(**x, initial_state=pool0[idx]), 'pool decode')
    rest = [0, 2, 3, 5]
    assert torch.equal(pool[rest], pool0[rest]), "unused slots modified during decode"


@pytest.mark.parametrize('varlen', [False, True])
def test_out_of_range_slot(path, varlen):
    """Slot P (one past the end) is outside the pool: its sequence's outputs are NaN; slot -1 marks
    a padding row: its outputs are zero. Nothing is written anywhere for either; the valid sequence
    is computed normally."""
    P, H, HV, K, V = 5, 1, 2, 16, 40
    if varlen:
        lengths = [3, 2, 4]
        B, T = 1, sum(lengths)
        extra = dict(cu_seqlens=make_cu_seqlens(lengths))
        rows = [(slice(0, 1), slice(0, 3)), (slice(0, 1), slice(3, 5)), (slice(0, 1), slice(5, 9))]
    else:
        B, T = 3, 4
        extra = {}
        rows = [(slice(n, n + 1), slice(0, T)) for n in range(3)]
    x = make_inputs(B, T, H, HV, K, V)
    pool = make_state(P, HV, K, V)
    pool0 = pool.clone()
    idx = torch.tensor([2, P, -1])
    out = torch.zeros(B, T, HV, V)
    fused_recurrent_kda(**x, initial_state=pool, inplace_final_state=True, ssm_state_indices=idx,
                        out=out, **extra)
    assert torch.isnan(out[rows[1]]).all(), f"the sequence of slot {P} must give NaN outputs"
    assert (out[rows[2]] == 0).all(), "the padding row (slot -1) must give zero outputs"
    good = out[rows[0]]
    if varlen:
        x0 = {k_: t[:, :3] for k_, t in x.items()}
    else:
        x0 = {k_: t[:1] for k_, t in x.items()}
    ref_o, ref_ht = reference64(**x0, initial_state=pool0[2:3])
    check(good, pool[2:3], ref_o, ref_ht, 'valid slot next to bad ones')
    rest = [0, 1, 3, 4]
    assert torch.equal(pool[rest], pool0[rest]), "an out-of-range slot wrote into the pool"


def test_non_contiguous_inputs(path):
    """Views (a transpose, slices of bigger tensors) give the same answer as dense copies."""
    B, T, H, HV, K, V = 2, 6, 2, 4, 20, 40
    x = make_inputs(B, T, H, HV, K, V)
    q = x['q'].transpose(1, 2).contiguous().transpose(1, 2)                 # [B, T, H, K] view of [B, H, T, K]
    k = torch.cat([x['k'], torch.randn(B, T, H, 7)], -1)[..., :K]           # slice of a wider tensor
    v = torch.cat([torch.randn(B, T, HV, V), x['v']], 0)[B:]                # slice along batch (contiguous)
    v = torch.stack([v, v], -1)[..., 0]                                     # stride 2 in the last dim
    g = x['g'].permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)
    beta = torch.stack([x['beta'], torch.rand(B, T, HV)], -1)[..., 0]
    h0 = make_state(B, HV, V, K).transpose(-1, -2)                          # [B, HV, K, V], not contiguous
    for name, t in dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=h0).items():
        assert not t.is_contiguous(), f"test setup: {name} should be a non-contiguous view"
    o, ht = fused_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    check(o, ht, *reference64(**x, initial_state=h0.contiguous()), 'non-contiguous inputs')


def test_non_contiguous_indices_and_cu_seqlens(path):
    """ssm_state_indices and cu_seqlens given as strided views are read by value, not by memory."""
    lengths = [4, 0, 3]
    T, H, HV, K, V, P = sum(lengths), 1, 2, 16, 20, 6
    x = make_inputs(1, T, H, HV, K, V)
    # Fillers chosen so that reading the views' memory densely stays in bounds (a wrong answer,
    # not a crash): offsets 0 (empty or backwards sequences) and slot 9 (outside the pool).
    cu = torch.stack([make_cu_seqlens(lengths), torch.zeros(4, dtype=torch.int64)], -1)[:, 0]
    idx = torch.tensor([3, 9, 0, 9, 4, 9])[::2]                            # slots [3, 0, 4]
    assert not cu.is_contiguous() and not idx.is_contiguous(), "test setup: views expected"
    pool = make_state(P, HV, K, V)
    pool0 = pool.clone()
    out = nan_like((1, T, HV, V))
    o, _ = fused_recurrent_kda(**x, initial_state=pool, inplace_final_state=True,
                               ssm_state_indices=idx, cu_seqlens=cu, out=out)
    ref_o, ref_ht = reference64(**x, initial_state=pool0[[3, 0, 4]], cu_seqlens=cu.contiguous())
    check(o, pool[[3, 0, 4]], ref_o, ref_ht, 'strided indices')
    assert torch.equal(pool[[1, 2, 5]], pool0[[1, 2, 5]]), "slots outside the (strided) indices were modified"


# ------------------------------------------------------------------------------ gate activations

def softplus64(x):
    return torch.logaddexp(x, torch.zeros_like(x))          # log(1 + exp(x)), exact in float64


GATES = {
    # name: (A_log, dt_bias, lower_bound, safe_gate, beta sigmoid, allow_neg_eigval)
    'A_log_dt_bias': (True, True, None, False, True, False),
    'A_log_neg_eigval': (True, False, None, False, True, True),
    'lb-5_safe': (True, True, -5.0, True, False, False),
    'lb_no_A_log': (False, True, -1.5, False, True, True),
    'lb_only': (False, False, -0.5, False, False, False),
    'beta_sigmoid_only': (None, None, None, False, True, False),
}


@pytest.mark.parametrize('cfg', GATES.values(), ids=GATES.keys())
def test_gate_and_beta_activations(path, cfg):
    """The in-kernel gate/beta options against the reference on activations computed here in
    float64 from docs/API.md's formulas."""
    use_A, use_dt, lb, safe, beta_sig, neg = cfg
    use_gate = use_A is not None
    B, T, H, HV, K, V = 2, 6, 1, 2, 24, 40
    x = make_inputs(B, T, H, HV, K, V)
    g_raw = 2 * torch.randn(B, T, HV, K)
    beta_raw = 3 * torch.randn(B, T, HV) if beta_sig else x['beta']
    A_log = (0.5 * torch.randn(HV)) if use_A else None
    dt_bias = torch.randn(HV * K) if use_dt else None
    h0 = make_state(B, HV, K, V)

    if use_gate:
        z = to64(g_raw)
        if dt_bias is not None:
            z = z + to64(dt_bias).view(HV, K)                 # dt_bias[h * K + d]
        a = to64(A_log).exp()[:, None] if A_log is not None else 1.0
        g_exp = -a * softplus64(z) if lb is None else lb * torch.sigmoid(a * z)
        if lb is not None:
            assert (g_exp >= lb).all() and (g_exp < 0).all(), "test setup: bounded gate out of range"
    else:
        g_exp = to64(x['g'])
    b_exp = to64(beta_raw)
    if beta_sig:
        b_exp = (2 if neg else 1) * torch.sigmoid(b_exp)

    o, ht = fused_recurrent_kda(x['q'], x['k'], x['v'], g_raw if use_gate else x['g'], beta_raw,
                                A_log=A_log, dt_bias=dt_bias, initial_state=h0, output_final_state=True,
                                use_gate_in_kernel=use_gate, lower_bound=lb, safe_gate=safe,
                                use_beta_sigmoid_in_kernel=beta_sig, allow_neg_eigval=neg)
    ref_o, ref_ht = reference64(x['q'], x['k'], x['v'], g_exp, b_exp, initial_state=h0)
    check(o, ht, ref_o, ref_ht, f'gate {cfg}')


# ------------------------------------------------------------------------------------ CUDA only

def _bf16_bound_check(name, got, exact, ref32, factor=2.0, floor=1e-6):
    """The kernel's error must be within `factor` of what the PyTorch reference itself makes on the
    same low-precision inputs (computing in float32): both errors are dominated by the same
    rounding (bf16 output, float32 arithmetic), so they are of the same size; `factor` absorbs
    different summation orders / rounding ties, `floor` a few float32 ulps when both are tiny."""
    err, err_ref = rel_err(got, exact), rel_err(ref32, exact)
    assert err <= factor * err_ref + floor, \
        f"{name}: rel err {err:.3e} > {factor} x reference's own {err_ref:.3e} + {floor:g}"


@pytest.fixture
def no_tf32():
    """The float32 reference must really compute in float32 (no TF32 matmuls) for its error to be
    the yardstick of the bf16 tests."""
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = saved


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize('T', [1, 64], ids=['decode', 'prefill64'])
@pytest.mark.parametrize('B', [1, 16, 64])
def test_cuda_bf16_real_sizes(B, T, no_tf32):
    H = HV = 32
    K = V = 128
    dev = 'cuda'
    x = make_inputs(B, T, H, HV, K, V, dtype=torch.bfloat16, gate_dtype=torch.float32, device=dev)
    h0 = make_state(B, HV, K, V, device=dev)
    o, ht = fused_recurrent_kda(**x, initial_state=h0, output_final_state=True)
    torch.cuda.synchronize()
    assert o.dtype == torch.bfloat16 and torch.isfinite(o).all() and torch.isfinite(ht).all(), \
        "non-finite or wrongly typed results"
    # The exact answer for these (bf16-valued) inputs, and the reference's own float32 attempt.
    ex_o, ex_ht = reference64(**x, initial_state=h0)
    r_o, r_ht = naive_recurrent_kda(**x, initial_state=h0, output_final_state=True)
    _bf16_bound_check('output', o, ex_o, r_o)
    # The state is float32 on both sides (no bf16 rounding): allow 4 x the reference's float32
    # error plus a few float32 ulps (different reduction trees over K give different roundings).
    _bf16_bound_check('final state', ht, ex_ht, r_ht, factor=4.0, floor=1e-6)


def _kimi_decode_inputs(B, H, HV, K, V, dev):
    """Raw bf16 gate and beta logits, and the Kimi Linear gate options."""
    x = make_inputs(B, 1, H, HV, K, V, dtype=torch.bfloat16, device=dev)
    x['g'] = torch.randn(B, 1, HV, K, device=dev).to(torch.bfloat16)
    x['beta'] = (2 * torch.randn(B, 1, HV, device=dev)).to(torch.bfloat16)
    opts = dict(A_log=torch.log(1 + 15 * torch.rand(HV, device=dev)),
                dt_bias=0.1 * torch.randn(HV * K, device=dev), use_gate_in_kernel=True,
                lower_bound=-5.0, use_beta_sigmoid_in_kernel=True)
    return x, opts


def _kimi_activations(x, opts):
    """The reference's inputs for ``_kimi_decode_inputs``: activated gate and beta (float32)."""
    HV, K = x['g'].shape[-2:]
    z = opts['A_log'].exp()[:, None] * (x['g'].float() + opts['dt_bias'].view(HV, K))
    return dict(x, g=opts['lower_bound'] * torch.sigmoid(z), beta=torch.sigmoid(x['beta'].float()))


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize('gate', [False, True], ids=['plain', 'kimi_gate'])
def test_cuda_graph_decode_step(no_tf32, gate):
    """A decode step with a state pool, out= and in-place states, captured in a CUDA graph and
    replayed after changing the inputs in place, equals the eager computation. 'kimi_gate': raw
    gate and beta logits activated inside the kernel (one launch, nothing allocated)."""
    B, H, HV, K, V, P = 4, 4, 8, 128, 128, 10
    dev = 'cuda'

    def inputs():
        if gate:
            return _kimi_decode_inputs(B, H, HV, K, V, dev)
        return make_inputs(B, 1, H, HV, K, V, dtype=torch.bfloat16, gate_dtype=torch.float32, device=dev), {}

    x, opts = inputs()
    pool = make_state(P, HV, K, V, device=dev)
    idx = torch.tensor([7, 2, 9, 0], device=dev)
    out = torch.empty(B, 1, HV, V, dtype=torch.bfloat16, device=dev)

    def step():
        fused_recurrent_kda(**x, **opts, initial_state=pool, inplace_final_state=True,
                            ssm_state_indices=idx, out=out)

    side = torch.cuda.Stream()                       # warm up (compile) outside the capture
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    for trial in range(3):
        new, _ = inputs()
        for name in x:
            x[name].copy_(new[name])
        pool.copy_(make_state(P, HV, K, V, device=dev))
        idx.copy_(torch.randperm(P, device=dev)[:B])
        pool_before = pool.clone()
        out.fill_(float('nan'))
        graph.replay()
        torch.cuda.synchronize()

        eager_pool = pool_before.clone()
        o_e, _ = fused_recurrent_kda(**{n: t.clone() for n, t in x.items()}, **opts,
                                     initial_state=eager_pool, inplace_final_state=True,
                                     ssm_state_indices=idx.clone())
        torch.cuda.synchronize()
        assert not torch.isnan(out).any(), f"trial {trial}: replay left NaN in out"
        assert torch.equal(out, o_e), f"trial {trial}: replayed output differs from eager ({rel_err(out, o_e):.3e})"
        assert torch.equal(pool, eager_pool), f"trial {trial}: replayed state pool differs from eager"
        # and the eager step is right
        xr = _kimi_activations(x, opts) if gate else x
        ex_o, _ = reference64(**xr, initial_state=pool_before[idx])
        r_o, _ = naive_recurrent_kda(**xr, initial_state=pool_before[idx])
        _bf16_bound_check(f'trial {trial} output', o_e, ex_o, r_o)
        unused = [s for s in range(P) if s not in idx.tolist()]
        assert torch.equal(pool[unused], pool_before[unused]), f"trial {trial}: unused slots modified"


@pytest.mark.skipif(not (INTERPRET or torch.cuda.is_available()), reason='kernel path only')
def test_backward_raises_instead_of_dropping_gradients():
    """The decode kernel has no backward: a loss through its output must raise, not leave the
    inputs' gradients silently without this layer's part."""
    dev = 'cuda' if torch.cuda.is_available() and not INTERPRET else 'cpu'
    x = {n: t.to(dev).requires_grad_() for n, t in make_inputs(1, 3, 1, 1, 16, 16).items()}
    o, _ = fused_recurrent_kda(**x)
    assert o.requires_grad, "the output must stay in the autograd graph"
    with pytest.raises(RuntimeError, match='no backward'):
        o.sum().backward()
    with torch.no_grad():
        o2, _ = fused_recurrent_kda(**x)
    assert torch.equal(o.detach(), o2), "the forward must not change under autograd"
    # The gate is activated inside the kernel: a gradient wanted for A_log or dt_bias alone must
    # raise as well.
    x = {n: t.detach() for n, t in x.items()}
    for name in ('A_log', 'dt_bias'):
        params = dict(A_log=torch.zeros(1, device=dev), dt_bias=torch.zeros(16, device=dev))
        params[name].requires_grad_()
        o, _ = fused_recurrent_kda(**x, **params, use_gate_in_kernel=True)
        with pytest.raises(RuntimeError, match='no backward'):
            o.sum().backward()
    # ... and one wanted for the initial state alone (review: it was silently missing).
    h0 = torch.zeros(1, 1, 16, 16, device=dev, requires_grad=True)
    o, _ = fused_recurrent_kda(**x, initial_state=h0)
    with pytest.raises(RuntimeError, match='no backward'):
        o.sum().backward()

