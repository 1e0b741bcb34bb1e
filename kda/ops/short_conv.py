"""``short_conv``: the causal depthwise short convolution (with SiLU) of the KDA layer's q, k and
v, with a state of the last ``W`` inputs for decoding (``kernels/short_conv.py`` states the math).

Where the kernels run (CUDA, or the interpreter) it is a Triton forward and backward; CPU tensors
otherwise take ``short_conv_reference``, differentiable by autograd and float64-capable.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kda.kernels.short_conv import short_conv_bwd_kernel, short_conv_fwd_kernel
from kda.ops.utils import contiguous, next_pow2, on_q_device, use_kernels
from kda.ops.validation import (INPUT_DTYPES, _expect_bool, _expect_dtype, _expect_tensor,
                                validate_cu_seqlens)

ACTIVATIONS = ('silu', None)
MAX_CONV_SIZE = 16
PARAM_DTYPES = INPUT_DTYPES + (torch.float64,)


def validate_short_conv(x, weight, bias, initial_state, output_final_state, cu_seqlens, activation,
                        reference: bool = False):
    """Checks a ``short_conv`` call; returns ``(N, W)``. ``reference`` admits float64 (the
    PyTorch reference)."""
    dtypes = PARAM_DTYPES if reference else INPUT_DTYPES
    _expect_tensor('x', x)
    _expect_dtype('x', x, dtypes)
    if x.dim() != 3:
        raise ValueError(f"x must be 3-D [B, T, D], got shape {list(x.shape)}")
    B, T, D = x.shape
    _expect_tensor('weight', weight)
    _expect_dtype('weight', weight, PARAM_DTYPES)
    if weight.dim() == 3 and weight.shape[1] == 1:
        weight = weight[:, 0]
    if weight.dim() != 2 or weight.shape[0] != D:
        raise ValueError(f"weight must be [D, W] or [D, 1, W] with D = {D} (x's channels), "
                         f"got shape {list(weight.shape)}")
    W = weight.shape[1]
    if not 1 <= W <= MAX_CONV_SIZE:
        raise ValueError(f"the convolution size W (weight's last dimension) must be in 1..{MAX_CONV_SIZE}, got {W}")
    if weight.device != x.device:
        raise ValueError(f"weight must be on {x.device} like x, got {weight.device}")
    if bias is not None:
        _expect_tensor('bias', bias)
        _expect_dtype('bias', bias, PARAM_DTYPES)
        if tuple(bias.shape) != (D,):
            raise ValueError(f"bias must have shape [{D}] (x's channels), got {list(bias.shape)}")
        if bias.device != x.device:
            raise ValueError(f"bias must be on {x.device} like x, got {bias.device}")
    _expect_bool('output_final_state', output_final_state)
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be 'silu' or None, got {activation!r}")
    N, _ = validate_cu_seqlens(cu_seqlens, B, T, x.device)
    if initial_state is not None:
        _expect_tensor('initial_state', initial_state)
        _expect_dtype('initial_state', initial_state, dtypes)
        if tuple(initial_state.shape) != (N, D, W):
            raise ValueError(f"initial_state must have shape [N, D, W] = [{N}, {D}, {W}], "
                             f"got {list(initial_state.shape)}")
        if initial_state.device != x.device:
            raise ValueError(f"initial_state must be on {x.device} like x, got {initial_state.device}")
    return N, W


def short_conv_reference(x, weight, bias=None, initial_state=None, output_final_state=False, *,
                         cu_seqlens=None, activation='silu'):
    """The convolution in PyTorch, per sequence (float64 inputs compute in float64; others in
    float32, returned in x's dtype). Same arguments and results as ``short_conv``."""
    N, W = validate_short_conv(x, weight, bias, initial_state, output_final_state, cu_seqlens, activation,
                               reference=True)
    B, T, D = x.shape
    ct = torch.float64 if x.dtype == torch.float64 else torch.float32
    w = weight.reshape(D, W).to(ct)
    b = None if bias is None else bias.to(ct)
    if cu_seqlens is None:
        spans = [(n, 0, T) for n in range(B)]
    else:
        offsets = cu_seqlens.tolist()
        spans = [(0, offsets[n], offsets[n + 1]) for n in range(N)]
    ys, states = [], []
    for n, (row, start, end) in enumerate(spans):
        xs = x[row, start:end].to(ct).t()                                    # [D, T_n]
        h0 = (initial_state[n].to(ct) if initial_state is not None
              else xs.new_zeros(D, W))
        window = torch.cat([h0, xs], dim=1)                                  # positions -W .. T_n - 1
        # z_t = sum_w weight[w] x_{t - (W - 1) + w}: window column t + 1 + w
        T_n = end - start
        z = sum(w[:, j:j + 1] * window[:, 1 + j:1 + j + T_n] for j in range(W))
        if b is not None:
            z = z + b[:, None]
        ys.append((F.silu(z) if activation == 'silu' else z).t())
        states.append(window[:, window.shape[1] - W:])
    y = torch.stack(ys) if cu_seqlens is None else torch.cat(ys)[None]
    final = None
    if output_final_state:
        final = torch.stack(states).to(x.dtype if initial_state is None else initial_state.dtype)
    return y.to(x.dtype), final


def _launch_fwd(x, weight, bias, h0, store_final, cu_seqlens, silu, W):
    B, T, D = x.shape
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    y = torch.empty_like(x)
    ht = x.new_empty(N, D, W, dtype=h0.dtype if h0 is not None else x.dtype) if store_final else None
    BD = min(next_pow2(D), 64)
    short_conv_fwd_kernel[(-(-D // BD), N)](
        x, weight, bias, y, h0, ht, cu_seqlens, T,
        D=D, W=W, BT=32, BD=BD, BW=next_pow2(W, 1), SILU=silu, HAS_BIAS=bias is not None,
        USE_H0=h0 is not None, STORE_HT=store_final, IS_VARLEN=cu_seqlens is not None)
    return y, ht


class ShortConvFunction(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x, weight, bias, h0, store_final, cu_seqlens, silu, W):
        y, ht = _launch_fwd(x, weight, bias, h0, store_final, cu_seqlens, silu, W)
        ctx.save_for_backward(x, weight, bias, h0, cu_seqlens)
        ctx.silu, ctx.W = silu, W
        if ht is not None:
            return y, ht
        return y, None

    @staticmethod
    def backward(ctx, dy, dht):
        x, weight, bias, h0, cu_seqlens = ctx.saved_tensors
        B, T, D = x.shape
        W = ctx.W
        N = B if cu_seqlens is None else cu_seqlens.numel() - 1
        dy, dht = contiguous(dy, dht)
        dx = torch.empty_like(x)
        dw = x.new_empty(N, D, W, dtype=torch.float32)
        db = x.new_empty(N, D, dtype=torch.float32) if bias is not None else None
        dh0 = torch.empty_like(h0) if h0 is not None else None
        BD = min(next_pow2(D), 64)
        short_conv_bwd_kernel[(-(-D // BD), N)](
            x, weight, bias, dy, h0, dht, dx, dw, db, dh0, cu_seqlens, T,
            D=D, W=W, BT=32, BD=BD, BW=next_pow2(W, 1), SILU=ctx.silu, HAS_BIAS=bias is not None,
            USE_H0=h0 is not None, USE_DHT=dht is not None, IS_VARLEN=cu_seqlens is not None)
        dweight = dw.sum(0).to(weight.dtype)
        dbias = db.sum(0).to(bias.dtype) if bias is not None else None
        return dx, dweight, dbias, dh0, None, None, None, None


@on_q_device
def short_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    *,
    cu_seqlens: torch.Tensor | None = None,
    activation: str | None = 'silu',
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Causal depthwise convolution of ``x`` ``[B, T, D]`` with ``weight`` ``[D, W]`` (or
    ``nn.Conv1d``'s ``[D, 1, W]``), plus ``bias`` ``[D]``, then SiLU (``activation=None``: none).

    ``initial_state`` ``[N, D, W]``: the ``W`` inputs before each sequence (zeros when None).
    Returns ``(y, final_state)``: ``y`` ``[B, T, D]`` in x's dtype; ``final_state`` the last ``W``
    inputs of each sequence ``[N, D, W]`` (in initial_state's dtype, else x's) with
    ``output_final_state``, else None. ``cu_seqlens`` ``[N + 1]`` packs N sequences into ``B = 1``
    (a sequence may be empty: its final state is its initial one). Differentiable in ``x``,
    ``weight``, ``bias`` and ``initial_state``, through ``final_state`` too.
    """
    N, W = validate_short_conv(x, weight, bias, initial_state, output_final_state, cu_seqlens, activation)
    if not use_kernels(x):
        return short_conv_reference(x, weight, bias, initial_state, output_final_state,
                                    cu_seqlens=cu_seqlens, activation=activation)
    w2 = weight.reshape(x.shape[2], W)
    x, w2, bias, h0, cu_seqlens = contiguous(x, w2, bias, initial_state, cu_seqlens)
    inputs = [t for t in (x, w2, bias, h0) if t is not None]
    if torch.is_grad_enabled() and any(t.requires_grad for t in inputs):
        y, ht = ShortConvFunction.apply(x, w2, bias, h0, output_final_state, cu_seqlens,
                                        activation == 'silu', W)
    else:
        y, ht = _launch_fwd(x, w2, bias, h0, output_final_state, cu_seqlens, activation == 'silu', W)
    return y, ht


def short_conv_update_reference(x, state, weight, bias=None, activation='silu'):
    """One decoding step in PyTorch: ``x`` ``[N, D]`` enters the window ``state`` ``[N, D, W]``
    (updated in place: shifted by one, ``x`` last); returns ``[N, D]`` in x's dtype."""
    D, W = x.shape[1], state.shape[2]
    ct = torch.float64 if x.dtype == torch.float64 else torch.float32
    window = torch.cat([state[:, :, 1:], x[:, :, None].to(state.dtype)], dim=2)
    state.copy_(window)
    z = (window.to(ct) * weight.reshape(D, W).to(ct)).sum(-1)
    if bias is not None:
        z = z + bias.to(ct)
    return (F.silu(z) if activation == 'silu' else z).to(x.dtype)


__all__ = ['short_conv', 'short_conv_reference', 'short_conv_update_reference']
