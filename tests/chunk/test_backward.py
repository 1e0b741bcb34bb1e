"""``chunk_kda``'s backward: gradients under mild decay, the diagonal sub-blocks' two paths
(factored and 4-row groups), the gradient through the final state alone, ``disable_recompute``
and what a training call keeps for its backward."""
from __future__ import annotations

import pytest
import torch

from kda import chunk_kda
from kda.ops.utils import INTERPRET
from conftest import HAS_CUDA, make_inputs, make_state
from chunk_helpers import (KDEV, TOL, assert_errs, check_case, cumsum_floor, errors, lengths_to_cu, requires_kernels,
                           run_chunk, run_ref)

# Every kernel load and store of these tests is bounds-checked in the interpreter.
pytestmark = pytest.mark.usefixtures('bounds_checked_memory')


@pytest.mark.slow
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


@pytest.mark.slow
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
    fo, fht, fgd = cumsum_floor(x, s0, do, dht, 64)
    floor = errors(fo, fht, fgd, ro, rht, rgd)
    assert_errs(errs, {n: TOL + 2 * f for n, f in floor.items()}, f"diagonal blocks, drop = {drop}")


@pytest.mark.skipif(not INTERPRET or HAS_CUDA, reason="patches a kernel constant, which only the "
                    "interpreter reads at run time")
@pytest.mark.parametrize('shape', [pytest.param('varlen_BT32', marks=pytest.mark.slow), 'T45_BT64'])
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


@pytest.mark.slow
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


@pytest.mark.slow
@requires_kernels
@pytest.mark.parametrize('config', ['plain', 'kimi'])
def test_disable_recompute_same_gradients(config):
    """disable_recompute=True gives the default path's outputs and gradients bit for bit (its
    forward forms the in-chunk stage's per-token tensors again with the backward's build of the
    cumsum kernel, whose scan may round c differently from the forward's on a GPU). 'kimi': the
    raw gate with A_log, dt_bias and the lower bound, beta logits, q/k l2norm (GVA, varlen)."""
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


@pytest.mark.slow
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
