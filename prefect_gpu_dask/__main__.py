"""``python -m prefect_gpu_dask``: the same as the ``prefect-gpu-dask`` command."""

from prefect_gpu_dask.cli.main import main

if __name__ == "__main__":
    main()
