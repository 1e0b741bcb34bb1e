"""Launch policy of the chunk kernels: each kernel's configuration at given head dims (``TUNING``
capped by the shape), the state sweeps' value slices and program order by how many programs the
device's SMs take, programmatic dependent launch, and the compile-time sizes the kernels share.

A state sweep runs one program per (sequence, value head, value slice): ``N * HV * ceil(V / BV)``
programs, each through every chunk of its sequence. Against ``sm_count`` SMs:

- fewer programs than SMs (``few_programs``): halved value slices, ``FEW_PROGRAMS``' settings;
- otherwise, 16-bit inputs, K <= 128: the fused forward sweep takes ``WIDE_SLICES``' one 128-wide
  slice a program;
- at most 1.5 waves of the carry (``transposed_sweeps``): the backward's carry and gradient sweep
  hold the state transposed and run side by side.
"""
from __future__ import annotations

import functools

import torch
import triton.language as tl

from kda.ops.chunk.layout import ChunkLayout
from kda.ops.chunk.tuning import FEW_PROGRAMS, TUNING, WIDE_SLICES
from kda.ops.gate import KernelGate
from kda.ops.utils import INTERPRET, cdiv, next_pow2

DOT_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
# Rows of a sub-block of the in-chunk matrices: the smallest tile tl.dot takes.
BC = 16


@functools.cache
def sm_count(device: torch.device) -> int:
    """Multiprocessors of a CUDA device (132 on the H200); 1 elsewhere (the interpreter)."""
    if device.type != 'cuda':
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def dependent_launch(device: torch.device) -> bool:
    """Whether ``device`` has programmatic dependent launch (CUDA, compute capability 9.0 and
    later; not the interpreter). Where it has, the cumsum always releases its dependents, and in
    the inference forward with l2norm in the kernel (``intra.pair_products_and_solve``) the pair
    products and the solve are launched with ``launch_pdl`` and may start as the kernel before
    them drains, the pair products forming their rows' norms meanwhile
    (``kernels/chunk_common.py``, ``wait_for_previous``). Elsewhere (training, inference without
    l2norm) the pair products have nothing to do before their wait, and in training early
    launches cost at one shape; the solve never has work before its wait and is launched early
    with the pair products (docs/tuning.md, "Programmatic dependent launch"). Not on ROCm, whose
    devices report a compute capability too (9.x on MI200 and MI300) but have no
    griddepcontrol."""
    return (device.type == 'cuda' and not INTERPRET and torch.version.hip is None
            and torch.cuda.get_device_capability(device)[0] >= 9)


def launch_config(stage: str, K: int, V: int) -> dict:
    """Keyword arguments for launching ``stage``'s kernel at head dims K, V (see ``TUNING``)."""
    cfg = {name: value for name, value in TUNING[stage].items() if value is not None}
    # next_pow2 is at least 16, the smallest operand tl.dot takes.
    if 'BK' in cfg:
        cfg['BK'] = min(cfg['BK'], next_pow2(K))
    if 'BV' in cfg:
        cfg['BV'] = min(cfg['BV'], next_pow2(V))
    if stage == 'intra_bwd':
        # Square tiles only. With BK < BV (K = 16 and V >= 32; or forced 16 / 32 and 32 / 64 at
        # K = V = 128) the compiled kernel reads past its shared memory on the H200 (triton 3.6,
        # bf16; compute-sanitizer: invalid __shared__ reads of 512 bytes), an illegal-address
        # fault; the interpreter gives the right gradients there. Not understood, avoided.
        cfg['BK'] = cfg['BV'] = min(cfg['BK'], cfg['BV'])
    return cfg


def sweep_programs(stage: str, K: int, V: int, sequence_heads: int) -> int:
    """Programs of a state sweep over ``sequence_heads`` (sequence, value head) pairs at TUNING's
    value slices."""
    return sequence_heads * cdiv(V, launch_config(stage, K, V)['BV'])


def few_programs(stage: str, K: int, V: int, sequence_heads: int, device) -> bool:
    """Whether a state sweep over ``sequence_heads`` (sequence, value head) pairs, at TUNING's
    value slices, has fewer programs than the device has SMs (FEW_PROGRAMS)."""
    return sweep_programs(stage, K, V, sequence_heads) < sm_count(device)


def state_launch_config(stage: str, K: int, V: int, sequence_heads: int, device,
                        dtype: torch.dtype, varlen: bool = False) -> dict:
    """``launch_config`` of a state sweep over ``sequence_heads`` (sequence, value head) pairs of
    ``dtype`` inputs, with FEW_PROGRAMS applied when they would leave SMs idle (else WIDE_SLICES
    where it applies), and the order of its programs (``SLICES_INNERMOST``, see ``sweep_grid``;
    ``varlen``: sequences of their own lengths)."""
    cfg = launch_config(stage, K, V)
    few = few_programs(stage, K, V, sequence_heads, device)
    if few:
        cfg['BV'] = max(16, cfg['BV'] // 2)
        cfg.update({n: x for n, x in FEW_PROGRAMS[stage].items() if x is not None})
        cfg['BV'] = min(cfg['BV'], next_pow2(V))
    elif stage in WIDE_SLICES and dtype != torch.float32 and K <= 128 and V > cfg['BV']:
        cfg.update({n: x for n, x in WIDE_SLICES[stage].items() if x is not None})
    cfg['SLICES_INNERMOST'] = stage != 'state_output' and (varlen or not few)
    # Shape rules last, so that no table entry above overrides them. The whole key dimension is
    # one block; at K = 256 half the value slice keeps the [256, BV] float32 state within the
    # registers.
    cfg['BK'] = next_pow2(K)
    if cfg['BK'] > 128:
        cfg['BV'] = min(cfg['BV'], 32)
        # Past two stages the [256, 64] key-side tiles' pipeline buffers outgrow shared memory:
        # the gradient sweep with few programs asked 256 KiB with 3 (bf16, triton 3.6;
        # test_launch_shared_memory).
        cfg['num_stages'] = min(cfg.get('num_stages', 2), 2)
    if dtype == torch.float32:
        # float32 tiles double the pipeline buffers (the H200 has 227 KiB of shared memory): the
        # gradient sweep asks 256 KiB at K = 128 with 3 stages (136 KiB with 2), and the sweeps
        # 254-287 KiB at K = 256 with 2 (triton 3.6; one stage fits). test_launch_shared_memory
        # pins both.
        cfg['num_stages'] = min(cfg.get('num_stages', 2), 2 if K <= 128 else 1)
    elif stage != 'state_output':
        # 16-bit inputs: compiled with one stage, the carry and the gradient sweep fault on the
        # H200 (illegal memory access; triton 3.6, bf16: the carry 16- and 32-wide with 4 warps
        # at (1, 32768, 32), the gradient sweep 32-wide with 8 warps there and with 4 at K = 256;
        # test_cuda_bf16_head_dim_256). Not understood; the fused forward sweep (one stage with
        # many programs, two with few) has not faulted at any tested shape (bf16, K <= 256). Two
        # stages fit at K = 256 in 16 bits (61 KiB).
        cfg['num_stages'] = max(cfg.get('num_stages', 2), 2)
    return cfg


def transposed_sweeps(N: int, HV: int, K: int, V: int, device, dtype: torch.dtype) -> bool:
    """Whether the backward's carry and gradient sweep hold the state transposed
    (``kernels/chunk_state.py``) and run side by side (``backward.chunk_kda_bwd``): where the
    carry's (sequence, value head, value slice) programs make at most 1.5 waves on the device's
    SMs (a looser bound than FEW_PROGRAMS'). With more programs both lose, the transposed
    gradient sweep most (docs/tuning.md, "Transposed sweeps"). The gradient sweep's slices are as
    wide as the carry's wherever this holds at the benchmark's shapes."""
    BV = state_launch_config('state_fwd', K, V, N * HV, device, dtype)['BV']
    return 2 * N * HV * cdiv(V, BV) <= 3 * sm_count(device)


def gate_launch_args(gate: KernelGate | None) -> dict:
    """The gate arguments of the kernels that read ``g`` (``kernels/gate.py``)."""
    if gate is None:
        return {'A_log': None, 'dt_bias': None, 'lower_bound': 0.0, 'GATE': 'none'}
    A_log, dt_bias = (None if t is None else t.detach().contiguous() for t in (gate.A_log, gate.dt_bias))
    return {'A_log': A_log, 'dt_bias': dt_bias, 'lower_bound': gate.lower_bound, 'GATE': gate.kind}


def sweep_grid(N: int, HV: int, V: int, cfg: dict) -> tuple[int, ...]:
    """The grid of a state sweep launched with ``cfg`` (``state_launch_config``), as
    ``sweep_program`` in ``kernels/chunk_common.py`` reads it: the value slices innermost on one
    axis (``SLICES_INNERMOST``: the backward's sweeps, carry and gradient sweep, but with few
    programs at fixed length) or on grid axis 1 (the fused forward sweep always). The same
    kernels, the same bits; only the order in which their programs are issued differs, and why it
    costs what it does is not established (docs/tuning.md, "Program order"). A varlen sweep lasts
    as long as its longest chain of chunks; where more programs than fit the GPU run one after
    another, a long sequence started last lengthens it, hence longest first (with the slices on
    axis 1, the first slice of every sequence starts before any second one)."""
    NV = cdiv(V, cfg['BV'])
    return (N * HV * NV,) if cfg['SLICES_INNERMOST'] else (N * HV, NV)


def head_dims(q, v, layout: ChunkLayout, cu_seqlens) -> dict:
    """The compile-time sizes most chunk kernels take (head counts and dims, chunk, dot dtype,
    varlen)."""
    return {'H': q.shape[2], 'HV': v.shape[2], 'K': q.shape[3], 'V': v.shape[3], 'BT': layout.BT,
                'DOT_DTYPE': DOT_DTYPES[q.dtype], 'IS_VARLEN': cu_seqlens is not None}
