"""``use_qk_l2norm_in_kernel``: launchers of the L2 normalization of q and k and of its gradient
(``ChunkKDAFunction`` keeps the normalized q and k and their inverse norms for the backward), and
of the inverse norms alone (``l2norm_rstd``: inference, where the pair products normalize the rows
themselves, ``kernels/chunk_intra.py``). q and k go through one launch (H200, (8, 4096, 16),
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
    qn, kn = torch.empty_like(q), torch.empty_like(k)
    rq, rk = _forward(q, k, qn, kn)
    return (qn, rq), (kn, rk)


def l2norm_rstd(q: torch.Tensor, k: torch.Tensor,
                out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rq, rk)`` of ``l2norm_fwd``, the same bits, without forming qn and kn; into ``out``
    (contiguous float32 ``(rq, rk)``) when given. Each row's norm is its own, so rows cut into
    several calls get the bits of one call where every part starts as aligned as the whole, as at
    whole chunks (64 H D elements). Elsewhere the GPU's bits may differ in the last place: Triton
    compiles a build per 16-byte alignment of the pointers, and the tile's layout, so the order of
    a row's sum, follows it (triton 3.6, sm_90, D = 60, offline: 4 values a thread over 16 lanes
    aligned, 1 over 32 lanes and two warps not; the H200 differed at a cut of 99 rows of 3 heads)."""
    return _forward(q, k, None, None, out)


def _forward(q, k, qn, kn, out: tuple[torch.Tensor, torch.Tensor] | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Launches the forward kernel, writing qn, kn unless None; returns the inverse norms (``out``
    if given)."""
    D = q.shape[-1]
    if out is None:
        out = tuple(torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device) for _ in range(2))
    rq, rk = out
    l2norm_fwd_kernel[_grid(q)](q, qn, rq, k, kn, rk, q.numel() // D, D=D, BR=ROWS, BD=next_pow2(D))
    return rq, rk


def l2norm_bwd(qn, rq, dqn, kn, rk, dkn) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients in q and k of ``l2norm_fwd``, from its outputs and the gradients ``dqn``, ``dkn``
    of qn and kn; in qn's dtype. qn, kn contiguous."""
    D = qn.shape[-1]
    dq, dk = torch.empty_like(qn), torch.empty_like(kn)
    l2norm_bwd_kernel[_grid(qn)](qn, rq, dqn.contiguous(), dq, kn, rk, dkn.contiguous(), dk,
                                qn.numel() // D, D=D, BR=ROWS, BD=next_pow2(D))
    return dq, dk
