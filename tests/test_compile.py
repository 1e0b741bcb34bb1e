"""``torch.compile``, ``torch.export`` and CUDA-graph capture (docs/API.md, "torch.compile and
CUDA graphs").

* ``fullgraph=True`` traces ``chunk_kda`` (training, with backward) and ``fused_recurrent_kda``
  (a decode step into a state pool, in place) with no graph break, and gives eager's results;
* ``dynamic=True`` compiles once for every T and every sequence count;
* every ``kda::`` op passes ``torch.library.opcheck``; an inference forward exports;
* ``use_graph=True``: the chunk map built on the device gives the host-built map's results bit
  for bit, without reading ``cu_seqlens`` on the host; on CUDA a captured varlen prefill replays
  with new ``cu_seqlens``.

Compiled with ``aot_eager`` on the CPU: inductor would add only C++ compile time to what is
tested here (the ops are opaque to it).
"""
from __future__ import annotations

import pytest
import torch
from conftest import make_cu_seqlens, make_inputs, make_state, rel_err, requires_cuda, requires_interpreter

import kda.ops.library  # noqa: F401  (registers torch.ops.kda.*)
from kda import chunk_kda, fused_recurrent_kda
from kda.ops.chunk import api as chunk_api

H, HV, K, V = 1, 2, 16, 16


class CountingBackend:
    """``aot_eager``, counting the graphs it is handed (one per compile, and per graph break)."""

    def __init__(self):
        self.graphs = 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        return torch._dynamo.lookup_backend('aot_eager')(gm, example_inputs)


class TinyKDA(torch.nn.Module):
    """A projection into the chunk kernel's q, k, v, g, beta and the in-kernel gate's parameters:
    ``train`` runs chunk_kda (with beta logits and the gate inside), ``decode`` one
    fused_recurrent_kda step into a state pool."""

    def __init__(self, D: int = 8):
        super().__init__()
        self.proj = torch.nn.Linear(D, 2 * H * K + HV * V + HV * K + HV)
        self.A_log = torch.nn.Parameter(torch.rand(HV) - 1)
        self.dt_bias = torch.nn.Parameter(0.1 * torch.randn(HV * K))

    def split(self, x):
        B, T, _ = x.shape
        q, k, v, g, beta = self.proj(x).split([H * K, H * K, HV * V, HV * K, HV], -1)
        return (q.view(B, T, H, K), k.view(B, T, H, K), v.view(B, T, HV, V), g.view(B, T, HV, K),
                beta.view(B, T, HV))

    def forward(self, x, h0, cu_seqlens=None):
        q, k, v, g, beta = self.split(x)
        o, ht = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                          use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=self.A_log,
                          dt_bias=self.dt_bias, use_beta_sigmoid_in_kernel=True, cu_seqlens=cu_seqlens,
                          chunk_size=32)
        return o, ht

    def decode(self, x, pool, slots):
        q, k, v, g, beta = self.split(x)
        o, _ = fused_recurrent_kda(q, k, v, g, beta, self.A_log, self.dt_bias, initial_state=pool,
                                   inplace_final_state=True, ssm_state_indices=slots,
                                   use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                   use_beta_sigmoid_in_kernel=True)
        return o


def training_step(model, x, h0, cu_seqlens=None):
    o, ht = model(x, h0, cu_seqlens)
    loss = (o.float() ** 2).sum() + (ht * ht.detach().sign()).sum()
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()] + [h0.grad.clone()]
    for p in (*model.parameters(), h0):
        p.grad = None
    return o.detach(), ht.detach(), grads


def test_fullgraph_training_step_equals_eager():
    """Forward, final state and every parameter's and the initial state's gradient, compiled
    ``fullgraph=True`` (a graph break raises), against eager."""
    model = TinyKDA()
    x = torch.randn(2, 40, 8)
    h0 = make_state(2, HV, K, V).requires_grad_()
    eager = training_step(model, x, h0)
    backend = CountingBackend()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    got = training_step(compiled, x, h0)
    assert backend.graphs == 1
    for name, a, b in zip(['o', 'ht', *(n for n, _ in model.named_parameters()), 'h0'],
                          [eager[0], eager[1], *eager[2]], [got[0], got[1], *got[2]]):
        assert rel_err(b, a) < 1e-6, name


def test_fullgraph_varlen_training_step_equals_eager():
    """Varlen under compile takes the device-built chunk map (no host read of cu_seqlens)."""
    model = TinyKDA()
    cu = make_cu_seqlens([5, 33, 0, 26])
    x = torch.randn(1, 64, 8)
    h0 = make_state(4, HV, K, V).requires_grad_()
    eager = training_step(model, x, h0, cu)
    got = training_step(torch.compile(model, backend='aot_eager', fullgraph=True), x, h0, cu)
    for a, b in zip([eager[0], eager[1], *eager[2]], [got[0], got[1], *got[2]]):
        assert rel_err(b, a) < 1e-6


def test_fullgraph_training_on_strided_views_equals_eager():
    """q, k, v, g and beta as column slices of one packed tensor (a fused projection's output,
    non-contiguous): the backward op reads them at their strides, as eager does."""
    x = make_inputs(2, 40, H, HV, K, V)
    h0 = make_state(2, HV, K, V)
    widths = [H * K, H * K, HV * V, HV * K, HV]
    packed = torch.cat([x[n].flatten(2) for n in 'qkvg'] + [x['beta']], -1)

    def step(packed, h0):
        parts = packed.split(widths, -1)
        shapes = [(H, K), (H, K), (HV, V), (HV, K), (HV,)]
        q, k, v, g, beta = (p.unflatten(-1, s) for p, s in zip(parts, shapes))
        o, ht = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
        return o.square().sum() + ht.sum()

    grads = []
    for fn in (step, torch.compile(step, backend='aot_eager', fullgraph=True)):
        leaves = [packed.clone().requires_grad_(), h0.clone().requires_grad_()]
        fn(*leaves).backward()
        grads.append([t.grad for t in leaves])
    for name, a, b in zip(['packed', 'h0'], *grads):
        assert rel_err(b, a) < 1e-6, name


def test_fullgraph_decode_step_updates_pool_in_place():
    model = TinyKDA()
    pool = make_state(5, HV, K, V)
    slots = torch.tensor([3, 0, 4])
    x = torch.randn(3, 1, 8)
    expected_pool = pool.clone()
    with torch.no_grad():
        expected = model.decode(x, expected_pool, slots)
        step = torch.compile(model.decode, backend='aot_eager', fullgraph=True)
        got = step(x, pool, slots)
    assert rel_err(got, expected) < 1e-6
    assert rel_err(pool, expected_pool) < 1e-6
    assert not torch.equal(pool[3], make_state(5, HV, K, V)[3])


def test_fullgraph_decode_backward_raises_as_in_eager():
    """``fused_recurrent_kda`` has no backward: compiled, a loss through its output raises the
    eager call's error (docs/API.md), not PyTorch's "does not require grad", and the forward
    under grad mode still runs and gives the eager outputs."""
    x = make_inputs(1, 4, H, HV, K, V)
    x['v'].requires_grad_()

    def step(**x):
        return fused_recurrent_kda(**x)[0]

    o = torch.compile(step, backend='aot_eager', fullgraph=True)(**x)
    with torch.no_grad():
        assert rel_err(o, step(**x)) < 1e-6
    with pytest.raises(RuntimeError, match='fused_recurrent_kda has no backward pass'):
        o.sum().backward()


def test_dynamic_compiles_once_across_lengths_and_sequence_counts():
    """``dynamic=True``: three lengths (fixed length), then three varlen batches of different
    lengths and sequence counts, each one compile."""
    def prefill(q, k, v, g, beta, cu_seqlens=None):
        return chunk_kda(q, k, v, g, beta, cu_seqlens=cu_seqlens, output_final_state=True)

    for batches in ([(1, 19, None), (1, 40, None), (1, 97, None)],
                    [(1, 19, [4, 15]), (1, 40, [7, 0, 33]), (1, 97, [1, 64, 0, 30, 2])]):
        torch._dynamo.reset()
        backend = CountingBackend()
        step = torch.compile(prefill, backend=backend, fullgraph=True, dynamic=True)
        for B, T, lengths in batches:
            x = make_inputs(B, T, H, HV, K, V)
            cu = None if lengths is None else make_cu_seqlens(lengths)
            with torch.no_grad():
                o, ht = step(**x, cu_seqlens=cu)
                ref_o, ref_ht = prefill(**x, cu_seqlens=cu)
            assert rel_err(o, ref_o) < 1e-6 and rel_err(ht, ref_ht) < 1e-6
        assert backend.graphs == 1, batches


def op_inputs(B=1, T=37, lengths=(9, 0, 28)):
    x = make_inputs(B, T, H, HV, K, V)
    cu = make_cu_seqlens(list(lengths))
    return x, cu


@pytest.mark.parametrize('qk_l2norm', [False, True])
def test_opcheck_chunk_fwd(qk_l2norm):
    x, cu = op_inputs()
    h0 = make_state(3, HV, K, V)
    args = (x['q'], x['k'], x['v'], x['g'], x['beta'], torch.rand(HV), None, h0, cu, K ** -0.5, 32,
            chunk_api.max_varlen_chunks(37, 32, 3), True, False, qk_l2norm, 'softplus', 0.0, 'sigmoid', True)
    torch.library.opcheck(torch.ops.kda.chunk_fwd.default, args)


@pytest.mark.parametrize('qk_l2norm,disable_recompute', [(False, False), (True, True)])
def test_opcheck_chunk_fwd_train_and_bwd(qk_l2norm, disable_recompute):
    """The training forward with its registered autograd formula (so ``kda::chunk_bwd`` too)."""
    x = make_inputs(2, 20, H, HV, K, V)
    h0 = make_state(2, HV, K, V).requires_grad_()
    A_log = torch.rand(HV).requires_grad_()
    dt_bias = torch.randn(HV * K).requires_grad_()
    q, k, v, g = (x[n].requires_grad_() for n in 'qkvg')
    beta = x['beta'].requires_grad_()
    args = (q, k, v, g, beta, A_log, dt_bias, h0, None, K ** -0.5, 32, 0, True, False, qk_l2norm,
            'sigmoid', -3.0, disable_recompute)
    torch.library.opcheck(torch.ops.kda.chunk_fwd_train.default, args)
    o, final, saved = torch.ops.kda.chunk_fwd_train(*args)
    bwd_args = (torch.randn_like(o), torch.randn_like(final[0]), None if saved and qk_l2norm else q.detach(),
                None if saved and qk_l2norm else k.detach(), v.detach(), g.detach(), beta.detach(),
                A_log.detach(), dt_bias.detach(), h0.detach(), None, [s.detach() for s in saved],
                K ** -0.5, 32, 0, False, qk_l2norm, 'sigmoid', -3.0)
    torch.library.opcheck(torch.ops.kda.chunk_bwd.default, bwd_args)


@pytest.mark.parametrize('in_place', [False, True])
def test_opcheck_fused_recurrent(in_place):
    x, cu = op_inputs(T=6, lengths=(1, 2, 3))
    pool = make_state(5, HV, K, V)
    out = torch.empty(1, 6, HV, V)
    if in_place:
        initial, final, slots = None, pool, torch.tensor([4, 0, 2])
    else:
        initial, final, slots = make_state(3, HV, K, V), torch.empty(3, HV, K, V), None
    args = (x['q'], x['k'], x['v'], x['g'], x['beta'], None, None, initial, cu, slots, out, final,
            K ** -0.5, 0.0, True, 'none', 'none', False, in_place)
    torch.library.opcheck(torch.ops.kda.fused_recurrent.default, args)


def test_export_inference_forward():
    class Prefill(torch.nn.Module):
        def forward(self, q, k, v, g, beta, h0):
            return chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)

    x = make_inputs(2, 24, H, HV, K, V)
    h0 = make_state(2, HV, K, V)
    args = (*x.values(), h0)
    program = torch.export.export(Prefill(), args)
    assert 'kda.chunk_fwd' in str(program.graph)
    got, expected = program.module()(*args), Prefill()(*args)
    assert rel_err(got[0], expected[0]) < 1e-6 and rel_err(got[1], expected[1]) < 1e-6


LENGTHS_OF_EQUAL_TOTAL = ([40, 0, 24, 7, 1], [3, 3, 3, 3, 60], [72, 0, 0, 0, 0])


@requires_interpreter
@pytest.mark.parametrize('lengths', LENGTHS_OF_EQUAL_TOTAL, ids=lambda x: '-'.join(map(str, x)))
def test_use_graph_device_map_equals_host_map(lengths, monkeypatch):
    """``use_graph=True`` (the map built on the device, 72 / 32 + 5 - 1 = 7 entries, padding
    included) against the host-built map: outputs, final states and every gradient bit for bit,
    without ``cu_seqlens`` read on the host (``tolist`` refused during the call)."""
    x = make_inputs(1, 72, H, HV, K, V)
    cu = make_cu_seqlens(lengths)
    h0 = make_state(5, HV, K, V)

    def run(**graph):
        leaves = {n: t.clone().requires_grad_() for n, t in (*x.items(), ('h0', h0))}
        o, ht = chunk_kda(leaves['q'], leaves['k'], leaves['v'], leaves['g'], leaves['beta'],
                          initial_state=leaves['h0'], output_final_state=True, cu_seqlens=cu,
                          chunk_size=32, **graph)
        (o.sum() + (ht ** 2).sum()).backward()
        return [o, ht] + [leaves[n].grad for n in ('q', 'k', 'v', 'g', 'beta', 'h0')]

    host = run()
    with monkeypatch.context() as m:
        def refuse(self):
            raise AssertionError('cu_seqlens read on the host')
        m.setattr(torch.Tensor, 'tolist', refuse)
        m.setattr(torch.Tensor, 'item', refuse)
        device = run(use_graph=True, max_num_seqs=5)
    for a, b in zip(host, device):
        assert torch.equal(a, b)


@requires_interpreter
def test_use_graph_intermediate_states_have_the_fixed_chunk_count():
    x = make_inputs(1, 72, H, HV, K, V)
    cu = make_cu_seqlens([40, 0, 24, 7, 1])
    with torch.no_grad():
        _, _, h = chunk_kda(**x, cu_seqlens=cu, chunk_size=32, return_intermediate_states=True,
                            intermediate_states_dtype=torch.float32)
        _, _, hg = chunk_kda(**x, cu_seqlens=cu, chunk_size=32, return_intermediate_states=True,
                             intermediate_states_dtype=torch.float32, use_graph=True)
    assert h.shape[1] == 5 and hg.shape[1] == 72 // 32 + 1 + 5 - 1
    assert torch.equal(hg[:, :5], h)


def test_max_num_seqs_must_match_the_padded_cu_seqlens():
    x = make_inputs(1, 16, H, HV, K, V)
    with pytest.raises(ValueError, match='max_num_seqs \\+ 1 = 5 entries'):
        chunk_kda(**x, cu_seqlens=make_cu_seqlens([8, 8]), use_graph=True, max_num_seqs=4)
    with pytest.raises(ValueError, match='without use_graph=True'):
        chunk_kda(**x, cu_seqlens=make_cu_seqlens([8, 8]), max_num_seqs=2)


# CUDA: the Kimi configuration (H = HV = 32, K = V = 128, bf16, in-kernel gate and beta).

def kimi_inputs(T, lengths=None, requires_grad=False):
    torch.manual_seed(0)
    x = make_inputs(1, T, 32, 32, 128, 128, dtype=torch.bfloat16, device='cuda', normalize_k=False)
    if requires_grad:
        for t in x.values():
            t.requires_grad_()
    params = dict(A_log=torch.rand(32, device='cuda'), dt_bias=torch.randn(32 * 128, device='cuda'))
    cu = None if lengths is None else make_cu_seqlens(lengths, device='cuda')
    return x, params, cu


def kimi_call(x, params, cu, **options):
    return chunk_kda(**x, **params, use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True,
                     use_beta_sigmoid_in_kernel=True, cu_seqlens=cu, **options)


@requires_cuda
@pytest.mark.gpu
def test_cuda_compiled_kimi_training_step():
    x, params, _ = kimi_inputs(1024, requires_grad=True)

    def step(x, params):
        o, _ = kimi_call(x, params, None)
        o.float().pow(2).sum().backward()
        return o.detach(), [t.grad for t in x.values()]

    eager = step(x, params)
    for t in x.values():
        t.grad = None
    got = torch.compile(step, fullgraph=True)(x, params)
    assert torch.equal(got[0], eager[0])
    for a, b in zip(got[1], eager[1]):
        assert rel_err(a, b) < 1e-6


@requires_cuda
@pytest.mark.gpu
def test_cuda_compiled_kimi_decode_step():
    x, params, _ = kimi_inputs(1)
    x = {n: t.expand(8, *t.shape[1:]).contiguous() for n, t in x.items()}
    pool = make_state(16, 32, 128, 128, device='cuda')
    slots = torch.arange(8, device='cuda') * 2
    out = torch.empty(8, 1, 32, 128, dtype=torch.bfloat16, device='cuda')

    def step(pool):
        return fused_recurrent_kda(**x, **params, initial_state=pool, inplace_final_state=True,
                                   ssm_state_indices=slots, out=out, use_gate_in_kernel=True,
                                   use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True)[0].clone()

    eager_pool = pool.clone()
    expected = step(eager_pool)
    got = torch.compile(step, fullgraph=True)(pool)
    assert torch.equal(got, expected) and torch.equal(pool, eager_pool)


@requires_cuda
@pytest.mark.gpu
def test_cuda_graph_replays_varlen_prefill_with_new_cu_seqlens():
    """Captured once (max_num_seqs = 5, T = 4096), replayed with three cu_seqlens of the same total
    length: bit for bit the eager (host-map) results."""
    T = 4096
    x, params, cu = kimi_inputs(T, [T, 0, 0, 0, 0])
    h0 = make_state(5, 32, 128, 128, device='cuda')
    static_cu = cu.clone()
    with torch.no_grad():
        kimi_call(x, params, static_cu, initial_state=h0, output_final_state=True, use_graph=True,
                  max_num_seqs=5)                            # warm-up: compiles the kernels
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            o, ht = kimi_call(x, params, static_cu, initial_state=h0, output_final_state=True,
                              use_graph=True, max_num_seqs=5)
        for lengths in ([1000, 0, 3000, 95, 1], [64] * 4 + [T - 256], [T - 4, 1, 1, 1, 1]):
            static_cu.copy_(make_cu_seqlens(lengths, device='cuda'))
            graph.replay()
            expected_o, expected_ht = kimi_call(x, params, make_cu_seqlens(lengths, device='cuda'),
                                                initial_state=h0, output_final_state=True)
            assert torch.equal(o, expected_o) and torch.equal(ht, expected_ht), lengths

