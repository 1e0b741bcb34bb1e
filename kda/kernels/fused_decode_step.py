"""The KDA layer's decode step (one token per sequence) between its input projections and its
output projection, in two launches that allocate nothing (CUDA-graph capturable).

``decode_conv_kernel`` (only with short convolutions): for each of q, k and v, the token enters
its convolution window (the state ``[N, D, W]``, updated in place: shifted by one, the token last)
and ``silu(sum_w weight[d, w] window[d, w] + bias[d])`` is written to a float32 workspace row.
Each program owns whole channels, so it alone reads and writes their window.

``decode_step_kernel``: one program per sequence and value head ``hv`` (query/key head
``h = hv // (HV // H)``) holds the whole ``[K, V]`` state in registers and computes::

    q, k = l2norm(q), l2norm(k);  q = scale q           (silu first when there is no convolution)
    g    = the in-kernel gate of dt_bias + g_raw      (kernels/gate.py: softplus, or lower bound)
    beta = sigmoid(b)  (2 sigmoid(b) with allow_neg_eigval)
    S    = Diag(exp(g)) S;  S += k (beta (v - S^T k))^T;  o = S^T q        (S updated in place)
    y    = o rsqrt(mean(o^2) + eps) * norm_weight * sigmoid(gate)      (kernels/gated_norm.py)

The whole value row per program is what lets the norm, which needs all of ``o``, run in the same
launch; ``N * HV`` programs (32 at one sequence of Kimi's 32 heads) each stream a 64 KiB state.
"""
import triton
import triton.language as tl

from kda.kernels.fused_recurrent import l2_normalize
from kda.kernels.gate import beta_fwd, gate_fwd, gate_params
from kda.kernels.gated_norm import inverse_rms, sigmoid_gated


@triton.jit
def conv_step(x, state, weight, bias, out, i_n, i_d, D: tl.constexpr, W: tl.constexpr,
              BD: tl.constexpr, BW: tl.constexpr, HAS_BIAS: tl.constexpr):
    """One token ``x[i_n]`` through the window of channels ``i_d * BD ..`` (in place)."""
    o_d = i_d * BD + tl.arange(0, BD)
    o_w = tl.arange(0, BW)
    m_d = o_d < D
    row = i_n.to(tl.int64) * D
    b_x = tl.load(x + row + o_d, mask=m_d, other=0.).to(tl.float32)
    p_win = state + (row + o_d[:, None]) * W + o_w[None, :]
    b_win = tl.load(p_win + 1, mask=m_d[:, None] & (o_w < W - 1)[None, :], other=0.).to(tl.float32)
    b_win = tl.where(o_w[None, :] == W - 1, b_x[:, None], b_win)
    tl.store(p_win, b_win.to(state.dtype.element_ty), mask=m_d[:, None] & (o_w < W)[None, :])
    b_w = tl.load(weight + o_d[:, None] * W + o_w[None, :], mask=m_d[:, None] & (o_w < W)[None, :],
                  other=0.).to(tl.float32)
    # the window as stored: a state of lower precision than float32 rounds the token for later
    # steps, and this step reads the same rounded value
    b_z = tl.sum(b_win.to(state.dtype.element_ty).to(tl.float32) * b_w, axis=1)
    if HAS_BIAS:
        b_z += tl.load(bias + o_d, mask=m_d, other=0.).to(tl.float32)
    tl.store(out + row + o_d, b_z * tl.sigmoid(b_z), mask=m_d)


@triton.jit
def decode_conv_kernel(
    q, k, v, q_state, k_state, v_state, q_weight, k_weight, v_weight, q_bias, k_bias, v_bias,
    q_out, k_out, v_out,
    DK: tl.constexpr, DV: tl.constexpr, W: tl.constexpr, BD: tl.constexpr, BW: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    i_d, i_n, which = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if which == 0:
        if i_d * BD < DK:
            conv_step(q, q_state, q_weight, q_bias, q_out, i_n, i_d, DK, W, BD, BW, HAS_BIAS)
    elif which == 1:
        if i_d * BD < DK:
            conv_step(k, k_state, k_weight, k_bias, k_out, i_n, i_d, DK, W, BD, BW, HAS_BIAS)
    else:
        if i_d * BD < DV:
            conv_step(v, v_state, v_weight, v_bias, v_out, i_n, i_d, DV, W, BD, BW, HAS_BIAS)


@triton.jit
def decode_step_kernel(
    q, k, v, g, beta, gate,      # [N, H*K], [N, H*K], [N, HV*V], [N, HV*K], [N, HV], [N, HV*V]
    state,                       # [N, HV, K, V] float32, updated in place
    A_log, dt_bias, norm_weight, out,
    scale, lower_bound, eps,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr,
    SILU_QKV: tl.constexpr, GATE: tl.constexpr, BETA: tl.constexpr,
):
    i_nh = tl.program_id(0)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    i_n64 = i_n.to(tl.int64)
    o_k = tl.arange(0, BK)
    o_v = tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V

    b_q = tl.load(q + (i_n64 * H + i_h) * K + o_k, mask=m_k, other=0.).to(tl.float32)
    b_k = tl.load(k + (i_n64 * H + i_h) * K + o_k, mask=m_k, other=0.).to(tl.float32)
    b_v = tl.load(v + (i_n64 * HV + i_hv) * V + o_v, mask=m_v, other=0.).to(tl.float32)
    if SILU_QKV:
        b_q = b_q * tl.sigmoid(b_q)
        b_k = b_k * tl.sigmoid(b_k)
        b_v = b_v * tl.sigmoid(b_v)
    b_q = l2_normalize(b_q) * scale
    b_k = l2_normalize(b_k)
    b_a, b_bias = gate_params(A_log, dt_bias, i_hv, 0, K, BK)
    b_g = tl.load(g + (i_n64 * HV + i_hv) * K + o_k, mask=m_k, other=0.).to(tl.float32)
    b_g = tl.where(m_k, gate_fwd(b_g + b_bias, b_a, lower_bound, GATE), 0.)
    b_beta = beta_fwd(tl.load(beta + i_n64 * HV + i_hv).to(tl.float32), BETA)

    p_s = state + (i_n64 * HV + i_hv) * K * V + o_k[:, None] * V + o_v[None, :]
    m_s = m_k[:, None] & m_v[None, :]
    b_s = tl.load(p_s, mask=m_s, other=0.)
    b_s *= tl.exp(b_g)[:, None]
    b_u = b_beta * (b_v - tl.sum(b_s * b_k[:, None], axis=0))
    b_s += b_k[:, None] * b_u[None, :]
    tl.store(p_s, b_s, mask=m_s)
    b_o = tl.sum(b_s * b_q[:, None], axis=0)

    b_gate = tl.load(gate + (i_n64 * HV + i_hv) * V + o_v, mask=m_v, other=0.).to(tl.float32)
    b_w = tl.load(norm_weight + o_v, mask=m_v, other=0.).to(tl.float32)
    b_r = inverse_rms(tl.sum(b_o * b_o, axis=0), eps, V)
    b_y = sigmoid_gated(b_o * b_r, b_gate, b_w)
    tl.store(out + (i_n64 * HV + i_hv) * V + o_v, b_y.to(out.dtype.element_ty), mask=m_v)
