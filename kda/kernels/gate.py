"""The in-kernel gate and beta activations of docs/API.md (``use_gate_in_kernel``,
``use_beta_sigmoid_in_kernel``), applied inside the kernels that read ``g`` and ``beta``, so that
the activated values never cross HBM (and a decode step launches one kernel, allocating nothing).

With ``x = g_raw + dt_bias`` and ``a = exp(A_log)`` (``a = 1`` without ``A_log``)::

    GATE = 'softplus':  g = -a softplus(x)            dg/dx = -a sigmoid(x)        dg/dA_log = g
    GATE = 'sigmoid':   g = lb sigmoid(a x)           dg/dx = a lb s (1 - s)       dg/dA_log = lb s (1 - s) a x

(``lb`` = ``lower_bound``, ``s = sigmoid(a x)``; ``dg/dA_log = a dg/da``.) ``GATE = 'none'``: ``g``
is the log-decay itself. Computed in float32 whatever the dtype of ``g_raw``. Beta:
``BETA = 'sigmoid'`` gives ``sigmoid(b)``, ``'sigmoid2'`` ``2 sigmoid(b)`` (``allow_neg_eigval``),
``'none'`` ``b``.
"""
import triton
import triton.language as tl


@triton.jit
def softplus(x):
    """``log(1 + exp(x)) = max(x, 0) + log1p(exp(-|x|))``, with ``log1p(e) = log(u) e / (u - 1)``,
    ``u = 1 + e``, accurate to a few ulps where ``1 + e`` rounds (a plain ``log(1 + e)`` is 0
    below x = -17; such steps decay by less than 1e-7, so this is about dA_log = sum dg g, not the
    outputs). A NaN stays NaN."""
    e = tl.exp(-tl.abs(x))
    u = 1. + e
    log1p = tl.where(u == 1., e, tl.log(u) * e / (u - 1.))
    return tl.where(x > 0., x, 0.) + log1p


@triton.jit
def gate_params(A_log, dt_bias, i_hv, col0, K: tl.constexpr, BK: tl.constexpr):
    """``a = exp(A_log)`` of head ``i_hv`` (1 without A_log) and its ``dt_bias`` over key columns
    ``col0 .. col0+BK`` (0 without). Either pointer may be None."""
    o_k = col0 + tl.arange(0, BK)
    if A_log is not None:
        b_a = tl.exp(tl.load(A_log + i_hv).to(tl.float32))
    else:
        b_a = 1.0
    if dt_bias is not None:
        b_bias = tl.load(dt_bias + i_hv * K + o_k, mask=o_k < K, other=0.).to(tl.float32)
    else:
        b_bias = tl.zeros([BK], dtype=tl.float32)
    return b_a, b_bias


@triton.jit
def gate_fwd(b_x, b_a, lower_bound, GATE: tl.constexpr):
    """The log-decay of ``x = g_raw + dt_bias`` (any shape; ``b_a`` broadcasts)."""
    if GATE == 'softplus':
        return -b_a * softplus(b_x)
    else:
        return lower_bound * tl.sigmoid(b_a * b_x)


@triton.jit
def log_decay_tile(b_g, A_log, dt_bias, i_hv, col0, lower_bound, K: tl.constexpr, BK: tl.constexpr,
                   GATE: tl.constexpr):
    """``(log-decay, x, a)`` of a ``[rows, BK]`` tile ``b_g`` of ``g`` (key columns ``col0..``,
    value head ``i_hv``): the tile itself with ``GATE = 'none'``, else its activation, with
    ``x = g_raw + dt_bias`` and ``a = exp(A_log)`` for ``gate_bwd``. The chunk forward and the gate
    gradient both take the log-decay from here, so they clamp at the same values."""
    if GATE == 'none':
        return b_g, b_g, 1.0
    b_a, b_bias = gate_params(A_log, dt_bias, i_hv, col0, K, BK)
    b_x = b_g + b_bias[None, :]
    return gate_fwd(b_x, b_a, lower_bound, GATE), b_x, b_a


@triton.jit
def gate_bwd(b_x, b_a, lower_bound, GATE: tl.constexpr):
    """``(dg/dx, dg/dA_log)`` at ``x = g_raw + dt_bias``."""
    if GATE == 'softplus':
        return -b_a * tl.sigmoid(b_x), -b_a * softplus(b_x)
    else:
        b_z = b_a * b_x
        b_s = tl.sigmoid(b_z)
        b_d = lower_bound * b_s * (1. - b_s)
        return b_a * b_d, b_d * b_z


@triton.jit
def beta_fwd(b_beta, BETA: tl.constexpr):
    """beta from its logits (``BETA``, see above)."""
    if BETA == 'sigmoid':
        return tl.sigmoid(b_beta)
    elif BETA == 'sigmoid2':
        return 2. * tl.sigmoid(b_beta)
    else:
        return b_beta
