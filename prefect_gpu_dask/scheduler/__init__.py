"""What runs on the Dask scheduler: functions sent through ``run_on_scheduler`` and
the scheduler plugin.

Nothing here imports Prefect: a scheduler need not have it installed.
"""
