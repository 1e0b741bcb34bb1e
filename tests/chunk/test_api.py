"""``chunk_kda``'s entry point: the PyTorch path that serves a call where the kernels cannot run
(CPU without the interpreter, bf16 in the interpreter), and argument validation, where no
computation may start on bad input."""
from __future__ import annotations

import pytest
import torch

import kda.ops.chunk.function as chunk_function
from kda import chunk_kda, naive_recurrent_kda
from kda.ops.utils import INTERPRET
from conftest import make_cu_seqlens, make_inputs, make_state, reference64, rel_err
from chunk_helpers import TOL, assert_errs, errors, forbid_chunk_kernels, lengths_to_cu, patch_chunk, run_chunk, run_ref

# Every kernel load and store of these tests is bounds-checked in the interpreter.
pytestmark = pytest.mark.usefixtures('bounds_checked_memory')


def test_torch_path(monkeypatch):
    """With the kernels disabled the chunked reference algorithm serves the call (any mode)."""
    forbid_chunk_kernels(monkeypatch)
    lengths = [0, 1, 19, 25]
    cu = lengths_to_cu(lengths)
    x = make_inputs(1, sum(lengths), 1, 2, 32, 24)
    s0 = make_state(len(lengths), 2, 32, 24, state_v_first=True)
    for bt in (32, 64):
        o, ht, gd, do, dht = run_chunk(x, s0, cu_seqlens=cu, chunk_size=bt, state_v_first=True, device='cpu')
        ro, rht, rgd = run_ref(x, s0, do, dht, cu_seqlens=cu, state_v_first=True)
        assert_errs(errors(o, ht, gd, ro, rht, rgd), TOL, f"torch path BT={bt}")


@pytest.mark.skipif(not INTERPRET, reason="the interpreter's bf16 route")
def test_bf16_in_the_interpreter_takes_the_pytorch_path(monkeypatch):
    """bf16 under TRITON_INTERPRET=1: the interpreter's bf16 dot is wrong (triton#11584), so the
    PyTorch path must serve the call, forward and backward, within the error that the reference
    itself has in bf16 (the kernels returned finite garbage there, relative error ~3e11)."""
    forbid_chunk_kernels(monkeypatch, disable=False)
    x = make_inputs(1, 40, 1, 2, 16, 16, dtype=torch.bfloat16)
    s0 = make_state(1, 2, 16, 16)
    o, ht = chunk_kda(**x, initial_state=s0, output_final_state=True, chunk_size=32)
    ro, rht = reference64(**x, initial_state=s0)
    bo, bht = naive_recurrent_kda(**x, initial_state=s0, output_final_state=True)
    assert rel_err(o, ro) <= 2 * rel_err(bo, ro) and rel_err(ht, rht) <= 2 * rel_err(bht, rht) + 1e-6
    q = x['q'].clone().requires_grad_()
    o, _ = chunk_kda(**dict(x, q=q), initial_state=s0, chunk_size=32)
    o.float().sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


@pytest.fixture
def no_compute(monkeypatch):
    def must_not_run(*a, **kw):
        raise AssertionError("computation started on invalid input")

    patch_chunk(monkeypatch, 'chunk_kda_fwd', must_not_run)
    patch_chunk(monkeypatch, 'chunk_kda_reference', must_not_run)
    monkeypatch.setattr(chunk_function.ChunkKDAFunction, 'apply', must_not_run)


@pytest.mark.parametrize('chunk_size', [16, 128, 48, 0, -64, True, 64.0, '64', None])
def test_bad_chunk_size(no_compute, chunk_size):
    x = make_inputs(1, 8, 1, 1, 16, 16)
    with pytest.raises(ValueError, match='chunk_size'):
        chunk_kda(**x, chunk_size=chunk_size)


def test_shared_validation(no_compute):
    """chunk_kda validates through the same checks as fused_recurrent_kda."""
    x = make_inputs(1, 20, 1, 2, 16, 8)
    with pytest.raises(ValueError, match='cu_seqlens'):
        chunk_kda(**x, cu_seqlens=make_cu_seqlens([5, 10]))                 # ends at 15, not T = 20
    with pytest.raises(ValueError, match='cu_seqlens'):
        chunk_kda(**x, cu_seqlens=torch.tensor([0, 12, 8, 20]))             # decreasing
    with pytest.raises(ValueError, match="cu_seqlens_cpu must hold cu_seqlens' values"):
        # On the CPU cu_seqlens is read too, so a well-formed host copy cannot hide it.
        chunk_kda(**x, cu_seqlens=torch.tensor([0, 12, 8, 20]), cu_seqlens_cpu=make_cu_seqlens([8, 4, 8]))
    with pytest.raises(ValueError, match='initial_state'):
        chunk_kda(**x, cu_seqlens=make_cu_seqlens([5, 15]), initial_state=make_state(1, 2, 16, 8))
    with pytest.raises(ValueError, match='initial_state'):
        chunk_kda(**x, initial_state=make_state(1, 2, 16, 8), state_v_first=True, output_final_state=True)
    y = make_inputs(2, 20, 1, 2, 16, 8)
    with pytest.raises(ValueError, match='B = 1'):
        chunk_kda(**y, cu_seqlens=make_cu_seqlens([5, 15]))
    with pytest.raises(ValueError, match='HV'):
        chunk_kda(**dict(x, v=torch.randn(1, 20, 3, 8)))
    with pytest.raises(TypeError, match='disable_recompute'):
        chunk_kda(**x, disable_recompute=1)
    with pytest.raises(TypeError, match='return_intermediate_states'):
        chunk_kda(**x, return_intermediate_states='yes')
