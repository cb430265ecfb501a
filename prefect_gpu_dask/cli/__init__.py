"""The operator's terminal: the ``prefect-gpu-dask`` command, and the host cluster it runs."""
