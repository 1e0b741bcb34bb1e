"""Benchmarks of ``kda`` beside flash-linear-attention's ``fla.ops.kda``.

    python benchmarks/bench.py [--quick] [--out DIR]

On a CUDA GPU it times, with ``triton.testing.do_bench`` (median), on the same inputs and in the
same process:

* ``chunk_kda`` forward (under ``torch.inference_mode``) and forward + backward, bf16, K = V = 128,
  ``use_qk_l2norm_in_kernel=True``, g pre-computed in float32;
* ``fused_recurrent_kda`` decode steps (T = 1, H = 32, K = V = 128, float32 state, a new final state
  each step), plus a CUDA-graph replay of the B = 1 step that updates the state in place
  (``inplace_final_state=True``) and writes into a preallocated ``out=``;
* forward throughput (tokens/s) against sequence length at a fixed B * T = 32768, H = 32, as a PNG.

FLA is used when ``import fla.ops.kda`` works; otherwise a ``fla_core-*.whl`` under ``.whl/`` at the
repository root is unpacked into a temporary folder and imported from there.

Floors. A time floor is ``max(bytes / 4.3e12 B/s, FLOPs / 700e12 FLOP/s)`` (H200 device-copy and bf16
matrix-product ceilings, see ANCHORS.md); both parts are printed.

* Bytes, forward: q, k, v read and o written once in bf16, g read once in float32, beta once in bf16
  (the API's bytes: not the float32 copy of beta that the kernels read).
  Forward + backward adds one read of q, k, v, g, beta and of the output gradient do, and one write of
  dq, dk, dv, dbeta (bf16) and dg (float32); saved or recomputed intermediates are not counted.
  Decode: the float32 state read and written once, plus q, k, v, beta, o (bf16) and g (float32).
* FLOPs, chunk forward, per value head and per chunk of C = 64 tokens (2 FLOPs per multiply-add),
  counting the matrix products of the WY/UT algorithm (see ``kda/reference.py``)::

      A   = (k e^c)(k e^-c)^T          2 C^2 K      in-chunk key-key products
      Aqk = (q e^c)(k e^-c)^T          2 C^2 K      in-chunk query-key products
      (I + A)^-1                       C^3 / 3      unit lower-triangular inverse
      W   = M (beta k e^c)             2 C^2 K
      U   = M (beta v)                 2 C^2 V
      W S                              2 C K V      corrections dV = U - W S
      (q e^c) S                        2 C K V      inter-chunk output
      Aqk dV                           2 C^2 V      intra-chunk output
      (k e^(c_last - c))^T dV          2 C K V      state update

  i.e. ``6 C^2 K + 4 C^2 V + 6 C K V + C^3 / 3`` per chunk, about 182 kFLOP per token and head at
  C = 64, K = V = 128. The kernels apply M inside the state sweeps instead (``M diag(beta)
  (V - (k e^c) S)``: W is never formed, 2 C^2 K less, ~164 kFLOP), so this FLOP floor is ~10 %
  high; the byte floor is the larger of the two at these shapes either way. Element-wise work (decays, normalization) is not counted. Forward + backward is
  counted as 3x the forward (the backward's products are about twice the forward's).
  Decode: ``8 K V`` per token and head (decay, prediction S^T k, rank-1 update, output S^T q).

Without CUDA it instead runs a small correctness table through Triton's interpreter (it re-executes
itself with ``TRITON_INTERPRET=1`` when that is not set): relative errors ``||x - ref|| / ||ref||`` of
the output and the final state of ``chunk_kda`` and ``fused_recurrent_kda`` against
``naive_recurrent_kda`` computed in float64, with wall times.
"""
from __future__ import annotations

import argparse
import atexit
import gc
import importlib.util
import inspect
import math
import os
import shutil
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent

BYTES_PER_S = 4.3e12
FLOPS_PER_S = 700e12
CHUNK = 64

CHUNK_SHAPES = [(8, 4096, 16), (1, 32768, 32), (1, 8192, 96), (4, 8192, 32)]
# 8 sequences of mixed lengths, most not multiples of the chunk size, 32768 tokens in all.
VARLEN_LENGTHS = [1000, 7193, 2048, 5111, 3100, 6144, 4085, 4087]
VARLEN_H = 32
DECODE_BATCHES = [1, 16, 64, 256, 1024]
DECODE_H = 32
PLOT_TOKENS = 32768
PLOT_T = [2048, 4096, 8192, 16384, 32768]
HEAD_DIM = 128
PARTS = ('fwd', 'gate_fwd', 'fwdbwd', 'gate_fwdbwd', 'profile', 'gate_profile', 'decode', 'throughput')


def _err(e: BaseException) -> str:
    msg = f"{type(e).__name__}: {e}".replace('\n', ' ').replace('|', '/')
    return 'error: ' + (msg if len(msg) <= 120 else msg[:117] + '...')


def _unavailable(e: BaseException) -> str:
    return 'unavailable: ' + _err(e)[len('error: '):]


def _fmt(x, spec='.3f'):
    if isinstance(x, str):
        return x
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return '-'
    return format(x, spec)


def _table(headers, rows):
    lines = ['| ' + ' | '.join(headers) + ' |', '| ' + ' | '.join('---' for _ in headers) + ' |']
    lines += ['| ' + ' | '.join(str(c) for c in r) + ' |' for r in rows]
    return '\n'.join(lines)


def _import_kda():
    """(chunk_kda, fused_recurrent_kda, errors) from the working tree's ``kda``."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    chunk = fused = None
    errors = {}
    try:
        import kda
    except Exception as e:  # noqa: BLE001
        errors['chunk_kda'] = errors['fused_recurrent_kda'] = _unavailable(e)
        return None, None, errors
    for name in ('chunk_kda', 'fused_recurrent_kda'):
        fn = getattr(kda, name, None)
        if fn is None:
            try:
                mod = {'chunk_kda': 'kda.ops.chunk', 'fused_recurrent_kda': 'kda.ops.fused_recurrent'}[name]
                fn = getattr(importlib.import_module(mod), name)
            except Exception as e:  # noqa: BLE001
                errors[name] = _unavailable(e)
        if name == 'chunk_kda':
            chunk = fn
        else:
            fused = fn
    return chunk, fused, errors


def _load_reference():
    """``kda/reference.py`` loaded by path, so that it works even if ``kda/__init__`` does not."""
    spec = importlib.util.spec_from_file_location('_kda_reference', ROOT / 'kda' / 'reference.py')
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _import_fla():
    """(module fla.ops.kda or None, description)."""
    try:
        import fla.ops.kda as fk
        import fla
        return fk, f"FLA {getattr(fla, '__version__', '?')} ({Path(fla.__file__).parent})"
    except Exception as e:  # noqa: BLE001
        first = _err(e)
    wheels = sorted((ROOT / '.whl').glob('fla_core-*.whl'))
    if not wheels:
        return None, f"FLA unavailable ({first})"
    try:
        for m in [m for m in sys.modules if m == 'fla' or m.startswith('fla.')]:
            del sys.modules[m]
        dest = Path(tempfile.mkdtemp(prefix='fla_wheel_'))
        atexit.register(shutil.rmtree, dest, True)
        with zipfile.ZipFile(wheels[-1]) as z:
            z.extractall(dest)
        sys.path.insert(0, str(dest))
        import fla.ops.kda as fk
        import fla
        return fk, f"FLA {getattr(fla, '__version__', '?')} (unpacked from {wheels[-1].name})"
    except Exception as e:  # noqa: BLE001
        return None, f"FLA unavailable ({first}; wheel: {_err(e)})"


# --------------------------------------------------------------------------------------------
# Floors

def chunk_flops_per_token_head(K=HEAD_DIM, V=HEAD_DIM, C=CHUNK):
    return (6 * C * C * K + 4 * C * C * V + 6 * C * K * V + C ** 3 / 3) / C


def chunk_floor(tokens, H, HV=None, K=HEAD_DIM, V=HEAD_DIM, backward=False):
    """(byte floor ms, FLOP floor ms) of a chunk_kda call over ``tokens`` tokens."""
    HV = HV or H
    o_bytes = tokens * HV * V * 2
    fwd_bytes = tokens * (2 * H * K * 2 + HV * V * 2 + HV * K * 4 + HV * 2) + o_bytes
    flops = tokens * HV * chunk_flops_per_token_head(K, V)
    nbytes = fwd_bytes
    if backward:
        # read q, k, v, g, beta, do (as many bytes as the forward); write dq, dk, dv, dg, dbeta
        nbytes += fwd_bytes + (fwd_bytes - o_bytes)
        flops *= 3
    return nbytes / BYTES_PER_S * 1e3, flops / FLOPS_PER_S * 1e3


def decode_floor_us(B, H=DECODE_H, K=HEAD_DIM, V=HEAD_DIM):
    state = 2 * B * H * K * V * 4
    io = B * (2 * H * K * 2 + H * V * 2 * 2 + H * K * 4 + H * 2)
    return (state + io) / BYTES_PER_S * 1e6, state


# --------------------------------------------------------------------------------------------
# GPU mode

def _bench_setup(quick):
    import triton.testing
    params = inspect.signature(triton.testing.do_bench).parameters
    warmup, rep = (10, 30) if quick else (25, 100)

    def bench(fn, grad_to_none=None):
        fn()  # compile / autotune outside the timed region
        torch.cuda.synchronize()
        if 'return_mode' in params:
            return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, grad_to_none=grad_to_none,
                                                 return_mode='median'))
        r = triton.testing.do_bench(fn, warmup=warmup, rep=rep, grad_to_none=grad_to_none, quantiles=[0.5])
        return float(r[0] if isinstance(r, (list, tuple)) else r)
    return bench


def _free():
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def _chunk_inputs(B, T, H, lengths=None, device='cuda', seed=0, gate=False, K=HEAD_DIM, V=HEAD_DIM,
                  dtype=torch.bfloat16):
    """Inputs of ``dtype`` (default bf16), head dims K, V (default 128), q/k L2-normalized in the
    kernel. ``gate=False``: g pre-computed in float32, beta post-sigmoid. ``gate=True``: the Kimi
    Linear configuration of FLA's KDA layer: the raw gate (in ``dtype``) with A_log, dt_bias and
    the lower-bound gate (safe_gate, lower_bound=-5), and beta as logits
    (use_beta_sigmoid_in_kernel)."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def rnd(*s, dtype=torch.float32):
        return torch.randn(*s, generator=gen, device=device, dtype=torch.float32).to(dtype)

    inp = dict(
        q=rnd(B, T, H, K, dtype=dtype),
        k=rnd(B, T, H, K, dtype=dtype),
        v=rnd(B, T, H, V, dtype=dtype),
        # per-channel log-decay in (-inf, 0), mostly in [-1, 0)
        g=(F.logsigmoid(rnd(B, T, H, K) + 3.0) * 2.0).contiguous(),
        beta=torch.sigmoid(rnd(B, T, H)).to(dtype),
    )
    opts = dict(use_qk_l2norm_in_kernel=True)
    if gate:
        inp['g'] = rnd(B, T, H, K, dtype=dtype)
        inp['beta'] = rnd(B, T, H, dtype=dtype)
        opts.update(use_gate_in_kernel=True, A_log=torch.log(torch.rand(H, generator=gen, device=device) * 15 + 1),
                    dt_bias=rnd(H * K) * 0.1, safe_gate=True, lower_bound=-5.0,
                    use_beta_sigmoid_in_kernel=True)
    if lengths is not None:
        cu = torch.tensor([0] + list(lengths), dtype=torch.int64).cumsum(0)
        opts['cu_seqlens'] = cu.to(device)
        opts['cu_seqlens_cpu'] = cu
    return inp, opts


def _peak_gib(fn):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() / 2 ** 30


def _chunk_case(B, T, H, lengths, impls, bench, backward, gate=False):
    """One chunk shape: {impl: (ms or error, peak GiB)}, and ||o_ours - o_FLA|| / ||o_FLA||."""
    inp, opts = _chunk_inputs(B, T, H, lengths, gate=gate)
    res = {}
    for name, fn in impls.items():
        if fn is None:
            res[name] = ('unavailable', None)
            continue
        try:
            if not backward:
                def run(fn=fn):
                    return fn(**inp, **opts)
                with torch.inference_mode():
                    ms = bench(run)
                    peak = _peak_gib(run)
            else:
                # leaves share the inputs' storage: the inputs are counted once in the peak
                leaves = {n: x.detach().requires_grad_() for n, x in inp.items()}
                do = torch.randn_like(inp['v'])

                def run(fn=fn):
                    o, _ = fn(**leaves, **opts)
                    o.backward(do)

                ms = bench(run, grad_to_none=list(leaves.values()))
                for x in leaves.values():
                    x.grad = None
                peak = _peak_gib(run)
                del leaves, do
            res[name] = (ms, peak)
        except Exception as e:  # noqa: BLE001
            res[name] = (_err(e), None)
        run = leaves = do = None
        _free()
    diff = None
    if not backward and all(fn is not None for fn in impls.values()):
        try:
            with torch.inference_mode():
                o_ours = impls['ours'](**inp, **opts)[0]
                o_fla = impls['FLA'](**inp, **opts)[0]
                diff = ((o_ours.float() - o_fla.float()).norm() / o_fla.float().norm()).item()
            del o_ours, o_fla
        except Exception:  # noqa: BLE001
            diff = None
    inp = None
    _free()
    return res, diff


def _chunk_table(impls, bench, quick, backward, gate=False, fla_backward=True):
    if backward and not fla_backward:
        impls = dict(impls, FLA=None)
    cases = [(f"({B}, {T}, {H})", B, T, H, None) for B, T, H in CHUNK_SHAPES]
    cases.append((f"varlen {len(VARLEN_LENGTHS)} seqs, {sum(VARLEN_LENGTHS)} tok, H={VARLEN_H}",
                  1, sum(VARLEN_LENGTHS), VARLEN_H, VARLEN_LENGTHS))
    if quick:
        cases = cases[:1] + cases[-1:] if not backward else cases[:1]
    rows = []
    for label, B, T, H, lengths in cases:
        t0 = time.time()
        res, diff = _chunk_case(B, T, H, lengths, impls, bench, backward, gate)
        byte_ms, flop_ms = chunk_floor(B * T, H, backward=backward)
        floor = max(byte_ms, flop_ms)
        ours, fla = res['ours'][0], res['FLA'][0]
        num = lambda x: isinstance(x, float)  # noqa: E731
        rows.append([
            label, _fmt(ours), _fmt(fla),
            _fmt(fla / ours, '.2f') if num(ours) and num(fla) else '-',
            f"{floor:.3f} ({byte_ms:.3f} B, {flop_ms:.3f} F)",
            _fmt(ours / floor, '.1f') if num(ours) else '-',
            f"{_fmt(res['ours'][1], '.2f')}, {_fmt(res['FLA'][1], '.2f')}",
            _fmt(diff, '.1e'),
        ])
        print(f"  [{time.time() - t0:.0f}s] " + ' | '.join(rows[-1]), file=sys.stderr, flush=True)
    headers = ['(B, T, H)', 'ours ms', 'FLA ms', 'FLA/ours', 'floor ms (bytes, FLOPs)', 'ours/floor',
               'peak GiB (ours, FLA)', 'rel. diff o']
    return _table(headers, rows)


def _decode_inputs(B, device='cuda', seed=0, gate=False):
    """One decode step's inputs; ``gate``: the Kimi Linear configuration (raw bf16 gate, A_log,
    dt_bias, lower bound -5, beta logits), whose options come back in the inputs."""
    gen = torch.Generator(device=device).manual_seed(seed)
    H, K, V = DECODE_H, HEAD_DIM, HEAD_DIM
    rnd = lambda *s: torch.randn(*s, generator=gen, device=device)  # noqa: E731
    bf = torch.bfloat16
    inp = dict(q=rnd(B, 1, H, K).to(bf), k=rnd(B, 1, H, K).to(bf), v=rnd(B, 1, H, V).to(bf),
               g=(F.logsigmoid(rnd(B, 1, H, K) + 3.0) * 2.0), beta=torch.sigmoid(rnd(B, 1, H)).to(bf))
    if gate:
        inp.update(g=rnd(B, 1, H, K).to(bf), beta=rnd(B, 1, H).to(bf),
                   A_log=torch.log(torch.rand(H, generator=gen, device=device) * 15 + 1),
                   dt_bias=rnd(H * K) * 0.1, use_gate_in_kernel=True, lower_bound=-5.0,
                   use_beta_sigmoid_in_kernel=True)
    state = rnd(B, H, K, V) * 0.1
    return inp, state


def _graph_time(step, bench):
    """Capture ``step`` (which must allocate nothing) in a CUDA graph; time its replay."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return bench(graph.replay)


def _decode_table(ours_fn, fla_mod, bench, quick):
    batches = [1, 64] if quick else DECODE_BATCHES
    impls = {'ours': ours_fn, 'FLA': getattr(fla_mod, 'fused_recurrent_kda', None) if fla_mod else None}
    rows = []

    def tbs(us, state_bytes):
        return _fmt(state_bytes / (us * 1e-6) / 1e12, '.2f') if isinstance(us, float) else '-'

    def row(label, B, times):
        floor_us, state_bytes = decode_floor_us(B)
        o, f = times['ours'], times['FLA']
        both = isinstance(o, float) and isinstance(f, float)
        rows.append([label, _fmt(o, '.1f'), _fmt(f, '.1f'), _fmt(f / o, '.2f') if both else '-',
                     _fmt(floor_us, '.2f'), tbs(o, state_bytes), tbs(f, state_bytes)])

    # (label, B, Kimi gate): the plain batches, then the Kimi configuration at two of them.
    cases = [(str(B), B, False) for B in batches] + [(f"{B}, Kimi gate", B, True) for B in (1, 64)]
    # The first case once more ahead of the others, timed and dropped: the first host-bound row
    # timed in a process read 2x its later figure for both libraries (H200, 0582c65: B = 1 took
    # 67.9 us here against 33.7 for the Kimi B = 1 row timed later; FLA 50.4).
    with torch.inference_mode():
        for i, (label, B, gate) in enumerate([cases[0]] + cases):
            inp, state = _decode_inputs(B, gate=gate)
            times = {}
            for name, fn in impls.items():
                if fn is None:
                    times[name] = 'unavailable'
                    continue
                try:
                    times[name] = bench(lambda fn=fn: fn(**inp, initial_state=state, output_final_state=True,
                                                         use_qk_l2norm_in_kernel=True)) * 1e3
                except Exception as e:  # noqa: BLE001
                    times[name] = _err(e)
            if i > 0:
                row(label, B, times)
            inp = state = None
            _free()

        # CUDA-graph replay of the B = 1 step, state updated in place, output preallocated.
        B = 1
        inp, state0 = _decode_inputs(B)
        times = {}
        fla_fwd = None
        if fla_mod is not None:
            try:
                from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd as fla_fwd
            except Exception as e:  # noqa: BLE001
                times['FLA'] = _err(e)
        steps = {}
        if ours_fn is not None:
            st, out = state0.clone(), torch.empty_like(inp['v'])
            steps['ours'] = lambda st=st, out=out: ours_fn(
                **inp, initial_state=st, output_final_state=True, inplace_final_state=True, out=out,
                use_qk_l2norm_in_kernel=True)
        if fla_fwd is not None:
            st2, out2 = state0.clone(), torch.empty_like(inp['v'])
            steps['FLA'] = lambda st=st2, out=out2: fla_fwd(
                **inp, initial_state=st, output_final_state=True, inplace_final_state=True, out=out,
                use_qk_l2norm_in_kernel=True)
        for name in ('ours', 'FLA'):
            if name in times:
                continue
            if name not in steps:
                times[name] = 'unavailable'
                continue
            try:
                times[name] = _graph_time(steps[name], bench) * 1e3
            except Exception as e:  # noqa: BLE001
                times[name] = _err(e)
        row('1, CUDA graph, in place, out=', B, times)
        inp = state0 = steps = None
        _free()
    headers = ['B', 'ours us', 'FLA us', 'FLA/ours', 'byte floor us', 'ours state TB/s', 'FLA state TB/s']
    return _table(headers, rows)


def _step_profile(chunk_fn, B=8, T=4096, H=16, gate=False):
    """GPU time per kernel of one forward + backward step of ours (torch.profiler); ``gate``:
    the Kimi configuration."""
    from torch.profiler import ProfilerActivity, profile
    inp, opts = _chunk_inputs(B, T, H, gate=gate)
    leaves = {n: x.detach().requires_grad_() for n, x in inp.items()}
    do = torch.randn_like(inp['v'])

    def step():
        # As do_bench's grad_to_none: no accumulation into .grad (4 element-wise adds a step).
        for x in leaves.values():
            x.grad = None
        o, _ = chunk_fn(**leaves, **opts)
        o.backward(do)
    step()
    torch.cuda.synchronize()
    steps = 3
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    events = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)
    rows = [[e.key[:60], f"{e.device_time_total / steps / 1e3:.3f}", str(e.count // steps)]
            for e in events if e.device_time_total > 0]
    return f"(B, T, H) = ({B}, {T}, {H})\n\n" + _table(['kernel', 'ms per step', 'launches per step'], rows)


def _throughput(impls, bench, quick, out_dir):
    Ts = [2048, 8192, 32768] if quick else PLOT_T
    data = {name: [] for name in impls}
    for T in Ts:
        B = PLOT_TOKENS // T
        inp, opts = _chunk_inputs(B, T, 32)
        for name, fn in impls.items():
            tps = float('nan')
            if fn is not None:
                try:
                    with torch.inference_mode():
                        ms = bench(lambda fn=fn: fn(**inp, **opts))
                    tps = B * T / (ms * 1e-3)
                except Exception as e:  # noqa: BLE001
                    print(f"  throughput {name} T={T}: {_err(e)}", file=sys.stderr)
            data[name].append(tps)
        inp = None
        _free()
    rows = [[str(T), str(PLOT_TOKENS // T)] + [_fmt(data[n][i] / 1e6, '.1f') for n in impls]
            for i, T in enumerate(Ts)]
    table = _table(['T', 'B', *[f'{n} Mtok/s' for n in impls]], rows)
    try:
        import matplotlib
        matplotlib.use('Agg')
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(6, 4))
        for name, ys in data.items():
            ax.plot(Ts, [y / 1e6 for y in ys], marker='o', label=name)
        ax.set_xscale('log', base=2)
        ax.set_xticks(Ts)
        ax.set_xticklabels([str(t) for t in Ts])
        ax.set_xlabel(f'sequence length T (B*T = {PLOT_TOKENS}, H = 32, K = V = 128, bf16)')
        ax.set_ylabel('forward throughput (M tokens/s)')
        ax.set_ylim(bottom=0)
        ax.set_title(f'chunk_kda forward, {torch.cuda.get_device_name()}')
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path = out_dir / 'forward_throughput.png'
        fig.savefig(path, dpi=120)
        table += f"\n\nplot: {path}"
    except Exception as e:  # noqa: BLE001
        table += f"\n\nplot not written: {_err(e)}"
    return table


def gpu_main(args):
    import triton
    bench = _bench_setup(args.quick)
    chunk, fused, errors = _import_kda()
    fla_mod, fla_desc = (None, 'FLA not run (--no-fla)') if args.no_fla else _import_fla()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    header = (f"# kda benchmarks\n\n{torch.cuda.get_device_name()}, torch {torch.__version__}, "
              f"triton {triton.__version__}, {fla_desc}; do_bench median"
              f"{' (--quick)' if args.quick else ''}.\n")
    if fla_mod is not None:
        extras = [m for m in ('flash_kda', 'tilelang') if importlib.util.find_spec(m) is not None]
        header += (f"FLA optional backends installed: {', '.join(extras) or 'none'} "
                   "(they only take over calls that their verifiers accept; see FLA_NOTES.md).\n")
    for name, e in errors.items():
        header += f"\nours {name}: {e}"
    sections = [header]
    print(header, flush=True)

    chunk_impls = {'ours': chunk, 'FLA': getattr(fla_mod, 'chunk_kda', None) if fla_mod else None}
    # Clocks idle at 345 MHz: a few hundred milliseconds of matrix products first, so that the
    # first timed case is not measured while they ramp up (seen: B = 1 decode first, 3x slow).
    a = torch.randn(4096, 4096, device='cuda', dtype=torch.bfloat16)
    t_end = time.time() + 0.5
    while time.time() < t_end:
        a @ a
    torch.cuda.synchronize()
    parts = {
        'fwd': ('## chunk_kda forward (inference mode), ms',
                lambda: _chunk_table(chunk_impls, bench, args.quick, False)),
        'gate_fwd': ('## chunk_kda forward (inference mode), Kimi Linear gate config, ms',
                     lambda: _chunk_table(chunk_impls, bench, args.quick, False, gate=True)),
        'fwdbwd': ('## chunk_kda forward + backward, ms',
                   lambda: _chunk_table(chunk_impls, bench, args.quick, True, fla_backward=not args.fla_forward_only)),
        'gate_fwdbwd': ('## chunk_kda forward + backward, Kimi Linear gate config, ms',
                        lambda: _chunk_table(chunk_impls, bench, args.quick, True, gate=True,
                                             fla_backward=not args.fla_forward_only)),
        'profile': ('## where one forward + backward step of ours spends GPU time', lambda: _step_profile(chunk)),
        'gate_profile': ('## where one forward + backward step of ours spends GPU time, Kimi Linear gate config',
                         lambda: _step_profile(chunk, gate=True)),
        'decode': (f'## fused_recurrent_kda decode step (T = 1, H = {DECODE_H}, K = V = 128, float32 state), us',
                   lambda: _decode_table(fused, fla_mod, bench, args.quick)),
        'throughput': ('## forward throughput, B * T = 32768, H = 32',
                       lambda: _throughput(chunk_impls, bench, args.quick, out_dir)),
    }
    for key in args.parts.split(','):
        if key not in parts:
            raise SystemExit(f"--parts: unknown part {key!r}; expected some of {', '.join(parts)}")
    for key in args.parts.split(','):
        title, make = parts[key]
        t0 = time.time()
        try:
            body = make()
        except Exception as e:  # noqa: BLE001
            body = _err(e)
            _free()
        text = f"{title}\n\n{body}\n"
        print(text, f"({key}: {time.time() - t0:.0f} s)", flush=True)
        sections.append(text)
        # written after every part, so that a run cut short by a time limit keeps what it measured
        (out_dir / 'results.md').write_text('\n'.join(sections))
    notes = ("Floors: max(bytes / 4.3 TB/s, FLOPs / 700 TFLOP/s), counted as in the docstring of "
             "benchmarks/bench.py. Peak GiB: allocator peak of one call, inputs included. rel. diff o: "
             "||o_ours - o_FLA|| / ||o_FLA|| on the same inputs. Varlen lengths: "
             f"{VARLEN_LENGTHS}.\n")
    print(notes)
    sections.append(notes)
    (out_dir / 'results.md').write_text('\n'.join(sections))
    print(f"written: {out_dir / 'results.md'}")


# --------------------------------------------------------------------------------------------
# CPU mode: correctness through the Triton interpreter

CPU_CASES = [
    # label, B, T, H, HV, K, V, cu_seqlens, with initial state
    ('B=2 T=37 H=2 HV=4 K=32 V=48', 2, 37, 2, 4, 32, 48, None, True),
    ('B=1 T=64 H=1 HV=1 K=16 V=16', 1, 64, 1, 1, 16, 16, None, False),
    ('varlen [0,5,21,40] H=2 K=V=32', 1, 40, 2, 2, 32, 32, [0, 5, 21, 40], True),
    ('decode B=3 T=1 H=2 HV=4 K=32 V=32', 3, 1, 2, 4, 32, 32, None, True),
]


def cpu_main(args):
    print(f"no CUDA device: correctness through the Triton interpreter "
          f"(TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')}), torch {torch.__version__}\n")
    chunk, fused, errors = _import_kda()
    try:
        ref_mod = _load_reference()
        naive = ref_mod.naive_recurrent_kda
    except Exception as e:  # noqa: BLE001
        naive = None
        rows_err = _unavailable(e)
        print(f"naive_recurrent_kda {rows_err}")
    fla_mod, fla_desc = (None, 'FLA not run') if args.no_fla else _import_fla()
    impls = [('chunk_kda', chunk), ('fused_recurrent_kda', fused)]
    if fla_mod is not None:
        impls += [('FLA chunk_kda', fla_mod.chunk_kda), ('FLA fused_recurrent_kda', fla_mod.fused_recurrent_kda)]
    print(f"{fla_desc}\n")
    rows = []
    for label, B, T, H, HV, K, V, cu, with_h0 in CPU_CASES:
        gen = torch.Generator().manual_seed(0)
        rnd = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
        q, k, v = rnd(B, T, H, K), rnd(B, T, H, K), rnd(B, T, HV, V)
        g = F.logsigmoid(rnd(B, T, HV, K) + 2.0)
        beta = torch.sigmoid(rnd(B, T, HV))
        N = B if cu is None else len(cu) - 1
        h0 = rnd(N, HV, K, V) * 0.1 if with_h0 else None
        cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int64)
        opts = dict(use_qk_l2norm_in_kernel=True, output_final_state=True, cu_seqlens=cu_t)
        ref = None
        if naive is not None:
            try:
                ref = naive(q.double(), k.double(), v.double(), g.double(), beta.double(),
                            initial_state=None if h0 is None else h0.double(), **opts)
            except Exception as e:  # noqa: BLE001
                rows.append([label, 'naive_recurrent_kda (float64)', _err(e), '-', '-'])
        for name, fn in impls:
            if fn is None:
                rows.append([label, name, errors.get(name, 'unavailable'), '-', '-'])
                continue
            try:
                t0 = time.perf_counter()
                o, ht = fn(q, k, v, g, beta, initial_state=h0, **opts)
                wall = time.perf_counter() - t0
                if ref is None:
                    rows.append([label, name, '-', '-', f"{wall:.2f}"])
                    continue
                eo = ((o.double() - ref[0]).norm() / ref[0].norm()).item()
                es = ((ht.double() - ref[1]).norm() / ref[1].norm()).item()
                rows.append([label, name, f"{eo:.1e}", f"{es:.1e}", f"{wall:.2f}"])
            except Exception as e:  # noqa: BLE001
                rows.append([label, name, _unavailable(e), '-', '-'])
    print(_table(['shape (float32 inputs)', 'function', 'rel. err o', 'rel. err final state', 'wall s'], rows))
    print("\nrel. err: ||x - ref|| / ||ref|| against naive_recurrent_kda in float64; "
          "use_qk_l2norm_in_kernel=True.")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--quick', action='store_true', help='fewer shapes and repetitions')
    p.add_argument('--out', default=str(ROOT / 'out'), help='folder for results.md and the plot')
    p.add_argument('--no-fla', action='store_true', help='skip FLA even if importable')
    p.add_argument('--fla-forward-only', action='store_true',
                   help="GPU mode: time FLA's forward only (its backward autotunes for minutes on a fresh GPU)")
    p.add_argument('--parts', default=','.join(PARTS),
                   help=f"GPU mode: comma-separated parts to run, in order (default all: {','.join(PARTS)})")
    args = p.parse_args(argv)
    if torch.cuda.is_available():
        gpu_main(args)
    else:
        cpu_main(args)


if __name__ == '__main__':
    if not torch.cuda.is_available() and os.environ.get('TRITON_INTERPRET') != '1':
        # The interpreter is chosen when triton is imported: start again with it set.
        env = dict(os.environ, TRITON_INTERPRET='1')
        sys.stdout.flush()
        os.execve(sys.executable, [sys.executable, os.path.abspath(__file__), *sys.argv[1:]], env)
    main()
