"""The one place outside ``kda`` that reaches into the chunk operator's internals (launch tables,
the forward's segment schedule, the matrix-product dtypes). Everything else imports them from
here, so that a move inside ``kda.ops`` is fixed on the import line below.

``TUNING``, ``FEW_PROGRAMS`` and ``WIDE_SLICES`` are the launchers' own dicts: an entry edited
in place is what the next launch reads. ``forward_segments`` is looked up by the forward at
each call in ``CHUNK_MODULE``: ``replaced_forward_segments`` swaps it there.
"""
from __future__ import annotations

import contextlib

from kda.ops import fused_recurrent as RECURRENT_MODULE
from kda.ops.chunk import forward as CHUNK_MODULE
from kda.ops.chunk.launch import DOT_DTYPES
from kda.ops.chunk.layout import chunk_layout
from kda.ops.chunk.schedule import segment_bounds
from kda.ops.chunk.tuning import FEW_PROGRAMS, TUNING, WIDE_SLICES

# What benchmarks/ and tools/ import from here (the re-exported names included).
__all__ = ['DECODE_TUNING', 'DOT_DTYPES', 'FEW_PROGRAMS', 'LAUNCH_TABLES', 'TUNING', 'WIDE_SLICES', 'chunk_layout',
           'forward_segments', 'replaced_forward_segments', 'segment_bounds']

DECODE_TUNING = RECURRENT_MODULE.DECODE_TUNING
LAUNCH_TABLES = {'TUNING': TUNING, 'FEW_PROGRAMS': FEW_PROGRAMS, 'WIDE_SLICES': WIDE_SLICES}


def forward_segments(*args, **kwargs):
    """The library's schedule (whatever ``replaced_forward_segments`` put in place)."""
    return CHUNK_MODULE.forward_segments(*args, **kwargs)


@contextlib.contextmanager
def replaced_forward_segments(schedule):
    """``schedule`` (``forward_segments``' signature) in the forward's place, restored on exit."""
    library = CHUNK_MODULE.forward_segments
    CHUNK_MODULE.forward_segments = schedule
    try:
        yield library
    finally:
        CHUNK_MODULE.forward_segments = library
