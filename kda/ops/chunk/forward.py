"""The chunk forward: the in-chunk stage (``intra``), then one sweep over the chunks that carries
the state and forms the outputs (``kernels/chunk_state_output.py``). Per chunk, with ``S`` the
state entering it (``[K, V]``), ``Kg`` / ``Kbar`` / ``Qt`` the decayed keys and queries and ``M``,
``Aqk`` the in-chunk matrices (``intra``):

    U = M diag(beta) (V - Kg S)              the chunk's corrected values
    O = Qt S + Aqk U
    S <- exp(c_last) * S + Kbar^T U          (exp(c_last) scales the rows of S, one per key)

M is applied inside the sweep; the WY form's W = M diag(beta) Kg and U are never stored. For one
long sequence whose sweep leaves SMs room, both run in time segments (``schedule``).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from kda.kernels.chunk_state_output import chunk_state_output_fwd_kernel
from kda.ops.chunk.intra import (
    InChunkTensors,
    cumulative_decay,
    in_chunk_buffers,
    pair_products_and_solve,
)
from kda.ops.chunk.launch import head_dims, state_launch_config, sweep_grid
from kda.ops.chunk import tuning
from kda.ops.chunk.layout import ChunkLayout, chunk_layout
from kda.ops.chunk.prep import fused_in_chunk_stage
from kda.ops.chunk.schedule import SEGMENT_MIN_TOKEN_HEADS, busy_sweep, forward_segments
from kda.ops.gate import KernelGate, bounded_decay
from kda.ops.utils import fork, join, state_strides


class StateSlots(NamedTuple):
    """Pool prefill (docs/API.md, "State pools"): sequence n's state is slot ``indices[n]`` (int32
    or int64 ``[N]``) of the pool passed as the initial state, read unless ``has_initial[n]``
    (bool ``[N]``, or None: every slot is read) is False, and its final state is written back
    there. The sweep reads and writes the pool itself: no gathered copy, no scatter."""
    indices: torch.Tensor
    has_initial: torch.Tensor | None


class ForwardOutputs(NamedTuple):
    """``chunk_kda_fwd``'s result: the outputs ``o`` (input dtype), the float32 ``final_state``
    (None unless asked for), the in-chunk tensors ``intra`` and ``h``, the float32 state entering
    every chunk (``[total chunks, HV, K, V]``; None unless ``store_states``)."""
    o: torch.Tensor
    final_state: torch.Tensor | None
    intra: InChunkTensors
    h: torch.Tensor | None


def chunk_kda_fwd(q, k, v, g, beta, scale, initial_state, output_final_state, state_v_first,
                  cu_seqlens, layout: ChunkLayout, gate: KernelGate | None = None,
                  store_states: bool = False, l2norm: bool = False, unit_keys: bool = False,
                  prepare_beta=None, slots: StateSlots | None = None, inplace: bool = False,
                  final_state_dtype: torch.dtype | None = None,
                  zero_unwritten: bool = False) -> ForwardOutputs:
    """The forward: the in-chunk stage, then the fused state sweep and outputs. ``l2norm``
    (inference with ``use_qk_l2norm_in_kernel``): q and k are raw, and the pair products
    normalize the rows they read (``chunk_pair_fwd_kernel``). ``unit_keys``: k's rows are
    l2norm's output (training with ``use_qk_l2norm_in_kernel``). Keys of norm 1 (either way)
    under the lower-bound gate take the pair products' build without the far-entry fallback
    (``ALL_NEAR``, ``diag_slice``). ``prepare_beta`` (inference): ``beta`` is the caller's, and
    ``prepare_beta(out, beta)`` writes the float32 copy the kernels read (``kernel_beta``); it
    runs on the side stream beside the first cumsum, which does not read it, and not at the head
    of the current stream's chain (at SEGMENT_MIN_TOKEN_HEADS and above; docs/tuning.md,
    "beta"). ``slots``: the initial state is a pool, read and written in the slots given
    (``StateSlots``), and returned as the final state. ``inplace``: the final state is written
    into ``initial_state`` and returned. ``final_state_dtype``: a new final state's dtype
    (float32 when None; rounded once, at the store).
    ``zero_unwritten``: the entries no kernel writes, the in-chunk matrices' blocks
    above the diagonal and the padding entries of ``h`` (a device-built map's), are zero rather
    than unspecified, as a ``torch.library`` op's outputs must be (a memset of each, which the
    launchers' direct calls skip: nothing reads those entries).

    Where ``forward_segments`` cuts the sequence, each segment's sweep runs on a side stream,
    starting from the state the previous segment's sweep left in a float32 buffer, while the
    current stream forms the next segment's in-chunk stage: the few-program sweep leaves most of
    every SM to the in-chunk kernels. Where the sweep is busier (``busy_sweep``) the cumsum runs
    for the whole sequence first and each segment forms only its pair products and M. The same
    steps on the same chunks, so the same bits (docs/tuning.md, "Time segments"). Not
    segmented: several sequences (their segments would not be contiguous views; the kernels
    would need a row stride per sequence) and the backward (its carry and gradient sweep would
    need the in-chunk stage's segments in opposite orders), and a pool call (``slots``: the
    segments hand the state over in a ``[N, ...]`` buffer, which the slot-indexed first read and
    last write would each need a build of their own for)."""
    B, T, _, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    dev, dt = q.device, q.dtype
    blocks = state_launch_config('state_output', K, V, N * HV, dev, dt, cu_seqlens is not None)
    o = torch.empty(B, T, HV, V, dtype=dt, device=dev)
    alloc = torch.zeros if zero_unwritten else torch.empty
    h = alloc(layout.total, HV, K, V, dtype=torch.float32, device=dev) if store_states else None
    shape = (N, HV, V, K) if state_v_first else (N, HV, K, V)
    if slots is not None or inplace:
        final_state = initial_state
    elif output_final_state:
        final_state = torch.empty(shape, dtype=final_state_dtype or torch.float32, device=dev)
    else:
        final_state = None
    # The pool's slots (``load_slot_state``); the flags at their defaults keep the other builds as
    # they are.
    pool = dict(state_indices=None, has_initial=None, num_slots=0)
    if slots is not None:
        has_initial = slots.has_initial
        pool = dict(state_indices=slots.indices,
                    has_initial=None if has_initial is None else has_initial.view(torch.uint8),
                    num_slots=initial_state.shape[0], USE_STATE_INDICES=True,
                    USE_HAS_INITIAL=has_initial is not None)
    stride_sk, stride_sv = state_strides(K, V, state_v_first)

    def sweep(intra, part, part_layout, h0, ht):
        Tp = part.stop - part.start
        chunk_state_output_fwd_kernel[sweep_grid(N, HV, V, blocks)](
            intra.qt, intra.kg, intra.kbar, v[:, part], beta[:, part], intra.gc, intra.Aqk, intra.Minv,
            o[:, part], h, h0, ht, cu_seqlens, part_layout.offsets, part_layout.order,
            T=Tp, NT=part_layout.NT, stride_sk=stride_sk, stride_sv=stride_sv,
            USE_INITIAL_STATE=h0 is not None, STORE_FINAL_STATE=ht is not None,
            STORE_STATES=store_states, **blocks, **head_dims(q, v, part_layout, cu_seqlens), **pool)

    all_near = (l2norm or unit_keys) and bounded_decay(gate)
    segments = None if slots is not None else forward_segments(B, T, HV, K, V, layout, cu_seqlens,
                                                                store_states, dev)
    intra = in_chunk_buffers(B, T, HV, K, layout.BT, dev, dt)
    if zero_unwritten:
        for matrix in intra.matrices:
            matrix.zero_()
    side = None
    try:
        if prepare_beta is not None:
            # Allocated on the current stream, which frees it; the join below orders the side
            # stream's write before every kernel that reads it. On the current stream where the
            # host may set the time (SEGMENT_MIN_TOKEN_HEADS): the fork and the join are two more
            # events for it to record.
            beta, raw_beta = torch.empty(beta.shape, dtype=torch.float32, device=dev), beta
            side = fork(dev) if B * T * HV >= SEGMENT_MIN_TOKEN_HEADS else None
            with torch.cuda.stream(side):
                prepare_beta(beta, raw_beta)
        if segments is None:
            if tuning.FUSED_PREP:
                join(side)
                fused_in_chunk_stage(q, k, g, beta, scale, layout, gate, HV, intra, l2norm, all_near)
            else:
                cumulative_decay(q, k, g, scale, layout, gate, HV, intra, decayed=False)
                join(side)
                pair_products_and_solve(q, k, beta, scale, layout, HV, intra, l2norm, all_near=all_near)
            sweep(intra, slice(0, T), layout, initial_state, final_state)
            return ForwardOutputs(o, final_state, intra, h)
        cumsum_first = busy_sweep(HV, K, V, dev) and not tuning.FUSED_PREP
        if cumsum_first:
            # The cumulative decay of every segment first, alone: beside a sweep the raw gate's
            # build slowed most. With few sweep programs the sweeps set the time and must start
            # early: there it costs (docs/tuning.md, "Time segments").
            cumulative_decay(q, k, g, scale, layout, gate, HV, intra, decayed=False)
        carried = torch.empty(shape, dtype=torch.float32, device=dev)
        for i, (t0, t1) in enumerate(segments):
            part = slice(t0, t1)
            part_layout = chunk_layout(B, t1 - t0, layout.BT, None, None)
            intra_part = intra.tokens(part)
            if tuning.FUSED_PREP:
                if i == 0:
                    join(side)
                fused_in_chunk_stage(q[:, part], k[:, part], g[:, part], beta[:, part], scale,
                                     part_layout, gate, HV, intra_part, l2norm, all_near)
            else:
                if not cumsum_first:
                    cumulative_decay(q[:, part], k[:, part], g[:, part], scale, part_layout, gate,
                                     HV, intra_part, decayed=False)
                if i == 0:
                    join(side)
                pair_products_and_solve(q[:, part], k[:, part], beta[:, part], scale, part_layout,
                                        HV, intra_part, l2norm, all_near=all_near)
            side = fork(dev)
            with torch.cuda.stream(side):
                sweep(intra_part, part, part_layout, initial_state if i == 0 else carried,
                      final_state if i == len(segments) - 1 else carried)
    finally:
        # Also on an error: the sweeps read and write tensors the current stream would otherwise
        # free.
        join(side)
    return ForwardOutputs(o, final_state, intra, h)
