"""Launch tables of the chunk kernels: block sizes (capped by the head dims at launch,
``launch.launch_config``) and Triton launch options (``num_warps``, ``num_stages``, ``maxnreg``).

Pure data. Chosen on the H200 with ``python -m benchmarks tune stages`` and ``tune forward``,
which edit these dicts in place to time alternatives; the figures behind every entry are in
``docs/tuning.md``. ``maxnreg`` caps the registers of a thread so that more programs fit an SM.
The state slice ``[K, BV]`` of the state sweeps lives in registers in float32.
"""

TUNING = {
    # The in-chunk cumulative decay. '_decayed': the backward recompute's builds, which also write
    # the decayed keys and queries; '_raw': the raw gate's builds (its activation inside).
    # docs/tuning.md, "cumsum".
    'cumsum': {'BK': 64, 'num_warps': 4, 'maxnreg': 96},
    'cumsum_decayed': {'BK': 64, 'num_warps': 4, 'maxnreg': 96},
    'cumsum_raw': {'BK': 64, 'num_warps': 2},
    'cumsum_raw_decayed': {'BK': 64, 'num_warps': 4, 'maxnreg': 96},
    # One warp: with more, every warp holds the products' whole [16, BK] left operand and the
    # exponentials formed in its layout. docs/tuning.md, "pair_fwd".
    'pair_fwd': {'BK': 32, 'num_warps': 1, 'num_stages': 3},
    # The inference build that normalizes raw q and k itself (L2NORM). docs/tuning.md, "pair_fwd".
    'pair_fwd_norms': {'BK': 32, 'num_warps': 1, 'num_stages': 2},
    # Its [16, 16] blocks fill one warp. docs/tuning.md, "solve".
    'solve': {'num_warps': 1},
    # The in-chunk stage in one kernel (FUSED_PREP): the pair products' and the solve's one warp,
    # their key slices. Untimed.
    'prep': {'BK': 32, 'num_warps': 1, 'num_stages': 2},
    # The backward's state carry. docs/tuning.md, "State sweeps".
    'state_fwd': {'BV': 64, 'num_warps': 4, 'num_stages': 2},
    # The forward's fused state sweep and outputs. docs/tuning.md, "State sweeps".
    'state_output': {'BV': 64, 'num_warps': 4, 'num_stages': 1},
    # The state-gradient sweep. docs/tuning.md, "State sweeps".
    'state_bwd': {'BV': 64, 'num_warps': 4, 'num_stages': 2},
    # The per-chunk gradients: one program an SM. docs/tuning.md, "intra_bwd".
    'intra_bwd': {'BK': 64, 'BV': 64, 'num_warps': 8, 'num_stages': 1},
    # The pair-matrix gradients; '_bounded': the lower-bound gate's build (no diagonal fallback).
    # docs/tuning.md, "pair_bwd".
    'pair_bwd': {'BK': 64, 'num_warps': 4, 'num_stages': 2, 'maxnreg': 128},
    'pair_bwd_bounded': {'BK': 64, 'num_warps': 4, 'num_stages': 3, 'maxnreg': 128},
    # The gate gradient; '_raw': the raw gate's build (its activation's gradient and the A_log and
    # dt_bias sums), which the softplus gate shares unswept. docs/tuning.md, "gate_bwd".
    'gate_bwd': {'BK': 64, 'num_warps': 4},
    'gate_bwd_raw': {'BK': 32, 'num_warps': 2},
    # The sums over chunks of the gate parameters' gradients, BN chunks a step.
    # docs/tuning.md, "gate_params".
    'gate_params': {'BK': 32, 'BN': 256, 'num_warps': 8},
}

# The state sweeps run one program per (sequence, value head, value slice) through every chunk of
# the sequence. Where that is fewer programs than SMs, the slice is halved for twice as many and
# these settings apply on top (a BV here replaces the halved one). docs/tuning.md, "Few programs".
FEW_PROGRAMS = {'state_fwd': {'BV': 32}, 'state_output': {'BV': 32, 'num_stages': 2},
                'state_bwd': {'num_warps': 4, 'num_stages': 3}}

# Where the fused forward sweep has at least as many programs as SMs at TUNING's 64-wide slices
# (so not FEW_PROGRAMS), 16-bit inputs and K <= 128: one 128-wide slice a program with 8 warps,
# one program an SM, so that the key-side tiles every value slice of a head reads (qt, kg, kbar,
# Aqk, M) are read once instead of twice. float32 keeps the 64-wide build: its 128-wide one asks
# more shared memory than the H200 has. docs/tuning.md, "Wide slices".
WIDE_SLICES = {'state_output': {'BV': 128, 'num_warps': 8, 'num_stages': 2}}

# The forward's in-chunk stage in one launch a (chunk, value head) (``prep.fused_in_chunk_stage``)
# instead of the cumsum, pair products and solve: the same bits. Off until timed on a GPU.
FUSED_PREP = False
