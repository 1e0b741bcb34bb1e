"""Token-by-token KDA recurrence (decode and short prefill).

One program owns a ``[BK, BV]`` tile of one sequence's state for one value head and walks the
tokens in order::

    S <- Diag(exp(g_t)) S
    S <- S + k_t (beta_t (v_t - S^T k_t))^T
    o_t = S^T (scale * q_t)

The state never leaves registers between tokens; it is read once at the start and written once at
the end, so a decode step (T = 1) moves the state's bytes twice and little else. With ``GATE`` /
``BETA`` (``kernels/gate.py``) ``g`` and ``beta`` are the raw gate and beta logits, activated here.
A log-decay > 0 or NaN at token t makes that head's outputs NaN from t on and its final state NaN
(the policy of ``kda/reference.py``, which the PyTorch path follows).

Serving (docs/API.md, "State pools"): with ``USE_STATE_INDICES`` sequence n's state is slot
``state_indices[n]`` of a pool ``[P, HV, K, V]``; with ``SPECULATIVE`` it enters from slot
``state_indices[n, num_accepted[n] - 1]`` and the state after its token t is stored in slot
``state_indices[n, t]`` (no final store). A negative slot is padding (zero outputs, no access); a
slot >= P gives NaN outputs and no access. ``CHANNEL_BETA``: beta is ``[.., HV, V]``, one write
strength per value column. A 16-bit pool is read into the float32 state and rounded once at each
store.
"""
import triton
import triton.language as tl

from kda.kernels.gate import beta_fwd, gate_fwd, gate_params
from kda.kernels.l2norm import inverse_norm


@triton.jit
def l2_normalize(x):
    """x / sqrt(sum(x^2) + 1e-6) over a 1-D block (padding lanes must hold 0)."""
    return x * inverse_norm(tl.sum(x * x, axis=0))


@triton.jit
def fused_recurrent_kda_kernel(
    q, k, v, g, beta, o,
    h0, ht,                      # state in and state out (may alias for an in-place update)
    cu_seqlens, state_indices,   # optional: varlen offsets [N + 1], state slots [N] or [N, T_idx]
    num_accepted,                # optional (SPECULATIVE): accepted tokens [N], in [1, T_idx]
    A_log, dt_bias,              # optional: the in-kernel gate's parameters
    scale, lower_bound,
    T,
    num_slots,                   # rows of the state pool h0/ht
    slots_per_seq,               # T_idx: columns of a [N, T_idx] state_indices (1 otherwise)
    stride_sk, stride_sv,        # element strides of the state between key rows / value columns
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr,
    USE_L2NORM: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    USE_INITIAL_STATE: tl.constexpr,
    STORE_FINAL_STATE: tl.constexpr,
    USE_STATE_INDICES: tl.constexpr,
    SPECULATIVE: tl.constexpr,
    CHANNEL_BETA: tl.constexpr,
    GATE: tl.constexpr,
    BETA: tl.constexpr,
):
    # One grid axis (2^31 - 1 programs; axes 1 and 2 stop at 65535), the value blocks of a state
    # innermost: programs that run together then cover whole rows of the same state.
    NV: tl.constexpr = (V + BV - 1) // BV
    i_nh, i_v = tl.program_id(0) // NV, tl.program_id(0) % NV
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    else:
        bos = i_n.to(tl.int64) * T
        eos = bos + T
    if USE_STATE_INDICES:
        p_slots = state_indices + i_n.to(tl.int64) * slots_per_seq
    if SPECULATIVE:
        # The entering state is the one stored after the last accepted token. An accepted count
        # outside [1, T_idx] would read past the row: it counts as a slot outside the pool.
        n_acc = tl.load(num_accepted + i_n).to(tl.int64)
        acc_ok = (n_acc >= 1) & (n_acc <= slots_per_seq)
        i_s = tl.load(p_slots + tl.where(acc_ok, n_acc - 1, 0)).to(tl.int64)
        i_s = tl.where(acc_ok, i_s, num_slots)
    elif USE_STATE_INDICES:
        i_s = tl.load(p_slots).to(tl.int64)
    else:
        i_s = i_n.to(tl.int64)
    # A negative slot is a padding row: zero outputs, nothing read or written. A slot past the
    # pool would read and write foreign memory: its outputs become NaN instead and no state is
    # touched, so the mistake is loud without a host-side check (and its sync).
    live = i_s >= 0
    slot_ok = live & (i_s < num_slots)
    i_s = tl.where(slot_ok, i_s, 0)

    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    # No state lanes at all for a bad slot.
    m_s = (o_k < tl.where(slot_ok, K, 0))[:, None] & m_v[None, :]
    o_h = o_k[:, None] * stride_sk + o_v[None, :] * stride_sv
    state_base = (i_s * HV + i_hv) * K * V

    if GATE != 'none':
        b_a, b_bias = gate_params(A_log, dt_bias, i_hv, 0, K, BK)
    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_INITIAL_STATE:
        b_h += tl.load(h0 + state_base + o_h, mask=m_s, other=0.).to(tl.float32)

    p_q = q + (bos * H + i_h) * K + o_k
    p_k = k + (bos * H + i_h) * K + o_k
    p_g = g + (bos * HV + i_hv) * K + o_k
    p_v = v + (bos * HV + i_hv) * V + o_v
    p_o = o + (bos * HV + i_hv) * V + o_v
    if CHANNEL_BETA:
        p_beta = beta + (bos * HV + i_hv) * V + o_v
    else:
        p_beta = beta + bos * HV + i_hv
    for i_t in range(0, eos - bos):
        b_q = tl.load(p_q, mask=m_k, other=0.).to(tl.float32)
        b_k = tl.load(p_k, mask=m_k, other=0.).to(tl.float32)
        b_g = tl.load(p_g, mask=m_k, other=0.).to(tl.float32)
        b_v = tl.load(p_v, mask=m_v, other=0.).to(tl.float32)
        if CHANNEL_BETA:
            b_beta = beta_fwd(tl.load(p_beta, mask=m_v, other=0.).to(tl.float32), BETA)
        else:
            b_beta = beta_fwd(tl.load(p_beta).to(tl.float32), BETA)
        if GATE != 'none':
            b_g = gate_fwd(b_g + b_bias, b_a, lower_bound, GATE)
        # Out of contract (g > 0, growth): NaN like a NaN g, never a finite answer. A NaN row of the
        # state makes the prediction S^T k NaN in every column, and the update then every entry.
        b_g = tl.where(b_g > 0, float('nan'), b_g)
        if USE_L2NORM:
            b_q = l2_normalize(b_q)
            b_k = l2_normalize(b_k)
        b_q = b_q * scale
        b_h *= tl.exp(b_g)[:, None]
        b_v = b_beta * (b_v - tl.sum(b_h * b_k[:, None], axis=0))
        b_h += b_k[:, None] * b_v[None, :]
        b_o = tl.sum(b_h * b_q[:, None], axis=0)
        if SPECULATIVE:
            # The state after token i_t goes to slot idx[n, i_t] (none past the row, none for a
            # negative slot); a slot past the pool is not written and flags the token's output.
            w_s = tl.load(p_slots + tl.minimum(i_t, slots_per_seq - 1)).to(tl.int64)
            w_s = tl.where(i_t < slots_per_seq, w_s, -1)
            w_ok = slot_ok & (w_s >= 0) & (w_s < num_slots)
            b_o = tl.where(w_s < num_slots, b_o, float('nan'))
            w_s = tl.where(w_ok, w_s, 0)
            m_w = (o_k < tl.where(w_ok, K, 0))[:, None] & m_v[None, :]
            tl.store(ht + (w_s * HV + i_hv) * K * V + o_h, b_h.to(ht.dtype.element_ty), mask=m_w)
        b_o = tl.where(slot_ok, b_o, tl.where(live, float('nan'), 0.))
        tl.store(p_o, b_o.to(p_o.dtype.element_ty), mask=m_v)
        p_q += H * K
        p_k += H * K
        p_g += HV * K
        p_v += HV * V
        p_o += HV * V
        if CHANNEL_BETA:
            p_beta += HV * V
        else:
            p_beta += HV

    if STORE_FINAL_STATE and not SPECULATIVE:
        tl.store(ht + state_base + o_h, b_h.to(ht.dtype.element_ty), mask=m_s)
