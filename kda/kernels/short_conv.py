"""Causal depthwise short convolution with an optional SiLU, forward and backward.

Per sequence and channel ``d``, with ``W`` taps, inputs ``x_t`` (``t = 0 .. T-1``) and the
``W`` inputs before the sequence held in a state ``h0[d, 0 .. W-1]`` (``h0[d, W + p]`` is the
input at position ``p = -W .. -1``; zero without a state)::

    z_t = bias[d] + sum_{w < W} weight[d, w] x_{t - (W - 1) + w}
    y_t = silu(z_t) = z_t sigmoid(z_t)        (or z_t without the activation)

The final state is the last ``W`` inputs, ``ht[d, j] = x_{T - W + j}`` (the state's entries where
``T - W + j < 0``), so that a sequence continued later sees the same window. ``h0[d, 0]`` feeds
no output; it is passed through to the final state of a sequence of length 0 only.

Backward, with ``dz_t = dy_t silu'(z_t)``, ``silu'(z) = s (1 + z (1 - s))``, ``s = sigmoid(z)``::

    dx_t       = sum_{w} weight[d, W - 1 - w] dz_{t + w}  +  dht[d, t - T + W]   (where in range)
    dweight[w] = sum_t dz_t x_{t - (W - 1) + w}          dbias = sum_t dz_t
    dh0[i]     = sum_{t < i} dz_t weight[d, i - 1 - t]   +  dht[d, i - T]        (where in range)

One program owns a block of ``BD`` channels of one sequence and walks its tokens in blocks of
``BT``; the backward recomputes ``z`` (``W`` shifted tiles per token block; the loads hit cache).
Its weight and bias gradients are per-sequence partial sums, added up by the launcher in a fixed
order (deterministic). Tensors: ``x``, ``y``, ``dy``, ``dx`` ``[total tokens, D]`` rows;
states ``[N, D, W]``; ``weight`` ``[D, W]``.
"""
import triton
import triton.language as tl


@triton.jit
def sequence_span(cu_seqlens, i_n, T, IS_VARLEN: tl.constexpr):
    """(first row, length) of sequence ``i_n``."""
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        T_n = (tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos).to(tl.int32)
    else:
        bos = i_n.to(tl.int64) * T
        T_n = T
    return bos, T_n


@triton.jit
def conv_input(x, h0, i_n, bos, T_n, o_p, o_d, m_d, D: tl.constexpr, W: tl.constexpr,
               USE_H0: tl.constexpr):
    """The inputs at positions ``o_p`` ``[BT]`` (any integers) of channels ``o_d``, float32
    ``[BT, BD]``: x's rows for ``0 <= p < T_n``, the state's entry ``W + p`` for ``-W <= p < 0``,
    else 0."""
    m_x = ((o_p >= 0) & (o_p < T_n))[:, None] & m_d[None, :]
    b_x = tl.load(x + (bos + o_p)[:, None] * D + o_d[None, :], mask=m_x, other=0.).to(tl.float32)
    if USE_H0:
        m_h = ((o_p < 0) & (o_p >= -W))[:, None] & m_d[None, :]
        b_x += tl.load(h0 + (i_n.to(tl.int64) * D + o_d[None, :]) * W + (W + o_p)[:, None],
                       mask=m_h, other=0.).to(tl.float32)
    return b_x


@triton.jit
def conv_preact(x, h0, weight, bias, i_n, bos, T_n, o_p, o_d, m_d, D: tl.constexpr, W: tl.constexpr,
                BT: tl.constexpr, BD: tl.constexpr, HAS_BIAS: tl.constexpr, USE_H0: tl.constexpr):
    """``z`` at positions ``o_p`` ``[BT]`` (formula above), float32 ``[BT, BD]``."""
    b_z = tl.zeros([BT, BD], dtype=tl.float32)
    if HAS_BIAS:
        b_z += tl.load(bias + o_d, mask=m_d, other=0.).to(tl.float32)[None, :]
    for w in tl.static_range(W):
        b_w = tl.load(weight + o_d * W + w, mask=m_d, other=0.).to(tl.float32)
        b_z += conv_input(x, h0, i_n, bos, T_n, o_p - (W - 1) + w, o_d, m_d, D, W, USE_H0) * b_w[None, :]
    return b_z


@triton.jit
def silu_grad(b_z):
    b_s = tl.sigmoid(b_z)
    return b_s * (1. + b_z * (1. - b_s))


@triton.jit
def short_conv_fwd_kernel(
    x, weight, bias, y,
    h0, ht,                      # optional states [N, D, W] in and out
    cu_seqlens,
    T,
    D: tl.constexpr, W: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, BW: tl.constexpr,
    SILU: tl.constexpr, HAS_BIAS: tl.constexpr, USE_H0: tl.constexpr, STORE_HT: tl.constexpr,
    IS_VARLEN: tl.constexpr,
):
    i_d, i_n = tl.program_id(0), tl.program_id(1)
    bos, T_n = sequence_span(cu_seqlens, i_n, T, IS_VARLEN)
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < D
    for t0 in range(0, T_n, BT):
        o_t = t0 + tl.arange(0, BT)
        b_z = conv_preact(x, h0, weight, bias, i_n, bos, T_n, o_t, o_d, m_d, D, W, BT, BD, HAS_BIAS, USE_H0)
        if SILU:
            b_z = b_z * tl.sigmoid(b_z)
        m_y = (o_t < T_n)[:, None] & m_d[None, :]
        tl.store(y + (bos + o_t)[:, None] * D + o_d[None, :], b_z.to(y.dtype.element_ty), mask=m_y)
    if STORE_HT:
        o_w = tl.arange(0, BW)
        b_h = conv_input(x, h0, i_n, bos, T_n, T_n - W + o_w, o_d, m_d, D, W, USE_H0)
        m_h = (o_w < W)[:, None] & m_d[None, :]
        tl.store(ht + (i_n.to(tl.int64) * D + o_d[None, :]) * W + o_w[:, None],
                 b_h.to(ht.dtype.element_ty), mask=m_h)


@triton.jit
def short_conv_bwd_kernel(
    x, weight, bias, dy, h0, dht,
    dx, dw, db, dh0,             # dw [N, D, W] and db [N, D]: float32 per-sequence partial sums
    cu_seqlens,
    T,
    D: tl.constexpr, W: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, BW: tl.constexpr,
    SILU: tl.constexpr, HAS_BIAS: tl.constexpr, USE_H0: tl.constexpr, USE_DHT: tl.constexpr,
    IS_VARLEN: tl.constexpr,
):
    i_d, i_n = tl.program_id(0), tl.program_id(1)
    bos, T_n = sequence_span(cu_seqlens, i_n, T, IS_VARLEN)
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < D
    o_w = tl.arange(0, BW)
    p_state = (i_n.to(tl.int64) * D + o_d[None, :]) * W + o_w[:, None]     # [BW, BD] of a state
    m_state = (o_w < W)[:, None] & m_d[None, :]
    b_dw = tl.zeros([BW, BD], dtype=tl.float32)
    b_db = tl.zeros([BD], dtype=tl.float32)
    for t0 in range(0, T_n, BT):
        o_t = t0 + tl.arange(0, BT)
        b_dx = tl.zeros([BT, BD], dtype=tl.float32)
        for s in tl.static_range(W):
            # dz at the tokens s steps ahead, which read x_t through tap W - 1 - s
            o_s = o_t + s
            b_dz = tl.load(dy + (bos + o_s)[:, None] * D + o_d[None, :],
                           mask=(o_s < T_n)[:, None] & m_d[None, :], other=0.).to(tl.float32)
            if SILU:
                b_z = conv_preact(x, h0, weight, bias, i_n, bos, T_n, o_s, o_d, m_d, D, W, BT, BD,
                                  HAS_BIAS, USE_H0)
                b_dz = b_dz * silu_grad(b_z)
            b_tap = tl.load(weight + o_d * W + (W - 1 - s), mask=m_d, other=0.).to(tl.float32)
            b_dx += b_dz * b_tap[None, :]
            if s == 0:
                b_db += tl.sum(b_dz, axis=0)
                for w in tl.static_range(W):
                    b_xw = conv_input(x, h0, i_n, bos, T_n, o_t - (W - 1) + w, o_d, m_d, D, W, USE_H0)
                    b_dw += tl.where(o_w[:, None] == w, tl.sum(b_dz * b_xw, axis=0)[None, :], 0.)
        if USE_DHT:
            # x_t is entry t - T + W of the final state
            o_j = o_t - T_n + W
            m_j = ((o_j >= 0) & (o_t < T_n))[:, None] & m_d[None, :]
            b_dx += tl.load(dht + (i_n.to(tl.int64) * D + o_d[None, :]) * W + o_j[:, None],
                            mask=m_j, other=0.).to(tl.float32)
        m_x = (o_t < T_n)[:, None] & m_d[None, :]
        tl.store(dx + (bos + o_t)[:, None] * D + o_d[None, :], b_dx.to(dx.dtype.element_ty), mask=m_x)
    tl.store(dw + p_state, b_dw, mask=m_state)
    if HAS_BIAS:
        tl.store(db + i_n.to(tl.int64) * D + o_d, b_db, mask=m_d)
    if USE_H0:
        # Entry i of h0 is the input at position i - W: token t < i reads it through tap i - 1 - t.
        b_dh = tl.zeros([BW, BD], dtype=tl.float32)
        o_f = tl.arange(0, BW)           # the first tokens, the only ones that read the state
        b_dzf = tl.load(dy + (bos + o_f)[:, None] * D + o_d[None, :],
                        mask=(o_f < T_n)[:, None] & m_d[None, :], other=0.).to(tl.float32)
        if SILU:
            b_zf = conv_preact(x, h0, weight, bias, i_n, bos, T_n, o_f, o_d, m_d, D, W, BW, BD,
                               HAS_BIAS, USE_H0)
            b_dzf = b_dzf * silu_grad(b_zf)
        for t in tl.static_range(W - 1):
            b_row = tl.sum(tl.where(o_f[:, None] == t, b_dzf, 0.), axis=0)
            for i in tl.static_range(t + 1, W):
                b_tap = tl.load(weight + o_d * W + (i - 1 - t), mask=m_d, other=0.).to(tl.float32)
                b_dh += tl.where(o_w[:, None] == i, (b_row * b_tap)[None, :], 0.)
        if USE_DHT:
            # entries the sequence did not push out of the window pass through to the final state
            o_j = o_w - T_n
            b_dh += tl.load(dht + (i_n.to(tl.int64) * D + o_d[None, :]) * W + o_j[:, None],
                            mask=((o_j >= 0) & (o_w < W))[:, None] & m_d[None, :], other=0.).to(tl.float32)
        tl.store(dh0 + p_state, b_dh.to(dh0.dtype.element_ty), mask=m_state)
