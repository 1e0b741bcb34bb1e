"""Helpers of the ``chunk_kda`` tests (``tests/chunk/``), against the float64 oracle.

Small-shape tests run the real Triton kernels: on CPU tensors through the interpreter
(``TRITON_INTERPRET=1``), or on CUDA tensors when a GPU is present (``KDEV`` below); they are
skipped when neither is available (``requires_kernels``). The reference is always
``naive_recurrent_kda`` in float64 on the CPU, and results are compared by the relative error norm
``||x - ref|| / ||ref||``.

* float32 forward outputs, final states and every gradient (q, k, v, g, beta, initial_state; the
  loss takes random upstream gradients for ``o`` AND for the final state) must agree to ``TOL``
  (2e-5; observed ~1e-7 .. 1e-6): ``check_case``, over the shapes of ``MATRIX``.
* Strong decay (steps of -20 over stretches, single steps of -1e3 / -1e4): the kernels hold each
  chunk's cumulative log-decay in float32, so a big drop followed by mild decay inside one chunk
  loses absolute precision in the exponent (~ulp of the cumulative sum, e.g. 2.4e-4 at -3300).
  That floor is measured (``cumsum_floor``: float64 chunk algebra fed the float32-rounded
  cumulative sums) and the bound is ``TOL + 2 * floor``.
* Low precision: bounds derived from the reference's own error in that dtype (``lowp_bound``,
  ``check_lowp``). bf16 cannot run in the interpreter: it multiplies bf16 ``tl.dot`` operands as
  raw uint16 bit patterns (triton-lang/triton#11584, "not supported yet"), so bf16 runs on CUDA
  only (``requires_bf16_kernels``); fp16 runs in both.

In the interpreter every kernel load and store of these tests is bounds-checked against the
launch's tensors (``bounds_checked_memory`` in ``tests/conftest.py``, which each module here
applies to all its tests through ``pytestmark``).
"""
from __future__ import annotations

import pytest
import torch

import kda.ops.chunk.api as chunk_api
import kda.ops.chunk.backward as chunk_bwd
import kda.ops.chunk.forward as chunk_fwd
import kda.ops.chunk.function as chunk_function
import kda.ops.chunk.intra as chunk_intra
import kda.ops.chunk.launch as chunk_launch
import kda.ops.chunk.layout as chunk_map
import kda.ops.chunk.schedule as chunk_schedule
from kda import chunk_kda, naive_recurrent_kda
from kda.ops.utils import INTERPRET
from kda.reference import chunk_kda_reference
from conftest import HAS_CUDA, make_cu_seqlens, make_inputs, make_state, rel_err, to64

TOL = 2e-5

# Where the small-shape kernel tests run: CUDA when present, else CPU through the interpreter.
KDEV = 'cuda' if HAS_CUDA else 'cpu'
requires_kernels = pytest.mark.skipif(
    not (HAS_CUDA or INTERPRET), reason="needs TRITON_INTERPRET=1 (CPU) or a CUDA GPU to run the kernels")
requires_bf16_kernels = pytest.mark.skipif(
    not HAS_CUDA, reason="the Triton interpreter computes bf16 tl.dot on raw bit patterns "
                         "(triton-lang/triton#11584); bf16 kernels are tested on CUDA only")

# The modules of the chunk operator that bind names a test may patch (``patch_chunk``).
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


def on_device(d: dict, device) -> dict:
    """The tensors of ``d`` moved to ``device`` (None passes through)."""
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
    """``cu_seqlens`` (int64, on the CPU) for the given sequence lengths."""
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


def check_matrix_case(shape, opts):
    """``check_case`` of a MATRIX entry (varlen entries carry their head counts and dims in opts)."""
    opts = dict(opts)
    if shape is None:
        shape = (1, 0, opts.pop('H'), opts.pop('HV'), opts.pop('K'), opts.pop('V'))
    check_case(*shape, **opts)


def cumsum_floor(x, s0, do, dht, chunk_size, cu_seqlens=None, **opts):
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
