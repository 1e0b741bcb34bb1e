"""The forward in time segments: for one long sequence whose fused state sweep leaves SMs room,
the in-chunk stage and the sweep run segment by segment, each segment's sweep (on a side stream)
beside the next segment's in-chunk stage (``forward.chunk_kda_fwd``).

Segment ``i`` of ``S`` covers whole chunks; lengths shrink geometrically by ``ratio`` (at least
0.6, at most 1):

    counts[i] = 1 + floor((NT - S) * ratio**i / sum_j ratio**j)    (+1 each to the first segments
                                                                    until they sum to NT)

The first segment's in-chunk stage runs alone, at full speed; each later one beside the previous
segment's sweep, which slows both; the last segment's sweep runs alone at the end. Where the sweep
is the shorter part (many heads) shrinking segments let more of the in-chunk stage run alone and
keep the last sweep short, while each sweep still ends before the next segment's in-chunk stage
does. The same steps on the same chunks: the same bits as one pass.
"""
from __future__ import annotations

import itertools

from kda.ops.chunk.launch import sm_count, sweep_programs
from kda.ops.chunk.layout import ChunkLayout
from kda.ops.utils import cdiv

# The forward in time segments (forward_segments): how many where the sweep has at most one
# program for every two SMs, and how many where it has more (but fewer than two an SM, see
# busy_sweep); see SEGMENT_BALANCE for their lengths. docs/tuning.md, "Time segments".
FORWARD_SEGMENTS = 4
BUSY_SWEEP_SEGMENTS = 3
# Value heads at which a K = V = 128 sweep over the whole sequence takes as long as the in-chunk
# stage for it (a chunk step of the few-program sweep against the in-chunk stage's time a
# token-head); segments shrink by SEGMENT_BALANCE / HV. docs/tuning.md, "Time segments".
SEGMENT_BALANCE = 30
# Token-heads below which the forward is not segmented: each segment adds ~5 launches and a
# dozen views on the host, so a forward that takes the GPU ~2 ms or less would wait on the host
# instead. docs/tuning.md, "Time segments".
SEGMENT_MIN_TOKEN_HEADS = 1 << 19


def busy_sweep(HV: int, K: int, V: int, device) -> bool:
    """Whether the fused sweep over one sequence's ``HV`` heads has more than one program for
    every two SMs (at TUNING's value slices). Segmented, such a forward runs the in-chunk stage's
    cumsum for the whole sequence first, alone, and fewer segments (``forward_segments``)."""
    return 2 * sweep_programs('state_output', K, V, HV) > sm_count(device)


def forward_segments(B: int, T: int, HV: int, K: int, V: int, layout: ChunkLayout, cu_seqlens,
                     store_states: bool, device) -> list[tuple[int, int]] | None:
    """Token ranges ``[t0, t1)`` (whole chunks) in which ``chunk_kda_fwd`` runs the in-chunk
    stage and the fused sweep one after the other, so that each segment's sweep runs beside the
    next segment's in-chunk stage; None for one pass over the whole sequence. Segmented only
    where the sweep leaves SMs room (fewer programs, counted at TUNING's 64-wide value slices,
    than two an SM: two such 4-warp programs, or one of WIDE_SLICES' 128-wide 8-warp ones, fill
    an SM's registers) and a segment is a contiguous view of every tensor: one sequence of fixed
    length (B = 1), without ``store_states``, long enough (``SEGMENT_MIN_TOKEN_HEADS``) that the
    GPU, not the host, sets the time. FORWARD_SEGMENTS segments where the sweep has at most one
    program for every two SMs, else BUSY_SWEEP_SEGMENTS (``busy_sweep``), shrinking by
    ``SEGMENT_BALANCE / HV`` (clamped to [0.6, 1], ``segment_bounds``). A lighter sweep beside
    the in-chunk stage loses (docs/tuning.md, "Time segments")."""
    if (cu_seqlens is not None or B != 1 or store_states or layout.NT < 2
            or T * HV < SEGMENT_MIN_TOKEN_HEADS):
        return None
    programs, sms = sweep_programs('state_output', K, V, HV), sm_count(device)
    if programs >= 2 * sms:
        return None
    S = BUSY_SWEEP_SEGMENTS if busy_sweep(HV, K, V, device) else FORWARD_SEGMENTS
    return segment_bounds(T, layout.BT, S, min(1.0, max(0.6, SEGMENT_BALANCE / HV)))


def segment_bounds(T: int, BT: int, segments: int, ratio: float) -> list[tuple[int, int]]:
    """``[t0, t1)`` of ``segments`` segments (at most one a chunk) of a ``T``-token sequence in
    whole ``BT``-token chunks, each ``ratio`` times as long as the one before it: one chunk each,
    the others shared by weight ``ratio ** i``, rounded down, what rounding left one each to the
    first segments (``forward_segments``; ``python -m benchmarks tune segments`` times others)."""
    NT = cdiv(T, BT)
    S = min(segments, NT)
    weights = [ratio ** i for i in range(S)]
    counts = [1 + int((NT - S) * w / sum(weights)) for w in weights]
    for i in range(NT - sum(counts)):
        counts[i] += 1
    ends = list(itertools.accumulate(counts))
    bounds = [0, *(BT * e for e in ends[:-1]), T]
    return list(itertools.pairwise(bounds))
