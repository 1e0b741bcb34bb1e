"""``fused_recurrent_kda``: validation, dispatch and the launch of the token-recurrence kernel."""
from __future__ import annotations

import torch
from torch.autograd.graph import increment_version

from kda.kernels.fused_recurrent import fused_recurrent_kda_kernel
from kda.ops import library
from kda.ops.gate import activate_beta, activate_gate
from kda.ops.utils import cdiv, contiguous, next_pow2, on_q_device, state_strides, use_kernels
from kda.ops.validation import (_expect_shape, _expect_tensor, _expect_bool, refuse_shared_slots,
                                resolve_state_v_first, validate_activations, validate_final_state_dtype,
                                validate_inplace_state, validate_inputs, validate_num_accepted,
                                validate_slot_indices, validate_state, validate_state_pool)
from kda.reference import naive_recurrent_kda, pooled_kda, speculative_recurrent_kda


def _validate_serving(problem, offsets, q, initial_state, state_v_first, inplace_final_state,
                      ssm_state_indices, num_accepted_tokens, out, final_state_dtype):
    """The serving arguments (docs/API.md, "State pools"), all checked before anything runs."""
    _expect_bool('inplace_final_state', inplace_final_state)
    validate_final_state_dtype(final_state_dtype)
    HV, K, V, N = problem.HV, problem.K, problem.V, problem.N
    if num_accepted_tokens is not None and ssm_state_indices is None:
        raise ValueError("num_accepted_tokens (speculative decoding) requires ssm_state_indices [N, T_idx]")
    if ssm_state_indices is not None:
        if not inplace_final_state:
            raise ValueError("ssm_state_indices requires inplace_final_state=True: each sequence "
                             "reads and writes its slot of the state pool initial_state")
        if initial_state is None:
            raise ValueError("ssm_state_indices requires initial_state (the state pool [P, HV, K, V])")
        validate_state_pool('initial_state', initial_state, HV, K, V, state_v_first, q.device,
                            'ssm_state_indices')
        if num_accepted_tokens is None:
            if isinstance(ssm_state_indices, torch.Tensor) and ssm_state_indices.dim() == 2:
                raise ValueError("ssm_state_indices [N, T_idx] (speculative decoding) requires "
                                 "num_accepted_tokens [N]")
            validate_slot_indices('ssm_state_indices', ssm_state_indices, N, q.device)
        else:
            # Every token of a sequence stores its state: T_idx covers the longest sequence.
            longest = problem.T if offsets is None else max((b - a for a, b in zip(offsets, offsets[1:])), default=0)
            validate_slot_indices('ssm_state_indices', ssm_state_indices, N, q.device, columns=longest)
            validate_num_accepted(num_accepted_tokens, N, ssm_state_indices.shape[1], q.device)
        refuse_shared_slots('ssm_state_indices', ssm_state_indices)
    else:
        validate_state('initial_state', initial_state, N, HV, K, V, state_v_first, q.device)
    if inplace_final_state:
        validate_inplace_state(initial_state)
        if final_state_dtype is not None:
            raise ValueError("final_state_dtype is for a new final state; with inplace_final_state=True "
                             "the final state takes initial_state's dtype")
    if out is not None:
        _expect_tensor('out', out)
        _expect_shape('out', out, (problem.B, problem.T, HV, V), '[B, T, HV, V]')
        if out.dtype != q.dtype:
            raise TypeError(f"out must have q's dtype {q.dtype}, got {out.dtype}")
        if out.device != q.device or not out.is_contiguous():
            got = 'a non-contiguous tensor' if not out.is_contiguous() else 'a tensor'
            raise ValueError(f"out must be a contiguous tensor on {q.device}, got {got} on {out.device}")
        if out.requires_grad and torch.is_grad_enabled():
            raise ValueError("out requires grad: the kernel's write into it cannot be recorded by autograd; "
                             "pass a tensor that does not require grad or call under torch.no_grad()")


def _torch_path(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                state_v_first, use_qk_l2norm_in_kernel, inplace_final_state, ssm_state_indices,
                num_accepted_tokens, out, final_state_dtype):
    """CPU without the interpreter: the float32 reference, with the kernel's serving semantics
    (``kda.reference.pooled_kda`` / ``speculative_recurrent_kda``: the slots gathered, computed
    and scattered back)."""
    args = (q, k, v, g, beta, scale, initial_state, ssm_state_indices)
    opts = dict(use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens,
                state_v_first=state_v_first)
    if num_accepted_tokens is not None:
        o, ht = speculative_recurrent_kda(*args, num_accepted_tokens, **opts), initial_state
    elif ssm_state_indices is not None:
        (o,), ht = pooled_kda(naive_recurrent_kda, *args, **opts), initial_state
    else:
        o, ht = naive_recurrent_kda(q, k, v, g, beta, scale, initial_state, True, use_qk_l2norm_in_kernel,
                                    cu_seqlens, state_v_first)
        if inplace_final_state:
            initial_state.copy_(ht)
            ht = initial_state
        elif final_state_dtype is not None:
            ht = ht.to(final_state_dtype)
    if out is not None:
        out.copy_(o)
        o = out
    return o, (ht if output_final_state else None)


# A float where A_log or dt_bias belong is most likely a scale passed by position: FLA's order
# (kept here) puts A_log and dt_bias 6th and 7th, scale 8th.
POSITIONAL_HINT = (" (fused_recurrent_kda's 6th and 7th positional arguments are A_log and dt_bias, "
                   "scale is the 8th, as in FLA: pass scale=... by keyword)")


# Value columns per program and warps. 32 columns: a 128 x 32 float32 state tile is 32 registers
# a thread at 4 warps, and B * HV * V / 32 programs keep the chip busy from B = 1 (128 programs at
# H = 32). `python -m benchmarks tune decode` edits this in place to time alternatives.
DECODE_TUNING = dict(BV=32, num_warps=4)


@on_q_device
def fused_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    *,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    lower_bound: float | None = None,
    safe_gate: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    state_v_first: bool = False,
    inplace_final_state: bool = False,
    ssm_state_indices: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    transpose_state_layout: bool | None = None,
    num_accepted_tokens: torch.Tensor | None = None,
    final_state_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """KDA by the token-by-token recurrence: the decode step (T = 1) and short prefills.

    Computes, per value head and sequence (docs/API.md)::

        S_t = Diag(exp(g_t)) S_{t-1};  S_t += beta_t k_t (v_t - S_t^T k_t)^T;  o_t = S_t^T (scale q_t)

    Args:
        q, k: ``[B, T, H, K]``. v: ``[B, T, HV, V]`` with ``HV % H == 0``. g: ``[B, T, HV, K]``
            log-decay (or the raw gate with ``use_gate_in_kernel``), <= 0: a log-decay > 0 or NaN
            at token t makes that head's outputs NaN from t on and its final state NaN.
            beta: ``[B, T, HV]``, or ``[B, T, HV, V]`` (a write strength per value channel).
        A_log, dt_bias: the in-kernel gate's parameters, any shape of HV (``A_log``) or
            ``HV * K`` (``dt_bias``) elements, 6th and 7th by position as in FLA (so ``scale``
            comes 8th: pass it by keyword). Without ``use_gate_in_kernel`` they and
            ``lower_bound`` are ignored with a warning, as FLA ignores them.
        transpose_state_layout: FLA's deprecated name of ``state_v_first`` (taken with a
            ``DeprecationWarning``; an error beside ``state_v_first=True``).
        initial_state: ``[N, HV, K, V]`` (``[N, HV, V, K]`` with ``state_v_first``), float32,
            bfloat16 or float16 (computed in float32, rounded once where stored); with
            ``ssm_state_indices`` a pool ``[P, HV, K, V]`` of which sequence n uses slot
            ``ssm_state_indices[n]``: a negative slot is padding (zero outputs, the pool untouched),
            a slot >= P gives NaN outputs and touches nothing.
        ssm_state_indices, num_accepted_tokens: speculative decoding, ``[N, T_idx]`` and ``[N]``:
            sequence n starts from slot ``ssm_state_indices[n, num_accepted_tokens[n] - 1]`` and
            the state after its token t is stored in slot ``ssm_state_indices[n, t]``.
        final_state_dtype: the dtype of a new final state (default float32).
        inplace_final_state: write the final state into ``initial_state`` instead of a new tensor
            (which must then not require grad while grad mode is on). Its version counter, and
            ``out``'s, move as a PyTorch in-place op's would.
        out: preallocated ``[B, T, HV, V]`` output. With these, a decode step allocates nothing
            and can be captured in a CUDA graph.

    Returns ``(o, final_state)``; ``final_state`` is None unless ``output_final_state``. There is no
    backward pass: a backward through ``o`` raises (train with ``chunk_kda``).
    """
    state_v_first = resolve_state_v_first(state_v_first, transpose_state_layout)
    # Compiling: cu_seqlens' values are not read on the host (docs/API.md).
    compiling = torch.compiler.is_compiling()
    problem, offsets = validate_inputs(q, k, v, g, beta, scale, initial_state, output_final_state,
                                       cu_seqlens, state_v_first, use_qk_l2norm_in_kernel, cu_seqlens_cpu,
                                       check_state=False, channel_beta=True, read_offsets=not compiling)
    params = validate_activations(problem.HV, problem.K, q.device, use_gate_in_kernel, A_log, dt_bias,
                                  safe_gate, lower_bound, use_beta_sigmoid_in_kernel, allow_neg_eigval,
                                  positional_hint=POSITIONAL_HINT)
    A_log, dt_bias, lower_bound = params.A_log, params.dt_bias, params.lower_bound
    _validate_serving(problem, offsets, q, initial_state, state_v_first, inplace_final_state,
                      ssm_state_indices, num_accepted_tokens, out, final_state_dtype)
    if compiling:
        if num_accepted_tokens is not None or final_state_dtype is not None:
            raise ValueError("num_accepted_tokens and final_state_dtype are not traceable by "
                             "torch.compile yet; call fused_recurrent_kda outside the compiled region")
        # One opaque op in the traced graph (docs/API.md, "torch.compile and CUDA graphs").
        return library.fused_recurrent_traced(
            q, k, v, g, beta, A_log, dt_bias, problem, initial_state, output_final_state,
            use_qk_l2norm_in_kernel, use_gate_in_kernel, lower_bound, use_beta_sigmoid_in_kernel,
            allow_neg_eigval, cu_seqlens, state_v_first, inplace_final_state, ssm_state_indices, out)
    if not use_kernels(q):
        if use_gate_in_kernel:
            g = activate_gate(g, A_log, dt_bias, lower_bound)
        if use_beta_sigmoid_in_kernel:
            beta = activate_beta(beta, allow_neg_eigval)
        return _torch_path(q, k, v, g, beta, problem.scale, initial_state, output_final_state,
                           cu_seqlens, state_v_first, use_qk_l2norm_in_kernel, inplace_final_state,
                           ssm_state_indices, num_accepted_tokens, out, final_state_dtype)

    # Tensors of the caller's that the kernel writes, unseen by autograd (see below).
    written = [t for t in (out, initial_state if inplace_final_state else None) if t is not None]
    q, k, v, g, beta = contiguous(q, k, v, g, beta)
    # The kernel reads cu_seqlens[n] and ssm_state_indices[n] at offset n: a strided view (e.g.
    # idx[::2]) must be made dense first (a no-op, so CUDA-graph safe, for dense tensors).
    cu_seqlens, ssm_state_indices, num_accepted_tokens = contiguous(cu_seqlens, ssm_state_indices,
                                                                    num_accepted_tokens)
    B, T, HV, K, V, N = problem.B, problem.T, problem.HV, problem.K, problem.V, problem.N
    if out is None:
        out = torch.empty(B, T, HV, V, dtype=q.dtype, device=q.device)
    if initial_state is not None and not initial_state.is_contiguous():
        initial_state = initial_state.contiguous()
    if inplace_final_state:
        ht = initial_state
    elif output_final_state:
        ht = q.new_empty((N, HV, V, K) if state_v_first else (N, HV, K, V),
                         dtype=final_state_dtype or torch.float32)
    else:
        ht = None
    gate_kind = gate_kind_of(use_gate_in_kernel, lower_bound)

    def launch():
        launch_fused_recurrent(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens,
                               ssm_state_indices, out, ht, problem.scale, float(lower_bound or 0.0),
                               use_qk_l2norm_in_kernel, gate_kind,
                               beta_kind_of(use_beta_sigmoid_in_kernel, allow_neg_eigval), state_v_first,
                               num_accepted_tokens)
        return out, (ht if output_final_state else None)

    inputs = [x for x in (q, k, v, g, beta, A_log, dt_bias, initial_state) if x is not None]
    if torch.is_grad_enabled() and any(x.requires_grad for x in inputs):
        result = ForwardOnly.apply(launch, *inputs)
    else:
        result = launch()
    # The kernel wrote out and the state pool in place, as PyTorch's in-place ops do, but behind
    # autograd's back: bump their version counters as those ops would, so that a backward which
    # saved one of them (e.g. chunk_kda's, for its initial state) raises "modified by an inplace
    # operation" instead of silently using the new values (a host-side counter: no GPU work, and
    # nothing a CUDA graph records).
    for t in written:
        increment_version(t)
    return result


def gate_kind_of(use_gate_in_kernel: bool, lower_bound: float | None) -> str:
    """The kernel's ``GATE``: ``'none'`` (g is the log-decay), ``'softplus'`` or ``'sigmoid'``
    (the lower-bound gate), as ``kernels/gate.py`` names them."""
    return 'none' if not use_gate_in_kernel else 'softplus' if lower_bound is None else 'sigmoid'


def beta_kind_of(use_beta_sigmoid_in_kernel: bool, allow_neg_eigval: bool) -> str:
    """The kernel's ``BETA``: ``'none'`` (beta as given), ``'sigmoid'``, or ``'sigmoid2'``
    (2 * sigmoid, ``allow_neg_eigval``)."""
    return 'none' if not use_beta_sigmoid_in_kernel else 'sigmoid2' if allow_neg_eigval else 'sigmoid'


def launch_fused_recurrent(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens,
                           ssm_state_indices, out, final_state, scale: float, lower_bound: float,
                           qk_l2norm: bool, gate_kind: str, beta_kind: str, state_v_first: bool,
                           num_accepted_tokens=None) -> None:
    """The recurrence kernel on dense tensors: writes ``out`` and, where given, ``final_state``
    (which may be ``initial_state`` itself, the pool updated in place). ``A_log`` / ``dt_bias``
    are read only under the in-kernel gate (``gate_kind`` not ``'none'``); ``num_accepted_tokens``
    with ``ssm_state_indices`` ``[N, T_idx]``: speculative decoding; a ``[B, T, HV, V]`` beta: one
    write strength per value column. The eager path and the ``kda::fused_recurrent`` op both
    launch through here."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    num_slots = initial_state.shape[0] if initial_state is not None else N
    slots_per_seq = ssm_state_indices.shape[1] if num_accepted_tokens is not None else 1
    BK = next_pow2(K)
    BV = min(next_pow2(V), DECODE_TUNING['BV'])
    # The gate's parameters, dense (a no-op for the [HV] / [HV * K] vectors the API takes).
    if gate_kind == 'none':
        A_log = dt_bias = None
    A_log, dt_bias = (None if t is None else t.detach().contiguous() for t in (A_log, dt_bias))
    fused_recurrent_kda_kernel[(N * HV * cdiv(V, BV),)](
        q, k, v, g, beta, out, initial_state, final_state, cu_seqlens, ssm_state_indices,
        num_accepted_tokens, A_log, dt_bias, scale, lower_bound, T, num_slots, slots_per_seq,
        *state_strides(K, V, state_v_first),
        H=H, HV=HV, K=K, V=V, BK=BK, BV=BV,
        USE_L2NORM=qk_l2norm,
        IS_VARLEN=cu_seqlens is not None,
        USE_INITIAL_STATE=initial_state is not None,
        STORE_FINAL_STATE=final_state is not None,
        USE_STATE_INDICES=ssm_state_indices is not None,
        SPECULATIVE=num_accepted_tokens is not None,
        CHANNEL_BETA=beta.dim() == 4,
        GATE=gate_kind, BETA=beta_kind,
        num_warps=DECODE_TUNING['num_warps'],
    )


NO_BACKWARD = "fused_recurrent_kda has no backward pass (it is the decode/prefill kernel); train with chunk_kda"


class ForwardOnly(torch.autograd.Function):
    """Puts the kernel's outputs in the autograd graph so that a backward through them raises,
    rather than the inputs' gradients silently missing this layer's contribution."""

    @staticmethod
    def forward(ctx, launch, *inputs):
        o, final_state = launch()
        if final_state is not None:
            ctx.mark_non_differentiable(final_state)
        return o, final_state

    @staticmethod
    def backward(ctx, do, dht):
        raise RuntimeError(NO_BACKWARD)
