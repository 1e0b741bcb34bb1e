"""The sigmoid-gated RMS norm of the KDA layer's output (FLA's ``FusedRMSNormGated`` with
``activation='sigmoid'``), per row of ``D`` elements, in float32::

    r = (mean_d x_d^2 + eps)^(-1/2),   xhat = x r,   y = xhat * weight * sigmoid(gate)

Backward, with ``s = sigmoid(gate)``, ``u = dy s`` and ``c = mean_d(u_d weight_d xhat_d)``::

    dgate = dy xhat weight s (1 - s),   dweight = sum_rows u xhat,   dx = r (u weight - xhat c)

One program normalizes ``BR`` rows; the weight gradient is a per-program partial sum that the
launcher adds up (deterministic). The fused decode kernel applies ``inverse_rms`` and
``sigmoid_gated`` to the row it holds in registers.
"""
import triton
import triton.language as tl


@triton.jit
def inverse_rms(sum_sq, eps, D: tl.constexpr):
    """``r`` of a row of ``D`` elements whose squares sum to ``sum_sq``."""
    return tl.rsqrt(sum_sq / D + eps)


@triton.jit
def sigmoid_gated(b_xhat, b_gate, b_w):
    """``y`` from the normalized row, its gate and the weight (float32)."""
    return b_xhat * b_w * tl.sigmoid(b_gate)


@triton.jit
def gated_norm_fwd_kernel(x, gate, weight, y, rstd, eps, n_rows, D: tl.constexpr, BR: tl.constexpr,
                          BD: tl.constexpr):
    o_r = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    o_d = tl.arange(0, BD)
    m = (o_r < n_rows)[:, None] & (o_d < D)[None, :]
    p = o_r[:, None] * D + o_d[None, :]
    b_x = tl.load(x + p, mask=m, other=0.).to(tl.float32)
    b_g = tl.load(gate + p, mask=m, other=0.).to(tl.float32)
    b_w = tl.load(weight + o_d, mask=o_d < D, other=0.).to(tl.float32)
    b_r = inverse_rms(tl.sum(b_x * b_x, axis=1), eps, D)
    b_y = sigmoid_gated(b_x * b_r[:, None], b_g, b_w[None, :])
    tl.store(y + p, b_y.to(y.dtype.element_ty), mask=m)
    tl.store(rstd + o_r, b_r, mask=o_r < n_rows)


@triton.jit
def gated_norm_bwd_kernel(x, gate, weight, rstd, dy, dx, dgate, dw, n_rows, D: tl.constexpr,
                          BR: tl.constexpr, BD: tl.constexpr):
    o_r = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    o_d = tl.arange(0, BD)
    m = (o_r < n_rows)[:, None] & (o_d < D)[None, :]
    p = o_r[:, None] * D + o_d[None, :]
    b_x = tl.load(x + p, mask=m, other=0.).to(tl.float32)
    b_g = tl.load(gate + p, mask=m, other=0.).to(tl.float32)
    b_dy = tl.load(dy + p, mask=m, other=0.).to(tl.float32)
    b_w = tl.load(weight + o_d, mask=o_d < D, other=0.).to(tl.float32)[None, :]
    b_r = tl.load(rstd + o_r, mask=o_r < n_rows, other=0.)[:, None]
    b_xhat = b_x * b_r
    b_s = tl.sigmoid(b_g)
    b_u = b_dy * b_s
    b_dg = b_dy * b_xhat * b_w * b_s * (1. - b_s)
    b_c = tl.sum(b_u * b_w * b_xhat, axis=1)[:, None] / D
    b_dx = b_r * (b_u * b_w - b_xhat * b_c)
    tl.store(dx + p, b_dx.to(dx.dtype.element_ty), mask=m)
    tl.store(dgate + p, b_dg.to(dgate.dtype.element_ty), mask=m)
    tl.store(dw + tl.program_id(0).to(tl.int64) * D + o_d, tl.sum(b_u * b_xhat, axis=0), mask=o_d < D)
