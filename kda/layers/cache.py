"""The decoding cache of ``KimiDeltaAttention``: per layer, the three convolution windows and the
recurrent state after the tokens seen so far.

``KDACache`` holds one ``LayerState`` per layer index (a model passes one cache to all its KDA
layers, as FLA's ``past_key_values``); a layer reads its entry, and writes a new one after each
call with ``use_cache=True``. The fused decode step updates the entry's tensors in place.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kda.ops.decode_step import DecodeWorkspace


@dataclass
class LayerState:
    """One layer's state for ``N`` sequences.

    conv_states: the windows of the q, k and v convolutions ``[N, D, W]`` (the last ``W`` inputs,
        in the projections' dtype), or None for a layer without short convolutions.
    recurrent_state: float32 ``[N, HV, K, V]``.
    workspace: the fused decode step's scratch rows, made on its first step.
    """
    conv_states: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    recurrent_state: torch.Tensor
    workspace: DecodeWorkspace | None = None

    @property
    def num_sequences(self) -> int:
        return self.recurrent_state.shape[0]


class KDACache:
    """Decoding states of several layers, indexed by ``layer_idx``."""

    def __init__(self):
        self.layers: dict[int, LayerState] = {}

    def __getitem__(self, layer_idx: int) -> LayerState | None:
        return self.layers.get(layer_idx)

    def __contains__(self, layer_idx: int) -> bool:
        return layer_idx in self.layers

    def __len__(self) -> int:
        return len(self.layers)

    def update(self, layer_idx: int, state: LayerState) -> None:
        if not isinstance(state, LayerState):
            raise TypeError(f"state must be a LayerState, got {type(state).__name__}")
        self.layers[layer_idx] = state
