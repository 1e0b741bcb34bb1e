"""The context-parallel layout: which part of the packed batch each rank of a group holds.

A packed batch of ``N`` sequences (global ``cu_seqlens`` ``[0, ..., T]``) is cut into contiguous
token ranges, one per rank in rank order; rank ``r`` holds tokens ``[start_r, start_r + T_r)``.
The cut may fall anywhere: a rank may hold several sequences, pieces of two, or a middle part of
one that spans several ranks. Each rank sees its range as a packed batch of *local pieces*
(``CPContext.cu_seqlens``), and at most two of them cross a rank boundary: the first piece may
continue a sequence begun on an earlier rank (``continues_in``) and the last one may go on to a
later rank (``continues_out``). A rank whose single piece does both is a *middle* rank.

Everything here is host arithmetic on the offsets, the same on every rank; nothing communicates.
"""
from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class CPContext:
    """The context-parallel layout as seen by one rank of ``group``.

    ``cu_seqlens`` / ``cu_seqlens_cpu`` are this rank's local piece offsets (``[0, ..., T_r]``, on
    the global ``cu_seqlens``' device and on the host). ``first_sequence`` is the global index of
    local piece 0. The per-rank tuples (indexed by rank) describe the whole group, so that every
    rank knows which summaries it needs: ``continues_in[r]``/``continues_out[r]`` say whether rank
    r's first / last piece crosses its left / right boundary, ``chain_start[r]`` is the rank holding
    the start of the sequence entering rank r (r itself when none enters) and ``chain_end[r]`` the
    rank holding the end of the sequence leaving rank r (r itself when none leaves), and
    ``middle[r]`` whether rank r holds only a middle part of one sequence.
    """
    group: dist.ProcessGroup
    rank: int
    world_size: int
    rank_lengths: tuple[int, ...]
    cu_seqlens: torch.Tensor
    cu_seqlens_cpu: torch.Tensor
    first_sequence: int
    continues_in: tuple[bool, ...]
    continues_out: tuple[bool, ...]
    chain_start: tuple[int, ...]
    chain_end: tuple[int, ...]
    middle: tuple[bool, ...]

    @property
    def local_length(self) -> int:
        """Tokens this rank holds: the T of its q, k, v, g, beta."""
        return self.rank_lengths[self.rank]

    @property
    def num_pieces(self) -> int:
        """Local pieces: sequences or parts of sequences held here."""
        return self.cu_seqlens_cpu.numel() - 1

    @property
    def num_starting(self) -> int:
        """Sequences that start on this rank: the rows of its ``initial_state``."""
        return self.num_pieces - int(self.continues_in[self.rank])

    @property
    def num_ending(self) -> int:
        """Sequences that end on this rank: the rows of its final state."""
        return self.num_pieces - int(self.continues_out[self.rank])

    @property
    def pre_num_ranks(self) -> int:
        """Earlier ranks that the sequence entering this rank spans (0 when none enters)."""
        return self.rank - self.chain_start[self.rank]

    @property
    def post_num_ranks(self) -> int:
        """Later ranks that the sequence leaving this rank spans (0 when none leaves)."""
        return self.chain_end[self.rank] - self.rank

    @property
    def any_middle(self) -> bool:
        """Whether some rank of the group is a middle rank (then transitions are exchanged)."""
        return any(self.middle)

    @property
    def communicates(self) -> bool:
        """Whether some rank boundary falls inside a sequence (else the ranks are independent)."""
        return any(self.continues_in)


def _offsets(cu_seqlens, cu_seqlens_cpu) -> list[int]:
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens must be a torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"cu_seqlens must be an integer tensor (int64 or int32), got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be a 1-D tensor [N + 1] with N >= 1, got shape {list(cu_seqlens.shape)}")
    if cu_seqlens_cpu is not None:
        if not isinstance(cu_seqlens_cpu, torch.Tensor) or cu_seqlens_cpu.shape != cu_seqlens.shape:
            raise ValueError(f"cu_seqlens_cpu must be a tensor of cu_seqlens' shape {list(cu_seqlens.shape)}")
        offsets = cu_seqlens_cpu.tolist()
        if cu_seqlens.device.type == 'cpu' and cu_seqlens.tolist() != offsets:
            raise ValueError(f"cu_seqlens_cpu must hold cu_seqlens' values {cu_seqlens.tolist()}, got {offsets}")
    else:
        offsets = cu_seqlens.tolist()
    if offsets[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {offsets[0]}")
    if any(b < a for a, b in itertools.pairwise(offsets)):
        raise ValueError(f"cu_seqlens must be non-decreasing, got {offsets}")
    return offsets


def _rank_lengths(rank_lengths, total: int, world_size: int) -> tuple[int, ...]:
    if rank_lengths is None:
        if total % world_size:
            raise ValueError(f"cu_seqlens ends at {total} tokens, which {world_size} ranks cannot share "
                             f"evenly; pass rank_lengths for an uneven split")
        lengths = (total // world_size,) * world_size
    else:
        if isinstance(rank_lengths, torch.Tensor):
            rank_lengths = rank_lengths.tolist()
        if not isinstance(rank_lengths, Sequence) or any(
                isinstance(n, bool) or not isinstance(n, int) for n in rank_lengths):
            raise TypeError(f"rank_lengths must be a sequence of ints, got {rank_lengths!r}")
        lengths = tuple(rank_lengths)
        if len(lengths) != world_size:
            raise ValueError(f"rank_lengths must give one token count per rank of the group "
                             f"({world_size}), got {len(lengths)}")
        if sum(lengths) != total:
            raise ValueError(f"rank_lengths {list(lengths)} sum to {sum(lengths)} tokens, but cu_seqlens "
                             f"ends at {total}")
    if min(lengths) < 1:
        raise ValueError(f"every rank must hold at least one token, got rank_lengths {list(lengths)}")
    return lengths


def _inside(offsets: list[int], p: int) -> int | None:
    """The sequence that position p cuts strictly inside (bos < p < eos), or None."""
    i = bisect.bisect_left(offsets, p)
    return i - 1 if i < len(offsets) and offsets[i] != p and i > 0 else None


def build_cp_context(cu_seqlens: torch.Tensor, group: dist.ProcessGroup | None = None, *,
                     rank_lengths: Sequence[int] | torch.Tensor | None = None,
                     cu_seqlens_cpu: torch.Tensor | None = None) -> CPContext:
    """The context of the calling rank for a packed batch split across ``group``.

    ``cu_seqlens`` is the global packed batch's offsets before partitioning (the same on every
    rank); ``group`` the process group (default: the default group). ``rank_lengths`` gives every
    rank's token count in rank order and must be the same list on every rank; by default the
    tokens are split evenly (FLA's convention; the total must then be divisible by the group size).
    ``cu_seqlens_cpu``, a host copy of ``cu_seqlens``, spares reading a device tensor back.
    Every rank must hold at least one token. Raises ``ValueError``/``TypeError`` on a malformed
    layout; communicates nothing.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("build_cp_context needs an initialized torch.distributed process group")
    if group is None:
        group = dist.group.WORLD
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    if rank < 0:
        raise ValueError("this process is not a member of the given group")
    offsets = _offsets(cu_seqlens, cu_seqlens_cpu)
    lengths = _rank_lengths(rank_lengths, offsets[-1], world_size)
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)

    cut_in = [None] + [_inside(offsets, p) for p in starts[1:-1]]    # sequence cut at rank r's start
    cut_out = cut_in[1:] + [None]                                    # ... at rank r's end

    def rank_of(token: int) -> int:
        return bisect.bisect_right(starts, token) - 1

    chain_start = tuple(r if cut_in[r] is None else rank_of(offsets[cut_in[r]]) for r in range(world_size))
    chain_end = tuple(r if cut_out[r] is None else rank_of(offsets[cut_out[r] + 1] - 1)
                      for r in range(world_size))

    def piece_range(r: int) -> tuple[int, int]:
        """First and last global sequence index of rank r's pieces."""
        first = cut_in[r] if cut_in[r] is not None else bisect.bisect_left(offsets, starts[r])
        last = len(offsets) - 2 if r == world_size - 1 else bisect.bisect_left(offsets, starts[r + 1]) - 1
        return first, last

    first, last = piece_range(rank)
    s, e = starts[rank], starts[rank + 1]
    local = [min(max(offsets[n], s), e) - s for n in range(first, last + 1)] + [e - s]
    local_cpu = torch.tensor(local, dtype=cu_seqlens.dtype)
    return CPContext(
        group=group, rank=rank, world_size=world_size, rank_lengths=lengths,
        cu_seqlens=local_cpu.to(cu_seqlens.device), cu_seqlens_cpu=local_cpu, first_sequence=first,
        continues_in=tuple(c is not None for c in cut_in),
        continues_out=tuple(c is not None for c in cut_out),
        chain_start=chain_start, chain_end=chain_end,
        middle=tuple(cut_in[r] is not None and cut_in[r] == cut_out[r] for r in range(world_size)))
