"""Times the segmented forward's schedules on a GPU (one device call): how many time segments and
how their lengths change from one to the next (``kda.ops.chunk.forward_segments``).

    python benchmarks/sweep_segments.py [--shapes 1,32768,32 1,8192,96] [--segments 3,4,5,6]
                                        [--ratios 0.8,1,1.25] [--rounds 2] [--timeline [--calls 3]]

For each shape (B = 1) and each (segments, ratio), ``forward_segments`` is replaced by one that
returns ``segment_bounds(T, BT, segments, ratio)`` (ratio > 1: segments that grow), and the
inference forward is timed (``bench.py``'s inputs and ``do_bench`` settings), g pre-computed and
the Kimi configuration, next to the schedule the library picks ("lib"). The rounds interleave
the schedules so that drift of the card's clock spreads over all of them. Every schedule runs the
same steps on the same chunks: its outputs must be the library's bits, which it checks.
``--timeline``: first, each shape's kernels of ``--calls`` Kimi forwards launched back to back
(the library's schedule) as torch.profiler saw them: stream, start and end in us from the first
kernel's start. With several calls the host runs ahead of the GPU, as in a ``do_bench`` loop,
so the later calls show where the GPU itself idles.
"""
from __future__ import annotations

import argparse
import functools
import json
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / 'benchmarks'))

from kda import chunk_kda  # noqa: E402
# forward_segments is replaced where chunk_kda_fwd looks it up.
from kda.ops.chunk import forward as chunk_ops  # noqa: E402
from kda.ops.chunk.schedule import segment_bounds  # noqa: E402
from bench import _bench_setup, _chunk_inputs  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--shapes', nargs='+', default=['1,32768,32', '1,8192,96'], metavar='B,T,H')
    p.add_argument('--segments', default='3,4,5,6')
    p.add_argument('--ratios', default='0.8,0.94,1,1.1,1.25')
    p.add_argument('--rounds', type=int, default=2)
    p.add_argument('--timeline', action='store_true')
    p.add_argument('--calls', type=int, default=1, help='forwards in the timeline')
    args = p.parse_args(argv)
    schedules = [('lib', None)] + [(f'{s}x{r}', (int(s), float(r)))
                                   for s in args.segments.split(',') for r in args.ratios.split(',')]
    shapes = [tuple(int(x) for x in shape.split(',')) for shape in args.shapes]
    if any(B != 1 for B, _, _ in shapes):
        p.error('the forward is segmented for one sequence only: give shapes with B = 1')
    bench = _bench_setup(False)
    library = chunk_ops.forward_segments
    try:
        run(args, schedules, shapes, bench, library)
    finally:
        chunk_ops.forward_segments = library


def schedule(sched, B, T, HV, K, V, layout, *rest):
    """``forward_segments``' stand-in: ``sched = (segments, ratio)`` for ``segment_bounds``."""
    return segment_bounds(T, layout.BT, *sched)


def run(args, schedules, shapes, bench, library):
    """Times every schedule at every shape (``main``, which restores ``forward_segments``)."""
    for B, T, H in shapes:
        shape = f'{B},{T},{H}'
        if args.timeline:
            timeline(B, T, H, args.calls)
        for gate in (False, True):
            inp, opts = _chunk_inputs(B, T, H, gate=gate)
            times = {name: [] for name, _ in schedules}
            ref = None
            for _ in range(args.rounds):
                for name, sched in schedules:
                    chunk_ops.forward_segments = library if sched is None else functools.partial(
                        schedule, sched)
                    with torch.inference_mode():
                        o = chunk_kda(**inp, **opts)[0]
                        if ref is None:
                            ref = o
                        elif not torch.equal(o, ref):
                            raise SystemExit(f'{shape} gate={gate} {name}: outputs differ from lib')
                        times[name].append(bench(lambda: chunk_kda(**inp, **opts)))
            chunk_ops.forward_segments = library
            base = sum(times['lib']) / len(times['lib'])
            picked = library(B, T, H, 128, 128, chunk_ops.chunk_layout(B, T, 64, None, None), None, False,
                             inp['q'].device)
            print(f'## ({shape}) {"Kimi" if gate else "g pre-computed"}: lib {base:.3f} ms ({picked})')
            for name, ts in sorted(times.items(), key=lambda kv: sum(kv[1])):
                ms = sum(ts) / len(ts)
                print(f'{name:>8} {ms:.3f} ms ({ms - base:+.3f})  rounds ' + ' '.join(f'{t:.3f}' for t in ts))
            inp = ref = None
            torch.cuda.empty_cache()


def timeline(B, T, H, calls):
    """Prints the kernels of ``calls`` Kimi inference forwards at (B, T, H), launched back to
    back, in the order they started."""
    inp, opts = _chunk_inputs(B, T, H, gate=True)
    with torch.inference_mode():
        for _ in range(3):
            chunk_kda(**inp, **opts)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                chunk_kda(**inp, **opts)
            torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix='.json') as f:
        prof.export_chrome_trace(f.name)
        events = json.load(open(f.name))['traceEvents']
    kernels = sorted((e for e in events if e.get('cat') == 'kernel'), key=lambda e: e['ts'])
    t0 = kernels[0]['ts']
    print(f'## timeline ({B},{T},{H}) {calls} Kimi inference forwards: stream start end dur (us) kernel')
    for e in kernels:
        print(f"{e['args'].get('stream', '?'):>4} {e['ts'] - t0:8.1f} {e['ts'] + e['dur'] - t0:8.1f} "
              f"{e['dur']:7.1f} {e['name'][:60]}")


if __name__ == '__main__':
    main()
