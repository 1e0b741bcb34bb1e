"""``fused_recurrent_kda``: validation, dispatch and the launch of the token-recurrence kernel."""
from __future__ import annotations

import torch
from torch.autograd.graph import increment_version

from kda.kernels.fused_recurrent import fused_recurrent_kda_kernel
from kda.ops import library
from kda.ops.gate import activate_beta, activate_gate
from kda.ops.utils import cdiv, contiguous, next_pow2, on_q_device, state_strides, use_kernels
from kda.ops.validation import (_expect_shape, _expect_tensor, _expect_bool, resolve_state_v_first,
                                validate_activations, validate_inputs, validate_state)
from kda.reference import naive_recurrent_kda


def _validate_serving(problem, q, initial_state, output_final_state, state_v_first,
                      inplace_final_state, ssm_state_indices, out):
    _expect_bool('inplace_final_state', inplace_final_state)
    HV, K, V, N = problem.HV, problem.K, problem.V, problem.N
    if ssm_state_indices is not None:
        _expect_tensor('ssm_state_indices', ssm_state_indices)
        if ssm_state_indices.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"ssm_state_indices must be int32 or int64, got {ssm_state_indices.dtype}")
        _expect_shape('ssm_state_indices', ssm_state_indices, (N,), f'[N] with N = {N} sequences')
        if ssm_state_indices.device != q.device:
            raise ValueError(f"ssm_state_indices must be on {q.device} like q, got {ssm_state_indices.device}")
        if not inplace_final_state:
            raise ValueError("ssm_state_indices requires inplace_final_state=True: each sequence "
                             "reads and writes its slot of the state pool initial_state")
        if initial_state is None:
            raise ValueError("ssm_state_indices requires initial_state (the state pool [P, HV, K, V])")
        _expect_tensor('initial_state', initial_state)
        slot = (HV, V, K) if state_v_first else (HV, K, V)
        if initial_state.dim() != 4 or initial_state.shape[0] < 1 or tuple(initial_state.shape[1:]) != slot:
            layout = '[P, HV, V, K] (state_v_first=True)' if state_v_first else '[P, HV, K, V]'
            raise ValueError(f"initial_state must be a state pool {layout} = [P, {', '.join(map(str, slot))}] "
                             f"with P >= 1 slots (ssm_state_indices picks a sequence's slot), "
                             f"got {list(initial_state.shape)}")
        validate_state('initial_state', initial_state, initial_state.shape[0], HV, K, V, state_v_first,
                       q.device)
    else:
        validate_state('initial_state', initial_state, N, HV, K, V, state_v_first, q.device)
    if inplace_final_state:
        if initial_state is None:
            raise ValueError("inplace_final_state=True requires initial_state (updated in place)")
        if not initial_state.is_contiguous():
            raise ValueError("inplace_final_state=True requires a contiguous initial_state")
        if initial_state.requires_grad and torch.is_grad_enabled():
            raise ValueError("inplace_final_state=True would overwrite initial_state, which requires grad, "
                             "in a write autograd cannot record; pass initial_state.detach() or call under "
                             "torch.no_grad()")
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
                state_v_first, use_qk_l2norm_in_kernel, inplace_final_state, ssm_state_indices, out):
    """CPU without the interpreter: the float32 reference, with the same serving semantics
    (including the kernel's: a slot outside the pool gives NaN outputs and writes no state)."""
    h0, valid = initial_state, None
    if ssm_state_indices is not None:
        num_slots = initial_state.shape[0]
        idx = ssm_state_indices.long()
        valid = (idx >= 0) & (idx < num_slots)
        # Bad slots read slot 0 (their results are discarded below); negative indices must not wrap.
        h0 = initial_state[torch.where(valid, idx, 0)]
    o, ht = naive_recurrent_kda(q, k, v, g, beta, scale, h0, True, use_qk_l2norm_in_kernel,
                                cu_seqlens, state_v_first)
    if valid is not None and not bool(valid.all()):
        o = o.clone()
        if cu_seqlens is None:
            o[~valid] = float('nan')
        else:
            lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
            seq_of_token = torch.repeat_interleave(torch.arange(len(lengths), device=o.device), lengths)
            o[0, ~valid[seq_of_token]] = float('nan')
    if out is not None:
        out.copy_(o)
        o = out
    if inplace_final_state:
        if ssm_state_indices is None:
            initial_state.copy_(ht)
        else:
            initial_state[idx[valid]] = ht[valid]
        ht = initial_state
    return o, (ht if output_final_state else None)


# A float where A_log or dt_bias belong is most likely a scale passed by position: FLA's order
# (kept here) puts A_log and dt_bias 6th and 7th, scale 8th.
POSITIONAL_HINT = (" (fused_recurrent_kda's 6th and 7th positional arguments are A_log and dt_bias, "
                   "scale is the 8th, as in FLA: pass scale=... by keyword)")


# Value columns per program and warps. 32 columns: a 128 x 32 float32 state tile is 32 registers
# a thread at 4 warps, and B * HV * V / 32 programs keep the chip busy from B = 1 (128 programs at
# H = 32). benchmarks/sweep_decode.py edits this in place to time alternatives.
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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """KDA by the token-by-token recurrence: the decode step (T = 1) and short prefills.

    Computes, per value head and sequence (docs/API.md)::

        S_t = Diag(exp(g_t)) S_{t-1};  S_t += beta_t k_t (v_t - S_t^T k_t)^T;  o_t = S_t^T (scale q_t)

    Args:
        q, k: ``[B, T, H, K]``. v: ``[B, T, HV, V]`` with ``HV % H == 0``. g: ``[B, T, HV, K]``
            log-decay (or the raw gate with ``use_gate_in_kernel``), <= 0: a log-decay > 0 or NaN
            at token t makes that head's outputs NaN from t on and its final state NaN.
            beta: ``[B, T, HV]``.
        A_log, dt_bias: the in-kernel gate's parameters, any shape of HV (``A_log``) or
            ``HV * K`` (``dt_bias``) elements, 6th and 7th by position as in FLA (so ``scale``
            comes 8th: pass it by keyword). Without ``use_gate_in_kernel`` they and
            ``lower_bound`` are ignored with a warning, as FLA ignores them.
        transpose_state_layout: FLA's deprecated name of ``state_v_first`` (taken with a
            ``DeprecationWarning``; an error beside ``state_v_first=True``).
        initial_state: float32 ``[N, HV, K, V]`` (``[N, HV, V, K]`` with ``state_v_first``); with
            ``ssm_state_indices`` a pool ``[P, HV, K, V]`` of which sequence n uses slot
            ``ssm_state_indices[n]`` (a slot outside the pool gives NaN outputs and no write).
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
    problem, _ = validate_inputs(q, k, v, g, beta, scale, initial_state, output_final_state,
                                 cu_seqlens, state_v_first, use_qk_l2norm_in_kernel, cu_seqlens_cpu,
                                 check_state=False, read_offsets=not compiling)
    params = validate_activations(problem.HV, problem.K, q.device, use_gate_in_kernel, A_log, dt_bias,
                                  safe_gate, lower_bound, use_beta_sigmoid_in_kernel, allow_neg_eigval,
                                  positional_hint=POSITIONAL_HINT)
    A_log, dt_bias, lower_bound = params.A_log, params.dt_bias, params.lower_bound
    _validate_serving(problem, q, initial_state, output_final_state, state_v_first,
                      inplace_final_state, ssm_state_indices, out)
    if compiling:
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
                           ssm_state_indices, out)

    # Tensors of the caller's that the kernel writes, unseen by autograd (see below).
    written = [t for t in (out, initial_state if inplace_final_state else None) if t is not None]
    q, k, v, g, beta = contiguous(q, k, v, g, beta)
    # The kernel reads cu_seqlens[n] and ssm_state_indices[n] at offset n: a strided view (e.g.
    # idx[::2]) must be made dense first (a no-op, so CUDA-graph safe, for dense tensors).
    cu_seqlens, ssm_state_indices = contiguous(cu_seqlens, ssm_state_indices)
    B, T, HV, K, V, N = problem.B, problem.T, problem.HV, problem.K, problem.V, problem.N
    if out is None:
        out = torch.empty(B, T, HV, V, dtype=q.dtype, device=q.device)
    if initial_state is not None and not initial_state.is_contiguous():
        initial_state = initial_state.contiguous()
    if inplace_final_state:
        ht = initial_state
    elif output_final_state:
        ht = q.new_empty((N, HV, V, K) if state_v_first else (N, HV, K, V), dtype=torch.float32)
    else:
        ht = None
    gate_kind = gate_kind_of(use_gate_in_kernel, lower_bound)

    def launch():
        launch_fused_recurrent(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens,
                               ssm_state_indices, out, ht, problem.scale, float(lower_bound or 0.0),
                               use_qk_l2norm_in_kernel, gate_kind,
                               beta_kind_of(use_beta_sigmoid_in_kernel, allow_neg_eigval), state_v_first)
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
                           qk_l2norm: bool, gate_kind: str, beta_kind: str, state_v_first: bool) -> None:
    """The recurrence kernel on dense tensors: writes ``out`` and, where given, ``final_state``
    (which may be ``initial_state`` itself, the pool updated in place). ``A_log`` / ``dt_bias``
    are read only under the in-kernel gate (``gate_kind`` not ``'none'``). The eager path and
    the ``kda::fused_recurrent`` op both launch through here."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    num_slots = initial_state.shape[0] if initial_state is not None else N
    BK = next_pow2(K)
    BV = min(next_pow2(V), DECODE_TUNING['BV'])
    # The gate's parameters, dense (a no-op for the [HV] / [HV * K] vectors the API takes).
    if gate_kind == 'none':
        A_log = dt_bias = None
    A_log, dt_bias = (None if t is None else t.detach().contiguous() for t in (A_log, dt_bias))
    fused_recurrent_kda_kernel[(N * HV * cdiv(V, BV),)](
        q, k, v, g, beta, out, initial_state, final_state, cu_seqlens, ssm_state_indices,
        A_log, dt_bias, scale, lower_bound, T, num_slots, *state_strides(K, V, state_v_first),
        H=H, HV=HV, K=K, V=V, BK=BK, BV=BV,
        USE_L2NORM=qk_l2norm,
        IS_VARLEN=cu_seqlens is not None,
        USE_INITIAL_STATE=initial_state is not None,
        STORE_FINAL_STATE=final_state is not None,
        USE_STATE_INDICES=ssm_state_indices is not None,
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
