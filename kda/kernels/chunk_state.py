"""Chunk stage 2: the state carried from chunk to chunk, with the WY transform applied inside.

For each chunk in order, with incoming state ``S`` (``[K, V]``), ``M = (I + diag(beta) A')^-1``
and the decayed keys ``Kg = k exp(c)``, ``Kbar = k exp(c_last - c)`` from the in-chunk stage::

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

``TRANSPOSED``: the sweep holds the state transposed, ``S^T`` ``[BV, K]``, and forms every
product transposed (``dV^T = (V^T - S^T Kg^T) diag(beta) M^T``,
``S^T <- S^T Diag(exp(c_last)) + dV^T Kbar``), so that whatever depends on the state is the left
operand, which the tensor cores take from registers; the right operands are the chunk's loaded
tiles. Held as is, the state and the corrections go through shared memory as right operands at
every chunk step, the wait that dominated the few-program sweeps (ncu at (1, 32768, 32): 56 % of
stalls; docs/tuning.md). The kernels are written once for both (the ``*_o`` helpers of
``chunk_common.py``). The fused forward sweep is always transposed; the carry and the gradient
sweep only with few programs (``transposed_sweeps``, ``ops/chunk/launch.py``). H200, ms a call,
transposed against not: (1, 32768, 32) carry 1.365 / 1.413, fused forward sweep
1.549 / 1.811, gradient sweep 1.290 / 1.970; (8, 4096, 16) 0.369 / 0.346, 0.384 / 0.414,
0.566 / 0.473 (why the transposed gradient sweep loses with many programs is not understood).
"""
import triton
import triton.language as tl

from kda.kernels.chunk_common import (exp_nonpos, load_row, load_state, load_tile_o, load_tile_ot,
                                      lower_o, mm_o, oriented, rows_o, store_tile_o, sweep_program)


@triton.jit
def chunk_beta_inverse(beta, Minv, row0, n, i_hv, HV: tl.constexpr, BT: tl.constexpr,
                       ADJOINT: tl.constexpr, TRANSPOSED: tl.constexpr):
    """The chunk's ``beta`` ``[BT]`` and ``M`` (``M^T`` with ``ADJOINT``) ``[BT, BT]`` in float32 as
    the sweep holds it (``n`` valid rows), through which the sweeps apply the WY form
    ``W = M diag(beta) Kg``; ``M``'s entries above the diagonal are never written: selected out."""
    o_t = tl.arange(0, BT)
    b_beta = tl.load(beta + (row0 + o_t) * HV + i_hv, mask=o_t < n, other=0.).to(tl.float32)
    p_M = Minv + row0 * HV * BT + i_hv * BT
    if ADJOINT:
        b_M = tl.where(lower_o(BT, not TRANSPOSED), load_tile_ot(p_M, 0, n, HV * BT, 0, BT, BT, BT, TRANSPOSED), 0.)
    else:
        b_M = tl.where(lower_o(BT, TRANSPOSED), load_tile_o(p_M, 0, n, HV * BT, 0, BT, BT, BT, TRANSPOSED), 0.)
    return b_beta, b_M


@triton.jit
def chunk_corrections(kg, v, beta, Minv, b_h, row0, n, i_hv, i_v, HV: tl.constexpr, K: tl.constexpr,
                      V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                      DOT_DTYPE: tl.constexpr, TRANSPOSED: tl.constexpr):
    """``dV = M diag(beta) (V - Kg S)`` ``[BT, BV]`` of the chunk at ``row0`` (``n`` valid rows),
    value slice ``i_v``, held as the sweep holds its state ``b_h``."""
    b_kg = load_tile_o(kg + row0 * HV * K + i_hv * K, 0, n, HV * K, 0, K, BT, BK, TRANSPOSED)
    b_v = load_tile_o(v + row0 * HV * V + i_hv * V, 0, n, HV * V, i_v * BV, V, BT, BV, TRANSPOSED)
    b_beta, b_M = chunk_beta_inverse(beta, Minv, row0, n, i_hv, HV, BT, False, TRANSPOSED)
    b_u = (b_v - mm_o(b_kg, b_h, DOT_DTYPE, TRANSPOSED)) * rows_o(b_beta, TRANSPOSED)
    return mm_o(b_M, b_u, DOT_DTYPE, TRANSPOSED)


@triton.jit
def chunk_last_decay(gc, row0, n, i_hv, HV: tl.constexpr, K: tl.constexpr, BK: tl.constexpr):
    """``c_last`` ``[BK]``: the cumulative decay's last row of the chunk at ``row0`` (``n`` valid
    rows), by which the sweeps decay the state across the chunk (``carry_state``)."""
    return load_row(gc + row0 * HV * K + i_hv * K, n - 1, n, HV * K, 0, K, BK)


@triton.jit
def carry_state(b_h, b_d, kbar, b_last, row0, n, i_hv, HV: tl.constexpr, K: tl.constexpr,
                BT: tl.constexpr, BK: tl.constexpr, DOT_DTYPE: tl.constexpr, TRANSPOSED: tl.constexpr):
    """``Diag(exp(c_last)) S + Kbar^T dV``: the state after the chunk at ``row0``. ``b_last`` is
    ``chunk_last_decay``'s row, which the caller loads at the top of the chunk step. Triton (3.6)
    does not prefetch that row across iterations, and loaded here, next to its use, it was issued
    after the corrections' products: each step then waited a memory round trip for it. H200, bf16
    inference forward (the fused sweep; the backward's carry, changed alike, was not timed
    apart): -0.03 to -0.10 ms at the benchmark's shapes, -0.099 on its varlen batch, nothing at
    (1, 32768, 32) with the Kimi gate (its segments' sweeps wait on the in-chunk stage there); bit for bit
    the same."""
    b_kbart = load_tile_ot(kbar + row0 * HV * K + i_hv * K, 0, n, HV * K, 0, K, BT, BK, TRANSPOSED)
    return b_h * rows_o(exp_nonpos(b_last), TRANSPOSED) + mm_o(b_kbart, b_d, DOT_DTYPE, TRANSPOSED)


@triton.jit
def chunk_state_fwd_kernel(
    kg, kbar, v, beta, gc, Minv,
    h, v_new, h0,
    cu_seqlens, chunk_offsets, seq_order,
    T, NT,
    stride_sk, stride_sv,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    DOT_DTYPE: tl.constexpr, IS_VARLEN: tl.constexpr, SLICES_INNERMOST: tl.constexpr,
    USE_INITIAL_STATE: tl.constexpr, TRANSPOSED: tl.constexpr,
):
    i_n, i_hv, i_v, bos, L, c0 = sweep_program(cu_seqlens, chunk_offsets, seq_order, T, NT, HV, V,
                                               BT, BV, IS_VARLEN, SLICES_INNERMOST)
    b_h, _, _ = load_state(h0, i_n, i_hv, i_v, HV, K, V, stride_sk, stride_sv, BK, BV, USE_INITIAL_STATE)
    b_h = oriented(b_h, TRANSPOSED)

    for i_t in range(tl.cdiv(L, BT)):
        row0 = bos + i_t * BT
        n = tl.minimum(L - i_t * BT, BT)
        b_last = chunk_last_decay(gc, row0, n, i_hv, HV, K, BK)
        store_tile_o(h + ((c0 + i_t) * HV + i_hv) * K * V, b_h, 0, K, V, i_v * BV, V, BK, BV, TRANSPOSED)
        b_d = chunk_corrections(kg, v, beta, Minv, b_h, row0, n, i_hv, i_v, HV, K, V, BT, BK, BV,
                                DOT_DTYPE, TRANSPOSED)
        store_tile_o(v_new + row0 * HV * V + i_hv * V, b_d, 0, n, HV * V, i_v * BV, V, BT, BV, TRANSPOSED)
        b_h = carry_state(b_h, b_d, kbar, b_last, row0, n, i_hv, HV, K, BT, BK, DOT_DTYPE, TRANSPOSED)
