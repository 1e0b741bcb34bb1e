"""Validation of every public call, before any kernel runs.

Each malformed call raises ``TypeError`` (not a tensor, wrong dtype) or ``ValueError`` (shape,
length, head grouping, cu_seqlens, option combination) whose message names the argument, what it
got and what it expects. Nothing is reshaped here: the launchers receive exactly what the user gave.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_HEAD_DIM = 256
CHUNK_SIZES = (32, 64)
FLOAT32_MAX = torch.finfo(torch.float32).max


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


def validate_cu_seqlens(cu_seqlens, B: int, T: int, device: torch.device,
                        cu_seqlens_cpu=None) -> tuple[int, list[int] | None]:
    """Checks ``cu_seqlens`` and returns (number of sequences, host copy of the offsets or None).

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
    _expect_dtype(name, state, (torch.float32,))
    if state.device != device:
        raise ValueError(f"{name} must be on {device} like q, got {state.device}")


def validate_inputs(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                    state_v_first, use_qk_l2norm_in_kernel, cu_seqlens_cpu=None,
                    check_state: bool = True) -> tuple[Problem, list[int] | None]:
    """Checks the arguments common to ``chunk_kda`` and ``fused_recurrent_kda``.

    Returns the problem sizes and, for varlen calls, the host copy of ``cu_seqlens``.
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
    _expect_shape('beta', beta, (B, T, HV), '[B, T, HV]')
    for name, dim in (('K (the last dim of q and k)', K), ('V (the last dim of v)', V)):
        if not 1 <= dim <= MAX_HEAD_DIM:
            raise ValueError(f"head dim {name} must be in [1, {MAX_HEAD_DIM}], got {dim}")
    _expect_dtype('q', q, INPUT_DTYPES)
    for name, x in (('k', k), ('v', v)):
        if x.dtype != q.dtype:
            raise TypeError(f"{name} must have q's dtype {_dtype_name(q.dtype)}, got {_dtype_name(x.dtype)}")
    for name, x in (('g', g), ('beta', beta)):
        if x.dtype not in (q.dtype, torch.float32):
            raise TypeError(f"{name} must have q's dtype {_dtype_name(q.dtype)} or float32, "
                            f"got {_dtype_name(x.dtype)}")
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
    N, offsets = validate_cu_seqlens(cu_seqlens, B, T, device, cu_seqlens_cpu)
    if check_state:
        validate_state('initial_state', initial_state, N, HV, K, V, state_v_first, device)
    return Problem(B, T, H, HV, K, V, N, float(scale)), offsets


def validate_chunk_size(chunk_size) -> int:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size not in CHUNK_SIZES:
        raise ValueError(f"chunk_size must be one of {CHUNK_SIZES}, got {chunk_size!r}")
    return chunk_size


def validate_activations(HV: int, K: int, device: torch.device, use_gate_in_kernel, A_log, dt_bias,
                         safe_gate, lower_bound, use_beta_sigmoid_in_kernel, allow_neg_eigval) -> None:
    """Checks the in-kernel gate and beta options of docs/API.md and the combinations they allow."""
    for name, x in (('use_gate_in_kernel', use_gate_in_kernel), ('safe_gate', safe_gate),
                    ('use_beta_sigmoid_in_kernel', use_beta_sigmoid_in_kernel),
                    ('allow_neg_eigval', allow_neg_eigval)):
        _expect_bool(name, x)
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("allow_neg_eigval=True requires use_beta_sigmoid_in_kernel=True "
                         "(beta becomes 2 * sigmoid(beta))")
    if not use_gate_in_kernel:
        for name, x in (('A_log', A_log), ('dt_bias', dt_bias), ('lower_bound', lower_bound)):
            if x is not None:
                raise ValueError(f"{name} was given but use_gate_in_kernel=False; it would be ignored")
        # safe_gate=True with g given: the caller's promise that g is bounded, which FLA accepts
        # (it picks a faster path on it). The kernels here are exact for any g <= 0, so it
        # changes nothing; refusing it would break model code that passes it.
        return
    if lower_bound is not None:
        if isinstance(lower_bound, bool) or not isinstance(lower_bound, (int, float)):
            raise TypeError(f"lower_bound must be a float or None, got {type(lower_bound).__name__}")
        if not -5 <= lower_bound < 0:
            raise ValueError(f"lower_bound must lie in [-5, 0), got {lower_bound}")
    elif A_log is None:
        raise ValueError("use_gate_in_kernel=True needs A_log (or lower_bound with A_log optional)")
    if safe_gate and lower_bound is None:
        raise ValueError("safe_gate=True requires lower_bound (the bound it promises)")
    if A_log is not None:
        _expect_tensor('A_log', A_log)
        _expect_shape('A_log', A_log, (HV,), '[HV]')
        _expect_dtype('A_log', A_log, (torch.float32,))
        if A_log.device != device:
            raise ValueError(f"A_log must be on {device} like q, got {A_log.device}")
    if dt_bias is not None:
        _expect_tensor('dt_bias', dt_bias)
        _expect_shape('dt_bias', dt_bias, (HV * K,), '[HV * K]')
        _expect_dtype('dt_bias', dt_bias, (torch.float32,))
        if dt_bias.device != device:
            raise ValueError(f"dt_bias must be on {device} like q, got {dt_bias.device}")
