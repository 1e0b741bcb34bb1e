"""``chunk_kda``: validation, the autograd Function and the launches of the chunk kernels.

Forward: stage 1 (``kernels/chunk_intra.py``) builds each chunk's matrices, stage 2
(``kernels/chunk_state.py``) carries the state across chunks, stage 3 (``kernels/chunk_output.py``)
forms the outputs. Backward recomputes stages 1-2 from the saved inputs (nothing chunk-sized is
kept between forward and backward unless ``disable_recompute=True``), then runs the state-gradient
sweep and the per-chunk gradient stage (``kernels/chunk_bwd_*.py``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kda.kernels.chunk_intra import chunk_intra_fwd_kernel
from kda.kernels.chunk_output import chunk_output_fwd_kernel
from kda.kernels.chunk_state import chunk_state_fwd_kernel
from kda.ops.utils import next_pow2

DOT_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
# Rows of a sub-block of the in-chunk matrices: the smallest tile tl.dot takes.
BC = 16


@dataclass(frozen=True)
class ChunkLayout:
    """Where the chunks are. ``NT``: chunks per sequence (fixed length only); ``total``: chunks
    over all sequences; for varlen, ``indices[c] = (sequence, chunk within it)`` and
    ``offsets[n]`` = first global chunk of sequence n."""
    BT: int
    NT: int
    total: int
    indices: torch.Tensor | None
    offsets: torch.Tensor | None


def chunk_layout(B: int, T: int, BT: int, seq_offsets: list[int] | None, device) -> ChunkLayout:
    if seq_offsets is None:
        NT = triton.cdiv(T, BT)
        return ChunkLayout(BT, NT, B * NT, None, None)
    counts = [triton.cdiv(e - s, BT) for s, e in zip(seq_offsets, seq_offsets[1:])]
    pairs = [(n, t) for n, c in enumerate(counts) for t in range(c)]
    firsts = [0]
    for c in counts:
        firsts.append(firsts[-1] + c)
    indices = torch.tensor(pairs, dtype=torch.int32).reshape(-1, 2).to(device)
    offsets = torch.tensor(firsts, dtype=torch.int32).to(device)
    return ChunkLayout(BT, 0, len(pairs), indices, offsets)


def state_strides(K: int, V: int, state_v_first: bool) -> tuple[int, int]:
    """Element strides (between key rows, between value columns) of a ``[K, V]`` state stored as
    ``[K, V]`` or, value-major, ``[V, K]``."""
    return (1, K) if state_v_first else (V, 1)


def chunk_kda_fwd(q, k, v, g, beta, scale, initial_state, output_final_state, state_v_first,
                  cu_seqlens, layout: ChunkLayout):
    """Runs the three forward stages. Returns ``(o, final_state, intermediates)`` where the
    intermediates are ``(gc, Aqk, Akk, Minv, w, u, h, v_new)``."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    BT = layout.BT
    dev, dt = q.device, q.dtype
    common = dict(H=H, HV=HV, K=K, V=V, BT=BT, DOT_DTYPE=DOT_DTYPES[dt], IS_VARLEN=cu_seqlens is not None)

    gc = torch.empty(B, T, HV, K, dtype=torch.float32, device=dev)
    Aqk = torch.empty(B, T, HV, BT, dtype=torch.float32, device=dev)
    Akk = torch.empty(B, T, HV, BT, dtype=torch.float32, device=dev)
    Minv = torch.empty(B, T, HV, BT, dtype=torch.float32, device=dev)
    w = torch.empty(B, T, HV, K, dtype=dt, device=dev)
    u = torch.empty(B, T, HV, V, dtype=dt, device=dev)
    chunk_intra_fwd_kernel[(layout.total, HV)](
        q, k, v, g, beta, gc, Aqk, Akk, Minv, w, u, cu_seqlens, layout.indices, scale, T, layout.NT,
        BC=BC, BK=min(64, next_pow2(K)), BV=min(64, next_pow2(V)), **common)

    BKS = next_pow2(K)
    # The state slice lives in registers: [K, BV] float32. 128 x 64 is 64 registers a thread at
    # 4 warps; at K = 256 halve BV to keep that.
    BVS = min(next_pow2(V), 64 if BKS <= 128 else 32)
    h = torch.empty(layout.total, HV, K, V, dtype=torch.float32, device=dev)
    v_new = torch.empty(B, T, HV, V, dtype=dt, device=dev)
    final_state = None
    if output_final_state:
        shape = (N, HV, V, K) if state_v_first else (N, HV, K, V)
        final_state = torch.empty(shape, dtype=torch.float32, device=dev)
    chunk_state_fwd_kernel[(triton.cdiv(V, BVS), N * HV)](
        k, w, u, gc, h, v_new, initial_state, final_state, cu_seqlens, layout.offsets, T, layout.NT,
        *state_strides(K, V, state_v_first), BK=BKS, BV=BVS,
        USE_INITIAL_STATE=initial_state is not None, STORE_FINAL_STATE=final_state is not None,
        **common)

    o = torch.empty(B, T, HV, V, dtype=dt, device=dev)
    BV = min(64, next_pow2(V))
    chunk_output_fwd_kernel[(triton.cdiv(V, BV), layout.total, HV)](
        q, gc, h, v_new, Aqk, o, cu_seqlens, layout.indices, scale, T, layout.NT,
        BK=min(64, next_pow2(K)), BV=BV, **common)
    return o, final_state, (gc, Aqk, Akk, Minv, w, u, h, v_new)
