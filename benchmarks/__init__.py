"""Benchmarks of ``kda`` beside FLA's ``fla.ops.kda`` and FlashKDA: ``python -m benchmarks
{run,report,tune,compare}`` (``--help`` of each says what it does)."""
