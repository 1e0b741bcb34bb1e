"""The KDA layer (``kda.layers.KimiDeltaAttention``) and its pieces against float64 references.

* ``short_conv`` and ``gated_rms_norm``: forward and backward against their PyTorch references
  run in float64 (float32 results within 1e-5).
* The layer: forward and every parameter's gradient against ``reference_layer`` below, a float64
  PyTorch statement of the whole layer written from FLA's layer definition (its gate and norm
  formulas spelt out here, the recurrence by ``naive_recurrent_kda``); prefill + decode equals one
  prefill; a padding mask equals the packed batch; the fused decode step equals the unfused one.
* Parameter names and shapes against FLA's layer (``FLA_PARAMETERS``, written down from
  ``fla/layers/kda.py``), and the transformers ``kimi_linear`` mapping.

The ``path`` fixture runs a test through the Triton kernels in the interpreter (``kernel``,
needs ``TRITON_INTERPRET=1``) and through the PyTorch CPU path (``torch``).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kda.ops.decode_step as decode_step_mod
import kda.ops.gated_norm as gated_norm_mod
import kda.ops.short_conv as short_conv_mod
import kda.ops.chunk.api as chunk_mod
import kda.ops.fused_recurrent as fused_recurrent_mod
from kda import naive_recurrent_kda
from kda.layers import KimiDeltaAttention, hf_kimi_linear_to_fla
from kda.ops.decode_step import DecodeWorkspace, decode_step_reference, kda_decode_step
from kda.ops.gated_norm import gated_rms_norm
from kda.ops.short_conv import short_conv, short_conv_reference
from kda.ops.utils import INTERPRET
from conftest import make_cu_seqlens, rel_err

TOL = 1e-5
PATCHED = (short_conv_mod, gated_norm_mod, decode_step_mod, chunk_mod, fused_recurrent_mod)
# A small layer with grouped value heads: hidden 32, H = 2, HV = 4, K = V = 16, 3 taps.
SMALL = dict(hidden_size=32, head_dim=16, num_heads=2, num_v_heads=4, conv_size=3, layer_idx=0)
# Fewer heads for training in the interpreter, whose cost grows with the programs launched.
TINY = dict(SMALL, num_heads=1, num_v_heads=2)


@pytest.fixture(params=['kernel', 'torch'])
def path(request, monkeypatch):
    if request.param == 'kernel':
        if not INTERPRET:
            pytest.skip("the kernel path needs TRITON_INTERPRET=1 on CPU")
    else:
        for mod in PATCHED:
            monkeypatch.setattr(mod, 'use_kernels', lambda x: False)
    return request.param


def leaves64(*xs):
    return [x.detach().double().requires_grad_() for x in xs]


# --------------------------------------------------------------------------------------------
# The pieces

@pytest.mark.parametrize('case', ['dense, state, bias', 'varlen, empty sequence, state'])
def test_short_conv_matches_reference(path, case):
    D, W = 12, 4
    if case.startswith('varlen'):
        lengths = [5, 0, 1, 35]
        cu, B, T, N = make_cu_seqlens(lengths), 1, sum(lengths), len(lengths)
    else:
        cu, B, T, N = None, 2, 37, 2
    x = torch.randn(B, T, D, requires_grad=True)
    w = torch.randn(D, 1, W, requires_grad=True)
    b = torch.randn(D, requires_grad=True) if 'bias' in case else None
    h0 = torch.randn(N, D, W, requires_grad=True)
    inputs = [t for t in (x, w, b, h0) if t is not None]
    y, ht = short_conv(x, w, b, h0, True, cu_seqlens=cu)
    dy, dht = torch.randn_like(y), torch.randn_like(ht)
    grads = torch.autograd.grad((y * dy).sum() + (ht * dht).sum(), inputs)
    ref_in = leaves64(*inputs)
    x64, w64, b64, h64 = ref_in if b is not None else (ref_in[0], ref_in[1], None, ref_in[2])
    y64, ht64 = short_conv_reference(x64, w64, b64, h64, True, cu_seqlens=cu)
    ref_grads = torch.autograd.grad((y64 * dy.double()).sum() + (ht64 * dht.double()).sum(), ref_in)
    assert rel_err(y, y64) < TOL
    assert rel_err(ht, ht64) < TOL
    for name, g, r in zip(['x', 'weight', 'bias', 'initial_state'] if b is not None
                          else ['x', 'weight', 'initial_state'], grads, ref_grads):
        assert rel_err(g, r) < TOL, name


def test_short_conv_reference_is_a_causal_conv1d():
    """The reference itself: nn.Conv1d's causal part, SiLU, and the window of the last W inputs."""
    x, w = torch.randn(2, 9, 5, dtype=torch.float64), torch.randn(5, 1, 4, dtype=torch.float64)
    y, ht = short_conv_reference(x, w, None, None, True)
    z = F.conv1d(x.transpose(1, 2), w, padding=3, groups=5)[..., :9]
    assert torch.allclose(y, F.silu(z).transpose(1, 2))
    assert torch.equal(ht, x[:, -4:].transpose(1, 2))


def test_gated_norm_matches_reference(path):
    x = torch.randn(3, 5, 24, requires_grad=True)
    gate = torch.randn(3, 5, 24, requires_grad=True)
    w = torch.randn(24, requires_grad=True)
    y = gated_rms_norm(x, gate, w, 1e-5)
    dy = torch.randn_like(y)
    grads = torch.autograd.grad((y * dy).sum(), [x, gate, w])
    x64, g64, w64 = leaves64(x, gate, w)
    xf = x64
    y64 = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5) * w64 * torch.sigmoid(g64)
    ref_grads = torch.autograd.grad((y64 * dy.double()).sum(), [x64, g64, w64])
    assert rel_err(y, y64) < TOL
    for name, g, r in zip(['x', 'gate', 'weight'], grads, ref_grads):
        assert rel_err(g, r) < TOL, name


# --------------------------------------------------------------------------------------------
# The whole layer

def reference_layer(layer, p, x, cu_seqlens=None, state=None):
    """The layer in float64 on ``x`` ``[B, T, hidden]`` with parameters ``p`` (FLA's names);
    ``state = (conv windows, recurrent state)`` before the tokens. Returns ``(y, state after)``."""
    B, T, _ = x.shape
    H, HV, K, V = layer.num_heads, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim
    convs, h0 = state if state is not None else ((None, None, None), None)
    acts, windows = [], []
    for which, window in zip('qkv', convs):
        proj = F.linear(x, p[f'{which}_proj.weight'])
        if layer.use_short_conv:
            a, ht = short_conv_reference(proj, p[f'{which}_conv1d.weight'], p.get(f'{which}_conv1d.bias'),
                                         window, True, cu_seqlens=cu_seqlens)
            windows.append(ht)
        else:
            a = F.silu(proj)
        acts.append(a)
    q, k = (a.view(B, T, H, K) for a in acts[:2])
    v = acts[2].view(B, T, HV, V)
    graw = F.linear(F.linear(x, p['f_proj.0.weight']), p['f_proj.1.weight']).view(B, T, HV, K) \
        + p['dt_bias'].view(HV, K)
    if layer.lower_bound is None:
        g = -p['A_log'].exp()[:, None] * F.softplus(graw)
    else:
        g = layer.lower_bound * torch.sigmoid(p['A_log'].exp()[:, None] * graw)
    beta = torch.sigmoid(F.linear(x, p['b_proj.weight'])) * (2 if layer.allow_neg_eigval else 1)
    o, ht = naive_recurrent_kda(q, k, v, g, beta, None, h0, True, use_qk_l2norm_in_kernel=True,
                                cu_seqlens=cu_seqlens)
    gate = F.linear(F.linear(x, p['g_proj.0.weight']), p['g_proj.1.weight'], p['g_proj.1.bias']).view(B, T, HV, V)
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + layer.norm_eps) * p['o_norm.weight'] * torch.sigmoid(gate)
    y = F.linear(o.reshape(B, T, HV * V), p['o_proj.weight'])
    return y, (tuple(windows) if layer.use_short_conv else None, ht)


def params64(layer):
    return {n: t.detach().double().requires_grad_() for n, t in layer.named_parameters()}


@pytest.mark.parametrize('config', [
    pytest.param(dict(), id='softplus gate'),
    pytest.param(dict(lower_bound=-3.0, safe_gate=True, allow_neg_eigval=True, conv_bias=True),
                 id='lower bound, negative eigenvalues, conv bias'),
    pytest.param(dict(use_short_conv=False), id='no short conv'),
])
def test_layer_training_matches_reference(path, config):
    if path == 'kernel' and config:
        pytest.skip("the other gates and options run in the interpreter in the slow tests")
    _training_case(config, TINY if path == 'kernel' else SMALL, batch=1 if path == 'kernel' else 2)


@pytest.mark.slow
@pytest.mark.parametrize('config', [
    pytest.param(dict(lower_bound=-3.0, safe_gate=True, allow_neg_eigval=True, conv_bias=True), id='lower bound'),
    pytest.param(dict(use_short_conv=False), id='no short conv'),
])
def test_layer_training_matches_reference_in_interpreter(config):
    if not INTERPRET:
        pytest.skip("needs TRITON_INTERPRET=1")
    _training_case(config, TINY, batch=1)


def _training_case(config, shape, batch):
    """Training mode (chunk_kda): the output and the gradients of the input and of every
    parameter."""
    layer = KimiDeltaAttention(**shape, **config).train()
    with torch.no_grad():   # make the bias and the norm weight matter
        layer.g_proj[1].bias.normal_()
        layer.o_norm.weight.normal_()
    x = torch.randn(batch, 11, 32, requires_grad=True)
    y, _, _ = layer(x)
    dy = torch.randn_like(y)
    names = [n for n, _ in layer.named_parameters()]
    grads = torch.autograd.grad((y * dy).sum(), [x] + list(layer.parameters()))
    p = params64(layer)
    x64 = x.detach().double().requires_grad_()
    y64, _ = reference_layer(layer, p, x64)
    ref = torch.autograd.grad((y64 * dy.double()).sum(), [x64] + [p[n] for n in names])
    assert rel_err(y, y64) < TOL
    for name, g, r in zip(['hidden_states'] + names, grads, ref):
        assert rel_err(g, r) < TOL, name


@pytest.mark.parametrize('use_short_conv', [True, False])
def test_prefill_then_decode_equals_one_prefill(path, use_short_conv):
    """Prefill 6 tokens, then decode 3 one at a time (the fused step), equals a prefill of 9;
    the cache after both agrees too. Compared with the float64 reference."""
    layer = KimiDeltaAttention(**SMALL, use_short_conv=use_short_conv).eval()
    x = torch.randn(2, 9, 32)
    calls = []
    real_step = decode_step_mod.kda_decode_step

    def counting_step(*args, **kwargs):
        calls.append(1)
        return real_step(*args, **kwargs)

    import kda.layers.kda as layer_mod
    layer_mod.kda_decode_step, saved = counting_step, layer_mod.kda_decode_step
    try:
        with torch.no_grad():
            y_prefill, _, cache = layer(x[:, :6], use_cache=True)
            steps = [layer(x[:, t:t + 1], past_key_values=cache, use_cache=True)[0] for t in range(6, 9)]
    finally:
        layer_mod.kda_decode_step = saved
    assert len(calls) == 3, "the cached one-token steps must take the fused decode step"
    y = torch.cat([y_prefill] + steps, dim=1)
    y64, (windows64, h64) = reference_layer(layer, params64(layer), x.double())
    assert rel_err(y, y64) < TOL
    state = cache[layer.cache_key]
    assert rel_err(state.recurrent_state, h64) < TOL
    if use_short_conv:
        for w, w64 in zip(state.conv_states, windows64):
            assert rel_err(w, w64) < TOL


def test_padding_mask_equals_packed_batch(path):
    """Rows padded anywhere (left, right, fully padded) compute as the packed sequences of their
    tokens; padding positions give zeros; the cached states match the packed call's."""
    layer = KimiDeltaAttention(**SMALL).eval()
    B, T = 4, 7
    mask = torch.ones(B, T, dtype=torch.int64)
    mask[0, :2] = 0            # left padding
    mask[1, 5:] = 0            # right padding
    mask[3] = 0                # no tokens: a sequence of length 0
    x = torch.randn(B, T, 32)
    with torch.no_grad():
        y, _, cache = layer(x, attention_mask=mask, use_cache=True)
        lengths = mask.sum(1).tolist()
        packed = x[mask.bool()][None]
        y_packed, _, cache_packed = layer(packed, cu_seqlens=make_cu_seqlens(lengths), use_cache=True)
    assert torch.equal(y[~mask.bool()], torch.zeros_like(y[~mask.bool()]))
    assert rel_err(y[mask.bool()], y_packed[0]) < TOL
    y64, _ = reference_layer(layer, params64(layer), packed.double(), cu_seqlens=make_cu_seqlens(lengths))
    assert rel_err(y[mask.bool()], y64[0]) < TOL
    assert rel_err(cache[0].recurrent_state, cache_packed[0].recurrent_state) < TOL


@pytest.mark.parametrize('options', [
    pytest.param(dict(), id='conv, softplus gate'),
    pytest.param(dict(conv_bias=True, lower_bound=-2.0, allow_neg_eigval=True), id='conv bias, lower bound'),
    pytest.param(dict(no_conv=True), id='no conv'),
])
def test_fused_decode_step_matches_unfused(path, options):
    """The fused step (kernels, or its PyTorch path) against the unfused step in float64:
    output, recurrent state and convolution windows (updated in place)."""
    options = dict(options)
    no_conv = options.pop('no_conv', False)
    N, H, HV, K, V, W = 3, 2, 4, 16, 8, 4
    rows = dict(q=H * K, k=H * K, v=HV * V, g=HV * K, beta=HV, gate=HV * V)
    x = {n: torch.randn(N, 1, d) for n, d in rows.items()}
    state = 0.3 * torch.randn(N, HV, K, V)
    convs = None if no_conv else dict(
        conv_states=tuple(torch.randn(N, d, W) for d in (H * K, H * K, HV * V)),
        conv_weights=tuple(torch.randn(d, 1, W) for d in (H * K, H * K, HV * V)),
        conv_biases=(tuple(torch.randn(d) for d in (H * K, H * K, HV * V)) if options.pop('conv_bias', False)
                     else None))
    params = dict(A_log=torch.rand(HV).log(), dt_bias=torch.randn(HV * K), norm_weight=torch.randn(V),
                  norm_eps=1e-5, scale=None, **options)
    if no_conv:
        params.update(conv_states=None, conv_weights=None, conv_biases=None)
    else:
        params.update(convs)
    ref_params = {n: (tuple(t.double() if t is not None else None for t in v) if isinstance(v, tuple)
                      else v.double() if isinstance(v, torch.Tensor) else v) for n, v in params.items()}
    params.setdefault('lower_bound', None)
    ref_params.setdefault('lower_bound', None)
    params.setdefault('allow_neg_eigval', False)
    ref_params.setdefault('allow_neg_eigval', False)
    state64 = state.double()
    y64 = decode_step_reference(*(x[n].double() for n in rows), state64, **ref_params)
    out = torch.empty(N, 1, HV * V)
    workspace = DecodeWorkspace.empty(N, H * K, HV * V, 'cpu')
    y = kda_decode_step(*(x[n] for n in rows), state, out=out, workspace=workspace, **params)
    assert y is out
    assert rel_err(y, y64) < TOL
    assert rel_err(state, state64) < TOL
    if not no_conv:
        for s, s64 in zip(params['conv_states'], ref_params['conv_states']):
            assert rel_err(s, s64) < TOL


def test_decode_step_reference_is_the_layer_step():
    """The unfused step the fused one is compared with continues the float64 layer reference."""
    layer = KimiDeltaAttention(**SMALL, conv_bias=True)
    p = params64(layer)
    x = torch.randn(2, 5, 32, dtype=torch.float64)
    with torch.no_grad():
        y_full, _ = reference_layer(layer, p, x)
        _, (windows, h) = reference_layer(layer, p, x[:, :4])
        t = x[:, 4:5]

        def lin(name, z):
            return F.linear(z, p[name + '.weight'], p.get(name + '.bias'))
        y = decode_step_reference(
            lin('q_proj', t), lin('k_proj', t), lin('v_proj', t), lin('f_proj.1', lin('f_proj.0', t)),
            lin('b_proj', t), lin('g_proj.1', lin('g_proj.0', t)), h.clone(),
            A_log=p['A_log'], dt_bias=p['dt_bias'], norm_weight=p['o_norm.weight'], norm_eps=layer.norm_eps,
            conv_states=tuple(w.clone() for w in windows),
            conv_weights=tuple(p[f'{c}_conv1d.weight'] for c in 'qkv'),
            conv_biases=tuple(p[f'{c}_conv1d.bias'] for c in 'qkv'), lower_bound=None,
            allow_neg_eigval=False, scale=None)
    assert rel_err(lin('o_proj', y), y_full[:, 4:5]) < 1e-12


# --------------------------------------------------------------------------------------------
# Parameters, checkpoints, refusals

def fla_parameters(hidden, K, H, HV, V, W, conv_bias):
    """FLA's ``KimiDeltaAttention`` parameters (names and shapes), as its definition creates them."""
    p = {'q_proj.weight': (H * K, hidden), 'k_proj.weight': (H * K, hidden), 'v_proj.weight': (HV * V, hidden),
         'q_conv1d.weight': (H * K, 1, W), 'k_conv1d.weight': (H * K, 1, W), 'v_conv1d.weight': (HV * V, 1, W),
         'f_proj.0.weight': (V, hidden), 'f_proj.1.weight': (HV * K, V), 'b_proj.weight': (HV, hidden),
         'A_log': (HV,), 'dt_bias': (HV * K,), 'g_proj.0.weight': (V, hidden), 'g_proj.1.weight': (HV * V, V),
         'g_proj.1.bias': (HV * V,), 'o_norm.weight': (V,), 'o_proj.weight': (hidden, HV * V)}
    if conv_bias:
        p.update({'q_conv1d.bias': (H * K,), 'k_conv1d.bias': (H * K,), 'v_conv1d.bias': (HV * V,)})
    return p


@pytest.mark.parametrize('conv_bias', [False, True])
def test_state_dict_has_fla_names_and_round_trips(conv_bias):
    layer = KimiDeltaAttention(hidden_size=24, head_dim=8, num_heads=2, num_v_heads=4, expand_v=2,
                               conv_size=4, conv_bias=conv_bias)
    expected = fla_parameters(24, 8, 2, 4, 16, 4, conv_bias)
    assert {n: tuple(t.shape) for n, t in layer.state_dict().items()} == expected
    fla_like = {n: torch.randn(s) for n, s in expected.items()}
    other = KimiDeltaAttention(hidden_size=24, head_dim=8, num_heads=2, num_v_heads=4, expand_v=2,
                               conv_size=4, conv_bias=conv_bias)
    other.load_state_dict(fla_like)   # strict
    assert all(torch.equal(other.state_dict()[n], t) for n, t in fla_like.items())


def test_initialization_as_fla():
    layer = KimiDeltaAttention(hidden_size=16, head_dim=8, num_heads=64)
    a = layer.A_log.exp()
    assert layer.A_log.dtype == torch.float32 and bool(((a >= 1) & (a <= 16)).all())
    dt = F.softplus(layer.dt_bias)
    assert layer.dt_bias.dtype == torch.float32 and bool(((dt >= 1e-4 * 0.999) & (dt <= 0.1 * 1.001)).all())
    assert layer.dt_bias.std() > 0
    assert torch.equal(layer.o_norm.weight, torch.ones(8))
    safe = KimiDeltaAttention(hidden_size=16, head_dim=8, num_heads=2, safe_gate=True, lower_bound=-5.0)
    assert torch.equal(safe.A_log, torch.zeros(2))


def hf_weights(layer, packed: bool):
    """``layer``'s weights named as a transformers kimi_linear layer (``packed``: transformers'
    module names; else the published checkpoint names), under a model prefix."""
    p = {n: t.detach().clone() for n, t in layer.state_dict().items()}
    HV, K = layer.num_v_heads, layer.head_k_dim
    pre = 'model.layers.3.self_attn.'
    out = {pre + n: p[n] for n in ('q_proj.weight', 'k_proj.weight', 'v_proj.weight', 'o_proj.weight',
                                   'o_norm.weight')}
    if packed:
        out[pre + 'conv1d.weight'] = torch.cat([p[f'{c}_conv1d.weight'] for c in 'qkv'])
        names = dict(f0='forget_gate_down', f1='forget_gate_up', g0='output_gate_down', g1='output_gate_up',
                     b='beta_proj')
        out[pre + 'A_log'], out[pre + 'dt_bias'] = p['A_log'].view(HV, 1), p['dt_bias'].view(HV, K)
    else:
        out.update({pre + f'{c}_conv1d.weight': p[f'{c}_conv1d.weight'] for c in 'qkv'})
        names = dict(f0='f_a_proj', f1='f_b_proj', g0='g_a_proj', g1='g_b_proj', b='b_proj')
        out[pre + 'A_log'], out[pre + 'dt_bias'] = p['A_log'].view(1, 1, HV, 1), p['dt_bias']
    ours = dict(f0='f_proj.0', f1='f_proj.1', g0='g_proj.0', g1='g_proj.1', b='b_proj')
    out.update({pre + names[n] + '.weight': p[ours[n] + '.weight'] for n in names})
    out['model.layers.3.mlp.gate.weight'] = torch.randn(3, 3)   # another module's: ignored
    return out, pre


@pytest.mark.parametrize('packed', [True, False], ids=['transformers modules', 'checkpoint files'])
def test_hf_kimi_linear_mapping_loads_the_layer(packed):
    source = KimiDeltaAttention(**SMALL)
    with torch.no_grad():
        source.g_proj[1].bias.zero_()     # Kimi Linear's output gate has no bias
    weights, prefix = hf_weights(source, packed)
    mapped = hf_kimi_linear_to_fla(weights, prefix)
    target = KimiDeltaAttention(**SMALL)
    target.load_state_dict(mapped)        # strict: every FLA name, nothing else
    for n, t in source.state_dict().items():
        assert torch.equal(target.state_dict()[n], t), n
    with pytest.raises(ValueError, match='unknown weight'):
        hf_kimi_linear_to_fla({**weights, prefix + 'extra.weight': torch.zeros(1)}, prefix)
    with pytest.raises(ValueError, match='full-rank'):
        hf_kimi_linear_to_fla({**weights, prefix + 'output_gate.weight': torch.zeros(1)}, prefix)


@pytest.mark.parametrize('kwargs, error, match', [
    (dict(num_heads=3, num_v_heads=4), ValueError, 'num_v_heads'),
    (dict(expand_v=0.3), ValueError, 'expand_v'),
    (dict(head_dim=512), ValueError, 'head_dim'),
    (dict(mode='parallel'), ValueError, 'mode'),
    (dict(safe_gate=True), ValueError, 'safe_gate'),
    (dict(lower_bound=-6.0), ValueError, 'lower_bound'),
    (dict(conv_size=0), ValueError, 'conv_size'),
    (dict(use_short_conv=1), TypeError, 'use_short_conv'),
    (dict(norm_eps=0.0), ValueError, 'norm_eps'),
    (dict(fuse_norm=True), TypeError, 'fuse_norm'),
])
def test_bad_configuration_is_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        KimiDeltaAttention(**{**dict(hidden_size=16, head_dim=8, num_heads=2), **kwargs})


def test_bad_inputs_are_refused():
    layer = KimiDeltaAttention(**SMALL).eval()
    x = torch.randn(2, 3, 32)
    with pytest.raises(ValueError, match='hidden_states'):
        layer(torch.randn(2, 3, 31))
    with pytest.raises(ValueError, match='attention_mask'):
        layer(x, attention_mask=torch.ones(2, 4))
    with pytest.raises(TypeError, match='past_key_values'):
        layer(x, past_key_values={})
    with torch.no_grad():
        _, _, cache = layer(x, use_cache=True)
    with pytest.raises(ValueError, match='cached state'):
        layer(torch.randn(3, 1, 32), past_key_values=cache, use_cache=True)
    with pytest.raises(ValueError, match='conv_size|W'):
        short_conv(x, torch.randn(32, 17))
    with pytest.raises(ValueError, match='initial_state'):
        short_conv(x, torch.randn(32, 4), initial_state=torch.zeros(2, 32, 3))
    with pytest.raises(ValueError, match='gate'):
        gated_rms_norm(x, torch.randn(2, 3, 30), torch.ones(32))
    state = cache[0]
    before = state.recurrent_state.clone()
    with pytest.raises(TypeError, match='conv_states'):
        kda_decode_step(*(torch.randn(2, 1, d) for d in (32, 32, 64, 64, 4, 64)), state.recurrent_state,
                        A_log=layer.A_log, dt_bias=layer.dt_bias, norm_weight=layer.o_norm.weight,
                        conv_states=state.conv_states[:2], conv_weights=(layer.q_conv1d.weight,) * 3)
    assert torch.equal(state.recurrent_state, before), "a refused call must modify nothing"
