"""Chunk stage 1 (forward) in one kernel: the cumulative decay, the decayed keys and queries, the
pair products and the solve of one chunk and value head in one program.

The same quantities as ``chunk_intra.py``'s three kernels, by the same helpers (see there for the
math and for the factored products' ranges)::

    c         = cumsum(g)                                       (the gate activated first, if raw)
    qt, kg, kbar                                                the decayed queries and keys
    Aqk, A'   = the pair products of the chunk's 16-row blocks  (one block row I at a time)
    M         = (I + diag(beta) A')^-1                          block forward substitution

Against the three kernels, nothing leaves the program between the phases but through the cache:
``gc`` and ``A'`` are written and read back by the same program (after a barrier), so the
in-chunk stage reads q, k, g and beta once from memory, and gc and A' are not read back from
memory by two later launches. A program's phases run one after another; the cumsum's writes of
gc, which the pair products' helpers load row by row and block by block, and the pair products'
writes of A', which the solve loads, are made visible to every thread of the program by
``tl.debug_barrier`` (a CTA barrier orders global memory within the block).

The arithmetic is the three kernels' (the cumsum over the same ``[BT, BK]`` tiles, the pair
products' key slices in the same order, the solve itself): the same outputs, bit for bit, in the
interpreter.
"""
import triton
import triton.language as tl

from kda.kernels.chunk_common import (chunk_span, clamp_log_decay, load_row, load_rows, load_tile,
                                      store_tile)
from kda.kernels.chunk_intra import (
    chunk_solve_kernel,
    diag_slice,
    offdiag_slice,
    row_inverse_norms,
    scale_rows,
    store_decayed_keys,
    store_decayed_queries,
    store_pair_block,
)
from kda.kernels.gate import log_decay_tile
from kda.kernels.l2norm import inverse_norm


@triton.jit
def cumulative_decay_tiles(g, A_log, dt_bias, gc_base, hv_offset, i_hv, L, lower_bound,
                           HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                           GATE: tl.constexpr):
    """``gc`` of the chunk, ``BK`` key columns at a time: the cumsum kernel's forward build
    (``chunk_cumsum_kernel`` with ``DECAYED`` False), the positivity test only for a given g."""
    for i_k in range(tl.cdiv(K, BK)):
        b_g, _, _ = log_decay_tile(load_tile(g + hv_offset, 0, L, HV * K, i_k * BK, K, BT, BK),
                                   A_log, dt_bias, i_hv, i_k * BK, lower_bound, K, BK, GATE)
        b_g = clamp_log_decay(b_g)
        b_c = tl.cumsum(b_g, axis=0)
        if GATE == 'none':
            b_c = tl.where(tl.max(b_g, axis=0)[None, :] > 0, float('nan'), b_c)
        store_tile(gc_base, b_c, 0, L, HV * K, i_k * BK, K, BT, BK)


@triton.jit
def pair_row_block(q_base, k_base, gc_base, A_base, K_base, qt_base, kbar_base, kg_base, scale, L,
                   I: tl.constexpr, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                   BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
                   FACTORED_DIAG: tl.constexpr, ALL_NEAR: tl.constexpr, L2NORM: tl.constexpr,
                   DOT_DTYPE: tl.constexpr):
    """Row block ``I`` of Aqk (scaled) and A', and its rows of qt, kbar, kg: one program of
    ``chunk_pair_fwd_kernel``, with ``I`` known at compile time (the blocks J < I unrolled)."""
    o_c = tl.arange(0, BC)
    m_r = ((I * BC + o_c) < L)[:, None]
    b_qk = tl.zeros([BC, BC], dtype=tl.float32)
    b_kk = tl.zeros([BC, BC], dtype=tl.float32)
    b_qk0, b_kk0 = b_qk, b_kk
    b_qk1, b_kk1 = b_qk, b_kk
    b_qk2, b_kk2 = b_qk, b_kk
    b_s0 = tl.zeros([BC], dtype=tl.float32)
    b_s1, b_s2 = b_s0, b_s0
    b_rq = None
    b_rk = None
    if L2NORM:
        b_rq = row_inverse_norms(q_base, I * BC + o_c, L, H, K, BK)
        b_rk = row_inverse_norms(k_base, I * BC + o_c, L, H, K, BK)
    for i_k in range(tl.cdiv(K, BK)):
        b_q = scale_rows(load_rows(q_base, I * BC + o_c, L, H * K, i_k * BK, K, BK), b_rq)
        b_k = scale_rows(load_rows(k_base, I * BC + o_c, L, H * K, i_k * BK, K, BK), b_rk)
        b_c = load_tile(gc_base, I * BC, L, HV * K, i_k * BK, K, BC, BK)
        b_r = load_row(gc_base, I * BC, L, HV * K, i_k * BK, K, BK)
        b_last = load_row(gc_base, L - 1, L, HV * K, i_k * BK, K, BK)
        store_decayed_keys(kbar_base, kg_base, b_k, b_c, b_last, I * BC, L, i_k * BK, HV, K, BC, BK)
        store_decayed_queries(qt_base, b_q, b_c, scale, I * BC, L, i_k * BK, HV, K, BC, BK)
        b_qk, b_kk, b_qe, b_ke = diag_slice(b_qk, b_kk, b_q, b_k, b_c, b_r, m_r, k_base, b_rk,
                                            gc_base, HV * K, I, i_k, L, H, K, BC, BK, FACTORED_DIAG,
                                            ALL_NEAR, DOT_DTYPE)
        if I > 0:
            b_qk0, b_kk0, b_s0 = offdiag_slice(b_qk0, b_kk0, b_s0, b_qe, b_ke, b_r, k_base, gc_base,
                                               HV * K, 0, i_k, L, H, K, BC, BK, DOT_DTYPE)
        if I > 1:
            b_qk1, b_kk1, b_s1 = offdiag_slice(b_qk1, b_kk1, b_s1, b_qe, b_ke, b_r, k_base, gc_base,
                                               HV * K, 1, i_k, L, H, K, BC, BK, DOT_DTYPE)
        if I > 2:
            b_qk2, b_kk2, b_s2 = offdiag_slice(b_qk2, b_kk2, b_s2, b_qe, b_ke, b_r, k_base, gc_base,
                                               HV * K, 2, i_k, L, H, K, BC, BK, DOT_DTYPE)
    if L2NORM:
        b_s0 = inverse_norm(b_s0)[None, :]
        b_s1 = inverse_norm(b_s1)[None, :]
        b_s2 = inverse_norm(b_s2)[None, :]
        b_qk0, b_kk0 = b_qk0 * b_s0, b_kk0 * b_s0
        b_qk1, b_kk1 = b_qk1 * b_s1, b_kk1 * b_s1
        b_qk2, b_kk2 = b_qk2 * b_s2, b_kk2 * b_s2
    b_qk = tl.where(o_c[:, None] >= o_c[None, :], b_qk, 0.)
    b_kk = tl.where(o_c[:, None] > o_c[None, :], b_kk, 0.)
    store_pair_block(A_base, K_base, b_qk, b_kk, scale, I, I, L, HV, BT, BC)
    if I > 0:
        store_pair_block(A_base, K_base, b_qk0, b_kk0, scale, I, 0, L, HV, BT, BC)
    if I > 1:
        store_pair_block(A_base, K_base, b_qk1, b_kk1, scale, I, 1, L, HV, BT, BC)
    if I > 2:
        store_pair_block(A_base, K_base, b_qk2, b_kk2, scale, I, 2, L, HV, BT, BC)


@triton.jit
def chunk_prep_fwd_kernel(
    q, k, g, A_log, dt_bias, beta, gc, qt, kbar, kg, Aqk, Akk, Minv,
    chunk_rows,
    scale, lower_bound, T, NT,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
    BK: tl.constexpr, GATE: tl.constexpr, FACTORED_DIAG: tl.constexpr, ALL_NEAR: tl.constexpr,
    L2NORM: tl.constexpr, DOT_DTYPE: tl.constexpr, IS_VARLEN: tl.constexpr,
):
    """The in-chunk stage of chunk ``program_id(0)``, value head ``program_id(1)``: ``gc``,
    ``qt``, ``kbar``, ``kg``, ``Aqk``, ``A'`` and ``M``, as ``chunk_cumsum_kernel`` (forward
    build), ``chunk_pair_fwd_kernel`` and ``chunk_solve_kernel`` write them (``L2NORM``,
    ``ALL_NEAR``, ``FACTORED_DIAG``: see the pair products). The solve is ``chunk_solve_kernel``
    itself, run as a function: this grid is its grid, (chunk, value head)."""
    tl.static_assert(BT % BC == 0, "the chunk must be a whole number of sub-blocks")
    NC: tl.constexpr = BT // BC
    tl.static_assert(NC <= 4, "at most 4 sub-blocks a chunk (three blocks J < I)")
    i_c, i_hv = tl.program_id(0), tl.program_id(1)
    i_h = i_hv // (HV // H)
    start, L = chunk_span(i_c, chunk_rows, T, NT, BT, IS_VARLEN)
    hv_offset = start * HV * K + i_hv * K
    h_offset = start * H * K + i_h * K
    cumulative_decay_tiles(g, A_log, dt_bias, gc + hv_offset, hv_offset, i_hv, L, lower_bound, HV, K,
                           BT, BK, GATE)
    tl.debug_barrier()
    A_base = Aqk + start * HV * BT + i_hv * BT
    K_base = Akk + start * HV * BT + i_hv * BT
    for I in tl.static_range(NC):
        pair_row_block(q + h_offset, k + h_offset, gc + hv_offset, A_base, K_base, qt + hv_offset,
                       kbar + hv_offset, kg + hv_offset, scale, L, I, H, HV, K, BT, BC, BK,
                       FACTORED_DIAG, ALL_NEAR, L2NORM, DOT_DTYPE)
    tl.debug_barrier()
    chunk_solve_kernel(beta, Akk, Minv, chunk_rows, T, NT, HV, BT, BC, DOT_DTYPE, IS_VARLEN, False)
