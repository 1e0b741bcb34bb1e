"""Chunk stage 2: the state carried from chunk to chunk, with the WY transform applied inside.

For each chunk in order, with incoming state ``S`` (``[K, V]``), ``M = (I + diag(beta) A')^-1``
and the decayed keys ``Kg = k exp(c)``, ``Kbar = k exp(c_last - c)`` from stage 1::

    dV = M diag(beta) (V - Kg S)                 the chunk's delta-rule corrections (U - W S with
                                                 the WY form's W = M diag(beta) Kg, U = M diag(beta) V)
    S  = Diag(exp(c_last)) S + Kbar^T dV

W and U are never formed: applying M inside costs one more ``[BT, BT] x [BT, BV]`` product a chunk
and spares a kernel that wrote them and the sweeps that read them back.
``chunk_state_fwd_kernel`` is the backward's recompute (run in the forward under
``disable_recompute``): it stores every chunk's incoming state and corrections for the gradient
stages. The forward runs the same steps fused with the outputs
(``chunk_state_output.py``). One program owns a ``[K, BV]`` slice of one sequence's state for one
value head and walks that sequence's chunks; the state stays in registers in float32.

The sweeps hold the state transposed, ``S^T`` ``[BV, K]``, and form every product transposed
(``dV^T = (V^T - S^T Kg^T) diag(beta) M^T``, ``S^T <- S^T Diag(exp(c_last)) + dV^T Kbar``), so
that whatever depends on the state is the left operand, which the tensor cores take from
registers; the right operands are the chunk's loaded tiles. In the other orientation the state
and the corrections went through shared memory as right operands at every chunk step, the wait
that dominated the few-program sweeps (ncu at (1, 32768, 32): 56 % of stalls; BENCHMARKS.md
note 56). H200, ms a call, transposed against not: (1, 32768, 32) carry 1.365 / 1.413, fused
forward sweep 1.549 / 1.811, gradient sweep 1.290 / 1.970; (8, 4096, 16) 0.369 / 0.346,
0.384 / 0.414, 0.566 / 0.473 (the many-program sweeps' loss is not understood).
"""
import triton
import triton.language as tl

from kda.kernels.chunk_common import (exp_nonpos, load_row, load_state, load_tile, load_tile_t, mm,
                                      store_tile_t, sweep_program)


@triton.jit
def chunk_beta_inverse_t(beta, Minv, row0, n, i_hv, HV: tl.constexpr, BT: tl.constexpr):
    """The chunk's ``beta`` ``[BT]`` and ``M^T`` ``[BT, BT]`` (float32; ``n`` valid rows), through
    which the sweeps apply the WY form ``W = M diag(beta) Kg``; ``M``'s entries above the diagonal
    are never written: selected out."""
    o_t = tl.arange(0, BT)
    b_beta = tl.load(beta + (row0 + o_t) * HV + i_hv, mask=o_t < n, other=0.).to(tl.float32)
    b_Mt = load_tile_t(Minv + row0 * HV * BT + i_hv * BT, 0, n, HV * BT, 0, BT, BT, BT)
    return b_beta, tl.where(o_t[None, :] >= o_t[:, None], b_Mt, 0.)


@triton.jit
def chunk_corrections(kg, v, beta, Minv, b_ht, row0, n, i_hv, i_v, HV: tl.constexpr, K: tl.constexpr,
                      V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                      DOT_DTYPE: tl.constexpr):
    """``dV^T = (V^T - S^T Kg^T) diag(beta) M^T`` ``[BV, BT]`` of the chunk at ``row0`` (``n``
    valid rows), value slice ``i_v``, from the transposed state ``S^T`` (``b_ht``)."""
    b_kgt = load_tile_t(kg + row0 * HV * K + i_hv * K, 0, n, HV * K, 0, K, BT, BK)
    b_vt = load_tile_t(v + row0 * HV * V + i_hv * V, 0, n, HV * V, i_v * BV, V, BT, BV)
    b_beta, b_Mt = chunk_beta_inverse_t(beta, Minv, row0, n, i_hv, HV, BT)
    return mm((b_vt - mm(b_ht, b_kgt, DOT_DTYPE)) * b_beta[None, :], b_Mt, DOT_DTYPE)


@triton.jit
def carry_state(b_ht, b_dt, kbar, gc, row0, n, i_hv, HV: tl.constexpr, K: tl.constexpr,
                BT: tl.constexpr, BK: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """``S^T Diag(exp(c_last)) + dV^T Kbar``: the transposed state after the chunk at ``row0``."""
    b_kbar = load_tile(kbar + row0 * HV * K + i_hv * K, 0, n, HV * K, 0, K, BT, BK)
    b_last = load_row(gc + row0 * HV * K + i_hv * K, n - 1, n, HV * K, 0, K, BK)
    return b_ht * exp_nonpos(b_last)[None, :] + mm(b_dt, b_kbar, DOT_DTYPE)


@triton.jit
def chunk_state_fwd_kernel(
    kg, kbar, v, beta, gc, Minv,
    h, v_new, h0,
    cu_seqlens, chunk_offsets, seq_order,
    T, NT,
    stride_sk, stride_sv,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    DOT_DTYPE: tl.constexpr, IS_VARLEN: tl.constexpr,
    USE_INITIAL_STATE: tl.constexpr,
):
    i_n, i_hv, i_v, bos, L, c0 = sweep_program(cu_seqlens, chunk_offsets, seq_order, T, NT, HV, V,
                                               BT, BV, IS_VARLEN)
    b_h, _, _ = load_state(h0, i_n, i_hv, i_v, HV, K, V, stride_sk, stride_sv, BK, BV, USE_INITIAL_STATE)
    b_ht = tl.trans(b_h)

    for i_t in range(tl.cdiv(L, BT)):
        row0 = bos + i_t * BT
        n = tl.minimum(L - i_t * BT, BT)
        store_tile_t(h + ((c0 + i_t) * HV + i_hv) * K * V, b_ht, 0, K, V, i_v * BV, V, BK, BV)
        b_dt = chunk_corrections(kg, v, beta, Minv, b_ht, row0, n, i_hv, i_v, HV, K, V, BT, BK, BV,
                                 DOT_DTYPE)
        store_tile_t(v_new + row0 * HV * V + i_hv * V, b_dt, 0, n, HV * V, i_v * BV, V, BT, BV)
        b_ht = carry_state(b_ht, b_dt, kbar, gc, row0, n, i_hv, HV, K, BT, BK, DOT_DTYPE)
