"""The benchmarks: ``run.py`` and its sections, the tagged comparison on its own, the probes."""
