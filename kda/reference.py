"""Pure-PyTorch KDA: the naive recurrence (the oracle) and the chunked WY/UT algebra.

Both follow the contract of ``docs/API.md``. Per value head and sequence, with column vectors and a
key-by-value state ``S`` of shape ``[K, V]``::

    S_t = Diag(exp(g_t)) S_{t-1}
    S_t = S_t + beta_t k_t (v_t - S_t^T k_t)^T
    o_t = S_t^T (scale * q_t)

Given float64 inputs everything is computed in float64; otherwise in float32. These functions are
differentiable by autograd and are what every kernel is tested against.
"""
from __future__ import annotations

import torch


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


def _recurrent_sequence(q, k, v, g, beta, S):
    """Token-by-token recurrence for one sequence; shapes as in ``_chunk_sequence``."""
    outs = []
    for t in range(q.shape[0]):
        S = S * g[t].exp()[..., None]
        pred = torch.einsum('hkv,hk->hv', S, k[t])
        S = S + torch.einsum('hk,hv->hkv', k[t], beta[t][:, None] * (v[t] - pred))
        outs.append(torch.einsum('hkv,hk->hv', S, q[t]))
    o = torch.stack(outs, 0) if outs else q.new_zeros(0, v.shape[1], v.shape[2])
    return o, S


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
    beta ``[B, T, HV]``; states ``[N, HV, K, V]`` (``[N, HV, V, K]`` with ``state_v_first``).
    Returns ``(o, final_state)``; ``o`` has q's dtype, the final state is float32 (both float64
    for float64 inputs).
    """
    return _run(_recurrent_sequence, q, k, v, g, beta, scale, initial_state, output_final_state,
                use_qk_l2norm_in_kernel, cu_seqlens, state_v_first)


def _chunk_sequence(q, k, v, g, beta, S, chunk_size, entering=None):
    """The WY/UT chunk algebra for one sequence, all value heads at once (the state entering each
    chunk appended to ``entering`` when given).

    q, k, g: ``[T, HV, K]``, v: ``[T, HV, V]``, beta: ``[T, HV]``, S: ``[HV, K, V]``. For a chunk with
    in-chunk cumulative log-decay ``c_i = g_1 + ... + g_i`` and incoming state ``S``:

        A[i, j]   = beta_i sum_d k_id k_jd exp(c_id - c_jd)      (j < i)
        Aqk[i, j] = sum_d q_id k_jd exp(c_id - c_jd)             (j <= i)
        M  = (I + A)^-1                                          (unit lower triangular)
        W  = M diag(beta) (k * exp(c)),   U = M diag(beta) v
        dV = U - W S                                             (the delta-rule corrections)
        O  = (q * exp(c)) S + Aqk dV
        S' = Diag(exp(c_last)) S + (k * exp(c_last - c))^T dV

    Every exponent above is <= 0, so arbitrarily strong decay stays finite.
    """
    T = q.shape[0]
    outs = []
    for s in range(0, T, chunk_size):
        e = min(s + chunk_size, T)
        if entering is not None:
            entering.append(S)
        qc, kc, vc, bc = q[s:e], k[s:e], v[s:e], beta[s:e]
        c = g[s:e].cumsum(0)                                       # [C, HV, K]
        C = e - s
        diff = c[:, None] - c[None, :]                             # [i, j, HV, K]
        lower = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
        diff = torch.where(lower[:, :, None, None], diff, torch.full_like(diff, -torch.inf))
        decay = diff.exp()
        kk = torch.einsum('ihd,jhd,ijhd->hij', kc, kc, decay)
        qk = torch.einsum('ihd,jhd,ijhd->hij', qc, kc, decay)
        strict = lower & ~torch.eye(C, dtype=torch.bool, device=q.device)
        A = (kk * bc.transpose(0, 1)[:, :, None]) * strict
        eye = torch.eye(C, dtype=q.dtype, device=q.device).expand_as(A)
        M = torch.linalg.solve_triangular(eye + A, eye, upper=False, unitriangular=True)
        bk = (kc * c.exp()) * bc[..., None]                        # [C, HV, K]
        W = torch.einsum('hij,jhd->ihd', M, bk)
        U = torch.einsum('hij,jhd->ihd', M, vc * bc[..., None])
        dV = U - torch.einsum('ihk,hkv->ihv', W, S)
        o = torch.einsum('ihk,hkv->ihv', qc * c.exp(), S) + torch.einsum('hij,jhv->ihv', qk, dV)
        outs.append(o)
        last = c[-1]                                               # [HV, K]
        kbar = kc * (last[None] - c).exp()
        S = S * last.exp()[..., None] + torch.einsum('ihk,ihv->hkv', kbar, dV)
    return (torch.cat(outs, 0) if outs else q.new_zeros(0, v.shape[1], v.shape[2])), S


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
