"""Property test: random shapes, options, dtypes and layouts against the float64 recurrence.

Each seed of ``SEEDS`` draws one case (``draw_case``): odd head dims, GVA, fixed-length or varlen
batches with empty sequences, q/k l2-normalized in the kernel or not, the in-kernel gate with or
without a lower bound (and ``A_log`` / ``dt_bias`` present or not), beta as logits (with
negative eigenvalues or not), an initial state or none, the final state or none, either state
layout, chunk size 32 or 64, float32 / float16 / bfloat16 inputs (g and beta in the input dtype
or float32), and inputs that are strided views rather than dense tensors. ``chunk_kda``'s
outputs, final state and every gradient, and ``fused_recurrent_kda``'s outputs and final state,
are compared with ``naive_recurrent_kda`` in float64 on the same (rounded) inputs, activated in
float64. The seed list is fixed, so CI runs the same cases every time, within about a minute on
one core through the interpreter (bf16 ``chunk_kda`` takes the PyTorch path there, by design).

Bounds (relative error norm):

* float32: ``TOL32`` = 2e-5, the bound of the other float32 kernel tests. Measured over the seed
  list (interpreter): outputs and states at most 1.4e-6, gradients 3e-6, but ``ddt_bias``
  (a sum over every token, which cancels) 1.2e-5.
* 16-bit: ``lowp_bound(err_ref, u)`` = ``2 err_ref + 5 u``, where ``err_ref`` is the error of
  the recurrence computed in float32 on the same 16-bit inputs (its outputs and gradients
  rounded to the dtype once), and ``u`` the size of one rounding of the float64 output to the
  dtype. The kernels round each tensor-core operand to the dtype on purpose, and an output
  depends on a chain of ~4-8 such roundings (``tests/chunk/chunk_helpers.py``, ``lowp_bound``, measured up
  to 3.1 u there). Measured over the seed list: at most 0.37 of the bound (float16 ``dbeta``).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
import torch
import torch.nn.functional as F

from kda import chunk_kda, fused_recurrent_kda, naive_recurrent_kda
from kda.ops.utils import INTERPRET
from conftest import HAS_CUDA, make_cu_seqlens, rel_err

KDEV = 'cuda' if HAS_CUDA else 'cpu'
requires_kernels = pytest.mark.skipif(
    not (HAS_CUDA or INTERPRET), reason="needs TRITON_INTERPRET=1 (CPU) or a CUDA GPU to run the kernels")

SEEDS = list(range(12))
TOL32 = 2e-5
NAMES = ('q', 'k', 'v', 'g', 'beta')


def lowp_bound(err_ref: float, u: float) -> float:
    """Bound for a 16-bit result: twice the reference's own error on the same inputs plus five
    roundings (module docstring)."""
    return 2 * err_ref + 5 * u


@dataclass
class Case:
    """One drawn case: sizes, options of both functions, dtypes and which inputs are views."""
    lengths: list[int] | None          # varlen sequence lengths (B = 1), or None
    B: int
    T: int
    H: int
    HV: int
    K: int
    V: int
    dtype: torch.dtype
    gate_dtype: torch.dtype
    chunk_size: int
    initial_state: bool
    opts: dict = field(default_factory=dict)
    gate: dict = field(default_factory=dict)      # use_gate_in_kernel's A_log / dt_bias / lower_bound
    strided: tuple[str, ...] = ()

    @property
    def N(self) -> int:
        return self.B if self.lengths is None else len(self.lengths)


def draw_case(seed: int) -> Case:
    rnd = random.Random(seed)
    if rnd.random() < 0.5:
        lengths = [rnd.choice([0, 1, rnd.randint(2, 20)]) for _ in range(rnd.randint(2, 4))]
        lengths[rnd.randrange(len(lengths))] = rnd.randint(17, 40)     # some work in every case
        B, T = 1, sum(lengths)
    else:
        lengths, B, T = None, rnd.randint(1, 2), rnd.choice([1, rnd.randint(2, 31), rnd.randint(33, 45)])
    H = rnd.choice([1, 2])
    HV = H * rnd.choice([1, 2])
    K, V = rnd.choice([8, 13, 16, 20]), rnd.choice([7, 16, 19])
    dtype = rnd.choice([torch.float32, torch.float32, torch.float16, torch.bfloat16])
    gate_dtype = rnd.choice([dtype, torch.float32])
    opts = dict(use_qk_l2norm_in_kernel=rnd.random() < 0.5, output_final_state=rnd.random() < 0.75,
                state_v_first=rnd.random() < 0.3)
    if rnd.random() < 0.5:
        opts['use_beta_sigmoid_in_kernel'] = True
        opts['allow_neg_eigval'] = rnd.random() < 0.5
    gate = {}
    kind = rnd.choice(['none', 'softplus', 'lower_bound'])
    if kind != 'none':
        opts['use_gate_in_kernel'] = True
        if kind == 'lower_bound':
            gate['lower_bound'] = rnd.choice([-5.0, -1.0, -0.3])
            opts['safe_gate'] = rnd.random() < 0.5
        if kind == 'softplus' or rnd.random() < 0.5:
            gate['A_log'] = True
        if rnd.random() < 0.6:
            gate['dt_bias'] = True
    strided = tuple(n for n in NAMES if rnd.random() < 0.3)
    return Case(lengths, B, T, H, HV, K, V, dtype, gate_dtype, rnd.choice([32, 64]),
                rnd.random() < 0.6, opts, gate, strided)


def _view_of(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """``x``'s values in a strided view: every other element of a wider last dim."""
    wide = torch.randn(*x.shape[:-1], 2 * x.shape[-1], generator=gen, dtype=torch.float64).to(x.dtype)
    wide[..., ::2] = x
    return wide[..., ::2]


def draw_inputs(case: Case, seed: int) -> dict:
    """Raw inputs (the gate and beta as logits where the kernel activates them), rounded to their
    dtypes, some as strided views; the gate parameters and initial state in float32."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    B, T, H, HV, K, V = case.B, case.T, case.H, case.HV, case.K, case.V
    q, k, v = randn(B, T, H, K), randn(B, T, H, K), randn(B, T, HV, V)
    if not case.opts['use_qk_l2norm_in_kernel']:
        k = k / k.norm(dim=-1, keepdim=True)
    if case.opts.get('use_gate_in_kernel'):
        g = randn(B, T, HV, K)
    else:
        g = -(0.01 + 0.99 * torch.rand(B, T, HV, K, generator=gen, dtype=torch.float64))
    beta = randn(B, T, HV) if case.opts.get('use_beta_sigmoid_in_kernel') else \
        torch.rand(B, T, HV, generator=gen, dtype=torch.float64)
    x = dict(q=q.to(case.dtype), k=k.to(case.dtype), v=v.to(case.dtype), g=g.to(case.gate_dtype),
             beta=beta.to(case.gate_dtype))
    for n in case.strided:
        x[n] = _view_of(x[n], gen)
        assert not x[n].is_contiguous()
    params = {}
    if 'A_log' in case.gate:
        params['A_log'] = torch.log(1 + 15 * torch.rand(HV, generator=gen)).float()
    if 'dt_bias' in case.gate:
        params['dt_bias'] = (0.5 * randn(HV * K)).float()
    if case.initial_state:
        shape = (case.N, HV, V, K) if case.opts['state_v_first'] else (case.N, HV, K, V)
        params['initial_state'] = (0.5 * randn(*shape)).float()
    return {**x, **params}


def reference(case: Case, inputs: dict):
    """The recurrence on ``inputs`` with the gate and beta activated first, in float64 for float64
    inputs (the oracle), else in float32 with outputs in q's dtype (the reference's own error on
    the same rounded inputs); returns ``(o, ht)``."""
    x = {n: inputs[n] for n in NAMES}
    compute = torch.float64 if x['q'].dtype == torch.float64 else torch.float32
    g, beta = x['g'].to(compute), x['beta'].to(compute)
    if case.opts.get('use_gate_in_kernel'):
        A_log, dt_bias = inputs.get('A_log'), inputs.get('dt_bias')
        if dt_bias is not None:
            g = g + dt_bias.to(compute).view(case.HV, case.K)
        lower = case.gate.get('lower_bound')
        if lower is None:
            g = -A_log.to(compute).exp()[:, None] * F.softplus(g)
        else:
            g = lower * torch.sigmoid(g if A_log is None else A_log.to(compute).exp()[:, None] * g)
    if case.opts.get('use_beta_sigmoid_in_kernel'):
        beta = torch.sigmoid(beta) * (2 if case.opts['allow_neg_eigval'] else 1)
    h0 = inputs.get('initial_state')
    return naive_recurrent_kda(
        x['q'], x['k'], x['v'], g, beta, initial_state=None if h0 is None else h0.to(compute),
        output_final_state=True, use_qk_l2norm_in_kernel=case.opts['use_qk_l2norm_in_kernel'],
        cu_seqlens=None if case.lengths is None else make_cu_seqlens(case.lengths),
        state_v_first=case.opts['state_v_first'])


def _call_opts(case: Case) -> dict:
    """The keyword options of both functions for ``case`` (tensors come from the inputs)."""
    opts = dict(case.opts)
    if case.opts.get('use_gate_in_kernel'):
        opts['lower_bound'] = case.gate.get('lower_bound')
    opts['cu_seqlens'] = None if case.lengths is None else make_cu_seqlens(case.lengths).to(KDEV)
    return opts


def _leaves(inputs: dict) -> dict:
    """Fresh leaves requiring grad, on KDEV; strided views stay strided (same strides)."""
    out = {}
    for n, x in inputs.items():
        y = x.detach()
        if not y.is_contiguous():
            y = torch.empty_strided(y.shape, y.stride(), dtype=y.dtype, device=KDEV).copy_(y)
        else:
            y = y.to(KDEV)
        out[n] = y.requires_grad_()
    return out


def _grad_loss(o, ht, seed: int):
    gen = torch.Generator().manual_seed(seed + 1000)
    do = torch.randn(o.shape, generator=gen, dtype=torch.float64)
    loss = (o.double() * do.to(o.device)).sum()
    if ht is not None:
        dht = torch.randn(ht.shape, generator=gen, dtype=torch.float64)
        loss = loss + (ht.double() * dht.to(ht.device)).sum()
    return loss


def _bounds(case: Case, ref64: dict, ref_lowp: dict | None) -> dict:
    if case.dtype == torch.float32:
        return {n: TOL32 for n in ref64}
    u = rel_err(ref64['o'].to(case.dtype), ref64['o'])
    return {n: lowp_bound(rel_err(ref_lowp[n], ref64[n]), u) for n in ref64}


def _check(case: Case, got: dict, bounds: dict, what: str) -> None:
    errs = {}
    for n, (x, ref) in got.items():
        assert x.isfinite().all(), f"{what} {case}: {n} not finite"
        errs[n] = rel_err(x, ref)
    bad = {n: f"{e:.2e} > {bounds[n]:.2e}" for n, e in errs.items() if not e < bounds[n]}
    assert not bad, f"{what} {case}: {bad}"


def _results(o, ht, grads: dict | None) -> dict:
    out = {'o': o.detach().cpu()}
    if ht is not None:
        out['ht'] = ht.detach().cpu()
    for n, gr in (grads or {}).items():
        out['d' + n] = gr.detach().cpu()
    return out


@pytest.mark.slow
@requires_kernels
@pytest.mark.parametrize('seed', SEEDS)
def test_random_cases(seed):
    """Case ``draw_case(seed)``: chunk_kda's outputs, final state and gradients, and
    fused_recurrent_kda's outputs and final state, within the bounds of the module docstring of
    the float64 recurrence on the same inputs."""
    case = draw_case(seed)
    inputs = draw_inputs(case, seed)
    final = case.opts['output_final_state']

    # The oracle (float64 leaves) and, for 16-bit inputs, the reference's own error (leaves in
    # the inputs' dtypes, so that its gradients are rounded to them as the kernels' are).
    def run_reference(float64: bool):
        leaves = {n: x.detach().to(torch.float64 if float64 else x.dtype).requires_grad_()
                  for n, x in inputs.items()}
        o, ht = reference(case, leaves)
        ht = ht if final else None
        grads = torch.autograd.grad(_grad_loss(o, ht, seed), list(leaves.values()), allow_unused=True)
        return _results(o, ht, {n: torch.zeros_like(leaves[n]) if gr is None else gr
                                for n, gr in zip(leaves, grads)})

    ref64 = run_reference(True)
    ref_lowp = None if case.dtype == torch.float32 else run_reference(False)
    bounds = _bounds(case, ref64, ref_lowp)

    leaves = _leaves(inputs)
    o, ht = chunk_kda(**leaves, chunk_size=case.chunk_size, **_call_opts(case))
    assert o.dtype == case.dtype and (ht is None) == (not final)
    grads = torch.autograd.grad(_grad_loss(o, ht, seed), list(leaves.values()))
    got = _results(o, ht, dict(zip(leaves, grads)))
    _check(case, {n: (got[n], ref64[n]) for n in got}, bounds, 'chunk_kda')

    with torch.no_grad():
        o, ht = fused_recurrent_kda(**{n: x.to(KDEV) for n, x in inputs.items()}, **_call_opts(case))
    got = _results(o, ht, None)
    _check(case, {n: (got[n], ref64[n]) for n in got}, bounds, 'fused_recurrent_kda')
