"""``torch.compile`` beside eager: ``compile_section(bench, quick, commit)`` returns a
results-record section (``kind='compile'``) for ``python -m benchmarks run``.

* Training step: ``chunk_kda`` in the Kimi configuration (bf16, H = HV = 32, K = V = 128, the
  in-kernel gate, q/k l2norm and beta logits), forward + ``o.backward(do)`` at B = 1,
  T = 8192 (2048 with ``quick``), eager and ``torch.compile(fullgraph=True)``: the compiled step
  runs the same kernels through the ``kda::`` ops, so the difference is the host path.
* Decode step: ``fused_recurrent_kda`` at B = 1 and 64 into a state pool in place
  (``inplace_final_state``, ``ssm_state_indices``, ``out``), under ``torch.inference_mode``: eager,
  compiled, and compiled with ``mode='reduce-overhead'`` (the compiled step in a CUDA graph).

Times in ms (training) and us (decode), one process; a failing variant's cell holds its error.
"""
from __future__ import annotations

import sys
import time

H, K, V = 32, 128, 128
TRAIN_T, QUICK_TRAIN_T = 8192, 2048
DECODE_BATCHES = [1, 64]
POOL_SLOTS = 256


def _training_inputs(T: int):
    import torch
    torch.manual_seed(0)
    dev, dt = 'cuda', torch.bfloat16
    x = dict(q=torch.randn(1, T, H, K, device=dev, dtype=dt), k=torch.randn(1, T, H, K, device=dev, dtype=dt),
             v=torch.randn(1, T, H, V, device=dev, dtype=dt), g=torch.randn(1, T, H, K, device=dev, dtype=dt),
             beta=torch.randn(1, T, H, device=dev, dtype=dt))
    for t in x.values():
        t.requires_grad_()
    params = dict(A_log=torch.rand(H, device=dev).requires_grad_(),
                  dt_bias=torch.randn(H * K, device=dev).requires_grad_())
    return x, params, torch.randn(1, T, H, V, device=dev, dtype=dt)


def _training_step(x, params, do):
    from kda import chunk_kda
    o, _ = chunk_kda(**x, **params, use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True,
                     use_beta_sigmoid_in_kernel=True)
    o.backward(do)


def _decode_step(B: int):
    """A decode step's function of the pool, and its other inputs, bound."""
    import torch

    from kda import fused_recurrent_kda
    torch.manual_seed(0)
    dev, dt = 'cuda', torch.bfloat16
    x = dict(q=torch.randn(B, 1, H, K, device=dev, dtype=dt), k=torch.randn(B, 1, H, K, device=dev, dtype=dt),
             v=torch.randn(B, 1, H, V, device=dev, dtype=dt), g=torch.randn(B, 1, H, K, device=dev, dtype=dt),
             beta=torch.randn(B, 1, H, device=dev, dtype=dt))
    A_log, dt_bias = torch.rand(H, device=dev), torch.randn(H * K, device=dev)
    slots = torch.randperm(POOL_SLOTS, device=dev)[:B]
    out = torch.empty(B, 1, H, V, device=dev, dtype=dt)

    def step(pool):
        return fused_recurrent_kda(**x, A_log=A_log, dt_bias=dt_bias, initial_state=pool,
                                   inplace_final_state=True, ssm_state_indices=slots, out=out,
                                   use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True,
                                   use_beta_sigmoid_in_kernel=True)[0]
    return step


def compile_section(bench, quick: bool, commit: str) -> dict:
    import torch

    from .timing import error_text, free_memory
    t0 = time.time()
    rows = []
    T = QUICK_TRAIN_T if quick else TRAIN_T
    x, params, do = _training_inputs(T)
    grads = list(x.values()) + list(params.values())
    row = dict(case=f"training step, Kimi configuration, T = {T}", B=1, T=T, unit='ms', times={}, errors={})
    variants = {'eager': _training_step, 'compiled': torch.compile(_training_step, fullgraph=True)}
    for name, fn in variants.items():
        try:
            row['times'][name] = bench(lambda fn=fn: fn(x, params, do), grad_to_none=grads)
        except Exception as e:  # noqa: BLE001
            row['errors'][name] = error_text(e)
    rows.append(row)
    x = params = do = grads = None
    free_memory()
    with torch.inference_mode():
        for B in DECODE_BATCHES:
            step = _decode_step(B)
            pool = torch.zeros(POOL_SLOTS, H, K, V, device='cuda')
            row = dict(case=f"decode step, B = {B}, pool in place", B=B, T=1, unit='us', times={}, errors={})
            variants = {'eager': step, 'compiled': torch.compile(step, fullgraph=True),
                        'compiled, reduce-overhead': torch.compile(step, fullgraph=True, mode='reduce-overhead')}
            for name, fn in variants.items():
                try:
                    row['times'][name] = bench(lambda fn=fn: fn(pool)) * 1e3
                except Exception as e:  # noqa: BLE001
                    row['errors'][name] = error_text(e)
            rows.append(row)
            free_memory()
    print(f"  [{time.time() - t0:.0f} s] compile: " + '; '.join(
        f"{r['case']}: " + ', '.join(f"{n} {v:.3f} {r['unit']}" for n, v in r['times'].items()) for r in rows),
        file=sys.stderr, flush=True)
    return dict(kind='compile', commit=commit, H=H, K=K, V=V,
                implementations=['eager', 'compiled', 'compiled, reduce-overhead'], rows=rows)
