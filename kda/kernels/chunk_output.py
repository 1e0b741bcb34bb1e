"""Chunk stage 3 (forward): the outputs.

For chunk c with incoming state ``h_c``, corrections ``dV``, the query-key matrix ``Aqk`` (scale
included) and the decayed queries ``Qt = scale q exp(c)`` (from stage 1)::

    O = Qt h_c + Aqk dV

Chunks are independent here, so this stage runs one program per (chunk, value head, V-block).
"""
import triton
import triton.language as tl

from kda.kernels.chunk_common import chunk_span, load_tile, mm, store_tile


@triton.jit
def chunk_output_fwd_kernel(
    qt, h, v_new, Aqk, o,
    cu_seqlens, chunk_indices,
    T, NT,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    DOT_DTYPE: tl.constexpr, IS_VARLEN: tl.constexpr,
):
    # Chunks on axis 0, which allows 2^31 - 1 programs; axes 1 and 2 stop at 65535.
    i_c, i_v, i_hv = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    _, start, L = chunk_span(i_c, cu_seqlens, chunk_indices, T, NT, BT, IS_VARLEN)
    o_t = tl.arange(0, BT)

    b_o = tl.zeros([BT, BV], dtype=tl.float32)
    h_base = h + (i_c.to(tl.int64) * HV + i_hv) * K * V
    for i_k in range(tl.cdiv(K, BK)):
        b_qt = load_tile(qt + start * HV * K + i_hv * K, 0, L, HV * K, i_k * BK, K, BT, BK)
        b_h = load_tile(h_base, i_k * BK, K, V, i_v * BV, V, BK, BV)
        b_o += mm(b_qt, b_h, DOT_DTYPE)
    b_A = load_tile(Aqk + start * HV * BT + i_hv * BT, 0, L, HV * BT, 0, BT, BT, BT)
    b_A = tl.where(o_t[:, None] >= o_t[None, :], b_A, 0.)
    b_d = load_tile(v_new + start * HV * V + i_hv * V, 0, L, HV * V, i_v * BV, V, BT, BV)
    b_o += mm(b_A, b_d, DOT_DTYPE)
    store_tile(o + start * HV * V + i_hv * V, b_o, 0, L, HV * V, i_v * BV, V, BT, BV)
