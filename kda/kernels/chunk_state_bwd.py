"""Chunk stage 2 (backward): the state gradient, swept from the last chunk to the first.

With ``dS`` the gradient of the state after chunk c (the final-state gradient for the last chunk)
and the forward's ``O = Qt h_c + Aqk dV``, ``dV = M diag(beta) (V - Kg h_c)``,
``S' = Diag(exp(c_last)) h_c + Kbar^T dV`` (``Qt = scale q exp(c)``, ``Kg = k exp(c)``,
``Kbar = k exp(c_last - c)``, from the in-chunk stage)::

    dh_c  = dS                                           (kept for the per-chunk gradient stage)
    d(dV) = Aqk^T dO + Kbar dS
    dS    = Diag(exp(c_last)) dS + Qt^T dO - Kg^T diag(beta) M^T d(dV)

(the last term is the WY form's ``W^T d(dV)``, ``W = M diag(beta) Kg``, never formed).

The last ``dS`` is the gradient of the initial state. ``TRANSPOSED`` as in ``chunk_state.py``:
``d(dV)^T = dO^T Aqk + dS^T Kbar^T``, ``dS^T <- dS^T Diag(exp(c_last)) + dO^T Qt - d(dV)^T M diag(beta) Kg``.
"""
import triton
import triton.language as tl

from kda.kernels.chunk_common import (exp_nonpos, load_state, load_tile_o, load_tile_ot, lower_o,
                                      mm_o, oriented, rows_o, store_tile_o, sweep_program)
from kda.kernels.chunk_state import chunk_beta_inverse, chunk_last_decay


@triton.jit
def chunk_state_bwd_kernel(
    qt, kbar, kg, beta, gc, Aqk, Minv, do,
    dh, dv_new, dht, dh0,
    cu_seqlens, chunk_offsets, seq_order,
    T, NT,
    stride_sk, stride_sv,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    DOT_DTYPE: tl.constexpr, IS_VARLEN: tl.constexpr, SLICES_INNERMOST: tl.constexpr,
    USE_FINAL_STATE_GRADIENT: tl.constexpr, STORE_INITIAL_STATE_GRADIENT: tl.constexpr,
    TRANSPOSED: tl.constexpr,
):
    i_n, i_hv, i_v, bos, L, c0 = sweep_program(cu_seqlens, chunk_offsets, seq_order, T, NT, HV, V,
                                               BT, BV, IS_VARLEN, SLICES_INNERMOST)
    b_dh, o_s, m_s = load_state(dht, i_n, i_hv, i_v, HV, K, V, stride_sk, stride_sv, BK, BV,
                                USE_FINAL_STATE_GRADIENT)
    b_dh = oriented(b_dh, TRANSPOSED)

    for i_r in range(tl.cdiv(L, BT)):
        i_t = tl.cdiv(L, BT) - 1 - i_r
        row0 = bos + i_t * BT
        n = tl.minimum(L - i_t * BT, BT)
        store_tile_o(dh + ((c0 + i_t) * HV + i_hv) * K * V, b_dh, 0, K, V, i_v * BV, V, BK, BV, TRANSPOSED)
        b_do = load_tile_o(do + row0 * HV * V + i_hv * V, 0, n, HV * V, i_v * BV, V, BT, BV, TRANSPOSED)
        # Aqk^T: Aqk's entries above its diagonal are never written.
        b_At = tl.where(lower_o(BT, not TRANSPOSED),
                        load_tile_ot(Aqk + row0 * HV * BT + i_hv * BT, 0, n, HV * BT, 0, BT, BT, BT, TRANSPOSED),
                        0.)
        b_kbar = load_tile_o(kbar + row0 * HV * K + i_hv * K, 0, n, HV * K, 0, K, BT, BK, TRANSPOSED)
        b_last = chunk_last_decay(gc, row0, n, i_hv, HV, K, BK)
        b_ddv = mm_o(b_At, b_do, DOT_DTYPE, TRANSPOSED) + mm_o(b_kbar, b_dh, DOT_DTYPE, TRANSPOSED)
        store_tile_o(dv_new + row0 * HV * V + i_hv * V, b_ddv, 0, n, HV * V, i_v * BV, V, BT, BV, TRANSPOSED)
        b_qtt = load_tile_ot(qt + row0 * HV * K + i_hv * K, 0, n, HV * K, 0, K, BT, BK, TRANSPOSED)
        b_kgt = load_tile_ot(kg + row0 * HV * K + i_hv * K, 0, n, HV * K, 0, K, BT, BK, TRANSPOSED)
        b_beta, b_Mt = chunk_beta_inverse(beta, Minv, row0, n, i_hv, HV, BT, True, TRANSPOSED)
        b_x = mm_o(b_Mt, b_ddv, DOT_DTYPE, TRANSPOSED) * rows_o(b_beta, TRANSPOSED)
        b_dh = (b_dh * rows_o(exp_nonpos(b_last), TRANSPOSED) + mm_o(b_qtt, b_do, DOT_DTYPE, TRANSPOSED)
                - mm_o(b_kgt, b_x, DOT_DTYPE, TRANSPOSED))

    if STORE_INITIAL_STATE_GRADIENT:
        tl.store(dh0 + o_s, oriented(b_dh, TRANSPOSED), mask=m_s)
