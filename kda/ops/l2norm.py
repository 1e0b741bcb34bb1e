"""``use_qk_l2norm_in_kernel``: the L2 normalization of q and k as one differentiable op."""
from __future__ import annotations

import torch

from kda.kernels.l2norm import l2norm_bwd_kernel, l2norm_fwd_kernel
from kda.ops.utils import cdiv, next_pow2

# Rows per program: 16 rows of up to 256 float32 values is 32 registers a thread at 4 warps.
ROWS = 16


class L2NormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        x = x.contiguous()
        D = x.shape[-1]
        n_rows = x.numel() // D
        y = torch.empty_like(x)
        rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
        l2norm_fwd_kernel[(cdiv(n_rows, ROWS),)](x, y, rstd, n_rows, D=D, BR=ROWS, BD=next_pow2(D))
        ctx.save_for_backward(x, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, rstd = ctx.saved_tensors
        D = x.shape[-1]
        n_rows = x.numel() // D
        dx = torch.empty_like(x)
        l2norm_bwd_kernel[(cdiv(n_rows, ROWS),)](x, rstd, dy.contiguous(), dx, n_rows, D=D, BR=ROWS,
                                                       BD=next_pow2(D))
        return dx


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + 1e-6)`` over the last dim, in x's dtype (float32 inside)."""
    return L2NormFunction.apply(x)
