"""CUDA only, compiled kernels at real sizes: bf16 at B = 8, T = 4096, H = 16, K = V = 128, varlen
over 8192 tokens, K = 256, gradients against float64 at T = 512, a user's stream, CUDA graph
capture, and tensors on a device that is not the current one."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kda.ops.chunk.launch as chunk_launch
import kda.ops.chunk.layout as chunk_map
import kda.ops.chunk.schedule as chunk_schedule
from kda import chunk_kda, fused_recurrent_kda, naive_recurrent_kda
from kda.ops.utils import INTERPRET
from conftest import make_cu_seqlens, make_inputs, make_state, rel_err, requires_cuda
from chunk_helpers import assert_errs, compare_with_float64, lowp_bound, patch_chunk

# Every kernel load and store of these tests is bounds-checked in the interpreter.
pytestmark = pytest.mark.usefixtures('bounds_checked_memory')


def _model_inputs(B, T, H, K, V, dtype, l2=False, device='cuda'):
    """Model-like inputs: q, k Gaussian (unit-norm k unless l2norm runs in the kernel),
    g = logsigmoid(x + 2) in float32 (log-decays in (-inf, 0), mostly -0.02 .. -1), beta = sigmoid(x)."""
    q = torch.randn(B, T, H, K)
    k = torch.randn(B, T, H, K)
    if not l2:
        k = k / k.norm(dim=-1, keepdim=True)
    v = torch.randn(B, T, H, V)
    g = F.logsigmoid(torch.randn(B, T, H, K) + 2.0)
    beta = torch.sigmoid(torch.randn(B, T, H))
    return dict(q=q.to(dtype).to(device), k=k.to(dtype).to(device), v=v.to(dtype).to(device),
                g=g.float().to(device), beta=beta.to(dtype).to(device))


def _no_grad_ref(x, h0, cu=None, l2=False, dtype=torch.float64):
    with torch.no_grad():
        return naive_recurrent_kda(**{n: t.to(dtype) for n, t in x.items()},
                                   initial_state=None if h0 is None else h0.to(dtype),
                                   output_final_state=True, cu_seqlens=cu, use_qk_l2norm_in_kernel=l2)


def check_real_sizes(dtype, H, K, V, B=None, T=None, lengths=None, device='cuda'):
    """Low-precision forward and backward at model sizes (fixed length B x T, or varlen
    ``lengths`` with l2norm in the kernel):

    * forward against the float64 oracle, bound ``lowp_bound`` from the reference's own error;
    * the same inputs in float32 through the kernels held to 1e-4 (ieee fp32 dots, no tf32: tf32
      alone would give errors ~5e-4);
    * the backward finite and close to the float32 kernels' gradients (which stand in for the
      oracle: no float64 autograd at this size; the reference's own low-precision gradient error is
      <= ~1 u, so the bound is ``lowp_bound(u, u)``)."""
    l2 = lengths is not None
    if l2:
        cu = make_cu_seqlens(lengths, device=device)
        B, T, N = 1, sum(lengths), len(lengths)
    else:
        cu, N = None, B
    x = _model_inputs(B, T, H, K, V, dtype, l2=l2, device=device)
    h0 = (0.5 * torch.randn(N, H, K, V)).to(device)
    leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
    o, ht = chunk_kda(**leaves, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                      use_qk_l2norm_in_kernel=l2)
    ro, rht = _no_grad_ref(x, h0, cu, l2)
    lo, lht = _no_grad_ref(x, h0, cu, l2, dtype=torch.float32)
    u = rel_err(ro.to(dtype), ro)
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()
    assert_errs({'o': rel_err(o, ro), 'ht': rel_err(ht, rht)},
                {'o': lowp_bound(rel_err(lo.to(dtype), ro), u), 'ht': lowp_bound(rel_err(lht, rht), u)},
                f"{dtype} model sizes lengths={lengths}")

    x32 = {n: t.float().requires_grad_() for n, t in x.items()}
    o32, ht32 = chunk_kda(**x32, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                          use_qk_l2norm_in_kernel=l2)
    assert_errs({'o': rel_err(o32, ro), 'ht': rel_err(ht32, rht)}, 1e-4, "float32 inputs, model sizes")

    do = torch.randn_like(o32)
    dht = torch.randn_like(ht32)
    names = list(x)
    gl = torch.autograd.grad((o.float() * do).sum() + (ht * dht).sum(), [leaves[n] for n in names])
    g32 = torch.autograd.grad((o32 * do).sum() + (ht32 * dht).sum(), [x32[n] for n in names])
    gerrs = {}
    for n, a, b in zip(names, gl, g32):
        assert torch.isfinite(a).all(), f"d{n} not finite"
        gerrs['d' + n] = rel_err(a, b)
    assert_errs(gerrs, lowp_bound(u, u), f"{dtype} gradients vs float32 kernels")


def check_gradients_vs_float64(dtype, B, T, H, HV, K, V, device='cuda'):
    """Gradients of every input against float64 autograd through the naive recurrence."""
    x = _model_inputs(B, T, HV, K, V, dtype, device=device)
    x['q'], x['k'] = x['q'][:, :, :H].contiguous(), x['k'][:, :, :H].contiguous()
    h0 = (0.5 * torch.randn(B, HV, K, V)).to(device)
    leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
    leaves['initial_state'] = h0.clone().requires_grad_()
    compare_with_float64(
        leaves, lambda L: chunk_kda(**L, output_final_state=True),
        lambda L: naive_recurrent_kda(**L, output_final_state=True), dtype, 1e-4,
        f"{dtype} gradients vs float64", low_cast=lambda t: t.clone())


@requires_cuda
def test_cuda_bf16_real_sizes():
    """bf16, B=8, T=4096, H=16, K=V=128."""
    check_real_sizes(torch.bfloat16, H=16, K=128, V=128, B=8, T=4096)


@requires_cuda
def test_cuda_bf16_varlen_real_sizes():
    """bf16 varlen: 8 mixed lengths (8192 tokens; partial chunks, a 1-token sequence), H=16,
    K=V=128, l2norm in the kernel."""
    check_real_sizes(torch.bfloat16, H=16, K=128, V=128, lengths=[1, 63, 64, 65, 500, 1000, 2437, 4062])


@requires_cuda
@pytest.mark.parametrize('B,H,T', [(1, 2, 1000), (8, 16, 200)])
def test_cuda_bf16_head_dim_256(B, H, T):
    """bf16 at K = 256 (value slices of at most 32 in the state sweeps; two pipeline stages for the
    carry and the gradient sweep, which faulted on the H200 with the one this shape used to get),
    with few programs (B = 1, H = 2) and with many."""
    check_real_sizes(torch.bfloat16, H=H, K=256, V=128, B=B, T=T)


@requires_cuda
@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float32])
def test_cuda_gradients(dtype):
    """B=2, T=512, GVA (H=2 q/k heads, HV=4), K=V=128, against float64 autograd."""
    check_gradients_vs_float64(dtype, B=2, T=512, H=2, HV=4, K=128, V=128)


def on_a_user_stream(fn):
    """``fn()`` called from a new stream of the caller's, whose freed memory is overwritten with NaN
    right after (what a launch left running on a side stream would still read)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        out = fn()
        torch.full((64 << 20,), float('nan'), device='cuda')
    torch.cuda.current_stream().wait_stream(stream)
    return out


@requires_cuda
def test_cuda_backward_on_a_user_stream():
    """Few programs (B = 1, HV = 2): the backward forks its carry onto a side stream
    (``kda.ops.utils.fork``). Run from a stream of the caller's, with that stream's memory reused
    right after, the gradients are the default stream's, bit for bit."""
    x = make_inputs(1, 700, 2, 2, 64, 64, dtype=torch.bfloat16, device='cuda')
    h0 = make_state(1, 2, 64, 64, device='cuda')

    def grads():
        leaves = {n: t.detach().clone().requires_grad_() for n, t in x.items()}
        state = h0.clone().requires_grad_()
        o, ht = chunk_kda(**leaves, initial_state=state, output_final_state=True, chunk_size=64)
        (o.float().square().sum() + ht.square().sum()).backward()
        return [t.grad.clone() for t in (*leaves.values(), state)]

    assert chunk_launch.transposed_sweeps(1, 2, 64, 64, torch.device('cuda'), torch.bfloat16)
    expected = grads()
    for a, b in zip(on_a_user_stream(grads), expected):
        assert torch.equal(a, b)


@requires_cuda
@pytest.mark.parametrize('busy', [False, True])
def test_cuda_segmented_forward_on_a_user_stream(monkeypatch, busy):
    """One sequence with few sweep programs (B = 1, HV = 4, K = V = 128, bf16): the forward runs
    in time segments, each sweep on a side stream beside the next segment's in-chunk stage. Its outputs
    and final state are the one-pass forward's bit for bit, also when called from a stream of the
    caller's whose memory is reused right after. (Segmented at this length, which the launcher
    leaves whole, SEGMENT_MIN_TOKEN_HEADS.) 'busy': 12 SMs claimed, which the sweep's 8 programs
    leave busy: the cumsum over the whole sequence first, then 3 segments."""
    patch_chunk(monkeypatch, 'SEGMENT_MIN_TOKEN_HEADS', 0)
    if busy:
        patch_chunk(monkeypatch, 'sm_count', lambda device: 12)
    assert chunk_schedule.busy_sweep(4, 128, 128, torch.device('cuda')) == busy
    x = make_inputs(1, 3000, 4, 4, 128, 128, dtype=torch.bfloat16, device='cuda')
    h0 = make_state(1, 4, 128, 128, device='cuda')

    def forward():
        with torch.no_grad():
            return chunk_kda(**x, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)

    layout = chunk_map.chunk_layout(1, 3000, 64, None, None)
    assert chunk_schedule.forward_segments(1, 3000, 4, 128, 128, layout, None, False,
                                      torch.device('cuda')) is not None
    got = on_a_user_stream(forward)
    patch_chunk(monkeypatch, 'forward_segments', lambda *a: None)
    for a, b in zip(got, forward()):
        assert torch.equal(a, b)


@requires_cuda
@pytest.mark.parametrize('mode', ['forward', 'training', 'forward-busy'])
def test_cuda_graph_capture(monkeypatch, mode):
    """Few programs (B = 1, HV = 4): the forward in time segments (at a length the launcher would
    leave whole, SEGMENT_MIN_TOKEN_HEADS) and the backward's forked carry both launch on a side
    stream. Captured in a CUDA graph (a forward under no_grad, or a whole forward + backward) and
    replayed after new inputs are copied in, the results equal the eager ones bit for bit.
    'busy': 12 SMs claimed (``busy_sweep``: the cumsum over the whole sequence first)."""
    patch_chunk(monkeypatch, 'SEGMENT_MIN_TOKEN_HEADS', 0)
    if mode.endswith('busy'):
        patch_chunk(monkeypatch, 'sm_count', lambda device: 12)
        mode = mode.removesuffix('-busy')
    T, H, K, V = 1500, 4, 128, 128
    layout = chunk_map.chunk_layout(1, T, 64, None, None)
    assert chunk_schedule.forward_segments(1, T, H, K, V, layout, None, False, torch.device('cuda')) is not None
    x = make_inputs(1, T, H, H, K, V, dtype=torch.bfloat16, device='cuda')
    leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
    state = make_state(1, H, K, V, device='cuda').requires_grad_()
    do = torch.randn(1, T, H, V, dtype=torch.bfloat16, device='cuda')
    dht = torch.randn(1, H, K, V, device='cuda')

    def step(xs, h0):
        if mode == 'forward':
            with torch.no_grad():
                return list(chunk_kda(**xs, initial_state=h0, output_final_state=True,
                                      use_qk_l2norm_in_kernel=True))
        o, ht = chunk_kda(**xs, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
        torch.autograd.backward((o, ht), (do, dht))
        return [o, ht] + [t.grad for t in (*xs.values(), h0)]

    side = torch.cuda.Stream()                       # warm up (compile) outside the capture
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(leaves, state)
    torch.cuda.current_stream().wait_stream(side)
    for t in (*leaves.values(), state):
        t.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step(leaves, state)

    for trial in range(2):
        new = make_inputs(1, T, H, H, K, V, dtype=torch.bfloat16, device='cuda')
        h0 = make_state(1, H, K, V, device='cuda')
        with torch.no_grad():
            for name, t in leaves.items():
                t.copy_(new[name])
            state.copy_(h0)
        graph.replay()
        torch.cuda.synchronize()
        eager = step({n: t.clone().requires_grad_() for n, t in new.items()}, h0.clone().requires_grad_())
        for i, (a, b) in enumerate(zip(captured, eager)):
            assert torch.equal(a, b), f"trial {trial}: output {i} of the replay differs from eager"


@requires_cuda
def test_cuda_graph_capture_creates_the_side_stream(monkeypatch):
    """The inference forward's beta stream (``fork``, at SEGMENT_MIN_TOKEN_HEADS and above)
    created for the first time inside a CUDA graph capture: B = 2, not segmented, so that no
    earlier call of this shape used a side stream (the cached stream is dropped before the
    capture). The replay, after new inputs are copied in, equals eager bit for bit."""
    from kda.ops import utils
    patch_chunk(monkeypatch, 'SEGMENT_MIN_TOKEN_HEADS', 0)
    B, T, H, K, V = 2, 300, 4, 64, 64
    layout = chunk_map.chunk_layout(B, T, 64, None, None)
    assert chunk_schedule.forward_segments(B, T, H, K, V, layout, None, False, torch.device('cuda')) is None
    x = make_inputs(B, T, H, H, K, V, dtype=torch.bfloat16, device='cuda', normalize_k=False)
    x['beta'] = torch.randn(B, T, H, dtype=torch.bfloat16, device='cuda')      # logits

    def forward(xs):
        with torch.no_grad():
            return chunk_kda(**xs, use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                             output_final_state=True)

    warm = torch.cuda.Stream()                       # compile outside the capture
    warm.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warm):
        forward(x)
    torch.cuda.current_stream().wait_stream(warm)
    torch.cuda.synchronize()
    utils._side_stream.cache_clear()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = forward(x)
    for trial in range(2):
        new = make_inputs(B, T, H, H, K, V, dtype=torch.bfloat16, device='cuda', normalize_k=False)
        new['beta'] = torch.randn(B, T, H, dtype=torch.bfloat16, device='cuda')
        for name, t in x.items():
            t.copy_(new[name])
        graph.replay()
        torch.cuda.synchronize()
        for i, (a, b) in enumerate(zip(captured, forward(new))):
            assert torch.equal(a, b), f"trial {trial}: output {i} of the replay differs from eager"


@requires_cuda
def test_cuda_graph_capture_varlen_map():
    """A varlen forward captured in a CUDA graph on the stream where an eager call with the same
    bounds just ran (which keeps its chunk map, ``chunk_layout``): the capture builds a map of its
    own, so an eager call with other bounds (which replaces the kept map and frees it) and memory
    overwritten after it leave the replay's outputs those of the eager call."""
    T, H = 1500, 4
    x = make_inputs(1, T, H, H, 64, 64, dtype=torch.bfloat16, device='cuda')
    cu, other = torch.tensor([0, 300, 1300, 1500]), torch.tensor([0, 700, 1500])
    cu_dev, other_dev = cu.cuda(), other.cuda()

    def forward(bounds, bounds_dev):
        # cu_seqlens_cpu: no read-back of the bounds (a sync, which a capture refuses).
        with torch.no_grad():
            return chunk_kda(**x, cu_seqlens=bounds_dev, cu_seqlens_cpu=bounds, output_final_state=True,
                             use_qk_l2norm_in_kernel=True)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        eager = forward(cu, cu_dev)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            captured = forward(cu, cu_dev)
    torch.cuda.current_stream().wait_stream(stream)
    forward(other, other_dev)
    torch.full((64 << 20,), -1, dtype=torch.int32, device='cuda')
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(captured, eager):
        assert torch.equal(a, b)


@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET or torch.cuda.device_count() < 2,
                    reason="needs two CUDA devices")
def test_cuda_tensors_on_a_device_not_current(monkeypatch):
    """Tensors on cuda:1 while cuda:0 is the current device (Triton launches on the current
    device: ``on_q_device`` makes q's current for the call): chunk_kda's inference forward (in
    time segments, forced, so with the norms and the sweeps on a side stream) and its forward +
    backward, and a fused_recurrent_kda step, give on cuda:1 the bits they give on cuda:0, and
    leave cuda:0 current."""
    patch_chunk(monkeypatch, 'SEGMENT_MIN_TOKEN_HEADS', 0)
    x0 = make_inputs(1, 300, 4, 4, 128, 128, dtype=torch.bfloat16, device='cuda:0', normalize_k=False)
    h0 = make_state(1, 4, 128, 128, device='cuda:0')

    def run(xs, state):
        with torch.no_grad():
            o, ht = chunk_kda(**xs, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
            od, hd = fused_recurrent_kda(**{n: t[:, :1] for n, t in xs.items()}, initial_state=state,
                                         output_final_state=True, use_qk_l2norm_in_kernel=True)
        leaves = {n: t.clone().requires_grad_() for n, t in xs.items()}
        ot, htt = chunk_kda(**leaves, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
        (ot.float().square().sum() + htt.sum()).backward()
        return [o, ht, od, hd, ot, htt] + [t.grad for t in leaves.values()]

    torch.cuda.set_device(0)
    expected = run(x0, h0)
    got = run({n: t.to('cuda:1') for n, t in x0.items()}, h0.to('cuda:1'))
    torch.cuda.synchronize('cuda:1')
    assert torch.cuda.current_device() == 0
    for a, b in zip(expected, got):
        assert b.device == torch.device('cuda:1') and torch.equal(a, b.to('cuda:0'))
