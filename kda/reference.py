"""Pure-PyTorch KDA: the naive recurrence (the oracle) and the chunked WY/UT algebra.

Both follow the contract of ``docs/API.md``. Per value head and sequence, with column vectors and a
key-by-value state ``S`` of shape ``[K, V]``::

    S_t = Diag(exp(g_t)) S_{t-1}
    S_t = S_t + beta_t k_t (v_t - S_t^T k_t)^T
    o_t = S_t^T (scale * q_t)

Given float64 inputs everything is computed in float64; otherwise in float32. These functions are
differentiable by autograd and are what every kernel is tested against.

Log-decays outside the contract ``g <= 0``: a step with ``g > 0`` (growth, which the chunk
kernels' factored decays cannot hold) or NaN in any key channel of a value head poisons that head
on every path, here as in the kernels. In ``naive_recurrent_kda`` its outputs are NaN from that
token on; in ``chunk_kda_reference`` from the first token of that token's chunk on; in both its
final state is NaN (and so is every state entering a later chunk), and so are the gradients that
flow through them. Other heads and sequences are untouched. ``g = -inf`` (a decay factor of
exactly 0) is inside the contract and exact on both.
"""
from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    # Same epsilon placement as the kernels: x / sqrt(sum(x^2) + 1e-6).
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _sequence_bounds(B: int, T: int, cu_seqlens: torch.Tensor | None) -> list[tuple[int, int, int]]:
    """(batch row, start, end) of every sequence."""
    if cu_seqlens is None:
        return [(b, 0, T) for b in range(B)]
    c = cu_seqlens.tolist()
    return [(0, c[n], c[n + 1]) for n in range(len(c) - 1)]


def _prepare(q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel, cu_seqlens, state_v_first):
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    dt = _compute_dtype(q)
    q, k, v, g, beta = (x.to(dt) for x in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        q, k = _l2norm(q), _l2norm(k)
    group = HV // H
    q = q.repeat_interleave(group, dim=2)
    k = k.repeat_interleave(group, dim=2)
    if scale is None:
        scale = K ** -0.5
    bounds = _sequence_bounds(B, T, cu_seqlens)
    if initial_state is None:
        S0 = q.new_zeros(len(bounds), HV, K, V)
    else:
        S0 = initial_state.to(dt)
        if state_v_first:
            S0 = S0.transpose(-1, -2)
    return q * scale, k, v, g, beta, S0, bounds


def _poison_bad_decays(g: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The out-of-contract policy for one sequence's ``g`` ``[T, HV, K]``: ``(g, poisoned)`` where
    ``poisoned`` ``[T, HV]`` marks every token of a head from the first block of ``block`` tokens
    holding a log-decay ``> 0`` or NaN on, and ``g`` is NaN there (so the states and gradients that
    pass through are NaN too)."""
    T = g.shape[0]
    if T == 0:
        return g, g.new_zeros(0, g.shape[1], dtype=torch.bool)
    bad = ~(g <= 0).all(-1)                                    # [T, HV]; NaN <= 0 is False
    t = torch.arange(T, device=g.device)
    first = torch.where(bad, t[:, None], T).amin(0)            # [HV], T where none
    start = torch.where(first < T, first - first % block, T)
    poisoned = t[:, None] >= start[None]
    return torch.where(poisoned[..., None], torch.nan, g), poisoned


def _recurrent_sequence(q, k, v, g, beta, S):
    """Token-by-token recurrence for one sequence; shapes as in ``_chunk_sequence``."""
    g, poisoned = _poison_bad_decays(g, 1)
    outs = []
    for t in range(q.shape[0]):
        S = S * g[t].exp()[..., None]
        pred = torch.einsum('hkv,hk->hv', S, k[t])
        # beta [HV] per head, or [HV, V] per value channel (fused_recurrent_kda's channel beta).
        strength = beta[t] if beta.dim() == 3 else beta[t][:, None]
        S = S + torch.einsum('hk,hv->hkv', k[t], strength * (v[t] - pred))
        outs.append(torch.einsum('hkv,hk->hv', S, q[t]))
    o = torch.stack(outs, 0) if outs else q.new_zeros(0, v.shape[1], v.shape[2])
    # Explicit, so that the policy does not rest on 0 * NaN = NaN inside the matrix products.
    return torch.where(poisoned[..., None], torch.nan, o), S


def _run(sequence_fn, q, k, v, g, beta, scale, initial_state, output_final_state,
         use_qk_l2norm_in_kernel, cu_seqlens, state_v_first):
    q_, k_, v_, g_, b_, S0, bounds = _prepare(
        q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel, cu_seqlens, state_v_first)
    pieces: list[list[torch.Tensor]] = [[] for _ in range(q.shape[0])]
    states = []
    for n, (b, bos, eos) in enumerate(bounds):
        o, S = sequence_fn(q_[b, bos:eos], k_[b, bos:eos], v_[b, bos:eos], g_[b, bos:eos],
                           b_[b, bos:eos], S0[n])
        pieces[b].append(o)
        states.append(S)
    if pieces:
        o = torch.stack([torch.cat(p, 0) for p in pieces], 0)
    else:                                                   # B = 0
        o = v_.new_zeros(0, *v_.shape[1:])
    o = o.to(torch.float64 if q.dtype == torch.float64 else q.dtype)
    if not output_final_state:
        return o, None
    S = torch.stack(states, 0) if states else S0
    if state_v_first:
        S = S.transpose(-1, -2)
    return o, S.to(_compute_dtype(q)).contiguous()


def naive_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    state_v_first: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-by-token KDA recurrence; the oracle for every kernel.

    Shapes as in docs/API.md: q, k ``[B, T, H, K]``; v ``[B, T, HV, V]``; g ``[B, T, HV, K]`` (log-decay);
    beta ``[B, T, HV]`` (or ``[B, T, HV, V]``, a write strength per value channel);
    states ``[N, HV, K, V]`` (``[N, HV, V, K]`` with ``state_v_first``).
    Returns ``(o, final_state)``; ``o`` has q's dtype, the final state is float32 (both float64
    for float64 inputs).
    """
    return _run(_recurrent_sequence, q, k, v, g, beta, scale, initial_state, output_final_state,
                use_qk_l2norm_in_kernel, cu_seqlens, state_v_first)


def _segment_log_decays(g: torch.Tensor) -> torch.Tensor:
    """``D[j, i] = g_{j+1} + ... + g_i`` for a chunk's ``g`` ``[C, HV, K]``: ``[C, C, HV, K]``, 0 for
    ``i <= j``. Each entry is a running sum of the steps it spans alone, never a difference of two
    cumulative sums: those cancel catastrophically after a large step (and give ``-inf - -inf =
    NaN`` after a step of ``-inf``)."""
    C = g.shape[0]
    t = torch.arange(C, device=g.device)
    spanned = (t[None, :] > t[:, None])[..., None, None]         # [j, l]: l > j
    return torch.where(spanned, g[None], 0).cumsum(1)


def _suffix_log_decays(g: torch.Tensor) -> torch.Tensor:
    """``g_{i+1} + ... + g_C`` for every row ``i`` of a chunk's ``g`` (0 for the last), summed from
    the chunk's end."""
    from_here = g.flip(0).cumsum(0).flip(0)                       # g_i + ... + g_C
    return torch.cat([from_here[1:], torch.zeros_like(g[:1])], 0)


def _pair_decays(g: torch.Tensor) -> torch.Tensor:
    """``E[j, i] = exp(D[j, i])`` for ``j <= i``, 0 above the diagonal: ``[C, C, HV, K]``, every entry
    in [0, 1] for any ``g <= 0`` (``-inf`` included; the masked entries are ``exp(0)`` times 0)."""
    C = g.shape[0]
    causal = torch.ones(C, C, dtype=torch.bool, device=g.device).triu()   # [j, i]: j <= i
    return _segment_log_decays(g).exp() * causal[..., None, None]


def _chunk_spans(T: int, chunk_size: int) -> list[tuple[int, int]]:
    return [(s, min(s + chunk_size, T)) for s in range(0, T, chunk_size)]


class _PairProducts(torch.autograd.Function):
    """``(KK, QK)`` ``[NT, HV, C, C]`` of every chunk of one sequence (q, k, g ``[T, HV, K]``):
    ``XK[n, h, i, j] = sum_d x_id k_jd E[j, i, d]`` within chunk ``n`` (``_pair_decays``), zero past a
    short last chunk's rows. With ``P[j, i] = E[j, i] k_j (dKK[i, j] k_i + dQK[i, j] q_i)`` the
    backward is ``dq_i = sum_j dQK[i, j] k_j E[j, i]``, ``dk_i = sum_j dKK[i, j] k_j E[j, i] +
    sum_j (dKK[j, i] k_j + dQK[j, i] q_j) E[i, j]`` and ``dg_l = sum_{j < l <= i} P[j, i]``.

    One node for the whole sequence, keeping only q, k and g: the ``[C, C, HV, K]`` decays are
    formed again chunk by chunk in the backward instead of being kept for every chunk (T / C of
    them, each C times the size of a chunk's keys). The outputs and gradients are allocated once,
    before the chunk loop, so the loop's large temporaries are freed back to back with nothing
    long-lived allocated between them, and the C library's allocator reuses their memory instead
    of fragmenting it: peak resident size of a training call at (1, 2048, 8, 64), float32, 0.26 GiB
    this way, 1.1 GiB with the same recomputation interleaved with the state updates, 1.7-2.5 GiB
    keeping every chunk's decays."""

    @staticmethod
    def forward(ctx, q, k, g, chunk_size):
        ctx.save_for_backward(q, k, g)
        ctx.chunk_size = chunk_size
        T, HV, _ = q.shape
        spans = _chunk_spans(T, chunk_size)
        kk = q.new_zeros(len(spans), HV, chunk_size, chunk_size)
        qk = torch.zeros_like(kk)
        for n, (s, e) in enumerate(spans):
            kj = _pair_decays(g[s:e]) * k[s:e, None]              # [j, i, HV, K]: k_j E[j, i]
            kk[n, :, :e - s, :e - s] = torch.einsum('jihd,ihd->hij', kj, k[s:e])
            qk[n, :, :e - s, :e - s] = torch.einsum('jihd,ihd->hij', kj, q[s:e])
        return kk, qk

    @staticmethod
    @once_differentiable
    def backward(ctx, dkk, dqk):
        q, k, g = ctx.saved_tensors
        dq, dk, dg = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(g)
        for n, (s, e) in enumerate(_chunk_spans(q.shape[0], ctx.chunk_size)):
            L = e - s
            qc, kc = q[s:e], k[s:e]
            E = _pair_decays(g[s:e])
            d_kk = dkk[n, :, :L, :L].permute(2, 1, 0)[..., None]   # [j, i, HV, 1]: dKK[i, j]
            d_qk = dqk[n, :, :L, :L].permute(2, 1, 0)[..., None]
            kj = E * kc[:, None]                                   # k_j E[j, i]
            dq[s:e] = (kj * d_qk).sum(0)
            dk[s:e] = (kj * d_kk).sum(0)
            row = d_kk * kc[None] + d_qk * qc[None]                # dKK[i, j] k_i + dQK[i, j] q_i
            dk[s:e] += (row * E).sum(1)
            P = row * kj
            from_l = P.flip(1).cumsum(1).flip(1)                   # [j, l]: sum over i >= l
            t = torch.arange(L, device=q.device)
            dg[s:e] = torch.where((t[None, :] > t[:, None])[..., None, None], from_l, 0).sum(0)
        return dq, dk, dg, None


def _chunk_sequence(q, k, v, g, beta, S, chunk_size, entering=None):
    """The WY/UT chunk algebra for one sequence, all value heads at once (the state entering each
    chunk appended to ``entering`` when given).

    q, k, g: ``[T, HV, K]``, v: ``[T, HV, V]``, beta: ``[T, HV]``, S: ``[HV, K, V]``. For a chunk of
    rows ``1..C`` with incoming state ``S``, in-chunk decay ``c_i = g_1 + ... + g_i``, decay between
    rows ``D_ij = g_{j+1} + ... + g_i`` (``j <= i``) and decay to the chunk's end
    ``r_i = g_{i+1} + ... + g_C``:

        A[i, j]   = beta_i sum_d k_id k_jd exp(D_ijd)                (j < i)
        Aqk[i, j] = sum_d q_id k_jd exp(D_ijd)                       (j <= i)
        M  = (I + A)^-1                                              (unit lower triangular)
        W  = M diag(beta) (k * exp(c)),   U = M diag(beta) v
        dV = U - W S                                                 (the delta-rule corrections)
        O  = (q * exp(c)) S + Aqk dV
        S' = Diag(exp(c_C)) S + (k * exp(r))^T dV

    ``c``, ``D`` and ``r`` are each summed over the steps they span (no difference of cumulative
    sums), so every exponent is exact to the rounding of its own sum and <= 0: any ``g <= 0``,
    ``-inf`` included, stays finite, forward and backward. ``KK`` and ``QK`` come from
    ``_PairProducts``, which keeps no ``[C, C, HV, K]`` tensor for the backward, so a training
    call's memory grows like its inputs. Log-decays > 0 or NaN: see the module docstring.
    """
    g, poisoned = _poison_bad_decays(g, chunk_size)
    kk_all, qk_all = _PairProducts.apply(q, k, g, chunk_size)
    outs = []
    for n, (s, e) in enumerate(_chunk_spans(q.shape[0], chunk_size)):
        if entering is not None:
            entering.append(S)
        qc, kc, vc, bc, gc = q[s:e], k[s:e], v[s:e], beta[s:e], g[s:e]
        C = e - s
        kk, qk = kk_all[n, :, :C, :C], qk_all[n, :, :C, :C]
        c = gc.cumsum(0)                                           # [C, HV, K]
        strict = torch.ones(C, C, dtype=torch.bool, device=q.device).tril(-1)
        A = kk * bc.transpose(0, 1)[:, :, None] * strict
        eye = torch.eye(C, dtype=q.dtype, device=q.device).expand_as(A)
        M = torch.linalg.solve_triangular(eye + A, eye, upper=False, unitriangular=True)
        bk = (kc * c.exp()) * bc[..., None]                        # [C, HV, K]
        W = torch.einsum('hij,jhd->ihd', M, bk)
        U = torch.einsum('hij,jhd->ihd', M, vc * bc[..., None])
        dV = U - torch.einsum('ihk,hkv->ihv', W, S)
        o = torch.einsum('ihk,hkv->ihv', qc * c.exp(), S) + torch.einsum('hij,jhv->ihv', qk, dV)
        outs.append(o)
        kbar = kc * _suffix_log_decays(gc).exp()
        S = S * c[-1].exp()[..., None] + torch.einsum('ihk,ihv->hkv', kbar, dV)
    o = torch.cat(outs, 0) if outs else q.new_zeros(0, v.shape[1], v.shape[2])
    # Explicit, so that the policy does not rest on 0 * NaN = NaN inside the matrix products.
    return torch.where(poisoned[..., None], torch.nan, o), S


def chunk_kda_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    state_v_first: bool = False,
    chunk_size: int = 64,
    return_intermediate_states: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None] | tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The chunkwise WY/UT algorithm (see ``_chunk_sequence``) in PyTorch; same contract as
    ``naive_recurrent_kda``. It is the specification that the chunk kernels implement.

    With ``return_intermediate_states`` it returns ``(o, final_state, h)`` as ``chunk_kda`` does:
    ``h`` holds the state entering every chunk, ``[B, NT, HV, K, V]`` (``[1, total chunks, HV, K,
    V]`` with ``cu_seqlens``, an empty sequence having none; ``[..., V, K]`` with
    ``state_v_first``), in the final state's dtype."""
    entering: list[torch.Tensor] | None = [] if return_intermediate_states else None
    o, ht = _run(lambda *a: _chunk_sequence(*a, chunk_size, entering), q, k, v, g, beta, scale,
                 initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens, state_v_first)
    if not return_intermediate_states:
        return o, ht
    B, T, _, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    # [B, NT] chunks, or all sequences' chunks in one row with cu_seqlens.
    rows, NT = (1, len(entering)) if cu_seqlens is not None else (B, -(-T // chunk_size))
    h = torch.stack(entering, 0) if entering else q.new_zeros(0, HV, K, V, dtype=_compute_dtype(q))
    h = h.reshape(rows, NT, HV, K, V)
    if state_v_first:
        h = h.transpose(-1, -2)
    return o, ht, h.to(_compute_dtype(q)).contiguous()


# ----------------------------------------------------------------------------- state pools

def _slot_rows(slots: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(live, in_pool)`` of a slot tensor: padding (< 0) is not live; a live slot >= P is not in
    the pool."""
    return slots >= 0, (slots >= 0) & (slots < num_slots)


def _token_sequence(B: int, T: int, cu_seqlens: torch.Tensor | None, device) -> torch.Tensor:
    """The sequence of every token row of the ``[B, T]`` batch, ``[B, T]``."""
    if cu_seqlens is None:
        return torch.arange(B, device=device)[:, None].expand(B, T)
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    return torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths)[None]


def pooled_kda(fn, q, k, v, g, beta, scale, pool, slots, has_initial_state=None,
               use_qk_l2norm_in_kernel=False, cu_seqlens=None, state_v_first=False, **kw):
    """``fn`` (``naive_recurrent_kda`` or ``chunk_kda_reference``) with its states in slots of
    ``pool``: sequence n starts from ``pool[slots[n]]`` (zeros where ``has_initial_state[n]`` is
    False) and its final state is written back there, rounded once to the pool's dtype. A negative
    slot is padding (zero outputs, the pool untouched), a slot >= P gives NaN outputs and touches
    nothing. Returns the outputs and ``fn``'s results after the final state (``h``, if asked for);
    the pool is updated in place (docs/API.md, "State pools")."""
    live, ok = _slot_rows(slots.long(), pool.shape[0])
    safe = torch.where(ok, slots.long(), 0)
    h0 = pool[safe].to(_compute_dtype(q))
    start = ok if has_initial_state is None else ok & has_initial_state
    h0 = torch.where(start[:, None, None, None], h0, 0)
    o, ht, *rest = fn(q, k, v, g, beta, scale, h0, True, use_qk_l2norm_in_kernel, cu_seqlens, state_v_first, **kw)
    seq = _token_sequence(q.shape[0], q.shape[1], cu_seqlens, q.device)
    o = torch.where(ok[seq][..., None, None], o, torch.where(live[seq][..., None, None], torch.nan, 0.)).to(o.dtype)
    pool[slots.long()[ok]] = ht[ok].to(pool.dtype)
    return (o, *rest)


def speculative_recurrent_kda(q, k, v, g, beta, scale, pool, slots, num_accepted,
                              use_qk_l2norm_in_kernel=False, cu_seqlens=None, state_v_first=False):
    """Speculative decoding on ``naive_recurrent_kda``, token by token: sequence n starts from
    ``pool[slots[n, num_accepted[n] - 1]]`` and the state after its token t is written to
    ``pool[slots[n, t]]`` (rounded to the pool's dtype). Padding and slots outside the pool as in
    ``pooled_kda``, per slot read or written (a write slot >= P also makes that token's output
    NaN); an accepted count outside [1, T_idx] reads as a slot outside the pool. Returns the
    outputs; the pool is updated in place."""
    P, columns = pool.shape[0], slots.shape[1]
    o = torch.zeros_like(v)
    table, accepted = slots.tolist(), num_accepted.tolist()
    for n, (b, bos, eos) in enumerate(_sequence_bounds(q.shape[0], q.shape[1], cu_seqlens)):
        row = table[n]
        read = row[accepted[n] - 1] if 1 <= accepted[n] <= columns else P
        if read < 0:
            continue
        if read >= P:
            o[b, bos:eos] = torch.nan
            continue
        S = pool[read:read + 1].to(_compute_dtype(q))
        for t in range(bos, eos):
            step = [x[b:b + 1, t:t + 1] for x in (q, k, v, g, beta)]
            o_t, S = naive_recurrent_kda(*step, scale, S, True, use_qk_l2norm_in_kernel, None, state_v_first)
            write = row[t - bos] if t - bos < columns else -1
            if write >= P:
                o_t = torch.full_like(o_t, torch.nan)
            elif write >= 0:
                pool[write] = S[0].to(pool.dtype)
            o[b, t] = o_t[0, 0]
    return o
