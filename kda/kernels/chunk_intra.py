"""The forward's in-chunk stage: in-chunk decay, the decayed keys and queries, the key-key and
query-key matrices, and the triangular solve.

For one chunk and value head, with ``c_i = g_1 + ... + g_i`` (in-chunk cumulative log-decay)::

    A'[i, j]  = sum_d k_id k_jd exp(c_id - c_jd)                 j < i,   A = diag(beta) A'
    Aqk[i, j] = scale sum_d q_id k_jd exp(c_id - c_jd)           j <= i
    M = (I + A)^-1                                                unit lower triangular

The exponents ``c_i - c_j`` are never split into ``exp(c_i) * exp(-c_j)`` over a whole chunk, which
overflows once a chunk's decay passes float32's range. The chunk is cut into ``BC``-row
sub-blocks, and row block I factors through its first row ``r``: ``exp(c_i - r) <= 1`` on its own
rows, ``exp(r - c_j)`` on the key rows, <= 1 for every block J < I and >= 1 on the diagonal block.
On the diagonal that holds for the key entries whose factored size stays in range (all of them
unless a step decays by more than -5 on average, or keys are huge); the others ("far", float16's
all) go through the same reference-row scheme once more, on groups of 4 rows, with only the 4 x 4
diagonal groups formed element by element. One reference row for the whole row block lets the
row factors ``q_I exp(c_I - r)``, ``k_I exp(c_I - r)`` of a key slice serve every block of the row
(0.53 -> 0.33 ms a call against the last row of each block J as reference, which formed them
again for every J: docs/tuning.md, pair_fwd).

Three kernels, in order: ``chunk_cumsum_kernel`` (c; the in-kernel gate's activation too; the
decayed keys and queries for the backward's recompute), ``chunk_pair_fwd_kernel`` (Aqk and A',
one program per row block of a chunk, the key slices outermost; the forward's decayed keys and
queries) and ``chunk_solve_kernel`` (M, one program per chunk). The WY
form's W = M diag(beta) Kg and U = M diag(beta) v are never formed: the state sweeps apply M
themselves (``chunk_state.py``). The backward keeps the forward's Aqk, A' and M and recomputes
only the cumsum kernel's tensors. On Hopper the pair products and the solve of the inference
forward with l2norm in the kernel are launched as programmatic dependents of the kernel before
them (``PDL``, ``chunk_common.wait_for_previous``; ``dependent_launch`` in ``kda/ops/chunk/launch.py``).
"""
import triton
import triton.language as tl

from kda.kernels.chunk_common import (chunk_span, clamp_log_decay, exp_ftz, exp_nonpos, load_row,
                                      load_rows, load_tile, mm, mm_fine, release_dependent, store_tile,
                                      wait_for_previous)
from kda.kernels.gate import log_decay_tile
from kda.kernels.l2norm import inverse_norm


# Diagonal blocks factor through their first row r: a key enters as k_jd exp(r_d - c_jd) >= k_jd.
# Entries whose factor would leave the operand range go to the 4-row scheme instead ("far").
# FAR_SPAN bounds the exponent: it keeps the lower-bound gate's blocks near (steps >= -5, so
# r - c_j <= 75 in a 16-row block) and, with the row factor exp(c_i - r), which falls below the
# smallest normal (exp(-87.3)) before anything else does, bounds what a flush of such a row
# factor to zero could lose: exp(c_i - c_j) < exp(76 - 87.3) = 1.2e-5 (82 would allow 5e-3).
# FAR_KEY keeps the factored key below the bf16/float32 maximum (3.4e38)
# with room for the dot's sums; it is reached by keys above 1e36 / exp(76) = 1e3.
FAR_SPAN = tl.constexpr(76.0)
FAR_KEY = tl.constexpr(1e36)


@triton.jit
def row_inverse_norms(base, o_r, L, H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr):
    """``(sum_d x_d^2 + 1e-6)^(-1/2)`` (l2norm's formula, ``kernels/l2norm.py``; the sum in
    another order) of rows ``o_r`` of q or k, over the key slices one at a time."""
    b_s = tl.zeros([o_r.shape[0]], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
        b_x = load_rows(base, o_r, L, H * K, i_k * BK, K, BK)
        b_s += tl.sum(b_x * b_x, axis=1)
    return inverse_norm(b_s)


@triton.jit
def scale_rows(b_x, b_r):
    """``diag(b_r) b_x``; ``b_x`` where ``b_r`` is None."""
    if b_r is not None:
        b_x = b_x * b_r[:, None]
    return b_x


@triton.jit
def far_keys(b_k, b_c, b_r, m_r, span):
    """``(far, k exp(r - c))`` for key rows ``b_k`` with cumulative decays ``b_c`` against the
    reference row ``b_r``: ``far`` marks the valid entries the factored product cannot carry
    (exponent above ``span``, a factored key above FAR_KEY, or NaN, which the 4-row scheme passes
    on). Each entry's choice reads only its own row and r, never a later row."""
    b_d = b_r[None, :] - b_c
    b_kd = b_k * exp_ftz(tl.minimum(b_d, span, propagate_nan=tl.PropagateNan.ALL))
    near = (b_d <= span) & (tl.abs(b_kd) <= FAR_KEY)
    return m_r & ~near, b_kd


@triton.jit
def group_products(b_qk, b_kk, b_q, b_k, b_c, b_r0, k_base, b_rk, gc_base, gc_stride, i_i, i_k, L,
                   span, H: tl.constexpr, K: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
                   DOT_DTYPE: tl.constexpr):
    """Adds the entries of the far keys (``far_keys`` against the block's first row ``b_r0``;
    ``span < 0`` makes every key far) of diagonal block ``i_i``, key slice ``i_k``, to ``b_qk`` and
    ``b_kk``, by the off-diagonal scheme one level down: the block is cut into groups of G = 4
    rows; entries between groups b < a factor through the last row of group b (both factors
    <= 1), one tensor-core product per group b with the other rows and columns zeroed; the 4 x 4
    diagonal groups are formed element by element, one gathered column per row at a time.
    Entries (i, j) read rows <= i only for finite c (a NaN row of c, through 0 times NaN,
    reaches the rows before it in its group; the chunk's outputs are NaN anyway); entries of
    near keys get exact zeros added. ``b_rk``:
    None, or the inverse norms of the block's raw key rows, which scale the rows loaded here as
    ``b_k``'s were (``L2NORM``)."""
    G: tl.constexpr = 4
    o_i = tl.arange(0, BC)
    o_g = o_i // G
    b_far, _ = far_keys(b_k, b_c, b_r0, ((i_i * BC + o_i) < L)[:, None], span)
    b_kf = tl.where(b_far, b_k, 0.)
    for b in range(BC // G - 1):
        b_r = load_row(gc_base, i_i * BC + b * G + G - 1, L, gc_stride, i_k * BK, K, BK)
        b_up = tl.where((o_g > b)[:, None], exp_nonpos(b_c - b_r[None, :]), 0.)
        b_kdt = tl.trans(tl.where((o_g == b)[:, None], b_kf * exp_nonpos(b_r[None, :] - b_c), 0.))
        b_qk += mm(b_q * b_up, b_kdt, DOT_DTYPE)
        b_kk += mm(b_k * b_up, b_kdt, DOT_DTYPE)
    for t in range(G):
        o_j = o_g * G + t
        b_kj = load_rows(k_base, i_i * BC + o_j, L, H * K, i_k * BK, K, BK)
        if b_rk is not None:
            b_kj = b_kj * tl.gather(b_rk, o_j, 0)[:, None]
        b_cj = load_rows(gc_base, i_i * BC + o_j, L, gc_stride, i_k * BK, K, BK)
        b_farj, _ = far_keys(b_kj, b_cj, b_r0, ((i_i * BC + o_j) < L)[:, None], span)
        b_kj = tl.where(b_farj, b_kj * exp_nonpos(b_c - b_cj), 0.)
        m_e = o_i[None, :] == o_j[:, None]
        b_qk += tl.where(m_e, tl.sum(b_q * b_kj, axis=1)[:, None], 0.)
        b_kk += tl.where(m_e, tl.sum(b_k * b_kj, axis=1)[:, None], 0.)
    return b_qk, b_kk


@triton.jit
def diag_slice(b_qk, b_kk, b_q, b_k, b_c, b_r, m_r, k_base, b_rk, gc_base, gc_stride, i_i,
               i_k, L, H: tl.constexpr, K: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
               FACTORED: tl.constexpr, ALL_NEAR: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """Adds key slice ``i_k`` of the diagonal block ``I = i_i`` (rows ``b_q``, ``b_k``, ``b_c``,
    first row ``b_r``; entries j > i are garbage) to ``b_qk`` and ``b_kk``; also returns the
    slice's row factors ``q exp(c - r)`` and ``k exp(c - r)`` (<= 1), which the blocks J < I reuse
    (``offdiag_slice``).

    ``FACTORED`` (bf16 and float32 operands): through r on the tensor cores, ``exp(c_i - r) <= 1``
    times ``exp(r - c_j) >= 1``, for every key entry that ``far_keys`` keeps in range (for any gate
    that lets every step's log-decay be above -5, every key below 2.7e3); only when the slice has
    far entries are those added by ``group_products``. The choice is per key entry and reads its
    own row and r only, so no entry's rounding depends on a later row (bit-exact causality); adding
    the zeros of near entries changes no bit. ``ALL_NEAR``: no entry can be far (steps >= -5 and
    keys of norm 1: the lower-bound gate with normalized keys), so neither the test nor
    ``group_products`` is compiled; the same outputs bit for bit (where c is NaN, the stored
    Aqk and A' of that chunk may differ in which entries are NaN, see ``group_products``; the
    chunk's outputs are NaN either way). Otherwise (float16, whose range ends at 65504):
    ``group_products`` for every entry."""
    # The row factor meets key factors up to exp(FAR_SPAN) on the diagonal block. Flushed below
    # 1.2e-38 (exp_ftz), a row whose block decays past 87.3 from r loses terms up to
    # exp(76 - 87.3) = 1.2e-5 |q k| (FAR_SPAN's bound): 300x under a 16-bit operand's rounding, but
    # not what float32 inputs promise, so for them it keeps its subnormals (flushed, an A' entry
    # of 1.0e-5 came out 0 on the H200: test_forward_diagonal_row_factor_below_normal).
    b_up = tl.where(m_r, exp_nonpos(b_c - b_r[None, :], DOT_DTYPE == tl.float32), 0.)
    b_qe = b_q * b_up
    b_ke = b_k * b_up
    tl.static_assert(FACTORED or not ALL_NEAR, "ALL_NEAR factors the block: not for float16")
    if ALL_NEAR:
        # r - c_j <= 15 * 5 = 75 < FAR_SPAN and |k| <= 1 < FAR_KEY: far_keys would mark nothing
        # but NaN entries, whose rows and columns come out NaN either way (the triangle masks
        # the entries above the diagonal, so the rows before them keep their bits).
        b_kdt = tl.trans(b_k * exp_ftz(b_r[None, :] - b_c))
        b_qk += mm(b_qe, b_kdt, DOT_DTYPE)
        b_kk += mm(b_ke, b_kdt, DOT_DTYPE)
    elif FACTORED:
        b_far, b_kd = far_keys(b_k, b_c, b_r, m_r, FAR_SPAN)
        b_kdt = tl.trans(tl.where(b_far, 0., b_kd))
        b_qk += mm(b_qe, b_kdt, DOT_DTYPE)
        b_kk += mm(b_ke, b_kdt, DOT_DTYPE)
        if tl.max(b_far.to(tl.int32)) > 0:
            b_qk, b_kk = group_products(b_qk, b_kk, b_q, b_k, b_c, b_r, k_base, b_rk, gc_base,
                                        gc_stride, i_i, i_k, L, FAR_SPAN, H, K, BC, BK, DOT_DTYPE)
    else:
        b_qk, b_kk = group_products(b_qk, b_kk, b_q, b_k, b_c, b_r, k_base, b_rk, gc_base,
                                    gc_stride, i_i, i_k, L, -1.0, H, K, BC, BK, DOT_DTYPE)
    return b_qk, b_kk, b_qe, b_ke


@triton.jit
def offdiag_slice(b_qk, b_kk, b_s, b_qe, b_ke, b_r, k_base, gc_base, gc_stride, i_j, i_k, L,
                  H: tl.constexpr, K: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
                  DOT_DTYPE: tl.constexpr):
    """Adds key slice ``i_k`` of block ``(I, J = i_j)``, ``J < I``, to ``b_qk`` and ``b_kk``: the
    row factors of ``diag_slice`` times ``k_J exp(r - c_J)``, both factors <= 1 (r, the first row of
    block I, comes after every row of J). Also returns ``b_s`` plus the slice's sums of squares of
    the rows of k_J as loaded, the norms that ``L2NORM`` scales the block's columns by (the
    compiler drops them otherwise)."""
    b_kj = load_rows(k_base, i_j * BC + tl.arange(0, BC), L, H * K, i_k * BK, K, BK)
    b_cj = load_tile(gc_base, i_j * BC, L, gc_stride, i_k * BK, K, BC, BK)
    b_kjt = tl.trans(b_kj * exp_nonpos(b_r[None, :] - b_cj))
    b_qk += mm(b_qe, b_kjt, DOT_DTYPE)
    b_kk += mm(b_ke, b_kjt, DOT_DTYPE)
    return b_qk, b_kk, b_s + tl.sum(b_kj * b_kj, axis=1)


@triton.jit
def store_pair_block(A_base, Akk_base, b_qk, b_kk, scale, i_i, i_j, L, HV: tl.constexpr,
                     BT: tl.constexpr, BC: tl.constexpr):
    """Block ``(I, J)`` of Aqk (scaled) and A'."""
    store_tile(A_base, b_qk * scale, i_i * BC, L, HV * BT, i_j * BC, BT, BC, BC)
    store_tile(Akk_base, b_kk, i_i * BC, L, HV * BT, i_j * BC, BT, BC, BC)


@triton.jit
def substitution_step(b_At, b_M, i, o_c):
    """Row ``i`` of ``(I + A)^-1`` for strictly lower-triangular ``A``, given as ``A^T``, by forward
    substitution: ``e_i - A[i, :] @ M``, which reads only rows of ``M`` already final (``M`` starts
    as I). Row i of A is column i of ``A^T``, gathered across the lanes that hold it: it then
    indexes M's rows in M's own layout. Reduced out of A instead, it came out along the other axis,
    and each step moved it through shared memory with two barriers (ptxas, triton 3.6, sm_90a:
    290 -> 116 instructions a step; H200, (8, 4096, 16): solve 0.170 -> 0.114 ms a call)."""
    b_a = tl.gather(b_At, tl.full([b_At.shape[0], b_At.shape[1]], i, tl.int32), 1)
    b_m = tl.sum(b_a * b_M, axis=0)
    return tl.where(o_c[:, None] == i, b_M - b_m[None, :], b_M)


@triton.jit
def diagonal_inverses(b_At1, b_At2, b_At3, b_At4, BC: tl.constexpr, N: tl.constexpr):
    """``(I + A_n)^-1`` of the first ``N`` (2 or 4) strictly lower ``[BC, BC]`` blocks, given
    transposed, row by row, the N independent chains in one loop so that their steps overlap (the
    rest returned as is)."""
    o_c = tl.arange(0, BC)
    b_I = tl.where(o_c[:, None] == o_c[None, :], 1., 0.)
    b_M1, b_M2, b_M3, b_M4 = b_I, b_I, b_At3, b_At4
    if N == 4:
        b_M3, b_M4 = b_I, b_I
    for i in range(1, BC):
        b_M1 = substitution_step(b_At1, b_M1, i, o_c)
        b_M2 = substitution_step(b_At2, b_M2, i, o_c)
        if N == 4:
            b_M3 = substitution_step(b_At3, b_M3, i, o_c)
            b_M4 = substitution_step(b_At4, b_M4, i, o_c)
    return b_M1, b_M2, b_M3, b_M4


@triton.jit
def beta_rows_block(Akk_base, beta_base, I: tl.constexpr, J: tl.constexpr, L, HV: tl.constexpr,
                    BT: tl.constexpr, BC: tl.constexpr):
    """Block ``(I, J)`` of ``A = diag(beta) A'`` (``[BC, BC]``, float32)."""
    o_c = tl.arange(0, BC)
    b_b = tl.load(beta_base + (I * BC + o_c) * HV, mask=I * BC + o_c < L, other=0.).to(tl.float32)
    return load_tile(Akk_base, I * BC, L, HV * BT, J * BC, BT, BC, BC) * b_b[:, None]


@triton.jit
def beta_diag_block_t(Akk_base, beta_base, I: tl.constexpr, L, HV: tl.constexpr, BT: tl.constexpr,
                      BC: tl.constexpr):
    """The diagonal block ``(I, I)`` of ``A = diag(beta) A'``, transposed for ``substitution_step``;
    strictly lower before the transpose (the pair products store zeros on and above the diagonal;
    the mask only guards that)."""
    o_c = tl.arange(0, BC)
    b_A = beta_rows_block(Akk_base, beta_base, I, I, L, HV, BT, BC)
    return tl.trans(tl.where(o_c[:, None] > o_c[None, :], b_A, 0.))


@triton.jit
def store_decayed_keys(kbar_base, kg_base, b_k, b_c, b_last, row0, L, col0, HV: tl.constexpr,
                       K: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr):
    """Rows ``row0..`` (key columns ``col0..``) of ``kbar = k exp(c_last - c)`` and ``kg = k exp(c)``."""
    store_tile(kbar_base, b_k * exp_nonpos(b_last[None, :] - b_c), row0, L, HV * K, col0, K, BR, BK)
    store_tile(kg_base, b_k * exp_nonpos(b_c), row0, L, HV * K, col0, K, BR, BK)


@triton.jit
def store_decayed_queries(qt_base, b_q, b_c, scale, row0, L, col0, HV: tl.constexpr,
                          K: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr):
    """Rows ``row0..`` (key columns ``col0..``) of ``qt = scale q exp(c)``."""
    store_tile(qt_base, b_q * exp_nonpos(b_c) * scale, row0, L, HV * K, col0, K, BR, BK)


@triton.jit
def chunk_cumsum_kernel(
    g, A_log, dt_bias, q, k, gc, qt, kbar, kg,
    chunk_rows,
    scale, lower_bound, T, NT,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
    GATE: tl.constexpr, DECAYED: tl.constexpr, IS_VARLEN: tl.constexpr, PDL: tl.constexpr,
):
    """``gc`` = in-chunk cumulative log-decay ``c`` of a ``[BT, BK]`` slice; with ``DECAYED`` (the
    backward's recompute) also the keys decayed to the chunk's end, ``kbar = k exp(c_last - c)``,
    the decayed queries ``qt = scale q exp(c)`` and ``kg = k exp(c)``, which the state sweeps read
    (they leave those one input-dtype tile per chunk to load instead of q or k, the float32 c and
    their exps; H200, (8, 4096, 16): carry 0.70 -> 0.31 ms a call with kbar). The forward asks for
    ``gc`` only: its pair products form the decayed keys and queries from the q, k and c tiles
    they load anyway (``chunk_pair_fwd_kernel``). With ``GATE`` (see ``kernels/gate.py``) ``g`` is
    the raw gate, activated here. A positive log-decay in a given g breaks the contract (g <= 0)
    that the safe factorizations rely on: its key channel becomes NaN for the whole chunk, so this
    chunk's outputs and everything after are NaN rather than silently wrong."""
    NK: tl.constexpr = (K + BK - 1) // BK
    # Not PDL-launched itself: it starts once everything before it is done.
    release_dependent(PDL)
    i_c, i_hvk = tl.program_id(0), tl.program_id(1)
    i_hv, i_k = i_hvk // NK, i_hvk % NK
    i_h = i_hv // (HV // H)
    start, L = chunk_span(i_c, chunk_rows, T, NT, BT, IS_VARLEN)
    # The chunk's first row in the [.., HV, K] tensors (g, gc and the decayed keys and queries)
    # and in q, k ([.., H, K]).
    hv_offset = start * HV * K + i_hv * K
    h_offset = start * H * K + i_h * K
    b_g, _, _ = log_decay_tile(load_tile(g + hv_offset, 0, L, HV * K, i_k * BK, K, BT, BK),
                               A_log, dt_bias, i_hv, i_k * BK, lower_bound, K, BK, GATE)
    b_g = clamp_log_decay(b_g)
    b_c = tl.cumsum(b_g, axis=0)
    if GATE == 'none' or DECAYED:
        # Only a given g can be positive: the activations are <= 0 or NaN by construction
        # (exp(A_log) >= 0, softplus >= 0, sigmoid in [0, 1], lower_bound in [-5, 0) validated),
        # so the forward's build for them skips this second reduction over rows (H200, Kimi
        # configuration, ms a launch at (8, 4096, 16) / (1, 32768, 32): 0.154 / 0.301 -> 0.129
        # / 0.256 at the same setting). The recompute's build keeps it for its register
        # allocation alone (its outputs meet A' and M from the forward, whose c already carries
        # any NaN): without it ptxas (triton 3.6) spills 44 B a thread at that build's
        # 96-register cap, none with it, and the Kimi training step read +0.026 / +0.098 ms at
        # (8, 4096, 16) / the varlen batch.
        b_c = tl.where(tl.max(b_g, axis=0)[None, :] > 0, float('nan'), b_c)
    store_tile(gc + hv_offset, b_c, 0, L, HV * K, i_k * BK, K, BT, BK)
    if DECAYED:
        b_last = tl.sum(tl.where((tl.arange(0, BT) == L - 1)[:, None], b_c, 0.), axis=0)
        b_k = load_tile(k + h_offset, 0, L, H * K, i_k * BK, K, BT, BK)
        store_decayed_keys(kbar + hv_offset, kg + hv_offset, b_k, b_c, b_last, 0, L, i_k * BK, HV, K,
                           BT, BK)
        b_q = load_tile(q + h_offset, 0, L, H * K, i_k * BK, K, BT, BK)
        store_decayed_queries(qt + hv_offset, b_q, b_c, scale, 0, L, i_k * BK, HV, K, BT, BK)


@triton.jit
def chunk_pair_fwd_kernel(
    q, k, gc, Aqk, Akk, qt, kbar, kg,
    chunk_rows,
    scale, T, NT,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
    BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
    FACTORED_DIAG: tl.constexpr, ALL_NEAR: tl.constexpr, L2NORM: tl.constexpr,
    DOT_DTYPE: tl.constexpr, IS_VARLEN: tl.constexpr, PDL: tl.constexpr,
):
    """Row block I of ``Aqk`` (scale included) and of ``A' = A / beta`` (both kept for the
    backward): the diagonal block and the blocks J < I. One program per (chunk, I): the row
    blocks are independent, and one program per chunk ran them one after another. Also row
    block I of the decayed queries and keys ``qt``, ``kbar``, ``kg`` that the forward's sweep
    reads, from the q, k and c tiles loaded here anyway (the cumsum kernel's formulas, through the
    same helpers): formed there, they cost the cumsum kernel a second read of q and k (H200,
    (8, 4096, 16): cumsum 0.350 -> 0.143 ms a call, pair products 0.325 -> 0.444).

    ``L2NORM`` (inference with ``use_qk_l2norm_in_kernel``): q and k are raw, and this kernel
    normalizes the rows it reads, so that no pass reads q and k for their norms before it. Block
    I's rows: their inverse norms first (``row_inverse_norms``, a loop over the key slices whose
    tiles the main loop then finds in cache), then the rows scaled as they load, in float32.
    Blocks J < I: their raw key rows' squares summed in the main loop, which loads them anyway,
    and the products' columns scaled at the end. Not rounded to the input dtype as the training
    forward's normalization pass stores them, and each row's squares summed in another order:
    outputs differ from its in the last bits (float32 too). ``ALL_NEAR``: the lower-bound gate
    with keys of norm 1, where ``diag_slice`` needs no far-entry fallback."""
    tl.static_assert(BT % BC == 0, "the chunk must be a whole number of sub-blocks")
    NC: tl.constexpr = BT // BC
    i_ci, i_hv = tl.program_id(0), tl.program_id(1)
    i_c, i_i = i_ci // NC, i_ci % NC
    i_h = i_hv // (HV // H)
    start, L = chunk_span(i_c, chunk_rows, T, NT, BT, IS_VARLEN)
    q_base = q + start * H * K + i_h * K
    k_base = k + start * H * K + i_h * K
    # The chunk's first row in the [.., HV, K] tensors (gc and the decayed keys and queries).
    hv_offset = start * HV * K + i_hv * K
    gc_base = gc + hv_offset
    A_base = Aqk + start * HV * BT + i_hv * BT
    Akk_base = Akk + start * HV * BT + i_hv * BT

    tl.static_assert(NC <= 4, "at most 4 sub-blocks a chunk (three blocks J < I)")
    o_c = tl.arange(0, BC)
    m_r = ((i_i * BC + o_c) < L)[:, None]
    b_qk = tl.zeros([BC, BC], dtype=tl.float32)
    b_kk = tl.zeros([BC, BC], dtype=tl.float32)
    b_qk0, b_kk0 = b_qk, b_kk
    b_qk1, b_kk1 = b_qk, b_kk
    b_qk2, b_kk2 = b_qk, b_kk
    b_s0 = tl.zeros([BC], dtype=tl.float32)
    b_s1, b_s2 = b_s0, b_s0
    b_rq = None
    b_rk = None
    if L2NORM:
        b_rq = row_inverse_norms(q_base, i_i * BC + o_c, L, H, K, BK)
        b_rk = row_inverse_norms(k_base, i_i * BC + o_c, L, H, K, BK)
    # q and k are inputs (and the varlen chunk map is the launcher's), written before the kernel
    # ahead started (the cumsum, or in the segmented forward the previous segment's solve):
    # their norms may be formed while it drains. c may not.
    wait_for_previous(PDL)
    release_dependent(PDL)
    # Key slices outermost: block I's rows and their factors, formed once a slice, serve the
    # diagonal block and every block J < I (one reference row for all of them).
    for i_k in range(tl.cdiv(K, BK)):
        b_q = scale_rows(load_rows(q_base, i_i * BC + o_c, L, H * K, i_k * BK, K, BK), b_rq)
        b_k = scale_rows(load_rows(k_base, i_i * BC + o_c, L, H * K, i_k * BK, K, BK), b_rk)
        b_c = load_tile(gc_base, i_i * BC, L, HV * K, i_k * BK, K, BC, BK)
        b_r = load_row(gc_base, i_i * BC, L, HV * K, i_k * BK, K, BK)
        b_last = load_row(gc_base, L - 1, L, HV * K, i_k * BK, K, BK)
        store_decayed_keys(kbar + hv_offset, kg + hv_offset, b_k, b_c, b_last, i_i * BC, L,
                           i_k * BK, HV, K, BC, BK)
        store_decayed_queries(qt + hv_offset, b_q, b_c, scale, i_i * BC, L, i_k * BK, HV, K, BC, BK)
        b_qk, b_kk, b_qe, b_ke = diag_slice(b_qk, b_kk, b_q, b_k, b_c, b_r, m_r, k_base, b_rk,
                                            gc_base, HV * K, i_i, i_k, L, H, K, BC, BK, FACTORED_DIAG,
                                            ALL_NEAR, DOT_DTYPE)
        if i_i > 0:
            b_qk0, b_kk0, b_s0 = offdiag_slice(b_qk0, b_kk0, b_s0, b_qe, b_ke, b_r, k_base,
                                             gc_base, HV * K, 0, i_k, L, H, K, BC, BK, DOT_DTYPE)
        # NC first, a compile-time test: with 2 sub-blocks (BT = 32) these are not compiled.
        if NC > 2:
            if i_i > 1:
                b_qk1, b_kk1, b_s1 = offdiag_slice(b_qk1, b_kk1, b_s1, b_qe, b_ke, b_r, k_base,
                                                 gc_base, HV * K, 1, i_k, L, H, K, BC, BK, DOT_DTYPE)
        if NC > 3:
            if i_i > 2:
                b_qk2, b_kk2, b_s2 = offdiag_slice(b_qk2, b_kk2, b_s2, b_qe, b_ke, b_r, k_base,
                                                 gc_base, HV * K, 2, i_k, L, H, K, BC, BK, DOT_DTYPE)
    if L2NORM:
        # The columns of blocks J < I: their keys' inverse norms.
        b_s0 = inverse_norm(b_s0)[None, :]
        b_s1 = inverse_norm(b_s1)[None, :]
        b_s2 = inverse_norm(b_s2)[None, :]
        b_qk0, b_kk0 = b_qk0 * b_s0, b_kk0 * b_s0
        b_qk1, b_kk1 = b_qk1 * b_s1, b_kk1 * b_s1
        b_qk2, b_kk2 = b_qk2 * b_s2, b_kk2 * b_s2
    b_qk = tl.where(o_c[:, None] >= o_c[None, :], b_qk, 0.)
    b_kk = tl.where(o_c[:, None] > o_c[None, :], b_kk, 0.)
    store_pair_block(A_base, Akk_base, b_qk, b_kk, scale, i_i, i_i, L, HV, BT, BC)
    if i_i > 0:
        store_pair_block(A_base, Akk_base, b_qk0, b_kk0, scale, i_i, 0, L, HV, BT, BC)
    if NC > 2:
        if i_i > 1:
            store_pair_block(A_base, Akk_base, b_qk1, b_kk1, scale, i_i, 1, L, HV, BT, BC)
    if NC > 3:
        if i_i > 2:
            store_pair_block(A_base, Akk_base, b_qk2, b_kk2, scale, i_i, 2, L, HV, BT, BC)


@triton.jit
def chunk_solve_kernel(
    beta, Akk, Minv,
    chunk_rows,
    T, NT,
    HV: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, DOT_DTYPE: tl.constexpr,
    IS_VARLEN: tl.constexpr, PDL: tl.constexpr,
):
    """``M = (I + diag(beta) A')^-1`` of one chunk and value head."""
    wait_for_previous(PDL)
    release_dependent(PDL)
    i_c, i_hv = tl.program_id(0), tl.program_id(1)
    start, L = chunk_span(i_c, chunk_rows, T, NT, BT, IS_VARLEN)
    Akk_base = Akk + start * HV * BT + i_hv * BT
    M_base = Minv + start * HV * BT + i_hv * BT

    # Block forward substitution on BC-row blocks, all in registers: the diagonal inverses
    # M_II = (I + A_II)^-1 side by side, then M_IJ = -M_II sum_{J <= l < I} A_Il M_lJ. (It went
    # through Minv in memory, one block after another with a barrier between them: with W and U
    # in the same kernel, 0.69 ms a call at (8, 4096, 16) on the H200 either way.)
    tl.static_assert(BT == 2 * BC or BT == 4 * BC, "chunks of 2 or 4 sub-blocks")
    NC: tl.constexpr = BT // BC
    beta_base = beta + start * HV + i_hv
    b_A21 = beta_rows_block(Akk_base, beta_base, 1, 0, L, HV, BT, BC)
    if NC == 2:
        b_M11, b_M22, _, _ = diagonal_inverses(
            beta_diag_block_t(Akk_base, beta_base, 0, L, HV, BT, BC),
            beta_diag_block_t(Akk_base, beta_base, 1, L, HV, BT, BC), b_A21, b_A21, BC, 2)
        b_M21 = -mm_fine(b_M22, mm_fine(b_A21, b_M11, DOT_DTYPE), DOT_DTYPE)
    else:
        b_M11, b_M22, b_M33, b_M44 = diagonal_inverses(
            beta_diag_block_t(Akk_base, beta_base, 0, L, HV, BT, BC),
            beta_diag_block_t(Akk_base, beta_base, 1, L, HV, BT, BC),
            beta_diag_block_t(Akk_base, beta_base, 2, L, HV, BT, BC),
            beta_diag_block_t(Akk_base, beta_base, 3, L, HV, BT, BC), BC, 4)
        b_M21 = -mm_fine(b_M22, mm_fine(b_A21, b_M11, DOT_DTYPE), DOT_DTYPE)
        b_A31 = beta_rows_block(Akk_base, beta_base, 2, 0, L, HV, BT, BC)
        b_A32 = beta_rows_block(Akk_base, beta_base, 2, 1, L, HV, BT, BC)
        b_M31 = -mm_fine(b_M33, mm_fine(b_A31, b_M11, DOT_DTYPE) + mm_fine(b_A32, b_M21, DOT_DTYPE),
                         DOT_DTYPE)
        b_M32 = -mm_fine(b_M33, mm_fine(b_A32, b_M22, DOT_DTYPE), DOT_DTYPE)
        b_A41 = beta_rows_block(Akk_base, beta_base, 3, 0, L, HV, BT, BC)
        b_A42 = beta_rows_block(Akk_base, beta_base, 3, 1, L, HV, BT, BC)
        b_A43 = beta_rows_block(Akk_base, beta_base, 3, 2, L, HV, BT, BC)
        b_M41 = -mm_fine(b_M44, mm_fine(b_A41, b_M11, DOT_DTYPE) + mm_fine(b_A42, b_M21, DOT_DTYPE)
                         + mm_fine(b_A43, b_M31, DOT_DTYPE), DOT_DTYPE)
        b_M42 = -mm_fine(b_M44, mm_fine(b_A42, b_M22, DOT_DTYPE) + mm_fine(b_A43, b_M32, DOT_DTYPE),
                         DOT_DTYPE)
        b_M43 = -mm_fine(b_M44, mm_fine(b_A43, b_M33, DOT_DTYPE), DOT_DTYPE)
        store_tile(M_base, b_M31, 2 * BC, L, HV * BT, 0, BT, BC, BC)
        store_tile(M_base, b_M32, 2 * BC, L, HV * BT, BC, BT, BC, BC)
        store_tile(M_base, b_M33, 2 * BC, L, HV * BT, 2 * BC, BT, BC, BC)
        store_tile(M_base, b_M41, 3 * BC, L, HV * BT, 0, BT, BC, BC)
        store_tile(M_base, b_M42, 3 * BC, L, HV * BT, BC, BT, BC, BC)
        store_tile(M_base, b_M43, 3 * BC, L, HV * BT, 2 * BC, BT, BC, BC)
        store_tile(M_base, b_M44, 3 * BC, L, HV * BT, 3 * BC, BT, BC, BC)
    store_tile(M_base, b_M11, 0, L, HV * BT, 0, BT, BC, BC)
    store_tile(M_base, b_M21, BC, L, HV * BT, 0, BT, BC, BC)
    store_tile(M_base, b_M22, BC, L, HV * BT, BC, BT, BC, BC)
