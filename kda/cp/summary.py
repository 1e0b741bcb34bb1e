"""The affine summary of a segment of a sequence, and the composition of summaries.

Per value head, KDA's step ``S_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T``
is affine in the state, and linear in ``(S, v)`` jointly. A segment of tokens therefore maps the
state entering it to the state leaving it as

    S_out = M S_in + E,      M: [K, K] (the segment's transition), E: [K, V] (its offset),

where ``E`` is the segment's final state from ``S_in`` = 0 (or from a given initial state), and
``M`` is the final state of the same segment run with ``S_in = I`` (K x K) and ``v = 0`` (K value
columns): with v = 0 each value column of the state evolves as ``s -> M s``, so the K columns of
the identity come out as the K columns of M. Both are computed by ``chunk_kda`` itself.

Composition is again affine: the summary of ``A`` then ``B`` is ``(M_B M_A, M_B E_A + E_B)``, so a
chain of segments folds left to right (``merge_states``). The gradient runs the same fold backward
with transposed transitions: ``dS_in = M^T dS_out + (local part)``.
"""
from __future__ import annotations

from typing import NamedTuple

import torch


class SegmentSummary(NamedTuple):
    """``S_out = transition @ S_in + offset`` per sequence and value head (float32).

    ``transition``: ``[N, HV, K, K]``; ``offset``: ``[N, HV, K, V]``."""
    transition: torch.Tensor
    offset: torch.Tensor


def identity_states(n: int, HV: int, K: int, device: torch.device) -> torch.Tensor:
    """``n`` stacks of ``HV`` K x K identities: the initial state that makes ``chunk_kda`` with
    ``v = 0`` return transitions."""
    return torch.eye(K, dtype=torch.float32, device=device).expand(n, HV, K, K).contiguous()


def local_summary(k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  initial_state: torch.Tensor | None = None, *,
                  use_qk_l2norm_in_kernel: bool = False, use_gate_in_kernel: bool = False,
                  A_log: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
                  safe_gate: bool = False, lower_bound: float | None = None,
                  use_beta_sigmoid_in_kernel: bool = False, allow_neg_eigval: bool = False,
                  cu_seqlens: torch.Tensor | None = None, cu_seqlens_cpu: torch.Tensor | None = None,
                  chunk_size: int = 64) -> SegmentSummary:
    """The summary ``(M, E)`` of every sequence of a batch, for callers with their own communication.

    Arguments as ``chunk_kda``'s (q is not needed: a state does not depend on it): k
    ``[B, T, H, K]``, v ``[B, T, HV, V]``, g ``[B, T, HV, K]``, beta ``[B, T, HV]``, optional
    ``initial_state`` ``[N, HV, K, V]`` folded into the offset (``E`` is then the final state from it).
    Returns ``SegmentSummary`` with ``transition`` ``[N, HV, K, K]`` and ``offset`` ``[N, HV, K, V]``,
    float32, differentiable in k, v, g, beta, the initial state (and A_log, dt_bias). Two
    ``chunk_kda`` forwards: one of value width K for M, one of width V for E.
    """
    from kda.ops.chunk import chunk_kda
    options = {'use_qk_l2norm_in_kernel': use_qk_l2norm_in_kernel, 'use_gate_in_kernel': use_gate_in_kernel,
               'A_log': A_log, 'dt_bias': dt_bias, 'safe_gate': safe_gate, 'lower_bound': lower_bound,
               'use_beta_sigmoid_in_kernel': use_beta_sigmoid_in_kernel, 'allow_neg_eigval': allow_neg_eigval,
               'cu_seqlens': cu_seqlens, 'cu_seqlens_cpu': cu_seqlens_cpu, 'chunk_size': chunk_size}
    _, offset = chunk_kda(k, k, v, g, beta, initial_state=initial_state, output_final_state=True, **options)
    HV, K = g.shape[2], g.shape[3]
    zeros = k.new_zeros(*v.shape[:3], K)
    _, transition = chunk_kda(k, k, zeros, g, beta, initial_state=identity_states(offset.shape[0], HV, K, k.device),
                              output_final_state=True, **options)
    return SegmentSummary(transition, offset)


def merge_states(transitions: torch.Tensor, offsets: torch.Tensor,
                 initial_state: torch.Tensor | None = None) -> torch.Tensor:
    """The state leaving a chain of segments, in float32 (float64 for float64 summaries).

    ``transitions`` ``[R, ..., K, K]`` and ``offsets`` ``[R, ..., K, V]`` summarize R consecutive
    segments in order; ``initial_state`` ``[..., K, V]`` enters the first (zeros when None). Returns
    ``M_R (... (M_1 S_0 + E_1) ...) + E_R``. The same fold serves the backward: with transitions
    ``M_j^T`` in reverse order and the gradients reaching each segment's entering state as offsets,
    it returns the gradient of the state entering the chain. Differentiable by autograd.
    """
    for name, x in (('transitions', transitions), ('offsets', offsets)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if transitions.dim() < 3 or transitions.shape[-1] != transitions.shape[-2]:
        raise ValueError(f"transitions must be [R, ..., K, K], got {list(transitions.shape)}")
    if offsets.shape[:-1] != transitions.shape[:-1]:
        raise ValueError(f"offsets must be [R, ..., K, V] = {list(transitions.shape[:-1])} + [V], "
                         f"got {list(offsets.shape)}")
    if initial_state is not None and initial_state.shape != offsets.shape[1:]:
        raise ValueError(f"initial_state must be [..., K, V] = {list(offsets.shape[1:])}, "
                         f"got {list(initial_state.shape)}")
    dtype = torch.promote_types(torch.promote_types(transitions.dtype, offsets.dtype), torch.float32)
    state = offsets.new_zeros(offsets.shape[1:], dtype=dtype) if initial_state is None \
        else initial_state.to(dtype)
    for M, E in zip(transitions.to(dtype), offsets.to(dtype)):
        state = M @ state + E
    return state
