"""Batch invariance: what ``chunk_kda`` and ``fused_recurrent_kda`` compute for one sequence does not
depend on the rest of the batch.

A sequence's outputs, final state and gradients (q, k, v, g, beta, its initial state) must be
bit for bit the same whether it runs alone (fixed length or as the only sequence of
``cu_seqlens``), packed with others in a varlen batch at any position, or as one row of a
fixed-length batch; and the same on every run (gate-parameter gradients included, which sum over
the whole batch). The launchers choose block sizes, program order and which kernels run
side by side from the batch's size against the GPU's SMs (``kda/ops/chunk/launch.py``:
``state_launch_config``, ``transposed_sweeps``, ``sweep_grid``); the "many SMs" arrangement
runs the sequence alone under the choices of a GPU it leaves mostly idle (halved value slices,
FEW_PROGRAMS, transposed backward sweeps), the others under those of a one-SM GPU. Float32
throughout. On the CPU, beta given as logits to ``chunk_kda`` is not batch-invariant
(``BETA_LOGITS_ON_CPU``): tested on CUDA.
"""
from __future__ import annotations

import pytest
import torch

import kda.ops.chunk.launch as launch_mod
import kda.ops.chunk.schedule as schedule_mod
from kda import chunk_kda, fused_recurrent_kda
from kda.ops.utils import INTERPRET
from conftest import HAS_CUDA, make_cu_seqlens, make_inputs, make_state

KDEV = 'cuda' if HAS_CUDA else 'cpu'
requires_kernels = pytest.mark.skipif(
    not (HAS_CUDA or INTERPRET), reason="needs TRITON_INTERPRET=1 (CPU) or a CUDA GPU to run the kernels")

SEQ_LEN = 37            # the sequence under test: odd, not a whole number of chunks
NAMES = ('q', 'k', 'v', 'g', 'beta')

# (H, HV, options, initial state, chunk size): GVA; l2norm with the Kimi gate (lower bound, A_log
# and dt_bias); the softplus gate with a group of three value heads (dq and dk summed over it, in
# an order that matters); beta as logits with negative eigenvalues (see BETA_LOGITS_ON_CPU).
CONFIGS = {
    'gva-h0-bt32': (1, 2, {}, True, 32),
    'l2norm-kimi-gate-bt64': (1, 2, dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                         lower_bound=-5.0, safe_gate=True), False, 64),
    'softplus-gate-group3-h0-bt32': (1, 3, dict(use_gate_in_kernel=True), True, 32),
    'beta-logits-bt32': (1, 2, dict(use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True), True, 32),
}
# chunk_kda activates beta logits with torch.sigmoid ahead of its kernels (kda/ops/gate.py:
# activate_beta in training, kernel_beta in inference). On the CPU that op rounds the elements of
# its vectorized body and of its scalar tail differently, so an element's bits depend on where it
# falls in the tensor, which the batch decides (a 90-element sigmoid against the same values
# inside a 1000-element one: 3 entries differ by one rounding; whether a batch shows it depends on
# the values). CUDA's elementwise kernels apply one function to every element: tested there.
# fused_recurrent_kda activates beta in its kernel: tested everywhere.
BETA_LOGITS_ON_CPU = pytest.mark.skipif(
    not HAS_CUDA, reason="CPU torch.sigmoid rounds its vector body and scalar tail differently, "
                         "which chunk_kda's beta logits go through")
K, V = 16, 48          # V = 48: two 32-wide value slices where the launcher halves them



def _set_sm_count(monkeypatch, count: int) -> None:
    """The launch policy and the time-segment schedule both read the GPU's SM count."""
    for mod in (launch_mod, schedule_mod):
        monkeypatch.setattr(mod, 'sm_count', lambda device: count)

def _sequence(T: int, H: int, HV: int, opts: dict) -> dict:
    """One sequence's inputs ``[1, T, ...]`` (raw q, k and gate logits where the options take them)."""
    x = make_inputs(1, T, H, HV, K, V, normalize_k=not opts.get('use_qk_l2norm_in_kernel', False))
    if opts.get('use_gate_in_kernel'):
        x['g'] = torch.randn_like(x['g'])
    if opts.get('use_beta_sigmoid_in_kernel'):
        x['beta'] = torch.randn_like(x['beta'])
    return x


def _gate_params(HV: int, opts: dict) -> dict:
    if not opts.get('use_gate_in_kernel'):
        return {}
    return dict(A_log=torch.randn(HV), dt_bias=torch.randn(HV * K))


class Batch:
    """Sequences placed in a varlen batch (``cu_seqlens``) or as the rows of a fixed-length one,
    with their initial states and upstream gradients."""

    def __init__(self, seqs: list[dict], states, dos: list, dhts: list, fixed: bool):
        self.fixed = fixed
        dim = 0 if fixed else 1
        self.inputs = {n: torch.cat([s[n] for s in seqs], dim) for n in NAMES}
        self.h0 = None if states[0] is None else torch.cat(states, 0)
        self.do = torch.cat(dos, dim)
        self.dht = torch.cat(dhts, 0)
        lengths = [s['q'].shape[1] for s in seqs]
        self.cu = None if fixed else make_cu_seqlens(lengths)
        self.bounds = [(0, lengths[0]) if fixed else (int(self.cu[i]), int(self.cu[i + 1]))
                       for i in range(len(seqs))]

    def tokens(self, x: torch.Tensor, n: int) -> torch.Tensor:
        """Sequence ``n``'s rows of a ``[B, T, ...]`` tensor."""
        bos, eos = self.bounds[n]
        return x[n, bos:eos] if self.fixed else x[0, bos:eos]


def _run_chunk(batch: Batch, n: int, params: dict, opts: dict, chunk_size: int) -> dict:
    """Inference forward, then training forward and backward, of ``batch``; sequence ``n``'s
    results (and the gate parameters' gradients, which sum over the batch)."""
    cu = None if batch.cu is None else batch.cu.to(KDEV)
    h0 = None if batch.h0 is None else batch.h0.to(KDEV)
    common = dict(cu_seqlens=cu, chunk_size=chunk_size, output_final_state=True,
                  **{p: t.to(KDEV) for p, t in params.items()}, **opts)
    with torch.no_grad():
        o_inf, ht_inf = chunk_kda(**{m: t.to(KDEV) for m, t in batch.inputs.items()},
                                  initial_state=h0, **common)
    leaves = {m: t.to(KDEV).requires_grad_() for m, t in batch.inputs.items()}
    if h0 is not None:
        leaves['initial_state'] = h0.clone().requires_grad_()
    plist = {p: t.to(KDEV).requires_grad_() for p, t in params.items()}
    common.update(plist)
    o, ht = chunk_kda(**leaves, **common)
    loss = (o * batch.do.to(KDEV)).sum() + (ht * batch.dht.to(KDEV)).sum()
    grads = torch.autograd.grad(loss, [*leaves.values(), *plist.values()])
    grads = dict(zip([*leaves, *plist], (g.cpu() for g in grads)))
    out = {'o inference': batch.tokens(o_inf.cpu(), n), 'ht inference': ht_inf[n].cpu(),
           'o': batch.tokens(o.detach().cpu(), n), 'ht': ht[n].detach().cpu()}
    out.update({'d' + m: batch.tokens(grads[m], n) for m in NAMES})
    if h0 is not None:
        out['dh0'] = grads['initial_state'][n]
    out.update({'d' + p: grads[p] for p in params})
    return out


def _assert_same_bits(got: dict, want: dict, what: str, skip=()) -> None:
    for name, ref in want.items():
        if name in skip:
            continue
        x = got[name]
        assert x.isfinite().all(), f"{what}: {name} not finite"
        assert torch.equal(x, ref), \
            f"{what}: {name} differs in {int((x != ref).sum())} of {ref.numel()} entries " \
            f"(max {(x - ref).abs().max().item():.3e})"


@requires_kernels
@pytest.mark.parametrize('config', [pytest.param(c, marks=BETA_LOGITS_ON_CPU) if 'beta-logits' in c else c
                                    for c in CONFIGS])
def test_chunk_batch_invariance(monkeypatch, config):
    """``chunk_kda``, inference forward and training forward + backward: the sequence's results
    alone (fixed length) equal its results alone through cu_seqlens, in the middle of a varlen
    batch, last after an empty sequence, as a row of a fixed-length batch, alone under a many-SM
    GPU's launch choices, and on a second run, where the gate parameters' gradients (sums over the
    batch) must agree too."""
    H, HV, opts, with_h0, chunk_size = CONFIGS[config]
    # Every batch under the choices of a one-SM GPU (many programs for it), as in the interpreter.
    _set_sm_count(monkeypatch, 1)
    params = _gate_params(HV, opts)
    x = _sequence(SEQ_LEN, H, HV, opts)
    others = [_sequence(T, H, HV, opts) for T in (20, 0, 33, SEQ_LEN)]
    h0s = [make_state(1, HV, K, V) if with_h0 else None for _ in range(5)]
    dos = [torch.randn(1, s['q'].shape[1], HV, V) for s in [x, *others]]
    dhts = [torch.randn(1, HV, K, V) for _ in range(5)]

    def arrange(order: list[int], fixed: bool = False) -> tuple[Batch, int]:
        seqs = [x, *others]
        return Batch([seqs[i] for i in order], [h0s[i] for i in order], [dos[i] for i in order],
                     [dhts[i] for i in order], fixed), order.index(0)

    alone = _run_chunk(arrange([0], fixed=True)[0], 0, params, opts, chunk_size)
    gate_grads = tuple('d' + p for p in params)          # sums over the batch: not per sequence
    cases = {'second run': (arrange([0], fixed=True), ()),
             'alone, varlen': (arrange([0]), gate_grads),
             'varlen, middle': (arrange([1, 0, 3]), gate_grads),
             'varlen, last (after an empty one)': (arrange([3, 2, 0]), gate_grads),
             'fixed-length batch, row 1': (arrange([4, 0], fixed=True), gate_grads)}
    for what, ((batch, n), skip) in cases.items():
        _assert_same_bits(_run_chunk(batch, n, params, opts, chunk_size), alone, what, skip)
    # Alone on a GPU it leaves idle: FEW_PROGRAMS, halved value slices, transposed backward sweeps.
    _set_sm_count(monkeypatch, 10 ** 6)
    (batch, n), _ = cases['alone, varlen']
    _assert_same_bits(_run_chunk(batch, n, params, opts, chunk_size), alone, 'alone, many SMs', gate_grads)


@pytest.mark.slow
@requires_kernels
@pytest.mark.parametrize('config', ['gva-h0-bt32', 'l2norm-kimi-gate-bt64', 'beta-logits-bt32'])
def test_recurrent_batch_invariance(config):
    """``fused_recurrent_kda``: the sequence alone, in a varlen batch at two positions, as a row
    of a fixed-length batch and on a second run gives the same output and final state bits."""
    H, HV, opts, with_h0, _ = CONFIGS[config]
    params = {p: t.to(KDEV) for p, t in _gate_params(HV, opts).items()}
    x = _sequence(SEQ_LEN, H, HV, opts)
    others = [_sequence(T, H, HV, opts) for T in (20, 0, SEQ_LEN)]
    h0s = [make_state(1, HV, K, V) if with_h0 else None for _ in range(4)]

    def run(order: list[int], fixed: bool = False) -> dict:
        seqs = [x, *others]
        dim = 0 if fixed else 1
        inputs = {m: torch.cat([seqs[i][m] for i in order], dim).to(KDEV) for m in NAMES}
        h0 = None if h0s[0] is None else torch.cat([h0s[i] for i in order], 0).to(KDEV)
        lengths = [seqs[i]['q'].shape[1] for i in order]
        cu = None if fixed else make_cu_seqlens(lengths)
        o, ht = fused_recurrent_kda(**inputs, **params, initial_state=h0, output_final_state=True,
                                    cu_seqlens=None if cu is None else cu.to(KDEV), **opts)
        n = order.index(0)
        o = o[n] if fixed else o[0, int(cu[n]):int(cu[n + 1])]
        return {'o': o.cpu(), 'ht': ht[n].cpu()}

    alone = run([0], fixed=True)
    for what, order, fixed in (('alone, varlen', [0], False), ('varlen, middle', [1, 0, 2], False),
                               ('varlen, last', [2, 1, 0], False), ('fixed-length, row 1', [3, 0], True),
                               ('second run', [0], True)):
        _assert_same_bits(run(order, fixed), alone, what)
