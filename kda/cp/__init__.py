"""Context parallelism for ``chunk_kda``: one packed batch split across the ranks of a
``torch.distributed`` group (``docs/cp.md``).

``build_cp_context`` describes the split, ``chunk_kda_cp`` runs the rank's slice with its exact
single-process outputs and gradients; ``local_summary`` and ``merge_states`` are the functional
layer for frameworks that communicate on their own.
"""
from kda.cp.chunk import chunk_kda_cp
from kda.cp.context import CPContext, build_cp_context
from kda.cp.summary import SegmentSummary, local_summary, merge_states

__all__ = ['CPContext', 'SegmentSummary', 'build_cp_context', 'chunk_kda_cp', 'local_summary', 'merge_states']
