"""The launch policy of ``kda.ops.chunk``: shape rules the interpreter's defaults never reach
(halved and transposed state slices, K = 256, wide slices), pipeline stages, the forward in time
segments, programmatic dependent launch (which kernels launch early, and after what) and the side
stream's beta ordered before its readers."""
from __future__ import annotations

import pytest
import torch

import kda.ops.chunk.api as chunk_api
import kda.ops.chunk.intra as chunk_intra
import kda.ops.chunk.launch as chunk_launch
import kda.ops.chunk.layout as chunk_map
import kda.ops.chunk.schedule as chunk_schedule
from kda import chunk_kda
from kda.ops.utils import INTERPRET
from conftest import make_cu_seqlens, make_inputs, make_state, requires_cuda
from chunk_helpers import (CHUNK_MODULES, KDEV, MATRIX, check_case, check_lowp, check_matrix_case, patch_chunk,
                           requires_kernels, spy_launches)

# Every kernel load and store of these tests is bounds-checked in the interpreter.
pytestmark = pytest.mark.usefixtures('bounds_checked_memory')


@pytest.mark.slow
@requires_kernels
@pytest.mark.parametrize('rule', ['halved_state_slice', 'K256'])
def test_launch_rules(monkeypatch, rule):
    """The launcher's shape rules, which the interpreter's defaults never reach: halving the state
    sweeps' value slices (forward carry and gradient sweep) when there are fewer programs than SMs
    (forced by claiming a huge GPU), and K = 256 (32-wide state slices; float32: one pipeline
    stage)."""
    if rule == 'halved_state_slice':
        patch_chunk(monkeypatch, 'sm_count', lambda device: 10 ** 6)
        check_case(1, 40, 1, 2, 32, 48, chunk_size=32)
    else:
        check_case(1, 20, 1, 1, 256, 32, chunk_size=32)


@pytest.mark.slow
@requires_kernels
@pytest.mark.parametrize('case', ['T45-BT32-K60-V48-vfirst', 'T37-BT32-gva24-noh0-nofinal', 'varlen-BT32-V72',
                                  'varlen-BT64-vfirst-l2'])
def test_transposed_sweeps(monkeypatch, case):
    """The backward's carry and gradient sweep holding the state transposed, as they do where their
    programs make at most 1.5 waves (forced by claiming a huge GPU, which also applies
    FEW_PROGRAMS; with the interpreter's one "SM" they are transposed only for a single program,
    N * HV * value slices = 1): the float64 checks of the matrix case, and the launches seen
    transposed."""
    patch_chunk(monkeypatch, 'sm_count', lambda device: 10 ** 6)
    seen = {name: spy_launches(monkeypatch, name, lambda grid, kwargs: kwargs['TRANSPOSED'])
            for name in ('chunk_state_fwd_kernel', 'chunk_state_bwd_kernel')}
    check_matrix_case(*next((s, o) for i, s, o in MATRIX if i == case))
    assert {name: set(s) for name, s in seen.items()} == {'chunk_state_fwd_kernel': {True},
                                                         'chunk_state_bwd_kernel': {True}}


@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16, torch.float32])
def test_state_sweep_stages(monkeypatch, dtype):
    """The pipeline stages the launcher gives the state sweeps, at every head dim and with few or
    many programs: 16-bit inputs never get one stage in the carry or the gradient sweep (they
    faulted on the H200 so, see state_launch_config); float32 never more than 2, and 1 at K = 256
    (shared memory)."""
    for few in (False, True):
        patch_chunk(monkeypatch, 'sm_count', lambda device: 10 ** 6 if few else 1)
        for K in (16, 64, 128, 256):
            for stage in ('state_fwd', 'state_bwd', 'state_output'):
                cfg = chunk_launch.state_launch_config(stage, K, 128, 4, torch.device('cpu'), dtype)
                stages = cfg.get('num_stages', 2)
                what = f"{stage} K={K} few={few} {dtype}: {cfg}"
                assert cfg['BK'] >= K and cfg['BV'] <= (32 if K > 128 else 128), what
                if dtype == torch.float32:
                    assert stages <= (2 if K <= 128 else 1), what
                elif stage != 'state_output':
                    assert stages >= 2, what


def test_fused_sweep_slices(monkeypatch):
    """The fused forward sweep's slices on a 132-SM GPU: WIDE_SLICES (one 128-wide slice with 8
    warps) for 16-bit inputs at K <= 128 where TUNING's 64-wide slices give at least as many
    programs as SMs and V needs more than one; TUNING's setting in float32, at V <= 64 and at
    K = 256 (32-wide there); FEW_PROGRAMS' with fewer programs than SMs. The backward's sweeps
    never take WIDE_SLICES."""
    patch_chunk(monkeypatch, 'sm_count', lambda device: 132)
    cpu = torch.device('cpu')

    def cfg(stage='state_output', K=128, V=128, heads=128, dtype=torch.bfloat16):
        c = chunk_launch.state_launch_config(stage, K, V, heads, cpu, dtype)
        return c['BV'], c['num_warps'], c.get('num_stages', 2)

    wide = (128, 8, 2)
    for dtype in (torch.bfloat16, torch.float16):
        assert cfg(dtype=dtype) == wide                    # (8, 4096, 16): 256 programs at 64-wide
        assert cfg(heads=66, dtype=dtype) == wide          # 132 programs at 64-wide
        assert cfg(heads=1024, dtype=dtype) == wide
        assert cfg(K=64, V=72, dtype=dtype) == wide
        assert cfg(V=256, dtype=dtype) == wide             # two 128-wide slices
    assert cfg(heads=65)[0] == 32                          # few programs (FEW_PROGRAMS)
    assert cfg(dtype=torch.float32) == (64, 4, 1)
    assert cfg(V=64, heads=132) == (64, 4, 1)               # one 64-wide slice already
    assert cfg(K=256)[:2] == (32, 4)
    for stage in ('state_fwd', 'state_bwd'):
        assert cfg(stage)[:2] == (64, 4), stage


@pytest.mark.slow
@requires_kernels
@pytest.mark.parametrize('V', [72, 160])
def test_fused_sweep_wide_slice(monkeypatch, V):
    """The fused forward sweep's WIDE_SLICES build (128-wide slices with 8 warps: one for V = 72,
    padded; two for V = 160, the second 32 columns wide), in float16 inference against the
    float64 oracle with the bound of the low-precision tests; the claimed single SM makes the
    launcher pick it on the GPU too."""
    patch_chunk(monkeypatch, 'sm_count', lambda device: 1)
    seen = spy_launches(monkeypatch, 'chunk_state_output_fwd_kernel',
                        lambda grid, kwargs: (grid, kwargs['BV'], kwargs['num_warps']))
    check_lowp(torch.float16, None, 2, 70, 1, 2, 16, V, chunk_size=64, grads=False)
    assert seen == [((4, -(-V // 128)), 128, 8)], seen


def test_forward_segments(monkeypatch):
    """Where the forward runs in time segments (``forward_segments``): only one fixed-length
    sequence whose fused sweep has fewer programs than two an SM, never with ``store_states``; the
    segments are whole chunks, cover the sequence in order, and shrink (never grow) where the
    sweep is the shorter part (many heads), equal otherwise; not for short sequences, whose time
    the host's launches would set (SEGMENT_MIN_TOKEN_HEADS, lifted for the shape checks)."""
    cpu = torch.device('cpu')

    def segments(B, T, HV, few=True, varlen=False, store=False, V=128):
        patch_chunk(monkeypatch, 'sm_count', lambda device: 10 ** 6 if few else 1)
        layout = chunk_map.chunk_layout(B, T, 64, None, None)
        return chunk_schedule.forward_segments(B, T, HV, 128, V, layout, torch.zeros(2) if varlen else None,
                                          store, cpu)

    assert segments(1, 16384, 32) is not None and segments(1, 8192, 32) is None
    patch_chunk(monkeypatch, 'SEGMENT_MIN_TOKEN_HEADS', 0)
    for T, HV in ((32768, 32), (32768, 64), (65536, 16), (32769, 32), (200, 4), (129, 40), (65, 1),
                  *((T, HV) for T in (257, 300, 320, 1000, 8191) for HV in (4, 20, 21, 40))):
        seg = segments(1, T, HV)
        assert seg[0][0] == 0 and seg[-1][1] == T, seg
        assert len(seg) == min(chunk_schedule.FORWARD_SEGMENTS, -(-T // 64)), seg
        assert all(a[1] == b[0] for a, b in zip(seg, seg[1:])), seg
        assert all(t0 % 64 == 0 and t1 > t0 for t0, t1 in seg), seg
        lengths = [t1 - t0 for t0, t1 in seg[:-1]]
        assert lengths == sorted(lengths, reverse=True), seg
        if T % (64 * chunk_schedule.FORWARD_SEGMENTS) == 0 and T >= 4096:
            assert (max(lengths) == min(lengths)) == (HV <= chunk_schedule.SEGMENT_BALANCE), seg
    assert segments(1, 64, 4) is None                  # one chunk
    assert segments(2, 4096, 4) is None                # a segment would not be a contiguous view
    assert segments(1, 4096, 4, varlen=True) is None
    assert segments(1, 4096, 4, store=True) is None
    assert segments(1, 4096, 4, few=False) is None     # the sweep fills the GPU
    # Between one program for every two SMs and two an SM: BUSY_SWEEP_SEGMENTS (64-wide slices:
    # 2 programs a head; 132 SMs as on the H200).
    patch_chunk(monkeypatch, 'sm_count', lambda device: 132)
    layout = chunk_map.chunk_layout(1, 8192, 64, None, None)
    busy = chunk_schedule.BUSY_SWEEP_SEGMENTS
    for HV, count in ((32, 4), (33, 4), (34, busy), (96, busy), (131, busy), (132, None)):
        seg = chunk_schedule.forward_segments(1, 8192, HV, 128, 128, layout, None, False, cpu)
        assert (None if seg is None else len(seg)) == count, (HV, seg)


@pytest.mark.slow
@requires_kernels
@pytest.mark.parametrize('case', ['T100-BT32-vfirst', 'T193-fp32-noh0', 'T150-gate-nofinal-inference',
                                  'T100-BT32-gate-busy', 'T100-BT32-busy-nofinal-inference'])
def test_segmented_forward(monkeypatch, case):
    """The forward in time segments (forced by claiming a huge GPU, at a length the launcher would
    leave whole): outputs, final state and every gradient bit for bit those of the forward in one
    pass, which the other tests check against float64 (the same chunk steps, the state handed from
    segment to segment in float32). 'gate-nofinal-inference': the Kimi gate activated in the first
    kernel, no final state (the last segment stores none), under no_grad. 'busy': a GPU of 4 SMs,
    which the sweep's 4 programs (4 heads, one value slice) leave busy (``busy_sweep``): the
    cumsum runs for the whole sequence first, then 3 segments. 'BT32': 32-token chunks, half the
    interpreter's time for as many chunks. Inference ('inference') normalizes raw q and k in each
    segment's pair products; training normalizes them in a pass of its own first."""
    T = int(case.split('-')[0][1:])
    BT = 32 if 'BT32' in case else 64
    dtype = torch.float32 if 'fp32' in case else torch.float16
    vfirst, with_h0, final = 'vfirst' in case, 'noh0' not in case, 'nofinal' not in case
    opts = dict(use_qk_l2norm_in_kernel=True)
    if 'gate' in case:
        opts.update(use_gate_in_kernel=True, A_log=torch.log(1 + 15 * torch.rand(4)).to(KDEV),
                    dt_bias=(0.1 * torch.randn(4 * 32)).to(KDEV), safe_gate=True, lower_bound=-5.0,
                    use_beta_sigmoid_in_kernel=True)
    busy = 'busy' in case
    patch_chunk(monkeypatch, 'sm_count', lambda device: 4 if busy else 10 ** 6)
    patch_chunk(monkeypatch, 'SEGMENT_MIN_TOKEN_HEADS', 0)
    x = make_inputs(1, T, 2, 4, 32, 48, dtype=dtype, device=KDEV)
    h0 = make_state(1, 4, 32, 48, state_v_first=vfirst, device=KDEV) if with_h0 else None
    seen, cumsums, matrices = [], [], []
    segments = chunk_schedule.forward_segments
    patch_chunk(monkeypatch, 'forward_segments', lambda *a: seen.append(segments(*a)) or seen[-1])
    cumsum, rest = chunk_intra.cumulative_decay, chunk_intra.pair_products_and_solve
    patch_chunk(monkeypatch, 'cumulative_decay',
                lambda q, *a, decayed: cumsums.append((q.shape[1], decayed)) or cumsum(q, *a, decayed=decayed))
    patch_chunk(monkeypatch, 'pair_products_and_solve',
                lambda q, *a, **kw: matrices.append((q.shape[1], a[-1])) or rest(q, *a, **kw))

    def run():
        if not final:
            with torch.no_grad():
                o, ht = chunk_kda(**x, initial_state=h0, state_v_first=vfirst, chunk_size=BT, **opts)
            assert ht is None
            return [o]
        leaves = {n: t.detach().clone().requires_grad_() for n, t in x.items()}
        state = None if h0 is None else h0.clone().requires_grad_()
        o, ht = chunk_kda(**leaves, initial_state=state, output_final_state=True, state_v_first=vfirst,
                          chunk_size=BT, **opts)
        (o.float().sin().sum() + ht.cos().sum()).backward()
        return [o, ht] + [t.grad for t in (*leaves.values(), state) if t is not None]

    got = run()
    assert chunk_schedule.busy_sweep(4, 32, 48, KDEV) == busy
    assert seen[-1] is not None and len(seen[-1]) == min(3 if busy else 4, -(-T // BT)), seen
    # The forward's cumsum: once over the whole sequence first with a busy sweep, else one a
    # segment; the pair products and the solve one a segment (the backward's recompute: whole).
    lengths = [t1 - t0 for t0, t1 in seen[-1]]
    assert [n for n, decayed in cumsums if not decayed] == ([T] if busy else lengths), cumsums
    assert matrices == [(n, 'inference' in case) for n in lengths], matrices
    patch_chunk(monkeypatch, 'forward_segments', lambda *a: None)
    for name, a, b in zip(['o', 'ht', *x, 'h0'], got, run()):
        assert torch.equal(a, b), name


# The in-chunk stage's kernels, in launch order.
IN_CHUNK_KERNELS = ('chunk_cumsum_kernel', 'chunk_pair_fwd_kernel', 'chunk_solve_kernel')


@pytest.mark.skipif(not INTERPRET, reason="records the interpreter's launches (CPU tensors)")
@pytest.mark.parametrize('case', ['train-segmented', 'train-busy-keep', 'inference-segmented',
                                  'inference-busy', 'inference-whole', 'inference-plain-segmented',
                                  'varlen-intermediate'])
def test_dependent_launch_chain(monkeypatch, case):
    """The launch side of PDL (``dependent_launch`` forced on; kda.ops.chunk's kernels recorded,
    not run): only the pair products and the solve of the inference forward with l2norm in the
    kernel are launched with ``launch_pdl``, and always with ``PDL`` (their waits) compiled in;
    training's and the other inference's plainly, without their waits; the cumsum never (it
    releases its dependents at its start without waiting, so it must not start early itself); no
    other kernel is. And on the stream where they run, each PDL launch comes right after one of
    the in-chunk stage's kernels (event records and waits aside), never after a PyTorch operation or
    another module's kernel: the pair products read q and k before their wait (L2NORM), which
    only a kernel that was not launched early, or that waited before releasing, makes safe (a
    kernel that does not release lets its dependent start as it exits, before its writes are
    flushed: NVIDIA/cccl#9134). Training (segmented; the busy sweep, disable_recompute),
    inference with beta logits (the side stream's beta: segmented, busy, whole; segmented
    without l2norm) and varlen with the intermediate states."""
    import contextlib
    import triton.runtime.interpreter as interpreter
    from torch.utils._python_dispatch import TorchDispatchMode

    patch_chunk(monkeypatch, 'dependent_launch', lambda device: True)
    patch_chunk(monkeypatch, 'SEGMENT_MIN_TOKEN_HEADS', 0)
    patch_chunk(monkeypatch, 'sm_count', lambda device: 4 if 'busy' in case else 10 ** 6)
    ours = {vars(m)[n] for m in CHUNK_MODULES for n in vars(m) if n.endswith('_kernel')}
    seen, where = [], {'side': False, 'inside': False}

    class Side:                               # the side stream kda.ops.utils.fork hands out
        device = torch.device('cpu')

    def fork(device):
        seen.append(('fork', where['side'], {}))
        return Side()

    def join(side):
        if side is not None:
            seen.append(('join', where['side'], {}))

    @contextlib.contextmanager
    def stream(s):
        before, where['side'] = where['side'], s is not None or where['side']
        try:
            yield
        finally:
            where['side'] = before

    run = interpreter.InterpretedFunction.run

    def spy(self, *args, grid, warmup, **kwargs):
        seen.append((self.fn.__name__, where['side'], kwargs))
        if self in ours:                      # recorded only: PDL builds do not run here
            return None
        where['inside'], before = True, where['inside']
        try:
            return run(self, *args, grid=grid, warmup=warmup, **kwargs)
        finally:
            where['inside'] = before

    class Ops(TorchDispatchMode):             # PyTorch's kernels, in launch order
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func.overloadpacket)
            if not where['inside'] and not func.is_view and 'empty' not in name and 'detach' not in name:
                seen.append((name, where['side'], {}))
            return func(*args, **(kwargs or {}))

    patch_chunk(monkeypatch, 'fork', fork)
    patch_chunk(monkeypatch, 'join', join)
    monkeypatch.setattr(torch.cuda, 'stream', stream)
    monkeypatch.setattr(interpreter.InterpretedFunction, 'run', spy)

    varlen, inference = case.startswith('varlen'), not case.startswith('train')
    B, T = (2, 100) if case == 'inference-whole' else (1, 100)
    x = make_inputs(B, T, 2, 4, 32, 48, dtype=torch.float16, normalize_k=False)
    opts = dict(use_qk_l2norm_in_kernel=case != 'inference-plain-segmented', chunk_size=32, output_final_state=True,
                disable_recompute=case == 'train-busy-keep')
    if inference:
        x['beta'] = torch.randn(B, T, 4)      # logits: the side stream forms beta's copy
        opts.update(use_beta_sigmoid_in_kernel=True)
    if varlen:
        opts.update(cu_seqlens=make_cu_seqlens([30, 70]), cu_seqlens_cpu=make_cu_seqlens([30, 70]),
                    return_intermediate_states=True)
    leaves = {n: t.requires_grad_(not inference) for n, t in x.items()}
    with Ops():
        if inference:
            with torch.no_grad():
                chunk_kda(**leaves, **opts)
        else:
            o, ht = chunk_kda(**leaves, **opts)
            (o.float().sum() + ht.sum()).backward()

    launches = [(n, kw) for n, _, kw in seen if n.endswith('_kernel')]
    # Early only in inference with l2norm in the kernel, where the pair products form the norms
    # before their wait; elsewhere they have nothing to do before it (and in training, early,
    # they cost 0.17 ms a step at one shape on the H200: kda/ops/chunk/launch.py, dependent_launch).
    l2norm = opts['use_qk_l2norm_in_kernel']
    early = [n for n, _ in launches if n in IN_CHUNK_KERNELS[1:]] if inference and l2norm else []
    assert [n for n, kw in launches if kw.get('launch_pdl')] == early, launches
    assert all(kw.get('PDL') is (n == IN_CHUNK_KERNELS[0] or inference and l2norm)
               for n, kw in launches if n in IN_CHUNK_KERNELS), launches
    segments = chunk_schedule.forward_segments(B, T, 4, 32, 48, chunk_map.chunk_layout(B, T, 32, None, None),
                                          opts.get('cu_seqlens'), varlen, torch.device('cpu'))
    assert (segments is not None) == case.endswith(('segmented', 'busy', 'keep')), segments
    assert sum(n == 'chunk_pair_fwd_kernel' for n, _ in launches) == len(segments or [0]), launches
    main = [(n, kw) for n, side, kw in seen if not side and n not in ('fork', 'join')]
    for i, (n, kw) in enumerate(main):
        if kw.get('launch_pdl'):
            before, kw_before = main[i - 1] if i else ('nothing', {})
            assert before in IN_CHUNK_KERNELS and kw_before.get('PDL') is True, (n, main[max(0, i - 3):i + 1])


@requires_cuda
@pytest.mark.parametrize('case', ['whole', 'segmented', 'segmented-busy'])
def test_inference_beta_ordered_before_its_readers(monkeypatch, case):
    """The side stream's beta (``prepare_beta``) is written behind ~5 ms of sleep after being
    filled with NaN: a pair product, solve or sweep that read it before the current stream joined
    the side stream would make the outputs NaN or differ. And the caller's beta is itself written
    behind ~5 ms of sleep on the current stream after a NaN fill: a side stream that did not wait
    for it would read NaN. Whole (two sequences), in time segments (one) and in segments after
    the cumsum of the whole sequence (12 SMs claimed, ``busy_sweep``), all past the forced
    SEGMENT_MIN_TOKEN_HEADS."""
    patch_chunk(monkeypatch, 'SEGMENT_MIN_TOKEN_HEADS', 0)
    if case.endswith('busy'):
        patch_chunk(monkeypatch, 'sm_count', lambda device: 12)
    B = 2 if case == 'whole' else 1
    x = make_inputs(B, 1500, 4, 4, 128, 128, dtype=torch.bfloat16, device='cuda')
    logits = torch.randn(B, 1500, 4, device='cuda')
    h0 = make_state(B, 4, 128, 128, device='cuda')
    layout = chunk_map.chunk_layout(B, 1500, 64, None, None)
    dev = torch.device('cuda')
    assert (chunk_schedule.forward_segments(B, 1500, 4, 128, 128, layout, None, False, dev) is not None) == (B == 1)
    assert chunk_schedule.busy_sweep(4, 128, 128, dev) == case.endswith('busy')

    def forward(beta):
        with torch.no_grad():
            return chunk_kda(**dict(x, beta=beta), initial_state=h0, output_final_state=True,
                             use_beta_sigmoid_in_kernel=True)

    want = forward(logits)
    prepare = chunk_api.kernel_beta

    def late(out, beta, **kw):
        out.fill_(float('nan'))
        torch.cuda._sleep(10 ** 7)
        prepare(out, beta, **kw)

    patch_chunk(monkeypatch, 'kernel_beta', late)
    beta = torch.full_like(logits, float('nan'))
    torch.cuda._sleep(10 ** 7)
    beta.copy_(logits)
    got = forward(beta)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
