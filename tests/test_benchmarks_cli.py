"""The benchmark's command line and page generator, without a GPU: every subcommand's --help, the
no-GPU refusal of ``run``, ``run --dry-run``, and BENCHMARKS.md as a function of a results record."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import cli, report, run

ROOT = Path(__file__).resolve().parent.parent
HELP_OPTIONS = {
    ('run',): ['--parts', '--quick', '--json', '--page', '--no-fla', '--no-flashkda', '--fla-forward-only',
               '--warm-fla', '--fla-picks', '--dry-run', 'Exit status'],
    ('report',): ['results', '--page'],
    ('tune',): ['stages', 'forward', 'segments', 'decode'],
    ('tune', 'stages'): ['--stages', '--jobs'],
    ('tune', 'forward'): ['--variants', '--rounds'],
    ('tune', 'segments'): ['--shapes', '--segments', '--ratios', '--rounds', '--timeline', '--calls'],
    ('tune', 'decode'): ['--help'],
    ('compare',): ['--same-process', '--modes', '--shapes', '--rounds', '--head-dims', '--dtype', 'LABEL='],
}


@pytest.mark.parametrize('command', list(HELP_OPTIONS), ids=' '.join)
def test_help_documents_every_option(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main([*command, '--help'])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out

    def documented(option):
        if option.startswith('--'):  # an option line of its own, not a mention in the description
            return re.search(rf'^  (-\w, )?{re.escape(option)}\b', text, re.MULTILINE) is not None
        return option in text
    missing = [option for option in HELP_OPTIONS[command] if not documented(option)]
    assert not missing, f"--help of {' '.join(command)} lacks {missing}"


def test_run_without_gpu_prints_one_line_and_exits_2(monkeypatch, capsys):
    import torch
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: False)
    assert cli.main(['run']) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and 'needs a CUDA GPU' in lines[0] and 'FlashKDA' in lines[0]
    assert captured.out == ''


def test_module_entry_point_without_gpu(tmp_path):
    """``python -m benchmarks run`` with no visible GPU: status 2, nothing written."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES='', PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, '-m', 'benchmarks', 'run', '--json', str(tmp_path / 'r.json'),
                           '--page', str(tmp_path / 'page.md')], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 2, done.stderr
    assert 'needs a CUDA GPU' in done.stderr
    assert list(tmp_path.iterdir()) == []


def test_dry_run_lists_parts_and_shapes(capsys):
    assert cli.main(['run', '--dry-run', '--parts', 'fwd-kimi,decode']) == 0
    text = capsys.readouterr().out
    assert 'FlashKDA' in text and 'FLA_FLASH_KDA=0' in text
    for label in ('(8, 4096, 16)', '(1, 32768, 32)', '(1, 8192, 96)', '(4, 8192, 32)', 'varlen'):
        assert label in text
    assert 'decode' in text and 'throughput' not in text


def test_dry_run_lists_the_layer_part(capsys):
    assert 'layer' in run.PARTS
    assert cli.main(['run', '--dry-run', '--parts', 'layer']) == 0
    text = capsys.readouterr().out
    assert 'layer: KimiDeltaAttention' in text and 'training step at (8, 4096)' in text
    assert 'decode step at B = 1, 16, 64, 256' in text and '  fwd' not in text
    assert cli.main(['run', '--dry-run', '--quick', '--parts', 'layer']) == 0
    text = capsys.readouterr().out
    assert 'training step at (2, 4096)' in text and 'decode step at B = 1, 64 ' in text


def test_report_renders_the_layer_section():
    layer = dict(kind='layer', commit='commit-d', hidden=2048, H=16, K=128, V=128,
                 implementations=['ours', 'ours, CUDA graph', 'FLA'],
                 rows=[dict(case='training step (8, 4096), hidden 2048, H = 16', B=8, T=4096, unit='ms',
                            times={'ours': 20.0, 'FLA': 25.0}, errors={'ours, CUDA graph': 'not captured'}),
                       dict(case='decode step, B = 1', B=1, T=1, unit='us',
                            times={'ours': 200.0, 'ours, CUDA graph': 50.0, 'FLA': 400.0}, errors={})])
    page = report.render(dict(_record(), sections=[layer]))
    assert "## KDA layer beside FLA's, hidden 2048, H = 16, K = V = 128, bf16 (commit commit-d)" in page
    assert '| case | unit | ours | ours, CUDA graph | FLA | ours, CUDA graph / ours | FLA / ours |' in page
    assert '| training step (8, 4096), hidden 2048, H = 16 | ms | 20.000 | - | 25.000 | - | 1.25 |' in page
    assert '| decode step, B = 1 | us | 200.000 | 50.000 | 400.000 | 0.25 | 2.00 |' in page
    assert 'ours, CUDA graph at training step (8, 4096), hidden 2048, H = 16: not captured' in page


def test_dry_run_lists_the_serving_and_compile_parts(capsys):
    assert {'serving', 'compile'} <= set(run.PARTS)
    assert cli.main(['run', '--dry-run', '--parts', 'serving,compile']) == 0
    text = capsys.readouterr().out
    assert 'serving: state pools, H = 32: decode step at B = 64, 256 (bf16 and float32 pools)' in text
    assert '32 steps at B = 1 in one CUDA graph' in text and 'prefill N x T = 64 x 512, 8 x 4096' in text
    assert 'speculative T = 4 at N = 64 against 4 single steps' in text
    assert 'compile: ours eager against torch.compile, Kimi training step at (1, 8192)' in text
    assert "decode step into a pool at B = 1, 64 (also mode='reduce-overhead')" in text and '  layer' not in text
    assert cli.main(['run', '--dry-run', '--quick', '--parts', 'serving,compile']) == 0
    text = capsys.readouterr().out
    assert 'decode step at B = 64 (bf16' in text and 'prefill N x T = 64 x 512 into' in text
    assert 'training step at (1, 2048)' in text


def _serving_section():
    """Decode: 64 slots of 32 x 128 x 128 states, read and written: 134217728 B in bf16, twice that
    in float32. Speculative: 64 x (1 + 4) and 64 x 8 float32 state accesses. The prefill row
    carries bytes for one implementation only, in a table timed in ms."""
    decode = dict(case='decode B = 64, pool 2B', B=64, us={'ours bf16 pool': 40.0, 'ours float32 pool': 80.0,
                                                          'FLA float32 pool': 100.0}, errors={},
                  state_bytes={'ours bf16 pool': 134217728, 'ours float32 pool': 268435456,
                               'FLA float32 pool': 268435456})
    graph = dict(case='32 steps at B = 1, 32 pools, one CUDA graph (per step)', B=1,
                 us={'ours bf16 pool': 3.0, 'ours float32 pool': 3.5}, errors={'FLA float32 pool': 'not available'})
    prefill = dict(case='prefill N = 64 x 512', N=64, T=512, errors={}, state_bytes={'ours pool': 268435456},
                   ms={'ours pool': 2.0, 'ours gather + call + scatter': 3.0, 'FLA gather + call + scatter': 5.0})
    speculative = dict(case='speculative T = 4, N = 64', N=64, T=4, errors={},
                       us={'ours speculative': 100.0, 'ours 4 single steps': 160.0, 'FLA speculative': 200.0},
                       state_bytes={'ours speculative': 671088640, 'ours 4 single steps': 1073741824,
                                    'FLA speculative': 671088640})
    pool_names = ['ours bf16 pool', 'ours float32 pool', 'FLA float32 pool']
    return dict(kind='serving', commit='commit-e', H=32, K=128, V=128, tables=[
        dict(table='decode', unit='us', implementations=pool_names, rows=[decode]),
        dict(table='graph', unit='us', implementations=pool_names, rows=[graph]),
        dict(table='prefill', unit='ms', implementations=list(prefill['ms']), rows=[prefill]),
        dict(table='speculative', unit='us', implementations=list(speculative['us']), rows=[speculative])])


def test_report_renders_the_serving_section():
    page = report.render(dict(_record(), sections=[_serving_section()]))
    assert ('## Serving: state pools addressed by slot indices, H = 32, K = V = 128, bf16 inputs '
            '(commit commit-e)') in page
    assert ('| case | ours bf16 pool us | ours float32 pool us | FLA float32 pool us | ours float32 pool / ours '
            'bf16 pool | FLA float32 pool / ours bf16 pool | state MB moved (ours bf16 pool, ours float32 pool, '
            'FLA float32 pool) | ours bf16 pool TB/s | ours float32 pool TB/s | FLA float32 pool TB/s |') in page
    # 134217728 B in 40 us = 3.36 TB/s; 268435456 B in 100 us = 2.68 TB/s
    assert ('| decode B = 64, pool 2B | 40.0 | 80.0 | 100.0 | 2.00 | 2.50 | 134.2, 268.4, 268.4 | 3.36 | 3.36 '
            '| 2.68 |') in page
    # a table whose rows carry no bytes has no bytes columns
    assert '| 32 steps at B = 1, 32 pools, one CUDA graph (per step) | 3.0 | 3.5 | 1.17 |' in page
    assert '- FLA float32 pool: not available' in page
    # 268435456 B in 2 ms = 0.13 TB/s
    assert '| prefill N = 64 x 512 | 2.000 | 3.000 | 5.000 | 1.50 | 2.50 | 268.4 | 0.13 |' in page
    assert '| ours gather + call + scatter / ours pool | FLA gather + call + scatter / ours pool |' in page
    # 671088640 B in 100 us = 6.71 TB/s, 1073741824 B in 160 us = 6.71 TB/s
    assert ('| speculative T = 4, N = 64 | 100.0 | 160.0 | 200.0 | 1.60 | 2.00 | 671.1, 1073.7, 671.1 | 6.71 '
            '| 6.71 | 3.36 |') in page
    assert page.count('\n### ') == 4


def test_report_renders_the_compile_section():
    section = dict(kind='compile', commit='commit-f', H=32, K=128, V=128,
                   implementations=['eager', 'compiled', 'compiled, reduce-overhead'],
                   rows=[dict(case='training step, Kimi configuration, T = 8192', B=1, T=8192, unit='ms',
                              times={'eager': 10.0, 'compiled': 8.0}, errors={}),
                         dict(case='decode step, B = 1, pool in place', B=1, T=1, unit='us',
                              times={'eager': 40.0, 'compiled': 30.0, 'compiled, reduce-overhead': 10.0}, errors={}),
                         dict(case='decode step, B = 64, pool in place', B=64, T=1, unit='us',
                              times={'eager': 50.0, 'compiled, reduce-overhead': 20.0},
                              errors={'compiled': 'Unsupported: graph break'})])
    page = report.render(dict(_record(), sections=[section]))
    assert '## torch.compile beside eager, ours, H = 32, K = V = 128, bf16 (commit commit-f)' in page
    assert ('| case | unit | eager | compiled | compiled, reduce-overhead | compiled / eager | '
            'compiled, reduce-overhead / eager |') in page
    assert '| training step, Kimi configuration, T = 8192 | ms | 10.000 | 8.000 | - | 0.80 | - |' in page
    assert '| decode step, B = 1, pool in place | us | 40.000 | 30.000 | 10.000 | 0.75 | 0.25 |' in page
    assert '| decode step, B = 64, pool in place | us | 50.000 | - | 20.000 | - | 0.40 |' in page
    assert '- compiled at decode step, B = 64, pool in place: Unsupported: graph break' in page


def test_unknown_part_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(['run', '--parts', 'fwd,nonsense'])
    assert exit_info.value.code == 2
    assert "nonsense" in capsys.readouterr().err


def test_compare_needs_two_versions(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(['compare', 'A=.'])
    assert exit_info.value.code == 2
    assert 'at least two versions' in capsys.readouterr().err


def _chunk_row(label, ours, fla, flashkda=None, errors=None):
    ms = {'ours': ours, 'FLA': fla} | ({'FlashKDA': flashkda} if flashkda else {})
    return dict(case=label, B=1, T=4096, H=16, lengths=None, ms=ms, peak_gib={n: 1.0 for n in ms},
                errors=errors or {}, rel_diff_vs_ours={n: 5e-3 for n in ms if n != 'ours'},
                floor_ms=dict(bytes=0.25, flops=0.125))


def _record():
    return dict(
        format=1, command='python -m benchmarks run', commit='commit-a', date='the date',
        gpu='NVIDIA H200 (132 SMs)', versions=dict(torch='2.11', triton='3.6.0', FLA='0.6.0', FlashKDA='0.1'),
        fla_environment=dict(FLA_FLASH_KDA='0'), timing='do_bench median',
        ceilings=dict(bytes_per_s=4.3e12, flops_per_s=700e12), agreement_bound=2e-2,
        sections=[
            dict(kind='chunk', mode='fwd', config='kimi', commit='commit-a',
                 implementations=['ours', 'FLA', 'FlashKDA'],
                 rows=[_chunk_row('(1, 4096, 16)', 1.0, 2.0, 0.5),
                       _chunk_row('(2, 4096, 16)', 2.0, 3.0, errors={'FlashKDA': 'ValueError: no'})]),
            dict(kind='chunk', mode='fwdbwd', config='g', commit='commit-b', implementations=['ours', 'FLA'],
                 rows=[_chunk_row('(1, 4096, 16)', 4.0, 6.0)]),
            dict(kind='decode', commit='commit-b', H=32, implementations=['ours', 'FLA'],
                 rows=[dict(case='64', B=64, config='g', graph=False, us=dict(ours=80.0, FLA=100.0), errors={},
                            floor_us=dict(bytes=63.16, flops=1.0), state_bytes=268435456)]),
            dict(kind='throughput', commit='commit-a', tokens=32768, H=32, implementations=['ours', 'FLA'],
                 rows=[dict(T=32768, B=1, ms=dict(ours=2.0, FLA=4.0), errors={})]),
        ])


def test_report_computes_ratios_floors_and_names_each_tables_commit():
    page = report.render(_record(), 'benchmarks/forward_throughput.png')
    assert 'NVIDIA H200' in page and 'FlashKDA 0.1' in page and 'FLA (fla-core) 0.6.0' in page
    assert '## chunk_kda forward (inference mode), Kimi configuration (commit commit-a)' in page
    assert '## chunk_kda forward + backward, g pre-computed (commit commit-b)' in page
    # ours 1.0 ms, FLA 2.0, FlashKDA 0.5; floor 0.25 ms
    assert '| (1, 4096, 16) | 1.000 | 2.000 | 0.500 | 2.00 | 0.50 | 0.250 (0.250, 0.125) | 4.0 |' in page
    assert 'FlashKDA at (2, 4096, 16): ValueError: no' in page
    assert "FlashKDA's output within 2e-2 of ours (largest 5.0e-3)" in page
    # decode: 268435456 B in 80 us = 3.36 TB/s
    assert '| 64 | 80.0 | 100.0 | 1.25 | 63.16 | 3.36 | 2.68 |' in page
    # throughput: 32768 tokens in 2 ms = 16.4 Mtok/s
    assert '| 32768 | 1 | 16.4 | 8.2 |' in page
    assert '![forward throughput](benchmarks/forward_throughput.png)' in page


def test_report_flags_outputs_outside_the_bound():
    record = _record()
    record['sections'][0]['rows'][0]['rel_diff_vs_ours']['FlashKDA'] = 0.03
    assert "FlashKDA's output OUTSIDE 2e-2 of ours (largest 3.0e-2)" in report.render(record)


def test_report_command_writes_the_page(tmp_path, capsys):
    results = tmp_path / 'results.json'
    results.write_text(json.dumps(_record()))
    assert cli.main(['report', str(results), '--page', str(tmp_path / 'page.md')]) == 0
    assert (tmp_path / 'page.md').read_text().startswith('# Benchmarks')


def test_committed_page_is_the_generators_output_of_the_committed_record():
    record = json.loads((ROOT / 'benchmarks' / 'results.json').read_text())
    expected = report.render(record, 'benchmarks/forward_throughput.png', 'benchmarks/results.json')
    assert (ROOT / 'BENCHMARKS.md').read_text() == expected


def test_benchmarks_package_holds_no_test_modules():
    """pytest collects test_*.py / *_test.py: none may live in benchmarks/ or tools/."""
    for folder in ('benchmarks', 'tools'):
        names = [p.name for p in (ROOT / folder).glob('*.py')]
        assert not [n for n in names if n.startswith('test_') or n.endswith('_test.py')], folder


def test_no_gpu_message_names_every_part():
    message = run.no_gpu_message(list(run.PARTS))
    assert all(part in message for part in run.PARTS) and '\n' not in message


def test_flashkda_adapter_passes_flashkdas_arguments():
    """The adapter calls ``flash_kda.fwd`` as its API states: dt_bias as [H, K], scale K^-1/2,
    a bf16 output buffer it returns, lower bound and cu_seqlens passed on."""
    import torch

    from benchmarks import cases, libraries
    seen = {}

    def fake_fwd(q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound, cu_seqlens=None):
        seen.update(scale=scale, out=out, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, cu=cu_seqlens)
        out.fill_(1)

    chunk = libraries.flashkda_chunk(fake_fwd)
    data = cases.chunk_inputs(cases.ChunkCase('varlen', 1, 12, 2, (5, 7)), 'kimi', device='cpu')
    o, final_state = chunk(**data.tensors, **data.options)
    assert final_state is None and o is seen['out'] and bool((o == 1).all())
    assert o.dtype == torch.bfloat16 and o.shape == data.tensors['v'].shape
    assert seen['dt_bias'].shape == (2, 128) and seen['dt_bias'].dtype == torch.float32
    assert seen['A_log'].shape == (2,) and seen['scale'] == 128 ** -0.5
    assert seen['lower_bound'] == cases.LOWER_BOUND and seen['cu'].tolist() == [0, 5, 12]
    plain = cases.chunk_inputs(cases.ChunkCase('(1, 8, 2)', 1, 8, 2), 'g', device='cpu')
    with pytest.raises(ValueError, match='Kimi configuration'):
        chunk(**plain.tensors, **plain.options, A_log=None, dt_bias=None, lower_bound=None)


def test_run_tables_record_every_implementation_on_cpu(monkeypatch):
    """``run``'s chunk table plumbing on CPU tensors (kda's PyTorch path) with a stand-in timer:
    each implementation's time and peak, the relative difference to ours, errors as text."""
    from benchmarks import cases, libraries, timing
    tiny = cases.ChunkCase('(1, 40, 1)', 1, 40, 1)
    monkeypatch.setattr(cases, 'chunk_cases', lambda: [tiny])
    original = cases.chunk_inputs
    monkeypatch.setattr(cases, 'chunk_inputs',
                        lambda case, config='g', **kw: original(case, config, device='cpu', **kw))
    monkeypatch.setattr(timing, 'peak_gib', lambda fn: (fn(), 0.5)[1])
    monkeypatch.setattr(timing, 'free_memory', lambda: None)
    ours = libraries.load_ours().chunk

    def doubled(*args, **kwargs):
        o, state = ours(*args, **kwargs)
        return o * 2, state
    section = run.chunk_section({'ours': ours, 'FLA': 'FLA unavailable (test)', 'FlashKDA': doubled}, 'kimi',
                                False, lambda fn, grad_to_none=None: (fn(), 1.5)[1], False, 'commit-c')
    row = section['rows'][0]
    assert row['ms'] == {'ours': 1.5, 'FlashKDA': 1.5} and row['peak_gib'] == {'ours': 0.5, 'FlashKDA': 0.5}
    assert row['errors'] == {'FLA': 'FLA unavailable (test)'}
    assert row['rel_diff_vs_ours']['FlashKDA'] == pytest.approx(1.0, rel=1e-5)
    assert section['commit'] == 'commit-c' and row['floor_ms']['bytes'] > row['floor_ms']['flops'] > 0
    assert 'FLA: FLA unavailable (test)' in report.render(dict(_record(), sections=[section]))
