"""kvshelf benchmarks: every speed, size and memory claim beside its baseline, measured in the same run.

Run ``python -m benchmarks`` from the repository root; see ``benchmarks/README.md``.
"""
