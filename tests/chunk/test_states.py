"""``return_intermediate_states``: the state at every chunk boundary, on the kernels and on the
PyTorch path, fixed length and varlen, inference only."""
from __future__ import annotations

import math

import pytest
import torch

from kda import chunk_kda
from kda.ops.utils import INTERPRET
from conftest import HAS_CUDA, make_inputs, make_state, reference64, rel_err
from chunk_helpers import KDEV, TOL, forbid_chunk_kernels, lengths_to_cu, on_device, requires_kernels

# Every kernel load and store of these tests is bounds-checked in the interpreter.
pytestmark = pytest.mark.usefixtures('bounds_checked_memory')


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


@pytest.mark.slow
@pytest.mark.parametrize('state_v_first,with_h0', [(False, True), (True, True), (False, False)])
def test_intermediate_states(states_path, state_v_first, with_h0):
    B, T, H, HV, K, V, BT = 2, 70, 1, 2, 32, 16, 32
    KDEV = states_path
    x = on_device(make_inputs(B, T, H, HV, K, V), KDEV)
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
    x = on_device(make_inputs(B, T, 1, HV, K, V), states_path)
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
        o, ht, h = chunk_kda(**on_device(x, KDEV), initial_state=s0.to(KDEV), output_final_state=True,
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
    x = on_device(make_inputs(1, 40, 1, 1, 16, 16), KDEV)
    x['q'].requires_grad_()
    with torch.no_grad():
        o, _, h = chunk_kda(**x, chunk_size=32, return_intermediate_states=True)
    assert h.shape == (1, 2, 1, 16, 16)
