"""A chunk kernel compiled for the H100/H200 (sm_90) without a GPU, with the argument types its
launch in ``kda/ops/chunk/`` gives it.

Triton compiles one build per signature (pointer dtypes, which optional arguments are None, the
constexpr values), so a tool that reads a kernel's shared memory, registers or machine code must
reproduce the launcher's choices. Used by ``tests/chunk/sm90_builds.py`` (the offline sm_90
tests), ``tools/resources.py`` and ``tools/uniform_regs.py``. Needs a Triton that is not
interpreting (``TRITON_INTERPRET`` unset).
"""
from __future__ import annotations

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

# Buffers the launchers allocate in float32 whatever the input dtype, beta (``chunk_kda`` hands
# the kernels a float32 copy), the float32 states, and the gate's parameters; every other pointer
# argument has the input dtype.
FLOAT32 = frozenset({'g', 'beta', 'gc', 'Akk', 'dAqk', 'dAkk', 'dq', 'dk', 'dg', 'dc', 'dbeta',
                     'h0', 'ht', 'dht', 'dh0', 'A_log', 'dt_bias', 'da', 'dbias', 'dA_log', 'ddt_bias'})
# Arguments a launch may pass as None (varlen tensors, states, the gate's parameters).
OPTIONAL = frozenset({'cu_seqlens', 'chunk_rows', 'chunk_offsets', 'seq_order', 'h0', 'ht',
                      'dht', 'dh0', 'A_log', 'dt_bias', 'da', 'dbias', 'state_indices', 'has_initial'})
# Integer tensors: the chunk map the launcher builds, and cu_seqlens in the caller's dtype (int64 in
# the README's example and the benchmark).
INTEGERS = {'cu_seqlens': '*i64', 'chunk_rows': '*i32', 'chunk_offsets': '*i32', 'seq_order': '*i32'}
SCALARS = {'T': 'i32', 'NT': 'i32', 'num_slots': 'i32', 'C': 'i32',
           'stride_sk': 'i32', 'stride_sv': 'i32', 'scale': 'fp32',
           'lower_bound': 'fp32'}
POINTERS = {torch.float32: '*fp32', torch.bfloat16: '*bf16', torch.float16: '*fp16'}
# Shared memory per block on the H200 (sm_90, opt-in maximum: 227 KiB), as Triton reports it there.
H200_SHARED_MEMORY = 232448


def pointer_type(fn, name: str, dtype: torch.dtype) -> str:
    """The launcher's dtype for pointer argument ``name`` of ``fn`` at input dtype ``dtype``."""
    if name in INTEGERS:
        return INTEGERS[name]
    # The fused forward sweep stores the states handed to the user (``h``) in float32; the carry
    # stores its states for the backward in the input dtype.
    float32 = name in FLOAT32 or (fn.fn.__name__ == 'chunk_state_output_fwd_kernel' and name == 'h')
    return POINTERS[torch.float32] if float32 else POINTERS[dtype]


def launch_signature(fn, values: dict, dtype: torch.dtype, absent=OPTIONAL, pointers=None,
                     constants=None, specialize: bool = False):
    """``(signature, constexprs, attrs)`` of ``fn`` for ``triton.compile``.

    ``values``: every constexpr parameter's value (other keys are not read). ``absent``: arguments
    passed as None. ``pointers``: pointer dtypes that differ from ``pointer_type``'s (a raw bf16
    gate). ``constants``: runtime arguments the launch compiles as constants (an integer equal to
    1). ``specialize``: the divisibility the launch gives 16-byte aligned pointers and integers
    divisible by 16; the compiled code differs without it (a build that knows the alignment
    pipelines its loads through shared memory: the gradient sweep at K = 256 asked 256 KiB on the
    H200 where the build without it asks 76 KiB)."""
    pointers, constants = pointers or {}, constants or {}
    signature, constexprs, attrs = {}, {}, {}
    for i, p in enumerate(fn.params):
        if p.is_constexpr or p.name in constants:
            signature[p.name] = 'constexpr'
            if not p.is_constexpr:
                constexprs[p.name] = constants[p.name]
            else:
                # A constexpr with a default (a build the launchers rarely take) keeps it unless given.
                constexprs[p.name] = values.get(p.name, p.default) if p.has_default else values[p.name]
        elif p.name in absent:
            signature[p.name], constexprs[p.name] = 'constexpr', None
        else:
            signature[p.name] = SCALARS.get(p.name) or pointers.get(p.name) or pointer_type(fn, p.name, dtype)
            if specialize and signature[p.name] != 'fp32':
                attrs[(i,)] = [['tt.divisibility', 16]]
    return signature, constexprs, attrs


def compile_sm90(fn, values: dict, dtype: torch.dtype, options: dict, **signature_options):
    """``fn`` compiled for sm_90 (``triton.compile``'s result: ``.asm``, ``.metadata``);
    ``options``: the launch's ``num_warps``, ``num_stages``, ``maxnreg``; ``signature_options``:
    ``launch_signature``'s keyword arguments."""
    signature, constexprs, attrs = launch_signature(fn, values, dtype, **signature_options)
    src = ASTSource(fn=fn, signature=signature, attrs=attrs,
                    constexprs={(fn.arg_names.index(n),): x for n, x in constexprs.items()})
    return triton.compile(src, target=GPUTarget('cuda', 90, 32), options=options)
