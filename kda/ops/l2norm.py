"""``use_qk_l2norm_in_kernel`` in training: launchers of the L2 normalization of q and k and of its
gradient (``ChunkKDAFunction`` keeps the normalized q and k and their inverse norms for the
backward; inference needs neither: the pair products normalize the rows they read,
``kernels/chunk_intra.py``). q and k go through one launch (H200, (8, 4096, 16),
kernel time: forward 0.128 -> 0.126 ms, backward 0.249 -> 0.247; the launch gap between two is
not in those figures)."""
from __future__ import annotations

import torch

from kda.kernels.l2norm import l2norm_bwd_kernel, l2norm_fwd_kernel
from kda.ops.utils import cdiv, next_pow2

# Rows per program: 16 rows of up to 256 float32 values is 32 registers a thread at 4 warps.
ROWS = 16


def _grid(x: torch.Tensor) -> tuple[int, int]:
    """Programs of ROWS rows of q's or k's ``x.shape[-1]``-wide rows (axis 1: q or k)."""
    return cdiv(x.numel() // x.shape[-1], ROWS), 2


def l2norm_fwd(q: torch.Tensor, k: torch.Tensor) -> tuple[tuple[torch.Tensor, torch.Tensor],
                                                           tuple[torch.Tensor, torch.Tensor]]:
    """``((qn, rq), (kn, rk))``: ``x / sqrt(sum(x^2) + 1e-6)`` and ``1 / sqrt(sum(x^2) + 1e-6)``
    over the last dim, for q and k (contiguous, the same shape and dtype); r shaped
    ``x.shape[:-1]``, float32."""
    D = q.shape[-1]
    qn, kn = torch.empty_like(q), torch.empty_like(k)
    rq, rk = (torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device) for _ in range(2))
    l2norm_fwd_kernel[_grid(q)](q, qn, rq, k, kn, rk, q.numel() // D, D=D, BR=ROWS, BD=next_pow2(D))
    return (qn, rq), (kn, rk)


def l2norm_bwd(qn, rq, dqn, kn, rk, dkn) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients in q and k of ``l2norm_fwd``, from its outputs and the gradients ``dqn``, ``dkn``
    of qn and kn; in qn's dtype. qn, kn contiguous."""
    D = qn.shape[-1]
    dq, dk = torch.empty_like(qn), torch.empty_like(kn)
    l2norm_bwd_kernel[_grid(qn)](qn, rq, dqn.contiguous(), dq, kn, rk, dkn.contiguous(), dk,
                                qn.numel() // D, D=D, BR=ROWS, BD=next_pow2(D))
    return dq, dk
