"""Row-wise L2 normalization of q and k (``use_qk_l2norm_in_kernel``), one pass each way, both
tensors in one launch (``program_id(1)`` picks q or k).

    y = x * r,   r = (sum_d x_d^2 + 1e-6)^(-1/2)
    dx = r * (dy - y * sum_d(dy_d y_d))

The gradient reads y as the forward stored it (rounded to the input dtype, the values every
later kernel used), not x: the backward then needs no normalization pass of its own.
"""
import triton
import triton.language as tl

# FLA's epsilon (``l2norm_fwd``): a zero row normalizes to zero instead of NaN.
L2NORM_EPS = tl.constexpr(1e-6)


@triton.jit
def inverse_norm(sum_sq):
    """``(sum_sq + 1e-6)^(-1/2)``: the inverse norm of a row whose squares sum to ``sum_sq``; every
    kernel that normalizes q or k goes through it (the chunk forward's pair products, the decode
    kernel, this file's pass)."""
    return tl.rsqrt(sum_sq + L2NORM_EPS)


@triton.jit
def program_rows(n_rows, D: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr):
    """``(o_r, m, p)``: this program's BR row indices, the mask of the ``[BR, BD]`` tile within
    ``n_rows`` x ``D``, and its element offsets."""
    o_r = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    o_d = tl.arange(0, BD)
    return o_r, (o_r < n_rows)[:, None] & (o_d < D)[None, :], o_r[:, None] * D + o_d[None, :]


@triton.jit
def l2norm_fwd_rows(x, y, rstd, n_rows, D: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr):
    """y and r for BR rows of x."""
    o_r, m, p = program_rows(n_rows, D, BR, BD)
    b_x = tl.load(x + p, mask=m, other=0.).to(tl.float32)
    b_r = inverse_norm(tl.sum(b_x * b_x, axis=1))
    tl.store(y + p, (b_x * b_r[:, None]).to(y.dtype.element_ty), mask=m)
    tl.store(rstd + o_r, b_r, mask=o_r < n_rows)


@triton.jit
def l2norm_fwd_kernel(q, qn, rq, k, kn, rk, n_rows, D: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr):
    if tl.program_id(1) == 0:
        l2norm_fwd_rows(q, qn, rq, n_rows, D, BR, BD)
    else:
        l2norm_fwd_rows(k, kn, rk, n_rows, D, BR, BD)


@triton.jit
def l2norm_bwd_rows(y, rstd, dy, dx, n_rows, D: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr):
    o_r, m, p = program_rows(n_rows, D, BR, BD)
    b_r = tl.load(rstd + o_r, mask=o_r < n_rows, other=0.)
    b_y = tl.load(y + p, mask=m, other=0.).to(tl.float32)
    b_dy = tl.load(dy + p, mask=m, other=0.).to(tl.float32)
    b_dx = b_r[:, None] * (b_dy - b_y * tl.sum(b_dy * b_y, axis=1)[:, None])
    tl.store(dx + p, b_dx.to(dx.dtype.element_ty), mask=m)


@triton.jit
def l2norm_bwd_kernel(qn, rq, dqn, dq, kn, rk, dkn, dk, n_rows, D: tl.constexpr, BR: tl.constexpr,
                      BD: tl.constexpr):
    if tl.program_id(1) == 0:
        l2norm_bwd_rows(qn, rq, dqn, dq, n_rows, D, BR, BD)
    else:
        l2norm_bwd_rows(kn, rk, dkn, dk, n_rows, D, BR, BD)
