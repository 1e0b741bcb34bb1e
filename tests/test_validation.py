"""Bad input to ``fused_recurrent_kda``: every malformed call raises ValueError or TypeError at the
public boundary, with a message naming the argument, before anything is computed (docs/API.md)."""
from __future__ import annotations

import pytest
import torch

import kda.ops.fused_recurrent as fr
from kda import fused_recurrent_kda
from conftest import make_cu_seqlens, make_inputs, make_state

B, T, H, HV, K, V = 2, 3, 2, 4, 8, 6      # K != V, HV = 2 H: layout and grouping errors are visible


def base(**over):
    """A valid call (as keyword arguments), with `over` applied on top."""
    kw = dict(make_inputs(B, T, H, HV, K, V), initial_state=make_state(B, HV, K, V),
              output_final_state=True)
    kw.update(over)
    return kw


def varlen(lengths=(2, 0, 1), **over):
    kw = dict(make_inputs(1, sum(lengths), H, HV, K, V), cu_seqlens=make_cu_seqlens(lengths))
    kw.update(over)
    return kw


def gate(**over):
    kw = base(use_gate_in_kernel=True, A_log=torch.randn(HV), dt_bias=torch.randn(HV * K))
    kw.update(over)
    return kw


def _raise(*args, **kwargs):
    raise RuntimeError("computation started on a call that should have been rejected")


class _NoLaunch:
    def __getitem__(self, grid):
        return _raise


@pytest.fixture
def no_compute(monkeypatch):
    """Makes any computation fail loudly, so a ValueError/TypeError can only come from validation."""
    monkeypatch.setattr(fr, 'fused_recurrent_kda_kernel', _NoLaunch())
    monkeypatch.setattr(fr, '_torch_path', _raise)
    monkeypatch.setattr(fr, 'naive_recurrent_kda', _raise)


def q_(*shape, dtype=torch.float32):
    return torch.randn(*shape).to(dtype)


CASES = [
    # ----- ranks and shapes of q, k, v, g, beta
    ('q 3-D', lambda: base(q=q_(B, T, H * K)), ValueError, r'q must be 4-D'),
    ('q 5-D', lambda: base(q=q_(B, T, H, K, 1)), ValueError, r'q must be 4-D'),
    ('k other K', lambda: base(k=q_(B, T, H, K + 1)), ValueError, r'k must have shape'),
    ('k other T', lambda: base(k=q_(B, T + 1, H, K)), ValueError, r'k must have shape'),
    ('k 3-D', lambda: base(k=q_(B, T, H)), ValueError, r'k must have shape'),
    ('v 3-D', lambda: base(v=q_(B, T, HV)), ValueError, r'v must have shape'),
    ('v other B', lambda: base(v=q_(B + 1, T, HV, V)), ValueError, r'v must have shape'),
    ('v other T', lambda: base(v=q_(B, T - 1, HV, V)), ValueError, r'v must have shape'),
    ('g with H heads', lambda: base(g=-q_(B, T, H, K).abs()), ValueError, r'g must have shape'),
    ('g other K', lambda: base(g=-q_(B, T, HV, K + 2).abs()), ValueError, r'g must have shape'),
    ('g 3-D', lambda: base(g=-q_(B, T, HV).abs()), ValueError, r'g must have shape'),
    ('beta 4-D', lambda: base(beta=q_(B, T, HV, 1)), ValueError, r'beta must have shape'),
    ('beta with H heads', lambda: base(beta=q_(B, T, H)), ValueError, r'beta must have shape'),
    ('beta 2-D', lambda: base(beta=q_(B, T)), ValueError, r'beta must have shape'),
    # ----- head grouping and head dims
    ('HV % H != 0', lambda: base(v=q_(B, T, 3, V), g=-q_(B, T, 3, K).abs(), beta=q_(B, T, 3),
                                 initial_state=make_state(B, 3, K, V)), ValueError, r'HV = 3.*H = 2'),
    ('HV = 0', lambda: base(v=q_(B, T, 0, V), g=-q_(B, T, 0, K).abs(), beta=q_(B, T, 0),
                            initial_state=None), ValueError, r'HV = 0'),
    ('HV < H', lambda: base(v=q_(B, T, 1, V), g=-q_(B, T, 1, K).abs(), beta=q_(B, T, 1),
                            initial_state=make_state(B, 1, K, V)), ValueError, r'HV = 1'),
    ('K > 256', lambda: base(**make_inputs(1, 1, 1, 1, 257, 4), initial_state=None, output_final_state=False),
     ValueError, r'head dim K .*257'),
    ('V > 256', lambda: base(**make_inputs(1, 1, 1, 1, 4, 300), initial_state=None, output_final_state=False),
     ValueError, r'head dim V .*300'),
    # ----- dtypes and non-tensors
    ('q float64', lambda: base(q=q_(B, T, H, K, dtype=torch.float64)), TypeError, r'q must have dtype'),
    ('q int', lambda: base(q=q_(B, T, H, K, dtype=torch.int32)), TypeError, r'q must have dtype'),
    ('k bf16 vs q f32', lambda: base(k=q_(B, T, H, K, dtype=torch.bfloat16)), TypeError, r"k must have q's dtype"),
    ('v f16 vs q f32', lambda: base(v=q_(B, T, HV, V, dtype=torch.float16)), TypeError, r"v must have q's dtype"),
    ('g float64', lambda: base(g=q_(B, T, HV, K, dtype=torch.float64)), TypeError, r'g must have'),
    ('g bf16 vs q f32', lambda: base(g=q_(B, T, HV, K, dtype=torch.bfloat16)), TypeError, r'g must have'),
    ('beta f16 vs q bf16', lambda: base(**dict(make_inputs(B, T, H, HV, K, V, dtype=torch.bfloat16),
                                               beta=q_(B, T, HV, dtype=torch.float16))), TypeError, r'beta must have'),
    ('q list', lambda: base(q=q_(B, T, H, K).tolist()), TypeError, r'q must be a torch.Tensor'),
    ('k numpy', lambda: base(k=q_(B, T, H, K).numpy()), TypeError, r'k must be a torch.Tensor'),
    ('v None', lambda: base(v=None), TypeError, r'v must be a torch.Tensor'),
    ('beta float', lambda: base(beta=0.5), TypeError, r'beta must be a torch.Tensor'),
    ('g int', lambda: base(g=0), TypeError, r'g must be a torch.Tensor'),
    ('scale str', lambda: base(scale='0.5'), TypeError, r'scale'),
    ('scale tensor', lambda: base(scale=torch.tensor(0.5)), TypeError, r'scale'),
    ('scale int beyond float', lambda: base(scale=10 ** 400), ValueError, r'scale must fit a float'),
    ('output_final_state str', lambda: base(output_final_state='yes'), TypeError, r'output_final_state'),
    ('state_v_first int', lambda: base(state_v_first=1), TypeError, r'state_v_first'),
    ('l2norm None', lambda: base(use_qk_l2norm_in_kernel=None), TypeError, r'use_qk_l2norm_in_kernel'),
    # ----- cu_seqlens
    ('cu_seqlens not from 0', lambda: varlen(cu_seqlens=torch.tensor([1, 2, 3])), ValueError,
     r'cu_seqlens must start at 0'),
    ('cu_seqlens decreasing', lambda: varlen(cu_seqlens=torch.tensor([0, 2, 1, 3])), ValueError,
     r'cu_seqlens must be non-decreasing'),
    ('cu_seqlens short of T', lambda: varlen(cu_seqlens=torch.tensor([0, 1, 2])), ValueError,
     r'cu_seqlens must end at T = 3'),
    ('cu_seqlens past T', lambda: varlen(cu_seqlens=torch.tensor([0, 1, 4])), ValueError, r'cu_seqlens must end at T'),
    ('cu_seqlens float', lambda: varlen(cu_seqlens=torch.tensor([0., 1., 3.])), TypeError, r'cu_seqlens .*float'),
    ('cu_seqlens with B > 1', lambda: base(cu_seqlens=torch.tensor([0, 1, T]), initial_state=None),
     ValueError, r'cu_seqlens.*B = 2'),
    ('cu_seqlens 2-D', lambda: varlen(cu_seqlens=torch.tensor([[0, 3]])), ValueError, r'cu_seqlens must be a 1-D'),
    ('cu_seqlens [0]', lambda: varlen(cu_seqlens=torch.tensor([0])), ValueError, r'cu_seqlens must be a 1-D'),
    ('cu_seqlens list', lambda: varlen(cu_seqlens=[0, 3]), TypeError, r'cu_seqlens must be a torch.Tensor'),
    ('cu_seqlens_cpu alone', lambda: base(cu_seqlens_cpu=torch.tensor([0, 3])), ValueError, r'cu_seqlens_cpu'),
    ('cu_seqlens_cpu other shape', lambda: varlen(cu_seqlens_cpu=torch.tensor([0, 3])), ValueError, r'cu_seqlens_cpu'),
    # cu_seqlens on the CPU is read (no sync there): a host copy that disagrees, even a well-formed
    # one, is an error, not a choice of one of the two (review: the kernel read cu_seqlens
    # unchecked, out of bounds for [0, 3, 600] with the host copy [0, 3, 6]).
    ('cu_seqlens_cpu other values', lambda: varlen(cu_seqlens_cpu=torch.tensor([0, 1, 1, 3])), ValueError,
     r"cu_seqlens_cpu must hold cu_seqlens' values \[0, 2, 2, 3\], got \[0, 1, 1, 3\]"),
    ('cu_seqlens past T, host copy fine', lambda: varlen(cu_seqlens=torch.tensor([0, 2, 2, 600]),
                                                        cu_seqlens_cpu=torch.tensor([0, 2, 2, 3])),
     ValueError, r"cu_seqlens_cpu must hold cu_seqlens' values"),
    ('cu_seqlens_cpu neither on the host nor on q\'s device',
     lambda: varlen(cu_seqlens_cpu=torch.tensor([0, 2, 2, 3], device='meta')),
     ValueError, r'cu_seqlens_cpu must be on the CPU.*or on cpu like q, got meta'),
    # ----- initial_state
    ('state wrong N', lambda: base(initial_state=make_state(B + 1, HV, K, V)), ValueError,
     r'initial_state must have shape \[2, 4, 8, 6\]'),
    ('state wrong N varlen', lambda: varlen(initial_state=make_state(1, HV, K, V)), ValueError,
     r'initial_state must have shape \[3, 4, 8, 6\]'),
    ('state H heads', lambda: base(initial_state=make_state(B, H, K, V)), ValueError, r'initial_state must have shape'),
    ('state [V, K] layout', lambda: base(initial_state=make_state(B, HV, V, K)), ValueError,
     r'initial_state must have shape.*\[N, HV, K, V\]'),
    ('state_v_first with [K, V] state', lambda: base(initial_state=make_state(B, HV, K, V), state_v_first=True),
     ValueError, r'initial_state must have shape \[2, 4, 6, 8\].*state_v_first'),
    ('state 3-D', lambda: base(initial_state=make_state(B, HV, K, V)[0]), ValueError, r'initial_state must have shape'),
    ('state float64', lambda: base(initial_state=make_state(B, HV, K, V, dtype=torch.float64)), TypeError,
     r'initial_state must have dtype'),
    ('state list', lambda: base(initial_state=[[0.0]]), TypeError, r'initial_state must be a torch.Tensor'),
    # ----- gate / beta activation options
    ('allow_neg_eigval without beta sigmoid', lambda: base(allow_neg_eigval=True), ValueError, r'allow_neg_eigval'),
    ('safe_gate without lower_bound', lambda: gate(safe_gate=True), ValueError, r'safe_gate.*lower_bound'),
    ('lower_bound -6 safe', lambda: gate(lower_bound=-6.0, safe_gate=True), ValueError,
     r'lower_bound must lie in \[-5, 0\) with safe_gate=True, got -6'),
    ('lower_bound 0', lambda: gate(lower_bound=0.0), ValueError, r'lower_bound must be finite and < 0'),
    ('lower_bound positive', lambda: gate(lower_bound=0.5), ValueError, r'lower_bound must be finite and < 0'),
    ('lower_bound nan', lambda: gate(lower_bound=float('nan')), ValueError, r'lower_bound must be finite'),
    ('lower_bound -inf', lambda: gate(lower_bound=float('-inf')), ValueError, r'lower_bound must be finite'),
    ('lower_bound str', lambda: gate(lower_bound='-1'), TypeError, r'lower_bound'),
    ('gate without A_log or lower_bound', lambda: gate(A_log=None), ValueError, r'A_log'),
    ('gate without anything', lambda: gate(A_log=None, dt_bias=None), ValueError, r'A_log'),
    # (A_log, dt_bias, lower_bound without the gate: ignored with a warning, test_fla_compat.py)
    ('A_log [H]', lambda: gate(A_log=torch.randn(H)), ValueError, r'A_log must hold HV = 4 elements.*got shape \[2\]'),
    ('A_log [1, 1, H, 1]', lambda: gate(A_log=torch.randn(1, 1, H, 1)), ValueError, r'A_log must hold HV = 4'),
    ('A_log float (a scale by position)', lambda: base(A_log=0.5), TypeError, r'A_log must be a torch.Tensor.*scale'),
    ('A_log bf16', lambda: gate(A_log=torch.randn(HV).bfloat16()), TypeError, r'A_log must have dtype'),
    ('A_log list', lambda: gate(A_log=[0.0] * HV), TypeError, r'A_log must be a torch.Tensor'),
    ('dt_bias [HV, K + 1]', lambda: gate(dt_bias=torch.randn(HV, K + 1)), ValueError,
     r'dt_bias must hold HV \* K = 32 elements'),
    ('dt_bias [H * K]', lambda: gate(dt_bias=torch.randn(H * K)), ValueError, r'dt_bias must hold'),
    ('dt_bias f16', lambda: gate(dt_bias=torch.randn(HV * K).half()), TypeError, r'dt_bias must have dtype'),
    ('use_gate_in_kernel int', lambda: gate(use_gate_in_kernel=1), TypeError, r'use_gate_in_kernel'),
    ('beta sigmoid str', lambda: base(use_beta_sigmoid_in_kernel='yes'), TypeError, r'use_beta_sigmoid_in_kernel'),
    # ----- serving options
    ('indices without inplace', lambda: base(ssm_state_indices=torch.tensor([0, 1])), ValueError,
     r'ssm_state_indices requires inplace_final_state'),
    ('indices without state', lambda: base(ssm_state_indices=torch.tensor([0, 1]), initial_state=None,
                                           inplace_final_state=True), ValueError,
     r'ssm_state_indices requires initial_state'),
    ('indices wrong length', lambda: base(ssm_state_indices=torch.tensor([0, 1, 2]), inplace_final_state=True,
                                          initial_state=make_state(5, HV, K, V)), ValueError,
     r'ssm_state_indices must have shape \[2\]'),
    ('indices float', lambda: base(ssm_state_indices=torch.tensor([0., 1.]), inplace_final_state=True),
     TypeError, r'ssm_state_indices'),
    ('indices list', lambda: base(ssm_state_indices=[0, 1], inplace_final_state=True),
     TypeError, r'ssm_state_indices must be a torch.Tensor'),
    ('pool wrong HV', lambda: base(ssm_state_indices=torch.tensor([0, 1]), inplace_final_state=True,
                                   initial_state=make_state(5, H, K, V)), ValueError,
     r'initial_state must be a state pool \[P, HV, K, V\] = \[P, 4, 8, 6\].*got \[5, 2, 8, 6\]'),
    ('pool wrong layout', lambda: base(ssm_state_indices=torch.tensor([0, 1]), inplace_final_state=True,
                                       initial_state=make_state(5, HV, V, K)), ValueError,
     r'initial_state must be a state pool'),
    ('pool empty', lambda: base(ssm_state_indices=torch.tensor([0, 1]), inplace_final_state=True,
                                initial_state=make_state(0, HV, K, V)), ValueError,
     r'initial_state must be a state pool.*P >= 1.*got \[0, 4, 8, 6\]'),
    ('pool 3-D', lambda: base(ssm_state_indices=torch.tensor([0, 1]), inplace_final_state=True,
                              initial_state=make_state(5, HV, K, V)[0]), ValueError,
     r'initial_state must be a state pool.*got \[4, 8, 6\]'),
    ('pool float64', lambda: base(ssm_state_indices=torch.tensor([0, 1]), inplace_final_state=True,
                                  initial_state=make_state(5, HV, K, V, dtype=torch.float64)), TypeError,
     r'initial_state must have dtype'),
    ('inplace without state', lambda: base(initial_state=None, inplace_final_state=True), ValueError,
     r'inplace_final_state=True requires initial_state'),
    ('inplace non-contiguous state', lambda: base(initial_state=make_state(B, HV, V, K).transpose(-1, -2),
                                                  inplace_final_state=True), ValueError,
     r'inplace_final_state=True requires a contiguous initial_state'),
    ('inplace int', lambda: base(inplace_final_state=1), TypeError, r'inplace_final_state'),
    # The kernel writes the state and out behind autograd's back, so a tensor that requires grad
    # (a leaf, or not: the write could not be recorded either way) is refused rather than
    # silently overwritten.
    ('inplace state requiring grad', lambda: base(initial_state=make_state(B, HV, K, V).requires_grad_(),
                                                  inplace_final_state=True), ValueError,
     r'inplace_final_state=True would overwrite initial_state, which requires grad'),
    ('inplace non-leaf state requiring grad',
     lambda: base(initial_state=make_state(B, HV, K, V).requires_grad_() * 1, inplace_final_state=True),
     ValueError, r'inplace_final_state=True would overwrite initial_state, which requires grad'),
    ('out requiring grad', lambda: base(out=torch.empty(B, T, HV, V, requires_grad=True)), ValueError,
     r'out requires grad'),
    ('out wrong shape', lambda: base(out=torch.empty(B, T, H, V)), ValueError, r'out must have shape \[2, 3, 4, 6\]'),
    ('out wrong T', lambda: base(out=torch.empty(B, T + 1, HV, V)), ValueError, r'out must have shape'),
    ('out wrong dtype', lambda: base(out=torch.empty(B, T, HV, V, dtype=torch.bfloat16)), TypeError,
     r"out must have q's dtype"),
    ('out non-contiguous', lambda: base(out=torch.empty(B, T, V, HV).transpose(-1, -2)), ValueError,
     r'out must be a contiguous'),
    ('out list', lambda: base(out=[]), TypeError, r'out must be a torch.Tensor'),
    ('out on another device', lambda: base(out=torch.empty(B, T, HV, V, device='meta')), ValueError,
     r'out must be a contiguous tensor on cpu, got a tensor on meta'),
]


@pytest.mark.parametrize('make,exc,match', [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_malformed_call_raises(no_compute, make, exc, match):
    kwargs = make()
    state = kwargs.get('initial_state')
    before = state.clone() if isinstance(state, torch.Tensor) else None
    with pytest.raises(exc, match=match):
        fused_recurrent_kda(**kwargs)
    if before is not None:
        assert torch.equal(state, before), "a rejected call modified initial_state"


# safe_gate with g given: a promise FLA accepts (its docstring: the caller provides bounded gates).
@pytest.mark.parametrize('make', [base, varlen, gate, lambda: base(out=torch.empty(B, T, HV, V)),
                                  lambda: base(safe_gate=True)],
                         ids=['base', 'varlen', 'gate', 'out', 'safe_gate-given-g'])
def test_valid_calls_are_accepted(make):
    """The positive control for the table above: the unmodified calls run (and give finite values)."""
    o, _ = fused_recurrent_kda(**make())
    assert torch.isfinite(o).all(), "a valid call gave non-finite output"


def test_messages_say_what_was_got_and_expected(no_compute):
    with pytest.raises(ValueError) as e:
        fused_recurrent_kda(**base(g=-q_(B, T, H, K).abs()))
    msg = str(e.value)
    assert 'g' in msg and str([B, T, HV, K]) in msg and str([B, T, H, K]) in msg, f"message lacks got/expected: {msg}"
