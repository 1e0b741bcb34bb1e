"""Context parallelism (``kda.cp``): one packed batch split across real gloo processes.

Every case runs in ``world_size`` spawned processes (gloo on 127.0.0.1, a free port), each rank
calling ``chunk_kda_cp`` on its contiguous slice and backpropagating random upstream gradients of
its outputs and final states. Rank 0 then concatenates every rank's outputs, final states and
gradients (A_log's and dt_bias' summed over ranks, as data-parallel reduction does) and compares
them with the single-process ``chunk_kda`` call on the whole batch, by the relative error norm
(float32; ``TOL`` = 1e-5). Both compute paths run, chosen in the children's environment before
they import kda: the Triton kernels through the interpreter (``TRITON_INTERPRET=1``) and the
PyTorch path (no interpreter).

The layouts cover uneven splits, sequence boundaries on rank boundaries, a sequence spanning every
rank (middle ranks, whose transitions are exchanged), a rank holding one token, empty sequences,
initial and final states in both state layouts, and the Kimi options (in-kernel gate with a lower
bound, l2-normalized q and k, sigmoid beta, grouped value heads). Malformed contexts must raise
``ValueError`` on every rank before any kernel runs.

One spawn serves all cases of a (world size, path, speed) group; the interpreter's larger groups
are marked slow.
"""
from __future__ import annotations

import dataclasses
import os
import socket
import tempfile
import time
import zlib
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import make_cu_seqlens, make_inputs, make_state, reference64, rel_err

from kda.cp import local_summary, merge_states

TOL = 1e-5
SPAWN_TIMEOUT_S = 600
H, K, V = 1, 16, 16


@dataclass(frozen=True)
class Case:
    world_size: int
    seqlens: tuple[int, ...]
    rank_lengths: tuple[int, ...] | None
    HV: int = 2
    states: bool = True                 # initial_state given and final states returned
    state_v_first: bool = False
    kimi: bool = False                  # in-kernel gate + lower bound, l2norm, sigmoid beta
    interpreter_slow: bool = True       # in the interpreter, only with -m slow


CASES = {
    # a 90-token sequence crosses the boundary at 70; the split is uneven
    'uneven_split': Case(2, (40, 90, 30), (70, 90)),
    # the same in fewer tokens, for the interpreter
    'uneven_split_small': Case(2, (25, 60, 15), (45, 55), HV=1, interpreter_slow=False),
    # two sequences end exactly on rank boundaries: no rank communicates
    'boundaries_on_rank_boundaries': Case(2, (64, 86), (64, 86)),
    # the boundary at 50 is a sequence boundary, the one at 140 is not
    'one_boundary_aligned': Case(3, (50, 70, 50), (50, 90, 30)),
    # a 153-token sequence spans all three ranks: rank 1 is a middle rank
    'sequence_spans_all_ranks': Case(3, (7, 153, 10), (50, 60, 60)),
    'sequence_spans_both_ranks': Case(2, (100,), (30, 70), states=False),
    # rank 0 holds one token, which starts the sequence it hands on
    'first_rank_one_token': Case(2, (100,), (1, 99)),
    # the middle rank holds one token
    'middle_rank_one_token': Case(3, (20, 130), (80, 1, 69)),
    # an empty sequence at position 30, on the rank whose last piece crosses into the next
    'empty_sequence': Case(2, (30, 0, 60, 30), (60, 60)),
    'state_v_first': Case(2, (50, 70), (80, 40), state_v_first=True),
    # the Kimi configuration on a sequence spanning three ranks
    'kimi_options': Case(3, (30, 1, 109), (45, 45, 50), HV=2, kimi=True),
    # the same in fewer tokens, for the interpreter: a one-token sequence, then one spanning all
    'kimi_options_small': Case(3, (20, 1, 79), (30, 30, 40), HV=2, kimi=True),
    'kimi_options_two_ranks': Case(2, (77, 43), (60, 60), HV=4, kimi=True),
}


# ---------------------------------------------------------------------------------------------
# Children
# ---------------------------------------------------------------------------------------------

def _global_inputs(case: Case, seed: int):
    """The whole batch's inputs, upstream gradients and options, drawn identically on every rank."""
    gen = torch.Generator().manual_seed(seed)
    T, N, HV = sum(case.seqlens), len(case.seqlens), case.HV

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float32)

    q, k, v = randn(1, T, H, K), randn(1, T, H, K), randn(1, T, HV, V)
    options = {}
    # Mild decay (log-decay ~ -0.01 a step), so that what crosses a rank boundary still weighs in
    # every output and gradient after it.
    if case.kimi:
        g = randn(1, T, HV, K)
        beta = randn(1, T, HV)
        # lower_bound * sigmoid(g + dt_bias) with g + dt_bias ~ -6 +- 1
        options = {'use_gate_in_kernel': True, 'A_log': 0.1 * randn(HV), 'dt_bias': 0.5 * randn(HV * K) - 6,
                   'lower_bound': -5.0, 'safe_gate': True, 'use_qk_l2norm_in_kernel': True,
                   'use_beta_sigmoid_in_kernel': True}
    else:
        k = k / k.norm(dim=-1, keepdim=True)
        g = -(0.001 + 0.02 * torch.rand(1, T, HV, K, generator=gen))
        beta = torch.rand(1, T, HV, generator=gen)
    state_shape = (N, HV, V, K) if case.state_v_first else (N, HV, K, V)
    h0 = 0.5 * randn(*state_shape) if case.states else None
    upstream = {'o': randn(1, T, HV, V), 'final': randn(*state_shape) if case.states else None}
    cu = [0]
    for n in case.seqlens:
        cu.append(cu[-1] + n)
    return {'q': q, 'k': k, 'v': v, 'g': g, 'beta': beta}, h0, options, upstream, torch.tensor(cu)


def _differentiable(tensors: dict, names) -> dict:
    return {n: (x.detach().clone().requires_grad_() if n in names and x is not None else x)
            for n, x in tensors.items()}


def _forward_backward(fn, inputs, h0, options, upstream, case: Case, **kwargs):
    """Runs fn, backpropagates the upstream gradients; returns outputs and every gradient."""
    inputs = _differentiable(inputs, inputs)
    options = _differentiable(options, ('A_log', 'dt_bias'))
    h0 = None if h0 is None else h0.detach().clone().requires_grad_()
    o, final = fn(**inputs, initial_state=h0, output_final_state=case.states,
                  state_v_first=case.state_v_first, **options, **kwargs)
    loss = (o * upstream['o']).sum()
    if case.states:
        loss = loss + (final * upstream['final']).sum()
    loss.backward()
    grads = {f'd{n}': x.grad for n, x in {**inputs, **options, 'initial_state': h0}.items()
             if isinstance(x, torch.Tensor) and x.requires_grad}
    return dict(o=o.detach(), final=None if final is None else final.detach(), **grads)


def _run_case(name: str, case: Case, rank: int) -> dict | None:
    """This rank's CP call; on rank 0 the relative errors of the assembled results."""
    from kda import chunk_kda
    from kda.cp import build_cp_context, chunk_kda_cp
    inputs, h0, options, upstream, cu = _global_inputs(case, seed=zlib.crc32(name.encode()))
    ctx = build_cp_context(cu, dist.group.WORLD, rank_lengths=case.rank_lengths)
    start = sum(case.rank_lengths[:rank])
    local = slice(start, start + ctx.local_length)
    rows = slice(ctx.first_sequence + int(ctx.continues_in[rank]), None)
    local_inputs = {n: x[:, local] for n, x in inputs.items()}
    local_h0 = None if h0 is None else h0[rows][:ctx.num_starting]
    ending = slice(ctx.first_sequence, ctx.first_sequence + ctx.num_ending)
    local_upstream = {'o': upstream['o'][:, local],
                      'final': None if upstream['final'] is None else upstream['final'][ending]}
    mine = _forward_backward(chunk_kda_cp, local_inputs, local_h0, options, local_upstream, case, cp_context=ctx)
    everyone = [None] * ctx.world_size
    dist.all_gather_object(everyone, mine)
    if rank != 0:
        return None
    whole = _forward_backward(chunk_kda, inputs, h0, options, upstream, case, cu_seqlens=cu)
    errors = {}
    for quantity, ref in whole.items():
        parts = [part.get(quantity) for part in everyone]
        if ref is None or any(p is None for p in parts):      # present on some ranks only
            errors[quantity] = 0.0 if ref is None and all(p is None for p in parts) else float('inf')
            continue
        if quantity in ('dA_log', 'ddt_bias'):
            got = torch.stack(parts).sum(0)                 # this rank's share of a shared parameter
        elif quantity in ('final', 'dinitial_state'):
            got = torch.cat(parts, 0)                       # one row per sequence
        else:
            got = torch.cat(parts, 1)                       # tokens
        errors[quantity] = rel_err(got, ref) if got.shape == ref.shape else float('inf')
    return errors


def _refusals(rank: int) -> dict[str, tuple[str, int]]:
    """Every malformed call on this rank: the exception it raised (or 'no error') and how many
    chunk_kda calls it made (none may run)."""
    import kda.ops.chunk as chunk_mod
    from kda.cp import build_cp_context, chunk_kda_cp
    launched = []
    real = chunk_mod.chunk_kda
    chunk_mod.chunk_kda = lambda *a, **kw: launched.append(1) or real(*a, **kw)
    cu = torch.tensor([0, 30, 100])
    ctx = build_cp_context(cu, rank_lengths=(60, 40))
    T = ctx.local_length
    x = {'q': torch.randn(1, T, H, K), 'k': torch.randn(1, T, H, K), 'v': torch.randn(1, T, 1, V),
         'g': -torch.rand(1, T, 1, K), 'beta': torch.rand(1, T, 1)}
    singles = [dist.new_group([r]) for r in range(dist.get_world_size())]
    other = build_cp_context(cu, singles[rank], rank_lengths=(100,))
    calls = {
        'rank_lengths_do_not_sum_to_cu_seqlens': lambda: build_cp_context(cu, rank_lengths=(60, 30)),
        'cu_seqlens_not_divisible_by_ranks': lambda: build_cp_context(torch.tensor([0, 33, 101])),
        'rank_lengths_for_another_group_size': lambda: build_cp_context(cu, rank_lengths=(50, 25, 25)),
        'rank_with_no_token': lambda: build_cp_context(cu, rank_lengths=(100, 0)),
        'tokens_not_matching_rank_length': lambda: chunk_kda_cp(
            **{n: t[:, :T - 1] for n, t in x.items()}, cp_context=ctx),
        'batch_of_two': lambda: chunk_kda_cp(**{n: t.expand(2, *t.shape[1:]) for n, t in x.items()},
                                             cp_context=ctx),
        'context_of_another_rank': lambda: chunk_kda_cp(**x, cp_context=dataclasses.replace(
            ctx, rank=1 - rank)),
        'one_rank_group_with_a_foreign_context': lambda: chunk_kda_cp(**x, cp_context=dataclasses.replace(
            ctx, group=singles[rank])),
        'one_rank_group_context_on_a_slice': lambda: chunk_kda_cp(**x, cp_context=other),
        'cu_seqlens_given': lambda: chunk_kda_cp(**x, cp_context=ctx, cu_seqlens=ctx.cu_seqlens),
        'initial_state_rows': lambda: chunk_kda_cp(**x, cp_context=ctx, initial_state=torch.zeros(
            ctx.num_starting + 1, 1, K, V)),
        'intermediate_states': lambda: chunk_kda_cp(**x, cp_context=ctx, return_intermediate_states=True),
    }
    outcome = {}
    for name, call in calls.items():
        launched.clear()
        try:
            call()
            raised = 'no error'
        except Exception as e:  # noqa: BLE001 -- the type is the result
            raised = type(e).__name__
        outcome[name] = (raised, len(launched))
    chunk_mod.chunk_kda = real
    return outcome


def _child(rank: int, world_size: int, port: int, jobs: list[str], out_dir: str) -> None:
    dist.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{port}', rank=rank, world_size=world_size)
    torch.set_num_threads(1)
    results = {}
    for job in jobs:
        results[job] = _refusals(rank) if job == 'refusals' else _run_case(job, CASES[job], rank)
    torch.save(results, os.path.join(out_dir, f'rank{rank}.pt'))
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# Parent
# ---------------------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def _spawn(world_size: int, interpreter: bool, jobs: list[str]) -> list[dict]:
    """Runs ``jobs`` in ``world_size`` fresh processes; returns each rank's results."""
    saved = os.environ.get('TRITON_INTERPRET')
    os.environ['TRITON_INTERPRET'] = '1' if interpreter else '0'
    try:
        with tempfile.TemporaryDirectory() as out_dir:
            context = mp.start_processes(_child, args=(world_size, _free_port(), jobs, out_dir),
                                         nprocs=world_size, join=False, start_method='spawn')
            try:
                deadline = time.monotonic() + SPAWN_TIMEOUT_S
                while not context.join(timeout=max(deadline - time.monotonic(), 0)):
                    if time.monotonic() >= deadline:
                        pytest.fail(f"{world_size} ranks did not finish {jobs} within {SPAWN_TIMEOUT_S} s")
            finally:
                for p in context.processes:
                    if p.is_alive():
                        p.kill()
            return [torch.load(os.path.join(out_dir, f'rank{r}.pt')) for r in range(world_size)]
    finally:
        if saved is None:
            del os.environ['TRITON_INTERPRET']
        else:
            os.environ['TRITON_INTERPRET'] = saved


PATHS = ('interpreter', 'pytorch')
_GROUP_RESULTS: dict[tuple, list[dict]] = {}


def _slow(name: str, path: str) -> bool:
    return path == 'interpreter' and CASES[name].interpreter_slow


def _case_results(name: str, path: str) -> dict:
    """Rank 0's errors for a case; every case of its (world size, path, speed) group runs at once."""
    case = CASES[name]
    key = (case.world_size, path, _slow(name, path))
    if key not in _GROUP_RESULTS:
        jobs = [n for n, c in CASES.items() if (c.world_size, path, _slow(n, path)) == key]
        _GROUP_RESULTS[key] = _spawn(case.world_size, path == 'interpreter', jobs)
    return _GROUP_RESULTS[key][0][name]


def _case_params():
    return [pytest.param(name, path, id=f'{name}-{path}',
                         marks=[pytest.mark.slow] if _slow(name, path) else [])
            for name in CASES for path in PATHS]


@pytest.mark.parametrize('name, path', _case_params())
def test_matches_single_process(name, path):
    """Outputs, final states and every gradient equal the single-process call's."""
    errors = _case_results(name, path)
    bad = {q: e for q, e in errors.items() if not e < TOL}
    assert not bad, f"relative errors above {TOL}: {bad} (all: {errors})"


REFUSALS = ('rank_lengths_do_not_sum_to_cu_seqlens', 'cu_seqlens_not_divisible_by_ranks',
            'rank_lengths_for_another_group_size', 'rank_with_no_token', 'tokens_not_matching_rank_length',
            'batch_of_two', 'context_of_another_rank', 'one_rank_group_with_a_foreign_context',
            'one_rank_group_context_on_a_slice', 'cu_seqlens_given', 'initial_state_rows',
            'intermediate_states')


@pytest.fixture(scope='module')
def refusals():
    return [r['refusals'] for r in _spawn(2, False, ['refusals'])]


@pytest.mark.parametrize('name', REFUSALS)
def test_bad_context_raises_value_error(refusals, name):
    """On every rank, before any chunk_kda call."""
    assert [r[name] for r in refusals] == [('ValueError', 0)] * len(refusals)


# ---------------------------------------------------------------------------------------------
# The functional layer, in one process
# ---------------------------------------------------------------------------------------------

def _segment_inputs(T: int, HV: int = 2):
    inputs = make_inputs(1, T, H, HV, K, V)
    inputs['g'] = inputs['g'] * 0.05                          # mild decay: S_in still matters at the end
    return inputs


def test_local_summary_maps_entering_to_leaving_state():
    """``transition @ S_in + offset`` is the final state from ``S_in``, per sequence (float64 oracle)."""
    x = _segment_inputs(70)
    cu = make_cu_seqlens([30, 40])
    entering = make_state(2, 2, K, V)
    summary = local_summary(x['k'], x['v'], x['g'], x['beta'], cu_seqlens=cu)
    _, ref = reference64(**x, initial_state=entering, cu_seqlens=cu)
    assert summary.transition.shape == (2, 2, K, K) and summary.offset.shape == (2, 2, K, V)
    assert rel_err(summary.transition @ entering + summary.offset, ref) < TOL


def test_merge_states_composes_consecutive_segments():
    """Summaries of three consecutive segments fold into the final state of the whole sequence."""
    x = _segment_inputs(90)
    entering = make_state(1, 2, K, V)[0]
    parts = [local_summary(*(x[n][:, a:b] for n in ('k', 'v', 'g', 'beta'))) for a, b in ((0, 25), (25, 26), (26, 90))]
    transitions = torch.stack([p.transition[0] for p in parts])
    offsets = torch.stack([p.offset[0] for p in parts])
    _, ref = reference64(**x, initial_state=entering[None])
    assert rel_err(merge_states(transitions, offsets, entering), ref[0]) < TOL


def test_merge_states_backward_fold_is_the_gradient():
    """Folding transposed transitions in reverse order, with zero offsets, from an upstream
    gradient W gives the gradient of <W, merge_states(M, E, S)> with respect to S."""
    transitions = torch.randn(3, 2, K, K, dtype=torch.float64) / K ** 0.5
    offsets = torch.randn(3, 2, K, V, dtype=torch.float64)
    entering = torch.randn(2, K, V, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(2, K, V, dtype=torch.float64)
    (merge_states(transitions, offsets, entering) * upstream).sum().backward()
    folded = merge_states(transitions.flip(0).transpose(-1, -2), torch.zeros_like(offsets), upstream)
    M1, M2, M3 = transitions.transpose(-1, -2)
    assert rel_err(folded, M1 @ (M2 @ (M3 @ upstream))) < 1e-12
    assert rel_err(entering.grad, M1 @ (M2 @ (M3 @ upstream))) < 1e-12


@pytest.mark.parametrize('bad, message', [
    ({'transitions': torch.zeros(2, 1, K, K + 1)}, 'transitions must be'),
    ({'offsets': torch.zeros(3, 1, K, V)}, 'offsets must be'),
    ({'initial_state': torch.zeros(2, K, V)}, 'initial_state must be'),
])
def test_merge_states_refuses_mismatched_shapes(bad, message):
    args = {'transitions': torch.zeros(2, 1, K, K), 'offsets': torch.zeros(2, 1, K, V), 'initial_state': None}
    with pytest.raises(ValueError, match=message):
        merge_states(**{**args, **bad})
