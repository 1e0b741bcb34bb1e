"""Chunk stages 2 and 3 fused (forward): the state carried from chunk to chunk and the outputs.

For each chunk in order, with incoming state ``S``, the corrections ``dV`` and the state update of
``chunk_state.py`` (the WY transform applied inside), the query-key matrix ``Aqk`` (scale
included) and the decayed queries ``Qt = scale q exp(c)`` (the in-chunk stage)::

    O = Qt S + Aqk dV

One program owns a ``[K, BV]`` slice of one sequence's state for one value head and walks that
sequence's chunks, the state in registers in float32. Against a carry that stores every chunk's
state and corrections and an output kernel that reads them back, it spares that traffic (H200,
(8, 4096, 16): 0.42 ms a call against 0.75 for the W/U kernel, carry and output kernel it
replaced). ``STORE_STATES`` also writes each chunk's incoming state (``return_intermediate_states``).
The state is held transposed as in ``chunk_state.py`` (``O^T = S^T Qt^T + dV^T Aqk^T``), at every
shape: H200, ms a call against the untransposed build, 0.384 / 0.414 at (8, 4096, 16), 0.728 / 0.791
at (1, 8192, 96), 1.549 / 1.811 at (1, 32768, 32).
"""
import triton
import triton.language as tl

from kda.kernels.chunk_common import (load_slot_state, load_state, load_tile_o, lower_o, mm_o, oriented,
                                      store_tile_o, sweep_program)
from kda.kernels.chunk_state import carry_state, chunk_corrections, chunk_last_decay


@triton.jit
def chunk_state_output_fwd_kernel(
    qt, kg, kbar, v, beta, gc, Aqk, Minv,
    o, h, h0, ht,
    cu_seqlens, chunk_offsets, seq_order,
    state_indices, has_initial,  # optional (USE_STATE_INDICES): slots [N] of the pool h0 = ht, [N] bool
    T, NT,
    num_slots,                   # rows of the pool (USE_STATE_INDICES)
    stride_sk, stride_sv,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    DOT_DTYPE: tl.constexpr, IS_VARLEN: tl.constexpr, SLICES_INNERMOST: tl.constexpr,
    USE_INITIAL_STATE: tl.constexpr, STORE_FINAL_STATE: tl.constexpr, STORE_STATES: tl.constexpr,
    USE_STATE_INDICES: tl.constexpr = False, USE_HAS_INITIAL: tl.constexpr = False,
):
    # Always transposed: faster with few programs and with many (module docstring).
    TRANSPOSED: tl.constexpr = True
    i_n, i_hv, i_v, bos, L, c0 = sweep_program(cu_seqlens, chunk_offsets, seq_order, T, NT, HV, V,
                                               BT, BV, IS_VARLEN, SLICES_INNERMOST)
    # Aqk's entries above its diagonal are never written.
    m_tri = lower_o(BT, TRANSPOSED)
    if USE_STATE_INDICES:
        b_h, o_s, m_s, slot_ok, live = load_slot_state(h0, state_indices, has_initial, num_slots, i_n,
                                                       i_hv, i_v, HV, K, V, stride_sk, stride_sv, BK, BV,
                                                       USE_HAS_INITIAL)
    else:
        b_h, o_s, m_s = load_state(h0, i_n, i_hv, i_v, HV, K, V, stride_sk, stride_sv, BK, BV,
                                   USE_INITIAL_STATE)
    b_h = oriented(b_h, TRANSPOSED)

    for i_t in range(tl.cdiv(L, BT)):
        row0 = bos + i_t * BT
        n = tl.minimum(L - i_t * BT, BT)
        # Issued first, used last (carry_state).
        b_last = chunk_last_decay(gc, row0, n, i_hv, HV, K, BK)
        if STORE_STATES:
            store_tile_o(h + ((c0 + i_t) * HV + i_hv) * K * V, b_h, 0, K, V, i_v * BV, V, BK, BV,
                         TRANSPOSED)
        b_d = chunk_corrections(kg, v, beta, Minv, b_h, row0, n, i_hv, i_v, HV, K, V, BT, BK, BV,
                                DOT_DTYPE, TRANSPOSED)
        b_qt = load_tile_o(qt + row0 * HV * K + i_hv * K, 0, n, HV * K, 0, K, BT, BK, TRANSPOSED)
        b_A = tl.where(m_tri, load_tile_o(Aqk + row0 * HV * BT + i_hv * BT, 0, n, HV * BT, 0, BT, BT, BT,
                                          TRANSPOSED), 0.)
        b_o = mm_o(b_qt, b_h, DOT_DTYPE, TRANSPOSED) + mm_o(b_A, b_d, DOT_DTYPE, TRANSPOSED)
        if USE_STATE_INDICES:
            # Padding (a negative slot): zeros; a slot past the pool: NaN (load_slot_state).
            b_o = tl.where(slot_ok, b_o, tl.where(live, float('nan'), 0.))
        store_tile_o(o + row0 * HV * V + i_hv * V, b_o, 0, n, HV * V, i_v * BV, V, BT, BV, TRANSPOSED)
        b_h = carry_state(b_h, b_d, kbar, b_last, row0, n, i_hv, HV, K, BT, BK, DOT_DTYPE, TRANSPOSED)

    if STORE_FINAL_STATE:
        tl.store(ht + o_s, oriented(b_h, TRANSPOSED).to(ht.dtype.element_ty), mask=m_s)
