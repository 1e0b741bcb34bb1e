"""The in-chunk stage (``kernels/chunk_intra.py``): per chunk of ``BT`` tokens and value head,
with ``c_i = g_1 + ... + g_i`` the in-chunk cumulative log-decay (per key channel):

    gc        = c                                                   float32
    qt_i      = scale q_i exp(c_i),   kg_i = k_i exp(c_i),   kbar_i = k_i exp(c_last - c_i)
    A'[i, j]  = sum_d k_id k_jd exp(c_id - c_jd)                    j < i,   A = diag(beta) A'
    Aqk[i, j] = scale sum_d q_id k_jd exp(c_id - c_jd)              j <= i
    M         = (I + A)^-1                                          unit lower triangular

Three kernels: the cumsum (``gc``; the in-kernel gate's activation; in the backward's recompute
also the decayed keys and queries), the pair products (Aqk, A'; in the forward also the decayed
keys and queries) and the solve (M). The forward forms all of it; the backward keeps the
forward's Aqk, A' and M (``InChunkMatrices``) and runs only the cumsum again.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import NamedTuple

import torch

from kda.kernels.chunk_intra import (
    chunk_cumsum_kernel,
    chunk_pair_fwd_kernel,
    chunk_solve_kernel,
)
from kda.ops.chunk.launch import (
    BC,
    DOT_DTYPES,
    dependent_launch,
    gate_launch_args,
    launch_config,
)
from kda.ops.chunk.layout import ChunkLayout
from kda.ops.gate import KernelGate
from kda.ops.utils import cdiv


class InChunkMatrices(NamedTuple):
    """The in-chunk matrices, ``[B, T, HV, BT]`` each (row ``t`` holds token t's row of its
    chunk's matrix), which the forward keeps for the backward: ``Aqk`` and ``Minv`` (M) in the
    input dtype, ``Akk`` (A') in float32."""
    Aqk: torch.Tensor
    Akk: torch.Tensor
    Minv: torch.Tensor


@dataclass
class InChunkTensors:
    """The in-chunk stage's per-token outputs: cumulative log-decay ``gc`` (float32), decayed
    queries ``qt`` and keys ``kbar``, ``kg`` (input dtype), and the in-chunk matrices."""
    gc: torch.Tensor
    qt: torch.Tensor
    kbar: torch.Tensor
    kg: torch.Tensor
    Aqk: torch.Tensor
    Akk: torch.Tensor
    Minv: torch.Tensor

    def tokens(self, part: slice) -> InChunkTensors:
        """Views of every tensor's tokens ``part`` (axis 1)."""
        return InChunkTensors(*(getattr(self, f.name)[:, part] for f in fields(self)))

    @property
    def matrices(self) -> InChunkMatrices:
        return InChunkMatrices(self.Aqk, self.Akk, self.Minv)


def in_chunk_buffers(B: int, T: int, HV: int, K: int, BT: int, device, dtype: torch.dtype,
                     matrices: bool = True) -> InChunkTensors:
    """Uninitialized in-chunk tensors for ``[B, T]`` tokens of ``dtype`` inputs; without
    ``matrices``, None for Aqk, A' and M."""
    gc = torch.empty(B, T, HV, K, dtype=torch.float32, device=device)
    # Decayed keys and queries for the state sweeps and the outputs.
    kbar, qt, kg = (torch.empty(B, T, HV, K, dtype=dtype, device=device) for _ in range(3))
    if not matrices:
        return InChunkTensors(gc, qt, kbar, kg, None, None, None)
    # Aqk and M are only ever matrix-product operands after the kernel that forms them, rounded
    # to the input dtype there anyway: kept in it, bit for bit the same results. A' is not: the
    # solve reads it in float32 (its products keep float32 operands, mm_fine) and the beta
    # gradient uses it element by element.
    Aqk = torch.empty(B, T, HV, BT, dtype=dtype, device=device)
    Akk = torch.empty(B, T, HV, BT, dtype=torch.float32, device=device)
    Minv = torch.empty(B, T, HV, BT, dtype=dtype, device=device)
    return InChunkTensors(gc, qt, kbar, kg, Aqk, Akk, Minv)


def in_chunk_tensors(q, k, g, beta, scale, layout: ChunkLayout, gate: KernelGate | None,
                     HV: int, matrices: InChunkMatrices | None = None,
                     out: InChunkTensors | None = None) -> InChunkTensors:
    """Cumulative decay and decayed keys / queries; with ``matrices`` (of an earlier call on the
    same inputs) the pair products and the solve are not run again. ``gate``: ``g`` is the raw
    gate, activated in the first kernel. ``out``: tensors to write into (``in_chunk_buffers``'
    shapes), else new ones."""
    B, T, _, K = q.shape
    intra = out if out is not None else in_chunk_buffers(B, T, HV, K, layout.BT, q.device, q.dtype,
                                                         matrices is None)
    cumulative_decay(q, k, g, scale, layout, gate, HV, intra, decayed=matrices is not None)
    if matrices is not None:
        return InChunkTensors(intra.gc, intra.qt, intra.kbar, intra.kg, *matrices)
    return pair_products_and_solve(q, k, beta, scale, layout, HV, intra)


def cumulative_decay(q, k, g, scale, layout: ChunkLayout, gate: KernelGate | None, HV: int,
                     intra: InChunkTensors, decayed: bool):
    """The in-chunk stage's first kernel into ``intra``: the cumulative decay, and with
    ``decayed`` (the backward's recompute) the decayed keys and queries (``in_chunk_tensors``)."""
    _, T, H, K = q.shape
    cfg = launch_config(('cumsum' if gate is None else 'cumsum_raw') + ('_decayed' if decayed else ''),
                        K, K)
    # The decayed keys and queries come from the pair products when those run (the forward).
    chunk_cumsum_kernel[(layout.total, HV * cdiv(K, cfg['BK']))](
        g, q=q, k=k, gc=intra.gc, qt=intra.qt, kbar=intra.kbar, kg=intra.kg, scale=scale, H=H, HV=HV,
        K=K, BT=layout.BT, DECAYED=decayed, IS_VARLEN=layout.rows is not None, chunk_rows=layout.rows,
        T=T, NT=layout.NT, PDL=dependent_launch(q.device), **gate_launch_args(gate), **cfg)


def pair_products_and_solve(q, k, beta, scale, layout: ChunkLayout, HV: int, intra: InChunkTensors,
                            l2norm: bool = False, all_near: bool = False) -> InChunkTensors:
    """The rest of the forward's in-chunk stage into ``intra``, on its cumulative decay: the pair
    products (Aqk, A', the decayed keys and queries), then the solve (M) (``in_chunk_tensors``).
    ``l2norm``: q and k are raw, and the pair products normalize the rows they read (inference
    with ``use_qk_l2norm_in_kernel``, ``chunk_pair_fwd_kernel``). ``all_near``: no key entry of a
    diagonal block can leave the factored form's range (steps >= -5, keys of norm 1), so the
    build without the far-entry test and fallback runs (``ALL_NEAR``; float16 never factors).
    The same bits, less time (docs/tuning.md, "pair_fwd")."""
    _, T, H, K = q.shape
    BT = layout.BT
    dt = q.dtype
    is_varlen = layout.rows is not None
    # Early only where the pair products have work before their wait (the rows' norms): see
    # dependent_launch for the cost in training.
    pdl = l2norm and dependent_launch(q.device)
    chunks = {'chunk_rows': layout.rows, 'T': T, 'NT': layout.NT, 'PDL': pdl, 'launch_pdl': pdl}
    # float16's range ends at 65504: no factor >= 1 on its operands.
    factored = dt != torch.float16
    chunk_pair_fwd_kernel[(layout.total * (BT // BC), HV)](
        q, k, intra.gc, intra.Aqk, intra.Akk, intra.qt, intra.kbar, intra.kg, scale=scale, H=H, HV=HV,
        K=K, BT=BT, BC=BC, DOT_DTYPE=DOT_DTYPES[dt],
        FACTORED_DIAG=factored, ALL_NEAR=all_near and factored, L2NORM=l2norm, IS_VARLEN=is_varlen,
        **chunks,
        **launch_config('pair_fwd_norms' if l2norm else 'pair_fwd', K, K))
    chunk_solve_kernel[(layout.total, HV)](
        beta, intra.Akk, intra.Minv, HV=HV, BT=BT, BC=BC, DOT_DTYPE=DOT_DTYPES[dt], IS_VARLEN=is_varlen,
        **chunks, **launch_config('solve', K, K))
    return intra
