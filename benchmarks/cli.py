"""Command line of ``python -m benchmarks``: ``run``, ``report``, ``tune``, ``compare``."""
from __future__ import annotations

import argparse
import sys

from . import compare, report, run, tune

DESCRIPTION = """Benchmarks of kda beside flash-linear-attention (FLA) and FlashKDA.

  run       time the chunk, decode, layer, serving and compile tables and the throughput plot;
            write the results record (JSON) and BENCHMARKS.md from it
  report    write BENCHMARKS.md again from a results record
  tune      launch-setting sweeps of our kernels
  compare   A/B timing of two or more versions of kda, with a bit comparison of their outputs
"""

RUN_EPILOG = """Exit status: 0 when every part ran; 1 when a part failed (its section holds the error);
2 without a CUDA GPU (one line on stderr says what would have been measured; nothing is written).
--dry-run lists what would run and needs no GPU."""


class _Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Descriptions as written; defaults appended to help lines that do not state theirs."""

    def _get_help_string(self, action):
        if '(default' in (action.help or '') or action.default in (None, False):
            return action.help
        return super()._get_help_string(action)


def _parts(text: str) -> list[str]:
    parts = [p for p in text.split(',') if p]
    unknown = [p for p in parts if p not in run.PARTS]
    if unknown or not parts:
        raise argparse.ArgumentTypeError(f"unknown parts {unknown}; expected some of {','.join(run.PARTS)}")
    return parts


def _first_paragraph(doc: str) -> str:
    return doc.strip().split('\n\n')[0]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog='python -m benchmarks', description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest='command', required=True, metavar='{run,report,tune,compare}')

    r = sub.add_parser('run', help='time the tables and the plot; write results JSON and BENCHMARKS.md',
                       description=run.__doc__, epilog=RUN_EPILOG, formatter_class=_Formatter)
    r.add_argument('--parts', type=_parts, default=list(run.PARTS), metavar='P1,P2',
                   help=f"parts to run, in order, from {','.join(run.PARTS)} (default: all)")
    r.add_argument('--quick', action='store_true', help='fewer shapes and shorter do_bench budgets')
    r.add_argument('--json', default=str(run.DEFAULT_JSON), metavar='PATH',
                   help='results record to write, the plot beside it (default: benchmarks/results.json)')
    r.add_argument('--page', default=str(run.DEFAULT_PAGE), metavar='PATH',
                   help='page to write from the record (default: BENCHMARKS.md at the repository root)')
    r.add_argument('--no-fla', action='store_true', help='skip FLA even if importable')
    r.add_argument('--no-flashkda', action='store_true', help='skip FlashKDA even if flash_kda imports')
    r.add_argument('--fla-forward-only', action='store_true',
                   help="time FLA's forward only (its backward autotunes for minutes on a fresh GPU)")
    r.add_argument('--warm-fla', action='store_true',
                   help="first run FLA's autotuner for the chunk parts, one process a (part, shape) side by "
                        "side over the visible GPUs, so that the timing finds FLA's picks cached")
    r.add_argument('--warm-seconds', type=int, default=300, help='limit of each --warm-fla process')
    r.add_argument('--fla-picks', default=None, metavar='ARCHIVE',
                   help="tar.gz of FLA's cached autotune picks: unpacked into Triton's cache first when it "
                        "exists, written after --warm-fla")
    r.add_argument('--dry-run', action='store_true', help='list what would run; needs no GPU')

    rep = sub.add_parser('report', help='write BENCHMARKS.md from a results record',
                         description=_first_paragraph(report.__doc__),
                         formatter_class=_Formatter)
    rep.add_argument('results', help='results record written by run (e.g. benchmarks/results.json)')
    rep.add_argument('--page', default=str(run.DEFAULT_PAGE), metavar='PATH',
                     help='page to write (default: BENCHMARKS.md at the repository root)')

    t = sub.add_parser('tune', help='launch-setting sweeps of our kernels', description=tune.__doc__,
                       formatter_class=_Formatter)
    sweeps = t.add_subparsers(dest='sweep', required=True, metavar='{stages,forward,segments,decode}')
    s = sweeps.add_parser('stages', help='one stage kernel at a time, GPU time under the profiler',
                          formatter_class=_Formatter)
    s.add_argument('--stages', default=','.join(tune.STAGE_CANDIDATES),
                   help='stages to sweep, comma-separated')
    s.add_argument('--jobs', type=int, default=12, help='parallel compile processes')
    s.add_argument('--compile-shard', default=None, help=argparse.SUPPRESS)
    s.set_defaults(error=s.error)
    f = sweeps.add_parser('forward', help='inference forward end to end under edited launch tables',
                          formatter_class=_Formatter)
    f.add_argument('--variants', default=','.join(tune.FORWARD_VARIANTS), help='variants, comma-separated')
    f.add_argument('--rounds', type=int, default=2, help='interleaved rounds')
    f.set_defaults(error=f.error)
    g = sweeps.add_parser('segments', help="the segmented forward's schedules", formatter_class=_Formatter)
    g.add_argument('--shapes', nargs='+', default=['1,32768,32', '1,8192,96'], metavar='B,T,H',
                   help='shapes with B = 1')
    g.add_argument('--segments', default='3,4,5,6', help='segment counts, comma-separated')
    g.add_argument('--ratios', default='0.8,0.94,1,1.1,1.25', help='length ratios of successive segments')
    g.add_argument('--rounds', type=int, default=2, help='interleaved rounds')
    g.add_argument('--timeline', action='store_true', help="print each shape's kernel timeline first")
    g.add_argument('--calls', type=int, default=1, help='forwards launched back to back in the timeline')
    g.set_defaults(error=g.error)
    d = sweeps.add_parser('decode', help='value columns a program and warps of the decode kernel',
                          formatter_class=_Formatter)
    d.set_defaults(error=d.error)

    c = sub.add_parser('compare', help='A/B timing of versions of kda, with a bit comparison',
                       description=compare.__doc__, formatter_class=_Formatter)
    c.add_argument('versions', nargs='*', metavar='LABEL=REV_OR_DIR',
                   help='versions in order; the first is the baseline')
    c.add_argument('--same-process', action='store_true',
                   help='import every version into one process instead of one process a version a round')
    c.add_argument('--modes', default=','.join(compare.MODES), help='modes, comma-separated')
    c.add_argument('--shapes', default=None, help='indices into the five shapes (default: all)')
    c.add_argument('--rounds', type=int, default=2, help='interleaved rounds')
    c.add_argument('--head-dims', default='128,128', metavar='K,V', help='head dims')
    c.add_argument('--dtype', default='bf16', choices=sorted(compare.DTYPES), help="inputs' dtype")
    c.add_argument('--worker', default=None, help=argparse.SUPPRESS)
    c.add_argument('--save', default=None, help=argparse.SUPPRESS)
    c.set_defaults(error=c.error)
    return p


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = parser()
    args = p.parse_args(argv)
    if args.command == 'run':
        args.argv = argv[1:]
        return run.main(args)
    if args.command == 'report':
        return report.main(args)
    if args.command == 'tune':
        return tune.main(args, args.error)
    return compare.main(args, args.error)
