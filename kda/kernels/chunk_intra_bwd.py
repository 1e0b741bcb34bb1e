"""The backward's per-chunk gradients: every per-token gradient of one chunk.

Inputs per chunk: ``h_c`` and ``dh_c`` (state before the chunk, gradient of the state after it),
``dV`` (forward corrections) and ``d(dV)`` (from the state sweep), ``dO``, and the recomputed
``M = (I + A)^-1`` and ``A'``. With ``X = [diag(beta) Kt | diag(beta) v]`` and
``[W | U] = M X`` (``Kt = k exp(c)``, ``Qt = scale q exp(c)``, ``Kbar = k exp(c_last - c)``)::

    dAqk = dO dV^T                       dQt = dO h_c^T          dKbar = dV dh_c^T
    dW   = -d(dV) h_c^T                  dU  = d(dV)
    dX   = M^T [dW | dU]                 dA  = -dX [W | U]^T = -dX_u dV^T   (strictly lower part)
    dv   = beta dX_u,   dKt = beta dX_w,  dA' = diag(beta) dA,
    dbeta = rowsum(dX_w * Kt + dX_u * v + dA * A')      (* element-wise)

``dA`` through ``dV`` itself: ``dX_w W^T = M^T dW W^T = -dX_u (W h_c)^T``, so
``dX [W | U]^T = dX_u (U - W h_c)^T = dX_u dV^T``, the gradient in ``A`` of
``(I + A) dV = diag(beta) (V - Kt h_c)``: one ``[BT, V] x [V, BT]`` product on tiles the value
side loads anyway (``dV`` as the state carry stored it); neither W nor U is formed.

Then the decayed pair products ``P[i, j] = sum_d a_id b_jd exp(c_id - c_jd)`` (Aqk with a = q,
scale in dP; A' with a = k) give ``da_i = sum_j dP_ij b_j exp(c_i - c_j)``,
``db_j = sum_i dP_ij a_i exp(c_i - c_j)``, ``dc_i += a_i da_i``, ``dc_j -= b_j db_j``, computed in
the same sub-blocks as the forward. ``c`` is a cumulative sum, so ``dg`` is the reverse cumulative
sum of ``dc`` (``c_last`` feeds the last row), zero where the forward clamped ``g``.

Three kernels, in order: ``chunk_intra_bwd_kernel`` (one program per chunk: everything above the
pair products; dq, dk, dc so far), ``chunk_pair_bwd_kernel`` (one program per ``[BC, BK]`` tile:
adds the pair-product terms), ``chunk_gate_bwd_kernel`` (dc -> dg; through the in-kernel gate to
the raw gate, and each chunk's sums of the A_log and dt_bias gradients when there is one); then,
with the gate's parameters, ``gate_param_grad_kernel`` (those sums over the chunks).
"""
import triton
import triton.language as tl

from kda.kernels.chunk_common import (LOG_DECAY_FLOOR, chunk_span, diag_factors, diag_reference,
                                      exp_nonpos, load_row, load_rows, load_tile, mm, mm_fine,
                                      scale_rows, store_tile, within_diag_span)
from kda.kernels.gate import gate_bwd, log_decay_tile


@triton.jit
def group_row_grads(b_p1, b_p2, b_k, b_c, k_base, gc_base, X, i_k, L, QK_STRIDE, GC_STRIDE,
                    K: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """Diagonal block X of ``pair_row_grads`` for any decay: its rows cut into groups of G = 4;
    entries between groups b < a factor through the last row of group b (both factors <= 1),
    one ``mm_fine`` product per group and matrix; the 4 x 4 diagonal groups element by element, one
    gathered row of k (and one entry of dP per row) at a time. ``b_p*``: dP[X, X] (zero above
    the diagonal); ``b_k``, ``b_c``: the block's keys and cumulative decays."""
    G: tl.constexpr = 4
    o_i = tl.arange(0, BC)
    o_g = o_i // G
    b_d1 = tl.zeros([BC, BK], dtype=tl.float32)
    b_d2 = tl.zeros([BC, BK], dtype=tl.float32)
    for b in range(BC // G - 1):
        b_r = load_row(gc_base, X * BC + b * G + G - 1, L, GC_STRIDE, i_k * BK, K, BK)
        b_up = tl.where((o_g > b)[:, None], exp_nonpos(b_c - b_r[None, :]), 0.)
        b_kd = tl.where((o_g == b)[:, None], b_k * exp_nonpos(b_r[None, :] - b_c), 0.)
        b_d1 += mm_fine(b_p1, b_kd, DOT_DTYPE) * b_up
        b_d2 += mm_fine(b_p2, b_kd, DOT_DTYPE) * b_up
    for t in range(G):
        o_j = o_g * G + t
        b_kj = load_rows(k_base, X * BC + o_j, L, QK_STRIDE, i_k * BK, K, BK)
        b_cj = load_rows(gc_base, X * BC + o_j, L, GC_STRIDE, i_k * BK, K, BK)
        b_kj *= exp_nonpos(b_c - b_cj)
        m_j = o_i[None, :] == o_j[:, None]
        b_d1 += tl.sum(tl.where(m_j, b_p1, 0.), axis=1)[:, None] * b_kj
        b_d2 += tl.sum(tl.where(m_j, b_p2, 0.), axis=1)[:, None] * b_kj
    return b_d1, b_d2


@triton.jit
def group_col_grads(b_pt1, b_pt2, b_q, b_k, b_c, q_base, k_base, gc_base, X, i_k, L, QK_STRIDE,
                    GC_STRIDE, K: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
                    DOT_DTYPE: tl.constexpr):
    """Diagonal block X of ``pair_col_grads`` for any decay, by the groups of
    ``group_row_grads`` seen from the column side: row j of the result sums over the rows
    i >= j; ``b_pt*`` = dP[X, X]^T (row j, column i)."""
    G: tl.constexpr = 4
    o_i = tl.arange(0, BC)
    o_g = o_i // G
    b_d = tl.zeros([BC, BK], dtype=tl.float32)
    for b in range(BC // G - 1):
        b_r = load_row(gc_base, X * BC + b * G + G - 1, L, GC_STRIDE, i_k * BK, K, BK)
        b_dn = tl.where((o_g == b)[:, None], exp_nonpos(b_r[None, :] - b_c), 0.)
        b_ea = tl.where((o_g > b)[:, None], exp_nonpos(b_c - b_r[None, :]), 0.)
        b_d += (mm_fine(b_pt1, b_q * b_ea, DOT_DTYPE) + mm_fine(b_pt2, b_k * b_ea, DOT_DTYPE)) * b_dn
    for t in range(G):
        o_s = o_g * G + t
        b_qs = load_rows(q_base, X * BC + o_s, L, QK_STRIDE, i_k * BK, K, BK)
        b_ks = load_rows(k_base, X * BC + o_s, L, QK_STRIDE, i_k * BK, K, BK)
        b_cs = load_rows(gc_base, X * BC + o_s, L, GC_STRIDE, i_k * BK, K, BK)
        b_e = exp_nonpos(b_cs - b_c)
        m_s = o_i[None, :] == o_s[:, None]
        b_d += (tl.sum(tl.where(m_s, b_pt1, 0.), axis=1)[:, None] * b_qs
                + tl.sum(tl.where(m_s, b_pt2, 0.), axis=1)[:, None] * b_ks) * b_e
    return b_d


@triton.jit
def factored_row_grads(b_d1, b_d2, b_p1, b_p2, b_k, b_c, b_r, m_r, DOT_DTYPE: tl.constexpr):
    """Adds the diagonal block of ``pair_row_grads`` through its middle row r (``mm_fine``
    products; ``chunk_common.diag_reference`` says when this is allowed and why not 16 bits). A factor reaches
    exp(60), so dP enters with its rows scaled to max |.| = 1 and the scale is applied after
    exp(c_i - r) has brought the product back to its true size: unscaled, gradients above ~3e12
    overflowed (review: v * 1e16 gave inf dq where the element-wise path was finite)."""
    b_up, b_dn = diag_factors(b_c, b_r, m_r)
    b_kd = b_k * b_dn
    b_p1, b_s1 = scale_rows(b_p1)
    b_p2, b_s2 = scale_rows(b_p2)
    b_d1 += (mm_fine(b_p1, b_kd, DOT_DTYPE) * b_up) * b_s1[:, None]
    b_d2 += (mm_fine(b_p2, b_kd, DOT_DTYPE) * b_up) * b_s2[:, None]
    return b_d1, b_d2


@triton.jit
def factored_col_grads(b_d, b_p1, b_p2, b_q, b_k, b_c, b_r, m_r, DOT_DTYPE: tl.constexpr):
    """Adds the diagonal block of ``pair_col_grads`` through its middle row r, as
    ``factored_row_grads`` from the column side (``b_p*``: dP[X, X], transposed here)."""
    b_up, b_dn = diag_factors(b_c, b_r, m_r)
    b_p1, b_s1 = scale_rows(tl.trans(b_p1))
    b_p2, b_s2 = scale_rows(tl.trans(b_p2))
    b_d += ((mm_fine(b_p1, b_q * b_up, DOT_DTYPE) * b_dn) * b_s1[:, None]
            + (mm_fine(b_p2, b_k * b_up, DOT_DTYPE) * b_dn) * b_s2[:, None])
    return b_d


@triton.jit
def pair_diag_grads(dP1_base, dP2_base, q_base, k_base, gc_base, X, b_qX, b_kX, b_cX, i_k, L,
                    P_STRIDE, QK_STRIDE, GC_STRIDE, K: tl.constexpr, BC: tl.constexpr,
                    BK: tl.constexpr, BOUNDED_DECAY: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """Diagonal block X of both sides (dP is zero above its diagonal): ``(d1, d2, d)`` with
    ``d1``, ``d2`` the row side of Aqk and A' and ``d`` the column side of both. Through the middle
    row r where the decay allows (always with BOUNDED_DECAY: steps >= -5 keep every row within 40
    of r; otherwise tested per block), the factors and dP tiles shared by the two sides; else by
    4-row groups (``group_*_grads``; the ``[BC, BC, BK]`` element-wise block they replaced held 255
    registers and 420 B of spills a thread in every program)."""
    b_p1 = load_tile(dP1_base, X * BC, L, P_STRIDE, X * BC, L, BC, BC)
    b_p2 = load_tile(dP2_base, X * BC, L, P_STRIDE, X * BC, L, BC, BC)
    b_r, m_r = diag_reference(b_cX, gc_base, GC_STRIDE, X, L, i_k * BK, K, BC, BK)
    b_d1 = tl.zeros([BC, BK], dtype=tl.float32)
    b_d2 = tl.zeros([BC, BK], dtype=tl.float32)
    b_d = tl.zeros([BC, BK], dtype=tl.float32)
    if BOUNDED_DECAY:
        b_d1, b_d2 = factored_row_grads(b_d1, b_d2, b_p1, b_p2, b_kX, b_cX, b_r, m_r, DOT_DTYPE)
        b_d = factored_col_grads(b_d, b_p1, b_p2, b_qX, b_kX, b_cX, b_r, m_r, DOT_DTYPE)
    elif within_diag_span(b_cX, b_r, m_r):
        b_d1, b_d2 = factored_row_grads(b_d1, b_d2, b_p1, b_p2, b_kX, b_cX, b_r, m_r, DOT_DTYPE)
        b_d = factored_col_grads(b_d, b_p1, b_p2, b_qX, b_kX, b_cX, b_r, m_r, DOT_DTYPE)
    else:
        b_d1, b_d2 = group_row_grads(b_p1, b_p2, b_kX, b_cX, k_base, gc_base, X, i_k, L, QK_STRIDE,
                                     GC_STRIDE, K, BC, BK, DOT_DTYPE)
        b_d = group_col_grads(tl.trans(b_p1), tl.trans(b_p2), b_qX, b_kX, b_cX, q_base, k_base,
                              gc_base, X, i_k, L, QK_STRIDE, GC_STRIDE, K, BC, BK, DOT_DTYPE)
    return b_d1, b_d2, b_d


@triton.jit
def pair_row_grads(b_d1, b_d2, dP1_base, dP2_base, k_base, gc_base, X, b_cX, i_k, L,
                   P_STRIDE, QK_STRIDE, GC_STRIDE, K: tl.constexpr, BC: tl.constexpr,
                   BK: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """Row side of sub-block X below the diagonal: adds ``sum_{J < X} dP[X, J] (k_J *
    exp(c_X - c_J))`` for both pair matrices (their column partner is k in both), through the last
    row r of J: ``exp(c_X - r) exp(r - c_J)``, both <= 1."""
    for J in range(X):
        b_p1 = load_tile(dP1_base, X * BC, L, P_STRIDE, J * BC, L, BC, BC)
        b_p2 = load_tile(dP2_base, X * BC, L, P_STRIDE, J * BC, L, BC, BC)
        b_kJ = load_tile(k_base, J * BC, L, QK_STRIDE, i_k * BK, K, BC, BK)
        b_cJ = load_tile(gc_base, J * BC, L, GC_STRIDE, i_k * BK, K, BC, BK)
        b_r = load_row(gc_base, J * BC + BC - 1, L, GC_STRIDE, i_k * BK, K, BK)
        b_kJ = b_kJ * exp_nonpos(b_r[None, :] - b_cJ)
        b_eX = exp_nonpos(b_cX - b_r[None, :])
        b_d1 += mm(b_p1, b_kJ, DOT_DTYPE) * b_eX
        b_d2 += mm(b_p2, b_kJ, DOT_DTYPE) * b_eX
    return b_d1, b_d2


@triton.jit
def pair_col_grads(b_d, dP1_base, dP2_base, q_base, k_base, gc_base, X, b_cX, i_k, L,
                   P_STRIDE, QK_STRIDE, GC_STRIDE, K: tl.constexpr, BC: tl.constexpr,
                   NC: tl.constexpr, BK: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """Column side of sub-block X above the diagonal: adds ``sum_{I > X} dP[I, X]^T (a_I *
    exp(c_I - c_X))`` with a = q for Aqk and a = k for A', summed, through the last row of X."""
    for I in range(X + 1, NC):
        b_p1 = load_tile(dP1_base, I * BC, L, P_STRIDE, X * BC, L, BC, BC)
        b_p2 = load_tile(dP2_base, I * BC, L, P_STRIDE, X * BC, L, BC, BC)
        b_qI = load_tile(q_base, I * BC, L, QK_STRIDE, i_k * BK, K, BC, BK)
        b_kI = load_tile(k_base, I * BC, L, QK_STRIDE, i_k * BK, K, BC, BK)
        b_cI = load_tile(gc_base, I * BC, L, GC_STRIDE, i_k * BK, K, BC, BK)
        b_r = load_row(gc_base, X * BC + BC - 1, L, GC_STRIDE, i_k * BK, K, BK)
        b_eI = exp_nonpos(b_cI - b_r[None, :])
        b_s = mm(tl.trans(b_p1), b_qI * b_eI, DOT_DTYPE) + mm(tl.trans(b_p2), b_kI * b_eI, DOT_DTYPE)
        b_d += b_s * exp_nonpos(b_r[None, :] - b_cX)
    return b_d


@triton.jit
def chunk_intra_bwd_kernel(
    q, k, v, beta, gc, Akk, Minv, h, v_new, do, dh, dv_new,
    dq, dk, dv, dbeta, dg, dAqk, dAkk,
    chunk_rows,
    scale, T, NT,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    DOT_DTYPE: tl.constexpr, IS_VARLEN: tl.constexpr,
):
    i_c, i_hv = tl.program_id(0), tl.program_id(1)
    i_h = i_hv // (HV // H)
    start, L = chunk_span(i_c, chunk_rows, T, NT, BT, IS_VARLEN)
    o_t = tl.arange(0, BT)

    q_base = q + start * H * K + i_h * K
    k_base = k + start * H * K + i_h * K
    v_base = v + start * HV * V + i_hv * V
    gc_base = gc + start * HV * K + i_hv * K
    vn_base = v_new + start * HV * V + i_hv * V
    dvn_base = dv_new + start * HV * V + i_hv * V
    do_base = do + start * HV * V + i_hv * V
    dq_base = dq + start * HV * K + i_hv * K
    dk_base = dk + start * HV * K + i_hv * K
    dg_base = dg + start * HV * K + i_hv * K
    dv_base = dv + start * HV * V + i_hv * V
    P_off = start * HV * BT + i_hv * BT
    h_base = h + (i_c.to(tl.int64) * HV + i_hv) * K * V
    dh_base = dh + (i_c.to(tl.int64) * HV + i_hv) * K * V

    b_beta = tl.load(beta + (start + o_t) * HV + i_hv, mask=o_t < L, other=0.).to(tl.float32)
    b_M = load_tile(Minv + P_off, 0, L, HV * BT, 0, BT, BT, BT)
    b_M = tl.where(o_t[:, None] >= o_t[None, :], b_M, 0.)
    b_dAqk = tl.zeros([BT, BT], dtype=tl.float32)
    b_dA = tl.zeros([BT, BT], dtype=tl.float32)
    b_db = tl.zeros([BT], dtype=tl.float32)

    # Value side: dAqk, dv and dA (all of it: -dX_u dV^T, see the docstring).
    for i_v in range(tl.cdiv(V, BV)):
        b_do = load_tile(do_base, 0, L, HV * V, i_v * BV, V, BT, BV)
        b_vn = load_tile(vn_base, 0, L, HV * V, i_v * BV, V, BT, BV)
        b_dvn = load_tile(dvn_base, 0, L, HV * V, i_v * BV, V, BT, BV)
        b_v = load_tile(v_base, 0, L, HV * V, i_v * BV, V, BT, BV)
        b_dAqk += mm(b_do, tl.trans(b_vn), DOT_DTYPE)
        b_xu = mm(tl.trans(b_M), b_dvn, DOT_DTYPE)
        store_tile(dv_base, b_xu * b_beta[:, None], 0, L, HV * V, i_v * BV, V, BT, BV)
        b_db += tl.sum(b_xu * b_v, axis=1)
        b_dA -= mm(b_xu, tl.trans(b_vn), DOT_DTYPE)

    # Done with dAqk and dA: to scratch now, so they hold no registers through the key side.
    b_dAqk = tl.where(o_t[:, None] >= o_t[None, :], b_dAqk * scale, 0.)
    store_tile(dAqk + P_off, b_dAqk, 0, L, HV * BT, 0, BT, BT, BT)
    # A = diag(beta) A': the beta gradient's A part, then the pair-matrix gradient.
    # Blocks above the diagonal of Akk were never written: select, don't multiply by zero.
    b_Akk = load_tile(Akk + P_off, 0, L, HV * BT, 0, BT, BT, BT)
    m_strict = o_t[:, None] > o_t[None, :]
    b_dA = tl.where(m_strict, b_dA, 0.)
    b_db += tl.sum(tl.where(m_strict, b_dA * b_Akk, 0.), axis=1)
    store_tile(dAkk + P_off, b_dA * b_beta[:, None], 0, L, HV * BT, 0, BT, BT, BT)

    # Key side, one K-slice at a time: the state terms, and dq, dk, dc so far.
    for i_k in range(tl.cdiv(K, BK)):
        b_dqt = tl.zeros([BT, BK], dtype=tl.float32)
        b_dkbar = tl.zeros([BT, BK], dtype=tl.float32)
        b_dw = tl.zeros([BT, BK], dtype=tl.float32)
        b_dlast = tl.zeros([BK], dtype=tl.float32)
        for i_v in range(tl.cdiv(V, BV)):
            b_do = load_tile(do_base, 0, L, HV * V, i_v * BV, V, BT, BV)
            b_vn = load_tile(vn_base, 0, L, HV * V, i_v * BV, V, BT, BV)
            b_dvn = load_tile(dvn_base, 0, L, HV * V, i_v * BV, V, BT, BV)
            b_h = load_tile(h_base, i_k * BK, K, V, i_v * BV, V, BK, BV)
            b_dh = load_tile(dh_base, i_k * BK, K, V, i_v * BV, V, BK, BV)
            b_dqt += mm(b_do, tl.trans(b_h), DOT_DTYPE)
            b_dkbar += mm(b_vn, tl.trans(b_dh), DOT_DTYPE)
            b_dw -= mm(b_dvn, tl.trans(b_h), DOT_DTYPE)
            b_dlast += tl.sum(b_h * b_dh, axis=1)
        b_q = load_tile(q_base, 0, L, H * K, i_k * BK, K, BT, BK)
        b_k = load_tile(k_base, 0, L, H * K, i_k * BK, K, BT, BK)
        b_c = load_tile(gc_base, 0, L, HV * K, i_k * BK, K, BT, BK)
        b_last = load_row(gc_base, L - 1, L, HV * K, i_k * BK, K, BK)
        # Each gradient finished and stored as soon as its inputs are (dq first): fewer tiles live
        # at once, fewer spills (docs/tuning.md, intra_bwd).
        b_e = exp_nonpos(b_c)
        b_dqt = b_dqt * b_e * scale
        store_tile(dq_base, b_dqt, 0, L, HV * K, i_k * BK, K, BT, BK)
        b_dc = b_dqt * b_q
        b_ebar = exp_nonpos(b_last[None, :] - b_c)
        b_dkbar = b_dkbar * b_ebar
        b_kd = b_dkbar * b_k
        b_dc -= b_kd
        b_dlast = b_dlast * exp_nonpos(b_last) + tl.sum(b_kd, axis=0)
        b_kt = b_k * b_e
        b_xw = mm(tl.trans(b_M), b_dw, DOT_DTYPE)
        b_dkt = b_xw * b_beta[:, None]
        b_db += tl.sum(b_xw * b_kt, axis=1)
        b_dc += b_dkt * b_kt
        b_dc += tl.where(o_t[:, None] == L - 1, b_dlast[None, :], 0.)
        store_tile(dk_base, b_dkt * b_e + b_dkbar, 0, L, HV * K, i_k * BK, K, BT, BK)
        store_tile(dg_base, b_dc, 0, L, HV * K, i_k * BK, K, BT, BK)

    tl.store(dbeta + (start + o_t) * HV + i_hv, b_db, mask=o_t < L)


@triton.jit
def chunk_pair_bwd_kernel(
    q, k, gc, dAqk, dAkk, dq, dk, dg,
    chunk_rows,
    T, NT,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
    BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
    BOUNDED_DECAY: tl.constexpr, DOT_DTYPE: tl.constexpr, IS_VARLEN: tl.constexpr,
):
    """The pair-matrix gradients of one ``[BC, BK]`` tile (sub-block X, key slice i_k) of a chunk,
    added to the dq, dk and dc that ``chunk_intra_bwd_kernel`` stored. One program per tile rather
    than a loop over tiles inside the chunk's program: the tiles are independent, and the chunk's
    program ran them one after another at one program per SM (ptxas: 255 registers).
    ``BOUNDED_DECAY``: every step's log-decay is >= -5 (the lower-bound gate), so the diagonal
    blocks never need the 4-row fallback, which is then not compiled in."""
    tl.static_assert(BT % BC == 0, "the chunk must be a whole number of sub-blocks")
    NC: tl.constexpr = BT // BC
    NK: tl.constexpr = (K + BK - 1) // BK
    i_cx, i_hvk = tl.program_id(0), tl.program_id(1)
    i_c, X = i_cx // NC, i_cx % NC
    i_hv, i_k = i_hvk // NK, i_hvk % NK
    i_h = i_hv // (HV // H)
    start, L = chunk_span(i_c, chunk_rows, T, NT, BT, IS_VARLEN)
    q_base = q + start * H * K + i_h * K
    k_base = k + start * H * K + i_h * K
    gc_base = gc + start * HV * K + i_hv * K
    P_off = start * HV * BT + i_hv * BT
    dq_base = dq + start * HV * K + i_hv * K
    dk_base = dk + start * HV * K + i_hv * K
    dg_base = dg + start * HV * K + i_hv * K

    b_qX = load_tile(q_base, X * BC, L, H * K, i_k * BK, K, BC, BK)
    b_kX = load_tile(k_base, X * BC, L, H * K, i_k * BK, K, BC, BK)
    b_cX = load_tile(gc_base, X * BC, L, HV * K, i_k * BK, K, BC, BK)
    # The diagonal blocks first, both sides in one helper: they share the factors and dP tiles,
    # and only three [BC, BK] accumulators are live when the blocks below and beside it start:
    # fewer spills, faster (docs/tuning.md, pair_bwd: "diagonal blocks first").
    b_dq1, b_dk2, b_dkc = pair_diag_grads(dAqk + P_off, dAkk + P_off, q_base, k_base, gc_base, X,
                                          b_qX, b_kX, b_cX, i_k, L, HV * BT, H * K, HV * K, K, BC, BK,
                                          BOUNDED_DECAY, DOT_DTYPE)
    b_dq1, b_dk2 = pair_row_grads(b_dq1, b_dk2, dAqk + P_off, dAkk + P_off, k_base, gc_base, X, b_cX,
                                  i_k, L, HV * BT, H * K, HV * K, K, BC, BK, DOT_DTYPE)
    b_dkc = pair_col_grads(b_dkc, dAqk + P_off, dAkk + P_off, q_base, k_base, gc_base, X, b_cX, i_k,
                           L, HV * BT, H * K, HV * K, K, BC, NC, BK, DOT_DTYPE)
    b_dqX = load_tile(dq_base, X * BC, L, HV * K, i_k * BK, K, BC, BK) + b_dq1
    b_dkX = load_tile(dk_base, X * BC, L, HV * K, i_k * BK, K, BC, BK) + b_dk2 + b_dkc
    b_dcX = (load_tile(dg_base, X * BC, L, HV * K, i_k * BK, K, BC, BK)
             + b_qX * b_dq1 + b_kX * (b_dk2 - b_dkc))
    store_tile(dq_base, b_dqX, X * BC, L, HV * K, i_k * BK, K, BC, BK)
    store_tile(dk_base, b_dkX, X * BC, L, HV * K, i_k * BK, K, BC, BK)
    store_tile(dg_base, b_dcX, X * BC, L, HV * K, i_k * BK, K, BC, BK)


@triton.jit
def chunk_gate_bwd_kernel(
    g, A_log, dt_bias, dc, dg, da, dbias,
    chunk_rows,
    lower_bound, T, NT,
    HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
    GATE: tl.constexpr, IS_VARLEN: tl.constexpr,
):
    """``dg`` (in g's dtype; ``dc`` itself when that is float32) from ``dc``: ``c`` is the
    in-chunk cumulative sum of ``g``, so
    ``dg_i = sum_{j >= i} dc_j``, formed as the chunk's sum less the forward scan (a reverse scan,
    ``tl.cumsum(reverse=True)``, compiles to 9x the shuffles: ptxas, triton 3.6, 352 against 40
    SHFL for the 64-wide build); zero where the forward clamped ``g`` at the floor. With ``GATE``
    (``kernels/gate.py``), ``g`` is the raw gate: ``dg`` becomes its gradient, and this chunk's
    sums over its tokens of the ``dt_bias`` gradient go to
    ``dbias`` (``[chunks, HV, K]``), of the ``A_log`` gradient, over its key slice too, to ``da``
    (``[chunks, HV, NK]``); the launcher sums them (``da`` as ``[chunks, HV, K]`` left 512 values
    to each of the HV sums at (8, 4096, 16), a 0.026 ms PyTorch reduction on the H200)."""
    NK: tl.constexpr = (K + BK - 1) // BK
    i_c, i_hvk = tl.program_id(0), tl.program_id(1)
    i_hv, i_k = i_hvk // NK, i_hvk % NK
    start, L = chunk_span(i_c, chunk_rows, T, NT, BT, IS_VARLEN)
    dg_base = dg + start * HV * K + i_hv * K
    b_dc = load_tile(dc + start * HV * K + i_hv * K, 0, L, HV * K, i_k * BK, K, BT, BK)
    b_g = load_tile(g + start * HV * K + i_hv * K, 0, L, HV * K, i_k * BK, K, BT, BK)
    # Rows past L hold dc = 0, so their dg is 0 too (up to rounding; not stored).
    b_dg = tl.sum(b_dc, axis=0)[None, :] - tl.cumsum(b_dc, axis=0) + b_dc
    b_lg, b_x, b_a = log_decay_tile(b_g, A_log, dt_bias, i_hv, i_k * BK, lower_bound, K, BK, GATE)
    b_dg = tl.where(b_lg < LOG_DECAY_FLOOR, 0., b_dg)
    if GATE != 'none':
        b_dx, b_dA = gate_bwd(b_x, b_a, lower_bound, GATE)
        # Rows past L (dg 0 up to the rounding of sum - cumsum) and columns past K selected out
        # of the sums.
        m_t = (tl.arange(0, BT) < L)[:, None]
        b_dx = tl.where(m_t, b_dx * b_dg, 0.)
        o_k = i_k * BK + tl.arange(0, BK)
        i_chv = i_c.to(tl.int64) * HV + i_hv
        tl.store(dbias + i_chv * K + o_k, tl.sum(b_dx, axis=0), mask=o_k < K)
        b_dA = tl.where(m_t & (o_k < K)[None, :], b_dA * b_dg, 0.)
        tl.store(da + i_chv * NK + i_k, tl.sum(tl.sum(b_dA, axis=0), axis=0))
        store_tile(dg_base, b_dx, 0, L, HV * K, i_k * BK, K, BT, BK)
    else:
        store_tile(dg_base, b_dg, 0, L, HV * K, i_k * BK, K, BT, BK)


@triton.jit
def gate_param_grad_kernel(da, dbias, dA_log, ddt_bias, C, HV: tl.constexpr, K: tl.constexpr,
                           NK: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr):
    """The gradients of the gate's parameters from ``chunk_gate_bwd_kernel``'s per-chunk sums, over
    the ``C`` chunks: ``ddt_bias[hv K + k] = sum_c dbias[c, hv, k]`` for key slice
    ``program_id(1)`` of value head ``program_id(0)``, and ``dA_log[hv] = sum_{c, j} da[c, hv, j]``
    (its first slice's program sums and stores it), ``BN`` chunks a step. Either output may be
    None. The same order every run, so the same bits (float atomics in the chunk kernel would
    not be). As two PyTorch reductions they took 0.034 ms of the Kimi configuration's 6.02 ms
    step on the H200 at (8, 4096, 16)."""
    NKP: tl.constexpr = triton.next_power_of_2(NK)
    i_hv, i_k = tl.program_id(0), tl.program_id(1)
    o_k = i_k * BK + tl.arange(0, BK)
    o_j = tl.arange(0, NKP)
    b_db = tl.zeros([BK], dtype=tl.float32)
    b_da = tl.zeros([NKP], dtype=tl.float32)
    for c0 in range(0, C, BN):
        o_c = c0 + tl.arange(0, BN)
        o_chv = o_c[:, None].to(tl.int64) * HV + i_hv
        m_c = (o_c < C)[:, None]
        if ddt_bias is not None:
            b_db += tl.sum(tl.load(dbias + o_chv * K + o_k[None, :], mask=m_c & (o_k < K)[None, :],
                                   other=0.), axis=0)
        if dA_log is not None:
            # Only the first key slice's program reads them (masked loads move no bytes).
            m_j = (o_j < tl.where(i_k == 0, NK, 0))[None, :]
            b_da += tl.sum(tl.load(da + o_chv * NK + o_j[None, :], mask=m_c & m_j, other=0.), axis=0)
    if ddt_bias is not None:
        tl.store(ddt_bias + i_hv * K + o_k, b_db, mask=o_k < K)
    if dA_log is not None:
        if i_k == 0:
            tl.store(dA_log + i_hv, tl.sum(b_da, axis=0))
