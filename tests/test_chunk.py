"""``chunk_kda`` (the chunkwise WY/UT kernels) against the float64 oracle.

Small-shape tests run the real Triton kernels: on CPU tensors through the interpreter
(``TRITON_INTERPRET=1``), or on CUDA tensors when a GPU is present (``KDEV`` below); they are
skipped when neither is available. The reference is always ``naive_recurrent_kda`` in float64 on
the CPU, and results are compared by the relative error norm ``||x - ref|| / ||ref||``.

* float32 forward outputs, final states and every gradient (q, k, v, g, beta, initial_state; the
  loss takes random upstream gradients for ``o`` AND for the final state) must agree to ``TOL``
  (2e-5; observed ~1e-7 .. 1e-6).
* Strong decay (steps of -20 over stretches, single steps of -1e3 / -1e4): the kernels hold each
  chunk's cumulative log-decay in float32, so a big drop followed by mild decay inside one chunk
  loses absolute precision in the exponent (~ulp of the cumulative sum, e.g. 2.4e-4 at -3300).
  That floor is measured (float64 chunk algebra fed the float32-rounded cumulative sums) and the
  bound is ``TOL + 2 * floor`` (see ``test_strong_decay``).
* Low precision: bounds derived from the reference's own error in that dtype (``lowp_bound``).
  bf16 cannot run in the interpreter: it multiplies bf16 ``tl.dot`` operands as raw uint16 bit
  patterns (triton-lang/triton#11584, "not supported yet"), so bf16 runs on CUDA only; fp16 runs
  in both.

In the interpreter every kernel load and store is bounds-checked against the launch's tensors
(``bounds_checked_memory``, autouse), and ``test_every_element_written`` poisons every allocation
with NaN plus a NaN guard region after it.

CUDA-only tests at real sizes (bf16, B=8, T=4096, H=16, K=V=128; varlen 8192 tokens; gradients
against float64 at T=512) are at the end.
"""
from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.nn.functional as F

import kda.ops.chunk.api as chunk_api
import kda.ops.chunk.backward as chunk_bwd
import kda.ops.chunk.forward as chunk_fwd
import kda.ops.chunk.function as chunk_function
import kda.ops.chunk.intra as chunk_intra
import kda.ops.chunk.launch as chunk_launch
import kda.ops.chunk.layout as chunk_map
import kda.ops.chunk.schedule as chunk_schedule
from kda import chunk_kda, fused_recurrent_kda, naive_recurrent_kda
from kda.ops.offline import H200_SHARED_MEMORY
from kda.ops.utils import INTERPRET
from kda.reference import chunk_kda_reference
from conftest import (HAS_CUDA, make_cu_seqlens, make_inputs, make_state, reference64, rel_err,
                      requires_cuda, to64)

TOL = 2e-5

# Where the small-shape kernel tests run: CUDA when present, else CPU through the interpreter.
KDEV = 'cuda' if HAS_CUDA else 'cpu'
requires_kernels = pytest.mark.skipif(
    not (HAS_CUDA or INTERPRET), reason="needs TRITON_INTERPRET=1 (CPU) or a CUDA GPU to run the kernels")
requires_bf16_kernels = pytest.mark.skipif(
    not HAS_CUDA, reason="the Triton interpreter computes bf16 tl.dot on raw bit patterns "
                         "(triton-lang/triton#11584); bf16 kernels are tested on CUDA only")

# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------

CHUNK_MODULES = (chunk_api, chunk_bwd, chunk_fwd, chunk_function, chunk_intra, chunk_launch, chunk_map,
                 chunk_schedule)


def chunk_name(name: str):
    """What ``name`` is bound to in the modules of ``kda.ops.chunk`` (the same object in each)."""
    bound = {id(vars(m)[name]): vars(m)[name] for m in CHUNK_MODULES if name in vars(m)}
    assert len(bound) == 1, f"{name}: bound to {len(bound)} objects in kda.ops.chunk"
    return next(iter(bound.values()))


def patch_chunk(monkeypatch, name: str, value):
    """Sets ``name`` in every module of ``kda.ops.chunk`` that binds it: each module looks its
    names up in its own namespace, so a function defined in one and imported by another is
    replaced in both."""
    chunk_name(name)
    for m in CHUNK_MODULES:
        if name in vars(m):
            monkeypatch.setattr(m, name, value)


def _dev(d: dict, device) -> dict:
    return {n: (None if x is None else x.to(device)) for n, x in d.items()}


def forbid_chunk_kernels(monkeypatch, disable=True):
    """Makes chunk_kda's kernel launchers raise, so that only the PyTorch path can serve a call;
    with ``disable`` also turns the kernels off (``use_kernels`` False: CPU without the
    interpreter)."""
    def no_kernel(*a, **kw):
        raise AssertionError("a kernel path ran where the PyTorch path must serve the call")

    if disable:
        patch_chunk(monkeypatch, 'use_kernels', lambda x: False)
    patch_chunk(monkeypatch, 'chunk_kda_fwd', no_kernel)
    patch_chunk(monkeypatch, 'chunk_kda_bwd', no_kernel)


def run_chunk(inputs: dict, h0, *, output_final_state=True, cu_seqlens=None, grads=True,
              do=None, dht=None, use_o=True, device=KDEV, **opts):
    """chunk_kda on ``device`` (fresh leaves), then autograd with upstream gradients ``do`` for o
    and ``dht`` for the final state (random when None; ``use_o=False`` drops o from the loss).
    Returns ``(o, ht, grads_by_name, do, dht)``, everything on the CPU."""
    # No clone: a strided view stays a strided view (clone would densify a sliced tensor).
    leaves = {n: x.detach().to(device).requires_grad_(grads) for n, x in inputs.items()}
    if h0 is not None:
        leaves['initial_state'] = h0.detach().to(device).requires_grad_(grads)
    cu = None if cu_seqlens is None else cu_seqlens.to(device)
    o, ht = chunk_kda(**leaves, output_final_state=output_final_state, cu_seqlens=cu, **opts)
    assert o.dtype == inputs['q'].dtype and o.shape == inputs['v'].shape
    assert (ht is None) == (not output_final_state)
    if ht is not None:
        assert ht.dtype == torch.float32
    gd = {}
    if grads:
        do = torch.randn(o.shape, dtype=torch.float64).to(o.dtype) if do is None else do
        loss = (o.float() * do.to(device).float()).sum() if use_o else 0.
        if ht is not None:
            dht = torch.randn(ht.shape, dtype=torch.float64).float() if dht is None else dht
            loss = loss + (ht * dht.to(device)).sum()
        names = list(leaves)
        gs = torch.autograd.grad(loss, [leaves[n] for n in names])
        gd = {n: gr.detach().cpu() for n, gr in zip(names, gs)}
        for n in names:
            assert gd[n].dtype == leaves[n].dtype, f"d{n} dtype {gd[n].dtype} != {leaves[n].dtype}"
    return (o.detach().cpu(), None if ht is None else ht.detach().cpu(), gd,
            do if use_o else None, dht if ht is not None else None)


def run_ref(inputs: dict, h0, do, dht, *, fn=naive_recurrent_kda, cast=to64, cu_seqlens=None, **opts):
    """``fn`` (default: the naive recurrence) on ``cast`` copies (default float64) of the inputs on
    the CPU, with autograd for the same upstream gradients. Returns ``(o, ht, grads_by_name)``."""
    leaves = {n: cast(x.cpu()).requires_grad_(do is not None or dht is not None) for n, x in inputs.items()}
    if h0 is not None:
        leaves['initial_state'] = cast(h0.cpu()).requires_grad_(leaves['q'].requires_grad)
    o, ht = fn(**leaves, output_final_state=True, cu_seqlens=cu_seqlens, **opts)
    gd = {}
    if do is not None or dht is not None:
        loss = 0.
        if do is not None:
            loss = (o.to(ht.dtype) * cast(do)).sum()
        if dht is not None:
            loss = loss + (ht * cast(dht)).sum()
        names = list(leaves)
        gs = torch.autograd.grad(loss, [leaves[n] for n in names], allow_unused=True)
        gd = {n: (torch.zeros_like(leaves[n]) if gr is None else gr.detach()) for n, gr in zip(names, gs)}
    return o.detach(), ht.detach(), gd


def errors(o, ht, gd, ro, rht, rgd) -> dict:
    """Relative errors of everything present; asserts everything is finite."""
    out = {'o': (o, ro)}
    if ht is not None:
        out['ht'] = (ht, rht)
    for n, gr in gd.items():
        out['d' + n] = (gr, rgd[n])
    errs = {}
    for name, (x, ref) in out.items():
        bad = (~torch.isfinite(x)).sum().item()
        assert bad == 0, f"{name}: {bad} non-finite entries"
        errs[name] = rel_err(x, ref)
    return errs


def assert_errs(errs: dict, bound, what=''):
    """``bound``: a number, or a dict name -> number."""
    print(f"\n{what}: " + ' '.join(f"{n}={e:.1e}" for n, e in errs.items()))
    for n, e in errs.items():
        b = bound[n] if isinstance(bound, dict) else bound
        assert e < b, f"{what}: {n} rel err {e:.3e} >= {b:.3e} (all: {errs})"


def lengths_to_cu(lengths):
    return make_cu_seqlens(lengths)


def check_case(B, T, H, HV, K, V, *, chunk_size, h0=True, final=True, lengths=None,
               state_v_first=False, l2=False, scale=None, grads=True, inputs=None, tol=TOL):
    """One float32 case against the float64 oracle: forward, final state and all gradients."""
    cu = None
    if lengths is not None:
        cu = lengths_to_cu(lengths)
        B, T = 1, sum(lengths)
    N = B if cu is None else len(lengths)
    x = make_inputs(B, T, H, HV, K, V, normalize_k=not l2) if inputs is None else inputs
    s0 = make_state(N, HV, K, V, state_v_first=state_v_first) if h0 else None
    opts = dict(state_v_first=state_v_first, use_qk_l2norm_in_kernel=l2, scale=scale)
    o, ht, gd, do, dht = run_chunk(x, s0, output_final_state=final, cu_seqlens=cu, grads=grads,
                                   chunk_size=chunk_size, **opts)
    ro, rht, rgd = run_ref(x, s0, do, dht, cu_seqlens=cu, **opts)
    errs = errors(o, ht, gd, ro, rht, rgd)
    if grads:
        expected = set(x) | ({'initial_state'} if h0 else set())
        assert {n[1:] for n in errs if n.startswith('d')} == expected
    assert_errs(errs, tol, f"B={B} T={T} H={H} HV={HV} K={K} V={V} BT={chunk_size} lengths={lengths}")
    return errs


@pytest.fixture(autouse=True)
def bounds_checked_memory(monkeypatch):
    """Autouse, interpreter only: every unmasked load and store of a kernel must touch bytes inside
    one of the launch's tensor arguments (a read past the end of a buffer is undefined behaviour on the
    GPU: usually garbage, possibly a fault). Hooks the interpreter's masked load/store (Triton
    3.x internals); skips the test where they are not available."""
    if HAS_CUDA or not INTERPRET:
        yield None
        return
    try:
        from triton.runtime import interpreter as it
        builder, executor = it.InterpreterBuilder, it.GridExecutor
        builder.create_masked_load, builder.create_masked_store, executor.__call__
    except (ImportError, AttributeError):
        pytest.skip("this Triton's interpreter has no load/store hooks to check bounds")
    import numpy as np
    ranges = []
    bad = []
    real_call, real_load, real_store = executor.__call__, builder.create_masked_load, builder.create_masked_store

    def call(self, *args, **kwargs):
        saved = list(ranges)
        for a in list(args) + list(kwargs.values()):
            if isinstance(a, torch.Tensor) and a.numel() > 0:
                # the tensor's own extent (not its storage's: a view's neighbours are off limits)
                span = 1 + sum((n - 1) * st for n, st in zip(a.shape, a.stride()))
                ranges.append((a.data_ptr(), a.data_ptr() + span * a.element_size()))
        try:
            return real_call(self, *args, **kwargs)
        finally:
            ranges[:] = saved

    def check(ptrs, mask, what):
        addr = np.broadcast_to(ptrs.data, np.broadcast_shapes(ptrs.data.shape, mask.data.shape))
        addr = addr[np.broadcast_to(mask.data, addr.shape)].astype(np.uint64)
        size = np.dtype(it._get_np_dtype(ptrs.get_element_ty())).itemsize
        ok = np.zeros(addr.shape, dtype=bool)
        for lo, hi in ranges:
            ok |= (addr >= lo) & (addr + size <= hi)
        if not ok.all():
            bad.append(f"{what}: {int((~ok).sum())} of {addr.size} addresses outside every argument")

    def load(self, ptrs, mask, other, *a, **kw):
        check(ptrs, mask, 'load')
        return real_load(self, ptrs, mask, other, *a, **kw)

    def store(self, ptrs, value, mask, *a, **kw):
        check(ptrs, mask, 'store')
        return real_store(self, ptrs, value, mask, *a, **kw)

    monkeypatch.setattr(executor, '__call__', call)
    monkeypatch.setattr(builder, 'create_masked_load', load)
    monkeypatch.setattr(builder, 'create_masked_store', store)
    yield bad
    assert not bad, f"out-of-bounds memory accesses: {bad[:5]}"


# ----------------------------------------------------------------------------------------------
# float32 matrix against the float64 oracle (forward, final state, all gradients)
# ----------------------------------------------------------------------------------------------

MATRIX = [
    # id, (B, T, H, HV, K, V), options
    ('T45-BT32-B2', (2, 45, 1, 1, 32, 32), dict(chunk_size=32)),
    ('T64-BT32-exact', (1, 64, 1, 1, 32, 32), dict(chunk_size=32, h0=False)),
    ('T70-BT64-gva12', (1, 70, 1, 2, 32, 32), dict(chunk_size=64)),
    ('T37-BT32-gva24-noh0-nofinal', (1, 37, 2, 4, 16, 16), dict(chunk_size=32, h0=False, final=False)),
    ('T20-BT64-short-nofinal', (2, 20, 1, 1, 32, 32), dict(chunk_size=64, final=False)),
    ('T45-BT32-K60-V48-vfirst', (1, 45, 1, 2, 60, 48), dict(chunk_size=32, state_v_first=True)),
    ('T40-BT32-l2norm-scale', (1, 40, 2, 2, 32, 32), dict(chunk_size=32, l2=True, scale=0.3)),
    ('T30-BT32-K100-V100', (1, 30, 1, 1, 100, 100), dict(chunk_size=32)),
    ('T1-BT64', (3, 1, 1, 1, 16, 16), dict(chunk_size=64)),
    # Fixed length with several (sequence, head) pairs and value slices: the backward's sweeps
    # with their slices innermost on a 1-D grid, the forward's on axis 1 (sweep_grid).
    ('T40-BT32-B2-gva12-V72', (2, 40, 1, 2, 16, 72), dict(chunk_size=32)),
    ('varlen-BT32-empty-len1', None, dict(chunk_size=32, lengths=[0, 1, 19, 25], H=1, HV=2, K=32, V=32)),
    ('varlen-BT64-vfirst-l2', None, dict(chunk_size=64, lengths=[40, 0, 1, 29], H=1, HV=2, K=32, V=24,
                                         state_v_first=True, l2=True)),
    ('varlen-BT32-gva-noh0', None, dict(chunk_size=32, lengths=[33, 3, 32], H=2, HV=4, K=16, V=16, h0=False)),
    # Several value slices: the backward's varlen sweeps decode the slice from a 1-D grid, the
    # forward's from grid axis 1 (sweep_grid).
    ('varlen-BT32-V72', None, dict(chunk_size=32, lengths=[7, 40, 0, 33], H=1, HV=2, K=16, V=72)),
]


@requires_kernels
@pytest.mark.parametrize('shape,opts', [pytest.param(s, o, id=i) for i, s, o in MATRIX])
def test_matches_reference(shape, opts):
    check_matrix_case(shape, opts)


def check_matrix_case(shape, opts):
    """``check_case`` of a MATRIX entry (varlen entries carry their head counts and dims in opts)."""
    opts = dict(opts)
    if shape is None:
        shape = (1, 0, opts.pop('H'), opts.pop('HV'), opts.pop('K'), opts.pop('V'))
    check_case(*shape, **opts)


@requires_kernels
def test_forward_K32_V100():
    """K != V with V > 64 (several V blocks in every stage) and T not a multiple of the chunk."""
    check_case(1, 50, 1, 1, 32, 100, chunk_size=64, grads=False)


@requires_kernels
@pytest.mark.parametrize('gate', ['A_log+dt_bias', 'A_log_wide', 'A_log_tail', 'lower_bound',
                                  'lower_bound_saturated', 'lower_bound_saturated+l2norm',
                                  'lower_bound+A_log_varlen_K60'])
def test_gate_and_beta_in_kernel(gate):
    """use_gate_in_kernel / use_beta_sigmoid_in_kernel: the activations of docs/API.md written out here
    in float64 as the oracle; gradients reach g_raw, beta logits, A_log and dt_bias.
    'A_log_wide': the softplus gate without dt_bias on raw gates within +-40: steps from about
    -1e-17 to below the -104 clamp (a = exp(1.5): down to -179), where the gradient is 0.
    'A_log_tail': the softplus gate on raw gates in [-30, -18], where softplus(x) ~ e^x and
    1 + e^x rounds to 1: dA_log (sum dg * step) is all tail (a plain log(1 + e^x) made it 0;
    a helper's mutation, which every other gate case passed).
    'lower_bound_saturated': lower_bound = -5 with raw gates driving whole 16-row blocks to -5 per
    step, the widest decay span (75) the factored diagonal blocks of the bounded gate take;
    '+l2norm' the same with q and k normalized in the kernel (the Kimi layer's configuration).
    'lower_bound+A_log_varlen_K60': the bounded gate with A_log and dt_bias, on 3 sequences (partial
    chunks, rows past a sequence's end in a chunk's tiles) and K = 60 (masked key columns)."""
    B, T, H, HV, K, V = 1, 40, 1, 2, 16, 16
    chunk_size, lb = 32, -3.0
    lengths = None
    if gate.startswith('lower_bound_saturated'):
        T, K, V, chunk_size, lb = 80, 32, 16, 64, -5.0
    if gate == 'lower_bound+A_log_varlen_K60':
        lengths, K, V = [5, 40, 19], 60, 24
        T = sum(lengths)
    x = make_inputs(B, T, H, HV, K, V)
    x['g'] = torch.randn(B, T, HV, K)                     # raw gate
    if gate.startswith('lower_bound_saturated'):
        x['g'][:, 16:48] = 40.                             # sigmoid -> 1: steps of -5
    x['beta'] = 2 * torch.randn(B, T, HV)                  # logits
    s0 = make_state(B if lengths is None else len(lengths), HV, K, V)
    extra = dict(dt_bias=0.5 * torch.randn(HV * K))
    if gate == 'lower_bound+A_log_varlen_K60':
        extra['A_log'] = torch.randn(HV)
    if gate == 'A_log_wide':
        x['g'] = 40 * (2 * torch.rand(B, T, HV, K) - 1)
        extra = dict(A_log=torch.tensor([0.5, 1.5]))
        opts = dict(use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True)
    elif gate == 'A_log_tail':
        x['g'] = -18 - 12 * torch.rand(B, T, HV, K)
        extra = dict(A_log=torch.tensor([0.3, -0.4]))
        opts = dict(use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True)
    elif gate == 'A_log+dt_bias':
        extra['A_log'] = torch.randn(HV)
        opts = dict(use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True)
    else:
        opts = dict(use_gate_in_kernel=True, lower_bound=lb, use_beta_sigmoid_in_kernel=True,
                    allow_neg_eigval=True, use_qk_l2norm_in_kernel=gate.endswith('+l2norm'))
    leaves = {n: t.clone().to(KDEV).requires_grad_() for n, t in dict(x, **extra).items()}
    cu = None if lengths is None else lengths_to_cu(lengths)
    o, ht = chunk_kda(**leaves, initial_state=s0.to(KDEV), output_final_state=True,
                      chunk_size=chunk_size, cu_seqlens=None if cu is None else cu.to(KDEV), **opts)
    do, dht = torch.randn(o.shape), torch.randn(ht.shape)
    names = list(leaves)
    gk = torch.autograd.grad((o * do.to(KDEV)).sum() + (ht * dht.to(KDEV)).sum(), [leaves[n] for n in names])

    L = {n: to64(t).requires_grad_() for n, t in dict(x, **extra).items()}
    z = L['g'] + L['dt_bias'].view(HV, K) if 'dt_bias' in L else L['g']
    if gate.startswith('A_log'):
        g = -L['A_log'].exp()[:, None] * F.softplus(z)
        beta = torch.sigmoid(L['beta'])
    else:
        if 'A_log' in L:
            z = L['A_log'].exp()[:, None] * z
        g = lb * torch.sigmoid(z)
        beta = 2 * torch.sigmoid(L['beta'])
    q, k = L['q'], L['k']
    if gate.endswith('+l2norm'):
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    ro, rht = naive_recurrent_kda(q, k, L['v'], g, beta, initial_state=to64(s0),
                                  output_final_state=True, cu_seqlens=cu)
    rg = torch.autograd.grad((ro * to64(do)).sum() + (rht * to64(dht)).sum(), [L[n] for n in names])
    errs = errors(o, ht, dict(zip(names, (t.cpu() for t in gk))), ro, rht, dict(zip(names, rg)))
    if gate == 'A_log_wide':
        # dA_log = sum dg/dstep * step is ill-conditioned here: steps near -100 multiply the
        # rounding of dg (1e-5 of its norm) while their true products vanish; against the
        # reference it measured 1e-4 .. 3e-3 on three seeds, before and after the gate moved
        # into the kernels. Checked instead through the kernel's own g_raw gradient:
        # dg_raw = dg/dstep * (-a sigmoid(x)), so dA_log = sum dg_raw softplus(x) / sigmoid(x),
        # and dg_raw = 0 where the step was clamped at -104.
        errs.pop('dA_log')
        dgr, xr = to64(gk[names.index('g')].cpu()), to64(x['g'])
        a = to64(extra['A_log']).exp()[:, None]
        clamped = -a * F.softplus(xr) < -104
        assert clamped.any() and (dgr[clamped] == 0).all()
        want = (dgr * F.softplus(xr) / torch.sigmoid(xr)).sum((0, 1, 3))
        assert_errs({'dA_log': rel_err(gk[names.index('A_log')].cpu(), want)}, TOL, 'dA_log')
    assert_errs(errs, TOL, f"in-kernel gate {gate}")


# ----------------------------------------------------------------------------------------------
# strong decay
# ----------------------------------------------------------------------------------------------

def _cumsum_floor(x, s0, do, dht, chunk_size, cu_seqlens=None, **opts):
    """The error the float32 in-chunk cumulative log-decay alone causes: the float64 chunk algebra
    fed ``g'`` whose float64 prefix sums are exactly the kernel's float32 prefix sums of the
    (clamped at -104) log-decay. Returns ``(o, ht, grads)`` of that computation."""
    g = x['g'].float().clamp(min=-104.)
    B, T = g.shape[:2]
    bounds = [0, T] if cu_seqlens is None else cu_seqlens.tolist()
    g2 = torch.empty(g.shape, dtype=torch.float64)
    for bos, eos in zip(bounds, bounds[1:]):
        for s in range(bos, eos, chunk_size):
            e = min(s + chunk_size, eos)
            c = g[:, s:e].cumsum(1).double()
            g2[:, s:e] = torch.diff(c, dim=1, prepend=torch.zeros_like(c[:, :1]))
    y = dict(x, g=g2)
    return run_ref(y, s0, do, dht, cu_seqlens=cu_seqlens,
                   fn=lambda **kw: chunk_kda_reference(**kw, chunk_size=chunk_size), **opts)


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


@requires_cuda
@pytest.mark.parametrize('case', ['whole', 'segmented', 'segmented-busy'])
def test_inference_beta_ordered_before_its_readers(monkeypatch, case):
    """The side stream's beta (``prepare_beta``) is written behind ~5 ms of sleep after being
    filled with NaN: a pair product, solve or sweep that read it before the current stream joined
    the side stream would make the outputs NaN or differ. And the caller's beta is itself written
    behind ~5 ms of sleep on the current stream after a NaN fill: a side stream that did not wait
    for it would read NaN. Whole (two sequences), in time segments (one) and in segments after
    the cumsum of the whole sequence (12 SMs claimed, ``busy_sweep``), all past the forced
    SEGMENT_MIN_TOKEN_HEADS."""
    patch_chunk(monkeypatch, 'SEGMENT_MIN_TOKEN_HEADS', 0)
    if case.endswith('busy'):
        patch_chunk(monkeypatch, 'sm_count', lambda device: 12)
    B = 2 if case == 'whole' else 1
    x = make_inputs(B, 1500, 4, 4, 128, 128, dtype=torch.bfloat16, device='cuda')
    logits = torch.randn(B, 1500, 4, device='cuda')
    h0 = make_state(B, 4, 128, 128, device='cuda')
    layout = chunk_map.chunk_layout(B, 1500, 64, None, None)
    dev = torch.device('cuda')
    assert (chunk_schedule.forward_segments(B, 1500, 4, 128, 128, layout, None, False, dev) is not None) == (B == 1)
    assert chunk_schedule.busy_sweep(4, 128, 128, dev) == case.endswith('busy')

    def forward(beta):
        with torch.no_grad():
            return chunk_kda(**dict(x, beta=beta), initial_state=h0, output_final_state=True,
                             use_beta_sigmoid_in_kernel=True)

    want = forward(logits)
    prepare = chunk_api.kernel_beta

    def late(out, beta, **kw):
        out.fill_(float('nan'))
        torch.cuda._sleep(10 ** 7)
        prepare(out, beta, **kw)

    patch_chunk(monkeypatch, 'kernel_beta', late)
    beta = torch.full_like(logits, float('nan'))
    torch.cuda._sleep(10 ** 7)
    beta.copy_(logits)
    got = forward(beta)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


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


@requires_kernels
@pytest.mark.parametrize('chunk_size,pattern,lengths', [
    (64, 'stretch', None), (32, 'stretch', None), (64, 'conftest', None), (32, 'stretch', [21, 43])])
def test_strong_decay(chunk_size, pattern, lengths):
    """Outputs and gradients stay finite and correct under -20 stretches and -1e3/-1e4 steps.

    Bound: ``TOL + 2 * floor`` per quantity, ``floor`` being the error of exact (float64)
    arithmetic on the kernel's float32 cumulative decays (``_cumsum_floor``). With mild gates the
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
    fo, fht, fgd = _cumsum_floor(x, s0, do, dht, chunk_size, cu_seqlens=cu)
    floor = errors(fo, fht, fgd, ro, rht, rgd)
    print("\nfloat32-cumsum floor: " + ' '.join(f"{n}={e:.1e}" for n, e in floor.items()))
    assert_errs(errs, {n: TOL + 2 * f for n, f in floor.items()}, f"strong decay {pattern} BT={chunk_size}")
    # Below the clamp (LOG_DECAY_FLOOR, -104) the gradient is exactly 0, as exp(g) (...) is in
    # float32; the kernel's rounding residue there (~1e-7, far inside the bound above) would pass.
    clamped = x['g'] < -104
    assert clamped.any() and (gd['g'][clamped] == 0).all(), \
        f"dg below the clamp: {gd['g'][clamped].abs().max():.1e}"


@requires_kernels
@pytest.mark.parametrize('lengths', [None, [70, 58]], ids=['T128', 'varlen-partial'])
def test_mild_decay_gradients(lengths):
    """Gradients under mild decay (g in (-0.05, 0], about exp(-1.6) across a 64-row chunk), where
    pairs 33-63 rows apart still weigh: conftest's gates (-0.5 a step on average) damp them by
    ~e^-16, below any tolerance, so a pair-gradient loop that skipped the farthest 16-row
    blocks passed the matrix (a helper's mutations of ``pair_row_grads`` and ``pair_col_grads``:
    dq 0.15 and dk 0.13 off here, caught elsewhere only by one diagonal-block case)."""
    H, HV, K, V = 1, 2, 32, 32
    T = 128 if lengths is None else sum(lengths)
    x = make_inputs(1, T, H, HV, K, V)
    x['g'] = -0.05 * torch.rand_like(x['g'])
    check_case(1, T, H, HV, K, V, chunk_size=64, lengths=lengths, inputs=x)


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
@pytest.mark.parametrize('drop', [-58., -61., 'mixed', 'large_values'])
def test_diagonal_block_paths(drop):
    """The backward's diagonal sub-blocks factor through their middle row r (row 7 of 16; float32
    matrix products) when every row's cumulative decay is within DIAG_SPAN = 60 of r's, else use the
    4-row group path. Mild steps of -0.1 with one drop right after r in every block put the
    block's last row |drop| + 0.7 from r: 58.7 (factored) or 61.7 (4-row groups); 'mixed' drops -61
    on half the key channels, so one block takes both paths in different key slices;
    'large_values': the factored case with values of 1e16, whose pair-matrix gradients times
    exp(58.7) overflowed float32 before they were scaled. Bound as in test_strong_decay (the
    drops push the float32 in-chunk sums to ~-250)."""
    B, T, HV, K, V = 1, 80, 2, 128, 32
    x = make_inputs(B, T, 1, HV, K, V)
    x['g'][:] = -0.1
    channels = slice(0, K // 2) if drop == 'mixed' else slice(None)
    x['g'][:, 8::16, :, channels] = {'mixed': -61., 'large_values': -58.}.get(drop, drop)
    if drop == 'large_values':
        x['v'] = x['v'] * 1e16
    s0 = make_state(B, HV, K, V)
    o, ht, gd, do, dht = run_chunk(x, s0, chunk_size=64)
    ro, rht, rgd = run_ref(x, s0, do, dht)
    errs = errors(o, ht, gd, ro, rht, rgd)
    fo, fht, fgd = _cumsum_floor(x, s0, do, dht, 64)
    floor = errors(fo, fht, fgd, ro, rht, rgd)
    assert_errs(errs, {n: TOL + 2 * f for n, f in floor.items()}, f"diagonal blocks, drop = {drop}")


@requires_kernels
def test_forward_diagonal_row_factor_below_normal():
    """The forward's diagonal block factors through its first row r: ``exp(c_i - r)`` times a key
    factor up to exp(76). After a drop of -75.9 (row 1) and -11.5 (row 2), row 2's factor is
    exp(-87.4), under float32's smallest normal, while A'[2, 1] = exp(-11.5) |k_1|^2 = 1.0e-5.
    A flushing exponential (ex2.approx.ftz) gave 0 there on the H200 (review of b1d7dd5); float32
    inputs keep the subnormal factor. The interpreter (NumPy) never flushes, so only a GPU run
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


@pytest.mark.skipif(not INTERPRET or HAS_CUDA, reason="patches a kernel constant, which only the "
                    "interpreter reads at run time")
@pytest.mark.parametrize('shape', ['varlen_BT32', 'T45_BT64'])
def test_backward_group_path_everywhere(monkeypatch, shape):
    """The backward's 4-row group scheme for diagonal sub-blocks on every block (DIAG_SPAN patched
    below any span), including partial blocks at sequence ends, which the natural drops of
    test_diagonal_block_paths do not reach."""
    import triton.language as tl
    import kda.kernels.chunk_common as common
    monkeypatch.setattr(common, 'DIAG_SPAN', tl.constexpr(-1.0))
    if shape == 'varlen_BT32':
        check_case(1, 0, 1, 2, 32, 24, chunk_size=32, lengths=[5, 23, 38])
    else:
        check_case(1, 45, 1, 1, 32, 16, chunk_size=64)


@requires_kernels
@pytest.mark.parametrize('rule', ['halved_state_slice', 'K256'])
def test_launch_rules(monkeypatch, rule):
    """The launcher's shape rules, which the interpreter's defaults never reach: halving the state
    sweeps' value slices (forward carry and gradient sweep) when there are fewer programs than SMs
    (forced by claiming a huge GPU), and K = 256 (32-wide state slices; float32: one pipeline
    stage)."""
    if rule == 'halved_state_slice':
        patch_chunk(monkeypatch, 'sm_count', lambda device: 10 ** 6)
        check_case(1, 40, 1, 2, 32, 48, chunk_size=32)
    else:
        check_case(1, 20, 1, 1, 256, 32, chunk_size=32)


def spy_launches(monkeypatch, name: str, record) -> list:
    """Replaces kernel ``name`` of ``kda.ops.chunk`` with one that still launches it but first
    appends ``record(grid, launch keyword arguments)`` to the list returned here."""
    seen, kernel = [], chunk_name(name)

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen.append(record(grid, kwargs))
                return kernel[grid](*args, **kwargs)
            return launch

    patch_chunk(monkeypatch, name, Spy())
    return seen


@requires_kernels
@pytest.mark.parametrize('case', ['T45-BT32-K60-V48-vfirst', 'T37-BT32-gva24-noh0-nofinal', 'varlen-BT32-V72',
                                  'varlen-BT64-vfirst-l2'])
def test_transposed_sweeps(monkeypatch, case):
    """The backward's carry and gradient sweep holding the state transposed, as they do where their
    programs make at most 1.5 waves (forced by claiming a huge GPU, which also applies
    FEW_PROGRAMS; with the interpreter's one "SM" they are transposed only for a single program,
    N * HV * value slices = 1): the float64 checks of the matrix case, and the launches seen
    transposed."""
    patch_chunk(monkeypatch, 'sm_count', lambda device: 10 ** 6)
    seen = {name: spy_launches(monkeypatch, name, lambda grid, kwargs: kwargs['TRANSPOSED'])
            for name in ('chunk_state_fwd_kernel', 'chunk_state_bwd_kernel')}
    check_matrix_case(*next((s, o) for i, s, o in MATRIX if i == case))
    assert {name: set(s) for name, s in seen.items()} == {'chunk_state_fwd_kernel': {True},
                                                         'chunk_state_bwd_kernel': {True}}


def test_forward_segments(monkeypatch):
    """Where the forward runs in time segments (``forward_segments``): only one fixed-length
    sequence whose fused sweep has fewer programs than two an SM, never with ``store_states``; the
    segments are whole chunks, cover the sequence in order, and shrink (never grow) where the
    sweep is the shorter part (many heads), equal otherwise; not for short sequences, whose time
    the host's launches would set (SEGMENT_MIN_TOKEN_HEADS, lifted for the shape checks)."""
    cpu = torch.device('cpu')

    def segments(B, T, HV, few=True, varlen=False, store=False, V=128):
        patch_chunk(monkeypatch, 'sm_count', lambda device: 10 ** 6 if few else 1)
        layout = chunk_map.chunk_layout(B, T, 64, None, None)
        return chunk_schedule.forward_segments(B, T, HV, 128, V, layout, torch.zeros(2) if varlen else None,
                                          store, cpu)

    assert segments(1, 16384, 32) is not None and segments(1, 8192, 32) is None
    patch_chunk(monkeypatch, 'SEGMENT_MIN_TOKEN_HEADS', 0)
    for T, HV in ((32768, 32), (32768, 64), (65536, 16), (32769, 32), (200, 4), (129, 40), (65, 1),
                  *((T, HV) for T in (257, 300, 320, 1000, 8191) for HV in (4, 20, 21, 40))):
        seg = segments(1, T, HV)
        assert seg[0][0] == 0 and seg[-1][1] == T, seg
        assert len(seg) == min(chunk_schedule.FORWARD_SEGMENTS, -(-T // 64)), seg
        assert all(a[1] == b[0] for a, b in zip(seg, seg[1:])), seg
        assert all(t0 % 64 == 0 and t1 > t0 for t0, t1 in seg), seg
        lengths = [t1 - t0 for t0, t1 in seg[:-1]]
        assert lengths == sorted(lengths, reverse=True), seg
        if T % (64 * chunk_schedule.FORWARD_SEGMENTS) == 0 and T >= 4096:
            assert (max(lengths) == min(lengths)) == (HV <= chunk_schedule.SEGMENT_BALANCE), seg
    assert segments(1, 64, 4) is None                  # one chunk
    assert segments(2, 4096, 4) is None                # a segment would not be a contiguous view
    assert segments(1, 4096, 4, varlen=True) is None
    assert segments(1, 4096, 4, store=True) is None
    assert segments(1, 4096, 4, few=False) is None     # the sweep fills the GPU
    # Between one program for every two SMs and two an SM: BUSY_SWEEP_SEGMENTS (64-wide slices:
    # 2 programs a head; 132 SMs as on the H200).
    patch_chunk(monkeypatch, 'sm_count', lambda device: 132)
    layout = chunk_map.chunk_layout(1, 8192, 64, None, None)
    busy = chunk_schedule.BUSY_SWEEP_SEGMENTS
    for HV, count in ((32, 4), (33, 4), (34, busy), (96, busy), (131, busy), (132, None)):
        seg = chunk_schedule.forward_segments(1, 8192, HV, 128, 128, layout, None, False, cpu)
        assert (None if seg is None else len(seg)) == count, (HV, seg)


@requires_kernels
@pytest.mark.parametrize('case', ['T100-BT32-vfirst', 'T193-fp32-noh0', 'T150-gate-nofinal-inference',
                                  'T100-BT32-gate-busy', 'T100-BT32-busy-nofinal-inference'])
def test_segmented_forward(monkeypatch, case):
    """The forward in time segments (forced by claiming a huge GPU, at a length the launcher would
    leave whole): outputs, final state and every gradient bit for bit those of the forward in one
    pass, which the other tests check against float64 (the same chunk steps, the state handed from
    segment to segment in float32). 'gate-nofinal-inference': the Kimi gate activated in the first
    kernel, no final state (the last segment stores none), under no_grad. 'busy': a GPU of 4 SMs,
    which the sweep's 4 programs (4 heads, one value slice) leave busy (``busy_sweep``): the
    cumsum runs for the whole sequence first, then 3 segments. 'BT32': 32-token chunks, half the
    interpreter's time for as many chunks. Inference ('inference') normalizes raw q and k in each
    segment's pair products; training normalizes them in a pass of its own first."""
    T = int(case.split('-')[0][1:])
    BT = 32 if 'BT32' in case else 64
    dtype = torch.float32 if 'fp32' in case else torch.float16
    vfirst, with_h0, final = 'vfirst' in case, 'noh0' not in case, 'nofinal' not in case
    opts = dict(use_qk_l2norm_in_kernel=True)
    if 'gate' in case:
        opts.update(use_gate_in_kernel=True, A_log=torch.log(1 + 15 * torch.rand(4)).to(KDEV),
                    dt_bias=(0.1 * torch.randn(4 * 32)).to(KDEV), safe_gate=True, lower_bound=-5.0,
                    use_beta_sigmoid_in_kernel=True)
    busy = 'busy' in case
    patch_chunk(monkeypatch, 'sm_count', lambda device: 4 if busy else 10 ** 6)
    patch_chunk(monkeypatch, 'SEGMENT_MIN_TOKEN_HEADS', 0)
    x = make_inputs(1, T, 2, 4, 32, 48, dtype=dtype, device=KDEV)
    h0 = make_state(1, 4, 32, 48, state_v_first=vfirst, device=KDEV) if with_h0 else None
    seen, cumsums, matrices = [], [], []
    segments = chunk_schedule.forward_segments
    patch_chunk(monkeypatch, 'forward_segments', lambda *a: seen.append(segments(*a)) or seen[-1])
    cumsum, rest = chunk_intra.cumulative_decay, chunk_intra.pair_products_and_solve
    patch_chunk(monkeypatch, 'cumulative_decay',
                lambda q, *a, decayed: cumsums.append((q.shape[1], decayed)) or cumsum(q, *a, decayed=decayed))
    patch_chunk(monkeypatch, 'pair_products_and_solve',
                lambda q, *a, **kw: matrices.append((q.shape[1], a[-1])) or rest(q, *a, **kw))

    def run():
        if not final:
            with torch.no_grad():
                o, ht = chunk_kda(**x, initial_state=h0, state_v_first=vfirst, chunk_size=BT, **opts)
            assert ht is None
            return [o]
        leaves = {n: t.detach().clone().requires_grad_() for n, t in x.items()}
        state = None if h0 is None else h0.clone().requires_grad_()
        o, ht = chunk_kda(**leaves, initial_state=state, output_final_state=True, state_v_first=vfirst,
                          chunk_size=BT, **opts)
        (o.float().sin().sum() + ht.cos().sum()).backward()
        return [o, ht] + [t.grad for t in (*leaves.values(), state) if t is not None]

    got = run()
    assert chunk_schedule.busy_sweep(4, 32, 48, KDEV) == busy
    assert seen[-1] is not None and len(seen[-1]) == min(3 if busy else 4, -(-T // BT)), seen
    # The forward's cumsum: once over the whole sequence first with a busy sweep, else one a
    # segment; the pair products and the solve one a segment (the backward's recompute: whole).
    lengths = [t1 - t0 for t0, t1 in seen[-1]]
    assert [n for n, decayed in cumsums if not decayed] == ([T] if busy else lengths), cumsums
    assert matrices == [(n, 'inference' in case) for n in lengths], matrices
    patch_chunk(monkeypatch, 'forward_segments', lambda *a: None)
    for name, a, b in zip(['o', 'ht', *x, 'h0'], got, run()):
        assert torch.equal(a, b), name


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
    sums), all-zero q and k rows (the epsilon keeps them zero, not NaN; review of 36735d1);
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


@requires_kernels
@pytest.mark.parametrize('present', ['both', 'A_log', 'dt_bias'])
@pytest.mark.parametrize('BN', [64, 'tuned'])
def test_gate_param_grad_sums(present, BN):
    """The sums over chunks of the gate kernel's per-chunk A_log and dt_bias gradients: C = 150
    chunks (with 64 a step, several steps and a partial one; with TUNING's step, one partial
    step), K = 60 (masked columns of a key slice, NK = 3 slice sums a chunk), against float64
    sums; the outputs start as NaN, so an entry left unwritten fails."""
    from kda.kernels.chunk_intra_bwd import gate_param_grad_kernel
    C, HV, K, NK = 150, 3, 60, 3
    cfg = chunk_launch.launch_config('gate_params', K, K)
    if BN != 'tuned':
        cfg['BN'] = BN
    da, dbias = torch.randn(C, HV, NK), torch.randn(C, HV, K)
    dA_log = torch.full((HV,), float('nan'), device=KDEV) if present != 'dt_bias' else None
    ddt_bias = torch.full((HV * K,), float('nan'), device=KDEV) if present != 'A_log' else None
    gate_param_grad_kernel[(HV, -(-K // cfg['BK']))](da.to(KDEV), dbias.to(KDEV), dA_log, ddt_bias, C,
                                                     HV=HV, K=K, NK=NK, **cfg)
    if dA_log is not None:
        assert rel_err(dA_log.cpu(), da.double().sum((0, 2))) < 1e-6
    if ddt_bias is not None:
        assert rel_err(ddt_bias.cpu(), dbias.double().sum(0).view(HV * K)) < 1e-6


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


@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16, torch.float32])
def test_state_sweep_stages(monkeypatch, dtype):
    """The pipeline stages the launcher gives the state sweeps, at every head dim and with few or
    many programs: 16-bit inputs never get one stage in the carry or the gradient sweep (they
    faulted on the H200 so, see state_launch_config); float32 never more than 2, and 1 at K = 256
    (shared memory)."""
    for few in (False, True):
        patch_chunk(monkeypatch, 'sm_count', lambda device: 10 ** 6 if few else 1)
        for K in (16, 64, 128, 256):
            for stage in ('state_fwd', 'state_bwd', 'state_output'):
                cfg = chunk_launch.state_launch_config(stage, K, 128, 4, torch.device('cpu'), dtype)
                stages = cfg.get('num_stages', 2)
                what = f"{stage} K={K} few={few} {dtype}: {cfg}"
                assert cfg['BK'] >= K and cfg['BV'] <= (32 if K > 128 else 128), what
                if dtype == torch.float32:
                    assert stages <= (2 if K <= 128 else 1), what
                elif stage != 'state_output':
                    assert stages >= 2, what


def test_fused_sweep_slices(monkeypatch):
    """The fused forward sweep's slices on a 132-SM GPU: WIDE_SLICES (one 128-wide slice with 8
    warps) for 16-bit inputs at K <= 128 where TUNING's 64-wide slices give at least as many
    programs as SMs and V needs more than one; TUNING's setting in float32, at V <= 64 and at
    K = 256 (32-wide there); FEW_PROGRAMS' with fewer programs than SMs. The backward's sweeps
    never take WIDE_SLICES."""
    patch_chunk(monkeypatch, 'sm_count', lambda device: 132)
    cpu = torch.device('cpu')

    def cfg(stage='state_output', K=128, V=128, heads=128, dtype=torch.bfloat16):
        c = chunk_launch.state_launch_config(stage, K, V, heads, cpu, dtype)
        return c['BV'], c['num_warps'], c.get('num_stages', 2)

    wide = (128, 8, 2)
    for dtype in (torch.bfloat16, torch.float16):
        assert cfg(dtype=dtype) == wide                    # (8, 4096, 16): 256 programs at 64-wide
        assert cfg(heads=66, dtype=dtype) == wide          # 132 programs at 64-wide
        assert cfg(heads=1024, dtype=dtype) == wide
        assert cfg(K=64, V=72, dtype=dtype) == wide
        assert cfg(V=256, dtype=dtype) == wide             # two 128-wide slices
    assert cfg(heads=65)[0] == 32                          # few programs (FEW_PROGRAMS)
    assert cfg(dtype=torch.float32) == (64, 4, 1)
    assert cfg(V=64, heads=132) == (64, 4, 1)               # one 64-wide slice already
    assert cfg(K=256)[:2] == (32, 4)
    for stage in ('state_fwd', 'state_bwd'):
        assert cfg(stage)[:2] == (64, 4), stage


@requires_kernels
@pytest.mark.parametrize('V', [72, 160])
def test_fused_sweep_wide_slice(monkeypatch, V):
    """The fused forward sweep's WIDE_SLICES build (128-wide slices with 8 warps: one for V = 72,
    padded; two for V = 160, the second 32 columns wide), in float16 inference against the
    float64 oracle with the bound of the low-precision tests; the claimed single SM makes the
    launcher pick it on the GPU too."""
    patch_chunk(monkeypatch, 'sm_count', lambda device: 1)
    seen = spy_launches(monkeypatch, 'chunk_state_output_fwd_kernel',
                        lambda grid, kwargs: (grid, kwargs['BV'], kwargs['num_warps']))
    check_lowp(torch.float16, None, 2, 70, 1, 2, 16, V, chunk_size=64, grads=False)
    assert seen == [((4, -(-V // 128)), 128, 8)], seen


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


# Compiles every chunk kernel for sm_90 at the launch configuration the launchers give it, in float32
# and bf16 (and float16 for the pair products, whose diagonal blocks take another path there; the
# other kernels' float16 tiles have bf16's sizes): K = V = 128, and for the state sweeps also
# K = 256 and few programs (FEW_PROGRAMS), the settings that depend on the shape. Prints each
# kernel's shared memory. A separate process: under TRITON_INTERPRET=1 the kernels are interpreted
# functions, which Triton cannot compile. Argument types: the launchers', from kda/ops/offline.py
# (g pre-computed in float32, the float32 scratch buffers, the states handed to the user).
SHARED_MEMORY_SCRIPT = r"""
import concurrent.futures, inspect, json, multiprocessing, os, re, torch
import kda.ops.chunk.launch as chunk_launch
from kda.kernels import chunk_common, chunk_intra, chunk_intra_bwd, chunk_state, chunk_state_bwd, chunk_state_output
from kda.ops.offline import OPTIONAL, POINTERS, compile_sm90
KERNELS = {'cumsum': chunk_intra.chunk_cumsum_kernel, 'cumsum_raw': chunk_intra.chunk_cumsum_kernel,
           'cumsum_decayed': chunk_intra.chunk_cumsum_kernel,
           'cumsum_raw_decayed': chunk_intra.chunk_cumsum_kernel,
           'pair_fwd': chunk_intra.chunk_pair_fwd_kernel,
           # Inference with use_qk_l2norm_in_kernel: raw q and k, normalized in the kernel.
           'pair_fwd_norms': chunk_intra.chunk_pair_fwd_kernel,
           # The lower-bound gate with keys of norm 1 (ALL_NEAR): training's and inference's.
           'pair_fwd_near': chunk_intra.chunk_pair_fwd_kernel,
           'pair_fwd_norms_near': chunk_intra.chunk_pair_fwd_kernel,
           'solve': chunk_intra.chunk_solve_kernel,
           # Varlen builds: the chunk map (chunk_rows) is read before griddepcontrol.wait.
           'pair_fwd_norms_varlen': chunk_intra.chunk_pair_fwd_kernel,
           'solve_varlen': chunk_intra.chunk_solve_kernel,
           'intra_bwd': chunk_intra_bwd.chunk_intra_bwd_kernel,
           'pair_bwd': chunk_intra_bwd.chunk_pair_bwd_kernel, 'pair_bwd_bounded': chunk_intra_bwd.chunk_pair_bwd_kernel,
           'gate_bwd': chunk_intra_bwd.chunk_gate_bwd_kernel, 'gate_bwd_raw': chunk_intra_bwd.chunk_gate_bwd_kernel,
           'state_fwd': chunk_state.chunk_state_fwd_kernel, 'state_bwd': chunk_state_bwd.chunk_state_bwd_kernel,
           'state_output': chunk_state_output.chunk_state_output_fwd_kernel}


# Builds for the raw gate (bf16 g, the activation inside).
RAW_GATE = ('gate_bwd_raw', 'cumsum_raw', 'cumsum_raw_decayed')


def compile_shared(stage, dtype, K, few, transposed):
    chunk_launch.sm_count = lambda device: 10 ** 6 if few else 1
    fn = KERNELS[stage]
    varlen, stage = stage.endswith('_varlen'), stage.removesuffix('_varlen')
    if stage.startswith('state_'):
        cfg = chunk_launch.state_launch_config(stage, K, K, 4, torch.device('cpu'), dtype)
    else:
        cfg = chunk_launch.launch_config(stage.removesuffix('_near'), K, K)
    values = dict(H=4, HV=4, K=K, V=K, BT=64, BC=16, DOT_DTYPE=chunk_launch.DOT_DTYPES[dtype], IS_VARLEN=varlen,
                  SLICES_INNERMOST=cfg.get('SLICES_INNERMOST', False),
                  GATE='sigmoid' if stage in RAW_GATE else 'none',
                  DECAYED=stage not in ('cumsum', 'cumsum_raw'),
                  FACTORED_DIAG=dtype != torch.float16, BOUNDED_DECAY=stage == 'pair_bwd_bounded',
                  ALL_NEAR=stage.endswith('_near'), L2NORM=stage.startswith('pair_fwd_norms'),
                  # As launched: early (the waits) only the l2norm inference's pair products and
                  # solve; the cumsum releases its dependents always (kda/ops/chunk/launch.py).
                  PDL=stage.startswith(('cumsum', 'pair_fwd_norms', 'solve')),
                  USE_INITIAL_STATE=False, STORE_FINAL_STATE=False, STORE_STATES=True, USE_FINAL_STATE_GRADIENT=False,
                  STORE_INITIAL_STATE_GRADIENT=False, TRANSPOSED=transposed,
                  **{n: cfg[n] for n in ('BK', 'BV') if n in cfg})
    options = {n: cfg[n] for n in ('num_warps', 'num_stages', 'maxnreg') if n in cfg}
    # specialize: the launches' tensors are 16-byte aligned with strides divisible by 16, and the
    # build that knows it pipelines its loads through shared memory (the larger ask: the gradient
    # sweep at K = 256 asked 256 KiB on the H200 where the unspecialized build asks 76 KiB).
    # The raw gate's build: g and its dg in the input dtype, A_log, dt_bias and the sums present.
    signature = dict(absent=OPTIONAL - {'A_log', 'dt_bias', 'da', 'dbias'},
                     pointers={n: POINTERS[dtype] for n in ('g', 'dg')}) if stage in RAW_GATE else {}
    if varlen:
        signature['absent'] = OPTIONAL - {'chunk_rows'}
    kernel = compile_sm90(fn, values, dtype, options, specialize=True, **signature)
    ptx = kernel.asm['ptx']
    return str(cfg), kernel.metadata.shared, tensor_core_products(ptx), dependent_launch_order(ptx)


# Tensor-core products (mma.sync, wgmma.mma_async), predicated or not.
TENSOR_CORE = re.compile(r'^\s*(?:@!?%\w+\s+)?(?:mma\.sync|wgmma\.mma_async)')


def tensor_core_products(ptx):
    return sum(bool(TENSOR_CORE.match(x)) for x in ptx.splitlines())


# Where the PDL instructions sit in the PTX. Every access to global memory counts (ld/st in any
# variant, cp.async and its bulk/tensor (TMA) forms, atomics and reductions; generic addresses
# too), not only ld.global/st.global: the loads the software pipeliner issues are cp.async, and
# Triton 3.6 places a loop's prologue copies above a griddepcontrol.wait inside the loop (Triton
# issue #11905). A load before the wait must come from a source line that may read early
# (EARLY_READS, by the PTX's .loc lines: the line itself and the line it was inlined at). The wait
# must not sit in a loop or a branch: no branch after it goes back above it, none before it jumps
# past it.
def source_lines(fn):
    src, first = inspect.getsourcelines(fn.fn)
    return os.path.basename(inspect.getsourcefile(fn.fn)), range(first, first + len(src))


# The rows' norms (inputs, written before the kernel ahead started) and the varlen chunk map
# (likewise).
EARLY_READS = (source_lines(chunk_intra.row_inverse_norms), source_lines(chunk_common.chunk_span))
MEMORY_OP = re.compile(r'^\s*(?:@!?%\w+\s+)?((?:ld|st|cp|atom|red|multimem|prefetch|prefetchu)\.[\w.:]*)')
LABEL = re.compile(r'^\s*(\$L\w+):')
BRANCH = re.compile(r'\bbra(?:\.uni)?\s+(\$L\w+)')
PTX_FILE = re.compile(r'^\s*\.file\s+(\d+)\s+"([^"]+)"')
LOC = re.compile(r'^\s*\.loc\s+(\d+)\s+(\d+)')


# None for an instruction that does not touch global memory, else 'load' or 'store'.
def global_access(op):
    if any(w in op for w in ('commit_group', 'wait_group', 'wait_all', '.param', '.local', '.const')):
        return None
    if '.shared' in op and '.global' not in op:
        return None
    if op.startswith('cp.'):       # cp.<...>.<destination>.<source>
        return 'store' if '.global' in op and op.index('.global') < op.find('.shared') else 'load'
    return 'load' if op.startswith(('ld.', 'prefetch')) else 'store'


def dependent_launch_order(ptx):
    lines = ptx.splitlines()
    files = {m.group(1): os.path.basename(m.group(2)) for m in map(PTX_FILE.match, lines) if m}
    wait = next((i for i, x in enumerate(lines) if 'griddepcontrol.wait' in x), len(lines))
    release = next((i for i, x in enumerate(lines) if 'griddepcontrol.launch_dependents' in x), None)
    labels = {m.group(1): i for i, m in enumerate(map(LABEL.match, lines)) if m}
    loads = stores = 0
    unexplained, frames = [], []
    for x in lines[:wait]:
        m = LOC.match(x)
        if m:
            frames = [(files.get(m.group(1)), int(m.group(2)))]
            frames += [(files.get(f), int(n)) for f, n in re.findall(r'inlined_at\s+(\d+)\s+(\d+)', x)]
            frames += [(f, int(n)) for f, n in re.findall(r'([\w.]+\.py):(\d+)', x.partition('//')[2])]
            continue
        op = MEMORY_OP.match(x)
        kind = op and global_access(op.group(1))
        if kind == 'store':
            stores += 1
        elif kind == 'load':
            loads += 1
            if not any(f == name and n in span for f, n in frames for name, span in EARLY_READS):
                unexplained.append(x.strip())
    targets = [(i, labels.get(m.group(1))) for i, m in enumerate(map(BRANCH.search, lines)) if m]
    return dict(wait=wait < len(lines), release=release is not None,
                loads=loads, stores=stores, unexplained=unexplained[:5],
                back_edges=sum(i > wait and t is not None and t < wait for i, t in targets),
                skips=sum(i < wait and t is not None and t > wait for i, t in targets),
                release_after_wait=release is not None and release > wait)


def row(case):
    stage, dtype, K, few, transposed = case
    return [stage, str(dtype), K, few, transposed, *compile_shared(stage, dtype, K, few, transposed)]


# The fused forward sweep runs transposed always; the carry and the gradient sweep either way with
# many programs (transposed up to 1.5 waves, kda.ops.chunk.launch.transposed_sweeps), transposed with few.
cases = [('pair_fwd', torch.float16, 128, False, False), ('pair_fwd_norms', torch.float16, 128, False, False)]
for dtype in (torch.float32, torch.bfloat16):
    for stage in KERNELS:
        if not stage.startswith('state_'):
            cases.append((stage, dtype, 128, False, False))
            continue
        for K in (128, 256):
            cases += [(stage, dtype, K, True, True)] + [(stage, dtype, K, False, t) for t in (True, False)
                                                        if t or stage != 'state_output']
# One compile per process, all cores: one after another they took > 150 s on the 16-core GPU host,
# where this test's shard of the GPU suite ran out of time twice (f89fb07, c985605).
workers = min(len(cases), len(os.sched_getaffinity(0)))
with concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context('fork')) as pool:
    print(json.dumps(list(pool.map(row, cases))))
"""


@functools.cache
def sm90_builds():
    """Every chunk kernel compiled for sm_90 at its launch configuration, without a GPU, once for
    the tests that read the builds: SHARED_MEMORY_SCRIPT's rows (stage, dtype, K, few,
    transposed, configuration, shared memory, tensor-core products, ``dependent_launch_order``)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path
    env = {n: x for n, x in os.environ.items() if n != 'TRITON_INTERPRET'}
    root = str(Path(__file__).resolve().parent.parent)
    env['PYTHONPATH'] = os.pathsep.join([root] + [p for p in [env.get('PYTHONPATH')] if p])
    run = subprocess.run([sys.executable, '-c', SHARED_MEMORY_SCRIPT], env=env, capture_output=True,
                         text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(rows) == 66
    return rows


def test_launch_shared_memory():
    """Every chunk kernel's launch configuration fits the H200's shared memory, checked by
    compiling for sm_90 without a GPU (no interpreter can see this: f056478 gave the gradient
    sweep 3 stages with few programs, and float32 inputs then asked 256 KiB on the GPU, where 5
    tests failed). A launch-table change that a bf16 sweep picked is checked in float32 here."""
    too_big = [r[:7] for r in sm90_builds() if r[6] > H200_SHARED_MEMORY]
    assert not too_big, f"over {H200_SHARED_MEMORY} B of shared memory: {too_big}"


def test_float32_products_are_exact():
    """With float32 inputs every chunk kernel's matrix products are exact float32 (``mm``,
    ``mm_fine``: ``input_precision="ieee"``, on the FMA units): as compiled for sm_90, no
    tensor-core instruction at all (tf32, or operands rounded to 16 bits). No CPU numerical
    test can see this: the interpreter's dot is numpy's matmul whatever precision it is asked
    for, and a product quietly rounded to tf32 (~1e-3 relative error) passed every interpreter
    test (a helper's mutation of ``mm``). The bf16 builds show that the count sees them at all.
    One build a kernel: a product only in a branch of another build's flags is not seen."""
    counts = {tuple(r[:5]): r[7] for r in sm90_builds()}
    exact = {key: n for key, n in counts.items() if key[1] == 'torch.float32'}
    assert exact and not any(exact.values()), {key: n for key, n in exact.items() if n}
    # Every bf16 build with matrix products (all but the cumsum's and the gate gradient's).
    assert all(n for key, n in counts.items()
               if key[1] == 'torch.bfloat16' and not key[0].startswith(('cumsum', 'gate_bwd'))), counts


def test_dependent_launch_order():
    """The in-chunk kernels as compiled for sm_90 (PDL on, ``kda/ops/chunk/intra.py``,
    ``pair_products_and_solve``): the pair products and the solve of the inference forward with
    l2norm in the kernel, which may start before the kernel ahead of them has finished, write nothing to global memory
    before their griddepcontrol.wait and read nothing before it but, in the L2NORM build, their
    own q and k rows for the norms and, in the varlen builds, the chunk map (by source line;
    cp.async, TMA and atomics count); the wait is in no loop or branch; each releases its
    dependents after its wait; the cumsum, not launched early, releases them without waiting. A
    wait moved below a load or a store, into the key loop, or dropped, fails here; no
    interpreter run can see it. Read from the Triton that runs the test (the GPU host's 3.6
    there, CI's newer one here)."""
    stages = ('cumsum', 'cumsum_raw', 'pair_fwd_norms', 'pair_fwd_norms_near', 'solve',
              'pair_fwd_norms_varlen', 'solve_varlen')
    order = {(r[0], r[1]): r[8] for r in sm90_builds() if r[0] in stages}
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


STAGE1_KERNELS = ('chunk_cumsum_kernel', 'chunk_pair_fwd_kernel', 'chunk_solve_kernel')


@pytest.mark.skipif(not INTERPRET, reason="records the interpreter's launches (CPU tensors)")
@pytest.mark.parametrize('case', ['train-segmented', 'train-busy-keep', 'inference-segmented',
                                  'inference-busy', 'inference-whole', 'inference-plain-segmented',
                                  'varlen-intermediate'])
def test_dependent_launch_chain(monkeypatch, case):
    """The launch side of PDL (``dependent_launch`` forced on; kda.ops.chunk's kernels recorded,
    not run): only the pair products and the solve of the inference forward with l2norm in the
    kernel are launched with ``launch_pdl``, and always with ``PDL`` (their waits) compiled in;
    training's and the other inference's plainly, without their waits; the cumsum never (it
    releases its dependents at its start without waiting, so it must not start early itself); no
    other kernel is. And on the stream where they run, each PDL launch comes right after one of
    stage 1's kernels (event records and waits aside), never after a PyTorch operation or
    another module's kernel: the pair products read q and k before their wait (L2NORM), which
    only a kernel that was not launched early, or that waited before releasing, makes safe (a
    kernel that does not release lets its dependent start as it exits, before its writes are
    flushed: NVIDIA/cccl#9134). Training (segmented; the busy sweep, disable_recompute),
    inference with beta logits (the side stream's beta: segmented, busy, whole; segmented
    without l2norm) and varlen with the intermediate states."""
    import contextlib
    import triton.runtime.interpreter as interpreter
    from torch.utils._python_dispatch import TorchDispatchMode

    patch_chunk(monkeypatch, 'dependent_launch', lambda device: True)
    patch_chunk(monkeypatch, 'SEGMENT_MIN_TOKEN_HEADS', 0)
    patch_chunk(monkeypatch, 'sm_count', lambda device: 4 if 'busy' in case else 10 ** 6)
    ours = {vars(m)[n] for m in CHUNK_MODULES for n in vars(m) if n.endswith('_kernel')}
    seen, where = [], {'side': False, 'inside': False}

    class Side:                               # the side stream kda.ops.utils.fork hands out
        device = torch.device('cpu')

    def fork(device):
        seen.append(('fork', where['side'], {}))
        return Side()

    def join(side):
        if side is not None:
            seen.append(('join', where['side'], {}))

    @contextlib.contextmanager
    def stream(s):
        before, where['side'] = where['side'], s is not None or where['side']
        try:
            yield
        finally:
            where['side'] = before

    run = interpreter.InterpretedFunction.run

    def spy(self, *args, grid, warmup, **kwargs):
        seen.append((self.fn.__name__, where['side'], kwargs))
        if self in ours:                      # recorded only: PDL builds do not run here
            return None
        where['inside'], before = True, where['inside']
        try:
            return run(self, *args, grid=grid, warmup=warmup, **kwargs)
        finally:
            where['inside'] = before

    class Ops(TorchDispatchMode):             # PyTorch's kernels, in launch order
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func.overloadpacket)
            if not where['inside'] and not func.is_view and 'empty' not in name and 'detach' not in name:
                seen.append((name, where['side'], {}))
            return func(*args, **(kwargs or {}))

    patch_chunk(monkeypatch, 'fork', fork)
    patch_chunk(monkeypatch, 'join', join)
    monkeypatch.setattr(torch.cuda, 'stream', stream)
    monkeypatch.setattr(interpreter.InterpretedFunction, 'run', spy)

    varlen, inference = case.startswith('varlen'), not case.startswith('train')
    B, T = (2, 100) if case == 'inference-whole' else (1, 100)
    x = make_inputs(B, T, 2, 4, 32, 48, dtype=torch.float16, normalize_k=False)
    opts = dict(use_qk_l2norm_in_kernel=case != 'inference-plain-segmented', chunk_size=32, output_final_state=True,
                disable_recompute=case == 'train-busy-keep')
    if inference:
        x['beta'] = torch.randn(B, T, 4)      # logits: the side stream forms beta's copy
        opts.update(use_beta_sigmoid_in_kernel=True)
    if varlen:
        opts.update(cu_seqlens=make_cu_seqlens([30, 70]), cu_seqlens_cpu=make_cu_seqlens([30, 70]),
                    return_intermediate_states=True)
    leaves = {n: t.requires_grad_(not inference) for n, t in x.items()}
    with Ops():
        if inference:
            with torch.no_grad():
                chunk_kda(**leaves, **opts)
        else:
            o, ht = chunk_kda(**leaves, **opts)
            (o.float().sum() + ht.sum()).backward()

    launches = [(n, kw) for n, _, kw in seen if n.endswith('_kernel')]
    # Early only in inference with l2norm in the kernel, where the pair products form the norms
    # before their wait; elsewhere they have nothing to do before it (and in training, early,
    # they cost 0.17 ms a step at one shape on the H200: kda/ops/chunk/launch.py, dependent_launch).
    l2norm = opts['use_qk_l2norm_in_kernel']
    early = [n for n, _ in launches if n in STAGE1_KERNELS[1:]] if inference and l2norm else []
    assert [n for n, kw in launches if kw.get('launch_pdl')] == early, launches
    assert all(kw.get('PDL') is (n == STAGE1_KERNELS[0] or inference and l2norm)
               for n, kw in launches if n in STAGE1_KERNELS), launches
    segments = chunk_schedule.forward_segments(B, T, 4, 32, 48, chunk_map.chunk_layout(B, T, 32, None, None),
                                          opts.get('cu_seqlens'), varlen, torch.device('cpu'))
    assert (segments is not None) == case.endswith(('segmented', 'busy', 'keep')), segments
    assert sum(n == 'chunk_pair_fwd_kernel' for n, _ in launches) == len(segments or [0]), launches
    main = [(n, kw) for n, side, kw in seen if not side and n not in ('fork', 'join')]
    for i, (n, kw) in enumerate(main):
        if kw.get('launch_pdl'):
            before, kw_before = main[i - 1] if i else ('nothing', {})
            assert before in STAGE1_KERNELS and kw_before.get('PDL') is True, (n, main[max(0, i - 3):i + 1])


@requires_kernels
def test_bounded_gate_float16():
    """float16 with the lower-bound gate saturated at -5 per step: the forward's factored diagonal
    blocks would need exp(75), far past float16's 65504, so float16 takes the 4-row scheme (with
    the factored path, outputs were NaN). Bound: 4 roundings to float16 (u = 4.9e-4), the size
    of the errors the float16 tests measure for outputs (<= 2.8 u)."""
    B, T, H, HV, K, V = 1, 64, 1, 2, 32, 32
    x = make_inputs(B, T, H, HV, K, V)
    x['g'] = torch.randn(B, T, HV, K)
    x['g'][:, 16:48] = 40.                                  # sigmoid -> 1: steps of -5
    s0 = make_state(B, HV, K, V)
    x16 = {n: t.to(torch.float16).to(KDEV) for n, t in x.items()}
    with torch.no_grad():
        o, ht = chunk_kda(**x16, initial_state=s0.to(KDEV), output_final_state=True,
                          use_gate_in_kernel=True, lower_bound=-5.0, safe_gate=True)
    g = -5.0 * torch.sigmoid(to64(x16['g'].cpu()))
    ro, rht = reference64(x16['q'].cpu(), x16['k'].cpu(), x16['v'].cpu(), g, x16['beta'].cpu(),
                          initial_state=s0)
    u = rel_err(ro.to(torch.float16), ro)
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()
    assert rel_err(o.cpu(), ro) < 4 * u and rel_err(ht.cpu(), rht) < 4 * u


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


# ----------------------------------------------------------------------------------------------
# low precision
# ----------------------------------------------------------------------------------------------

def lowp_bound(err_ref: float, u: float) -> float:
    """Bound for a kernel result in a low-precision dtype.

    ``err_ref``: the error of the reference itself on the same low-precision inputs (the naive
    recurrence computed in float32, its output rounded to the dtype: one rounding).
    ``u``: the size of one rounding to the dtype, ``rel(ref64.to(dtype), ref64)``.
    The kernels round tensor-core dot operands to the input dtype by design (q*e^c, k*e^c,
    h, Aqk, M, beta (v - kg h), v_new, and in the backward the operands of every dot but those of
    the diagonal sub-blocks of the pair-matrix gradients, see chunk_common.DIAG_SPAN): each output
    depends on a chain of ~4-8 such roundings, which add in quadrature (sqrt(8) ~ 2.8 u) and are
    carried a little by the recurrence. Hence ``2 * err_ref + 5 * u``. Observed (fp16,
    interpreter): o <= 2.8 u, final state <= 2.6 u, gradients <= 3.1 u, while the reference's own
    error is ~1 u (o, dq, dk, dv) or ~0 (float32 states, float32 g/beta gradients). A wrong mask,
    decay or chunk boundary gives errors >= 1e-2 .. 1, far above this (fp16: ~1.5e-3, bf16:
    ~1.2e-2). Rounding the backward's diagonal sub-block products to the input dtype fails it
    through dg alone (fp16, interpreter: 7.4 u, bound 5 u; bf16 on the H200: 9 u), as the float16
    case here shows.
    """
    return 2 * err_ref + 5 * u


def check_lowp(dtype, gate_dtype, B, T, H, HV, K, V, chunk_size, grads, device=KDEV, **opts):
    x = make_inputs(B, T, H, HV, K, V, dtype=dtype, gate_dtype=gate_dtype,
                    normalize_k=not opts.get('use_qk_l2norm_in_kernel', False))
    s0 = make_state(B, HV, K, V)
    o, ht, gd, do, dht = run_chunk(x, s0, grads=grads, chunk_size=chunk_size, device=device, **opts)
    ro, rht, rgd = run_ref(x, s0, do, dht, **opts)
    lo, lht, lgd = run_ref(x, s0, do, dht, cast=lambda t: t.detach().clone(), **opts)
    errs = errors(o, ht, gd, ro, rht, rgd)
    ref_errs = errors(lo, lht, {n: v.to(gd[n].dtype) for n, v in lgd.items()}, ro, rht, rgd)
    u = rel_err(ro.to(dtype), ro)
    print(f"\nreference's own {dtype} error: " + ' '.join(f"{n}={e:.1e}" for n, e in ref_errs.items())
          + f" (u={u:.1e})")
    assert_errs(errs, {n: lowp_bound(e, u) for n, e in ref_errs.items()}, f"{dtype} g:{gate_dtype}")
    return errs


@requires_kernels
@pytest.mark.parametrize('dtype', [torch.float16, pytest.param(torch.bfloat16, marks=requires_bf16_kernels)])
@pytest.mark.parametrize('gate_dtype,grads', [(None, False), (torch.float32, True)])
def test_low_precision(dtype, gate_dtype, grads):
    check_lowp(dtype, gate_dtype, 2, 70, 1, 2, 32, 32, chunk_size=64, grads=grads)


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
    x = _dev(make_inputs(B, T, 1, HV, K, V), KDEV)
    x['g'] = x['g'].clone()
    x['g'][0, 40, 1, 3] = bad
    with torch.no_grad():
        o, ht = chunk_kda(**x, chunk_size=32, output_final_state=True)
    ro, _ = reference64(**_dev(x, 'cpu'))
    o = o.cpu()
    assert torch.isnan(o[0, 32:, 1]).all(), "outputs from the bad chunk on must be NaN"
    assert torch.isnan(ht[0, 1]).all(), "the final state of the bad head must be NaN"
    assert rel_err(o[0, :32], ro[0, :32]) < TOL, "outputs before the bad chunk changed"
    assert torch.isfinite(o[0, :, 0]).all() and torch.isfinite(ht[0, 0]).all(), \
        "the other head must be unaffected"


# ----------------------------------------------------------------------------------------------
# agreement with fused_recurrent_kda
# ----------------------------------------------------------------------------------------------

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
    x = _dev(make_inputs(B, T, 1, HV, K, V), KDEV)
    s0 = make_state(N, HV, V, K, state_v_first=True).to(KDEV)
    opts = dict(initial_state=s0, output_final_state=True, cu_seqlens=cu, state_v_first=True)
    with torch.no_grad():
        o_c, ht_c = chunk_kda(**x, chunk_size=32, **opts)
        o_r, ht_r = fused_recurrent_kda(**x, **opts)
    ro, rht = reference64(**_dev(x, 'cpu'), initial_state=s0.cpu(), cu_seqlens=None if cu is None else cu.cpu(),
                          state_v_first=True)
    errs = {'o chunk-vs-recurrent': rel_err(o_c, o_r.cpu()), 'ht chunk-vs-recurrent': rel_err(ht_c, ht_r.cpu()),
            'o chunk': rel_err(o_c, ro), 'o recurrent': rel_err(o_r, ro),
            'ht chunk': rel_err(ht_c, rht), 'ht recurrent': rel_err(ht_r, rht)}
    assert_errs(errs, TOL, f"chunk vs fused_recurrent varlen={varlen}")


# ----------------------------------------------------------------------------------------------
# structure: causality, sequence isolation, every element written, splitting, state-only gradient
# ----------------------------------------------------------------------------------------------

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
        o1, _ = chunk_kda(**_dev(x, KDEV), initial_state=s0.to(KDEV), chunk_size=chunk_size, **opts)
        o2, _ = chunk_kda(**_dev(z, KDEV), initial_state=s0.to(KDEV), chunk_size=chunk_size, **opts)
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
        o1, h1 = chunk_kda(**_dev(x, KDEV), initial_state=s0.to(KDEV), output_final_state=True,
                           cu_seqlens=cu.to(KDEV), chunk_size=32)
        o2, h2 = chunk_kda(**_dev(y, KDEV), initial_state=s0.to(KDEV), output_final_state=True,
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


@requires_kernels
@pytest.mark.parametrize('T,t1,chunk_size', [(70, 37, 32), (70, 45, 64)])
def test_split_sequence(T, t1, chunk_size):
    """One call over [0, T) equals [0, t1) then [t1, T) with the first call's final state as the
    second's initial state (t1 not a multiple of the chunk), for outputs and final state."""
    B, H, HV, K, V = 2, 1, 2, 32, 32
    x = _dev(make_inputs(B, T, H, HV, K, V), KDEV)
    s0 = make_state(B, HV, K, V).to(KDEV)
    with torch.no_grad():
        o, ht = chunk_kda(**x, initial_state=s0, output_final_state=True, chunk_size=chunk_size)
        oa, ha = chunk_kda(**{n: t[:, :t1] for n, t in x.items()}, initial_state=s0,
                           output_final_state=True, chunk_size=chunk_size)
        ob, hb = chunk_kda(**{n: t[:, t1:] for n, t in x.items()}, initial_state=ha,
                           output_final_state=True, chunk_size=chunk_size)
    ro, rht = reference64(**_dev(x, 'cpu'), initial_state=s0.cpu())
    errs = {'o split-vs-one': rel_err(torch.cat([oa, ob], 1), o), 'ht split-vs-one': rel_err(hb, ht),
            'o': rel_err(o, ro), 'ht': rel_err(ht, rht), 'o split': rel_err(torch.cat([oa, ob], 1), ro)}
    assert_errs(errs, TOL, f"split T={T} at {t1}")


@requires_kernels
@pytest.mark.parametrize('lengths', [None, [0, 1, 19, 25]])
def test_gradient_through_final_state_only(lengths):
    """loss = (ht * dht).sum(): o is unused, its gradient arrives as zeros."""
    cu = None if lengths is None else lengths_to_cu(lengths)
    B, T = (2, 45) if lengths is None else (1, sum(lengths))
    N = B if lengths is None else len(lengths)
    HV, K, V = 2, 32, 32
    x = make_inputs(B, T, 1, HV, K, V)
    s0 = make_state(N, HV, K, V)
    o, ht, gd, do, dht = run_chunk(x, s0, cu_seqlens=cu, chunk_size=32, use_o=False)
    assert do is None
    ro, rht, rgd = run_ref(x, s0, None, dht, cu_seqlens=cu)
    errs = errors(o, ht, gd, ro, rht, rgd)
    assert_errs(errs, TOL, f"state-only gradient lengths={lengths}")


# ----------------------------------------------------------------------------------------------
# return_intermediate_states, disable_recompute, non-contiguous inputs
# ----------------------------------------------------------------------------------------------

@pytest.fixture(params=['kernels', 'torch'])
def states_path(request, monkeypatch):
    """The device of a return_intermediate_states test: the kernels' (skipped where they cannot
    run), or the CPU with the kernels disabled (the PyTorch path, chunk_kda_reference)."""
    if request.param == 'torch':
        forbid_chunk_kernels(monkeypatch)
        return 'cpu'
    if not (HAS_CUDA or INTERPRET):
        pytest.skip("the kernels need a GPU or TRITON_INTERPRET=1")
    return KDEV


@pytest.mark.parametrize('state_v_first,with_h0', [(False, True), (True, True), (False, False)])
def test_intermediate_states(states_path, state_v_first, with_h0):
    B, T, H, HV, K, V, BT = 2, 70, 1, 2, 32, 16, 32
    KDEV = states_path
    x = _dev(make_inputs(B, T, H, HV, K, V), KDEV)
    s0 = make_state(B, HV, K, V, state_v_first=state_v_first).to(KDEV) if with_h0 else None
    opts = dict(initial_state=s0, output_final_state=True, chunk_size=BT, state_v_first=state_v_first)
    with torch.no_grad():
        o, ht, h = chunk_kda(**x, return_intermediate_states=True, **opts)
        o2, ht2 = chunk_kda(**x, **opts)
    NT = math.ceil(T / BT)
    assert h.shape == ((B, NT, HV, V, K) if state_v_first else (B, NT, HV, K, V))
    assert h.dtype == torch.float32
    assert torch.equal(o, o2) and torch.equal(ht, ht2)
    h0 = s0 if with_h0 else torch.zeros_like(h[:, 0])
    assert torch.equal(h[:, 0], h0), "chunk 0 must hold the initial state"
    for c in range(1, NT):
        _, ref = reference64(**{n: t[:, :c * BT].cpu() for n, t in x.items()},
                             initial_state=None if s0 is None else s0.cpu(), state_v_first=state_v_first)
        e = rel_err(h[:, c], ref)
        print(f"\nchunk {c}: rel err {e:.1e}")
        assert e < TOL, f"state entering chunk {c}: rel err {e:.3e}"


@pytest.mark.parametrize('B,T', [(0, 5), (2, 0)])
def test_intermediate_states_empty(states_path, B, T):
    """No batch rows, or no tokens: o [B, T, HV, V], the final state the initial one, h [B,
    cdiv(T, BT), HV, K, V]. B = 0 raised on both paths (the launcher viewed h as [B, -1, ...];
    the reference stacked no sequences)."""
    HV, K, V = 2, 16, 8
    x = _dev(make_inputs(B, T, 1, HV, K, V), states_path)
    s0 = make_state(B, HV, K, V).to(states_path)
    with torch.no_grad():
        o, ht, h = chunk_kda(**x, initial_state=s0, output_final_state=True, chunk_size=32,
                             return_intermediate_states=True)
    assert o.shape == (B, T, HV, V) and torch.equal(ht, s0)
    assert h.shape == (B, -(-T // 32), HV, K, V) and h.dtype == torch.float32


def test_intermediate_states_varlen(states_path):
    lengths, BT, HV, K, V = [0, 1, 19, 40], 32, 2, 16, 32
    KDEV = states_path
    cu = lengths_to_cu(lengths)
    x = make_inputs(1, sum(lengths), 1, HV, K, V)
    s0 = make_state(len(lengths), HV, K, V)
    with torch.no_grad():
        o, ht, h = chunk_kda(**_dev(x, KDEV), initial_state=s0.to(KDEV), output_final_state=True,
                             cu_seqlens=cu.to(KDEV), chunk_size=BT, return_intermediate_states=True)
    # chunks: sequence 1 (1 token), sequence 2 (19), sequence 3 (40: two chunks); none for the empty one
    assert h.shape == (1, 4, HV, K, V)
    assert torch.equal(h[0, 0], s0[1].to(h.device))
    assert torch.equal(h[0, 1], s0[2].to(h.device))
    assert torch.equal(h[0, 2], s0[3].to(h.device))
    b = cu[3].item()
    _, ref = reference64(**{n: t[:, b:b + BT] for n, t in x.items()}, initial_state=s0[3:4])
    e = rel_err(h[0, 3], ref[0])
    assert e < TOL, f"second chunk of sequence 3: rel err {e:.3e}"


def test_intermediate_states_need_inference():
    x = make_inputs(1, 8, 1, 1, 16, 16)
    x['q'].requires_grad_()
    with pytest.raises(ValueError, match='return_intermediate_states'):
        chunk_kda(**x, return_intermediate_states=True)
    s0 = make_state(1, 1, 16, 16).requires_grad_()
    y = make_inputs(1, 8, 1, 1, 16, 16)
    with pytest.raises(ValueError, match='return_intermediate_states'):
        chunk_kda(**y, initial_state=s0, return_intermediate_states=True)


@requires_kernels
def test_intermediate_states_allowed_under_no_grad_with_grad_leaves():
    x = _dev(make_inputs(1, 40, 1, 1, 16, 16), KDEV)
    x['q'].requires_grad_()
    with torch.no_grad():
        o, _, h = chunk_kda(**x, chunk_size=32, return_intermediate_states=True)
    assert h.shape == (1, 2, 1, 16, 16)


@requires_kernels
@pytest.mark.parametrize('config', ['plain', 'kimi'])
def test_disable_recompute_same_gradients(config):
    """disable_recompute=True gives the default path's outputs and gradients bit for bit (its
    forward forms stage 1's per-token tensors again with the backward's build of the cumsum
    kernel, whose scan may round c differently from the forward's on a GPU). 'kimi': the raw gate
    with A_log, dt_bias and the lower bound, beta logits, q/k l2norm (GVA, varlen)."""
    lengths = [0, 1, 19, 45]
    cu = lengths_to_cu(lengths)
    x = make_inputs(1, sum(lengths), 1, 2, 32, 32, normalize_k=config == 'plain')
    s0 = make_state(len(lengths), 2, 32, 32)
    opts = dict(chunk_size=32)
    if config == 'kimi':
        x['g'] = torch.randn(x['g'].shape)
        x['beta'] = torch.randn(x['beta'].shape)
        opts.update(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, safe_gate=True, lower_bound=-5.0,
                    A_log=torch.log(1 + 15 * torch.rand(2)).to(KDEV), dt_bias=(0.1 * torch.randn(64)).to(KDEV),
                    use_beta_sigmoid_in_kernel=True)
    o1, h1, g1, do, dht = run_chunk(x, s0, cu_seqlens=cu, **opts)
    o2, h2, g2, _, _ = run_chunk(x, s0, cu_seqlens=cu, do=do, dht=dht, disable_recompute=True, **opts)
    assert torch.equal(o1, o2) and torch.equal(h1, h2)
    for n in g1:
        assert torch.equal(g1[n], g2[n]), f"d{n} differs with disable_recompute=True"
    if config == 'plain':
        ro, rht, rgd = run_ref(x, s0, do, dht, cu_seqlens=cu)
        assert_errs(errors(o2, h2, g2, ro, rht, rgd), TOL, "disable_recompute")


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
    base = _dev(make_inputs(B, T, H, HV, K, V), KDEV)
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
    x = _dev(make_inputs(1, T, 1, HV, K, V), KDEV)
    with torch.no_grad():
        o1, h1 = chunk_kda(**x, cu_seqlens=strided.to(KDEV), output_final_state=True, chunk_size=32)
        o2, h2 = chunk_kda(**x, cu_seqlens=cu.to(KDEV), output_final_state=True, chunk_size=32)
    assert torch.equal(o1, o2) and torch.equal(h1, h2), "a strided cu_seqlens changed the result"


# ----------------------------------------------------------------------------------------------
# the PyTorch path (CPU without the interpreter)
# ----------------------------------------------------------------------------------------------

def test_torch_path(monkeypatch):
    """With the kernels disabled the chunked reference algorithm serves the call (any mode)."""
    forbid_chunk_kernels(monkeypatch)
    lengths = [0, 1, 19, 25]
    cu = lengths_to_cu(lengths)
    x = make_inputs(1, sum(lengths), 1, 2, 32, 24)
    s0 = make_state(len(lengths), 2, 32, 24, state_v_first=True)
    for bt in (32, 64):
        o, ht, gd, do, dht = run_chunk(x, s0, cu_seqlens=cu, chunk_size=bt, state_v_first=True, device='cpu')
        ro, rht, rgd = run_ref(x, s0, do, dht, cu_seqlens=cu, state_v_first=True)
        assert_errs(errors(o, ht, gd, ro, rht, rgd), TOL, f"torch path BT={bt}")


@pytest.mark.skipif(not INTERPRET, reason="the interpreter's bf16 route")
def test_bf16_in_the_interpreter_takes_the_pytorch_path(monkeypatch):
    """bf16 under TRITON_INTERPRET=1: the interpreter's bf16 dot is wrong (triton#11584), so the
    PyTorch path must serve the call, forward and backward, within the error that the reference
    itself has in bf16 (the kernels returned finite garbage there, relative error ~3e11)."""
    forbid_chunk_kernels(monkeypatch, disable=False)
    x = make_inputs(1, 40, 1, 2, 16, 16, dtype=torch.bfloat16)
    s0 = make_state(1, 2, 16, 16)
    o, ht = chunk_kda(**x, initial_state=s0, output_final_state=True, chunk_size=32)
    ro, rht = reference64(**x, initial_state=s0)
    bo, bht = naive_recurrent_kda(**x, initial_state=s0, output_final_state=True)
    assert rel_err(o, ro) <= 2 * rel_err(bo, ro) and rel_err(ht, rht) <= 2 * rel_err(bht, rht) + 1e-6
    q = x['q'].clone().requires_grad_()
    o, _ = chunk_kda(**dict(x, q=q), initial_state=s0, chunk_size=32)
    o.float().sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


# ----------------------------------------------------------------------------------------------
# validation of chunk_kda's arguments (no kernel may run on bad input)
# ----------------------------------------------------------------------------------------------

@pytest.fixture
def no_compute(monkeypatch):
    def must_not_run(*a, **kw):
        raise AssertionError("computation started on invalid input")

    patch_chunk(monkeypatch, 'chunk_kda_fwd', must_not_run)
    patch_chunk(monkeypatch, 'chunk_kda_reference', must_not_run)
    monkeypatch.setattr(chunk_function.ChunkKDAFunction, 'apply', must_not_run)


@pytest.mark.parametrize('chunk_size', [16, 128, 48, 0, -64, True, 64.0, '64', None])
def test_bad_chunk_size(no_compute, chunk_size):
    x = make_inputs(1, 8, 1, 1, 16, 16)
    with pytest.raises(ValueError, match='chunk_size'):
        chunk_kda(**x, chunk_size=chunk_size)


def test_shared_validation(no_compute):
    """chunk_kda validates through the same checks as fused_recurrent_kda."""
    x = make_inputs(1, 20, 1, 2, 16, 8)
    with pytest.raises(ValueError, match='cu_seqlens'):
        chunk_kda(**x, cu_seqlens=make_cu_seqlens([5, 10]))                 # ends at 15, not T = 20
    with pytest.raises(ValueError, match='cu_seqlens'):
        chunk_kda(**x, cu_seqlens=torch.tensor([0, 12, 8, 20]))             # decreasing
    with pytest.raises(ValueError, match="cu_seqlens_cpu must hold cu_seqlens' values"):
        # On the CPU cu_seqlens is read too, so a well-formed host copy cannot hide it.
        chunk_kda(**x, cu_seqlens=torch.tensor([0, 12, 8, 20]), cu_seqlens_cpu=make_cu_seqlens([8, 4, 8]))
    with pytest.raises(ValueError, match='initial_state'):
        chunk_kda(**x, cu_seqlens=make_cu_seqlens([5, 15]), initial_state=make_state(1, 2, 16, 8))
    with pytest.raises(ValueError, match='initial_state'):
        chunk_kda(**x, initial_state=make_state(1, 2, 16, 8), state_v_first=True, output_final_state=True)
    y = make_inputs(2, 20, 1, 2, 16, 8)
    with pytest.raises(ValueError, match='B = 1'):
        chunk_kda(**y, cu_seqlens=make_cu_seqlens([5, 15]))
    with pytest.raises(ValueError, match='HV'):
        chunk_kda(**dict(x, v=torch.randn(1, 20, 3, 8)))
    with pytest.raises(TypeError, match='disable_recompute'):
        chunk_kda(**x, disable_recompute=1)
    with pytest.raises(TypeError, match='return_intermediate_states'):
        chunk_kda(**x, return_intermediate_states='yes')


# ----------------------------------------------------------------------------------------------
# CUDA at real sizes
# ----------------------------------------------------------------------------------------------

def _model_inputs(B, T, H, K, V, dtype, l2=False, device='cuda'):
    """Model-like inputs: q, k Gaussian (unit-norm k unless l2norm runs in the kernel),
    g = logsigmoid(x + 2) in float32 (log-decays in (-inf, 0), mostly -0.02 .. -1), beta = sigmoid(x)."""
    q = torch.randn(B, T, H, K)
    k = torch.randn(B, T, H, K)
    if not l2:
        k = k / k.norm(dim=-1, keepdim=True)
    v = torch.randn(B, T, H, V)
    g = F.logsigmoid(torch.randn(B, T, H, K) + 2.0)
    beta = torch.sigmoid(torch.randn(B, T, H))
    return dict(q=q.to(dtype).to(device), k=k.to(dtype).to(device), v=v.to(dtype).to(device),
                g=g.float().to(device), beta=beta.to(dtype).to(device))


def _no_grad_ref(x, h0, cu=None, l2=False, dtype=torch.float64):
    with torch.no_grad():
        return naive_recurrent_kda(**{n: t.to(dtype) for n, t in x.items()},
                                   initial_state=None if h0 is None else h0.to(dtype),
                                   output_final_state=True, cu_seqlens=cu, use_qk_l2norm_in_kernel=l2)


def check_real_sizes(dtype, H, K, V, B=None, T=None, lengths=None, device='cuda'):
    """Low-precision forward and backward at model sizes (fixed length B x T, or varlen
    ``lengths`` with l2norm in the kernel):

    * forward against the float64 oracle, bound ``lowp_bound`` from the reference's own error;
    * the same inputs in float32 through the kernels held to 1e-4 (ieee fp32 dots, no tf32: tf32
      alone would give errors ~5e-4);
    * the backward finite and close to the float32 kernels' gradients (which stand in for the
      oracle: no float64 autograd at this size; the reference's own low-precision gradient error is
      <= ~1 u, so the bound is ``lowp_bound(u, u)``)."""
    l2 = lengths is not None
    if l2:
        cu = make_cu_seqlens(lengths, device=device)
        B, T, N = 1, sum(lengths), len(lengths)
    else:
        cu, N = None, B
    x = _model_inputs(B, T, H, K, V, dtype, l2=l2, device=device)
    h0 = (0.5 * torch.randn(N, H, K, V)).to(device)
    leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
    o, ht = chunk_kda(**leaves, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                      use_qk_l2norm_in_kernel=l2)
    ro, rht = _no_grad_ref(x, h0, cu, l2)
    lo, lht = _no_grad_ref(x, h0, cu, l2, dtype=torch.float32)
    u = rel_err(ro.to(dtype), ro)
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()
    assert_errs({'o': rel_err(o, ro), 'ht': rel_err(ht, rht)},
                {'o': lowp_bound(rel_err(lo.to(dtype), ro), u), 'ht': lowp_bound(rel_err(lht, rht), u)},
                f"{dtype} model sizes lengths={lengths}")

    x32 = {n: t.float().requires_grad_() for n, t in x.items()}
    o32, ht32 = chunk_kda(**x32, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                          use_qk_l2norm_in_kernel=l2)
    assert_errs({'o': rel_err(o32, ro), 'ht': rel_err(ht32, rht)}, 1e-4, "float32 inputs, model sizes")

    do = torch.randn_like(o32)
    dht = torch.randn_like(ht32)
    names = list(x)
    gl = torch.autograd.grad((o.float() * do).sum() + (ht * dht).sum(), [leaves[n] for n in names])
    g32 = torch.autograd.grad((o32 * do).sum() + (ht32 * dht).sum(), [x32[n] for n in names])
    gerrs = {}
    for n, a, b in zip(names, gl, g32):
        assert torch.isfinite(a).all(), f"d{n} not finite"
        gerrs['d' + n] = rel_err(a, b)
    assert_errs(gerrs, lowp_bound(u, u), f"{dtype} gradients vs float32 kernels")


def compare_with_float64(leaves, run, reference, dtype, fp32_tol, what, low_cast):
    """``run(leaves) -> (o, final_state)``: the outputs, final state and the gradient of every leaf
    against float64 autograd through ``reference(cast leaves) -> (o, final_state)``. float32:
    within ``fp32_tol``; low precision: within ``lowp_bound`` of the reference's own error, that
    of ``reference`` on the leaves cast by ``low_cast`` (the same inputs, computed in float32)."""
    o, ht = run(leaves)
    do = torch.randn_like(o, dtype=torch.float32)
    dht = torch.randn_like(ht)
    names = list(leaves)
    gk = torch.autograd.grad((o.float() * do).sum() + (ht * dht).sum(), [leaves[n] for n in names])

    def ref(cast):
        L = {n: cast(t).detach().requires_grad_() for n, t in leaves.items()}
        ro, rht = reference(L)
        gr = torch.autograd.grad((ro.to(rht.dtype) * cast(do)).sum() + (rht * cast(dht)).sum(),
                                 [L[n] for n in names])
        return ro.detach(), rht.detach(), dict(zip(names, gr))

    ro, rht, rg = ref(lambda t: t.double())
    errs = errors(o, ht, dict(zip(names, gk)), ro, rht, rg)
    if dtype == torch.float32:
        assert_errs(errs, fp32_tol, what)
        return
    lo, lht, lg = ref(low_cast)
    ref_errs = errors(lo, lht, {n: lg[n].to(leaves[n].dtype) for n in names}, ro, rht, rg)
    u = rel_err(ro.to(dtype), ro)
    assert_errs(errs, {n: lowp_bound(e, u) for n, e in ref_errs.items()}, what)


def check_gradients_vs_float64(dtype, B, T, H, HV, K, V, device='cuda'):
    """Gradients of every input against float64 autograd through the naive recurrence."""
    x = _model_inputs(B, T, HV, K, V, dtype, device=device)
    x['q'], x['k'] = x['q'][:, :, :H].contiguous(), x['k'][:, :, :H].contiguous()
    h0 = (0.5 * torch.randn(B, HV, K, V)).to(device)
    leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
    leaves['initial_state'] = h0.clone().requires_grad_()
    compare_with_float64(
        leaves, lambda L: chunk_kda(**L, output_final_state=True),
        lambda L: naive_recurrent_kda(**L, output_final_state=True), dtype, 1e-4,
        f"{dtype} gradients vs float64", low_cast=lambda t: t.clone())


@requires_cuda
def test_cuda_bf16_real_sizes():
    """bf16, B=8, T=4096, H=16, K=V=128."""
    check_real_sizes(torch.bfloat16, H=16, K=128, V=128, B=8, T=4096)


@requires_cuda
def test_cuda_bf16_varlen_real_sizes():
    """bf16 varlen: 8 mixed lengths (8192 tokens; partial chunks, a 1-token sequence), H=16,
    K=V=128, l2norm in the kernel."""
    check_real_sizes(torch.bfloat16, H=16, K=128, V=128, lengths=[1, 63, 64, 65, 500, 1000, 2437, 4062])


@requires_cuda
@pytest.mark.parametrize('B,H,T', [(1, 2, 1000), (8, 16, 200)])
def test_cuda_bf16_head_dim_256(B, H, T):
    """bf16 at K = 256 (value slices of at most 32 in the state sweeps; two pipeline stages for the
    carry and the gradient sweep, which faulted on the H200 with the one this shape used to get),
    with few programs (B = 1, H = 2) and with many."""
    check_real_sizes(torch.bfloat16, H=H, K=256, V=128, B=B, T=T)


@requires_cuda
@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float32])
def test_cuda_gradients(dtype):
    """B=2, T=512, GVA (H=2 q/k heads, HV=4), K=V=128, against float64 autograd."""
    check_gradients_vs_float64(dtype, B=2, T=512, H=2, HV=4, K=128, V=128)


def on_a_user_stream(fn):
    """``fn()`` called from a new stream of the caller's, whose freed memory is overwritten with NaN
    right after (what a launch left running on a side stream would still read)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        out = fn()
        torch.full((64 << 20,), float('nan'), device='cuda')
    torch.cuda.current_stream().wait_stream(stream)
    return out


@requires_cuda
def test_cuda_backward_on_a_user_stream():
    """Few programs (B = 1, HV = 2): the backward forks its carry onto a side stream
    (``kda.ops.utils.fork``). Run from a stream of the caller's, with that stream's memory reused
    right after, the gradients are the default stream's, bit for bit."""
    x = make_inputs(1, 700, 2, 2, 64, 64, dtype=torch.bfloat16, device='cuda')
    h0 = make_state(1, 2, 64, 64, device='cuda')

    def grads():
        leaves = {n: t.detach().clone().requires_grad_() for n, t in x.items()}
        state = h0.clone().requires_grad_()
        o, ht = chunk_kda(**leaves, initial_state=state, output_final_state=True, chunk_size=64)
        (o.float().square().sum() + ht.square().sum()).backward()
        return [t.grad.clone() for t in (*leaves.values(), state)]

    assert chunk_launch.transposed_sweeps(1, 2, 64, 64, torch.device('cuda'), torch.bfloat16)
    expected = grads()
    for a, b in zip(on_a_user_stream(grads), expected):
        assert torch.equal(a, b)


@requires_cuda
@pytest.mark.parametrize('busy', [False, True])
def test_cuda_segmented_forward_on_a_user_stream(monkeypatch, busy):
    """One sequence with few sweep programs (B = 1, HV = 4, K = V = 128, bf16): the forward runs
    in time segments, each sweep on a side stream beside the next segment's stage 1. Its outputs
    and final state are the one-pass forward's bit for bit, also when called from a stream of the
    caller's whose memory is reused right after. (Segmented at this length, which the launcher
    leaves whole, SEGMENT_MIN_TOKEN_HEADS.) 'busy': 12 SMs claimed, which the sweep's 8 programs
    leave busy: the cumsum over the whole sequence first, then 3 segments."""
    patch_chunk(monkeypatch, 'SEGMENT_MIN_TOKEN_HEADS', 0)
    if busy:
        patch_chunk(monkeypatch, 'sm_count', lambda device: 12)
    assert chunk_schedule.busy_sweep(4, 128, 128, torch.device('cuda')) == busy
    x = make_inputs(1, 3000, 4, 4, 128, 128, dtype=torch.bfloat16, device='cuda')
    h0 = make_state(1, 4, 128, 128, device='cuda')

    def forward():
        with torch.no_grad():
            return chunk_kda(**x, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)

    layout = chunk_map.chunk_layout(1, 3000, 64, None, None)
    assert chunk_schedule.forward_segments(1, 3000, 4, 128, 128, layout, None, False,
                                      torch.device('cuda')) is not None
    got = on_a_user_stream(forward)
    patch_chunk(monkeypatch, 'forward_segments', lambda *a: None)
    for a, b in zip(got, forward()):
        assert torch.equal(a, b)


@requires_cuda
@pytest.mark.parametrize('mode', ['forward', 'training', 'forward-busy'])
def test_cuda_graph_capture(monkeypatch, mode):
    """Few programs (B = 1, HV = 4): the forward in time segments (at a length the launcher would
    leave whole, SEGMENT_MIN_TOKEN_HEADS) and the backward's forked carry both launch on a side
    stream. Captured in a CUDA graph (a forward under no_grad, or a whole forward + backward) and
    replayed after new inputs are copied in, the results equal the eager ones bit for bit.
    'busy': 12 SMs claimed (``busy_sweep``: the cumsum over the whole sequence first)."""
    patch_chunk(monkeypatch, 'SEGMENT_MIN_TOKEN_HEADS', 0)
    if mode.endswith('busy'):
        patch_chunk(monkeypatch, 'sm_count', lambda device: 12)
        mode = mode.removesuffix('-busy')
    T, H, K, V = 1500, 4, 128, 128
    layout = chunk_map.chunk_layout(1, T, 64, None, None)
    assert chunk_schedule.forward_segments(1, T, H, K, V, layout, None, False, torch.device('cuda')) is not None
    x = make_inputs(1, T, H, H, K, V, dtype=torch.bfloat16, device='cuda')
    leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
    state = make_state(1, H, K, V, device='cuda').requires_grad_()
    do = torch.randn(1, T, H, V, dtype=torch.bfloat16, device='cuda')
    dht = torch.randn(1, H, K, V, device='cuda')

    def step(xs, h0):
        if mode == 'forward':
            with torch.no_grad():
                return list(chunk_kda(**xs, initial_state=h0, output_final_state=True,
                                      use_qk_l2norm_in_kernel=True))
        o, ht = chunk_kda(**xs, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
        torch.autograd.backward((o, ht), (do, dht))
        return [o, ht] + [t.grad for t in (*xs.values(), h0)]

    side = torch.cuda.Stream()                       # warm up (compile) outside the capture
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(leaves, state)
    torch.cuda.current_stream().wait_stream(side)
    for t in (*leaves.values(), state):
        t.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step(leaves, state)

    for trial in range(2):
        new = make_inputs(1, T, H, H, K, V, dtype=torch.bfloat16, device='cuda')
        h0 = make_state(1, H, K, V, device='cuda')
        with torch.no_grad():
            for name, t in leaves.items():
                t.copy_(new[name])
            state.copy_(h0)
        graph.replay()
        torch.cuda.synchronize()
        eager = step({n: t.clone().requires_grad_() for n, t in new.items()}, h0.clone().requires_grad_())
        for i, (a, b) in enumerate(zip(captured, eager)):
            assert torch.equal(a, b), f"trial {trial}: output {i} of the replay differs from eager"


@requires_cuda
def test_cuda_graph_capture_creates_the_side_stream(monkeypatch):
    """The inference forward's beta stream (``fork``, at SEGMENT_MIN_TOKEN_HEADS and above)
    created for the first time inside a CUDA graph capture: B = 2, not segmented, so that no
    earlier call of this shape used a side stream (the cached stream is dropped before the
    capture). The replay, after new inputs are copied in, equals eager bit for bit."""
    from kda.ops import utils
    patch_chunk(monkeypatch, 'SEGMENT_MIN_TOKEN_HEADS', 0)
    B, T, H, K, V = 2, 300, 4, 64, 64
    layout = chunk_map.chunk_layout(B, T, 64, None, None)
    assert chunk_schedule.forward_segments(B, T, H, K, V, layout, None, False, torch.device('cuda')) is None
    x = make_inputs(B, T, H, H, K, V, dtype=torch.bfloat16, device='cuda', normalize_k=False)
    x['beta'] = torch.randn(B, T, H, dtype=torch.bfloat16, device='cuda')      # logits

    def forward(xs):
        with torch.no_grad():
            return chunk_kda(**xs, use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                             output_final_state=True)

    warm = torch.cuda.Stream()                       # compile outside the capture
    warm.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warm):
        forward(x)
    torch.cuda.current_stream().wait_stream(warm)
    torch.cuda.synchronize()
    utils._side_stream.cache_clear()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = forward(x)
    for trial in range(2):
        new = make_inputs(B, T, H, H, K, V, dtype=torch.bfloat16, device='cuda', normalize_k=False)
        new['beta'] = torch.randn(B, T, H, dtype=torch.bfloat16, device='cuda')
        for name, t in x.items():
            t.copy_(new[name])
        graph.replay()
        torch.cuda.synchronize()
        for i, (a, b) in enumerate(zip(captured, forward(new))):
            assert torch.equal(a, b), f"trial {trial}: output {i} of the replay differs from eager"


@requires_cuda
def test_cuda_graph_capture_varlen_map():
    """A varlen forward captured in a CUDA graph on the stream where an eager call with the same
    bounds just ran (which keeps its chunk map, ``chunk_layout``): the capture builds a map of its
    own, so an eager call with other bounds (which replaces the kept map and frees it) and memory
    overwritten after it leave the replay's outputs those of the eager call."""
    T, H = 1500, 4
    x = make_inputs(1, T, H, H, 64, 64, dtype=torch.bfloat16, device='cuda')
    cu, other = torch.tensor([0, 300, 1300, 1500]), torch.tensor([0, 700, 1500])
    cu_dev, other_dev = cu.cuda(), other.cuda()

    def forward(bounds, bounds_dev):
        # cu_seqlens_cpu: no read-back of the bounds (a sync, which a capture refuses).
        with torch.no_grad():
            return chunk_kda(**x, cu_seqlens=bounds_dev, cu_seqlens_cpu=bounds, output_final_state=True,
                             use_qk_l2norm_in_kernel=True)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        eager = forward(cu, cu_dev)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            captured = forward(cu, cu_dev)
    torch.cuda.current_stream().wait_stream(stream)
    forward(other, other_dev)
    torch.full((64 << 20,), -1, dtype=torch.int32, device='cuda')
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(captured, eager):
        assert torch.equal(a, b)


def check_kimi_gate_gradients(dtype, B, T, H, K, V, device):
    """The Kimi Linear configuration (q/k l2norm, raw gate with A_log, dt_bias and the lower-bound
    gate, beta logits): outputs, final state and the gradients of every input (A_log, dt_bias,
    the raw gate and the beta logits included) against float64 autograd through the naive
    recurrence on the activations written out here; bounds as in check_gradients_vs_float64."""
    raw = dict(q=torch.randn(B, T, H, K), k=torch.randn(B, T, H, K), v=torch.randn(B, T, H, V),
               g=torch.randn(B, T, H, K), beta=2 * torch.randn(B, T, H))
    leaves = {n: t.to(dtype).to(device).requires_grad_() for n, t in raw.items()}
    leaves['A_log'] = torch.log(1 + 15 * torch.rand(H)).to(device).requires_grad_()
    leaves['dt_bias'] = (0.1 * torch.randn(H * K)).to(device).requires_grad_()
    leaves['initial_state'] = (0.5 * torch.randn(B, H, K, V)).to(device).requires_grad_()

    def run(L):
        return chunk_kda(**L, output_final_state=True, use_qk_l2norm_in_kernel=True,
                         use_gate_in_kernel=True, safe_gate=True, lower_bound=-5.0,
                         use_beta_sigmoid_in_kernel=True)

    def reference(L):
        z = L['A_log'].exp()[:, None] * (L['g'] + L['dt_bias'].view(H, K))
        return naive_recurrent_kda(L['q'], L['k'], L['v'], -5.0 * torch.sigmoid(z),
                                   torch.sigmoid(L['beta']), initial_state=L['initial_state'],
                                   output_final_state=True, use_qk_l2norm_in_kernel=True)

    compare_with_float64(leaves, run, reference, dtype, TOL if device == 'cpu' else 1e-4,
                         f"Kimi gate, {dtype}", low_cast=lambda t: t.float())


@requires_kernels
def test_kimi_gate_gradients_small():
    """check_kimi_gate_gradients in float32 at a small size (the interpreter's version of the
    CUDA test below)."""
    check_kimi_gate_gradients(torch.float32, 1, 80, 2, 32, 32, KDEV)


@requires_cuda
def test_cuda_kimi_gate_bf16():
    """The production configuration in bf16 (the bounded gate's factored diagonal blocks),
    B=2, T=1024, H=4, K=V=128."""
    check_kimi_gate_gradients(torch.bfloat16, 2, 1024, 4, 128, 128, 'cuda')


@requires_kernels
@pytest.mark.parametrize('dtype', [torch.float32, torch.float16])
@pytest.mark.parametrize('gate', [False, True])
def test_saved_for_backward(gate, dtype):
    """What a training call keeps for its backward beyond its inputs, in units of one float32
    [B, T, HV, K] tensor: the normalized q and k in the input dtype, in place of the raw q and k
    (which it does not keep: memory-neutral where nothing else holds them, as in a model whose
    q and k come from a projection; where the caller keeps q and k alive, two more such tensors
    live from forward to backward), and their inverse norms (2 / K); beta in float32 (1 / K)
    where that is not the input itself: the activated beta with the in-kernel gate, and the
    float32 copy of a 16-bit beta that the kernels read (``chunk_kda``); and
    the in-chunk matrices Aqk and M (input dtype) and A' (float32), BT entries a token each; nothing
    [.., K]- or state-sized (c, the decayed keys and queries and the states are recomputed;
    FLA 0.6.0 keeps c), and
    nothing of the gate, which the kernels activate themselves (as PyTorch ops under autograd it
    kept 3 units: the activated log-decay and two intermediates, which lifted the H200 training
    peak from 0.78x to 0.88x FLA's)."""
    B, T, H, K, V = 1, 64, 2, 32, 32
    x = make_inputs(B, T, H, H, K, V, dtype=dtype, normalize_k=False)
    opts = dict(use_qk_l2norm_in_kernel=True)
    if gate:
        x['g'] = torch.randn(B, T, H, K, dtype=dtype)
        opts.update(use_gate_in_kernel=True, safe_gate=True, lower_bound=-5.0,
                    use_beta_sigmoid_in_kernel=True)
    leaves = {n: t.to(KDEV).requires_grad_() for n, t in x.items()}
    if gate:
        leaves['A_log'] = torch.zeros(H, device=KDEV, requires_grad=True)
        leaves['dt_bias'] = torch.zeros(H * K, device=KDEV, requires_grad=True)
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        o, _ = chunk_kda(**leaves, **opts)
    inputs = {t.untyped_storage().data_ptr() for t in leaves.values()}
    units = sum(n for p, n in saved.items() if p not in inputs) / (B * T * H * K * 4)
    BT = 64
    itemsize = x['q'].element_size()
    beta_copy = gate or x['beta'].dtype != torch.float32
    expected = 2 * itemsize / 4 + 2 / K + (1 / K if beta_copy else 0) + BT * (2 * itemsize + 4) / (4 * K)
    assert abs(units - expected) < 0.01, f"saved {units:.3f} units for backward, expected {expected:.3f}"
    raw = {leaves[n].untyped_storage().data_ptr() for n in ('q', 'k')}
    assert not raw & saved.keys(), "the raw q and k are kept beside the normalized ones"
    o.sum().backward()                       # the graph is usable


@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET or torch.cuda.device_count() < 2,
                    reason="needs two CUDA devices")
def test_cuda_tensors_on_a_device_not_current(monkeypatch):
    """Tensors on cuda:1 while cuda:0 is the current device (Triton launches on the current
    device: ``on_q_device`` makes q's current for the call): chunk_kda's inference forward (in
    time segments, forced, so with the norms and the sweeps on a side stream) and its forward +
    backward, and a fused_recurrent_kda step, give on cuda:1 the bits they give on cuda:0, and
    leave cuda:0 current."""
    patch_chunk(monkeypatch, 'SEGMENT_MIN_TOKEN_HEADS', 0)
    x0 = make_inputs(1, 300, 4, 4, 128, 128, dtype=torch.bfloat16, device='cuda:0', normalize_k=False)
    h0 = make_state(1, 4, 128, 128, device='cuda:0')

    def run(xs, state):
        with torch.no_grad():
            o, ht = chunk_kda(**xs, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
            od, hd = fused_recurrent_kda(**{n: t[:, :1] for n, t in xs.items()}, initial_state=state,
                                         output_final_state=True, use_qk_l2norm_in_kernel=True)
        leaves = {n: t.clone().requires_grad_() for n, t in xs.items()}
        ot, htt = chunk_kda(**leaves, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
        (ot.float().square().sum() + htt.sum()).backward()
        return [o, ht, od, hd, ot, htt] + [t.grad for t in leaves.values()]

    torch.cuda.set_device(0)
    expected = run(x0, h0)
    got = run({n: t.to('cuda:1') for n, t in x0.items()}, h0.to('cuda:1'))
    torch.cuda.synchronize('cuda:1')
    assert torch.cuda.current_device() == 0
    for a, b in zip(expected, got):
        assert b.device == torch.device('cuda:1') and torch.equal(a, b.to('cuda:0'))
