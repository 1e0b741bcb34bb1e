"""Every chunk kernel compiled for sm_90 (H100/H200) at the launch configuration the launchers
give it, without a GPU; prints one JSON list with a record a build (``test_offline_sm90.py`` reads
it).

    python tests/chunk/sm90_builds.py      # TRITON_INTERPRET unset; the repository on PYTHONPATH

Builds: float32 and bf16 (and float16 for the pair products, whose diagonal blocks take another
path there; the other kernels' float16 tiles have bf16's sizes) at K = V = 128, and for the state
sweeps also K = 256 and few programs (FEW_PROGRAMS), the settings that depend on the shape.
Argument types: the launchers', from ``kda/ops/offline.py`` (g pre-computed in float32, the
float32 scratch buffers, the states handed to the user). A process of its own: under
``TRITON_INTERPRET=1`` the kernels are interpreted functions, which Triton cannot compile.

A record: the case (``stage``, ``dtype``, ``K``, ``few``, ``transposed``), the launch
configuration (``config``), the shared memory the build asks (``shared``, bytes), its
tensor-core instructions (``tensor_core_products``) and where its PDL instructions sit
(``dependent_launch_order``). Cases whose compile inputs are the same (the launcher gives them
the same configuration) share one compile.
"""
from __future__ import annotations

import concurrent.futures
import inspect
import json
import multiprocessing
import os
import re

import torch

import kda.ops.chunk.launch as chunk_launch
from kda.kernels import chunk_common, chunk_intra, chunk_intra_bwd, chunk_state, chunk_state_bwd, chunk_state_output
from kda.ops.offline import OPTIONAL, POINTERS, compile_sm90

KERNELS = {'cumsum': chunk_intra.chunk_cumsum_kernel, 'cumsum_raw': chunk_intra.chunk_cumsum_kernel,
           'cumsum_decayed': chunk_intra.chunk_cumsum_kernel,
           'cumsum_raw_decayed': chunk_intra.chunk_cumsum_kernel,
           'pair_fwd': chunk_intra.chunk_pair_fwd_kernel,
           # Inference with use_qk_l2norm_in_kernel: raw q and k, normalized in the kernel.
           'pair_fwd_norms': chunk_intra.chunk_pair_fwd_kernel,
           # The lower-bound gate with keys of norm 1 (ALL_NEAR): training's and inference's.
           'pair_fwd_near': chunk_intra.chunk_pair_fwd_kernel,
           'pair_fwd_norms_near': chunk_intra.chunk_pair_fwd_kernel,
           'solve': chunk_intra.chunk_solve_kernel,
           # Varlen builds: the chunk map (chunk_rows) is read before griddepcontrol.wait.
           'pair_fwd_norms_varlen': chunk_intra.chunk_pair_fwd_kernel,
           'solve_varlen': chunk_intra.chunk_solve_kernel,
           'intra_bwd': chunk_intra_bwd.chunk_intra_bwd_kernel,
           'pair_bwd': chunk_intra_bwd.chunk_pair_bwd_kernel, 'pair_bwd_bounded': chunk_intra_bwd.chunk_pair_bwd_kernel,
           'gate_bwd': chunk_intra_bwd.chunk_gate_bwd_kernel, 'gate_bwd_raw': chunk_intra_bwd.chunk_gate_bwd_kernel,
           'state_fwd': chunk_state.chunk_state_fwd_kernel, 'state_bwd': chunk_state_bwd.chunk_state_bwd_kernel,
           'state_output': chunk_state_output.chunk_state_output_fwd_kernel}

# Builds for the raw gate (bf16 g, the activation inside).
RAW_GATE = ('gate_bwd_raw', 'cumsum_raw', 'cumsum_raw_decayed')


def build_inputs(stage, dtype, K, few, transposed):
    """What ``compile_sm90`` is given for a case, and the launch configuration it comes from:
    ``(kernel, constexpr values, options, signature options, configuration)``."""
    chunk_launch.sm_count = lambda device: 10 ** 6 if few else 1
    fn = KERNELS[stage]
    varlen, stage = stage.endswith('_varlen'), stage.removesuffix('_varlen')
    if stage.startswith('state_'):
        cfg = chunk_launch.state_launch_config(stage, K, K, 4, torch.device('cpu'), dtype)
    else:
        cfg = chunk_launch.launch_config(stage.removesuffix('_near'), K, K)
    values = dict(H=4, HV=4, K=K, V=K, BT=64, BC=16, DOT_DTYPE=chunk_launch.DOT_DTYPES[dtype], IS_VARLEN=varlen,
                  SLICES_INNERMOST=cfg.get('SLICES_INNERMOST', False),
                  GATE='sigmoid' if stage in RAW_GATE else 'none',
                  DECAYED=stage not in ('cumsum', 'cumsum_raw'),
                  FACTORED_DIAG=dtype != torch.float16, BOUNDED_DECAY=stage == 'pair_bwd_bounded',
                  ALL_NEAR=stage.endswith('_near'), L2NORM=stage.startswith('pair_fwd_norms'),
                  # As launched: early (the waits) only the l2norm inference's pair products and
                  # solve; the cumsum releases its dependents always (kda/ops/chunk/launch.py).
                  PDL=stage.startswith(('cumsum', 'pair_fwd_norms', 'solve')),
                  USE_INITIAL_STATE=False, STORE_FINAL_STATE=False, STORE_STATES=True, USE_FINAL_STATE_GRADIENT=False,
                  STORE_INITIAL_STATE_GRADIENT=False, TRANSPOSED=transposed,
                  **{n: cfg[n] for n in ('BK', 'BV') if n in cfg})
    options = {n: cfg[n] for n in ('num_warps', 'num_stages', 'maxnreg') if n in cfg}
    # specialize: the launches' tensors are 16-byte aligned with strides divisible by 16, and the
    # build that knows it pipelines its loads through shared memory (the larger ask: the gradient
    # sweep at K = 256 asked 256 KiB on the H200 where the unspecialized build asks 76 KiB).
    # The raw gate's build: g and its dg in the input dtype, A_log, dt_bias and the sums present.
    signature = dict(absent=OPTIONAL - {'A_log', 'dt_bias', 'da', 'dbias'},
                     pointers={n: POINTERS[dtype] for n in ('g', 'dg')}) if stage in RAW_GATE else {}
    if varlen:
        signature['absent'] = OPTIONAL - {'chunk_rows'}
    return fn, values, options, dict(signature, specialize=True), cfg


def compile_key(case):
    """The compile inputs of ``case`` as a hashable value: cases with equal keys give one build."""
    fn, values, options, signature, _ = build_inputs(*case)
    frozen = {n: tuple(sorted(x)) if isinstance(x, (set, frozenset)) else x for n, x in signature.items()}
    return (fn.fn.__name__, str(case[1]), repr(sorted(values.items())), repr(sorted(options.items())),
            repr(sorted(frozen.items())))


def compile_case(case):
    """Compiles ``case``: ``(shared memory, tensor-core products, dependent_launch_order)``."""
    fn, values, options, signature, _ = build_inputs(*case)
    kernel = compile_sm90(fn, values, case[1], options, **signature)
    ptx = kernel.asm['ptx']
    return kernel.metadata.shared, tensor_core_products(ptx), dependent_launch_order(ptx)


# Tensor-core products (mma.sync, wgmma.mma_async), predicated or not.
TENSOR_CORE = re.compile(r'^\s*(?:@!?%\w+\s+)?(?:mma\.sync|wgmma\.mma_async)')


def tensor_core_products(ptx):
    return sum(bool(TENSOR_CORE.match(x)) for x in ptx.splitlines())


# Where the PDL instructions sit in the PTX. Every access to global memory counts (ld/st in any
# variant, cp.async and its bulk/tensor (TMA) forms, atomics and reductions; generic addresses
# too), not only ld.global/st.global: the loads the software pipeliner issues are cp.async, and
# Triton 3.6 places a loop's prologue copies above a griddepcontrol.wait inside the loop (Triton
# issue #11905). A load before the wait must come from a source line that may read early
# (EARLY_READS, by the PTX's .loc lines: the line itself and the line it was inlined at). The wait
# must not sit in a loop or a branch: no branch after it goes back above it, none before it jumps
# past it.
def source_lines(fn):
    src, first = inspect.getsourcelines(fn.fn)
    return os.path.basename(inspect.getsourcefile(fn.fn)), range(first, first + len(src))


# The rows' norms (inputs, written before the kernel ahead started) and the varlen chunk map
# (likewise).
EARLY_READS = (source_lines(chunk_intra.row_inverse_norms), source_lines(chunk_common.chunk_span))
MEMORY_OP = re.compile(r'^\s*(?:@!?%\w+\s+)?((?:ld|st|cp|atom|red|multimem|prefetch|prefetchu)\.[\w.:]*)')
LABEL = re.compile(r'^\s*(\$L\w+):')
BRANCH = re.compile(r'\bbra(?:\.uni)?\s+(\$L\w+)')
PTX_FILE = re.compile(r'^\s*\.file\s+(\d+)\s+"([^"]+)"')
LOC = re.compile(r'^\s*\.loc\s+(\d+)\s+(\d+)')


def global_access(op):
    """None for an instruction that does not touch global memory, else 'load' or 'store'."""
    if any(w in op for w in ('commit_group', 'wait_group', 'wait_all', '.param', '.local', '.const')):
        return None
    if '.shared' in op and '.global' not in op:
        return None
    if op.startswith('cp.'):       # cp.<...>.<destination>.<source>
        return 'store' if '.global' in op and op.index('.global') < op.find('.shared') else 'load'
    return 'load' if op.startswith(('ld.', 'prefetch')) else 'store'


def dependent_launch_order(ptx):
    lines = ptx.splitlines()
    files = {m.group(1): os.path.basename(m.group(2)) for m in map(PTX_FILE.match, lines) if m}
    wait = next((i for i, x in enumerate(lines) if 'griddepcontrol.wait' in x), len(lines))
    release = next((i for i, x in enumerate(lines) if 'griddepcontrol.launch_dependents' in x), None)
    labels = {m.group(1): i for i, m in enumerate(map(LABEL.match, lines)) if m}
    loads = stores = 0
    unexplained, frames = [], []
    for x in lines[:wait]:
        m = LOC.match(x)
        if m:
            frames = [(files.get(m.group(1)), int(m.group(2)))]
            frames += [(files.get(f), int(n)) for f, n in re.findall(r'inlined_at\s+(\d+)\s+(\d+)', x)]
            frames += [(f, int(n)) for f, n in re.findall(r'([\w.]+\.py):(\d+)', x.partition('//')[2])]
            continue
        op = MEMORY_OP.match(x)
        kind = op and global_access(op.group(1))
        if kind == 'store':
            stores += 1
        elif kind == 'load':
            loads += 1
            if not any(f == name and n in span for f, n in frames for name, span in EARLY_READS):
                unexplained.append(x.strip())
    targets = [(i, labels.get(m.group(1))) for i, m in enumerate(map(BRANCH.search, lines)) if m]
    return dict(wait=wait < len(lines), release=release is not None,
                loads=loads, stores=stores, unexplained=unexplained[:5],
                back_edges=sum(i > wait and t is not None and t < wait for i, t in targets),
                skips=sum(i < wait and t is not None and t > wait for i, t in targets),
                release_after_wait=release is not None and release > wait)


def cases():
    """``(stage, dtype, K, few, transposed)`` of every build. The fused forward sweep runs
    transposed always; the carry and the gradient sweep either way with many programs (transposed
    up to 1.5 waves, ``transposed_sweeps`` in kda/ops/chunk/launch.py), transposed with few."""
    out = [('pair_fwd', torch.float16, 128, False, False), ('pair_fwd_norms', torch.float16, 128, False, False)]
    for dtype in (torch.float32, torch.bfloat16):
        for stage in KERNELS:
            if not stage.startswith('state_'):
                out.append((stage, dtype, 128, False, False))
                continue
            for K in (128, 256):
                out += [(stage, dtype, K, True, True)] + [(stage, dtype, K, False, t) for t in (True, False)
                                                          if t or stage != 'state_output']
    return out


def main():
    all_cases = cases()
    builds = {}
    for case in all_cases:
        builds.setdefault(compile_key(case), case)
    # One compile a process, on every core: compiles are single-threaded, and one after another
    # they take minutes.
    workers = max(1, min(len(builds), len(os.sched_getaffinity(0))))
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context('fork')) as pool:
        compiled = dict(zip(builds, pool.map(compile_case, builds.values())))
    records = []
    for case in all_cases:
        shared, products, order = compiled[compile_key(case)]
        stage, dtype, K, few, transposed = case
        records.append(dict(stage=stage, dtype=str(dtype), K=K, few=few, transposed=transposed,
                            config=str(build_inputs(*case)[-1]), shared=shared, tensor_core_products=products,
                            dependent_launch_order=order))
    print(json.dumps(dict(builds=len(builds), records=records)))


if __name__ == '__main__':
    main()
