"""Compiler-inspection tools for the kernels (registers, spills, shared memory, machine code),
run without a GPU: ``python -m tools.resources``, ``python -m tools.uniform_regs``, or the files
as scripts."""
