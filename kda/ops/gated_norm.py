"""``gated_rms_norm``: the sigmoid-gated RMS norm of the KDA layer's output, FLA's
``FusedRMSNormGated(activation='sigmoid')`` (``kernels/gated_norm.py`` states the math)::

    y = x * rsqrt(mean(x^2, -1) + eps) * weight * sigmoid(gate)

computed in float32 over the last dimension and returned in x's dtype. Where the kernels run it
is a Triton forward and backward; CPU tensors otherwise take ``gated_rms_norm_reference``
(differentiable by autograd, float64-capable).
"""
from __future__ import annotations

import math

import torch

from kda.kernels.gated_norm import gated_norm_bwd_kernel, gated_norm_fwd_kernel
from kda.ops.utils import cdiv, contiguous, next_pow2, on_q_device, use_kernels
from kda.ops.validation import INPUT_DTYPES, _expect_dtype, _expect_tensor

MAX_NORM_DIM = 4096


def validate_gated_norm(x, gate, weight, eps, reference: bool = False) -> None:
    dtypes = INPUT_DTYPES + ((torch.float64,) if reference else ())
    _expect_tensor('x', x)
    _expect_dtype('x', x, dtypes)
    if x.dim() < 1 or x.shape[-1] < 1:
        raise ValueError(f"x must have a last dimension of at least 1 element, got shape {list(x.shape)}")
    D = x.shape[-1]
    if D > MAX_NORM_DIM:
        raise ValueError(f"x's last dimension must be at most {MAX_NORM_DIM}, got {D}")
    _expect_tensor('gate', gate)
    _expect_dtype('gate', gate, dtypes)
    if gate.shape != x.shape:
        raise ValueError(f"gate must have x's shape {list(x.shape)}, got {list(gate.shape)}")
    _expect_tensor('weight', weight)
    _expect_dtype('weight', weight, INPUT_DTYPES + (torch.float64,))
    if tuple(weight.shape) != (D,):
        raise ValueError(f"weight must have shape [{D}] (x's last dimension), got {list(weight.shape)}")
    for name, t in (('gate', gate), ('weight', weight)):
        if t.device != x.device:
            raise ValueError(f"{name} must be on {x.device} like x, got {t.device}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (math.isfinite(eps) and eps > 0):
        raise ValueError(f"eps must be a positive finite number, got {eps!r}")


def gated_rms_norm_reference(x, gate, weight, eps=1e-5):
    """The norm in PyTorch (float64 inputs in float64, others in float32; x's dtype out)."""
    validate_gated_norm(x, gate, weight, eps, reference=True)
    ct = torch.float64 if x.dtype == torch.float64 else torch.float32
    xf = x.to(ct)
    xhat = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xhat * weight.to(ct) * torch.sigmoid(gate.to(ct))).to(x.dtype)


def _rows(D: int) -> tuple[int, int]:
    """(BR rows a program, BD): about 4096 elements a tile."""
    BD = next_pow2(D)
    return max(1, min(16, 4096 // BD)), BD


def _launch_fwd(x2, g2, weight, eps):
    """``(y, rstd)`` of rows ``x2`` ``[M, D]``."""
    M, D = x2.shape
    y = torch.empty_like(x2)
    rstd = x2.new_empty(M, dtype=torch.float32)
    BR, BD = _rows(D)
    gated_norm_fwd_kernel[(cdiv(M, BR),)](x2, g2, weight, y, rstd, float(eps), M, D=D, BR=BR, BD=BD)
    return y, rstd


class GatedNormFunction(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x2, g2, weight, eps):
        y, rstd = _launch_fwd(x2, g2, weight, eps)
        ctx.save_for_backward(x2, g2, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x2, g2, weight, rstd = ctx.saved_tensors
        M, D = x2.shape
        dy = dy.contiguous()
        BR, BD = _rows(D)
        grid = cdiv(M, BR)
        dx, dg = torch.empty_like(x2), torch.empty_like(g2)
        dw = x2.new_empty(grid, D, dtype=torch.float32)
        gated_norm_bwd_kernel[(grid,)](x2, g2, weight, rstd, dy, dx, dg, dw, M, D=D, BR=BR, BD=BD)
        return dx, dg, dw.sum(0).to(weight.dtype), None


@on_q_device
def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """``x * rsqrt(mean(x^2, -1) + eps) * weight * sigmoid(gate)`` over the last dimension ``D``:
    ``x`` and ``gate`` ``[..., D]`` (same shape), ``weight`` ``[D]``. Differentiable in all three."""
    validate_gated_norm(x, gate, weight, eps)
    if not use_kernels(x):
        return gated_rms_norm_reference(x, gate, weight, eps)
    shape, D = x.shape, x.shape[-1]
    x2, g2, w = contiguous(x.reshape(-1, D), gate.reshape(-1, D), weight)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (x, gate, weight)):
        return GatedNormFunction.apply(x2, g2, w, eps).view(shape)
    return _launch_fwd(x2, g2, w, eps)[0].view(shape)
