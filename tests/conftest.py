"""Shared helpers for the kda test-suite.

Conventions (project rules):

* The oracle is ``kda.naive_recurrent_kda`` run in float64 (``reference64`` below).
* Results are compared by the relative error norm ``||x - ref|| / ||ref||`` (``rel_err``).
* Inputs are drawn fresh for every test: the autouse ``_seed`` fixture seeds torch's global RNG
  from the test's node id, so every test sees different numbers, yet reruns are reproducible.
* ``bounds_checked_memory`` (a fixture a test module applies with ``pytestmark``) checks, in the
  interpreter, that every kernel load and store stays inside the launch's tensors.
* ``INTERPRET`` says whether the Triton kernels run on CPU tensors (``TRITON_INTERPRET=1``);
  ``requires_interpreter`` / ``requires_cuda`` are skip markers for tests that need them.

Helpers here are meant for every test file (recurrent and chunk tests alike); keep them general.
"""
from __future__ import annotations

import zlib

import pytest
import torch

from kda.ops.utils import INTERPRET
from kda.reference import naive_recurrent_kda

HAS_CUDA = torch.cuda.is_available()

requires_interpreter = pytest.mark.skipif(
    not INTERPRET, reason="needs TRITON_INTERPRET=1 to run the Triton kernels on CPU")
# CUDA tests run the compiled kernels (real sizes, CUDA graphs): not under the interpreter.
requires_cuda = pytest.mark.skipif(not HAS_CUDA or INTERPRET,
                                   reason="needs a CUDA GPU and TRITON_INTERPRET unset")


@pytest.fixture(autouse=True)
def _seed(request):
    """Seed torch's RNG per test (from the test id): fresh inputs per test, reproducible runs."""
    seed = zlib.crc32(request.node.nodeid.encode())
    torch.manual_seed(seed)
    return seed


@pytest.fixture
def bounds_checked_memory(monkeypatch):
    """Interpreter only: every unmasked load and store of a kernel must touch bytes inside
    one of the launch's tensor arguments (a read past the end of a buffer is undefined behaviour on the
    GPU: usually garbage, possibly a fault). Hooks the interpreter's masked load/store (Triton
    3.x internals); skips the test where they are not available."""
    if HAS_CUDA or not INTERPRET:
        yield None
        return
    try:
        from triton.runtime import interpreter as it
        builder, executor = it.InterpreterBuilder, it.GridExecutor
        builder.create_masked_load, builder.create_masked_store, executor.__call__
    except (ImportError, AttributeError):
        pytest.skip("this Triton's interpreter has no load/store hooks to check bounds")
    import numpy as np
    ranges = []
    bad = []
    real_call, real_load, real_store = executor.__call__, builder.create_masked_load, builder.create_masked_store

    def call(self, *args, **kwargs):
        saved = list(ranges)
        for a in list(args) + list(kwargs.values()):
            if isinstance(a, torch.Tensor) and a.numel() > 0:
                # the tensor's own extent (not its storage's: a view's neighbours are off limits)
                span = 1 + sum((n - 1) * st for n, st in zip(a.shape, a.stride()))
                ranges.append((a.data_ptr(), a.data_ptr() + span * a.element_size()))
        try:
            return real_call(self, *args, **kwargs)
        finally:
            ranges[:] = saved

    def check(ptrs, mask, what):
        addr = np.broadcast_to(ptrs.data, np.broadcast_shapes(ptrs.data.shape, mask.data.shape))
        addr = addr[np.broadcast_to(mask.data, addr.shape)].astype(np.uint64)
        size = np.dtype(it._get_np_dtype(ptrs.get_element_ty())).itemsize
        ok = np.zeros(addr.shape, dtype=bool)
        for lo, hi in ranges:
            ok |= (addr >= lo) & (addr + size <= hi)
        if not ok.all():
            bad.append(f"{what}: {int((~ok).sum())} of {addr.size} addresses outside every argument")

    def load(self, ptrs, mask, other, *a, **kw):
        check(ptrs, mask, 'load')
        return real_load(self, ptrs, mask, other, *a, **kw)

    def store(self, ptrs, value, mask, *a, **kw):
        check(ptrs, mask, 'store')
        return real_store(self, ptrs, value, mask, *a, **kw)

    monkeypatch.setattr(executor, '__call__', call)
    monkeypatch.setattr(builder, 'create_masked_load', load)
    monkeypatch.setattr(builder, 'create_masked_store', store)
    yield bad
    assert not bad, f"out-of-bounds memory accesses: {bad[:5]}"


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """``||x - ref|| / ||ref||`` computed in float64 (the absolute norm when ``ref`` is zero).

    NaNs or infs in ``x`` give ``nan``/``inf``, which fails every ``<`` tolerance check.
    """
    assert x.shape == ref.shape, f"shape mismatch: {tuple(x.shape)} vs reference {tuple(ref.shape)}"
    x64 = x.detach().to(device=ref.device, dtype=torch.float64)
    r64 = ref.detach().to(torch.float64)
    den = r64.norm().item()
    num = (x64 - r64).norm().item()
    return num / den if den > 0 else num


def make_inputs(B: int, T: int, H: int, HV: int, K: int, V: int, dtype=torch.float32,
                device='cpu', strong_decay: bool = False, normalize_k: bool = True,
                gate_dtype=None) -> dict[str, torch.Tensor]:
    """Random ``q, k, v, g, beta`` with the shapes of docs/API.md, as a dict of keyword arguments.

    * ``k`` has unit L2 norm per head (``normalize_k=True``) so the delta rule is stable; with
      ``normalize_k=False`` q and k are raw Gaussians times 2 (for ``use_qk_l2norm_in_kernel``).
    * ``g`` is a log-decay in ``[-1, -0.01]`` per step; ``strong_decay=True`` adds the extreme
      values a kernel must survive: one value head decays by ``-20`` on every step and channel,
      some tokens by ``-25`` on all channels, and a few channels by ``-1e4`` on some tokens.
    * ``beta`` is in ``(0, 1)``.

    Values are drawn on the CPU (so a given seed means the same numbers on any device), then
    cast to ``dtype`` (``gate_dtype`` for g and beta, default ``dtype``) and moved to ``device``.
    """
    q = torch.randn(B, T, H, K, dtype=torch.float64)
    k = torch.randn(B, T, H, K, dtype=torch.float64)
    if normalize_k:
        k = k / k.norm(dim=-1, keepdim=True)
    else:
        q, k = 2 * q, 2 * k
    v = torch.randn(B, T, HV, V, dtype=torch.float64)
    g = -(0.01 + 0.99 * torch.rand(B, T, HV, K, dtype=torch.float64))
    if strong_decay:
        g[:, :, 0] = -20.0                               # every step of head 0: -20
        if T > 1:
            g[:, 1::3, :, :] = -25.0                     # some tokens: -25 on every channel
        ch = torch.randperm(K)[:max(1, K // 4)]
        g[:, ::2, :, ch] = -1e4                          # some channels: -1e4
    beta = torch.rand(B, T, HV, dtype=torch.float64)
    gate_dtype = dtype if gate_dtype is None else gate_dtype
    out = dict(q=q.to(dtype), k=k.to(dtype), v=v.to(dtype), g=g.to(gate_dtype), beta=beta.to(gate_dtype))
    return {name: x.to(device) for name, x in out.items()}


def make_state(N: int, HV: int, K: int, V: int, state_v_first: bool = False, device='cpu',
               dtype=torch.float32) -> torch.Tensor:
    """A random float32 state ``[N, HV, K, V]`` (``[N, HV, V, K]`` with ``state_v_first``)."""
    shape = (N, HV, V, K) if state_v_first else (N, HV, K, V)
    return (0.5 * torch.randn(*shape, dtype=torch.float64)).to(dtype).to(device)


def make_cu_seqlens(lengths, device='cpu', dtype=torch.int64) -> torch.Tensor:
    """``cu_seqlens`` ``[N + 1]`` (int64 by default) for the given sequence lengths."""
    c = [0]
    for n in lengths:
        c.append(c[-1] + int(n))
    return torch.tensor(c, dtype=dtype, device=device)


def to64(x):
    """float64 copy of a tensor (None passes through)."""
    return None if x is None else x.detach().to(torch.float64)


def reference64(q, k, v, g, beta, **kwargs):
    """The oracle: ``naive_recurrent_kda`` on float64 copies of the inputs (and of
    ``initial_state``); keyword options (scale, cu_seqlens, state_v_first, ...) pass through.
    Always returns the final state as well, in float64."""
    kwargs = dict(kwargs)
    kwargs['initial_state'] = to64(kwargs.get('initial_state'))
    kwargs['output_final_state'] = True
    return naive_recurrent_kda(to64(q), to64(k), to64(v), to64(g), to64(beta), **kwargs)


def pytest_addoption(parser):
    parser.addoption("--shard", default=None, metavar="I/N",
                     help="run only every N-th collected test, starting at I (0 <= I < N): N shards "
                          "run in parallel spread the kernels' compiles over a GPU host's cores")


def pytest_collection_modifyitems(config, items):
    spec = config.getoption("--shard")
    if spec is None:
        return
    try:
        i, n = (int(x) for x in spec.split("/"))
    except ValueError:
        raise pytest.UsageError(f"--shard expects I/N with integers, got {spec!r}") from None
    if not 0 <= i < n:
        raise pytest.UsageError(f"--shard expects 0 <= I < N, got {spec!r}")
    keep = [it for j, it in enumerate(items) if j % n == i]
    config.hook.pytest_deselected(items=[it for j, it in enumerate(items) if j % n != i])
    items[:] = keep
