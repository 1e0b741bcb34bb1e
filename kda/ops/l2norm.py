"""``use_qk_l2norm_in_kernel``: launchers of the L2 normalization of q and k and of its gradient
(``ChunkKDAFunction`` calls them and keeps only the inverse norms for the backward)."""
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


def l2norm_bwd(x: torch.Tensor, rstd: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """Gradient of ``l2norm_fwd``'s first output, from x and its saved ``rstd``."""
    D = x.shape[-1]
    n_rows = x.numel() // D
    dx = torch.empty_like(x)
    l2norm_bwd_kernel[(cdiv(n_rows, ROWS),)](x, rstd, dy.contiguous(), dx, n_rows, D=D, BR=ROWS,
                                                   BD=next_pow2(D))
    return dx
