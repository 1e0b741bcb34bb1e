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
"""
import triton
import triton.language as tl

from kda.kernels.chunk_common import (exp_nonpos, load_row, load_state, load_tile, mm, store_tile,
                                      sweep_program)


@triton.jit
def chunk_beta_inverse(beta, Minv, row0, n, i_hv, HV: tl.constexpr, BT: tl.constexpr):
    """The chunk's ``beta`` ``[BT]`` and ``M`` ``[BT, BT]`` (float32; ``n`` valid rows), through
    which the sweeps apply the WY form ``W = M diag(beta) Kg``; ``M``'s entries above the diagonal
    are never written: selected out."""
    o_t = tl.arange(0, BT)
    b_beta = tl.load(beta + (row0 + o_t) * HV + i_hv, mask=o_t < n, other=0.).to(tl.float32)
    b_M = load_tile(Minv + row0 * HV * BT + i_hv * BT, 0, n, HV * BT, 0, BT, BT, BT)
    return b_beta, tl.where(o_t[:, None] >= o_t[None, :], b_M, 0.)


@triton.jit
def chunk_corrections(kg, v, beta, Minv, b_h, row0, n, i_hv, i_v, HV: tl.constexpr, K: tl.constexpr,
                      V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                      DOT_DTYPE: tl.constexpr):
    """``dV = M diag(beta) (V - Kg S)`` ``[BT, BV]`` of the chunk at ``row0`` (``n`` valid rows),
    value slice ``i_v``."""
    b_kg = load_tile(kg + row0 * HV * K + i_hv * K, 0, n, HV * K, 0, K, BT, BK)
    b_v = load_tile(v + row0 * HV * V + i_hv * V, 0, n, HV * V, i_v * BV, V, BT, BV)
    b_beta, b_M = chunk_beta_inverse(beta, Minv, row0, n, i_hv, HV, BT)
    return mm(b_M, (b_v - mm(b_kg, b_h, DOT_DTYPE)) * b_beta[:, None], DOT_DTYPE)


@triton.jit
def carry_state(b_h, b_d, kbar, gc, row0, n, i_hv, HV: tl.constexpr, K: tl.constexpr,
                BT: tl.constexpr, BK: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """``Diag(exp(c_last)) S + Kbar^T dV``: the state after the chunk at ``row0``."""
    b_kbar = load_tile(kbar + row0 * HV * K + i_hv * K, 0, n, HV * K, 0, K, BT, BK)
    b_last = load_row(gc + row0 * HV * K + i_hv * K, n - 1, n, HV * K, 0, K, BK)
    return b_h * exp_nonpos(b_last)[:, None] + mm(tl.trans(b_kbar), b_d, DOT_DTYPE)


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

    for i_t in range(tl.cdiv(L, BT)):
        row0 = bos + i_t * BT
        n = tl.minimum(L - i_t * BT, BT)
        store_tile(h + ((c0 + i_t) * HV + i_hv) * K * V, b_h, 0, K, V, i_v * BV, V, BK, BV)
        b_d = chunk_corrections(kg, v, beta, Minv, b_h, row0, n, i_hv, i_v, HV, K, V, BT, BK, BV,
                                DOT_DTYPE)
        store_tile(v_new + row0 * HV * V + i_hv * V, b_d, 0, n, HV * V, i_v * BV, V, BT, BV)
        b_h = carry_state(b_h, b_d, kbar, gc, row0, n, i_hv, HV, K, BT, BK, DOT_DTYPE)
