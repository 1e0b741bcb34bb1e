"""Calls written for flash-linear-attention's ``fla.ops.kda`` run here with its meaning (API.md:
model code must run unchanged). Each case is one argument or shape FLA takes: spelled the same,
accepted, and computing what FLA computes with it; ignored where FLA ignores it (with a warning
here); refused, with a message that says so, where it is not supported yet.

All on the PyTorch path (CPU tensors), at sizes of a few chunks: what is checked is the handling
of the arguments, and two calls that must mean the same are compared bit for bit.
"""
from __future__ import annotations

import warnings

import pytest
import torch

from kda import chunk_kda, fused_recurrent_kda
from kda.ops.validation import validate_activations
from conftest import make_inputs, make_state, rel_err
from kda import naive_recurrent_kda

B, T, H, HV, K, V = 2, 40, 2, 4, 16, 8
FUNCTIONS = {'chunk_kda': chunk_kda, 'fused_recurrent_kda': fused_recurrent_kda}


def inputs(dtype=torch.float32, **over):
    x = make_inputs(B, T, H, HV, K, V, dtype=dtype)
    x.update(over)
    return x


def no_warnings(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        return fn(*args, **kwargs)


def assert_same(a, b):
    for name, x, y in zip(('o', 'final_state', 'h'), a, b):
        assert (x is None) == (y is None) and (x is None or torch.equal(x, y)), f"{name} differs"


@pytest.mark.slow
@pytest.mark.parametrize('fn', FUNCTIONS.values(), ids=FUNCTIONS.keys())
def test_transpose_state_layout_is_state_v_first_with_a_deprecation_warning(fn):
    x = inputs()
    s0 = make_state(B, HV, K, V, state_v_first=True)
    want = fn(**x, initial_state=s0, output_final_state=True, state_v_first=True)
    with pytest.warns(DeprecationWarning, match='transpose_state_layout'):
        got = fn(**x, initial_state=s0, output_final_state=True, transpose_state_layout=True)
    assert_same(got, want)
    with pytest.raises(ValueError, match='transpose_state_layout.*state_v_first'):
        fn(**x, state_v_first=True, transpose_state_layout=True)


@pytest.mark.slow
def test_lower_bound_beside_safe_gate_with_given_g_is_accepted():
    """FLA: with g given, safe_gate=True says g keeps the bound; lower_bound changes nothing."""
    x = inputs(g=-5 * torch.rand(B, T, HV, K))
    want = chunk_kda(**x)
    got = no_warnings(chunk_kda, **x, safe_gate=True, lower_bound=-5)
    assert_same(got, want)


@pytest.mark.slow
@pytest.mark.parametrize('fn', FUNCTIONS.values(), ids=FUNCTIONS.keys())
@pytest.mark.parametrize('given', ['A_log', 'dt_bias', 'lower_bound'])
def test_gate_parameters_without_the_gate_are_ignored_with_a_warning(fn, given):
    x = inputs()
    value = {'A_log': torch.randn(HV), 'dt_bias': torch.randn(HV * K), 'lower_bound': -1.0}[given]
    want = fn(**x)
    with pytest.warns(UserWarning, match=f'{given} given with use_gate_in_kernel=False: ignored'):
        got = fn(**x, **{given: value})
    assert_same(got, want)


@pytest.mark.slow
@pytest.mark.parametrize('fn', FUNCTIONS.values(), ids=FUNCTIONS.keys())
def test_gate_parameters_of_any_shape_holding_their_elements(fn):
    """A_log as [1, 1, HV, 1] (FLA's tests make it so) and dt_bias as [HV, K]: the same gate as
    the flat [HV] and [HV * K], and A_log's gradient comes back in the caller's shape."""
    x = inputs(g=torch.randn(B, T, HV, K))
    A_log, dt_bias = torch.randn(HV), torch.randn(HV * K)
    want = fn(**x, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias)
    A_log4 = A_log.view(1, 1, HV, 1).clone().requires_grad_(fn is chunk_kda)
    got = fn(**x, use_gate_in_kernel=True, A_log=A_log4, dt_bias=dt_bias.view(HV, K))
    assert_same([t.detach() for t in got if t is not None], [t for t in want if t is not None])
    if fn is chunk_kda:
        got[0].sum().backward()
        assert A_log4.grad.shape == (1, 1, HV, 1)


def test_gate_parameters_are_viewed_not_copied():
    A_log, dt_bias = torch.randn(1, 1, HV, 1), torch.randn(HV, K)
    params = validate_activations(HV, K, torch.device('cpu'), True, A_log, dt_bias, False, None, False, False)
    assert params.A_log.shape == (HV,) and params.dt_bias.shape == (HV * K,)
    assert params.A_log.data_ptr() == A_log.data_ptr() and params.dt_bias.data_ptr() == dt_bias.data_ptr()


@pytest.mark.parametrize('varlen', [False, True], ids=['dense', 'varlen'])
def test_intermediate_states_come_in_q_dtype(varlen):
    """FLA returns h in the input dtype; intermediate_states_dtype=torch.float32 keeps the float32
    states as computed (the same values, before rounding)."""
    x = inputs(dtype=torch.bfloat16)
    opts = dict(output_final_state=True, return_intermediate_states=True, chunk_size=32)
    if varlen:
        x = {n: t[:1] for n, t in x.items()}
        opts['cu_seqlens'] = torch.tensor([0, 13, T])
    with torch.inference_mode():
        o, ht, h = chunk_kda(**x, **opts)
        o32, ht32, h32 = chunk_kda(**x, **opts, intermediate_states_dtype=torch.float32)
    assert h.dtype == torch.bfloat16 and h32.dtype == torch.float32
    assert ht.dtype == torch.float32, "the final state stays float32 (API.md)"
    assert torch.equal(h, h32.to(torch.bfloat16)) and torch.equal(o, o32)


@pytest.mark.parametrize('bad', ['float32', torch.int32, torch.float64])
def test_intermediate_states_dtype_must_be_a_float_dtype(bad):
    with pytest.raises(TypeError, match='intermediate_states_dtype must be None'):
        chunk_kda(**inputs(), return_intermediate_states=True, intermediate_states_dtype=bad)


def test_chunk_size_16_gives_flas_message():
    with pytest.raises(ValueError, match=r"`chunk_size` must be either 32 or 64"):
        chunk_kda(**inputs(), chunk_size=16)


def test_cp_context_must_come_from_build_cp_context():
    with pytest.raises(TypeError, match='cp_context must be a CPContext'):
        chunk_kda(**inputs(), cp_context=object())


@pytest.mark.parametrize('options,exc,message', [
    ({'use_graph': 'yes'}, TypeError, 'use_graph must be a bool'),
    ({'max_num_seqs': 4}, ValueError, 'without use_graph=True'),
    ({'use_graph': True, 'max_num_seqs': True}, TypeError, 'max_num_seqs must be an int')])
def test_graph_options_are_checked(options, exc, message):
    with pytest.raises(exc, match=message):
        chunk_kda(**inputs(), **options)


@pytest.mark.parametrize('fn', FUNCTIONS.values(), ids=FUNCTIONS.keys())
def test_unknown_keywords_are_refused(fn):
    with pytest.raises(TypeError, match='head_first'):
        fn(**inputs(), head_first=False)


def test_dtype_message_names_each_dtype_once():
    with pytest.raises(TypeError) as e:
        chunk_kda(**inputs(g=-torch.rand(B, T, HV, K).bfloat16()))
    msg = str(e.value)
    assert 'float32 or float32' not in msg and 'g must have' in msg and 'bfloat16' in msg, msg


@pytest.mark.slow
def test_head_first_shapes_warn():
    """[B, H, T, K] passed as [B, T, H, K]: 3 'tokens' of 8 'heads' warns; as many tokens as heads,
    or more, does not."""
    x = make_inputs(1, 3, 8, 8, K, V)
    with pytest.warns(UserWarning, match=r'T = 3 tokens but H = 8 heads.*head-first'):
        chunk_kda(**x)
    no_warnings(chunk_kda, **make_inputs(1, 8, 8, 8, K, V))


def test_positional_scale_in_fused_recurrent_is_named():
    """FLA's fused_recurrent_kda takes A_log 6th: a scale passed there is refused with a hint,
    where FLA would silently drop it."""
    x = inputs()
    with pytest.raises(TypeError, match=r'A_log must be a torch.Tensor or None, got float.*scale=\.\.\. by keyword'):
        fused_recurrent_kda(*x.values(), 0.5)


@pytest.mark.parametrize('fn', FUNCTIONS.values(), ids=FUNCTIONS.keys())
def test_lower_bound_below_minus_5_without_safe_gate(fn):
    """FLA takes any negative lower_bound without safe_gate. Steps of down to -12 span more than
    FAR_SPAN within a 16-row block, so the pair kernels must take their general build (with the
    far-entry fallback), not the one that -5 allows; outputs and every gradient match the float64
    recurrence of the activated gate."""
    from kda.ops.gate import activate_gate
    x = make_inputs(1, T, H, HV, K, V, normalize_k=False)
    x['g'] = 4 * torch.randn(1, T, HV, K)                     # sigmoid near 0 and 1: steps -12..0
    A_log, dt_bias = torch.randn(HV) * 0.3, torch.randn(HV * K) * 0.3
    leaves = {n: t.clone().requires_grad_(fn is chunk_kda) for n, t in dict(x, A_log=A_log, dt_bias=dt_bias).items()}
    opts = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, lower_bound=-12.0)
    o, _ = fn(**{n: leaves[n] for n in x}, A_log=leaves['A_log'], dt_bias=leaves['dt_bias'], **opts)
    ref = {n: t.detach().double().requires_grad_(fn is chunk_kda) for n, t in leaves.items()}
    g64 = activate_gate(ref['g'], ref['A_log'], ref['dt_bias'], -12.0).double()
    assert g64.min() < -10, "the test must reach steps far below -5"
    o64, _ = naive_recurrent_kda(ref['q'], ref['k'], ref['v'], g64, ref['beta'], use_qk_l2norm_in_kernel=True)
    assert rel_err(o, o64) < 2e-5
    if fn is chunk_kda:
        do = torch.randn_like(o64)
        o.backward(do.float())
        o64.backward(do)
        for name in leaves:
            assert rel_err(leaves[name].grad, ref[name].grad) < 2e-5, f"d{name}"
