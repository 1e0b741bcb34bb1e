"""The chunk backward. With the forward's per chunk (``forward``: ``U = M diag(beta) (V - Kg S)``,
``O = Qt S + Aqk U``, ``S' = exp(c_last) S + Kbar^T U``):

1. the in-chunk tensors again (``intra``; the forward's Aqk, A' and M are kept, only the cumsum
   runs) and the state carry, which stores every chunk's incoming state ``h`` and corrections
   ``v_new = U`` (``kernels/chunk_state.py``) -- or both handed over from the forward
   (``disable_recompute``);
2. the state-gradient sweep from the last chunk to the first (``kernels/chunk_state_bwd.py``):

       dh_c = dS,   dU = Aqk^T dO + Kbar dS,
       dS  <- exp(c_last) dS + Qt^T dO - Kg^T diag(beta) M^T dU

   the last ``dS`` being the initial state's gradient;
3. the per-chunk gradients (``kernels/chunk_intra_bwd.py``): dq, dk, dv, dbeta and the
   in-chunk matrices' gradients, then those of the pair products (through ``exp(c_i - c_j)``
   into dq, dk and dc), then ``dg`` as the reverse cumulative sum of ``dc`` (with the in-kernel
   gate, through its activation, and the A_log / dt_bias sums).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from kda.kernels.chunk_intra_bwd import (
    chunk_gate_bwd_kernel,
    chunk_intra_bwd_kernel,
    chunk_pair_bwd_kernel,
    gate_param_grad_kernel,
)
from kda.kernels.chunk_state import chunk_state_fwd_kernel
from kda.kernels.chunk_state_bwd import chunk_state_bwd_kernel
from kda.ops.chunk.intra import InChunkMatrices, InChunkTensors, in_chunk_tensors
from kda.ops.chunk.launch import (
    BC,
    gate_launch_args,
    head_dims,
    launch_config,
    state_launch_config,
    sweep_grid,
    transposed_sweeps,
)
from kda.ops.chunk.layout import ChunkLayout
from kda.ops.gate import KernelGate, bounded_decay
from kda.ops.utils import cdiv, fork, join, state_strides


@dataclass
class ForwardIntermediates:
    """What the backward reads of the forward: the in-chunk tensors ``intra``, and the state
    carry's every chunk's incoming state ``h`` (``[total chunks, HV, K, V]``) and corrections
    ``v_new`` (``[B, T, HV, V]``), both in the input dtype."""
    intra: InChunkTensors
    h: torch.Tensor
    v_new: torch.Tensor


class ChunkGradients(NamedTuple):
    """``chunk_kda_bwd``'s result, in float32 but ``dv`` (v's dtype) and ``dg`` (g's dtype):
    ``dq``, ``dk`` summed over GVA groups; ``dg`` of the raw gate with the in-kernel gate;
    ``dh0`` None without an initial state; ``dA_log``, ``ddt_bias`` None without the in-kernel
    gate's parameter."""
    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    dg: torch.Tensor
    dbeta: torch.Tensor
    dh0: torch.Tensor | None
    dA_log: torch.Tensor | None
    ddt_bias: torch.Tensor | None


def chunk_kda_recompute(q, k, v, beta, initial_state, state_v_first, cu_seqlens, layout: ChunkLayout,
                        intra: InChunkTensors, side: torch.cuda.Stream | None = None
                        ) -> ForwardIntermediates:
    """The state carry on the in-chunk tensors ``intra`` (``kernels/chunk_state.py``): every
    chunk's incoming state and corrections. The carry is launched on ``side`` when given
    (``chunk_kda_bwd``); its outputs are allocated on the current stream, which frees them, so
    their memory stays in the current stream's pool."""
    B, T, _, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    dev, dt = q.device, q.dtype
    blocks = state_launch_config('state_fwd', K, V, N * HV, dev, dt, cu_seqlens is not None)
    # In the input dtype: every later product rounds them to it anyway.
    h = torch.empty(layout.total, HV, K, V, dtype=dt, device=dev)
    v_new = torch.empty(B, T, HV, V, dtype=dt, device=dev)
    with torch.cuda.stream(side):
        chunk_state_fwd_kernel[sweep_grid(N, HV, V, blocks)](
            intra.kg, intra.kbar, v, beta, intra.gc, intra.Minv, h, v_new, initial_state, cu_seqlens,
            layout.offsets, layout.order, T, layout.NT, *state_strides(K, V, state_v_first),
            USE_INITIAL_STATE=initial_state is not None,
            TRANSPOSED=transposed_sweeps(N, HV, K, V, dev, dt), **blocks,
            **head_dims(q, v, layout, cu_seqlens))
    return ForwardIntermediates(intra, h, v_new)


def chunk_kda_bwd(q, k, v, g, beta, scale, initial_state, state_v_first, cu_seqlens,
                  layout: ChunkLayout, do, dht, saved: ForwardIntermediates | None = None,
                  gate: KernelGate | None = None, matrices: InChunkMatrices | None = None
                  ) -> ChunkGradients:
    """Gradients of ``chunk_kda_fwd``: recomputes the in-chunk tensors and the state carry
    (unless ``saved`` holds them; from the forward's ``matrices`` when given), sweeps the state
    gradient backwards, then forms every per-token gradient chunk by chunk. At the peak, held in
    float32 only what later passes still add to."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    BT = layout.BT
    dev = q.device
    common = head_dims(q, v, layout, cu_seqlens)
    transposed = transposed_sweeps(N, HV, K, V, dev, q.dtype)
    side = None
    try:
        if saved is None:
            intra = in_chunk_tensors(q, k, g, beta, scale, layout, gate, HV, matrices)
            # The carry and the gradient sweep below read only the in-chunk tensors. With few
            # programs each leaves SMs idle for much of its time: the carry runs on a side stream
            # beside the gradient sweep (docs/tuning.md, "Transposed sweeps").
            side = fork(dev) if transposed else None
            saved = chunk_kda_recompute(q, k, v, beta, initial_state, state_v_first, cu_seqlens,
                                        layout, intra, side)
            intra = None
        h, v_new = saved.h, saved.v_new
        gc, Aqk, Akk, Minv = saved.intra.gc, saved.intra.Aqk, saved.intra.Akk, saved.intra.Minv
        kg, kbar, qt = saved.intra.kg, saved.intra.kbar, saved.intra.qt
        saved = None
        blocks = state_launch_config('state_bwd', K, V, N * HV, dev, q.dtype, cu_seqlens is not None)
        dh = torch.empty_like(h)
        # Read only as a matrix-product operand (rounded to the input dtype there): kept in that dtype.
        dv_new = torch.empty(B, T, HV, V, dtype=q.dtype, device=dev)
        dh0 = torch.empty_like(initial_state) if initial_state is not None else None
        chunk_state_bwd_kernel[sweep_grid(N, HV, V, blocks)](
            qt, kbar, kg, beta, gc, Aqk, Minv, do, dh, dv_new, dht, dh0, cu_seqlens, layout.offsets,
            layout.order, T, layout.NT,
            *state_strides(K, V, state_v_first),
            USE_FINAL_STATE_GRADIENT=dht is not None, STORE_INITIAL_STATE_GRADIENT=dh0 is not None,
            TRANSPOSED=transposed, **blocks, **common)
    finally:
        # Also when the above raises: the carry still reads the in-chunk tensors, which the
        # current stream must not free (and a graph capture must not stay forked) before it has
        # waited.
        join(side)
    # Read by no later kernel: freed before the per-token gradients are allocated (the peak).
    del kbar, qt, kg

    dq = torch.empty(B, T, HV, K, dtype=torch.float32, device=dev)
    dk = torch.empty(B, T, HV, K, dtype=torch.float32, device=dev)
    dg = torch.empty(B, T, HV, K, dtype=torch.float32, device=dev)
    dv = torch.empty(B, T, HV, V, dtype=v.dtype, device=dev)          # final: no later pass adds to it
    dbeta = torch.empty(B, T, HV, dtype=torch.float32, device=dev)
    # Scratch for the pair-matrix gradients, float32: the diagonal sub-blocks use them in float32.
    dAqk = torch.empty(Aqk.shape, dtype=torch.float32, device=dev)
    dAkk = torch.empty_like(Akk)
    chunk_intra_bwd_kernel[(layout.total, HV)](
        q, k, v, beta, gc, Akk, Minv, h, v_new, do, dh, dv_new,
        dq, dk, dv, dbeta, dg, dAqk, dAkk, layout.rows, scale, T, layout.NT,
        **launch_config('intra_bwd', K, V), **common)
    bounded = bounded_decay(gate)
    cfg = launch_config('pair_bwd_bounded' if bounded else 'pair_bwd', K, V)
    chunk_pair_bwd_kernel[(layout.total * (BT // BC), HV * cdiv(K, cfg['BK']))](
        q, k, gc, dAqk, dAkk, dq, dk, dg, layout.rows, T, layout.NT,
        H=H, HV=HV, K=K, BT=BT, BC=BC, DOT_DTYPE=common['DOT_DTYPE'], IS_VARLEN=common['IS_VARLEN'],
        BOUNDED_DECAY=bounded, **cfg)
    # Read by no later kernel: freed before the gate kernel allocates (a bf16 raw gate's dg is a
    # new tensor beside dc; docs/tuning.md, "Memory").
    del dAqk, dAkk, gc, h, dh, v_new, dv_new
    cfg = launch_config('gate_bwd' if gate is None else 'gate_bwd_raw', K, V)
    NK = cdiv(K, cfg['BK'])
    # Per-chunk sums of the dt_bias gradient (tokens of a chunk summed in the kernel) and of the
    # A_log gradient (tokens and a key slice).
    da = dbias = None
    if gate is not None:
        dbias = torch.empty(layout.total, HV, K, dtype=torch.float32, device=dev)
        da = torch.empty(layout.total, HV, NK, dtype=torch.float32, device=dev)
    # dg in g's dtype straight from the kernel (a bf16 raw gate: no float32 -> bf16 pass after
    # it); in place when g is float32.
    dc, dg = dg, (dg if g.dtype == torch.float32 else torch.empty_like(g))
    chunk_gate_bwd_kernel[(layout.total, HV * NK)](
        g, dc=dc, dg=dg, da=da, dbias=dbias, chunk_rows=layout.rows,
        T=T, NT=layout.NT, HV=HV, K=K, BT=BT, IS_VARLEN=common['IS_VARLEN'],
        **gate_launch_args(gate), **cfg)
    dA_log = ddt_bias = None
    if gate is not None and (gate.A_log is not None or gate.dt_bias is not None):
        if gate.A_log is not None:
            dA_log = torch.empty(HV, dtype=torch.float32, device=dev)
        if gate.dt_bias is not None:
            ddt_bias = torch.empty(HV * K, dtype=torch.float32, device=dev)
        cfg = launch_config('gate_params', K, V)
        gate_param_grad_kernel[(HV, cdiv(K, cfg['BK']))](da, dbias, dA_log, ddt_bias, layout.total, HV=HV,
                                                         K=K, NK=NK, **cfg)
    if HV != H:
        dq = dq.view(B, T, H, HV // H, K).sum(3)
        dk = dk.view(B, T, H, HV // H, K).sum(3)
    return ChunkGradients(dq, dk, dv, dg, dbeta, dh0, dA_log, ddt_bias)
