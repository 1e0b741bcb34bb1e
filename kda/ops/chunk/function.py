"""The autograd Function of ``chunk_kda`` in training: the forward (``forward.chunk_kda_fwd``)
keeps the inputs and the in-chunk matrices Aqk, A' and M (``[B, T, HV, BT]`` each; nothing
``[.., K]``- or state-sized is kept between forward and backward unless
``disable_recompute=True``), and the backward (``backward.chunk_kda_bwd``) recomputes the rest.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from kda.ops.chunk.backward import (
    ChunkGradients,
    ForwardIntermediates,
    chunk_kda_bwd,
    chunk_kda_recompute,
)
from kda.ops.chunk.forward import chunk_kda_fwd
from kda.ops.chunk.intra import InChunkMatrices, in_chunk_tensors
from kda.ops.chunk.layout import ChunkLayout
from kda.ops.gate import KernelGate
from kda.ops.l2norm import l2norm_bwd, l2norm_fwd


class SavedForBackward(NamedTuple):
    """What the training forward keeps for the backward: q and k as the backward reads them
    (``qn``, ``kn``: normalized, with their inverse norms ``rq``, ``rk``, under ``qk_l2norm``;
    else the inputs and None), the in-chunk matrices, and with ``disable_recompute`` the
    backward's in-chunk recompute and state carry (``intermediates``; else None)."""
    qn: torch.Tensor
    kn: torch.Tensor
    rq: torch.Tensor | None
    rk: torch.Tensor | None
    matrices: InChunkMatrices
    intermediates: ForwardIntermediates | None


class TrainingForward(NamedTuple):
    o: torch.Tensor
    final_state: torch.Tensor | None
    saved: SavedForBackward


def training_forward(q, k, v, g, beta, A_log, dt_bias, scale, initial_state, output_final_state,
                     state_v_first, cu_seqlens, layout: ChunkLayout, qk_l2norm: bool,
                     gate_kind: str | None, lower_bound: float, disable_recompute: bool,
                     zero_unwritten: bool = False) -> TrainingForward:
    """The forward of ``ChunkKDAFunction`` (and of the ``kda::chunk_fwd_train`` op): outputs,
    final state and what the backward reads. ``beta`` is the float32 activated beta;
    ``zero_unwritten`` as in ``chunk_kda_fwd``."""
    rq = rk = None
    qn, kn = q, k
    if qk_l2norm:
        (qn, rq), (kn, rk) = l2norm_fwd(q, k)
    gate = None if gate_kind is None else KernelGate(gate_kind, A_log, dt_bias, lower_bound)
    out = chunk_kda_fwd(qn, kn, v, g, beta, scale, initial_state, output_final_state,
                        state_v_first, cu_seqlens, layout, gate, unit_keys=qk_l2norm,
                        zero_unwritten=zero_unwritten)
    o, final_state, intra = out.o, out.final_state, out.intra
    out = None
    # Kept either way: the in-chunk matrices, [B, T, HV, BT] each (at BT = 64, K = V = 128,
    # bf16 with g in float32: half the bytes of q, k, v and g), which spare the backward's
    # recompute the pair products and the solve (docs/tuning.md, "Memory").
    matrices = intra.matrices
    # disable_recompute: the backward's in-chunk recompute and state carry run here instead
    # (the forward's own sweep keeps neither states nor corrections). The in-chunk per-token
    # tensors are formed again as the backward forms them: the forward's c comes from the
    # cumsum kernel's other build (DECAYED=False), whose scan runs in another thread layout
    # and may round differently, so only this keeps the gradients the same bits either way.
    intermediates = None
    if disable_recompute:
        intra = in_chunk_tensors(qn, kn, g, beta, scale, layout, gate, v.shape[2], matrices, out=intra)
        intermediates = chunk_kda_recompute(qn, kn, v, beta, initial_state, state_v_first, cu_seqlens,
                                            layout, intra)
    return TrainingForward(o, final_state, SavedForBackward(qn, kn, rq, rk, matrices, intermediates))


def training_backward(saved: SavedForBackward, v, g, beta, A_log, dt_bias, scale, initial_state,
                      state_v_first, cu_seqlens, layout: ChunkLayout, qk_l2norm: bool,
                      gate_kind: str | None, lower_bound: float, do, dht) -> ChunkGradients:
    """The backward of ``training_forward``: gradients in the inputs' dtypes (q, k, v, g), float32
    (beta, the initial state, A_log, dt_bias). ``saved`` is handed over, not kept:
    ``chunk_kda_bwd`` frees what its later stages do not read."""
    gate = None if gate_kind is None else KernelGate(gate_kind, A_log, dt_bias, lower_bound)
    qn, kn, rq, rk = saved.qn, saved.kn, saved.rq, saved.rk
    grads = chunk_kda_bwd(
        qn, kn, v, g, beta, scale, initial_state, state_v_first, cu_seqlens, layout,
        do.contiguous(), None if dht is None else dht.contiguous(), saved.intermediates, gate,
        saved.matrices)
    saved = None
    if qk_l2norm:
        # Replaced, not kept beside: the normalized inputs' float32 gradients are freed here.
        dq, dk = l2norm_bwd(qn, rq, grads.dq, kn, rk, grads.dk)
        grads = grads._replace(dq=dq, dk=dk)
    return grads._replace(dq=grads.dq.to(qn.dtype), dk=grads.dk.to(kn.dtype))


class ChunkKDAFunction(torch.autograd.Function):
    """Differentiable in q, k, v, g, beta and the initial state (and, with the in-kernel gate,
    ``gate_kind`` not None, in the raw g, A_log and dt_bias); the final state's gradient flows
    back through every chunk. With ``qk_l2norm`` q and k are normalized here, and the normalized
    q and k are kept with their inverse norms in place of q and k (as many bytes; where the
    caller also keeps q and k alive, two more [B, T, H, K] tensors until the backward): the
    backward reads them as they are and forms the raw inputs' gradients from them
    (``l2norm_bwd``), where keeping the raw q and k cost it two more normalization passes. The
    gate is activated inside the first kernel, forward and recompute, so nothing of it is
    kept."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, A_log, dt_bias, scale, initial_state, output_final_state,
                state_v_first, cu_seqlens, layout, qk_l2norm, gate_kind, lower_bound,
                disable_recompute):
        o, final_state, saved = training_forward(
            q, k, v, g, beta, A_log, dt_bias, scale, initial_state, output_final_state, state_v_first,
            cu_seqlens, layout, qk_l2norm, gate_kind, lower_bound, disable_recompute)
        ctx.save_for_backward(saved.qn, saved.kn, saved.rq, saved.rk, v, g, beta, A_log, dt_bias,
                              initial_state, cu_seqlens, *saved.matrices)
        ctx.saved_intermediates = saved.intermediates
        saved = None
        ctx.scale, ctx.state_v_first, ctx.layout = scale, state_v_first, layout
        ctx.qk_l2norm, ctx.gate_kind, ctx.lower_bound = qk_l2norm, gate_kind, lower_bound
        return o, final_state

    @staticmethod
    def backward(ctx, do, dht):
        qn, kn, rq, rk, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, *matrices = ctx.saved_tensors
        saved = SavedForBackward(qn, kn, rq, rk, InChunkMatrices(*matrices), ctx.saved_intermediates)
        ctx.saved_intermediates = matrices = None
        grads = training_backward(saved, v, g, beta, A_log, dt_bias, ctx.scale, initial_state,
                                  ctx.state_v_first, cu_seqlens, ctx.layout, ctx.qk_l2norm,
                                  ctx.gate_kind, ctx.lower_bound, do, dht)
        # dbeta is float32 like the beta chunk_kda hands this Function; autograd casts it back to
        # the caller's dtype through that copy.
        return (grads.dq, grads.dk, grads.dv, grads.dg, grads.dbeta, grads.dA_log, grads.ddt_bias,
                None, grads.dh0, None, None, None, None, None, None, None, None)
