"""``chunk_kda``, the public entry: validation, then the PyTorch reference path (CPU without the
interpreter, bf16 in the interpreter), the inference forward (``forward.chunk_kda_fwd``) or the
autograd Function (``function.ChunkKDAFunction``).
"""
from __future__ import annotations

import functools

import torch

from torch.autograd.graph import increment_version

from kda.ops.chunk.forward import StateSlots, chunk_kda_fwd
from kda.ops.chunk.function import ChunkKDAFunction
from kda.ops import library
from kda.ops.chunk.layout import chunk_layout, device_chunk_layout, max_varlen_chunks
from kda.ops.gate import KernelGate, activate_beta, activate_gate, kernel_beta
from kda.ops.utils import INTERPRET, contiguous, on_q_device, use_kernels
from kda.ops.validation import (
    _expect_bool,
    cast_intermediate_states,
    resolve_state_v_first,
    validate_activations,
    validate_chunk_size,
    validate_graph_options,
    validate_inputs,
    validate_pool_prefill,
    validate_states_dtype,
    warn_if_head_first,
)
from kda.reference import chunk_kda_reference, pooled_kda


@on_q_device
def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    *,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    safe_gate: bool = False,
    lower_bound: float | None = None,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    chunk_size: int = 64,
    state_v_first: bool = False,
    disable_recompute: bool = False,
    return_intermediate_states: bool = False,
    intermediate_states_dtype: torch.dtype | None = None,
    transpose_state_layout: bool | None = None,
    cp_context=None,
    use_graph: bool = False,
    max_num_seqs: int | None = None,
    initial_state_indices: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
    inplace_final_state: bool = False,
    final_state_dtype: torch.dtype | None = None,
):
    """KDA by the chunkwise-parallel WY/UT algorithm: training and prefill.

    Same contract as ``fused_recurrent_kda`` (docs/API.md): q, k ``[B, T, H, K]``, v ``[B, T, HV, V]``,
    g ``[B, T, HV, K]`` (log-decay, <= 0), beta ``[B, T, HV]``, float32 states ``[N, HV, K, V]``
    (``[N, HV, V, K]`` with ``state_v_first``). Differentiable in q, k, v, g, beta, the initial
    state (and A_log, dt_bias with the in-kernel gate), including gradients arriving through the
    final state. A log-decay above 0 (outside the contract) or NaN makes the outputs of its chunk
    and of everything after it NaN for that head; it is never clamped into a plausible answer.
    ``cu_seqlens_cpu``, when given, must hold ``cu_seqlens``' values: the chunk map is sized from it
    without reading a device ``cu_seqlens`` back (that would cost a sync), so there a mismatch is
    not detected; a ``cu_seqlens`` on the CPU is read and must agree.

    ``A_log`` may have any shape of HV elements (e.g. ``[1, 1, HV, 1]``) and ``dt_bias`` any of
    ``HV * K``. Without ``use_gate_in_kernel`` they and ``lower_bound`` are ignored with a warning
    (``lower_bound`` silently beside ``safe_gate=True``: the bound g is promised to keep). A q with
    fewer tokens than heads warns (a head-first ``[B, H, T, K]`` passed by mistake?).

    Returns ``(o, final_state)``, or ``(o, final_state, h)`` with ``return_intermediate_states``
    (inference only): ``h`` holds the state entering every chunk, ``[B, NT, HV, K, V]``
    (``[1, total chunks, HV, K, V]`` with ``cu_seqlens``), in q's dtype as FLA returns it, or in
    ``intermediate_states_dtype`` where given (``torch.float32``: the states as computed).

    FLA's other arguments: ``transpose_state_layout``, its deprecated name of ``state_v_first``
    (taken with a ``DeprecationWarning``); ``cp_context`` (from ``kda.cp.build_cp_context``) runs
    the call context-parallel (docs/cp.md); ``use_graph`` builds the varlen chunk map on the
    device at a fixed size, without reading ``cu_seqlens`` (its values are then not checked), so
    that a captured CUDA graph replays with new ``cu_seqlens`` of as many entries:
    ``max_num_seqs`` (default ``cu_seqlens.shape[0] - 1``) sequences, zero-length ones padding
    (docs/API.md, "torch.compile and CUDA graphs"). The intermediate states ``h`` then have
    ``ceil(T / chunk_size) + max_num_seqs - 1`` chunks, those past the real chunks unspecified.
    Under ``torch.compile`` varlen calls take that map too.

    Serving (docs/API.md, "State pools"), forward only: ``initial_state`` may be a pool
    ``[P, HV, K, V]`` with ``initial_state_indices`` ``[N]`` (and ``inplace_final_state=True``):
    sequence n reads slot ``initial_state_indices[n]`` (zeros where ``has_initial_state[n]`` is
    False) and its final state is written back there, in the kernels, without a gathered copy.
    A negative slot is padding (zero outputs, the pool untouched); a slot >= P gives NaN outputs
    and touches nothing. ``inplace_final_state=True`` without indices overwrites
    ``initial_state`` ``[N, ...]``. States may be float32, bfloat16 or float16 (computed in
    float32, rounded once where stored); ``final_state_dtype`` is a new final state's dtype
    (float32 when None); not yet traceable by ``torch.compile``.
    """
    state_v_first = resolve_state_v_first(state_v_first, transpose_state_layout)
    validate_graph_options(use_graph, max_num_seqs, cu_seqlens, cp_context)
    serving = (initial_state_indices is not None or has_initial_state is not None
               or inplace_final_state is not False or final_state_dtype is not None)
    if cp_context is not None and serving:
        raise ValueError("initial_state_indices, has_initial_state, inplace_final_state and "
                         "final_state_dtype are not supported with cp_context")
    if cp_context is not None:
        from kda.cp.chunk import chunk_kda_cp       # kda.cp imports this module
        validate_states_dtype(intermediate_states_dtype)
        return chunk_kda_cp(
            q, k, v, g, beta, scale, initial_state, output_final_state, cp_context=cp_context,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
            A_log=A_log, dt_bias=dt_bias, safe_gate=safe_gate, lower_bound=lower_bound,
            use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
            cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu, chunk_size=chunk_size,
            state_v_first=state_v_first, disable_recompute=disable_recompute,
            return_intermediate_states=return_intermediate_states)
    validate_states_dtype(intermediate_states_dtype)
    compiling = torch.compiler.is_compiling()
    # The chunk map built on the device, at a fixed size: cu_seqlens is not read on the host.
    device_map = cu_seqlens is not None and (use_graph or compiling)
    problem, offsets = validate_inputs(q, k, v, g, beta, scale, initial_state, output_final_state,
                                       cu_seqlens, state_v_first, use_qk_l2norm_in_kernel, cu_seqlens_cpu,
                                       check_state=initial_state_indices is None,
                                       read_offsets=not device_map)
    params = validate_activations(problem.HV, problem.K, q.device, use_gate_in_kernel, A_log, dt_bias,
                                  safe_gate, lower_bound, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    A_log, dt_bias, lower_bound = params.A_log, params.dt_bias, params.lower_bound
    validate_chunk_size(chunk_size)
    warn_if_head_first(problem)
    _expect_bool('disable_recompute', disable_recompute)
    _expect_bool('return_intermediate_states', return_intermediate_states)
    needs_grad = torch.is_grad_enabled() and any(
        x is not None and x.requires_grad for x in (q, k, v, g, beta, initial_state, A_log, dt_bias))
    if return_intermediate_states and needs_grad:
        raise ValueError("return_intermediate_states=True is for inference only; call it under "
                         "torch.no_grad() or with inputs that do not require grad")
    validate_pool_prefill(problem, q.device, initial_state, state_v_first, initial_state_indices,
                          has_initial_state, inplace_final_state, final_state_dtype, needs_grad)

    inference = return_intermediate_states or not needs_grad
    if compiling and serving:
        raise ValueError("initial_state_indices, has_initial_state, inplace_final_state and "
                         "final_state_dtype are not traceable by torch.compile yet; call chunk_kda "
                         "outside the compiled region (torch.compiler.disable) for pool prefill")
    if compiling:
        # One opaque op in the traced graph (docs/API.md, "torch.compile and CUDA graphs").
        return library.chunk_kda_traced(
            q, k, v, g, beta, problem, initial_state, output_final_state, use_qk_l2norm_in_kernel,
            use_gate_in_kernel, A_log, dt_bias, lower_bound, use_beta_sigmoid_in_kernel,
            allow_neg_eigval, cu_seqlens, chunk_size, state_v_first, disable_recompute,
            return_intermediate_states, intermediate_states_dtype, inference)
    # Not bf16 in Triton's interpreter: its tl.dot multiplies bf16 operands' raw bit patterns
    # (triton-lang/triton#11584), and the kernels' answer is finite garbage there (relative error
    # ~3e11 against the reference at (1, 64, 1, 1, 16, 16)); the PyTorch path serves those calls.
    if not use_kernels(q) or (INTERPRET and q.dtype == torch.bfloat16):
        if use_beta_sigmoid_in_kernel:
            beta = activate_beta(beta, allow_neg_eigval)
        if use_gate_in_kernel:
            g = activate_gate(g, A_log, dt_bias, lower_bound)
        args = (q, k, v, g, beta, problem.scale, initial_state)
        if initial_state_indices is not None:
            o, *h = pooled_kda(chunk_kda_reference, *args, initial_state_indices, has_initial_state,
                               use_qk_l2norm_in_kernel, cu_seqlens, state_v_first, chunk_size=chunk_size,
                               return_intermediate_states=return_intermediate_states)
            result = (o, initial_state if output_final_state else None, *h)
        else:
            result = chunk_kda_reference(*args, output_final_state or inplace_final_state,
                                         use_qk_l2norm_in_kernel, cu_seqlens, state_v_first, chunk_size,
                                         return_intermediate_states)
            result = _place_final_state(result, initial_state, output_final_state, inplace_final_state,
                                        final_state_dtype)
        if device_map and return_intermediate_states:
            # The kernels' device-built map's size (use_graph).
            h = library.pad_chunk_states(result[2][0], max_varlen_chunks(problem.T, chunk_size, problem.N))
            result = (*result[:2], h.unsqueeze(0))
        return cast_intermediate_states(result, intermediate_states_dtype)
    # The kernels read beta in float32 (a [B, T, HV] copy, which training keeps for the backward:
    # 4 bytes a token-head, 1 / K of q's float32 size; test_saved_for_backward): the state
    # sweeps load it a row at a time in their chunk loop, and Triton (3.6) prefetches a load
    # (asynchronous copy) only from 4 bytes a thread, so a 16-bit beta stalled every chunk step on
    # its load. H200, bf16 forward with g pre-computed: -0.03 to -0.07 ms at (1, 32768, 32),
    # (1, 8192, 96), (4, 8192, 32) and the varlen batch, 0 at (8, 4096, 16) (one 128-wide sweep
    # program an SM there too: why it lost nothing is not known). The Kimi configuration's
    # activated beta was float32 already. One copy, contiguous, whatever beta's strides: in
    # training here, through autograd; in inference inside chunk_kda_fwd, off the head of its
    # chain (``prepare_beta``).
    if not inference:
        if use_beta_sigmoid_in_kernel:
            beta = activate_beta(beta, allow_neg_eigval)
        beta = beta.to(torch.float32, memory_format=torch.contiguous_format).contiguous()
    q, k, v, g, initial_state, cu_seqlens = contiguous(q, k, v, g, initial_state, cu_seqlens)
    slots = None
    if initial_state_indices is not None:
        slots = StateSlots(*contiguous(initial_state_indices, has_initial_state))
    if device_map:
        layout = device_chunk_layout(chunk_size, problem.T, cu_seqlens,
                                     max_varlen_chunks(problem.T, chunk_size, problem.N))
    else:
        layout = chunk_layout(problem.B, problem.T, chunk_size, offsets, cu_seqlens)
    # The gate's activation runs in the first kernel, forward and backward recompute: as PyTorch
    # ops it took five float32 passes over [B, T, HV, K] each way (docs/tuning.md, Memory).
    gate = KernelGate.of(A_log, dt_bias, lower_bound) if use_gate_in_kernel else None
    if inference:
        # A float32, contiguous beta that is not logits is what the kernels read, as it is.
        ready = (not use_beta_sigmoid_in_kernel and beta.dtype == torch.float32
                 and beta.is_contiguous())
        # Inference: nothing is kept for a backward, so q and k are not normalized in a pass of
        # their own: the pair products normalize the rows they read, in float32 (outputs
        # differ from the training forward's in the last bits: it rounds the normalized rows
        # to the input dtype, and sums each row's squares in another order).
        o, final_state, _, h = chunk_kda_fwd(
            q, k, v, g, beta, problem.scale, initial_state, output_final_state, state_v_first,
            cu_seqlens, layout, gate, store_states=return_intermediate_states,
            l2norm=use_qk_l2norm_in_kernel,
            prepare_beta=None if ready else functools.partial(
                kernel_beta, sigmoid=use_beta_sigmoid_in_kernel, neg_eigval=allow_neg_eigval),
            slots=slots, inplace=inplace_final_state, final_state_dtype=final_state_dtype)
        if slots is not None or inplace_final_state:
            # The sweep wrote the pool (or the state) behind autograd's back: its version counter
            # moves as a PyTorch in-place op's would (fused_recurrent_kda does the same).
            increment_version(initial_state)
            final_state = initial_state if output_final_state else None
        if not return_intermediate_states:
            return o, final_state
        h = h.view(problem.B, layout.NT, *h.shape[1:]) if cu_seqlens is None else h.unsqueeze(0)
        return cast_intermediate_states((o, final_state, h.transpose(-1, -2) if state_v_first else h),
                                        intermediate_states_dtype)
    o, final_state = ChunkKDAFunction.apply(q, k, v, g, beta, A_log, dt_bias, problem.scale, initial_state,
                                            output_final_state, state_v_first, cu_seqlens, layout,
                                            use_qk_l2norm_in_kernel, gate and gate.kind,
                                            gate and gate.lower_bound, disable_recompute)
    if final_state is not None and final_state_dtype is not None:
        final_state = final_state.to(final_state_dtype)
    return o, final_state


def _place_final_state(result: tuple, initial_state, output_final_state: bool, inplace: bool,
                       final_state_dtype) -> tuple:
    """The PyTorch path's ``(o, final_state, ...)`` as the kernels return it: written into
    ``initial_state`` with ``inplace``, else in ``final_state_dtype`` where given."""
    o, final_state, *rest = result
    if inplace:
        initial_state.copy_(final_state)
        final_state = initial_state
    elif final_state is not None and final_state_dtype is not None:
        final_state = final_state.to(final_state_dtype)
    return (o, final_state if output_final_state else None, *rest)
