"""Offline check of the state sweeps' sm_90 machine code for uniform registers read before any
write (in program order), without a GPU.

    python benchmarks/uniform_regs.py

Why: the carry compiled with one pipeline stage (bf16, 16-wide, 4 warps) faulted on the H200
with "Out-of-range shared or local address" (compute-sanitizer) at a wgmma whose shared-memory
descriptor ptxas builds from two uniform registers the kernel never writes first (triton 3.6,
whose bundled ptxas is CUDA 12.8; BENCHMARKS.md note 51). Among the builds checked there, that
one alone reads a uniform register before writing it; the launch settings in use do not. Run this
with the GPU's Triton (3.6) after changing a state sweep or its launch settings. The launch's
specializations are modelled (16-byte aligned pointers, sizes divisible by 16, unit value
stride): without them the compiled code differs.
"""
import os
import re
import subprocess
import tempfile

import torch
import triton

from kda.kernels import chunk_state, chunk_state_bwd, chunk_state_output
from kda.ops.chunk.launch import DOT_DTYPES
from kda.ops.offline import compile_sm90

KERNELS = {'state_fwd': chunk_state.chunk_state_fwd_kernel,
           'state_bwd': chunk_state_bwd.chunk_state_bwd_kernel,
           'state_output': chunk_state_output.chunk_state_output_fwd_kernel}
DTYPES = {'bf16': torch.bfloat16, 'fp16': torch.float16, 'fp32': torch.float32}
VARLEN = {'cu_seqlens', 'chunk_offsets', 'seq_order'}
STATE_IO = {'h0', 'ht', 'dht', 'dh0'}
# (kernel, dtype, K = V, BV, warps, stages, transposed): the launch settings in use (kda.ops.chunk;
# the carry and the gradient sweep transposed with few programs, the fused forward sweep always)
# and the build that faulted. The carry and the gradient sweep are compiled in both program
# mappings (value slices innermost or on grid axis 1, ``sweep_grid``), which depend on the
# program count; the fused forward sweep has only the second.
CASES = [('state_output', 'bf16', 128, 128, 8, 2, True), ('state_output', 'bf16', 256, 32, 4, 1, True),
         ('state_output', 'fp16', 128, 128, 8, 2, True), ('state_output', 'fp32', 128, 64, 4, 1, True),
         ('state_output', 'bf16', 128, 32, 4, 2, True), ('state_output', 'bf16', 256, 32, 4, 2, True),
         ('state_fwd', 'bf16', 128, 64, 4, 2, False), ('state_fwd', 'bf16', 128, 64, 4, 2, True),
         ('state_fwd', 'bf16', 128, 32, 4, 2, True), ('state_fwd', 'fp32', 256, 32, 4, 1, False),
         ('state_bwd', 'bf16', 128, 64, 4, 2, False), ('state_bwd', 'bf16', 128, 64, 4, 2, True),
         ('state_bwd', 'bf16', 128, 32, 4, 3, True), ('state_bwd', 'bf16', 256, 32, 4, 2, True),
         ('state_fwd', 'bf16', 128, 16, 4, 1, False)]
# The many-program settings in use again with varlen (the sequences' bounds loaded).
VARLEN_CASES = [('state_output', 'bf16', 128, 128, 8, 2, True), ('state_fwd', 'bf16', 128, 64, 4, 2, False),
                ('state_bwd', 'bf16', 128, 64, 4, 2, False)]


def sass(name, dtype, K, BV, warps, stages, transposed, flags, varlen=False, innermost=False):
    """Disassembly of one build; ``flags``: initial / final state and stored states on;
    ``innermost``: the value slices innermost on one grid axis."""
    fn = KERNELS[name]
    values = dict(H=32, HV=32, K=K, V=K, BT=64, BK=K, BV=BV, DOT_DTYPE=DOT_DTYPES[DTYPES[dtype]],
                  IS_VARLEN=varlen, SLICES_INNERMOST=innermost, USE_INITIAL_STATE=flags,
                  STORE_FINAL_STATE=flags, STORE_STATES=flags, USE_FINAL_STATE_GRADIENT=flags,
                  STORE_INITIAL_STATE_GRADIENT=flags, TRANSPOSED=transposed)
    # The fused forward sweep's h (states handed to the user) is optional; the carry's is not.
    absent = set() if varlen else set(VARLEN)
    if not flags:
        absent |= STATE_IO | ({'h'} if name == 'state_output' else set())
    # stride_sv = 1: the launch compiles an integer argument equal to 1 as a constant.
    kernel = compile_sm90(fn, values, DTYPES[dtype], dict(num_warps=warps, num_stages=stages),
                          absent=absent, constants=dict(stride_sv=1), specialize=True)
    nvdisasm = os.path.join(os.path.dirname(triton.__file__), 'backends/nvidia/bin/nvdisasm')
    with tempfile.NamedTemporaryFile(suffix='.cubin') as f:
        f.write(kernel.asm['cubin'])
        f.flush()
        return subprocess.run([nvdisasm, '-c', f.name], capture_output=True, text=True, check=True).stdout


def undefined_reads(code):
    """``(address, opcode, register)`` of each uniform register read before any instruction
    writes it, in program order. A wgmma reads its shared-memory descriptors from the four
    uniform registers from the named one on (A's pair, B's pair; only B's when A is in registers)."""
    written, found = set(), []
    for line in code.splitlines():
        m = re.match(r'\s*/\*([0-9a-f]+)\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)\s+(.*?);', line)
        if not m:
            continue
        addr, op, args = m.groups()
        regs = re.findall(r'\bUR\d+\b', args)
        reads = set()
        for d in re.findall(r'gdesc\[(UR\d+)\]', args):
            n = int(d[2:])
            a_in_registers = re.search(r'R\d+,\s*R\d+,\s*gdesc', args) is not None
            reads |= {f'UR{n + i}' for i in ((2, 3) if a_in_registers else range(4))}
            regs = [r for r in regs if r != d]
        dests = set()
        writes = op[0] == 'U' or op.startswith(('S2UR', 'R2UR'))
        if writes and regs and not op.startswith(('UISETP', 'UPLOP', 'UBRA')):
            dest, regs = regs[0], regs[1:]
            dests = {dest, f'UR{int(dest[2:]) + 1}'} if ('.64' in op or 'WIDE' in op) else {dest}
        found += [(addr, op, r) for r in sorted(set(regs) | reads) if r not in written]
        written |= dests
    return found


def main():
    print(f'triton {triton.__version__}')
    for varlen, cases in ((False, CASES), (True, VARLEN_CASES)):
        for case in cases:
            mappings = (False,) if case[0] == 'state_output' else (True,) if varlen else (False, True)
            for innermost in mappings:
                for flags in (False, True):
                    found = undefined_reads(sass(*case, flags, varlen, innermost))
                    print(case, 'varlen' if varlen else '', 'slices innermost' if innermost else '',
                          'with states' if flags else '', 'reads before writes:',
                          ', '.join(f'{r} at {a} ({o})' for a, o, r in found) or 'none', flush=True)


if __name__ == '__main__':
    main()
