"""What runs in a Dask worker process (and its nanny): the guard and what it reads,
the wrappers around a task's function, and a task run's start.

Importing a module here never imports Prefect: a worker loads it with its first task run.
"""
