"""Hostile inputs: a non-finite ``scale`` is refused; non-finite values in q, k, v, g, beta or in
an upstream gradient stay where the documented bounds put them.

What the kernels guarantee for a NaN or an infinity at token ``t`` of sequence ``n`` (README,
Numerics), pinned here bit for bit against a clean run of the same call:

* ``fused_recurrent_kda`` is exactly causal: outputs before ``t`` are unchanged.
* ``chunk_kda``'s forward: in q, only ``o_t`` changes (q never enters the state). In k, v, g or
  beta, the outputs of ``t``'s chunk may turn non-finite from the chunk's first token on, not
  only from ``t``: the chunk's products ``M (beta (V - Kg S))`` and ``Aqk dV`` sum ``0 * NaN``
  over the entries above their diagonals. Earlier chunks keep their bits; from ``t`` on every
  output of the heads that read the value is non-finite, and so is their final state.
* ``chunk_kda``'s backward: a non-finite upstream gradient at ``t`` may reach the gradients of
  every token up to the end of ``t``'s chunk (the recurrence's would stop at ``t``); later
  chunks keep their bits. A non-finite input may make that head's gradients non-finite over the
  whole sequence.
* Always: other sequences of a varlen batch, and heads that do not read the value (value heads
  for v, g, beta; the q/k head's group of value heads for q, k), keep their bits.

``g = -inf`` is not hostile: it is a full decay (``exp(-inf) = 0``), computed exactly.
"""
from __future__ import annotations

import functools
import math
import re

import pytest
import torch

from kda import chunk_kda, fused_recurrent_kda, naive_recurrent_kda
from kda.ops.utils import INTERPRET
from conftest import HAS_CUDA, make_cu_seqlens, make_inputs, make_state, reference64, rel_err

KDEV = 'cuda' if HAS_CUDA else 'cpu'
requires_kernels = pytest.mark.skipif(
    not (HAS_CUDA or INTERPRET), reason="needs TRITON_INTERPRET=1 (CPU) or a CUDA GPU to run the kernels")
TOL = 2e-5

# A varlen batch whose middle sequence is poisoned; two q/k heads, each read by two value heads.
LENGTHS = [21, 70, 9]
H, HV, K, V = 2, 4, 16, 16
SEQ = 1
BAD_VALUE_HEAD = 1          # v, g, beta poisoned here: value heads 0, 2, 3 must not see it
BAD_QK_HEAD = 1             # q, k poisoned here: read by value heads 2, 3; 0, 1 must not see it
BAD_CHANNEL = 3


def _dev(d: dict) -> dict:
    return {n: x.to(KDEV) for n, x in d.items()}


def _cu() -> torch.Tensor:
    return make_cu_seqlens(LENGTHS)


@functools.cache
def _batch() -> tuple[dict, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The batch every non-finite case poisons: inputs, initial states, and the upstream gradients
    of o and of the final state (fixed seed, so that each clean run is computed once)."""
    with torch.random.fork_rng():
        torch.manual_seed(20261203)
        x = make_inputs(1, sum(LENGTHS), H, HV, K, V)
        s0 = make_state(len(LENGTHS), HV, K, V)
        do = torch.randn(1, sum(LENGTHS), HV, V)
        dht = torch.randn(len(LENGTHS), HV, K, V)
    return x, s0, do, dht


def _chunk_forward(x: dict, chunk_size: int):
    _, s0, _, _ = _batch()
    with torch.no_grad():
        o, ht = chunk_kda(**_dev(x), initial_state=s0.to(KDEV), output_final_state=True,
                          cu_seqlens=_cu().to(KDEV), chunk_size=chunk_size)
    return o[0].cpu(), ht.cpu()


@functools.cache
def _clean_chunk_forward(chunk_size: int):
    return _chunk_forward(_batch()[0], chunk_size)


def _affected_heads(name: str) -> list[int]:
    if name in ('q', 'k'):
        group = HV // H
        return list(range(BAD_QK_HEAD * group, (BAD_QK_HEAD + 1) * group))
    return [BAD_VALUE_HEAD]


def _poison(x: dict, name: str, token: int, value: float) -> dict:
    """A copy of the inputs with ``value`` at ``token`` in one channel (one head for beta)."""
    y = {n: t.clone() for n, t in x.items()}
    if name == 'beta':
        y['beta'][0, token, BAD_VALUE_HEAD] = value
    else:
        head = BAD_QK_HEAD if name in ('q', 'k') else BAD_VALUE_HEAD
        y[name][0, token, head, BAD_CHANNEL] = value
    return y


def _other_tokens(t0: int, t1: int) -> torch.Tensor:
    """Mask of the packed tokens outside ``[t0, t1)``."""
    keep = torch.ones(sum(LENGTHS), dtype=torch.bool)
    keep[t0:t1] = False
    return keep


def _bitwise(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    a, b = a.cpu(), b.cpu()
    same = (a == b) | (a.isnan() & b.isnan())
    assert same.all(), f"{what}: {int((~same).sum())} entries changed"


def _every_token_non_finite(o: torch.Tensor, what: str) -> None:
    """Every token of ``o`` ``[tokens, heads, V]`` has a non-finite entry in every head."""
    loud = (~o.isfinite()).any(-1)
    assert loud.all(), f"{what}: {int((~loud).sum())} (token, head) outputs stayed finite"


# ----------------------------------------------------------------------------------------------
# scale
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize('fn', [chunk_kda, fused_recurrent_kda], ids=['chunk', 'recurrent'])
@pytest.mark.parametrize('scale,shown', [(float('nan'), 'nan'), (float('inf'), 'inf'),
                                         (float('-inf'), '-inf'), (1e39, '1e+39'), (-1e300, '-1e+300')])
def test_non_finite_scale_is_refused(fn, scale, shown):
    """A scale that is not finite in float32, the type the kernels take it as, turned every output
    NaN: it is refused with a ValueError naming the argument and the value, before anything runs
    (the in-place state of the decode step is left as it was)."""
    x = make_inputs(1, 3, 1, 1, 16, 16)
    state = make_state(1, 1, 16, 16)
    before = state.clone()
    opts = dict(inplace_final_state=True) if fn is fused_recurrent_kda else {}
    with pytest.raises(ValueError, match=rf"scale must be finite.*got {re.escape(shown)}$"):
        fn(**x, scale=scale, initial_state=state, **opts)
    assert torch.equal(state, before)


@pytest.mark.parametrize('scale', [3.4e38, -3.4e38, 0.0, -1.0])
def test_finite_scale_is_accepted(scale):
    """The bound is float32's largest value: anything within it, zero or negative, is taken."""
    x = make_inputs(1, 3, 1, 1, 16, 16)
    o, _ = fused_recurrent_kda(**x, scale=scale)
    assert o.shape == x['v'].shape


# ----------------------------------------------------------------------------------------------
# forward: chunk_kda
# ----------------------------------------------------------------------------------------------

@pytest.mark.slow
@requires_kernels
@pytest.mark.parametrize('name,chunk_size,t,bad', [
    *((n, 32, 45, math.nan) for n in ('q', 'k', 'v', 'g', 'beta')),       # inside a 16-row block
    *((n, 32, 32, math.inf) for n in ('q', 'k', 'v', 'g', 'beta')),       # a chunk's first token
    *((n, 64, 66, math.nan) for n in ('q', 'g')),
], ids=lambda p: str(p))
def test_chunk_forward_under_non_finite_input(name, chunk_size, t, bad):
    """A non-finite q, k, v, g or beta at token ``t`` of the middle sequence (``t`` counted in
    it): earlier chunks, other sequences and other heads keep their bits; the poisoned heads'
    outputs from ``t`` on and their final state are non-finite; a poisoned q changes ``o_t``
    alone. (Not pinned: the outputs of ``t``'s chunk before ``t``, which may be non-finite.)"""
    cu = _cu()
    x = _batch()[0]
    bos, eos = cu[SEQ].item(), cu[SEQ + 1].item()
    tok = bos + t
    chunk0 = bos + (t // chunk_size) * chunk_size
    o1, h1 = _clean_chunk_forward(chunk_size)
    o2, h2 = _chunk_forward(_poison(x, name, tok, bad), chunk_size)
    hit = _affected_heads(name)
    spared = [h for h in range(HV) if h not in hit]
    others = [n for n in range(len(LENGTHS)) if n != SEQ]
    assert o1.isfinite().all() and h1.isfinite().all()
    _bitwise(o2[:, spared], o1[:, spared], f"outputs of heads {spared}")
    _bitwise(h2[:, spared], h1[:, spared], f"final states of heads {spared}")
    _bitwise(o2[_other_tokens(bos, eos)], o1[_other_tokens(bos, eos)], "outputs of other sequences")
    _bitwise(h2[others], h1[others], "final states of other sequences")
    if name == 'q':
        _bitwise(o2[_other_tokens(tok, tok + 1)], o1[_other_tokens(tok, tok + 1)],
                 "outputs of tokens other than t (q enters o_t alone)")
        _every_token_non_finite(o2[tok:tok + 1, hit], "o_t")
        _bitwise(h2, h1, "final states (q never enters the state)")
        return
    _bitwise(o2[:chunk0], o1[:chunk0], "outputs of earlier chunks")
    _every_token_non_finite(o2[tok:eos, hit], "outputs from t on")
    assert (~h2[SEQ, hit].isfinite()).any(), "the poisoned heads' final state stayed finite"


# ----------------------------------------------------------------------------------------------
# forward: fused_recurrent_kda (exactly causal)
# ----------------------------------------------------------------------------------------------

@pytest.mark.slow
@requires_kernels
@pytest.mark.parametrize('name,bad', [*((n, math.nan) for n in ('q', 'k', 'v', 'g', 'beta')),
                                      ('k', math.inf), ('v', -math.inf)],
                         ids=['q-nan', 'k-nan', 'v-nan', 'g-nan', 'beta-nan', 'k-inf', 'v-minus-inf'])
def test_recurrent_forward_under_non_finite_input(name, bad):
    """The decode kernel: a non-finite value at token ``t`` leaves every output before ``t``
    unchanged (exact causality), and other sequences and heads too; from ``t`` on the poisoned
    heads' outputs are non-finite (for q: ``o_t`` alone)."""
    cu = _cu()
    x, s0, _, _ = _batch()
    bos, eos = cu[SEQ].item(), cu[SEQ + 1].item()
    tok = bos + 29
    opts = dict(initial_state=s0.to(KDEV), output_final_state=True, cu_seqlens=cu.to(KDEV))
    o1, h1 = fused_recurrent_kda(**_dev(x), **opts)
    o2, h2 = fused_recurrent_kda(**_dev(_poison(x, name, tok, bad)), **opts)
    o1, h1, o2, h2 = o1[0].cpu(), h1.cpu(), o2[0].cpu(), h2.cpu()
    hit = _affected_heads(name)
    spared = [h for h in range(HV) if h not in hit]
    others = [n for n in range(len(LENGTHS)) if n != SEQ]
    _bitwise(o2[:tok], o1[:tok], "outputs before t")
    _bitwise(o2[:, spared], o1[:, spared], f"outputs of heads {spared}")
    _bitwise(o2[eos:], o1[eos:], "outputs of the next sequence")
    _bitwise(h2[others], h1[others], "final states of other sequences")
    if name == 'q':
        _bitwise(o2[tok + 1:], o1[tok + 1:], "outputs after t (q enters o_t alone)")
        _every_token_non_finite(o2[tok:tok + 1, hit], "o_t")
    else:
        _every_token_non_finite(o2[tok:eos, hit], "outputs from t on")


# ----------------------------------------------------------------------------------------------
# backward: chunk_kda
# ----------------------------------------------------------------------------------------------

def _chunk_grads(x: dict, do, chunk_size: int) -> dict:
    _, s0, _, dht = _batch()
    leaves = {n: t.to(KDEV).requires_grad_() for n, t in x.items()}
    leaves['initial_state'] = s0.to(KDEV).requires_grad_()
    o, ht = chunk_kda(**leaves, output_final_state=True, cu_seqlens=_cu().to(KDEV),
                      chunk_size=chunk_size)
    loss = (o * do.to(KDEV)).sum() + (ht * dht.to(KDEV)).sum()
    grads = torch.autograd.grad(loss, list(leaves.values()))
    return {n: gr.cpu() for n, gr in zip(leaves, grads)}


@functools.cache
def _clean_chunk_grads(chunk_size: int) -> dict:
    x, _, do, _ = _batch()
    return _chunk_grads(x, do, chunk_size)


def _check_spared_gradients(g1: dict, g2: dict, bos: int, eos: int, value_heads: list[int],
                            qk_heads: list[int]) -> None:
    """Other sequences' gradients (tokens and initial states), and the gradients of heads that do
    not read the poisoned value, kept their bits."""
    keep = _other_tokens(bos, eos)
    others = [n for n in range(len(LENGTHS)) if n != SEQ]
    for n in ('q', 'k', 'v', 'g', 'beta'):
        _bitwise(g2[n][0, keep], g1[n][0, keep], f"d{n} of other sequences")
        heads = qk_heads if n in ('q', 'k') else value_heads
        _bitwise(g2[n][0][:, heads], g1[n][0][:, heads], f"d{n} of heads {heads}")
    _bitwise(g2['initial_state'][others], g1['initial_state'][others], "dh0 of other sequences")
    _bitwise(g2['initial_state'][:, value_heads], g1['initial_state'][:, value_heads],
             f"dh0 of heads {value_heads}")


@pytest.mark.slow
@requires_kernels
def test_chunk_backward_under_non_finite_output_gradient():
    """A NaN in the gradient arriving at ``o_t`` (one value head and channel): the gradients of
    every token in later chunks, of other sequences and of other heads keep their bits; ``dq``
    changes at ``t`` alone (``dq_t = scale S_t do_t``); the gradients at ``t`` are non-finite.
    (Not pinned: tokens after ``t`` in its chunk, which may turn non-finite.)"""
    chunk_size, t = 32, 40
    cu = _cu()
    x, _, do, _ = _batch()
    bos, eos = cu[SEQ].item(), cu[SEQ + 1].item()
    tok = bos + t
    later = bos + (t // chunk_size + 1) * chunk_size
    assert later < eos
    bad_do = do.clone()
    bad_do[0, tok, BAD_VALUE_HEAD, BAD_CHANNEL] = math.nan
    g1 = _clean_chunk_grads(chunk_size)
    g2 = _chunk_grads(x, bad_do, chunk_size)
    assert all(gr.isfinite().all() for gr in g1.values())
    group = HV // H
    _check_spared_gradients(g1, g2, bos, eos, [h for h in range(HV) if h != BAD_VALUE_HEAD],
                            [h for h in range(H) if h != BAD_VALUE_HEAD // group])
    for n in ('q', 'k', 'v', 'g', 'beta'):
        _bitwise(g2[n][0, later:eos], g1[n][0, later:eos], f"d{n} of later chunks")
    _bitwise(g2['q'][0, _other_tokens(tok, tok + 1)], g1['q'][0, _other_tokens(tok, tok + 1)],
             "dq of tokens other than t")
    assert not g2['v'][0, tok, BAD_VALUE_HEAD].isfinite().all(), "dv at t stayed finite"
    assert not g2['q'][0, tok, BAD_VALUE_HEAD // group].isfinite().all(), "dq at t stayed finite"


@pytest.mark.slow
@requires_kernels
def test_chunk_backward_under_non_finite_input():
    """A NaN in k (read by a group of value heads) at a token of the middle sequence: the other
    sequences' gradients, and those of the heads that do not read it, keep their bits."""
    name = 'k'
    cu = _cu()
    x, _, do, _ = _batch()
    bos, eos = cu[SEQ].item(), cu[SEQ + 1].item()
    g1 = _clean_chunk_grads(32)
    g2 = _chunk_grads(_poison(x, name, bos + 40, math.nan), do, 32)
    hit = _affected_heads(name)
    group = HV // H
    _check_spared_gradients(g1, g2, bos, eos, [h for h in range(HV) if h not in hit],
                            [h for h in range(H) if h not in {v // group for v in hit}])
    assert not g2['k'][0, bos:eos].isfinite().all(), "the poisoned sequence's dk stayed finite"


# ----------------------------------------------------------------------------------------------
# g = -inf: a full decay, not an error
# ----------------------------------------------------------------------------------------------

@pytest.mark.slow
@requires_kernels
@pytest.mark.parametrize('fn', ['chunk', 'recurrent'])
def test_minus_infinite_log_decay_is_a_full_decay(fn):
    """``g = -inf`` on a whole token (every channel of a head) and on single channels forgets
    those channels of the state entirely: outputs (and, for chunk_kda, every gradient) are finite
    and match the float64 recurrence, where ``exp(-inf) = 0``, and outputs before the token keep
    their bits."""
    B, T = 1, 50
    x = make_inputs(B, T, H, HV, K, V)
    s0 = make_state(B, HV, K, V)
    y = {n: t.clone() for n, t in x.items()}
    y['g'][0, 20, 1] = -math.inf
    y['g'][0, 37, 2, 5] = -math.inf
    y['g'][0, 38:, 0, :4] = -math.inf
    ro, rht = reference64(**y, initial_state=s0)
    if fn == 'recurrent':
        o1, _ = fused_recurrent_kda(**_dev(x), initial_state=s0.to(KDEV))
        o2, ht = fused_recurrent_kda(**_dev(y), initial_state=s0.to(KDEV), output_final_state=True)
    else:
        leaves = {n: t.to(KDEV).requires_grad_() for n, t in y.items()}
        leaves['initial_state'] = s0.to(KDEV).requires_grad_()
        with torch.no_grad():
            o1, _ = chunk_kda(**_dev(x), initial_state=s0.to(KDEV), chunk_size=32)
        o2, ht = chunk_kda(**leaves, output_final_state=True, chunk_size=32)
        do, dht = torch.randn(o2.shape), torch.randn(ht.shape)
        grads = torch.autograd.grad((o2 * do.to(KDEV)).sum() + (ht * dht.to(KDEV)).sum(),
                                    list(leaves.values()))
        ref = {n: t.detach().double().requires_grad_() for n, t in y.items()}
        ref['initial_state'] = s0.double().requires_grad_()
        ro_g, rht_g = naive_recurrent_kda(**ref, output_final_state=True)
        rgrads = torch.autograd.grad((ro_g * do.double()).sum() + (rht_g * dht.double()).sum(),
                                     list(ref.values()))
        for n, gr, rg in zip(leaves, grads, rgrads):
            assert gr.isfinite().all(), f"d{n} not finite"
            assert rel_err(gr.cpu(), rg) < TOL, f"d{n}: rel err {rel_err(gr.cpu(), rg):.2e}"
    o1, o2, ht = o1.detach().cpu(), o2.detach().cpu(), ht.detach().cpu()
    assert o2.isfinite().all() and ht.isfinite().all()
    assert rel_err(o2, ro) < TOL and rel_err(ht, rht) < TOL
    _bitwise(o2[:, :20], o1[:, :20], "outputs before the first -inf")
