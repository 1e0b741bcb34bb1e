"""``chunk_kda`` against the float64 oracle on the float32 matrix (outputs, final state and every
gradient), and the forward's own stages checked one by one: the in-chunk cumulative decay and
the decayed keys and queries, the solve, the diagonal blocks' factors, the inference builds
(l2norm in the pair products, beta formed on the side stream, the ``ALL_NEAR`` build)."""
from __future__ import annotations

import math

import pytest
import torch

import kda.ops.chunk.backward as chunk_bwd
import kda.ops.chunk.intra as chunk_intra
import kda.ops.chunk.layout as chunk_map
from kda import chunk_kda, fused_recurrent_kda
from conftest import make_cu_seqlens, make_inputs, make_state, reference64, rel_err
from chunk_helpers import (KDEV, MATRIX, TOL, assert_errs, check_case, check_lowp, check_matrix_case, chunk_name,
                           lengths_to_cu, on_device, patch_chunk, requires_bf16_kernels, requires_kernels, run_chunk)

# Every kernel load and store of these tests is bounds-checked in the interpreter.
pytestmark = pytest.mark.usefixtures('bounds_checked_memory')


# The matrix cases of over ~3 s in the interpreter: the fast tier keeps one of each kind
# (fixed length, partial chunks, single token, K != V, varlen with empty and one-token sequences).
SLOW_MATRIX = {'T70-BT64-gva12', 'T37-BT32-gva24-noh0-nofinal', 'T45-BT32-K60-V48-vfirst', 'T40-BT32-l2norm-scale',
               'T40-BT32-B2-gva12-V72', 'varlen-BT64-vfirst-l2', 'varlen-BT32-gva-noh0', 'varlen-BT32-V72'}


@requires_kernels
@pytest.mark.parametrize('shape,opts', [pytest.param(s, o, id=i, marks=[pytest.mark.slow] if i in SLOW_MATRIX else [])
                                        for i, s, o in MATRIX])
def test_matches_reference(shape, opts):
    check_matrix_case(shape, opts)


@requires_kernels
def test_forward_K32_V100():
    """K != V with V > 64 (several V blocks in every stage) and T not a multiple of the chunk."""
    check_case(1, 50, 1, 1, 32, 100, chunk_size=64, grads=False)


@requires_kernels
@pytest.mark.parametrize('varlen', [False, True])
def test_agrees_with_fused_recurrent(varlen):
    HV, K, V = 2, 32, 32
    if varlen:
        lengths = [0, 30, 1, 39]
        cu = lengths_to_cu(lengths).to(KDEV)
        B, T, N = 1, sum(lengths), len(lengths)
    else:
        cu, B, T, N = None, 2, 45, 2
    x = on_device(make_inputs(B, T, 1, HV, K, V), KDEV)
    s0 = make_state(N, HV, V, K, state_v_first=True).to(KDEV)
    opts = dict(initial_state=s0, output_final_state=True, cu_seqlens=cu, state_v_first=True)
    with torch.no_grad():
        o_c, ht_c = chunk_kda(**x, chunk_size=32, **opts)
        o_r, ht_r = fused_recurrent_kda(**x, **opts)
    ro, rht = reference64(**on_device(x, 'cpu'), initial_state=s0.cpu(), cu_seqlens=None if cu is None else cu.cpu(),
                          state_v_first=True)
    errs = {'o chunk-vs-recurrent': rel_err(o_c, o_r.cpu()), 'ht chunk-vs-recurrent': rel_err(ht_c, ht_r.cpu()),
            'o chunk': rel_err(o_c, ro), 'o recurrent': rel_err(o_r, ro),
            'ht chunk': rel_err(ht_c, rht), 'ht recurrent': rel_err(ht_r, rht)}
    assert_errs(errs, TOL, f"chunk vs fused_recurrent varlen={varlen}")


@pytest.mark.slow
@requires_kernels
@pytest.mark.parametrize('chunk_size,lengths,H,HV,K,dtype', [
    (32, [0, 1, 19, 45, 0, 33], 2, 4, 60, torch.float32), (64, [70], 1, 3, 48, torch.float16)])
def test_forward_decayed_keys_and_queries(chunk_size, lengths, H, HV, K, dtype):
    """The forward's decayed queries and keys ``qt = scale q exp(c)``, ``kg = k exp(c)``,
    ``kbar = k exp(c_last - c)`` (the pair products form them, row block by row block; the
    backward's recompute, in the cumsum kernel): into NaN-filled buffers, every entry written,
    against float64 from the forward's own c, and against the recompute's (within rounding: the
    two cumsum builds may round c differently on a GPU). Empty and one-token sequences, partial
    chunks, masked key columns (K = 60), GVA (HV = 2H, 3H)."""
    cu = lengths_to_cu(lengths)
    bounds = cu.tolist()
    T = sum(lengths)
    gen = torch.Generator().manual_seed(5)
    q, k = (torch.randn(1, T, H, K, generator=gen).to(dtype).to(KDEV) for _ in range(2))
    g = (-0.02 - torch.rand(1, T, HV, K, generator=gen)).to(KDEV)
    beta = torch.rand(1, T, HV, generator=gen).to(dtype).to(KDEV)
    layout = chunk_map.chunk_layout(1, T, chunk_size, bounds, cu.to(KDEV))

    def in_chunk(matrices):
        out = chunk_intra.in_chunk_buffers(1, T, HV, K, chunk_size, KDEV, dtype, matrices is None)
        for t in (out.gc, out.qt, out.kbar, out.kg):
            t.fill_(float('nan'))
        return chunk_intra.in_chunk_tensors(q, k, g, beta, 0.3, layout, None, HV, matrices, out=out)

    fwd = in_chunk(None)
    rec = in_chunk(fwd.matrices)
    c = fwd.gc.double().cpu()
    assert torch.isfinite(c).all(), "c not written everywhere"
    last = torch.empty_like(c)
    for s, e in zip(bounds, bounds[1:]):
        for c0 in range(s, e, chunk_size):
            c1 = min(c0 + chunk_size, e)
            last[:, c0:c1] = c[:, c1 - 1:c1]
    rep = HV // H
    qd, kd = (t.double().cpu().repeat_interleave(rep, dim=2) for t in (q, k))
    expected = dict(qt=0.3 * qd * c.exp(), kg=kd * c.exp(), kbar=kd * (last - c).exp())
    # float16 outputs round to 2^-11 relative; float32 ones to 2^-24, and exp's own error.
    tol = 1e-3 if dtype == torch.float16 else 2e-6
    for name, want in expected.items():
        got, again = getattr(fwd, name).double().cpu(), getattr(rec, name).double().cpu()
        assert torch.isfinite(got).all(), f"{name}: entries not written by the forward"
        assert rel_err(got, want) < tol, f"{name}: {rel_err(got, want):.2e} against float64"
        assert rel_err(got, again) < tol, f"{name}: {rel_err(got, again):.2e} against the recompute"


@pytest.mark.slow
@requires_kernels
@pytest.mark.parametrize('chunk_size,lengths,H,HV', [
    (64, [70], 1, 1), (32, [70], 1, 2), (64, [1, 65, 49, 2], 1, 2), (32, [1, 33, 17, 64], 2, 2)])
def test_solve_against_inverse(chunk_size, lengths, H, HV, monkeypatch):
    """The solve's M = (I + diag(beta) A')^-1 and the state carry's corrections
    dV = M diag(beta) (v - k exp(c) S) (S: the state the carry stores for the chunk, checked
    against the oracle only through the gradient tests), entry by entry against float64
    (torch.linalg.inv). Mild decay (steps in [-0.02, 0]), correlated keys
    and beta up to 2 (allow_neg_eigval's range) keep every block of M large, so a wrong term in
    a block far from the diagonal shows (with the default inputs, where steps reach -1, blocks
    48 rows from the diagonal are ~1e-16 of the rest and the end-to-end tests hardly see them:
    dropping one product from M's corner block failed a single test). Every allocation of the
    forward starts as NaN, so an entry the kernels should have written and did not shows too."""
    empty = torch.empty

    def nan_empty(*size, **kw):
        t = empty(*size, **kw)
        return t.fill_(float('nan')) if t.is_floating_point() else t
    monkeypatch.setattr(torch, 'empty', nan_empty)
    K = V = 16
    T = sum(lengths)
    x = make_inputs(1, T, H, HV, K, V)
    k = x['k'] + 1.5 * x['k'][:, :1]
    k = k / k.norm(dim=-1, keepdim=True)
    beta = 2 * torch.rand(1, T, HV)
    g = -0.02 * torch.rand(1, T, HV, K)
    offsets = [0] + torch.tensor(lengths).cumsum(0).tolist()
    varlen = len(lengths) > 1
    cu = lengths_to_cu(lengths).to(KDEV) if varlen else None
    layout = chunk_map.chunk_layout(1, T, chunk_size, offsets if varlen else None, cu)
    q, kd, vd, gd, betad = (t.to(KDEV) for t in (x['q'], k, x['v'], g, beta))
    intra = chunk_intra.in_chunk_tensors(q, kd, gd, betad, 0.25, layout, None, HV)
    saved = chunk_bwd.chunk_kda_recompute(q, kd, vd, betad, None, False, cu, layout, intra)
    gc, Akk, Minv, kg, h, v_new = (t.double().cpu() for t in (intra.gc, intra.Akk, intra.Minv, intra.kg,
                                                              saved.h, saved.v_new))
    worst = far = 0.
    chunk = 0                               # global chunk index (h's first axis)
    for s, e in zip(offsets, offsets[1:]):
        for c0 in range(s, e, chunk_size):
            L = min(chunk_size, e - c0)
            rows = slice(c0, c0 + L)
            for hv in range(HV):
                b = beta[0, rows, hv, None].double()
                M = torch.linalg.inv(torch.eye(L, dtype=torch.float64) + b * Akk[0, rows, hv, :L].tril(-1))
                Kg = k[0, rows, hv // (HV // H)].double() * gc[0, rows, hv].exp()
                dV = M @ (b * (x['v'][0, rows, hv].double() - Kg @ h[chunk, hv]))
                scale = M.abs().max()
                for got, ref in ((Minv[0, rows, hv, :L].tril(), M), (kg[0, rows, hv], Kg),
                                 (v_new[0, rows, hv], dV)):
                    err = ((got - ref).abs().max() / ref.abs().max()).item()
                    worst = max(worst, err if math.isfinite(err) else math.inf)   # NaN: unwritten
                if L > chunk_size - 16:        # M's corner block, farthest from the diagonal
                    far = max(far, (M[chunk_size - 16:, :16].abs().max() / scale).item())
            chunk += 1
    assert chunk == h.shape[0]
    assert far > 0.05, f"the inputs no longer exercise M's far blocks (largest {far:.1e} of max |M|)"
    assert worst < 2e-5, f"solve / corrections: max relative error {worst:.2e}"


@requires_kernels
def test_forward_diagonal_row_factor_below_normal():
    """The forward's diagonal block factors through its first row r: ``exp(c_i - r)`` times a key
    factor up to exp(76). After a drop of -75.9 (row 1) and -11.5 (row 2), row 2's factor is
    exp(-87.4), under float32's smallest normal, while A'[2, 1] = exp(-11.5) |k_1|^2 = 1.0e-5.
    A flushing exponential (ex2.approx.ftz) gave 0 there on the H200; float32 inputs keep the
    subnormal factor. The interpreter (NumPy) never flushes, so only a GPU run
    can fail this test."""
    K, T = 16, 16
    g = torch.full((1, T, 1, K), -0.01, dtype=torch.float64)
    g[:, 1], g[:, 2] = -75.9, -11.5
    k = torch.randn(1, T, 1, K, dtype=torch.float64)
    k[:, 2] = k[:, 1]
    k = k / k.norm(dim=-1, keepdim=True)
    q = torch.randn(1, T, 1, K, dtype=torch.float64)
    beta = torch.rand(1, T, 1, dtype=torch.float64)
    layout = chunk_map.chunk_layout(1, T, 32, None, None)
    intra = chunk_intra.in_chunk_tensors(*(t.float().to(KDEV) for t in (q, k, g, beta)), 1.0, layout,
                                         None, 1)
    c = g[0, :, 0].cumsum(0)
    want = (k[0, 2, 0] * k[0, 1, 0] * (c[2] - c[1]).exp()).sum().item()
    got = intra.Akk[0, 2, 0, 1].item()
    assert abs(got - want) <= 1e-5 * abs(want), f"A'[2, 1]: {got:.4e}, want {want:.4e}"


@pytest.mark.slow
@requires_kernels
@pytest.mark.parametrize('dtype', [torch.float32, torch.float16,
                                   pytest.param(torch.bfloat16, marks=requires_bf16_kernels)])
@pytest.mark.parametrize('layout', ['varlen', 'B2-BT32'])
def test_inference_l2norm_in_pair_products(dtype, layout):
    """Inference with ``use_qk_l2norm_in_kernel``: the pair products normalize the raw rows they
    read, in float32 (block I's rows as they load, the key columns of blocks J < I at the end);
    the training forward normalizes q and k in a pass of its own that stores them in the input
    dtype (and which the other tests check against float64). No larger an error against float64
    than the training forward's on the same inputs: 16-bit inputs have one rounding of q and k
    fewer (measured in the interpreter, float16, three seeds, with the norms then formed by a
    pass of their own: o 0.79-0.84x of it, the final state 0.92-0.97x), float32 the rows' sums
    of squares in another order (0.94-1.01x, both layouts, strong decay or not); bound 1.25x.
    Strong decay (the far keys' 4-row scheme loads key rows of its own, scaled by norms gathered
    from the block's; float16 takes it for every entry), GVA, K = 60 (masked key columns in the
    sums), all-zero q and k rows (the epsilon keeps them zero, not NaN);
    varlen with partial chunks, or two sequences of fixed length with 32-token chunks (two
    sub-blocks)."""
    if layout == 'varlen':
        B, T, N, cu, chunk = 1, 191, 3, make_cu_seqlens([37, 64, 90], device=KDEV), 64
    else:
        B, T, N, cu, chunk = 2, 75, 2, None, 32
    x = make_inputs(B, T, 2, 4, 60, 40, dtype=dtype, device=KDEV, strong_decay=True, normalize_k=False)
    # All-zero rows normalize to zero (the epsilon): q alone, k alone and both, in blocks that
    # later blocks of their chunk read as J < I, and in the block of the rows they scale.
    for t, names in ((3, 'q'), (17, 'k'), (36, 'qk'), (42, 'k'), (66, 'qk')):
        for n in names:
            x[n][:, t] = 0
    opts = dict(initial_state=make_state(N, 4, 60, 40, device=KDEV), output_final_state=True,
                cu_seqlens=cu, use_qk_l2norm_in_kernel=True, scale=0.7, chunk_size=chunk)
    with torch.no_grad():
        o, ht = chunk_kda(**x, **opts)
    o_train, ht_train = chunk_kda(**{n: t.clone().requires_grad_() for n, t in x.items()}, **opts)
    assert o.isfinite().all() and ht.isfinite().all()
    ro, rht = reference64(**{n: t.cpu() for n, t in x.items()},
                          **{n: t.cpu() if torch.is_tensor(t) else t for n, t in opts.items()
                             if n != 'chunk_size'})
    for name, got, train, ref in (('o', o, o_train, ro), ('ht', ht, ht_train, rht)):
        e, e_train = rel_err(got, ref), rel_err(train, ref)
        assert e <= 1.25 * e_train, f"{name}: {e:.3e} against float64, the training forward {e_train:.3e}"


@pytest.mark.slow
@requires_kernels
@pytest.mark.parametrize('inference', [True, False])
def test_all_near_pair_products(monkeypatch, inference):
    """The pair products' build without the far-entry fallback (``ALL_NEAR``) runs exactly where
    no entry can be far, the lower-bound gate with l2norm (in the kernel or by the pass), never
    in float16, never for the softplus gate, a given g or raw keys; and gives the same bits as
    the general build where both may run: the gate saturated at -5 a step over whole chunks
    (span 75 in a 16-row block, FAR_SPAN 76), fresh raw gates elsewhere. Outputs, the final state
    and (training) every gradient compared with the fallback forced back in."""
    real = chunk_intra.chunk_pair_fwd_kernel
    seen, force = [], {}

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                seen.append(kw['ALL_NEAR'])
                return real[grid](*args, **{**kw, **force})
            return launch

    patch_chunk(monkeypatch, 'chunk_pair_fwd_kernel', Spy())
    B, T, H, HV, K, V = 1, 80, 1, 2, 32, 48
    x = make_inputs(B, T, H, HV, K, V, normalize_k=False)
    x['g'] = torch.randn(B, T, HV, K)
    x['g'][:, 16:64] = 40.                                  # sigmoid -> 1: steps of -5
    s0 = make_state(B, HV, K, V)
    gate = dict(use_gate_in_kernel=True, A_log=torch.zeros(HV), lower_bound=-5.0, safe_gate=True)

    def run(dtype=torch.float32, **opts):
        # Fresh leaves a run: float32 CPU tensors would come back from .to as themselves, and
        # their .grad would add up across runs and be shared by the runs compared.
        xs = {n: t.to(dtype).to(KDEV).clone().requires_grad_(not inference) for n, t in x.items()}
        opts = {**opts, 'initial_state': s0.to(KDEV).clone().requires_grad_(not inference)}
        opts = {n: t.to(KDEV) if isinstance(t, torch.Tensor) else t for n, t in opts.items()}
        with torch.set_grad_enabled(not inference):
            o, ht = chunk_kda(**xs, output_final_state=True, **opts)
            if inference:
                return [o, ht]
            (o.float().pow(2).sum() + ht.pow(2).sum()).backward()
        return [o, ht] + [t.grad for t in (*xs.values(), opts['initial_state'])]

    expect = {'l2norm': True, 'raw keys': False, 'softplus': False, 'g given': False}
    cases = {'l2norm': dict(gate, use_qk_l2norm_in_kernel=True),
             'raw keys': gate,
             'softplus': dict(gate, lower_bound=None, safe_gate=False, use_qk_l2norm_in_kernel=True),
             'g given': dict(use_qk_l2norm_in_kernel=True)}
    for name, opts in cases.items():
        seen.clear()
        if name == 'g given':
            x_g, x['g'] = x['g'], -torch.rand_like(x['g'])
        run(**opts)
        if name == 'g given':
            x['g'] = x_g
        assert seen == [expect[name]], (name, seen)
    seen.clear()
    run(torch.float16, **cases['l2norm'])
    assert seen == [False], seen
    near = run(**cases['l2norm'])
    force['ALL_NEAR'] = False
    general = run(**cases['l2norm'])
    assert all(torch.isfinite(t).all() for t in near)
    assert all(torch.equal(a, b) for a, b in zip(near, general)), \
        [float((a - b).abs().max()) for a, b in zip(near, general)]


@pytest.mark.slow
@requires_kernels
@pytest.mark.parametrize('beta_case', ['logits', 'logits-neg-eigval', 'logits-fp16', 'logits-permuted',
                                       'given', 'given-fp16', 'given-strided'])
def test_inference_beta_as_training(beta_case):
    """Inference forms the kernels' float32 beta inside the forward, on the side stream
    (``prepare_beta``): from the caller's logits (``use_beta_sigmoid_in_kernel``, with
    ``allow_neg_eigval`` 2 sigmoid) or from a given beta (a float32 contiguous one as it is). The
    outputs and final state equal the training forward's bit for bit, which activates beta
    through autograd first and is checked against float64 elsewhere (no l2norm in the kernel:
    with it, inference normalizes q and k in other kernels). 'fp16': every input in float16
    (the sigmoid then reads 16-bit logits); 'permuted': a dense beta in [B, HV, T] order, whose
    sigmoid the CPU rounds otherwise than a contiguous one's; 'strided': every other entry of a
    [B, T, 2 HV] tensor."""
    B, T, H, HV, K, V = 1, 45, 1, 2, 16, 24
    x = make_inputs(B, T, H, HV, K, V, dtype=torch.float16 if beta_case.endswith('fp16') else torch.float32)
    opts = dict(chunk_size=32)
    if beta_case.startswith('logits'):
        x['beta'] = (2 * torch.randn(B, T, HV)).to(x['q'].dtype)
        if beta_case.endswith('permuted'):
            x['beta'] = x['beta'].transpose(1, 2).contiguous().transpose(1, 2)
        opts.update(use_beta_sigmoid_in_kernel=True, allow_neg_eigval=beta_case.endswith('neg-eigval'))
    elif beta_case.endswith('strided'):
        x['beta'] = torch.stack([x['beta'], torch.rand(B, T, HV)], -1).flatten(-2)[..., ::2]
    assert x['beta'].is_contiguous() == (beta_case.split('-')[-1] not in ('permuted', 'strided'))
    s0 = make_state(B, HV, K, V)
    o_train, ht_train, _, _, _ = run_chunk(x, s0, grads=True, **opts)
    with torch.no_grad():
        o, ht = chunk_kda(**{n: t.to(KDEV) for n, t in x.items()}, initial_state=s0.to(KDEV),
                          output_final_state=True, **opts)
    assert torch.equal(o.cpu(), o_train) and torch.equal(ht.cpu(), ht_train)


@pytest.mark.slow
@requires_kernels
def test_kernels_read_float32_beta(monkeypatch):
    """A 16-bit beta reaches the forward's kernels (``pair_products_and_solve``: the solve, and the sweep
    that reads the same tensor) and the backward's launcher (``chunk_kda_bwd``) as a float32
    copy, in training and in inference, strided or not (the state sweeps prefetch a per-row load
    only from 4 bytes a thread, ``chunk_kda``); its gradient keeps beta's dtype (``run_chunk``),
    and the results stay within the float64 bound of the low-precision tests."""
    seen = []
    # (q, k, beta, ...) and (q, k, v, g, beta, ...)
    for name, i in (('pair_products_and_solve', 2), ('chunk_kda_bwd', 4)):
        def spy(*args, _f=chunk_name(name), _n=name, _i=i, **kwargs):
            seen.append((_n, args[_i].dtype, args[_i].is_contiguous()))
            return _f(*args, **kwargs)
        patch_chunk(monkeypatch, name, spy)
    check_lowp(torch.float16, None, 2, 70, 1, 2, 32, 32, chunk_size=64, grads=True)
    x = {n: t.to(KDEV) for n, t in make_inputs(2, 70, 1, 2, 32, 32, dtype=torch.float16).items()}
    with torch.no_grad():
        o = chunk_kda(**x)[0]
        x['beta'] = x['beta'].transpose(0, 1).contiguous().transpose(0, 1)  # the same values, strided
        o_strided = chunk_kda(**x)[0]
    assert not x['beta'].is_contiguous()
    assert torch.equal(o, o_strided)
    assert seen == [('pair_products_and_solve', torch.float32, True), ('chunk_kda_bwd', torch.float32, True)] + \
        [('pair_products_and_solve', torch.float32, True)] * 2, seen
