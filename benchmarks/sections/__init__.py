"""One module per section of ``benchmarks/run.py``. Each ``run(options)`` yields
``(key, figures)`` as it measures them: the keys it adds to the result file."""
