import distributed

from prefect_gpu_dask.flow.cluster import local_cluster_kwargs


class NarrowCluster(distributed.LocalCluster):
    def __init__(self, asynchronous: bool = False):  # takes no host or dashboard_address
        self.asynchronous = asynchronous


def test_loopback_defaults_only_where_the_class_takes_them():
    assert local_cluster_kwargs(distributed.LocalCluster, {"n_workers": 1}) == {
        "n_workers": 1,
        "host": "127.0.0.1",
        "dashboard_address": "127.0.0.1:0",
    }
    assert local_cluster_kwargs(NarrowCluster, {}) == {}
    # What the user passed is passed on, accepted or not: the class names the error.
    assert local_cluster_kwargs(NarrowCluster, {"n_workers": 2}) == {"n_workers": 2}


def test_clusters_forking_at_once_hand_the_start_method_back_to_the_user(monkeypatch):
    import dask

    from prefect_gpu_dask import forkserver
    from prefect_gpu_dask.forkserver import START_METHOD_KEY, worker_processes, worker_start_method

    assert dask.config.get(START_METHOD_KEY) == "spawn"
    worker_start_method()  # the server runs; earlier tests here may have changed the environment since
    monkeypatch.setattr(forkserver, "_fork_server_surroundings", forkserver._surroundings())
    first, second = worker_processes(), worker_processes()
    assert first.__enter__() == second.__enter__() == "forkserver"
    assert dask.config.get(START_METHOD_KEY) == "forkserver"
    # Still the user's "spawn" underneath: a changed environment is still noticed.
    monkeypatch.setenv("PREFECT_GPU_DASK_TEST_MARK", "changed")
    assert worker_start_method() == "spawn"
    monkeypatch.delenv("PREFECT_GPU_DASK_TEST_MARK")
    first.__exit__(None, None, None)  # closed before the later one, as overlapping flows may
    assert dask.config.get(START_METHOD_KEY) == "forkserver"
    second.__exit__(None, None, None)
    assert dask.config.get(START_METHOD_KEY) == "spawn"


def test_started_clusters_sample_profiles_coarser_unless_the_user_chose_an_interval():
    import dask

    from prefect_gpu_dask.flow.cluster import PROFILE_INTERVAL, local_cluster_config

    assert local_cluster_config(gpu_wait_s=None) == {PROFILE_INTERVAL: "100ms"}
    # Dask's own no-workers timeout backs the flow's gpu_wait_s up, 10 s later.
    assert local_cluster_config(gpu_wait_s=5) == {
        "distributed.scheduler.no-workers-timeout": "15s",
        PROFILE_INTERVAL: "100ms",
    }
    with dask.config.set({PROFILE_INTERVAL: "5ms", "distributed.scheduler.no-workers-timeout": "1h"}):
        assert local_cluster_config(gpu_wait_s=5) == {}


def test_the_fork_server_imports_dask_cuda_only_for_cuda_workers():
    from prefect_gpu_dask.forkserver import CUDA_WORKER_PRELOAD, server_preload

    assert server_preload(["prefect"], cuda=True) == ["prefect", *CUDA_WORKER_PRELOAD]
    assert server_preload(["prefect"], cuda=False) == ["prefect"]


def test_a_local_clusters_closed_streams_log_their_line_without_a_traceback():
    import io
    import logging
    from contextlib import ExitStack

    from distributed.comm import CommClosedError

    from prefect_gpu_dask.flow.cluster import start_local_cluster

    with ExitStack() as stack:
        in_process = {"processes": False, "n_workers": 0, "dashboard_address": ":0"}
        start_local_cluster(distributed.LocalCluster, in_process, stack, {})
    logger = logging.getLogger("distributed.batched")
    written = io.StringIO()
    handler = logging.StreamHandler(written)
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        for error in (CommClosedError("closed"), ValueError("something else")):
            try:
                raise error
            except Exception:
                logger.info("Batched Comm Closed %r", "<TCP (closed)>", exc_info=True)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    text = written.getvalue()
    assert text.count("Batched Comm Closed") == 2
    assert "Batched Comm Closed '<TCP (closed)>': CommClosedError('closed')" in text  # its words kept
    assert text.count("Traceback (most recent call last)") == 1  # only the other error's
    assert "ValueError: something else" in text
