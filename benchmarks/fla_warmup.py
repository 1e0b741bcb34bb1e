"""FLA's autotuner run ahead of the timing (``run --warm-fla``), so that the timing finds FLA's picks
cached on disk.

FLA 0.6.0 autotunes its chunk kernels on first use of each tuning key (head count, varlen, gate
options) and caches the winners on disk (``FLA_CACHE_RESULTS=1``, its default, through Triton's
``cache_results``). On a fresh H200 that costs 60-100 s a head count for the forward, more for
the backward, one key after another inside a single process. Here one process a (part, shape)
runs side by side, spread over the visible GPUs; nothing is timed. The autotuner then times its
candidates on a busy GPU, so its picks may differ from an idle GPU's.

Triton keys each cached pick (``*.autotune.json`` in its cache folder) by its version, the GPU
target, the kernel's source and the tuning key, nothing machine-specific: ``--fla-picks FILE``
unpacks FILE into the cache before the run when it exists and packs the picks into it after a
warm-up, so that another machine starts with them.

    python -m benchmarks.fla_warmup PART:SHAPE ...     (one process's cases; run does this)
"""
from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from . import cases
from .libraries import FLA_OWN_KERNELS, ROOT, load_fla

# Parts whose FLA calls autotune, and whether they run a backward.
WARMED_PARTS = {'fwd': False, 'fwd-kimi': False, 'fwdbwd': True, 'fwdbwd-kimi': True}
# One shape a tuning key: (4, 8192, 32) has the key of (1, 32768, 32).
WARMED_SHAPES = ('8,4096,16', '1,32768,32', '1,8192,96', 'varlen')


def warm(case_names: list[str]) -> None:
    """Runs FLA once for each ``PART:SHAPE`` (``PART`` in ``WARMED_PARTS``)."""
    import torch
    fla = load_fla()
    if fla.chunk is None:
        raise SystemExit(fla.description)
    for name in case_names:
        part, shape = name.split(':')
        backward = WARMED_PARTS[part]
        t0 = time.time()
        data = cases.chunk_inputs(cases.case_by_name(shape), 'kimi' if part.endswith('kimi') else 'g')
        if backward:
            leaves = {n: x.detach().requires_grad_() for n, x in data.tensors.items()}
            o, _ = fla.chunk(**leaves, **data.options)
            o.backward(torch.randn_like(o))
        else:
            with torch.inference_mode():
                fla.chunk(**data.tensors, **data.options)
        torch.cuda.synchronize()
        print(f"warm {name}: {time.time() - t0:.0f} s", flush=True)


def triton_cache() -> Path:
    return Path(os.environ.get('TRITON_CACHE_DIR') or Path.home() / '.triton' / 'cache')


def unpack_picks(archive: Path) -> int:
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if m.isfile() and m.name.endswith('.autotune.json')]
        tar.extractall(triton_cache(), members=members)
    return len(members)


def pack_picks(archive: Path) -> int:
    cache = triton_cache()
    picks = sorted(cache.rglob('*.autotune.json'))
    with tarfile.open(archive, 'w:gz') as tar:
        for path in picks:
            tar.add(path, arcname=str(path.relative_to(cache)))
    return len(picks)


def warm_in_parallel(parts, seconds: int, picks: str | None) -> None:
    """One ``warm`` process a (part, shape) of ``parts``, side by side, each cut at ``seconds``."""
    import torch
    if picks and Path(picks).exists():
        print(f"FLA autotune picks unpacked: {unpack_picks(Path(picks))} files", flush=True)
    todo = [f"{p}:{s}" for p in parts if p in WARMED_PARTS for s in WARMED_SHAPES]
    gpus = max(torch.cuda.device_count(), 1)
    procs = []
    t0 = time.time()
    for i, name in enumerate(todo):
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=str(i % gpus), **FLA_OWN_KERNELS)
        procs.append((name, subprocess.Popen([sys.executable, '-m', 'benchmarks.fla_warmup', name], env=env,
                                            cwd=ROOT)))
    for name, proc in procs:
        try:
            proc.wait(timeout=max(1.0, seconds - (time.time() - t0)))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            print(f"warm {name}: cut at {seconds} s", flush=True)
    print(f"FLA warm-up: {time.time() - t0:.0f} s", flush=True)
    if picks and todo:
        print(f"FLA autotune picks packed into {picks}: {pack_picks(Path(picks))} files", flush=True)


if __name__ == '__main__':
    warm(sys.argv[1:])
