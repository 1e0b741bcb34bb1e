"""Triton kernels for Kimi Delta Attention (KDA), with FLA's ``fla.ops.kda`` API."""
from kda.ops.chunk import chunk_kda
from kda.ops.fused_recurrent import fused_recurrent_kda
from kda.reference import chunk_kda_reference, naive_recurrent_kda

__all__ = ['chunk_kda', 'fused_recurrent_kda', 'naive_recurrent_kda', 'chunk_kda_reference']
__version__ = '0.1.0'
