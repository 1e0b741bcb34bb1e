"""Helpers shared by the chunk kernels: chunk bounds, masked tiles, matrix products, safe decay.

Every per-token tensor is addressed as rows of ``[B * T, heads, D]`` (row = token), every state as
``[chunks, HV, K, V]``. A chunk covers rows ``start .. start + L - 1`` of one sequence, ``L <= BT``.
"""
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def chunk_span(i_c, chunk_rows, T, NT, BT: tl.constexpr, IS_VARLEN: tl.constexpr):
    """First row and number of valid rows of global chunk ``i_c``.

    Fixed length: chunk ``i_c`` is chunk ``i_c % NT`` of sequence ``i_c // NT``. Varlen:
    ``chunk_rows[i_c] = (first row, valid rows)`` (``chunk_layout``), two loads that do not wait
    on each other, where a map of (sequence, chunk) needed the sequence's bounds after it.
    """
    if IS_VARLEN:
        start = tl.load(chunk_rows + i_c * 2).to(tl.int64)
        rows = tl.load(chunk_rows + i_c * 2 + 1)
    else:
        i_n = (i_c // NT).to(tl.int64)
        i_t = (i_c % NT).to(tl.int64)
        start = i_n * T + i_t * BT
        rows = tl.minimum(i_n * T + T - start, BT)
    return start, rows.to(tl.int32)


@triton.jit
def sequence_span(i_n, cu_seqlens, chunk_offsets, T, NT, BT: tl.constexpr, IS_VARLEN: tl.constexpr):
    """First row, length and first global chunk of sequence ``i_n``."""
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
        c0 = tl.load(chunk_offsets + i_n).to(tl.int64)
    else:
        bos = i_n.to(tl.int64) * T
        eos = bos + T
        c0 = i_n.to(tl.int64) * NT
    return bos, (eos - bos).to(tl.int32), c0


@triton.jit
def state_tile(i_n, i_hv, i_v, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, stride_sk,
               stride_sv, BK: tl.constexpr, BV: tl.constexpr):
    """Offsets and mask of the ``[BK, BV]`` slice (value columns ``i_v*BV..``) of state
    ``[i_n, i_hv]`` in a ``[N, HV, K, V]`` tensor stored key-major (strides V, 1) or value-major
    (strides 1, K)."""
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    base = (i_n.to(tl.int64) * HV + i_hv) * K * V
    offsets = base + o_k[:, None] * stride_sk + o_v[None, :] * stride_sv
    return offsets, (o_k < K)[:, None] & (o_v < V)[None, :]


@triton.jit
def sweep_program(cu_seqlens, chunk_offsets, seq_order, T, NT, HV: tl.constexpr, V: tl.constexpr,
                  BT: tl.constexpr, BV: tl.constexpr, IS_VARLEN: tl.constexpr,
                  SLICES_INNERMOST: tl.constexpr):
    """A state sweep's program: (sequence, value head) on grid axis 0, which allows 2^31 - 1
    programs (axis 1 stops at 65535), value slice on axis 1; with ``SLICES_INNERMOST``, one axis of
    (sequence, value head, value slice), the slice innermost (which sweeps take which:
    ``sweep_grid`` in ``kda/ops/chunk/launch.py``). Varlen takes the sequences in ``seq_order`` (most
    chunks first). Returns ``(i_n, i_hv, i_v)`` and the sequence's first row, length and first
    global chunk (``sequence_span``)."""
    NV: tl.constexpr = (V + BV - 1) // BV
    if SLICES_INNERMOST:
        i_nh, i_v = tl.program_id(0) // NV, tl.program_id(0) % NV
    else:
        i_nh, i_v = tl.program_id(0), tl.program_id(1)
    if IS_VARLEN:
        i_n, i_hv = tl.load(seq_order + i_nh // HV), i_nh % HV
    else:
        i_n, i_hv = i_nh // HV, i_nh % HV
    bos, L, c0 = sequence_span(i_n, cu_seqlens, chunk_offsets, T, NT, BT, IS_VARLEN)
    return i_n, i_hv, i_v, bos, L, c0


@triton.jit
def load_state(s0, i_n, i_hv, i_v, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, stride_sk,
               stride_sv, BK: tl.constexpr, BV: tl.constexpr, USE: tl.constexpr):
    """The float32 ``[BK, BV]`` slice of a sweep's starting state ``s0`` (zeros unless ``USE``),
    with the slice's offsets and mask in such a tensor (``state_tile``), for the state it ends
    with."""
    o_s, m_s = state_tile(i_n, i_hv, i_v, HV, K, V, stride_sk, stride_sv, BK, BV)
    b_s = tl.zeros([BK, BV], dtype=tl.float32)
    if USE:
        b_s += tl.load(s0 + o_s, mask=m_s, other=0.).to(tl.float32)
    return b_s, o_s, m_s


@triton.jit
def load_slot_state(pool, state_indices, has_initial, num_slots, i_n, i_hv, i_v, HV: tl.constexpr,
                    K: tl.constexpr, V: tl.constexpr, stride_sk, stride_sv, BK: tl.constexpr,
                    BV: tl.constexpr, USE_HAS_INITIAL: tl.constexpr):
    """``load_state`` from slot ``state_indices[i_n]`` of a state pool ``[P, HV, K, V]``: the
    float32 slice (zeros where ``has_initial[i_n]`` is False), its offsets in the pool, the store
    mask, and ``(slot_ok, live)``. A negative slot is padding (not ``live``) and a slot >= P is
    live but not ``slot_ok``: neither reads nor writes any lane (the mask is empty), so no slot
    value reaches memory outside the pool."""
    i_s = tl.load(state_indices + i_n).to(tl.int64)
    live = i_s >= 0
    slot_ok = live & (i_s < num_slots)
    o_s, m_v = state_tile(tl.where(slot_ok, i_s, 0), i_hv, i_v, HV, K, V, stride_sk, stride_sv, BK, BV)
    # The scalar conditions folded into the key bound: the interpreter rejects a block mask
    # combined with a scalar one.
    o_k = tl.arange(0, BK)
    m_s = (o_k < tl.where(slot_ok, K, 0))[:, None] & m_v
    read = slot_ok
    if USE_HAS_INITIAL:
        read = read & (tl.load(has_initial + i_n) != 0)
    m_r = (o_k < tl.where(read, K, 0))[:, None] & m_v
    b_s = tl.load(pool + o_s, mask=m_r, other=0.).to(tl.float32)
    return b_s, o_s, m_s, slot_ok, live


@triton.jit
def load_rows(base, o_r, n_rows, row_stride, col0, n_cols, BC: tl.constexpr):
    """float32 ``[len(o_r), BC]`` tile of the rows listed in ``o_r`` and columns ``col0..``; zero
    outside ``n_rows`` x ``n_cols``."""
    o_c = col0 + tl.arange(0, BC)
    m = (o_r < n_rows)[:, None] & (o_c < n_cols)[None, :]
    p = base + o_r[:, None].to(tl.int64) * row_stride + o_c[None, :]
    return tl.load(p, mask=m, other=0.).to(tl.float32)


@triton.jit
def load_tile(base, row0, n_rows, row_stride, col0, n_cols, BR: tl.constexpr, BC: tl.constexpr):
    """float32 ``[BR, BC]`` tile of rows ``row0..`` and columns ``col0..``; zero outside
    ``n_rows`` x ``n_cols``."""
    return load_rows(base, row0 + tl.arange(0, BR), n_rows, row_stride, col0, n_cols, BC)


@triton.jit
def store_tile(base, x, row0, n_rows, row_stride, col0, n_cols, BR: tl.constexpr, BC: tl.constexpr):
    o_r = row0 + tl.arange(0, BR)
    o_c = col0 + tl.arange(0, BC)
    m = (o_r < n_rows)[:, None] & (o_c < n_cols)[None, :]
    p = base + o_r[:, None].to(tl.int64) * row_stride + o_c[None, :]
    tl.store(p, x.to(base.dtype.element_ty), mask=m)


@triton.jit
def load_tile_t(base, row0, n_rows, row_stride, col0, n_cols, BR: tl.constexpr, BC: tl.constexpr):
    """``load_tile`` transposed: the float32 ``[BC, BR]`` tile whose entry ``[c, r]`` is row
    ``row0 + r``, column ``col0 + c``."""
    o_r = row0 + tl.arange(0, BR)
    o_c = col0 + tl.arange(0, BC)
    m = (o_c < n_cols)[:, None] & (o_r < n_rows)[None, :]
    p = base + o_r[None, :].to(tl.int64) * row_stride + o_c[:, None]
    return tl.load(p, mask=m, other=0.).to(tl.float32)


@triton.jit
def store_tile_t(base, x, row0, n_rows, row_stride, col0, n_cols, BR: tl.constexpr, BC: tl.constexpr):
    """``store_tile`` of the transposed ``[BC, BR]`` tile ``x`` (entry ``[c, r]`` to row
    ``row0 + r``, column ``col0 + c``)."""
    o_r = row0 + tl.arange(0, BR)
    o_c = col0 + tl.arange(0, BC)
    m = (o_c < n_cols)[:, None] & (o_r < n_rows)[None, :]
    p = base + o_r[None, :].to(tl.int64) * row_stride + o_c[:, None]
    tl.store(p, x.to(base.dtype.element_ty), mask=m)


@triton.jit
def load_tile_o(base, row0, n_rows, row_stride, col0, n_cols, BR: tl.constexpr, BC: tl.constexpr,
                TRANSPOSED: tl.constexpr):
    """Tile X (``load_tile``) as a state sweep holds it: as is, or transposed (``load_tile_t``)."""
    if TRANSPOSED:
        return load_tile_t(base, row0, n_rows, row_stride, col0, n_cols, BR, BC)
    else:
        return load_tile(base, row0, n_rows, row_stride, col0, n_cols, BR, BC)


@triton.jit
def load_tile_ot(base, row0, n_rows, row_stride, col0, n_cols, BR: tl.constexpr, BC: tl.constexpr,
                 TRANSPOSED: tl.constexpr):
    """X^T for tile X (``load_tile``) as a state sweep holds it: transposed, that is X itself."""
    return oriented(load_tile(base, row0, n_rows, row_stride, col0, n_cols, BR, BC), not TRANSPOSED)


@triton.jit
def store_tile_o(base, x, row0, n_rows, row_stride, col0, n_cols, BR: tl.constexpr, BC: tl.constexpr,
                 TRANSPOSED: tl.constexpr):
    """``store_tile`` of a tile a state sweep holds as is or transposed."""
    if TRANSPOSED:
        store_tile_t(base, x, row0, n_rows, row_stride, col0, n_cols, BR, BC)
    else:
        store_tile(base, x, row0, n_rows, row_stride, col0, n_cols, BR, BC)


@triton.jit
def mm_o(a, b, DOT_DTYPE: tl.constexpr, TRANSPOSED: tl.constexpr):
    """``A B`` from A, B held as is or transposed, in the same orientation: ``(A B)^T = B^T A^T``."""
    if TRANSPOSED:
        return mm(b, a, DOT_DTYPE)
    else:
        return mm(a, b, DOT_DTYPE)


@triton.jit
def rows_o(x, TRANSPOSED: tl.constexpr):
    """A vector with one entry per row of a matrix held as is or transposed, broadcast to it."""
    if TRANSPOSED:
        return x[None, :]
    else:
        return x[:, None]


@triton.jit
def lower_o(BT: tl.constexpr, TRANSPOSED: tl.constexpr):
    """The lower triangle with the diagonal of a ``[BT, BT]`` matrix held as is or transposed."""
    o_t = tl.arange(0, BT)
    if TRANSPOSED:
        return o_t[None, :] >= o_t[:, None]
    else:
        return o_t[:, None] >= o_t[None, :]


@triton.jit
def oriented(x, TRANSPOSED: tl.constexpr):
    """``x`` or ``x^T``: a state slice between its stored ``[BK, BV]`` form and a sweep's."""
    if TRANSPOSED:
        return tl.trans(x)
    else:
        return x


@triton.jit
def load_row(base, row, n_rows, row_stride, col0, n_cols, BC: tl.constexpr):
    """One float32 row ``[BC]``; zero when ``row >= n_rows`` (nothing past the tile is read)."""
    o_c = col0 + tl.arange(0, BC)
    # The row test folds into the column bound: the interpreter rejects a block mask combined
    # with a scalar one.
    m = o_c < tl.where(row < n_rows, n_cols, 0)
    return tl.load(base + row * row_stride + o_c, mask=m, other=0.).to(tl.float32)


@triton.jit
def mm(a, b, DOT_DTYPE: tl.constexpr):
    """``a @ b`` with float32 accumulation. Operands are float32 blocks; for float32 inputs the
    product is exact float32 (no tf32), otherwise the operands are rounded to the input dtype so
    the tensor cores run at full rate."""
    if DOT_DTYPE == tl.float32:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a.to(DOT_DTYPE), b.to(DOT_DTYPE))


@triton.jit
def mm_fine(a, b, DOT_DTYPE: tl.constexpr):
    """``a @ b`` for operands that must not be rounded to 16 bits (the backward's diagonal blocks,
    see ``DIAG_SPAN``; the solve's block substitution, whose errors would compound): exact
    float32 for float32 inputs, as ``mm``; otherwise three tf32 tensor-core products on a split of
    each operand into its leading and trailing 11 bits (tf32x3, about 1e-6 relative error where a
    bf16 operand carries 4e-3), instead of the exact product on the FMA units, which costs each
    thread ~16 multiply-adds per output element plus its operand shuffles."""
    if DOT_DTYPE == tl.float32:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision="tf32x3")


# exp(x) = 2^(x log2 e): tl.exp2 compiles to one ex2.approx.ftz (MUFU.EX2); tl.exp's ex2.approx
# without ftz takes four instructions, three of them rescaling inputs below -126 for a denormal
# result (ptxas, sm_90a). The only difference is that results below float32's smallest normal
# (exp(-87.3) = 1.2e-38) flush to 0. A flushed factor times a partner of order 1 or less is
# below anything float32 sums keep; where the partner can be larger (the forward's diagonal
# blocks, up to exp(76)), see chunk_intra.diag_slice.
LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def exp_ftz(x):
    """``exp(x)`` with results below 1.2e-38 flushed to 0 (see LOG2E)."""
    return tl.exp2(x * LOG2E)


@triton.jit
def exp_nonpos(x, SUBNORMAL: tl.constexpr = False):
    """exp of a quantity that is mathematically <= 0 (a decay over a span of tokens). Clamping at 0
    keeps lanes whose exponent is meaningless (above the diagonal, past the chunk) finite; a NaN
    passes through (PropagateNan.ALL: one min.NaN instruction; a plain ``tl.minimum`` would drop
    it), so a poisoned decay stays visible. Results below 1.2e-38 flush to 0 (``exp_ftz``) unless
    ``SUBNORMAL`` (``tl.exp``, four instructions), for a factor whose partner can exceed 1."""
    x = tl.minimum(x, 0., propagate_nan=tl.PropagateNan.ALL)
    if SUBNORMAL:
        return tl.exp(x)
    else:
        return exp_ftz(x)


# A step whose log-decay is below -104 multiplies by less than float32's smallest denormal
# (exp(-104) = 6.8e-46 < 1.4e-45), so clamping it there changes no float32 product, while it keeps
# the in-chunk cumulative decay small enough that differences of it stay accurate (float32 carries
# an absolute error of about 6e-8 times its magnitude). The gradient below the clamp is 0, as
# exp(g) * (...) is.
LOG_DECAY_FLOOR = tl.constexpr(-104.0)


@triton.jit
def clamp_log_decay(g):
    # tl.where, not tl.maximum, which would turn a NaN input into the floor.
    return tl.where(g < LOG_DECAY_FLOOR, LOG_DECAY_FLOOR, g)


# Diagonal sub-blocks in the backward: exp(c_i - c_j) = exp(c_i - r) exp(r - c_j) through the
# block's middle row r is exact and runs as a matrix product, but a factor exceeds 1 on one side of
# r. Taken only where every valid row of the slice lies within DIAG_SPAN of r: exp(60) = 1.1e26
# leaves 1e12 of float32 range for the keys or queries the factor multiplies (the pair-matrix
# gradients enter scaled to at most 1, see chunk_intra_bwd.py), and exp(-60) times a key stays far
# above float32's smallest normal (1e-38). The products keep float32 operands (``mm_fine``: exact
# for float32 inputs, tf32x3 otherwise), never rounded to the input dtype: a
# pair term x_ij enters dc_i as +x and dc_j as -x through two different products, and dg sums dc
# over the chunk, so any rounding that differs between the two sides stays in every dg before j.
# The diagonal blocks hold the least-decayed, largest terms; with bf16 operands there the H200 gave
# dg errors of 9 roundings (1.5e-2 against the test's 8.3e-3 bound) where the other gradients had
# 2. The forward does not use this data-dependent choice: it depends on every row of the block, so
# an output's rounding would depend on later rows' gates (see chunk_intra.py).
DIAG_SPAN = tl.constexpr(60.0)


@triton.jit
def diag_reference(b_c, gc_base, gc_stride, i_x, L, col0, n_cols, BC: tl.constexpr, BK: tl.constexpr):
    """For diagonal sub-block ``i_x`` with cumulative decays ``b_c`` ``[BC, BK]``: the middle valid
    row ``r`` and the valid-row mask."""
    o_r = i_x * BC + tl.arange(0, BC)
    b_r = load_row(gc_base, tl.minimum(i_x * BC + BC // 2 - 1, L - 1), L, gc_stride, col0, n_cols, BK)
    return b_r, (o_r < L)[:, None]


@triton.jit
def within_diag_span(b_c, b_r, m_r):
    """Whether the factored form may be used: every valid row within ``DIAG_SPAN`` of ``r``."""
    return tl.max(tl.where(m_r, tl.abs(b_c - b_r[None, :]), 0.)) <= DIAG_SPAN


@triton.jit
def diag_factors(b_c, b_r, m_r):
    """``(exp(c - r), exp(r - c))`` on the valid rows, 0 elsewhere (see ``diag_reference``)."""
    b_d = b_c - b_r[None, :]
    return tl.where(m_r, exp_ftz(b_d), 0.), tl.where(m_r, exp_ftz(-b_d), 0.)


@triton.jit
def scale_rows(b_p):
    """``(b_p / s[:, None], s)`` with ``s`` the largest magnitude of each row (rows of zeros stay
    zero; a NaN stays NaN)."""
    b_s = tl.max(tl.abs(b_p), axis=1)
    return b_p * tl.where(b_s > 0, 1. / b_s, 0.)[:, None], b_s


# Programmatic dependent launch (Hopper and later; ``dependent_launch`` in ``kda/ops/chunk/launch.py``): a
# kernel launched with ``launch_pdl`` may start while the kernel before it on its stream still
# runs, once every program of that one has passed ``release_dependent`` or exited (a kernel that
# never releases lets it start as its programs exit, before its writes are flushed). PDL False
# (the interpreter, older GPUs; the builds launched plainly) compiles both helpers to nothing.
# Keep ``wait_for_previous`` out of loops: Triton 3.6's software pipeliner issues a loop's first
# loads (cp.async) above a wait inside it (triton-lang/triton#11905;
# ``tests/chunk/test_offline_sm90.py::test_dependent_launch_order``).


@triton.jit
def wait_for_previous(PDL: tl.constexpr):
    """Blocks until the kernel before this one on the stream has finished and its writes are
    visible. A PDL-launched kernel calls it before it reads what that kernel wrote and before it
    writes anything (its buffers may be memory that kernel still reads); before it, it may read
    only tensors written before that kernel started."""
    if PDL:
        gdc_wait()


@triton.jit
def release_dependent(PDL: tl.constexpr):
    """Lets the next kernel on the stream, if PDL-launched, start its programs on the SMs this
    kernel's finished programs leave. A PDL-launched kernel calls it only after
    ``wait_for_previous``, and a kernel not launched so (which started once everything before it
    was done) may call it anywhere: either way the next kernel's early reads (see there) find
    everything before this kernel complete."""
    if PDL:
        gdc_launch_dependents()
