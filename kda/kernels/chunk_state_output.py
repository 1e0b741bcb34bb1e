"""Chunk stages 2 and 3 fused (forward): the state carried from chunk to chunk and the outputs.

For each chunk in order, with incoming state ``S``, the corrections ``dV`` and the state update of
``chunk_state.py`` (the WY transform applied inside), the query-key matrix ``Aqk`` (scale
included) and the decayed queries ``Qt = scale q exp(c)`` (stage 1)::

    O = Qt S + Aqk dV

One program owns a ``[K, BV]`` slice of one sequence's state for one value head and walks that
sequence's chunks, the state in registers in float32. Against a carry that stores every chunk's
state and corrections and an output kernel that reads them back, it spares that traffic (H200,
(8, 4096, 16): 0.42 ms a call against 0.75 for the W/U kernel, carry and output kernel it
replaced). ``STORE_STATES`` also writes each chunk's incoming state (``return_intermediate_states``).
Held and formed transposed like the carry's (``chunk_state.py``): ``O^T = S^T Qt^T + dV^T Aqk^T``.
"""
import triton
import triton.language as tl

from kda.kernels.chunk_common import load_state, load_tile_t, mm, store_tile_t, sweep_program
from kda.kernels.chunk_state import carry_state, chunk_corrections


@triton.jit
def chunk_state_output_fwd_kernel(
    qt, kg, kbar, v, beta, gc, Aqk, Minv,
    o, h, h0, ht,
    cu_seqlens, chunk_offsets, seq_order,
    T, NT,
    stride_sk, stride_sv,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    DOT_DTYPE: tl.constexpr, IS_VARLEN: tl.constexpr,
    USE_INITIAL_STATE: tl.constexpr, STORE_FINAL_STATE: tl.constexpr, STORE_STATES: tl.constexpr,
):
    i_n, i_hv, i_v, bos, L, c0 = sweep_program(cu_seqlens, chunk_offsets, seq_order, T, NT, HV, V,
                                               BT, BV, IS_VARLEN)
    o_t = tl.arange(0, BT)
    # Aqk^T's lower triangle with the diagonal (entry [j, i] is row i, column j): the entries
    # above Aqk's diagonal are never written.
    m_tri_t = o_t[None, :] >= o_t[:, None]
    b_h, o_s, m_s = load_state(h0, i_n, i_hv, i_v, HV, K, V, stride_sk, stride_sv, BK, BV,
                               USE_INITIAL_STATE)
    b_ht = tl.trans(b_h)

    for i_t in range(tl.cdiv(L, BT)):
        row0 = bos + i_t * BT
        n = tl.minimum(L - i_t * BT, BT)
        if STORE_STATES:
            store_tile_t(h + ((c0 + i_t) * HV + i_hv) * K * V, b_ht, 0, K, V, i_v * BV, V, BK, BV)
        b_dt = chunk_corrections(kg, v, beta, Minv, b_ht, row0, n, i_hv, i_v, HV, K, V, BT, BK, BV,
                                 DOT_DTYPE)
        b_qtt = load_tile_t(qt + row0 * HV * K + i_hv * K, 0, n, HV * K, 0, K, BT, BK)
        b_At = tl.where(m_tri_t, load_tile_t(Aqk + row0 * HV * BT + i_hv * BT, 0, n, HV * BT, 0, BT, BT, BT), 0.)
        b_ot = mm(b_ht, b_qtt, DOT_DTYPE) + mm(b_dt, b_At, DOT_DTYPE)
        store_tile_t(o + row0 * HV * V + i_hv * V, b_ot, 0, n, HV * V, i_v * BV, V, BT, BV)
        b_ht = carry_state(b_ht, b_dt, kbar, gc, row0, n, i_hv, HV, K, BT, BK, DOT_DTYPE)

    if STORE_FINAL_STATE:
        tl.store(ht + o_s, tl.trans(b_ht), mask=m_s)
