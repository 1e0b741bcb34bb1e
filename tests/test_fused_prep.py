"""The forward's in-chunk stage in one kernel (``FUSED_PREP``, ``kda/ops/chunk/prep.py``) against
the three-kernel build it would replace.

Specification: with the switch on, ``chunk_kda`` gives the same outputs and final states, bit for
bit, as with it off (the same arithmetic, ``kernels/chunk_prep.py``), and the gradients of a
training call too (the backward reads the forward's Aqk, A' and M); NaN where the build it
replaces gives NaN. Each case also checks the fused build against the float64 recurrence, so that
two builds wrong alike cannot pass. Cases: odd lengths, chunks of 32 and 64, varlen with an empty
and a one-token sequence, GVA, strong decay with -inf steps, a positive given step (NaN), the
in-kernel gates (the Kimi configuration: lower-bound gate, beta logits, l2norm in the kernel),
float32 and float16.
"""
from __future__ import annotations

import pytest
import torch

from kda import chunk_kda
from kda.ops.chunk import forward, launch, schedule, tuning
from conftest import (make_cu_seqlens, make_inputs, make_state, reference64, rel_err,
                            requires_interpreter)

pytestmark = requires_interpreter

# float32 against the float64 recurrence, as the chunk tests allow; float16's own rounding.
TOL = {torch.float32: 1e-5, torch.float16: 5e-3}


def kimi_inputs(B, T, H, HV, K, V, dtype, lower_bound=-5.0):
    """Raw gate, beta logits, A_log and dt_bias, raw q and k: the options of the Kimi layer."""
    x = make_inputs(B, T, H, HV, K, V, dtype=dtype, normalize_k=False)
    x['g'] = torch.randn(B, T, HV, K).to(dtype)
    x['beta'] = (2 * torch.randn(B, T, HV)).to(dtype)
    extra = dict(A_log=torch.randn(HV), dt_bias=0.5 * torch.randn(HV * K))
    opts = dict(use_gate_in_kernel=True, lower_bound=lower_bound, use_beta_sigmoid_in_kernel=True,
                use_qk_l2norm_in_kernel=True, **extra)
    return x, opts


def kimi_reference(x, opts, s0, cu):
    """The float64 recurrence on the Kimi options' activations."""
    f = {n: t.double() for n, t in x.items()}
    z = opts['A_log'].double().exp()[:, None] * (f['g'] + opts['dt_bias'].double().view(-1, f['g'].shape[-1]))
    g = opts['lower_bound'] * torch.sigmoid(z)
    q = torch.nn.functional.normalize(f['q'], dim=-1)
    k = torch.nn.functional.normalize(f['k'], dim=-1)
    return reference64(q, k, f['v'], g, torch.sigmoid(f['beta']), initial_state=s0, cu_seqlens=cu)


CASES = {
    # name: (B, T, H, HV, K, V), chunk_size, lengths, dtype, kind
    'odd-T45-BT32-B2': ((2, 45, 1, 1, 32, 32), 32, None, torch.float32, 'plain'),
    'T70-BT64-gva12': ((1, 70, 1, 2, 32, 32), 64, None, torch.float32, 'plain'),
    'varlen-BT32-empty-len1': ((1, None, 1, 2, 32, 16), 32, [0, 1, 19, 40], torch.float32, 'plain'),
    'varlen-BT64-K60-V24': ((1, None, 1, 2, 60, 24), 64, [40, 0, 29, 70], torch.float32, 'plain'),
    'strong-decay-inf-BT32': ((1, 50, 1, 2, 32, 16), 32, None, torch.float32, 'strong'),
    'positive-step-nan-BT64': ((1, 70, 1, 1, 16, 16), 64, None, torch.float32, 'positive'),
    'kimi-BT64-varlen': ((1, None, 2, 2, 32, 16), 64, [23, 70, 5], torch.float32, 'kimi'),
    'kimi-saturated-BT64': ((1, 80, 1, 1, 32, 16), 64, None, torch.float32, 'kimi-saturated'),
    'l2norm-softplus-BT32': ((1, 45, 1, 2, 32, 16), 32, None, torch.float32, 'softplus-l2'),
    'fp16-T45-BT64-gva12': ((1, 45, 1, 2, 32, 16), 64, None, torch.float16, 'plain'),
}


def case_inputs(shape, lengths, dtype, kind):
    """``(inputs, options, initial state, cu_seqlens, reference or None)``."""
    B, T, H, HV, K, V = shape
    T = sum(lengths) if lengths is not None else T
    N = B if lengths is None else len(lengths)
    cu = None if lengths is None else make_cu_seqlens(lengths)
    s0 = make_state(N, HV, K, V)
    if kind.startswith('kimi'):
        x, opts = kimi_inputs(B, T, H, HV, K, V, dtype)
        if kind == 'kimi-saturated':
            x['g'][:, 16:48] = 40.                        # sigmoid -> 1: 32 steps of -5
        return x, opts, s0, cu, kimi_reference(x, opts, s0, cu)
    if kind == 'softplus-l2':
        x = make_inputs(B, T, H, HV, K, V, dtype=dtype, normalize_k=False)
        x['g'] = 3 * torch.randn(B, T, HV, K)
        opts = dict(use_gate_in_kernel=True, A_log=torch.randn(HV), use_qk_l2norm_in_kernel=True)
        f = {n: t.double() for n, t in x.items()}
        g = -opts['A_log'].double().exp()[:, None] * torch.nn.functional.softplus(f['g'])
        ref = reference64(torch.nn.functional.normalize(f['q'], dim=-1),
                          torch.nn.functional.normalize(f['k'], dim=-1), f['v'], g, f['beta'],
                          initial_state=s0, cu_seqlens=cu)
        return x, opts, s0, cu, ref
    x = make_inputs(B, T, H, HV, K, V, dtype=dtype, strong_decay=kind == 'strong')
    if kind == 'strong':
        x['g'][:, 3::7, 1, :5] = -float('inf')
    if kind == 'positive':
        x['g'][0, 66, 0, 3] = 0.5                          # chunk 1, key channel 3: NaN
        return x, {}, s0, cu, None
    return x, {}, s0, cu, reference64(**x, initial_state=s0, cu_seqlens=cu)


def run(x, opts, s0, cu, chunk_size, fused, monkeypatch, grads=False):
    """``(o, final state, gradients or None)`` of ``chunk_kda`` with the switch set to ``fused``."""
    monkeypatch.setattr(tuning, 'FUSED_PREP', fused)
    leaves = {n: t.clone().requires_grad_(grads) for n, t in x.items()}
    with torch.set_grad_enabled(grads):
        o, ht = chunk_kda(**leaves, initial_state=s0, output_final_state=True, chunk_size=chunk_size,
                          cu_seqlens=cu, **opts)
    if not grads:
        return o, ht, None
    do, dht = torch.randn_like(o), torch.randn_like(ht)
    return o, ht, torch.autograd.grad((o * do).sum() + (ht * dht).sum(), list(leaves.values()))


def assert_same_bits(name, got, want):
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"{name}: {m}")


@pytest.fixture
def fused_only():
    """With the switch on, the three-kernel stage must not run."""
    def refuse(*args, **kwargs):
        raise AssertionError("the three-kernel in-chunk stage ran with FUSED_PREP on")
    return refuse


# With -m slow only: the first's forward is the training case's; the second (K = 60, masked key
# columns, partial 64-row chunks) takes 12 s in the interpreter.
SLOW = {'T70-BT64-gva12', 'varlen-BT64-K60-V24'}


@pytest.mark.parametrize('name', [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in CASES])
def test_fused_prep_same_bits(name, monkeypatch, fused_only):
    """Outputs and final states bit for bit those of the three-kernel stage; the fused build
    within the float64 recurrence's tolerance (NaN in the chunk of a positive given step and
    after it, as before)."""
    shape, chunk_size, lengths, dtype, kind = CASES[name]
    x, opts, s0, cu, ref = case_inputs(shape, lengths, dtype, kind)
    o0, ht0, _ = run(x, opts, s0, cu, chunk_size, False, monkeypatch)
    monkeypatch.setattr(forward, 'cumulative_decay', fused_only)
    monkeypatch.setattr(forward, 'pair_products_and_solve', fused_only)
    o1, ht1, _ = run(x, opts, s0, cu, chunk_size, True, monkeypatch)
    assert_same_bits(f"{name} o", o1, o0)
    assert_same_bits(f"{name} final state", ht1, ht0)
    if kind == 'positive':
        assert o1[0, :64].isfinite().all() and o1[0, 64:].isnan().any() and ht1.isnan().any()
        return
    ro, rht = ref
    tol = TOL[dtype]
    assert rel_err(o1, ro) < tol, f"{name}: o {rel_err(o1, ro):.2e}"
    assert rel_err(ht1, rht) < tol, f"{name}: final state {rel_err(ht1, rht):.2e}"


@pytest.mark.parametrize('sms', [10 ** 6, 3], ids=['few-sweep-programs', 'busy-sweep'])
def test_fused_prep_segments_same_bits(sms, monkeypatch, fused_only):
    """The forward in time segments (``schedule.forward_segments``, forced: the token-head
    minimum lifted, a GPU of ``sms`` SMs claimed): each segment's fused stage, bit for bit the
    three kernels' per segment, including where the busy sweep's build runs the cumsum of the
    whole sequence first."""
    monkeypatch.setattr(schedule, 'SEGMENT_MIN_TOKEN_HEADS', 0)
    monkeypatch.setattr(forward, 'SEGMENT_MIN_TOKEN_HEADS', 0)
    for module in (schedule, launch):
        monkeypatch.setattr(module, 'sm_count', lambda device: sms)
    x, opts, s0, cu, ref = case_inputs((1, 100, 1, 2, 16, 16), None, torch.float32, 'kimi')
    layout = forward.chunk_layout(1, 100, 32, None, None)
    assert forward.forward_segments(1, 100, 2, 16, 16, layout, None, False, 'cpu') is not None
    assert schedule.busy_sweep(2, 16, 16, 'cpu') == (sms == 3)
    o0, ht0, _ = run(x, opts, s0, cu, 32, False, monkeypatch)
    monkeypatch.setattr(forward, 'cumulative_decay', fused_only)
    monkeypatch.setattr(forward, 'pair_products_and_solve', fused_only)
    o1, ht1, _ = run(x, opts, s0, cu, 32, True, monkeypatch)
    assert_same_bits("segmented o", o1, o0)
    assert_same_bits("segmented final state", ht1, ht0)
    assert rel_err(o1, ref[0]) < TOL[torch.float32] and rel_err(ht1, ref[1]) < TOL[torch.float32]


@pytest.mark.parametrize('name', ['T70-BT64-gva12',
                                  pytest.param('kimi-BT64-varlen', marks=pytest.mark.slow)])
def test_fused_prep_training_same_bits(name, monkeypatch, fused_only):
    """Training: the backward reads the forward's Aqk, A' and M, so its gradients come out bit
    for bit the same as well."""
    shape, chunk_size, lengths, dtype, kind = CASES[name]
    x, opts, s0, cu, _ = case_inputs(shape, lengths, dtype, kind)
    seed = torch.seed()
    o0, ht0, g0 = run(x, opts, s0, cu, chunk_size, False, monkeypatch, grads=True)
    torch.manual_seed(seed)
    monkeypatch.setattr(forward, 'cumulative_decay', fused_only)
    monkeypatch.setattr(forward, 'pair_products_and_solve', fused_only)
    o1, ht1, g1 = run(x, opts, s0, cu, chunk_size, True, monkeypatch, grads=True)
    assert_same_bits(f"{name} o", o1, o0)
    assert_same_bits(f"{name} final state", ht1, ht0)
    for n, a, b in zip(x, g1, g0):
        assert_same_bits(f"{name} d{n}", a, b)
