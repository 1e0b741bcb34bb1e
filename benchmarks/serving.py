"""Serving tables: state pools addressed by slot indices, as an inference engine calls the kernels
(docs/API.md, "State pools"). ``serving_section`` (the ``serving`` part of ``python -m benchmarks
run``) times, H = 32, K = V = 128, bf16 inputs:

* ``decode``: one decode step (T = 1) through a pool of 2B slots at B = 64 and 256 (64 with
  ``quick``): ours with a bf16 pool and a float32 one, FLA's ``fused_recurrent_kda_fwd`` with its
  float32 pool. A step moves the addressed states twice (read, write): half the bytes in bf16.
* ``graph``: 32 decode steps at B = 1, each on its own pool (a model's 32 layers), captured in
  one CUDA graph; the replay's time divided by 32, for ours and FLA.
* ``prefill``: ``chunk_kda`` with ``initial_state_indices`` (the sweep reads and writes the
  pool) against gathering the slots, a plain call and scattering the final states back, at
  N = 64 sequences of 512 tokens and N = 8 of 4096 (the first with ``quick``; varlen, float32
  pool); FLA's gather + call + scatter beside.
* ``speculative``: T = 4 tokens (three drafts) for N = 64 sequences, ``ssm_state_indices``
  ``[N, 4]`` with ``num_accepted_tokens``, against four single-token steps; the state bytes each
  moves (one read and four writes against four reads and four writes).

The section holds one table a bullet (``tables``: name, unit, implementations, rows); a row holds
its times under the unit's key and, where it moves states, ``state_bytes`` per implementation.
``pool_drift`` (CPU, ``python -m benchmarks.serving drift``) measures how far a bf16 pool's
decode strays from float32 and float64 over many steps.
"""
from __future__ import annotations

import sys

from .cases import DECODE_H, HEAD_DIM

DECODE_POOL_BATCHES = (64, 256)
GRAPH_LAYERS = 32
PREFILL_CASES = ((64, 512), (8, 4096))      # (sequences, tokens each)
SPEC_N, SPEC_T = 64, 4
POOL_IMPLEMENTATIONS = ['ours bf16 pool', 'ours float32 pool', 'FLA float32 pool']
PREFILL_IMPLEMENTATIONS = ['ours pool', 'ours gather + call + scatter', 'FLA gather + call + scatter']
SPEC_IMPLEMENTATIONS = ['ours speculative', f'ours {SPEC_T} single steps', 'FLA speculative']


def pool_batches(quick: bool) -> tuple[int, ...]:
    return DECODE_POOL_BATCHES[:1] if quick else DECODE_POOL_BATCHES


def prefill_cases(quick: bool) -> tuple[tuple[int, int], ...]:
    return PREFILL_CASES[:1] if quick else PREFILL_CASES


def state_bytes(states: int, dtype_bytes: int, H: int = DECODE_H, K: int = HEAD_DIM, V: int = HEAD_DIM) -> int:
    """Bytes of ``states`` accesses (reads or writes) of an ``[H, K, V]`` state."""
    return states * H * K * V * dtype_bytes


def _decode_step_inputs(B: int, T: int = 1, device: str = 'cuda', seed: int = 0) -> dict:
    """One decode step (or ``T`` speculative tokens) of ``B`` sequences: bf16 q, k, v, beta,
    float32 log-decay g, q and k normalized in the kernel (the benchmark's 'g' configuration)."""
    import torch
    import torch.nn.functional as F
    gen = torch.Generator(device=device).manual_seed(seed)
    H, K, V = DECODE_H, HEAD_DIM, HEAD_DIM

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, device=device)
    bf = torch.bfloat16
    return dict(q=rnd(B, T, H, K).to(bf), k=rnd(B, T, H, K).to(bf), v=rnd(B, T, H, V).to(bf),
                g=F.logsigmoid(rnd(B, T, H, K) + 3.0) * 2.0, beta=torch.sigmoid(rnd(B, T, H)).to(bf))


def _pool(P: int, dtype, device: str = 'cuda'):
    import torch
    return (torch.randn(P, DECODE_H, HEAD_DIM, HEAD_DIM, device=device) * 0.1).to(dtype)


def _time(row: dict, name: str, measure, unit: str = 'us') -> None:
    """``row[unit][name]`` = ``measure()`` (ms) in ``unit`` ('us' or 'ms'), or the error in
    ``row['errors']``; ``measure`` None: not available."""
    from .timing import error_text
    if measure is None:
        row['errors'][name] = 'not available'
        return
    try:
        row.setdefault(unit, {})[name] = measure() * (1e3 if unit == 'us' else 1.0)
    except Exception as e:  # noqa: BLE001
        row['errors'][name] = error_text(e)


def _bench(bench, fn):
    """``measure`` for ``_time``: ``bench(fn)``; None where ``fn`` is."""
    return None if fn is None else (lambda: bench(fn))


def decode_table(ours, fla, bench, quick: bool) -> dict:
    """A decode step through a pool: bf16 and float32 pools (ours), FLA's float32 one."""
    import torch
    fla_step = fla.extras.get('serving_step')
    rows = []
    for B in pool_batches(quick):
        x = _decode_step_inputs(B)
        idx = torch.randperm(2 * B, device='cuda')[:B].int()
        out = torch.empty_like(x['v'])
        pools = {torch.bfloat16: _pool(2 * B, torch.bfloat16), torch.float32: _pool(2 * B, torch.float32)}
        row = dict(case=f"decode B = {B}, pool 2B", B=B, us={}, errors={},
                   state_bytes={'ours bf16 pool': state_bytes(2 * B, 2), 'ours float32 pool': state_bytes(2 * B, 4),
                                'FLA float32 pool': state_bytes(2 * B, 4)})
        for name, dtype in (('ours bf16 pool', torch.bfloat16), ('ours float32 pool', torch.float32)):
            _time(row, name, _bench(bench, lambda p=pools[dtype]: ours.recurrent(
                **x, initial_state=p, inplace_final_state=True, ssm_state_indices=idx, out=out,
                use_qk_l2norm_in_kernel=True)))
        _time(row, 'FLA float32 pool', _bench(bench, fla_step and (lambda: fla_step(
            **x, initial_state=pools[torch.float32], inplace_final_state=True, ssm_state_indices=idx, out=out,
            use_qk_l2norm_in_kernel=True))))
        rows.append(row)
    return dict(table='decode', unit='us', implementations=POOL_IMPLEMENTATIONS, rows=rows)


def graph_table(ours, fla, bench, quick: bool) -> dict:
    """``GRAPH_LAYERS`` B = 1 decode steps on as many pools in one CUDA graph, per step."""
    import torch

    from .timing import graph_replay_ms
    row = dict(case=f"{GRAPH_LAYERS} steps at B = 1, {GRAPH_LAYERS} pools, one CUDA graph (per step)",
               B=1, us={}, errors={})
    layers = [_decode_step_inputs(1, seed=i) for i in range(GRAPH_LAYERS)]
    idx = torch.tensor([3], device='cuda', dtype=torch.int32)
    for name, fn, dtype in zip(POOL_IMPLEMENTATIONS, (ours.recurrent, ours.recurrent, fla.extras.get('serving_step')),
                               (torch.bfloat16, torch.float32, torch.float32)):
        if fn is None:
            row['errors'][name] = 'not available'
            continue
        pools = [_pool(8, dtype) for _ in layers]
        outs = [torch.empty_like(x['v']) for x in layers]

        def steps(fn=fn, pools=pools, outs=outs):
            for x, pool, out in zip(layers, pools, outs):
                fn(**x, initial_state=pool, inplace_final_state=True, ssm_state_indices=idx, out=out,
                   use_qk_l2norm_in_kernel=True)
        _time(row, name, lambda steps=steps: graph_replay_ms(steps, bench) / GRAPH_LAYERS)
    return dict(table='graph', unit='us', implementations=POOL_IMPLEMENTATIONS, rows=[row])


def _varlen_prefill_inputs(N: int, T: int, seed: int = 0) -> dict:
    import torch
    x = _decode_step_inputs(1, N * T, seed=seed)
    x['cu_seqlens'] = torch.arange(0, N * T + 1, T, device='cuda', dtype=torch.int32)
    x['cu_seqlens_cpu'] = x['cu_seqlens'].cpu()
    return x


def prefill_table(ours, fla, bench, quick: bool) -> dict:
    """Pool prefill against gather + call + scatter (ms)."""
    import torch
    rows = []
    for N, T in prefill_cases(quick):
        x = _varlen_prefill_inputs(N, T)
        pool = _pool(2 * N, torch.float32)
        idx = torch.randperm(2 * N, device='cuda')[:N].int()
        row = dict(case=f"prefill N = {N} x {T}", N=N, T=T, ms={}, errors={})

        def gathered(fn):
            def call():
                _, ht = fn(**x, initial_state=pool[idx], output_final_state=True, use_qk_l2norm_in_kernel=True)
                pool[idx] = ht
            return call
        _time(row, 'ours pool', _bench(bench, lambda: ours.chunk(
            **x, initial_state=pool, initial_state_indices=idx, inplace_final_state=True,
            use_qk_l2norm_in_kernel=True)), 'ms')
        _time(row, 'ours gather + call + scatter', _bench(bench, gathered(ours.chunk)), 'ms')
        _time(row, 'FLA gather + call + scatter', _bench(bench, fla.chunk and gathered(fla.chunk)), 'ms')
        rows.append(row)
    return dict(table='prefill', unit='ms', implementations=PREFILL_IMPLEMENTATIONS, rows=rows)


def speculative_table(ours, fla, bench, quick: bool) -> dict:
    """T = SPEC_T tokens for SPEC_N sequences in one speculative call against SPEC_T single steps."""
    import torch
    N, T = SPEC_N, SPEC_T
    x = _decode_step_inputs(N, T)
    pool = _pool(N * T, torch.float32)
    idx = torch.randperm(N * T, device='cuda').int().view(N, T).contiguous()
    accepted = torch.randint(1, T + 1, (N,), device='cuda', dtype=torch.int32)
    out = torch.empty_like(x['v'])
    single = [{n: t[:, i:i + 1].contiguous() for n, t in x.items()} for i in range(T)]
    single_out = [torch.empty_like(s['v']) for s in single]
    one_call, single_steps = state_bytes(N * (1 + T), 4), state_bytes(N * 2 * T, 4)
    row = dict(case=f"speculative T = {T}, N = {N}", N=N, T=T, us={}, errors={},
               state_bytes=dict(zip(SPEC_IMPLEMENTATIONS, (one_call, single_steps, one_call))))

    def spec(fn):
        return lambda: fn(**x, initial_state=pool, inplace_final_state=True, ssm_state_indices=idx,
                          num_accepted_tokens=accepted, out=out, use_qk_l2norm_in_kernel=True)

    def steps():
        for i in range(T):
            ours.recurrent(**single[i], initial_state=pool, inplace_final_state=True, ssm_state_indices=idx[:, i],
                           out=single_out[i], use_qk_l2norm_in_kernel=True)
    _time(row, 'ours speculative', _bench(bench, spec(ours.recurrent)))
    _time(row, f'ours {T} single steps', _bench(bench, steps))
    fla_step = fla.extras.get('serving_step')
    _time(row, 'FLA speculative', _bench(bench, fla_step and spec(fla_step)))
    return dict(table='speculative', unit='us', implementations=SPEC_IMPLEMENTATIONS, rows=[row])


def serving_section(ours, fla, bench, quick: bool, commit: str) -> dict:
    """The serving tables (module docstring); decode, graph and speculative times in us, prefill
    in ms. ``quick`` times the first case of each table."""
    import torch

    from .timing import free_memory
    tables = []
    with torch.inference_mode():
        for make in (decode_table, graph_table, prefill_table, speculative_table):
            tables.append(make(ours, fla, bench, quick))
            free_memory()
    return dict(kind='serving', commit=commit, H=DECODE_H, K=HEAD_DIM, V=HEAD_DIM, tables=tables)


def pool_drift(steps: int = 4096, B: int = 4, H: int = 2, K: int = 64, V: int = 64, seed: int = 0,
               checkpoints=(64, 512, 4096)) -> list[dict]:
    """CPU: ``steps`` decode steps through a bf16 pool and a float32 pool against the float64
    recurrence from the same starting states (the bf16 pool's values). Returns, at each
    checkpoint, the relative error norms of the states and of that step's outputs. Unit keys,
    beta in (0, 1), log-decays in [-0.1, -0.001]: slow decays, a long memory, which forgets
    earlier roundings slowly (the harder case for a 16-bit state). On the PyTorch path (no
    ``TRITON_INTERPRET``), which computes and rounds as the kernel does."""
    import torch

    from kda import fused_recurrent_kda
    from kda.reference import naive_recurrent_kda
    gen = torch.Generator().manual_seed(seed)

    def rel(x, ref):
        return float((x.double() - ref).norm() / ref.norm())
    pools = {torch.bfloat16: (torch.randn(B, H, K, V, generator=gen) * 0.5).to(torch.bfloat16)}
    pools[torch.float32] = pools[torch.bfloat16].float()
    exact = pools[torch.float32].double()
    idx = torch.arange(B)
    results = []
    for t in range(1, steps + 1):
        q = torch.randn(B, 1, H, K, generator=gen, dtype=torch.float64)
        k = torch.nn.functional.normalize(torch.randn(B, 1, H, K, generator=gen, dtype=torch.float64), dim=-1)
        v = torch.randn(B, 1, H, V, generator=gen, dtype=torch.float64)
        g = -(0.001 + 0.099 * torch.rand(B, 1, H, K, generator=gen, dtype=torch.float64))
        beta = torch.rand(B, 1, H, generator=gen, dtype=torch.float64)
        o64, exact = naive_recurrent_kda(q, k, v, g, beta, None, exact, True)
        outs = {}
        for dtype, pool in pools.items():
            outs[dtype], _ = fused_recurrent_kda(q.float(), k.float(), v.float(), g.float(), beta.float(),
                                                 initial_state=pool, inplace_final_state=True,
                                                 ssm_state_indices=idx)
        if t in checkpoints:
            results.append(dict(step=t, **{f'{str(d).split(".")[1]} state': rel(p, exact) for d, p in pools.items()},
                                **{f'{str(d).split(".")[1]} output': rel(o, o64) for d, o in outs.items()}))
    return results


if __name__ == '__main__':
    if sys.argv[1:] != ['drift']:
        raise SystemExit("usage: python -m benchmarks.serving drift (CPU); the timed rows run from a "
                         "benchmark part calling serving_section")
    for r in pool_drift():
        print(r)
