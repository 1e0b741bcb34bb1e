"""Model layers built on the ``kda`` kernels: ``KimiDeltaAttention`` (docs/layer.md)."""
from kda.layers.cache import KDACache, LayerState
from kda.layers.hf import hf_kimi_linear_to_fla
from kda.layers.kda import GatedRMSNorm, KimiDeltaAttention, ShortConvolution

__all__ = ['KimiDeltaAttention', 'KDACache', 'LayerState', 'ShortConvolution', 'GatedRMSNorm',
           'hf_kimi_linear_to_fla']
