"""Chunk stage 2 (backward): the state gradient, swept from the last chunk to the first.

With ``dS`` the gradient of the state after chunk c (the final-state gradient for the last chunk)
and the forward's ``O = Qt h_c + Aqk dV``, ``dV = M diag(beta) (V - Kg h_c)``,
``S' = Diag(exp(c_last)) h_c + Kbar^T dV`` (``Qt = scale q exp(c)``, ``Kg = k exp(c)``,
``Kbar = k exp(c_last - c)``, from stage 1)::

    dh_c  = dS                                           (kept for the per-chunk gradient stage)
    d(dV) = Aqk^T dO + Kbar dS
    dS    = Diag(exp(c_last)) dS + Qt^T dO - Kg^T diag(beta) M^T d(dV)

(the last term is the WY form's ``W^T d(dV)``, ``W = M diag(beta) Kg``, never formed).

The last ``dS`` is the gradient of the initial state. Held and formed transposed, as the forward
sweeps do (``chunk_state.py``): ``d(dV)^T = dO^T Aqk + dS^T Kbar^T``,
``dS^T <- dS^T Diag(exp(c_last)) + dO^T Qt - d(dV)^T M diag(beta) Kg``.
"""
import triton
import triton.language as tl

from kda.kernels.chunk_common import (exp_nonpos, load_row, load_state, load_tile, load_tile_t, mm,
                                      store_tile_t, sweep_program)
from kda.kernels.chunk_state import chunk_beta_inverse_t


@triton.jit
def chunk_state_bwd_kernel(
    qt, kbar, kg, beta, gc, Aqk, Minv, do,
    dh, dv_new, dht, dh0,
    cu_seqlens, chunk_offsets, seq_order,
    T, NT,
    stride_sk, stride_sv,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    DOT_DTYPE: tl.constexpr, IS_VARLEN: tl.constexpr,
    USE_FINAL_STATE_GRADIENT: tl.constexpr, STORE_INITIAL_STATE_GRADIENT: tl.constexpr,
):
    i_n, i_hv, i_v, bos, L, c0 = sweep_program(cu_seqlens, chunk_offsets, seq_order, T, NT, HV, V,
                                               BT, BV, IS_VARLEN)
    o_t = tl.arange(0, BT)
    b_dh, o_s, m_s = load_state(dht, i_n, i_hv, i_v, HV, K, V, stride_sk, stride_sv, BK, BV,
                                USE_FINAL_STATE_GRADIENT)
    b_dht = tl.trans(b_dh)

    for i_r in range(tl.cdiv(L, BT)):
        i_t = tl.cdiv(L, BT) - 1 - i_r
        row0 = bos + i_t * BT
        n = tl.minimum(L - i_t * BT, BT)
        store_tile_t(dh + ((c0 + i_t) * HV + i_hv) * K * V, b_dht, 0, K, V, i_v * BV, V, BK, BV)
        b_dot = load_tile_t(do + row0 * HV * V + i_hv * V, 0, n, HV * V, i_v * BV, V, BT, BV)
        b_A = load_tile(Aqk + row0 * HV * BT + i_hv * BT, 0, n, HV * BT, 0, BT, BT, BT)
        b_A = tl.where(o_t[:, None] >= o_t[None, :], b_A, 0.)
        b_kbart = load_tile_t(kbar + row0 * HV * K + i_hv * K, 0, n, HV * K, 0, K, BT, BK)
        b_last = load_row(gc + row0 * HV * K + i_hv * K, n - 1, n, HV * K, 0, K, BK)
        b_ddvt = mm(b_dot, b_A, DOT_DTYPE) + mm(b_dht, b_kbart, DOT_DTYPE)
        store_tile_t(dv_new + row0 * HV * V + i_hv * V, b_ddvt, 0, n, HV * V, i_v * BV, V, BT, BV)
        b_qt = load_tile(qt + row0 * HV * K + i_hv * K, 0, n, HV * K, 0, K, BT, BK)
        b_kg = load_tile(kg + row0 * HV * K + i_hv * K, 0, n, HV * K, 0, K, BT, BK)
        b_beta, b_Mt = chunk_beta_inverse_t(beta, Minv, row0, n, i_hv, HV, BT)
        b_xt = mm(b_ddvt, tl.trans(b_Mt), DOT_DTYPE) * b_beta[None, :]
        b_dht = (b_dht * exp_nonpos(b_last)[None, :] + mm(b_dot, b_qt, DOT_DTYPE)
                 - mm(b_xt, b_kg, DOT_DTYPE))

    if STORE_INITIAL_STATE_GRADIENT:
        tl.store(dh0 + o_s, tl.trans(b_dht), mask=m_s)
