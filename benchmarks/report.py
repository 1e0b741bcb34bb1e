"""The benchmark page as a function of a results record (the JSON ``run`` writes).

    python -m benchmarks report benchmarks/results.json [--page BENCHMARKS.md]

``render(record, plot_path)`` returns the Markdown; ``write_page`` also draws the throughput plot
beside the JSON when matplotlib is importable (otherwise an existing plot file is kept). Every
ratio, floor multiple and bandwidth on the page is computed here from the record's raw figures.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from . import cases

PLOT_NAME = 'forward_throughput.png'
MODE_TITLES = {'fwd': 'chunk_kda forward (inference mode)', 'fwdbwd': 'chunk_kda forward + backward'}
SERVING_TITLES = {
    'decode': 'Decode step (T = 1) through a pool of 2B slots',
    'graph': 'Decode steps at B = 1, one pool a layer, captured in one CUDA graph: time per step',
    'prefill': 'chunk_kda prefill, float32 pool: slot indices against gather + call + scatter',
    'speculative': 'Speculative decode (ssm_state_indices [N, T], num_accepted_tokens) against single steps',
}
UNIT_SECONDS = {'ms': 1e-3, 'us': 1e-6}


def _num(x, spec: str) -> str:
    return '-' if x is None else format(x, spec)


def _sci(x) -> str:
    """``5.3e-3`` rather than ``5.3e-03``."""
    if x is None:
        return '-'
    mantissa, exponent = f"{x:.1e}".split('e')
    return f"{mantissa}e{int(exponent)}"


def _table(headers, rows) -> str:
    lines = ['| ' + ' | '.join(headers) + ' |', '|' + ' --- |' * len(headers)]
    lines += ['| ' + ' | '.join(str(c) for c in row) + ' |' for row in rows]
    return '\n'.join(lines)


def _span(values, spec: str, unit: str = 'x') -> str:
    values = [v for v in values if v is not None]
    if not values:
        return '-'
    lo, hi = min(values), max(values)
    return f"{lo:{spec}}{unit}" if format(lo, spec) == format(hi, spec) else f"{lo:{spec}}-{hi:{spec}}{unit}"


def _ratio(a, b):
    return None if a is None or b is None or b == 0 else a / b


def _commit_note(section: dict, record: dict) -> str:
    return f"commit {section.get('commit') or record.get('commit', 'unknown')}"


def _ran(section: dict, key: str) -> list[str]:
    """The section's implementations with at least one figure."""
    return [n for n in section['implementations'] if any(n in row.get(key, {}) for row in section['rows'])]


def _errors(section: dict, label_key: str = 'case') -> list[str]:
    """One line an implementation: its error where it failed at every row, else per row."""
    lines = []
    for name in section['implementations']:
        failures = [(row.get(label_key), row['errors'][name])
                    for row in section['rows'] if name in row.get('errors', {})]
        if not failures:
            continue
        messages = {msg for _, msg in failures}
        if len(failures) == len(section['rows']) and len(messages) == 1:
            lines.append(f"{name}: {messages.pop()}")
        else:
            lines += [f"{name} at {label}: {msg}" for label, msg in failures]
    return lines


def _error_block(lines: list[str]) -> str:
    return ('\n\nNot measured:\n\n' + '\n'.join(f"- {line}" for line in lines)) if lines else ''


def chunk_table(section: dict, record: dict) -> str:
    backward = section['mode'] == 'fwdbwd'
    ran = _ran(section, 'ms')
    others = [n for n in ran if n != 'ours']
    config = cases.CONFIG_TITLES[section['config']]
    title = f"## {MODE_TITLES[section['mode']]}, {config} ({_commit_note(section, record)})"
    headers = ['(B, T, H)'] + [f"{n} ms" for n in ran] + [f"{n} / ours" for n in others]
    headers += ['floor ms (bytes, FLOPs)', 'ours / floor', f"peak GiB ({', '.join(ran)})"]
    if backward and 'FLA' in ran:
        headers.append('peak ours / FLA')
    if not backward and others:
        headers.append(f"rel. diff vs ours ({', '.join(others)})")
    rows, speedups, floor_multiples = [], {n: [] for n in others}, []
    for row in section['rows']:
        ms, peak = row['ms'], row['peak_gib']
        floor = max(row['floor_ms']['bytes'], row['floor_ms']['flops'])
        cells = [row['case']] + [_num(ms.get(n), '.3f') for n in ran]
        for n in others:
            speedups[n].append(_ratio(ms.get(n), ms.get('ours')))
            cells.append(_num(speedups[n][-1], '.2f'))
        floor_multiples.append(_ratio(ms.get('ours'), floor))
        cells += [f"{floor:.3f} ({row['floor_ms']['bytes']:.3f}, {row['floor_ms']['flops']:.3f})",
                  _num(floor_multiples[-1], '.1f'), ', '.join(_num(peak.get(n), '.2f') for n in ran)]
        if backward and 'FLA' in ran:
            cells.append(_num(_ratio(peak.get('ours'), peak.get('FLA')), '.2f'))
        if not backward and others:
            diffs = row.get('rel_diff_vs_ours', {})
            cells.append(', '.join(_sci(diffs.get(n)) for n in others))
        rows.append(cells)
    summary = [f"{n} / ours {_span(speedups[n], '.2f')}" for n in others]
    summary.append(f"ours / floor {_span(floor_multiples, '.1f')}")
    if not backward and others:
        bound = record.get('agreement_bound')
        worst = {n: max((r.get('rel_diff_vs_ours', {}).get(n) for r in section['rows']
                         if r.get('rel_diff_vs_ours', {}).get(n) is not None), default=None) for n in others}
        summary += [f"{n}'s output {'within' if w <= bound else 'OUTSIDE'} {_sci(bound).replace('.0e', 'e')} "
                    f"of ours (largest {_sci(w)})" for n, w in worst.items() if w is not None and bound]
    return f"{title}\n\n{_table(headers, rows)}\n\n{'; '.join(summary)}.{_error_block(_errors(section))}"


def decode_table(section: dict, record: dict) -> str:
    ran = _ran(section, 'us')
    others = [n for n in ran if n != 'ours']
    title = (f"## fused_recurrent_kda decode step, T = 1, H = {section['H']}, float32 state "
             f"({_commit_note(section, record)})")
    headers = ['B'] + [f"{n} us" for n in ran] + [f"{n} / ours" for n in others]
    headers += ['floor us'] + [f"{n} state TB/s" for n in ran]
    rows = []
    for row in section['rows']:
        us = row['us']
        floor = max(row['floor_us']['bytes'], row['floor_us']['flops'])
        cells = [row['case']] + [_num(us.get(n), '.1f') for n in ran]
        cells += [_num(_ratio(us.get(n), us.get('ours')), '.2f') for n in others]
        cells.append(f"{floor:.2f}")
        cells += [_num(None if us.get(n) is None else row['state_bytes'] / (us[n] * 1e-6) / 1e12, '.2f')
                  for n in ran]
        rows.append(cells)
    return f"{title}\n\n{_table(headers, rows)}{_error_block(_errors(section))}"


def throughput_table(section: dict, record: dict, plot_link: str | None) -> str:
    ran = _ran(section, 'ms')
    title = (f"## Forward throughput, B * T = {section['tokens']}, H = {section['H']}, g pre-computed "
             f"({_commit_note(section, record)})")
    rows = [[row['T'], row['B']] + [_num(None if row['ms'].get(n) is None
                                         else row['B'] * row['T'] / (row['ms'][n] * 1e-3) / 1e6, '.1f')
                                    for n in ran] for row in section['rows']]
    text = f"{title}\n\n{_table(['T', 'B'] + [f'{n} Mtok/s' for n in ran], rows)}"
    if plot_link:
        text += f"\n\n![forward throughput]({plot_link})"
    return text + _error_block(_errors(section, 'T'))


def profile_table(section: dict, record: dict) -> str:
    title = (f"## GPU time a kernel, one forward + backward step of ours, {section['case']}, "
             f"{cases.CONFIG_TITLES[section['config']]} ({_commit_note(section, record)})")
    rows = [[f"`{r['kernel'][:70]}`", f"{r['ms']:.3f}", r['launches']] for r in section['rows']]
    rows.append(['sum', f"{sum(r['ms'] for r in section['rows']):.3f}", ''])
    return f"{title}\n\n{_table(['kernel', 'ms per step', 'launches per step'], rows)}"


def _unit_table(section: dict, baseline: str) -> str:
    """Rows of ``times`` in each row's ``unit``: a column an implementation that ran, then each
    other one's time over ``baseline``'s; the errors below."""
    ran = _ran(section, 'times')
    others = [n for n in ran if n != baseline]
    headers = ['case', 'unit'] + ran + [f"{n} / {baseline}" for n in others]
    rows = []
    for row in section['rows']:
        times = row['times']
        rows.append([row['case'], row['unit']] + [_num(times.get(n), '.3f') for n in ran]
                    + [_num(_ratio(times.get(n), times.get(baseline)), '.2f') for n in others])
    return f"{_table(headers, rows)}{_error_block(_errors(section))}"


def layer_table(section: dict, record: dict) -> str:
    title = (f"## KDA layer beside FLA's, hidden {section['hidden']}, H = {section['H']}, "
             f"K = V = {section['K']}, bf16 ({_commit_note(section, record)})")
    return f"{title}\n\n{_unit_table(section, 'ours')}"


def compile_table(section: dict, record: dict) -> str:
    title = (f"## torch.compile beside eager, ours, H = {section['H']}, K = V = {section['K']}, bf16 "
             f"({_commit_note(section, record)})")
    return f"{title}\n\n{_unit_table(section, 'eager')}"


def _pool_table(table: dict) -> str:
    """One serving table: times in the table's unit, each other implementation's time over the
    first one's, the state bytes a row moves and the bandwidth that makes."""
    unit = table['unit']
    ran = _ran(table, unit)
    baseline = table['implementations'][0]
    others = [n for n in ran if n != baseline]
    movers = [n for n in ran if any(n in row.get('state_bytes', {}) for row in table['rows'])]
    headers = ['case'] + [f"{n} {unit}" for n in ran] + [f"{n} / {baseline}" for n in others]
    if movers:
        headers += [f"state MB moved ({', '.join(movers)})"] + [f"{n} TB/s" for n in movers]
    rows = []
    for row in table['rows']:
        times, moved = row[unit], row.get('state_bytes', {})
        cells = [row['case']] + [_num(times.get(n), '.1f' if unit == 'us' else '.3f') for n in ran]
        cells += [_num(_ratio(times.get(n), times.get(baseline)), '.2f') for n in others]
        if movers:
            cells.append(', '.join(_num(None if n not in moved else moved[n] / 1e6, '.1f') for n in movers))
            cells += [_num(None if n not in moved or n not in times
                           else moved[n] / (times[n] * UNIT_SECONDS[unit]) / 1e12, '.2f') for n in movers]
        rows.append(cells)
    return f"### {SERVING_TITLES[table['table']]}\n\n{_table(headers, rows)}{_error_block(_errors(table))}"


def serving_table(section: dict, record: dict) -> str:
    title = (f"## Serving: state pools addressed by slot indices, H = {section['H']}, K = V = {section['K']}, "
             f"bf16 inputs ({_commit_note(section, record)})")
    return '\n\n'.join([title] + [_pool_table(table) for table in section['tables']])


def _software(record: dict) -> str:
    names = {'torch': 'torch', 'triton': 'triton', 'FLA': 'FLA (fla-core)', 'FlashKDA': 'FlashKDA'}
    return ', '.join(f"{label} {record['versions'][k]}" if record['versions'].get(k) else f"{label} not installed"
                     for k, label in names.items())


def header(record: dict, json_name: str) -> str:
    lines = [
        '# Benchmarks',
        '',
        (f"Measured by `{record['command']}`; this page is generated from its results record by "
         f"`python -m benchmarks report {json_name}` (regenerate rather than edit)."),
    ]
    if record.get('provenance'):
        lines += ['', record['provenance']]
    ceilings = record['ceilings']
    env = ' '.join(f"{k}={v}" for k, v in sorted(record.get('fla_environment', {}).items()))
    lines += [
        '',
        f"- Commit: {record['commit']} (each table names the commit it ran at)",
        f"- GPU: {record['gpu']}",
        f"- Software: {_software(record)}",
        f"- Date: {record['date']}",
        (f"- Timing: {record['timing']}; every library in the same process on the same inputs; FLA with "
         f"{env or 'its defaults'} (its own Triton kernels, not the backends it can dispatch to)."),
        (f"- Inputs: bf16 q, k, v, K = V = {cases.HEAD_DIM}, `use_qk_l2norm_in_kernel=True`, chunk "
         f"{cases.CHUNK}. g pre-computed: g float32, beta after the sigmoid. Kimi configuration: the raw "
         f"bf16 gate with `use_gate_in_kernel=True`, `A_log`, `dt_bias`, `safe_gate=True`, "
         f"`lower_bound={cases.LOWER_BOUND:g}`, beta logits with `use_beta_sigmoid_in_kernel=True` "
         "(the only configuration FlashKDA runs). Varlen lengths: "
         f"{', '.join(map(str, cases.VARLEN_LENGTHS))}."),
        (f"- Floors: max(bytes / {ceilings['bytes_per_s'] / 1e12:g} TB/s, FLOPs / "
         f"{ceilings['flops_per_s'] / 1e12:g} TFLOP/s), counted as `benchmarks/floors.py` states. Peak: "
         "allocator peak of one call, inputs included. rel. diff vs ours: `||o_x - o_ours|| / ||o_ours||`."),
    ]
    return '\n'.join(lines)


def render(record: dict, plot_link: str | None = None, json_name: str = 'benchmarks/results.json') -> str:
    """The page of ``record``; ``plot_link``: the throughput plot's path relative to the page."""
    parts = [header(record, json_name)]
    for section in record['sections']:
        kind = section['kind']
        if kind == 'chunk':
            parts.append(chunk_table(section, record))
        elif kind == 'decode':
            parts.append(decode_table(section, record))
        elif kind == 'throughput':
            parts.append(throughput_table(section, record, plot_link))
        elif kind == 'profile':
            parts.append(profile_table(section, record))
        elif kind == 'layer':
            parts.append(layer_table(section, record))
        elif kind == 'serving':
            parts.append(serving_table(section, record))
        elif kind == 'compile':
            parts.append(compile_table(section, record))
        elif kind == 'failed':
            parts.append(f"## {section['part']}: failed\n\n{section['error']}")
        else:
            raise ValueError(f"record section kind {kind!r}: expected chunk, decode, throughput, profile, "
                             "layer, serving, compile or failed")
    return '\n\n'.join(parts) + '\n'


def draw_plot(section: dict, record: dict, path: Path) -> bool:
    """Draws the throughput plot; False when matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    Ts = [row['T'] for row in section['rows']]
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in _ran(section, 'ms'):
        ys = [row['B'] * row['T'] / (row['ms'][name] * 1e-3) / 1e6 if name in row['ms'] else float('nan')
              for row in section['rows']]
        ax.plot(Ts, ys, marker='o', label=name)
    ax.set_xscale('log', base=2)
    ax.set_xticks(Ts)
    ax.set_xticklabels([str(t) for t in Ts])
    ax.set_xlabel(f"sequence length T (B * T = {section['tokens']}, H = {section['H']}, K = V = 128, bf16)")
    ax.set_ylabel('forward throughput (M tokens/s)')
    ax.set_ylim(bottom=0)
    ax.set_title(f"chunk_kda forward, {record['gpu']}, {section.get('commit', record['commit'])}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write_page(record: dict, json_path: Path, page_path: Path) -> Path:
    """Writes the page of ``record`` (read from or written to ``json_path``) to ``page_path``, and
    the plot beside the JSON."""
    json_path, page_path = Path(json_path), Path(page_path)
    plot_link = None
    for section in record['sections']:
        if section['kind'] == 'throughput':
            plot = json_path.parent / PLOT_NAME
            if not draw_plot(section, record, plot):
                print(f"matplotlib missing: {plot} not redrawn", file=sys.stderr)
            if plot.exists():
                plot_link = Path(os.path.relpath(plot, page_path.parent)).as_posix()
    try:
        json_name = Path(os.path.relpath(json_path, page_path.parent)).as_posix()
    except ValueError:
        json_name = json_path.as_posix()
    page_path.write_text(render(record, plot_link, json_name))
    return page_path


def main(args) -> int:
    record = json.loads(Path(args.results).read_text())
    page = write_page(record, Path(args.results), Path(args.page))
    print(f"written: {page}")
    return 0
