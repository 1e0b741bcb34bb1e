"""The forward's in-chunk stage in one launch (``kernels/chunk_prep.py``): the cumulative decay,
the pair products and the solve of ``intra.cumulative_decay`` and ``intra.pair_products_and_solve``,
one program per (chunk, value head), into the same ``InChunkTensors``.

``chunk_kda_fwd`` takes it where ``FUSED_PREP`` (``tuning.py``) is set; the three-kernel build
otherwise. The same arithmetic: the same tensors, bit for bit, in the interpreter.
"""
from __future__ import annotations

import torch

from kda.kernels.chunk_prep import chunk_prep_fwd_kernel
from kda.ops.chunk.intra import InChunkTensors
from kda.ops.chunk.launch import BC, DOT_DTYPES, gate_launch_args, launch_config
from kda.ops.chunk.layout import ChunkLayout
from kda.ops.gate import KernelGate


def fused_in_chunk_stage(q, k, g, beta, scale, layout: ChunkLayout, gate: KernelGate | None, HV: int,
                         intra: InChunkTensors, l2norm: bool = False,
                         all_near: bool = False) -> InChunkTensors:
    """``intra``'s tensors (``in_chunk_buffers``, with the matrices) for the chunks of ``layout``,
    in one launch: ``gc``, ``qt``, ``kbar``, ``kg``, ``Aqk``, ``A'`` and ``M``. ``gate``, ``l2norm``
    and ``all_near`` as ``cumulative_decay`` and ``pair_products_and_solve`` take them; ``beta`` is
    the kernels' float32 copy."""
    _, T, H, K = q.shape
    # float16's range ends at 65504: no factor >= 1 on its operands (pair_products_and_solve).
    factored = q.dtype != torch.float16
    chunk_prep_fwd_kernel[(layout.total, HV)](
        q, k, g, beta=beta, gc=intra.gc, qt=intra.qt, kbar=intra.kbar, kg=intra.kg, Aqk=intra.Aqk,
        Akk=intra.Akk, Minv=intra.Minv, chunk_rows=layout.rows, scale=scale, T=T, NT=layout.NT, H=H,
        HV=HV, K=K, BT=layout.BT, BC=BC, FACTORED_DIAG=factored, ALL_NEAR=all_near and factored,
        L2NORM=l2norm, DOT_DTYPE=DOT_DTYPES[q.dtype], IS_VARLEN=layout.rows is not None,
        **gate_launch_args(gate), **launch_config('prep', K, K))
    return intra
