import distributed

from prefect_gpu_dask.cluster import local_cluster_kwargs


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
