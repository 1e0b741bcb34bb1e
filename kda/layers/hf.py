"""Loading Kimi Linear checkpoints of Hugging Face ``transformers`` (model type ``kimi_linear``)
into ``KimiDeltaAttention``, whose parameter names are FLA's.

``hf_kimi_linear_to_fla(state_dict, prefix)`` takes one KDA layer's weights in either naming:

* transformers' module (``KimiLinearDeltaAttention``): a packed ``conv1d.weight``
  ``[2 H K + HV V, 1, W]`` (q, k, v channels in that order), ``forget_gate_down`` /
  ``forget_gate_up``, ``output_gate_down`` / ``output_gate_up``, ``beta_proj``, ``A_log``
  ``[HV, 1]``, ``dt_bias`` ``[HV, K]``;
* the checkpoint files as published (transformers renames them when it loads them):
  ``q_conv1d`` / ``k_conv1d`` / ``v_conv1d``, ``f_a_proj`` / ``f_b_proj``, ``g_a_proj`` /
  ``g_b_proj``, ``b_proj``, and ``A_log``, ``dt_bias`` of any shape with HV and HV K elements;

and returns FLA's names (``q_conv1d.weight``, ``f_proj.0.weight``, ``f_proj.1.weight``,
``g_proj.0.weight``, ``g_proj.1.weight``, ``g_proj.1.bias``, ``b_proj.weight``, ``A_log`` ``[HV]``,
``dt_bias`` ``[HV K]`` float32, ...). The output gate's up projection has no bias in Kimi Linear:
``g_proj.1.bias`` is zeros. ``q_proj``, ``k_proj``, ``v_proj``, ``o_norm``, ``o_proj`` keep their
names. The layer itself must be built with the checkpoint's configuration (docs/layer.md lists the
correspondence); Kimi Linear's full-rank output gate variant has no counterpart and is refused.
"""
from __future__ import annotations

import torch

# checkpoint / transformers name -> FLA name, for weights that only change their name
RENAMES = {
    'f_a_proj.weight': 'f_proj.0.weight', 'f_b_proj.weight': 'f_proj.1.weight',
    'forget_gate_down.weight': 'f_proj.0.weight', 'forget_gate_up.weight': 'f_proj.1.weight',
    'g_a_proj.weight': 'g_proj.0.weight', 'g_b_proj.weight': 'g_proj.1.weight',
    'output_gate_down.weight': 'g_proj.0.weight', 'output_gate_up.weight': 'g_proj.1.weight',
    'beta_proj.weight': 'b_proj.weight',
}
KEPT = ('q_proj.weight', 'k_proj.weight', 'v_proj.weight', 'o_proj.weight', 'o_norm.weight', 'b_proj.weight',
        'q_conv1d.weight', 'k_conv1d.weight', 'v_conv1d.weight', 'q_conv1d.bias', 'k_conv1d.bias',
        'v_conv1d.bias')
PACKED_CONV = ('conv1d.weight', 'conv1d.bias')


def hf_kimi_linear_to_fla(state_dict: dict, prefix: str = '') -> dict:
    """One KDA layer's weights under ``prefix`` (e.g. ``'model.layers.0.self_attn.'``), renamed and
    reshaped for ``KimiDeltaAttention.load_state_dict`` (see the module docstring). Keys outside
    ``prefix`` are ignored; an unknown key inside it raises ``ValueError``."""
    if not isinstance(prefix, str):
        raise TypeError(f"prefix must be a str, got {type(prefix).__name__}")
    if not hasattr(state_dict, 'items'):
        raise TypeError(f"state_dict must be a mapping of names to tensors, got {type(state_dict).__name__}")
    layer = {name[len(prefix):]: t for name, t in state_dict.items() if name.startswith(prefix)}
    if not layer:
        raise ValueError(f"no weights under prefix {prefix!r}")
    if 'output_gate.weight' in layer:
        raise ValueError("this checkpoint has a full-rank output gate (output_gate.weight); "
                         "KimiDeltaAttention's g_proj is low-rank (two linears)")
    out = {}
    for name, t in layer.items():
        if name in RENAMES:
            out[RENAMES[name]] = t
        elif name in KEPT:
            out[name] = t
        elif name in ('A_log', 'dt_bias'):
            out[name] = t.detach().reshape(-1).float()
        elif name not in PACKED_CONV:
            raise ValueError(f"unknown weight {prefix + name!r} for a Kimi Linear KDA layer")
    if 'conv1d.weight' in layer:
        out.update(_split_packed_conv(layer, prefix))
    if 'g_proj.1.weight' in out:
        up = out['g_proj.1.weight']
        out['g_proj.1.bias'] = torch.zeros(up.shape[0], dtype=up.dtype, device=up.device)
    return out


def _split_packed_conv(layer: dict, prefix: str) -> dict:
    """transformers' one convolution over q | k | v channels, as three."""
    for name in ('q_proj.weight', 'k_proj.weight', 'v_proj.weight'):
        if name not in layer:
            raise ValueError(f"{prefix}conv1d.weight needs {prefix}{name} to split it into q, k and v")
    sizes = [layer[n].shape[0] for n in ('q_proj.weight', 'k_proj.weight', 'v_proj.weight')]
    out = {}
    for name in PACKED_CONV:
        if name not in layer:
            continue
        t = layer[name]
        if t.shape[0] != sum(sizes):
            raise ValueError(f"{prefix}{name} has {t.shape[0]} channels; q, k and v have {sizes}")
        param = name.split('.')[1]
        for which, part in zip('qkv', torch.split(t, sizes, dim=0)):
            out[f'{which}_conv1d.{param}'] = part
    return out
