"""``kda_decode_step``: the KDA layer's decode step, one token per sequence, from the outputs of
its input projections to the input of its output projection (``kernels/fused_decode_step.py``
states the math): the three short convolutions with their states, SiLU, q/k l2norm, the gate
and beta activations, the KDA step with its state in place, and the sigmoid-gated RMS norm.

Where the kernels run it is two launches (one without convolutions) that allocate nothing when
``out`` and ``workspace`` are given, so the step can be captured in a CUDA graph. CPU tensors
otherwise take ``decode_step_reference``, the same step composed of the PyTorch references.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.autograd.graph import increment_version

from kda.kernels.fused_decode_step import decode_conv_kernel, decode_step_kernel
from kda.ops.gated_norm import gated_rms_norm_reference
from kda.ops.short_conv import MAX_CONV_SIZE, short_conv_update_reference
from kda.ops.utils import cdiv, next_pow2, on_q_device, use_kernels
from kda.ops.validation import (INPUT_DTYPES, MAX_HEAD_DIM, _expect_bool, _expect_dtype, _expect_tensor,
                                validate_activations)
from kda.reference import naive_recurrent_kda


@dataclass(frozen=True)
class DecodeWorkspace:
    """float32 rows the convolution launch hands to the step launch: ``q``, ``k`` ``[N, H*K]``,
    ``v`` ``[N, HV*V]``. Allocate once (``DecodeWorkspace.empty``) and reuse every step."""
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor

    @staticmethod
    def empty(N: int, key_dim: int, value_dim: int, device) -> DecodeWorkspace:
        def make(d):
            return torch.empty(N, d, dtype=torch.float32, device=device)
        return DecodeWorkspace(make(key_dim), make(key_dim), make(value_dim))


@dataclass(frozen=True)
class StepShape:
    N: int
    H: int
    HV: int
    K: int
    V: int
    W: int          # convolution size, 0 without convolutions


def _row_input(name, x, N, width, dtype, device):
    _expect_tensor(name, x)
    if x.dtype != dtype:
        raise TypeError(f"{name} must have q's dtype {dtype}, got {x.dtype}")
    if tuple(x.shape) != (N, 1, width):
        raise ValueError(f"{name} must have shape [N, 1, {width}] = [{N}, 1, {width}] "
                         f"(one token per sequence), got {list(x.shape)}")
    if x.device != device:
        raise ValueError(f"{name} must be on {device} like q, got {x.device}")


def _in_place(name, x, shape, dtype, device, meaning):
    _expect_tensor(name, x)
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {list(shape)} ({meaning}), got {list(x.shape)}")
    if x.dtype != dtype:
        raise TypeError(f"{name} must have dtype {dtype}, got {x.dtype}")
    if x.device != device:
        raise ValueError(f"{name} must be on {device} like q, got {x.device}")
    if not x.is_contiguous():
        raise ValueError(f"{name} is updated in place and must be contiguous")
    if x.requires_grad and torch.is_grad_enabled():
        raise ValueError(f"{name} is updated in place and must not require grad while grad mode is on")


def _conv_triplet(name, x):
    if not isinstance(x, (tuple, list)) or len(x) != 3:
        raise TypeError(f"{name} must be a tuple of three tensors (q, k, v), got {type(x).__name__}")
    return tuple(x)


def validate_decode_step(q, k, v, g, beta, gate, recurrent_state, A_log, dt_bias, norm_weight, norm_eps,
                         conv_states, conv_weights, conv_biases, lower_bound, allow_neg_eigval, scale,
                         out, workspace) -> StepShape:
    _expect_tensor('q', q)
    _expect_dtype('q', q, INPUT_DTYPES)
    if q.dim() != 3 or q.shape[1] != 1:
        raise ValueError(f"q must be [N, 1, H*K] (one token per sequence), got shape {list(q.shape)}")
    _expect_tensor('recurrent_state', recurrent_state)
    if recurrent_state.dim() != 4:
        raise ValueError(f"recurrent_state must be [N, HV, K, V], got shape {list(recurrent_state.shape)}")
    N, HV, K, V = recurrent_state.shape
    if q.shape[0] != N:
        raise ValueError(f"q has {q.shape[0]} sequences but recurrent_state has N = {N}")
    if not (1 <= K <= MAX_HEAD_DIM and 1 <= V <= MAX_HEAD_DIM):
        raise ValueError(f"K and V must be in 1..{MAX_HEAD_DIM}, got recurrent_state [N, HV, K, V] = "
                         f"{list(recurrent_state.shape)}")
    if q.shape[2] % K:
        raise ValueError(f"q's last dimension {q.shape[2]} must be H * K with K = {K} (recurrent_state)")
    H = q.shape[2] // K
    if H < 1 or HV % H:
        raise ValueError(f"the value heads HV = {HV} must be a positive multiple of the query heads H = {H}")
    dt, dev = q.dtype, q.device
    _in_place('recurrent_state', recurrent_state, (N, HV, K, V), torch.float32, dev, '[N, HV, K, V]')
    for name, x, width in (('k', k, H * K), ('v', v, HV * V), ('g', g, HV * K), ('beta', beta, HV),
                           ('gate', gate, HV * V)):
        _row_input(name, x, N, width, dt, dev)
    validate_activations(HV, K, dev, True, A_log, dt_bias, False, lower_bound, True, allow_neg_eigval)
    _expect_tensor('norm_weight', norm_weight)
    _expect_dtype('norm_weight', norm_weight, INPUT_DTYPES)
    if tuple(norm_weight.shape) != (V,) or norm_weight.device != dev:
        raise ValueError(f"norm_weight must be [{V}] on {dev}, got {list(norm_weight.shape)} on {norm_weight.device}")
    if isinstance(norm_eps, bool) or not isinstance(norm_eps, (int, float)) or not (
            math.isfinite(norm_eps) and norm_eps > 0):
        raise ValueError(f"norm_eps must be a positive finite number, got {norm_eps!r}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        raise TypeError(f"scale must be a number or None, got {type(scale).__name__}")
    W = _validate_convs(conv_states, conv_weights, conv_biases, N, H * K, HV * V, dev)
    if out is not None:
        _in_place('out', out, (N, 1, HV * V), dt, dev, '[N, 1, HV*V]')
    if workspace is not None:
        if not isinstance(workspace, DecodeWorkspace):
            raise TypeError(f"workspace must be a DecodeWorkspace, got {type(workspace).__name__}")
        for name, x, width in (('workspace.q', workspace.q, H * K), ('workspace.k', workspace.k, H * K),
                               ('workspace.v', workspace.v, HV * V)):
            _in_place(name, x, (N, width), torch.float32, dev, f'[N, {width}]')
    return StepShape(N, H, HV, K, V, W)


def _validate_convs(conv_states, conv_weights, conv_biases, N, key_dim, value_dim, dev) -> int:
    given = [x is not None for x in (conv_states, conv_weights)]
    if not any(given):
        if conv_biases is not None:
            raise ValueError("conv_biases was given without conv_weights and conv_states")
        return 0
    if not all(given):
        raise ValueError("conv_states and conv_weights go together: pass both (short convolutions) or neither")
    states = _conv_triplet('conv_states', conv_states)
    weights = _conv_triplet('conv_weights', conv_weights)
    biases = _conv_triplet('conv_biases', conv_biases) if conv_biases is not None else (None,) * 3
    W = None
    for which, state, weight, bias, D in zip('qkv', states, weights, biases, (key_dim, key_dim, value_dim)):
        _expect_tensor(f'conv_weights[{which}]', weight)
        _expect_dtype(f'conv_weights[{which}]', weight, INPUT_DTYPES)
        w_size = weight.shape[-1] if weight.dim() in (2, 3) else -1
        if weight.dim() not in (2, 3) or weight.numel() != D * w_size or weight.shape[0] != D:
            raise ValueError(f"conv_weights[{which}] must be [{D}, W] or [{D}, 1, W], got {list(weight.shape)}")
        if W is None:
            W = w_size
        if w_size != W or not 1 <= W <= MAX_CONV_SIZE:
            raise ValueError(f"the three convolutions must share one size W in 1..{MAX_CONV_SIZE}, "
                             f"got conv_weights[{which}] {list(weight.shape)}")
        if weight.device != dev:
            raise ValueError(f"conv_weights[{which}] must be on {dev} like q, got {weight.device}")
        _expect_tensor(f'conv_states[{which}]', state)
        _expect_dtype(f'conv_states[{which}]', state, INPUT_DTYPES)
        _in_place(f'conv_states[{which}]', state, (N, D, W), state.dtype, dev, '[N, D, W]')
        if bias is not None:
            _expect_tensor(f'conv_biases[{which}]', bias)
            if tuple(bias.shape) != (D,) or bias.device != dev:
                raise ValueError(f"conv_biases[{which}] must be [{D}] on {dev}, "
                                 f"got {list(bias.shape)} on {bias.device}")
    if (biases[0] is None) != (biases[1] is None) or (biases[0] is None) != (biases[2] is None):
        raise ValueError("conv_biases must hold three tensors or be None")
    return W


def decode_step_reference(q, k, v, g, beta, gate, recurrent_state, *, A_log, dt_bias, norm_weight,
                          norm_eps, conv_states, conv_weights, conv_biases, lower_bound, allow_neg_eigval,
                          scale):
    """The step composed of the PyTorch references (states updated in place); returns
    ``[N, 1, HV*V]`` in q's dtype. Float64 inputs and states compute in float64."""
    N, HV, K, V = recurrent_state.shape
    H = q.shape[2] // K
    rows = [x[:, 0] for x in (q, k, v)]
    if conv_states is None:
        rows = [F.silu(x.float() if x.dtype != torch.float64 else x) for x in rows]
    else:
        biases = conv_biases if conv_biases is not None else (None,) * 3
        rows = [short_conv_update_reference(x, s, w, b) for x, s, w, b in zip(rows, conv_states, conv_weights, biases)]
    ct = torch.float64 if recurrent_state.dtype == torch.float64 else torch.float32
    qs, ks = (x.to(ct).view(N, 1, H, K) for x in rows[:2])
    vs = rows[2].to(ct).view(N, 1, HV, V)
    log_decay = _log_decay(g.to(ct).view(N, 1, HV, K), A_log, dt_bias, lower_bound)
    b = torch.sigmoid(beta.to(ct)) * (2 if allow_neg_eigval else 1)
    o, ht = naive_recurrent_kda(qs, ks, vs, log_decay, b, scale, recurrent_state.to(ct), True,
                                use_qk_l2norm_in_kernel=True)
    recurrent_state.copy_(ht)
    y = gated_rms_norm_reference(o, gate.to(ct).view(N, 1, HV, V), norm_weight.to(ct), norm_eps)
    return y.reshape(N, 1, HV * V).to(q.dtype)


def _log_decay(g, A_log, dt_bias, lower_bound):
    """The in-kernel gate of docs/API.md in g's dtype (``kda.ops.gate.activate_gate`` computes
    in float32; this reference keeps float64 inputs in float64)."""
    HV, K = g.shape[-2:]
    x = g if dt_bias is None else g + dt_bias.to(g.dtype).view(HV, K)
    a = None if A_log is None else A_log.to(g.dtype).reshape(HV, 1).exp()
    if lower_bound is None:
        return -a * F.softplus(x)
    return lower_bound * torch.sigmoid(x if a is None else a * x)


@on_q_device
def kda_decode_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    gate: torch.Tensor,
    recurrent_state: torch.Tensor,
    *,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    norm_weight: torch.Tensor,
    norm_eps: float = 1e-5,
    conv_states: tuple | None = None,
    conv_weights: tuple | None = None,
    conv_biases: tuple | None = None,
    lower_bound: float | None = None,
    allow_neg_eigval: bool = False,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    workspace: DecodeWorkspace | None = None,
) -> torch.Tensor:
    """One decode step of the KDA layer for ``N`` sequences of one token each.

    Args:
        q, k: ``[N, 1, H*K]`` projections (before the convolution); v ``[N, 1, HV*V]``;
            g ``[N, 1, HV*K]`` the raw gate (``f_proj``'s output); beta ``[N, 1, HV]`` its logits
            (``b_proj``'s); gate ``[N, 1, HV*V]`` the output gate (``g_proj``'s). One dtype.
        recurrent_state: float32 ``[N, HV, K, V]``, updated in place.
        A_log ``[HV]``, dt_bias ``[HV*K]`` (float32), lower_bound: the gate (docs/API.md).
        norm_weight ``[V]``, norm_eps: the output norm.
        conv_states, conv_weights, conv_biases: tuples (q, k, v) of the windows ``[N, D, W]``
            (updated in place), the weights ``[D, W]`` / ``[D, 1, W]`` and the biases (or None);
            without them q, k and v only go through SiLU.
        scale: default ``K ** -0.5``. out: ``[N, 1, HV*V]`` to write into. workspace: the
            convolutions' output rows (``DecodeWorkspace``).

    Returns ``out`` (new when not given). With ``out`` and ``workspace`` nothing is allocated.
    No autograd: the states are written in place (inference only).
    """
    _expect_bool('allow_neg_eigval', allow_neg_eigval)
    shape = validate_decode_step(q, k, v, g, beta, gate, recurrent_state, A_log, dt_bias, norm_weight, norm_eps,
                                 conv_states, conv_weights, conv_biases, lower_bound, allow_neg_eigval, scale,
                                 out, workspace)
    scale = shape.K ** -0.5 if scale is None else float(scale)
    written = [recurrent_state] + (list(conv_states) if conv_states is not None else [])
    if not use_kernels(q):
        with torch.no_grad():
            y = decode_step_reference(q, k, v, g, beta, gate, recurrent_state, A_log=A_log, dt_bias=dt_bias,
                                      norm_weight=norm_weight, norm_eps=norm_eps, conv_states=conv_states,
                                      conv_weights=conv_weights, conv_biases=conv_biases, lower_bound=lower_bound,
                                      allow_neg_eigval=allow_neg_eigval, scale=scale)
        if out is not None:
            out.copy_(y)
            y = out
        return y
    N, H, HV, K, V, W = shape.N, shape.H, shape.HV, shape.K, shape.V, shape.W
    if out is None:
        out = q.new_empty(N, 1, HV * V)
    rows = [x.view(N, -1) if x.is_contiguous() else x.reshape(N, -1) for x in (q, k, v, g, beta, gate)]
    if W:
        if workspace is None:
            workspace = DecodeWorkspace.empty(N, H * K, HV * V, q.device)
        weights = [w.detach().reshape(w.shape[0], W).contiguous() for w in conv_weights]
        biases = ([b.detach().contiguous() for b in conv_biases] if conv_biases is not None else [None] * 3)
        BD = 32
        decode_conv_kernel[(cdiv(max(H * K, HV * V), BD), N, 3)](
            *rows[:3], *conv_states, *weights, *biases, workspace.q, workspace.k, workspace.v,
            DK=H * K, DV=HV * V, W=W, BD=BD, BW=next_pow2(W, 1), HAS_BIAS=conv_biases is not None)
        rows[:3] = [workspace.q, workspace.k, workspace.v]
    params = [None if t is None else t.detach().contiguous() for t in (A_log, dt_bias, norm_weight)]
    decode_step_kernel[(N * HV,)](
        *rows, recurrent_state, *params, out, scale, float(lower_bound or 0.0), float(norm_eps),
        H=H, HV=HV, K=K, V=V, BK=next_pow2(K), BV=next_pow2(V),
        SILU_QKV=W == 0, GATE='softplus' if lower_bound is None else 'sigmoid',
        BETA='sigmoid2' if allow_neg_eigval else 'sigmoid',
        num_warps=8 if K * V > 8192 else 4)
    for t in written + [out]:
        increment_version(t)
    return out
