"""Validation of every public call, before any kernel runs.

Each malformed call raises ``TypeError`` (not a tensor, wrong dtype) or ``ValueError`` (shape,
length, head grouping, cu_seqlens, option combination) whose message names the argument, what it
got and what it expects. The only reshapes are of the gate parameters (``GateParameters``): any
tensor of ``HV`` elements is ``A_log`` and any of ``HV * K`` is ``dt_bias``, viewed flat.

flash-linear-attention's ``fla.ops.kda`` also takes arguments that change nothing here or are
spelled differently; the helpers at the end give each its meaning there: a deprecated alias of
``state_v_first``, gate parameters it ignores without the in-kernel gate (ignored here too, with
a warning), and options of its distributed and graph modes (refused: not supported yet).
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch

INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# States (initial states, pools, final states) are computed in float32 and may be stored in 16 bits.
STATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int32, torch.int64)
MAX_HEAD_DIM = 256
CHUNK_SIZES = (32, 64)
FLOAT32_MAX = torch.finfo(torch.float32).max
# warnings.warn's stacklevel from a helper here to the user's line: helper, public function, the
# ``on_q_device`` wrapper, caller.
CALLER_STACKLEVEL = 4


@dataclass(frozen=True)
class Problem:
    """The sizes of a validated call."""
    B: int
    T: int
    H: int
    HV: int
    K: int
    V: int
    N: int          # number of sequences (B, or len(cu_seqlens) - 1)
    scale: float


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace('torch.', '')


def _expect_tensor(name: str, x) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def _expect_shape(name: str, x: torch.Tensor, shape: tuple, meaning: str) -> None:
    if x.shape != tuple(shape):
        raise ValueError(f"{name} must have shape {list(shape)} ({meaning}), got {list(x.shape)}")


def _expect_dtype(name: str, x: torch.Tensor, allowed: tuple) -> None:
    if x.dtype not in allowed:
        names = ', '.join(_dtype_name(d) for d in allowed)
        raise TypeError(f"{name} must have dtype in ({names}), got {_dtype_name(x.dtype)}")


def _expect_bool(name: str, x) -> None:
    if not isinstance(x, bool):
        raise TypeError(f"{name} must be a bool, got {type(x).__name__}")


def _gate_dtypes(q_dtype: torch.dtype) -> str:
    """The dtypes g and beta may have, in words: q's, or float32 (once where q's is float32)."""
    if q_dtype == torch.float32:
        return "dtype float32 (q's)"
    return f"q's dtype {_dtype_name(q_dtype)} or float32"


def validate_cu_seqlens(cu_seqlens, B: int, T: int, device: torch.device,
                        cu_seqlens_cpu=None, read_offsets: bool = True) -> tuple[int, list[int] | None]:
    """Checks ``cu_seqlens`` and returns (number of sequences, host copy of the offsets or None).

    Without ``read_offsets`` (``use_graph``, ``torch.compile``) only its type, shape and device
    are checked, and neither it nor ``cu_seqlens_cpu`` is read: the host copy is None.

    The host copy is taken from ``cu_seqlens_cpu`` when given, else by one device sync. Where
    ``cu_seqlens`` itself is on the CPU (reading it costs no sync) the two must agree; a device
    ``cu_seqlens`` is trusted to hold ``cu_seqlens_cpu``'s values (docs/API.md), as checking it would
    cost the sync that ``cu_seqlens_cpu`` exists to avoid.
    """
    if cu_seqlens is None:
        if cu_seqlens_cpu is not None:
            raise ValueError("cu_seqlens_cpu was given without cu_seqlens; pass both or neither")
        return B, None
    _expect_tensor('cu_seqlens', cu_seqlens)
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"cu_seqlens must be an integer tensor (int64 or int32), got {_dtype_name(cu_seqlens.dtype)}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be a 1-D tensor [N + 1] with N >= 1, got shape {list(cu_seqlens.shape)}")
    if cu_seqlens.device != device:
        raise ValueError(f"cu_seqlens must be on {device} like q, got {cu_seqlens.device}")
    if B != 1:
        raise ValueError(f"with cu_seqlens the batch must be packed into B = 1, got B = {B}")
    if not read_offsets:
        if cu_seqlens_cpu is not None:
            _expect_tensor('cu_seqlens_cpu', cu_seqlens_cpu)
        if cu_seqlens_cpu is not None and cu_seqlens_cpu.shape != cu_seqlens.shape:
            raise ValueError(f"cu_seqlens_cpu must have the shape of cu_seqlens {list(cu_seqlens.shape)}, "
                             f"got {list(cu_seqlens_cpu.shape)}")
        return cu_seqlens.shape[0] - 1, None
    if cu_seqlens_cpu is not None:
        _expect_tensor('cu_seqlens_cpu', cu_seqlens_cpu)
        if cu_seqlens_cpu.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"cu_seqlens_cpu must be an integer tensor (int64 or int32), "
                            f"got {_dtype_name(cu_seqlens_cpu.dtype)}")
        if cu_seqlens_cpu.shape != cu_seqlens.shape:
            raise ValueError(f"cu_seqlens_cpu must have the shape of cu_seqlens {list(cu_seqlens.shape)}, "
                             f"got {list(cu_seqlens_cpu.shape)}")
        # The host, as docs/API.md has it; q's device is accepted too (FLA reads either), at the cost of
        # the sync that the host copy exists to avoid.
        if cu_seqlens_cpu.device.type != 'cpu' and cu_seqlens_cpu.device != device:
            raise ValueError(f"cu_seqlens_cpu must be on the CPU (the host copy of cu_seqlens) or on {device} "
                             f"like q, got {cu_seqlens_cpu.device}")
        offsets = cu_seqlens_cpu.tolist()
        if cu_seqlens.device.type == 'cpu' and cu_seqlens.tolist() != offsets:
            raise ValueError(f"cu_seqlens_cpu must hold cu_seqlens' values {cu_seqlens.tolist()}, "
                             f"got {offsets}")
    else:
        offsets = cu_seqlens.tolist()
    if offsets[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {offsets[0]}")
    if any(b < a for a, b in zip(offsets, offsets[1:])):
        raise ValueError(f"cu_seqlens must be non-decreasing, got {offsets}")
    if offsets[-1] != T:
        raise ValueError(f"cu_seqlens must end at T = {T} (the packed length), got {offsets[-1]}")
    return len(offsets) - 1, offsets


def validate_state(name: str, state, N: int, HV: int, K: int, V: int, state_v_first: bool,
                   device: torch.device) -> None:
    if state is None:
        return
    _expect_tensor(name, state)
    expected = (N, HV, V, K) if state_v_first else (N, HV, K, V)
    layout = '[N, HV, V, K] (state_v_first=True)' if state_v_first else '[N, HV, K, V]'
    _expect_shape(name, state, expected, f"layout {layout} with N = {N} sequences")
    _expect_dtype(name, state, STATE_DTYPES)
    if state.device != device:
        raise ValueError(f"{name} must be on {device} like q, got {state.device}")


def validate_inputs(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                    state_v_first, use_qk_l2norm_in_kernel, cu_seqlens_cpu=None,
                    check_state: bool = True, channel_beta: bool = False,
                    read_offsets: bool = True) -> tuple[Problem, list[int] | None]:
    """Checks the arguments common to ``chunk_kda`` and ``fused_recurrent_kda``.

    ``channel_beta``: beta may also be ``[B, T, HV, V]``, one write strength per value column
    (``fused_recurrent_kda``). Returns the problem sizes and, for varlen calls, the host copy of
    ``cu_seqlens`` (None without ``read_offsets``: see ``validate_cu_seqlens``).
    """
    for name, x in (('q', q), ('k', k), ('v', v), ('g', g), ('beta', beta)):
        _expect_tensor(name, x)
    for name, x in (('output_final_state', output_final_state), ('state_v_first', state_v_first),
                    ('use_qk_l2norm_in_kernel', use_qk_l2norm_in_kernel)):
        _expect_bool(name, x)
    if q.dim() != 4:
        raise ValueError(f"q must be 4-D [B, T, H, K], got shape {list(q.shape)}")
    B, T, H, K = q.shape
    _expect_shape('k', k, (B, T, H, K), 'like q: [B, T, H, K]')
    if v.dim() != 4 or v.shape[:2] != (B, T):
        raise ValueError(f"v must have shape [B, T, HV, V] = [{B}, {T}, HV, V], got {list(v.shape)}")
    HV, V = v.shape[2], v.shape[3]
    if H == 0 or HV == 0 or HV % H != 0:
        raise ValueError(f"v's head count HV = {HV} must be a positive multiple of q's H = {H} "
                         f"(grouped-value attention)")
    _expect_shape('g', g, (B, T, HV, K), '[B, T, HV, K]')
    if not (channel_beta and beta.shape == (B, T, HV, V)):
        _expect_shape('beta', beta, (B, T, HV),
                      '[B, T, HV], or [B, T, HV, V] per value channel' if channel_beta else '[B, T, HV]')
    for name, dim in (('K (the last dim of q and k)', K), ('V (the last dim of v)', V)):
        if not 1 <= dim <= MAX_HEAD_DIM:
            raise ValueError(f"head dim {name} must be in [1, {MAX_HEAD_DIM}], got {dim}")
    _expect_dtype('q', q, INPUT_DTYPES)
    for name, x in (('k', k), ('v', v)):
        if x.dtype != q.dtype:
            raise TypeError(f"{name} must have q's dtype {_dtype_name(q.dtype)}, got {_dtype_name(x.dtype)}")
    for name, x in (('g', g), ('beta', beta)):
        if x.dtype not in (q.dtype, torch.float32):
            raise TypeError(f"{name} must have {_gate_dtypes(q.dtype)}, got {_dtype_name(x.dtype)}")
    device = q.device
    for name, x in (('k', k), ('v', v), ('g', g), ('beta', beta)):
        if x.device != device:
            raise ValueError(f"{name} must be on {device} like q, got {x.device}")
    if scale is None:
        scale = K ** -0.5
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    else:
        try:
            scale = float(scale)
        except OverflowError:
            raise ValueError(f"scale must fit a float, got an int of {scale.bit_length()} bits") from None
        # The kernels take scale as a float32: beyond its range it is inf there, and so is q * scale.
        if not math.isfinite(scale) or abs(scale) > FLOAT32_MAX:
            raise ValueError(f"scale must be finite as a float32 (|scale| <= {FLOAT32_MAX:.7g}), got {scale}")
    N, offsets = validate_cu_seqlens(cu_seqlens, B, T, device, cu_seqlens_cpu, read_offsets)
    if check_state:
        validate_state('initial_state', initial_state, N, HV, K, V, state_v_first, device)
    return Problem(B, T, H, HV, K, V, N, float(scale)), offsets


def validate_chunk_size(chunk_size) -> int:
    # The message keeps FLA's words ("`chunk_size` must be either 32 or 64"), which its callers'
    # tests match.
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size not in CHUNK_SIZES:
        raise ValueError(f"`chunk_size` must be either 32 or 64 (the chunk lengths the kernels are "
                         f"built for), got {chunk_size!r}")
    return chunk_size


@dataclass(frozen=True)
class GateParameters:
    """The in-kernel gate's inputs as the launchers take them: ``A_log`` ``[HV]`` and ``dt_bias``
    ``[HV * K]`` (views of the caller's tensors where their strides allow), ``lower_bound``; all
    None without the in-kernel gate."""
    A_log: torch.Tensor | None
    dt_bias: torch.Tensor | None
    lower_bound: float | None


NO_GATE = GateParameters(None, None, None)


def _expect_gate_tensor(name: str, x, positional_hint: str) -> None:
    if x is not None and not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(x).__name__}{positional_hint}")


def _flat_parameter(name: str, x: torch.Tensor, numel: int, meaning: str, device: torch.device) -> torch.Tensor:
    """``x`` as a 1-D tensor of ``numel`` elements: any shape holding them is taken (FLA takes
    ``A_log`` as ``[1, 1, HV, 1]``), viewed without a copy where its strides allow."""
    if x.numel() != numel:
        raise ValueError(f"{name} must hold {meaning} = {numel} elements (shape [{numel}], or any shape "
                         f"of {numel} elements such as [1, 1, {numel}, 1]), got shape {list(x.shape)}")
    _expect_dtype(name, x, (torch.float32,))
    if x.device != device:
        raise ValueError(f"{name} must be on {device} like q, got {x.device}")
    return x.reshape(numel)


def validate_activations(HV: int, K: int, device: torch.device, use_gate_in_kernel, A_log, dt_bias,
                         safe_gate, lower_bound, use_beta_sigmoid_in_kernel, allow_neg_eigval,
                         positional_hint: str = '') -> GateParameters:
    """Checks the in-kernel gate and beta options of docs/API.md and the combinations they allow, and
    returns the gate's parameters as the launchers take them.

    Without the in-kernel gate, ``A_log``, ``dt_bias`` and ``lower_bound`` are ignored, as FLA
    ignores them, with a warning; ``lower_bound`` beside ``safe_gate=True`` is the bound the caller
    promises g keeps, and is ignored silently (the kernels are exact for any g <= 0).
    ``positional_hint`` ends the message of a non-tensor ``A_log`` or ``dt_bias`` (a scale passed
    by position lands there in ``fused_recurrent_kda``).
    """
    for name, x in (('use_gate_in_kernel', use_gate_in_kernel), ('safe_gate', safe_gate),
                    ('use_beta_sigmoid_in_kernel', use_beta_sigmoid_in_kernel),
                    ('allow_neg_eigval', allow_neg_eigval)):
        _expect_bool(name, x)
    _expect_gate_tensor('A_log', A_log, positional_hint)
    _expect_gate_tensor('dt_bias', dt_bias, positional_hint)
    if lower_bound is not None and (isinstance(lower_bound, bool) or not isinstance(lower_bound, (int, float))):
        raise TypeError(f"lower_bound must be a float or None, got {type(lower_bound).__name__}")
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("allow_neg_eigval=True requires use_beta_sigmoid_in_kernel=True "
                         "(beta becomes 2 * sigmoid(beta))")
    if not use_gate_in_kernel:
        ignored = [name for name, x in (('A_log', A_log), ('dt_bias', dt_bias)) if x is not None]
        if lower_bound is not None and not safe_gate:
            ignored.append('lower_bound')
        if ignored:
            warnings.warn(f"{', '.join(ignored)} given with use_gate_in_kernel=False: ignored, as g is "
                          f"taken as the log-decay itself (pass use_gate_in_kernel=True to activate a raw g)",
                          UserWarning, stacklevel=CALLER_STACKLEVEL)
        return NO_GATE
    if lower_bound is not None:
        # safe_gate promises steps of at least -5 (what FLA's fast paths assume); without it any
        # finite negative bound is taken, as FLA takes it.
        if safe_gate and not -5 <= lower_bound < 0:
            raise ValueError(f"lower_bound must lie in [-5, 0) with safe_gate=True, got {lower_bound}")
        if not -math.inf < lower_bound < 0:
            raise ValueError(f"lower_bound must be finite and < 0, got {lower_bound}")
    elif A_log is None:
        raise ValueError("use_gate_in_kernel=True needs A_log (or lower_bound with A_log optional)")
    if safe_gate and lower_bound is None:
        raise ValueError("safe_gate=True requires lower_bound (the bound it promises)")
    return GateParameters(
        A_log=None if A_log is None else _flat_parameter('A_log', A_log, HV, 'HV', device),
        dt_bias=None if dt_bias is None else _flat_parameter('dt_bias', dt_bias, HV * K, 'HV * K', device),
        lower_bound=None if lower_bound is None else float(lower_bound))


def resolve_state_v_first(state_v_first, transpose_state_layout) -> bool:
    """``transpose_state_layout``, FLA's deprecated name of ``state_v_first``: None when not
    given; given, it is taken with a ``DeprecationWarning``, and beside ``state_v_first=True`` it
    is an error (which one was meant cannot be told)."""
    if transpose_state_layout is None:
        return state_v_first
    _expect_bool('transpose_state_layout', transpose_state_layout)
    if state_v_first is True:
        raise ValueError("transpose_state_layout (the deprecated name of state_v_first) was given "
                         "beside state_v_first=True; pass state_v_first alone")
    warnings.warn("transpose_state_layout is deprecated; it is the old name of state_v_first",
                  DeprecationWarning, stacklevel=CALLER_STACKLEVEL)
    return transpose_state_layout


def validate_graph_options(use_graph, max_num_seqs, cu_seqlens, cp_context) -> None:
    """FLA's CUDA-graph varlen options: ``use_graph`` (the chunk map built on the device at a
    fixed size) and ``max_num_seqs``, its sequence bound, which ``cu_seqlens`` must be padded to
    with zero-length sequences (``max_num_seqs + 1`` entries)."""
    _expect_bool('use_graph', use_graph)
    if max_num_seqs is not None:
        if isinstance(max_num_seqs, bool) or not isinstance(max_num_seqs, int):
            raise TypeError(f"max_num_seqs must be an int or None, got {type(max_num_seqs).__name__}")
        if not use_graph:
            raise ValueError(f"max_num_seqs (the sequence bound of use_graph=True) was given without "
                             f"use_graph=True; got max_num_seqs={max_num_seqs}")
        if cu_seqlens is not None and cu_seqlens.shape[0] - 1 != max_num_seqs:
            raise ValueError(f"with use_graph=True, cu_seqlens must be padded with zero-length sequences "
                             f"to max_num_seqs + 1 = {max_num_seqs + 1} entries, got {cu_seqlens.shape[0]}")
    if use_graph and cp_context is not None:
        raise ValueError("use_graph=True cannot be combined with cp_context (context parallelism)")


def warn_if_head_first(problem: Problem) -> None:
    """Warns where q ``[B, T, H, K]`` has fewer tokens than heads, the mark of a head-first
    ``[B, H, T, K]`` tensor passed where a sequence-first one belongs (it would run, on the
    wrong axes). The shapes are legal, so a warning only."""
    if 0 < problem.T < problem.H:
        warnings.warn(f"q has T = {problem.T} tokens but H = {problem.H} heads: if it is head-first "
                      f"[B, H, T, K], transpose it to [B, T, H, K] (the layout every input takes)",
                      UserWarning, stacklevel=CALLER_STACKLEVEL)


def validate_states_dtype(intermediate_states_dtype) -> None:
    """``intermediate_states_dtype`` of ``chunk_kda``: None (q's dtype, as FLA returns them) or a
    dtype the states may be returned in."""
    if intermediate_states_dtype is not None and intermediate_states_dtype not in INPUT_DTYPES:
        raise TypeError(f"intermediate_states_dtype must be None (q's dtype) or one of "
                        f"({', '.join(_dtype_name(d) for d in INPUT_DTYPES)}), got {intermediate_states_dtype!r}")


def cast_intermediate_states(result: tuple, intermediate_states_dtype) -> tuple:
    """``(o, final_state, h)`` with ``h`` (computed in float32) in ``intermediate_states_dtype``,
    or in o's dtype, which is q's, where that is None; other results pass through."""
    if len(result) != 3:
        return result
    o, final_state, h = result
    return o, final_state, h.to(intermediate_states_dtype or o.dtype)


# ----------------------------------------------------------------------------- state pools

def validate_final_state_dtype(final_state_dtype) -> None:
    """``final_state_dtype``: None (float32) or the dtype a new final state is stored in."""
    if final_state_dtype is not None and final_state_dtype not in STATE_DTYPES:
        raise TypeError(f"final_state_dtype must be None (float32) or one of "
                        f"({', '.join(_dtype_name(d) for d in STATE_DTYPES)}), got {final_state_dtype!r}")


def validate_inplace_state(initial_state) -> None:
    """``inplace_final_state=True``: the state (or pool) the final state overwrites."""
    if initial_state is None:
        raise ValueError("inplace_final_state=True requires initial_state (updated in place)")
    if not initial_state.is_contiguous():
        raise ValueError("inplace_final_state=True requires a contiguous initial_state (a pool's slots "
                         "are addressed at a stride of HV * K * V elements)")
    if initial_state.requires_grad and torch.is_grad_enabled():
        raise ValueError("inplace_final_state=True would overwrite initial_state, which requires grad, "
                         "in a write autograd cannot record; pass initial_state.detach() or call under "
                         "torch.no_grad()")


def validate_state_pool(name: str, pool, HV: int, K: int, V: int, state_v_first: bool,
                        device: torch.device, indices_name: str) -> int:
    """A state pool ``[P, HV, K, V]`` (``[P, HV, V, K]`` with ``state_v_first``), P >= 1, of a
    state dtype on ``device``; returns P."""
    _expect_tensor(name, pool)
    slot = (HV, V, K) if state_v_first else (HV, K, V)
    if pool.dim() != 4 or pool.shape[0] < 1 or tuple(pool.shape[1:]) != slot:
        layout = '[P, HV, V, K] (state_v_first=True)' if state_v_first else '[P, HV, K, V]'
        raise ValueError(f"{name} must be a state pool {layout} = [P, {', '.join(map(str, slot))}] "
                         f"with P >= 1 slots ({indices_name} picks a sequence's slot), "
                         f"got {list(pool.shape)}")
    validate_state(name, pool, pool.shape[0], HV, K, V, state_v_first, device)
    return pool.shape[0]


def validate_slot_indices(name: str, indices, N: int, device: torch.device,
                          columns: int | None = None) -> None:
    """Slot indices: an int32/int64 tensor ``[N]`` on ``device``, or ``[N, columns]`` where
    ``columns`` is given (speculative decoding: at least as many as a sequence's tokens)."""
    _expect_tensor(name, indices)
    if indices.dtype not in INDEX_DTYPES:
        raise TypeError(f"{name} must be int32 or int64, got {_dtype_name(indices.dtype)}")
    if columns is None:
        _expect_shape(name, indices, (N,), f'[N] with N = {N} sequences')
    elif indices.dim() != 2 or indices.shape[0] != N or indices.shape[1] < max(columns, 1):
        raise ValueError(f"{name} must have shape [N, T_idx] with N = {N} sequences and T_idx >= "
                         f"{max(columns, 1)} (a slot for the state after each token), got {list(indices.shape)}")
    if indices.device != device:
        raise ValueError(f"{name} must be on {device} like q, got {indices.device}")


def refuse_shared_slots(name: str, indices: torch.Tensor) -> None:
    """Two sequences writing one slot would race: refused where the indices can be read without
    a device sync (on the CPU) and outside a ``torch.compile`` trace (which cannot branch on
    their values). Negative entries are padding and may repeat."""
    if indices.device.type != 'cpu' or torch.compiler.is_compiling():
        return
    live = indices[indices >= 0]
    unique = torch.unique(live)
    if unique.numel() != live.numel():
        counts = torch.stack([(live == u).sum() for u in unique])
        dup = unique[counts > 1].tolist()
        raise ValueError(f"{name} gives slots {dup} to more than one sequence (or token): each live "
                         f"slot (>= 0) may appear once")


def validate_num_accepted(num_accepted_tokens, N: int, columns: int, device: torch.device) -> None:
    """``num_accepted_tokens`` ``[N]`` int32/int64 on ``device``; where on the CPU, every entry in
    [1, columns] (on a GPU a count outside reads as a slot outside the pool: NaN outputs)."""
    _expect_tensor('num_accepted_tokens', num_accepted_tokens)
    if num_accepted_tokens.dtype not in INDEX_DTYPES:
        raise TypeError(f"num_accepted_tokens must be int32 or int64, got "
                        f"{_dtype_name(num_accepted_tokens.dtype)}")
    _expect_shape('num_accepted_tokens', num_accepted_tokens, (N,), f'[N] with N = {N} sequences')
    if num_accepted_tokens.device != device:
        raise ValueError(f"num_accepted_tokens must be on {device} like q, got {num_accepted_tokens.device}")
    if device.type == 'cpu' and N > 0:
        low, high = int(num_accepted_tokens.min()), int(num_accepted_tokens.max())
        if low < 1 or high > columns:
            raise ValueError(f"num_accepted_tokens must lie in [1, {columns}] (T_idx, the columns of "
                             f"ssm_state_indices), got values in [{low}, {high}]")


def validate_pool_prefill(problem: Problem, device: torch.device, initial_state, state_v_first: bool,
                          initial_state_indices, has_initial_state, inplace_final_state,
                          final_state_dtype, needs_grad: bool) -> None:
    """``chunk_kda``'s serving arguments (docs/API.md, "State pools"): a pool with
    ``initial_state_indices`` ``[N]``, ``has_initial_state`` ``[N]`` bool, ``inplace_final_state``,
    ``final_state_dtype``. The pool is written by the kernels: forward only."""
    _expect_bool('inplace_final_state', inplace_final_state)
    validate_final_state_dtype(final_state_dtype)
    if has_initial_state is not None and initial_state_indices is None:
        raise ValueError("has_initial_state requires initial_state_indices (it says which slots are read)")
    if initial_state_indices is not None:
        if not inplace_final_state:
            raise ValueError("initial_state_indices requires inplace_final_state=True: each sequence "
                             "reads and writes its slot of the state pool initial_state")
        if initial_state is None:
            raise ValueError("initial_state_indices requires initial_state (the state pool [P, HV, K, V])")
        validate_state_pool('initial_state', initial_state, problem.HV, problem.K, problem.V, state_v_first,
                            device, 'initial_state_indices')
        validate_slot_indices('initial_state_indices', initial_state_indices, problem.N, device)
        if has_initial_state is not None:
            _expect_tensor('has_initial_state', has_initial_state)
            if has_initial_state.dtype != torch.bool:
                raise TypeError(f"has_initial_state must be a bool tensor, got {_dtype_name(has_initial_state.dtype)}")
            _expect_shape('has_initial_state', has_initial_state, (problem.N,), f'[N] with N = {problem.N} sequences')
            if has_initial_state.device != device:
                raise ValueError(f"has_initial_state must be on {device} like q, got {has_initial_state.device}")
        refuse_shared_slots('initial_state_indices', initial_state_indices)
    if inplace_final_state:
        validate_inplace_state(initial_state)
        if needs_grad:
            raise ValueError("inplace_final_state=True is forward only (the kernels write the state in "
                             "place, which autograd cannot record): call under torch.no_grad() or with "
                             "inputs that do not require grad")
        if final_state_dtype is not None:
            raise ValueError("final_state_dtype is for a new final state; with inplace_final_state=True "
                             "the final state takes initial_state's dtype")
