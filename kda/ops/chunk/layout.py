"""The chunk layout: where each chunk of ``BT`` tokens lies in the ``[B, T]`` token rows.

Fixed length: ``NT = ceil(T / BT)`` chunks a sequence, ``B * NT`` in all; chunk ``c`` of sequence
``b`` starts at row ``c * BT`` of batch ``b``. Varlen (``cu_seqlens``, one batch row): sequence
``n`` covers rows ``[cu[n], cu[n + 1])`` and has ``ceil((cu[n + 1] - cu[n]) / BT)`` chunks,
numbered globally in sequence order; the map gives every global chunk its first row and its valid
rows, and every sequence its first global chunk.

The device-built map (``device_chunk_layout``: CUDA-graph replay with new ``cu_seqlens``, and
``torch.compile``) has a fixed number of entries, a bound on the chunk count of any ``N``
sequences of ``T`` tokens in all::

    sum_n ceil(L_n / BT) <= ceil(T / BT) + N - 1

Entries past the real chunks are padding, ``(0, 0)``: no valid rows, which every chunk kernel
reads as nothing to load or store. The real entries are the host-built map's, value for value.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from kda.ops.utils import cdiv


@dataclass(frozen=True)
class ChunkLayout:
    """Where the chunks are. ``NT``: chunks per sequence (fixed length only); ``total``: chunks
    over all sequences; for varlen, ``rows[c] = (first row, valid rows)`` of global chunk c,
    ``offsets[n]`` = first global chunk of sequence n, and ``order``: the sequences by chunk count,
    most first, the order in which the state sweeps start them."""
    BT: int
    NT: int
    total: int
    rows: torch.Tensor | None
    offsets: torch.Tensor | None
    order: torch.Tensor | None


# The last varlen chunk map built and its key (see chunk_layout).
_last_varlen_layout: tuple | None = None


def chunk_layout(B: int, T: int, BT: int, seq_offsets: list[int] | None,
                 cu_seqlens: torch.Tensor | None) -> ChunkLayout:
    """The chunk map; for varlen built on ``cu_seqlens``' device from it (``seq_offsets`` is its
    host copy, which gives the sizes). Device operations, not a host-built table copied over: a
    copy from pageable host memory waits for the GPU to drain first, and the kernels launched
    after it then start one by one behind the host (docs/tuning.md, "Varlen chunk map").

    A model calls every layer with the same sequence bounds, and building the map takes ~20 small
    kernels: the last varlen map is kept and returned again for the same host offsets, chunk
    size, device and stream. The map is a function of those alone: ``cu_seqlens`` holds the host
    offsets' values (read from it, or ``cu_seqlens_cpu``, which must match it, docs/API.md). Same
    stream: a map built on another one might not be written yet. Neither kept nor reused inside a
    CUDA graph capture or a ``torch.compile`` trace: a captured map is written only when the graph
    replays, and a graph must own the memory it reads (a kept map is freed when the next one
    replaces it)."""
    global _last_varlen_layout
    if seq_offsets is None:
        NT = cdiv(T, BT)
        return ChunkLayout(BT, NT, B * NT, None, None, None)
    if (cu_seqlens.is_cuda and torch.cuda.is_current_stream_capturing()) or torch.compiler.is_compiling():
        return varlen_chunk_layout(BT, seq_offsets, cu_seqlens)
    stream = torch.cuda.current_stream(cu_seqlens.device) if cu_seqlens.is_cuda else None
    key = (cu_seqlens.device, stream, BT, tuple(seq_offsets))
    last = _last_varlen_layout
    if last is not None and last[0] == key:
        return last[1]
    layout = varlen_chunk_layout(BT, seq_offsets, cu_seqlens)
    _last_varlen_layout = (key, layout)
    return layout


def max_varlen_chunks(T: int, BT: int, N: int) -> int:
    """The device-built map's fixed size: at most this many chunks cover ``N`` sequences of ``T``
    tokens in all. The whole chunks number at most ``floor(T / BT)``; of the at most ``N`` partial
    ones, the first is counted by rounding ``T / BT`` up (their leftover rows are at least one)."""
    return cdiv(T, BT) + N - 1


def device_chunk_layout(BT: int, T: int, cu_seqlens: torch.Tensor, max_chunks: int) -> ChunkLayout:
    """``chunk_layout``'s varlen map built from ``cu_seqlens`` on its device alone, without
    reading it back: ``max_chunks`` entries (``max_varlen_chunks``), those past the real chunks
    padding ``(0, 0)``. Fixed shapes throughout, so a captured CUDA graph replays it for new
    ``cu_seqlens`` of as many entries and a ``torch.compile`` trace holds no host read."""
    cu = cu_seqlens.long()
    N = cu.shape[0] - 1
    counts = (cu[1:] - cu[:-1] + BT - 1) // BT
    ends = counts.cumsum(0)
    offsets = torch.nn.functional.pad(ends, (1, 0))
    chunk = torch.arange(max_chunks, device=cu.device)
    # The sequence of each chunk: the first whose chunks end past it (empty sequences skipped);
    # N for padding.
    seq = torch.searchsorted(ends, chunk, right=True)
    real = seq < N
    seq = seq.clamp(max=N - 1)
    first = cu[seq] + (chunk - offsets[seq]) * BT
    valid = torch.clamp(cu[seq + 1] - first, max=BT)
    zero = torch.zeros((), dtype=first.dtype, device=cu.device)
    rows = torch.stack([torch.where(real, first, zero), torch.where(real, valid, zero)], 1)
    order = torch.sort(counts, descending=True, stable=True).indices
    rows = rows.int() if T < 2 ** 31 else rows
    return ChunkLayout(BT, 0, max_chunks, rows, offsets.int(), order.int())


def varlen_chunk_layout(BT: int, seq_offsets: list[int], cu_seqlens: torch.Tensor) -> ChunkLayout:
    """``chunk_layout``'s varlen map, built anew."""
    total = sum(cdiv(e - s, BT) for s, e in itertools.pairwise(seq_offsets))
    cu = cu_seqlens.long()
    counts = (cu[1:] - cu[:-1] + BT - 1) // BT
    offsets = torch.nn.functional.pad(counts.cumsum(0), (1, 0))
    # output_size: the size is known here, so repeat_interleave does not read counts back. It
    # trusts cu_seqlens_cpu to hold cu_seqlens' values (docs/API.md); checking would cost the sync.
    seq = torch.repeat_interleave(counts, output_size=total)
    first = cu[seq] + (torch.arange(total, device=cu.device) - offsets[seq]) * BT
    rows = torch.stack([first, torch.clamp(cu[seq + 1] - first, max=BT)], 1)
    # Stable: sequences of as many chunks keep their order.
    order = torch.sort(counts, descending=True, stable=True).indices
    # First rows past int32 stay int64 (the kernels load either).
    rows = rows.int() if seq_offsets[-1] < 2 ** 31 else rows
    return ChunkLayout(BT, 0, total, rows, offsets.int(), order.int())
