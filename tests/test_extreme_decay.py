"""Extreme decay, out-of-contract log-decays and memory, on every path of ``chunk_kda`` and
``fused_recurrent_kda``.

The ``path`` fixture runs each test twice: ``torch``, the PyTorch path (``use_kernels`` patched to
False: what CPU tensors take without the interpreter; ``chunk_kda_reference`` and
``naive_recurrent_kda``), and ``kernels``, the Triton kernels (CPU tensors under
``TRITON_INTERPRET=1``, or CUDA; skipped otherwise).

* Inside the contract (g <= 0), float32 against the float64 recurrence, relative error norm
  ``TOL`` on outputs, final state and every gradient: ``g = -inf`` at one step (the first, a middle
  and the last row of a chunk), ``-1e30`` at one step, ``-1e4`` on every other step of half the
  key channels between ordinary steps, and the softplus in-kernel gate with raw values 1e4..1e5
  there (``dA_log``, a sum that cancels, against the sum of its terms' sizes). The oracle's own
  gradients are finite in every case (asserted), so they are compared as they are, ``-inf``
  included.
* Outside it, one policy: a log-decay > 0 or NaN at token t makes that value head's outputs NaN
  from the first token of t's chunk on (``chunk_kda``) or from t on (``fused_recurrent_kda``), its
  final state NaN, the states entering its later chunks NaN and its gradients NaN; the other head
  and the other sequence stay exact.
* The PyTorch path's training call keeps no per-chunk pair tensor and peaks well under 0.5 GB at
  (1, 2048, 8, 64).
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import kda.ops.chunk.api as chunk_mod
import kda.ops.fused_recurrent as recurrent_mod
from kda import chunk_kda, fused_recurrent_kda, naive_recurrent_kda
from kda.ops.utils import INTERPRET
from conftest import HAS_CUDA, make_cu_seqlens, make_inputs, make_state, rel_err, to64

TOL = 2e-5
KDEV = 'cuda' if HAS_CUDA else 'cpu'
B, T, H, HV, K, V, CHUNK = 1, 80, 1, 2, 16, 16, 32


@pytest.fixture(params=['torch', 'kernels'])
def path(request, monkeypatch):
    """The device the inputs go to; on the ``torch`` path the kernels are switched off."""
    if request.param == 'kernels':
        if not (INTERPRET or HAS_CUDA):
            pytest.skip("the kernels need TRITON_INTERPRET=1 (CPU) or a CUDA GPU")
        return KDEV
    monkeypatch.setattr(chunk_mod, 'use_kernels', lambda x: False)
    monkeypatch.setattr(recurrent_mod, 'use_kernels', lambda x: False)
    return 'cpu'


def softplus_gate(raw, A_log, dt_bias):
    """docs/API.md's gate without a lower bound, in raw's dtype (the oracle's, float64)."""
    return -A_log.exp()[:, None] * F.softplus(raw + dt_bias.view(HV, K))


EXTREME = ['-inf-first-row', '-inf-middle-row', '-inf-last-row', '-1e30', '-1e4-every-other-step',
           'softplus-raw-1e4..1e5']


def extreme_inputs(case):
    """``(inputs, gate)``: float32 inputs of ``case`` (in the second chunk, value head 1 where one
    step is extreme) and the in-kernel gate's parameters (empty without the gate)."""
    x = make_inputs(B, T, H, HV, K, V)
    g = x['g']
    if case.startswith('-inf'):
        row = {'first': CHUNK, 'middle': CHUNK + CHUNK // 2 - 1, 'last': 2 * CHUNK - 1}[case.split('-')[2]]
        g[0, row, 1, :K // 2] = -torch.inf
    elif case == '-1e30':
        g[0, CHUNK + 5, 1, 3] = -1e30
    elif case == '-1e4-every-other-step':
        g[:, ::2, :, ::2] = -1e4
    else:
        raw = torch.randn_like(g)
        raw[:, ::2, :, ::2] = torch.empty_like(raw[:, ::2, :, ::2]).uniform_(1e4, 1e5)
        x['g'] = raw
        return x, dict(A_log=0.5 * torch.randn(HV), dt_bias=torch.randn(HV * K))
    return x, {}


def chunk_with_grads(x, gate, h0, do, dht, device):
    leaves = {n: t.to(device).requires_grad_() for n, t in dict(x, initial_state=h0, **gate).items()}
    o, ht = chunk_kda(**leaves, output_final_state=True, chunk_size=CHUNK, use_gate_in_kernel=bool(gate))
    loss = (o * do.to(device)).sum() + (ht * dht.to(device)).sum()
    grads = torch.autograd.grad(loss, list(leaves.values()))
    return o.cpu(), ht.cpu(), {n: d.cpu() for n, d in zip(leaves, grads)}


def oracle_with_grads(x, gate, h0, do, dht):
    """The float64 recurrence (the gate activated in float64 too) and its gradients; with the gate
    also ``dA_log_terms``, per head the sum of ``|dg g|`` whose signed sum ``dA_log`` is."""
    leaves = {n: to64(t).requires_grad_() for n, t in dict(x, initial_state=h0, **gate).items()}
    g = softplus_gate(leaves['g'], leaves['A_log'], leaves['dt_bias']) if gate else leaves['g']
    o, ht = naive_recurrent_kda(leaves['q'], leaves['k'], leaves['v'], g, leaves['beta'],
                                initial_state=leaves['initial_state'], output_final_state=True)
    loss = (o * to64(do)).sum() + (ht * to64(dht)).sum()
    *grads, dg = torch.autograd.grad(loss, list(leaves.values()) + [g])
    grads = dict(zip(leaves, grads))
    if gate:
        grads['dA_log_terms'] = (dg * g).abs().sum((0, 1, 3)).detach()
    return o, ht, grads


@pytest.mark.slow
@pytest.mark.parametrize('case', EXTREME)
def test_chunk_extreme_decay_is_exact(path, case):
    x, gate = extreme_inputs(case)
    h0 = make_state(B, HV, K, V)
    do, dht = torch.randn(B, T, HV, V), torch.randn(B, HV, K, V)
    ro, rht, rgrads = oracle_with_grads(x, gate, h0, do, dht)
    for name, d in rgrads.items():
        assert torch.isfinite(d).all(), f"the oracle's own d{name} is not finite"
    o, ht, grads = chunk_with_grads(x, gate, h0, do, dht, path)
    terms = rgrads.pop('dA_log_terms', None)
    errs = dict(o=rel_err(o, ro), final_state=rel_err(ht, rht),
                **{f'd{n}': rel_err(grads[n], rgrads[n]) for n in rgrads})
    if terms is not None:
        # dA_log = sum over tokens and channels of dg * g cancels (observed |dA_log| down to 1/200
        # of the sum of |dg g|): its error is measured against that sum, as a sum's rounding is.
        errs['dA_log'] = (to64(grads['A_log']) - rgrads['A_log']).norm().item() / terms.norm().item()
    bad = {n: f'{e:.2e}' for n, e in errs.items() if not e < TOL}
    assert not bad, f"{case}: relative errors above {TOL}: {bad}"


@pytest.mark.parametrize('case', EXTREME)
def test_recurrent_extreme_decay_is_exact(path, case):
    x, gate = extreme_inputs(case)
    h0 = make_state(B, HV, K, V)
    ro, rht, _ = oracle_with_grads(x, gate, h0, torch.zeros(B, T, HV, V), torch.zeros(B, HV, K, V))
    with torch.no_grad():
        o, ht = fused_recurrent_kda(**{n: t.to(path) for n, t in dict(x, **gate).items()},
                                    initial_state=h0.to(path), output_final_state=True,
                                    use_gate_in_kernel=bool(gate))
    assert rel_err(o, ro) < TOL and rel_err(ht, rht) < TOL, \
        f"{case}: output {rel_err(o, ro):.2e}, final state {rel_err(ht, rht):.2e}"


# ------------------------------------------------------------- log-decays outside the contract

# Two sequences; sequence 0 holds chunks [0, 32), [32, 64), [64, 70), sequence 1 [70, 102), [102, 110).
LENGTHS = [70, 40]
BAD_TOKEN, BAD_CHUNK_START, BAD_HEAD = 45, 32, 1
BAD = ['positive', 'nan', 'nan-raw-gate']


def bad_inputs(bad):
    """``(inputs, gate)`` with one out-of-contract log-decay at ``BAD_TOKEN``, head ``BAD_HEAD``
    (one key channel), and the oracle's copy of the log-decay: with ``nan-raw-gate`` the raw gate
    is NaN there (and the in-kernel gate is on)."""
    x = make_inputs(1, sum(LENGTHS), H, HV, K, V)
    gate = {}
    if bad == 'nan-raw-gate':
        gate = dict(A_log=0.5 * torch.randn(HV), dt_bias=torch.randn(HV * K))
        x['g'] = torch.randn_like(x['g'])
    x['g'][0, BAD_TOKEN, BAD_HEAD, 3] = 0.5 if bad == 'positive' else torch.nan
    g64 = softplus_gate(to64(x['g']), to64(gate['A_log']), to64(gate['dt_bias'])) if gate else to64(x['g'])
    return x, gate, g64


def check_policy(o, ht, ro, rht, first_nan):
    """Head BAD_HEAD of sequence 0: exact before ``first_nan``, NaN from there to the sequence's
    end and in the final state. Head 0 and sequence 1: exact."""
    end, h = LENGTHS[0], BAD_HEAD
    assert torch.isnan(o[0, first_nan:end, h]).all(), f"outputs from token {first_nan} on must be NaN"
    assert rel_err(o[0, :first_nan, h], ro[0, :first_nan, h]) < TOL, "outputs before them changed"
    assert torch.isnan(ht[0, h]).all(), "the final state of the poisoned head must be NaN"
    assert rel_err(o[0, :, 1 - h], ro[0, :, 1 - h]) < TOL, "the other head changed"
    assert rel_err(ht[0, 1 - h], rht[0, 1 - h]) < TOL, "the other head's final state changed"
    assert rel_err(o[0, end:], ro[0, end:]) < TOL and rel_err(ht[1], rht[1]) < TOL, \
        "the other sequence changed"


@pytest.mark.slow
@pytest.mark.parametrize('bad', BAD)
def test_chunk_bad_log_decay_policy(path, bad):
    """chunk_kda: NaN from the first token of the bad token's chunk on, in outputs, final state,
    the states entering later chunks and the gradients; everything else exact."""
    x, gate, g64 = bad_inputs(bad)
    cu = make_cu_seqlens(LENGTHS)
    h0 = make_state(len(LENGTHS), HV, K, V)
    ro, rht = naive_recurrent_kda(*(to64(x[n]) for n in ('q', 'k', 'v')), g64, to64(x['beta']),
                                  initial_state=to64(h0), output_final_state=True, cu_seqlens=cu)
    dev = {n: t.to(path) for n, t in dict(x, initial_state=h0, **gate).items()}
    opts = dict(output_final_state=True, cu_seqlens=cu.to(path), chunk_size=CHUNK,
                use_gate_in_kernel=bool(gate))
    with torch.no_grad():
        o, ht, h = chunk_kda(**dev, **opts, return_intermediate_states=True)
    o, ht, h = o.cpu(), ht.cpu(), h.cpu()
    check_policy(o, ht, ro, rht, BAD_CHUNK_START)
    # States entering the chunks [0, 32), [32, 64), [64, 70) of sequence 0, then sequence 1's two.
    assert torch.isfinite(h[0, :2]).all(), "the states entering the bad chunk and before must be finite"
    assert torch.isnan(h[0, 2, BAD_HEAD]).all(), "the state entering the next chunk must be NaN"
    assert torch.isfinite(h[0, 2, 1 - BAD_HEAD]).all() and torch.isfinite(h[0, 3:]).all(), \
        "states of the other head and sequence must be finite"

    leaves = {n: t.requires_grad_() for n, t in dev.items()}
    o, ht = chunk_kda(**leaves, **opts)
    (o.nan_to_num().sum() + ht.nan_to_num().sum()).backward()
    dv = leaves['v'].grad.cpu()
    assert torch.isnan(dv[0, BAD_CHUNK_START:LENGTHS[0], BAD_HEAD]).any(), \
        "gradients through the poisoned head must not look usable"


@pytest.mark.parametrize('bad', BAD)
def test_recurrent_bad_log_decay_policy(path, bad):
    """fused_recurrent_kda: NaN from the bad token itself on, and in the final state."""
    x, gate, g64 = bad_inputs(bad)
    cu = make_cu_seqlens(LENGTHS)
    h0 = make_state(len(LENGTHS), HV, K, V)
    ro, rht = naive_recurrent_kda(*(to64(x[n]) for n in ('q', 'k', 'v')), g64, to64(x['beta']),
                                  initial_state=to64(h0), output_final_state=True, cu_seqlens=cu)
    with torch.no_grad():
        o, ht = fused_recurrent_kda(**{n: t.to(path) for n, t in dict(x, **gate).items()},
                                    initial_state=h0.to(path), output_final_state=True,
                                    cu_seqlens=cu.to(path), use_gate_in_kernel=bool(gate))
    check_policy(o.cpu(), ht.cpu(), ro, rht, BAD_TOKEN)


# ------------------------------------------------------------------ memory of the PyTorch path


def test_torch_path_keeps_no_pair_tensors(monkeypatch):
    """A training call on the PyTorch path keeps for its backward a few tensors the size of its
    inputs, not the per-chunk [C, C, HV, K] pair decays (C = 64 times a chunk's keys each)."""
    monkeypatch.setattr(chunk_mod, 'use_kernels', lambda x: False)
    x = {n: t.requires_grad_() for n, t in make_inputs(1, 256, 2, 2, 64, 64).items()}
    inputs_bytes = sum(t.numel() * t.element_size() for t in x.values())
    kept = {}

    def pack(t):
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        chunk_kda(**x)
    assert sum(kept.values()) < 8 * inputs_bytes, \
        f"saved for the backward: {sum(kept.values()) / inputs_bytes:.1f} x the inputs' bytes"


PEAK_SCRIPT = r'''
import resource, torch
from kda import chunk_kda
B, T, H, K, V = 1, 2048, 8, 64, 64
x = [torch.randn(B, T, H, K), torch.nn.functional.normalize(torch.randn(B, T, H, K), dim=-1),
     torch.randn(B, T, H, V), -torch.rand(B, T, H, K), torch.rand(B, T, H)]
x = [t.requires_grad_() for t in x]
do = torch.randn(B, T, H, V)
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
o, _ = chunk_kda(*x)
(o * do).sum().backward()
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) * 1024)
'''


@pytest.mark.slow
def test_torch_path_training_peak_memory():
    """Peak resident memory of one forward + backward at (B, T, H, K) = (1, 2048, 8, 64), V = 64,
    float32, on the PyTorch path: the growth of ``ru_maxrss`` in a fresh process over its value
    after imports and input creation (the allocator's fragmentation counts). Bound 0.5 GB
    (measured 0.26 GiB; keeping every chunk's pair decays takes 1.7-2.5 GiB)."""
    env = {n: v for n, v in os.environ.items() if n != 'TRITON_INTERPRET'}
    env['PYTHONPATH'] = os.pathsep.join([os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                         env.get('PYTHONPATH', '')])
    out = subprocess.run([sys.executable, '-c', PEAK_SCRIPT], env=env, capture_output=True,
                         text=True, check=False, timeout=600)
    assert out.returncode == 0, out.stderr
    peak = int(out.stdout.split()[-1])
    assert peak < 0.5e9, f"training call peak {peak / 1e9:.2f} GB above the 0.5 GB bound"
