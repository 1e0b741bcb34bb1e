"""Shared helpers for the kda test-suite.

Conventions (project rules):

* The oracle is ``kda.naive_recurrent_kda`` run in float64 (``reference64`` below).
* Results are compared by the relative error norm ``||x - ref|| / ||ref||`` (``rel_err``).
* Inputs are drawn fresh for every test: the autouse ``_seed`` fixture seeds torch's global RNG
  from the test's node id, so every test sees different numbers, yet reruns are reproducible.
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
                     help="run only every N-th collected test, starting at I (0 <= I < N); "
                          "benchmarks/gpu_session.sh runs N shards in parallel to spread kernel compiles")


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
