"""Chunk stage 2, the backward's recompute: the state carried from chunk to chunk, storing what
the gradient stages read.

For each chunk in order, with incoming state ``S`` (``[K, V]``) and the stage-1 outputs::

    h_c = S                                              (kept for the backward)
    dV  = U - W S                                        (the chunk's delta-rule corrections, kept)
    S   = Diag(exp(c_last)) S + Kbar^T dV                   (Kbar = k exp(c_last - c), from stage 1)

The forward itself runs the same sweep fused with the outputs and without W and U
(``chunk_state_output.py``). One program owns a ``[K, BV]`` slice of one sequence's state for one
value head and walks that sequence's chunks; the state stays in registers in float32.
"""
import triton
import triton.language as tl

from kda.kernels.chunk_common import (exp_nonpos, load_row, load_tile, mm, sequence_span, state_tile,
                                      store_tile)


@triton.jit
def chunk_state_fwd_kernel(
    kbar, w, u, gc,
    h, v_new, h0,
    cu_seqlens, chunk_offsets,
    T, NT,
    stride_sk, stride_sv,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    DOT_DTYPE: tl.constexpr, IS_VARLEN: tl.constexpr,
    USE_INITIAL_STATE: tl.constexpr,
):
    # (sequence, head) on axis 0, which allows 2^31 - 1 programs; axis 1 stops at 65535.
    i_nh, i_v = tl.program_id(0), tl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    bos, L, c0 = sequence_span(i_n, cu_seqlens, chunk_offsets, T, NT, BT, IS_VARLEN)

    o_s, m_s = state_tile(i_n, i_hv, i_v, HV, K, V, stride_sk, stride_sv, BK, BV)
    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_INITIAL_STATE:
        b_h += tl.load(h0 + o_s, mask=m_s, other=0.).to(tl.float32)

    for i_t in range(tl.cdiv(L, BT)):
        row0 = bos + i_t * BT
        n = tl.minimum(L - i_t * BT, BT)
        store_tile(h + ((c0 + i_t) * HV + i_hv) * K * V, b_h, 0, K, V, i_v * BV, V, BK, BV)
        b_w = load_tile(w + row0 * HV * K + i_hv * K, 0, n, HV * K, 0, K, BT, BK)
        b_u = load_tile(u + row0 * HV * V + i_hv * V, 0, n, HV * V, i_v * BV, V, BT, BV)
        b_d = b_u - mm(b_w, b_h, DOT_DTYPE)
        store_tile(v_new + row0 * HV * V + i_hv * V, b_d, 0, n, HV * V, i_v * BV, V, BT, BV)
        b_kbar = load_tile(kbar + row0 * HV * K + i_hv * K, 0, n, HV * K, 0, K, BT, BK)
        b_last = load_row(gc + row0 * HV * K + i_hv * K, n - 1, n, HV * K, 0, K, BK)
        b_h = b_h * exp_nonpos(b_last)[:, None] + mm(tl.trans(b_kbar), b_d, DOT_DTYPE)
