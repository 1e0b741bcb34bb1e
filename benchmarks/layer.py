"""The KDA layer beside FLA's: ``layer_section(ours, fla, bench, quick, commit)`` returns a
results-record section (``kind='layer'``) for ``python -m benchmarks run``.

* Training step: ``kda.layers.KimiDeltaAttention`` and ``fla.layers.KimiDeltaAttention`` with the
  same weights (FLA's state_dict loads into ours), bf16, hidden 2048, 16 heads, K = V = 128,
  forward + ``y.backward(dy)`` at B = 8, T = 4096 (B = 2 with ``quick``); the parameters'
  gradients are reset by ``bench`` (``grad_to_none``).
* Decode step: one token per sequence from a cache after a 16-token prefill, under
  ``torch.inference_mode``, at B = 1, 16, 64, 256 (1 and 64 with ``quick``): ours (the fused
  decode step), ours captured in a CUDA graph and replayed (the step writes its states in place
  and allocates nothing but the projections' outputs, which the graph's pool holds), and FLA's
  layer with its ``Cache``. Each step advances the states; their values do not change the time.

Times in ms (training) and us (decode); a failing implementation's cell holds its error.
"""
from __future__ import annotations

import sys
import time

HIDDEN, HEADS, HEAD_DIM = 2048, 16, 128
TRAIN_B, TRAIN_T = 8, 4096
DECODE_BATCHES = [1, 16, 64, 256]
PREFILL_T = 16


def train_batch(quick: bool) -> int:
    return 2 if quick else TRAIN_B


def decode_batches(quick: bool) -> list[int]:
    return [1, 64] if quick else DECODE_BATCHES


def _layers(fla):
    """(ours, FLA's or an error string), bf16 on the GPU, with FLA's weights in ours."""
    import torch

    from kda.layers import KimiDeltaAttention
    torch.manual_seed(0)
    config = dict(hidden_size=HIDDEN, num_heads=HEADS, head_dim=HEAD_DIM)
    ours = KimiDeltaAttention(**config, layer_idx=0).cuda().to(torch.bfloat16)
    theirs = fla.description if fla.available else 'FLA unavailable'
    try:
        from fla.layers import KimiDeltaAttention as FLALayer
        theirs = FLALayer(**config, layer_idx=0).cuda().to(torch.bfloat16)
        ours.load_state_dict(theirs.state_dict())
    except Exception as e:  # noqa: BLE001
        from .timing import error_text
        theirs = error_text(e)
    return ours, theirs


def _train_ms(layer, B, T, bench):
    import torch
    x = torch.randn(B, T, HIDDEN, device='cuda', dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    layer.train()

    def step():
        y = layer(x)[0]
        y.backward(dy)
    return bench(step, grad_to_none=[x] + list(layer.parameters()))


def _ours_decode(layer, B, graph: bool, bench):
    import torch

    from .timing import graph_replay_ms
    layer.eval()
    x = torch.randn(B, PREFILL_T + 1, HIDDEN, device='cuda', dtype=torch.bfloat16)
    _, _, cache = layer(x[:, :PREFILL_T], use_cache=True)
    token = x[:, PREFILL_T:]

    def step():
        layer(token, past_key_values=cache, use_cache=True)
    return (graph_replay_ms(step, bench) if graph else bench(step)) * 1e3


def _fla_decode(layer, B, bench):
    import torch
    from fla.models.utils import Cache
    layer.eval()
    x = torch.randn(B, PREFILL_T + 1, HIDDEN, device='cuda', dtype=torch.bfloat16)
    cache = Cache()
    layer(x[:, :PREFILL_T], past_key_values=cache, use_cache=True)
    token = x[:, PREFILL_T:]

    def step():
        layer(token, past_key_values=cache, use_cache=True)
    return bench(step) * 1e3


def layer_section(ours, fla, bench, quick: bool, commit: str) -> dict:
    """The layer table (see the module docstring). ``ours`` is unused beyond its availability
    (the layer comes from ``kda.layers``); ``fla`` is ``libraries.load_fla()``'s result."""
    import torch

    from .timing import error_text, free_memory
    ours_layer, fla_layer = _layers(fla)
    rows = []
    t0 = time.time()
    B = train_batch(quick)
    row = dict(case=f"training step ({B}, {TRAIN_T}), hidden {HIDDEN}, H = {HEADS}", B=B, T=TRAIN_T,
               unit='ms', times={}, errors={})
    for name, layer in (('ours', ours_layer), ('FLA', fla_layer)):
        if isinstance(layer, str):
            row['errors'][name] = layer
            continue
        try:
            row['times'][name] = _train_ms(layer, B, TRAIN_T, bench)
        except Exception as e:  # noqa: BLE001
            row['errors'][name] = error_text(e)
        free_memory()
    rows.append(row)
    with torch.inference_mode():
        for B in decode_batches(quick):
            row = dict(case=f"decode step, B = {B}", B=B, T=1, unit='us', times={}, errors={})
            makers = {'ours': lambda: _ours_decode(ours_layer, B, False, bench),
                      'ours, CUDA graph': lambda: _ours_decode(ours_layer, B, True, bench),
                      'FLA': lambda: _fla_decode(fla_layer, B, bench)}
            for name, make in makers.items():
                if name == 'FLA' and isinstance(fla_layer, str):
                    row['errors'][name] = fla_layer
                    continue
                try:
                    row['times'][name] = make()
                except Exception as e:  # noqa: BLE001
                    row['errors'][name] = error_text(e)
                free_memory()
            rows.append(row)
    print(f"  [{time.time() - t0:.0f} s] layer: " + '; '.join(
        f"{r['case']}: " + ', '.join(f"{n} {v:.3f} {r['unit']}" for n, v in r['times'].items()) for r in rows),
        file=sys.stderr, flush=True)
    return dict(kind='layer', commit=commit, hidden=HIDDEN, H=HEADS, K=HEAD_DIM, V=HEAD_DIM,
                implementations=['ours', 'ours, CUDA graph', 'FLA'], rows=rows)
