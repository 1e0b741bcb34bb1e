"""``use_qk_l2norm_in_kernel``: launchers of the L2 normalization of q and k and of its gradient
(``ChunkKDAFunction`` keeps the normalized q and k and their inverse norms for the backward)."""
from __future__ import annotations

import torch

from kda.kernels.l2norm import l2norm_bwd_kernel, l2norm_fwd_kernel
from kda.ops.utils import cdiv, next_pow2

# Rows per program: 16 rows of up to 256 float32 values is 32 registers a thread at 4 warps.
ROWS = 16


def l2norm_fwd(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x / sqrt(sum(x^2) + 1e-6), 1 / sqrt(sum(x^2) + 1e-6))`` over the last dim; x contiguous."""
    D = x.shape[-1]
    n_rows = x.numel() // D
    y = torch.empty_like(x)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    l2norm_fwd_kernel[(cdiv(n_rows, ROWS),)](x, y, rstd, n_rows, D=D, BR=ROWS, BD=next_pow2(D))
    return y, rstd


def l2norm_bwd(y: torch.Tensor, rstd: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """Gradient in x of ``(y, rstd) = l2norm_fwd(x)``, from those two outputs and dy (the gradient
    of y); in y's dtype. y contiguous."""
    D = y.shape[-1]
    n_rows = y.numel() // D
    dx = torch.empty_like(y)
    l2norm_bwd_kernel[(cdiv(n_rows, ROWS),)](y, rstd, dy.contiguous(), dx, n_rows, D=D, BR=ROWS,
                                                   BD=next_pow2(D))
    return dx
