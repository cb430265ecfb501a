"""How compute_on_gpus deals a split graph's roots: in proportion to how fast each
worker computed its shares of that graph before."""

import dask.array as da
import numpy as np
import pytest
from dask._expr import FinalizeCompute
from dask.base import collections_to_expr
from dask.core import flatten

from prefect_gpu_dask.worker.compute import _served_seconds, split_graph
from prefect_gpu_dask.worker.share_balance import (
    GRAPHS_KEPT,
    MOST_UNEVEN,
    WORKERS_KEPT,
    ShareSpeeds,
    graph_shape,
    share_sizes,
)


def test_roots_follow_the_speeds_and_add_up():
    assert share_sizes(100, [None, None]) == [50, 50]  # nothing seen yet: even
    assert share_sizes(10, [None, None, None]) == [4, 3, 3]
    assert share_sizes(100, [2.0, 1.0]) == [67, 33]
    assert share_sizes(100, [1.0, 1.06]) == [49, 51]
    assert share_sizes(8, [2.0, 1.0, 1.0]) == [4, 2, 2]
    for roots, speeds in [(3, [1.0, 9.0, 9.0]), (64, [0.1, 3.0, None, 7.0]), (2, [1.0, 1e9])]:
        sizes = share_sizes(roots, speeds)
        assert sum(sizes) == roots and min(sizes) >= 1, (roots, speeds, sizes)
    with pytest.raises(ValueError, match="cannot deal 2 roots into 3 shares"):
        share_sizes(2, [None] * 3)


def test_an_unseen_worker_gets_a_typical_share_and_no_worker_counts_as_absurdly_fast_or_slow():
    assert share_sizes(90, [3.0, None, 3.0]) == [30, 30, 30]
    assert share_sizes(70, [1.0, 1.0, 1000.0]) == [14, 14, 42]  # MOST_UNEVEN times the median at most
    assert share_sizes(70, [1000.0, 1000.0, 1.0]) == [30, 30, 10]  # and a third of it at least
    assert MOST_UNEVEN == 3.0


def test_speeds_are_kept_against_the_same_calls_other_shares_and_their_median_ignores_one_slow_share():
    speeds = ShareSpeeds()
    shape = ("graph", 1)
    assert speeds.speeds(shape, ["a", "b"]) == [None, None]
    speeds.note(shape, {"a": (50, 1.0), "b": (50, 3.0)})  # both seen for the first time
    speeds.note(shape, {"a": (50, 1.0), "b": (50, 10.0)})  # one slow share
    for _ in range(2):
        speeds.note(shape, {"a": (50, 1.0), "b": (50, 3.0)})
    # The same two workers on a graph of the same shape that costs ten times as much.
    speeds.note(shape, {"a": (50, 10.0), "b": (50, 30.0)})
    a, b = speeds.speeds(shape, ["a", "b"])
    assert (a, b) == (pytest.approx(1.5), pytest.approx(0.5))
    assert share_sizes(100, [a, b]) == [75, 25]
    assert speeds.speeds(("another graph", 1), ["a"]) == [None]
    speeds.note(shape, {"a": (0, 0.5), "c": (10, 0.0)})  # nothing to learn from these
    speeds.note(shape, {"a": (50, 0.1)})  # nor from a share with none beside it to compare
    assert speeds.speeds(shape, ["a", "c"]) == [pytest.approx(1.5), None]


def test_a_workers_first_share_of_a_graph_teaches_nothing_and_the_others_are_kept_against_each_other():
    speeds = ShareSpeeds()
    shape = ("graph", 1)
    speeds.note(shape, {"a": (50, 1.0), "b": (50, 10.0)})  # b compiled the graph's kernels
    assert speeds.speeds(shape, ["a", "b"]) == [None, None]  # the next split is still even
    speeds.note(shape, {"a": (50, 1.0), "b": (50, 1.0)})
    assert speeds.speeds(shape, ["a", "b"]) == [pytest.approx(1.0), pytest.approx(1.0)]
    # c joins (a restarted worker, at a new address): a and b against each other, c not at all.
    speeds.note(shape, {"a": (50, 1.0), "b": (50, 2.0), "c": (50, 20.0)})
    assert speeds.speeds(shape, ["a", "b", "c"]) == [pytest.approx(7 / 6), pytest.approx(5 / 6), None]


def test_a_call_with_more_workers_than_are_kept_keeps_learning():
    speeds = ShareSpeeds()
    shape = ("graph", 1)
    workers = {f"w{i}": (10, 1.0 if i else 0.5) for i in range(WORKERS_KEPT + 1)}
    for _ in range(2):
        speeds.note(shape, workers)
    known = speeds.speeds(shape, list(workers))
    assert None not in known and known[0] == pytest.approx(2 * known[1])


def test_only_the_latest_graph_shapes_and_workers_are_kept():
    speeds = ShareSpeeds()
    for i in range(GRAPHS_KEPT + 1):
        for _ in range(2):  # the first call on a graph only introduces its workers
            speeds.note(("graph", i), {"a": (2, 1.0), "b": (1, 1.0)})
    assert speeds.speeds(("graph", 0), ["a"]) == [None]
    assert speeds.speeds(("graph", GRAPHS_KEPT), ["a"]) == [pytest.approx(4 / 3)]
    # Workers restarted at new addresses, one after another, beside one that stays.
    for i in range(WORKERS_KEPT + 1):
        stays = (100, 1.0) if i == WORKERS_KEPT else (2, 1.0)  # one outlier, outvoted by its history
        for _ in range(2):
            speeds.note(("graph", 1), {"stays": stays, f"restarted-{i}": (1, 1.0)})
    kept = speeds.speeds(("graph", 1), ["stays", "restarted-0", f"restarted-{WORKERS_KEPT}"])
    assert kept == [pytest.approx(4 / 3), None, pytest.approx(2 / 101)]


def test_only_a_number_the_worker_reported_counts_as_its_time():
    assert _served_seconds({"status": "OK", "seconds": 0.25}) == 0.25
    for reply in ({"status": "OK"}, {"seconds": None}, {"seconds": "0.2"}, {"seconds": -1.0}):
        assert _served_seconds(reply) == 0.0


def graph_of(collection):
    expr = FinalizeCompute(collections_to_expr([collection], True)).optimize()
    return dict(expr.__dask_graph__()), list(flatten(expr.__dask_keys__()))


def test_a_split_deals_roots_by_speed_and_keeps_whole_subtrees():
    x = da.random.RandomState(0).normal(10, 1, size=(2000, 2000), chunks=200)
    graph, keys = graph_of((x[::2, ::2] + 1).mean())
    parts, join = split_graph(graph, keys, 2, [1.0, 1.5])
    roots = [sum(not node.dependencies for node in part.values()) for part, _ in parts]
    assert roots == [40, 60]
    assert len(join) <= 4
    for part, _ in parts:
        assert all(dep in part for node in part.values() for dep in node.dependencies)
    with pytest.raises(ValueError, match="3 speeds for 2 parts"):
        split_graph(graph, keys, 2, [1.0, 1.0, 1.0])


def test_the_same_work_has_the_same_shape_whatever_its_tokens():
    def cube(seed):
        x = da.random.RandomState(seed).normal(size=(400, 400), chunks=100)
        return graph_of(x.mean())

    assert graph_shape(*cube(1)) == graph_shape(*cube(2))
    x = da.ones((400, 400), chunks=100)
    assert graph_shape(*graph_of(x.sum())) != graph_shape(*cube(1))
    assert graph_shape(*graph_of(x + 1)) == graph_shape(*graph_of(x + 2))
    assert graph_shape(*graph_of(x.map_blocks(np.sin))) != graph_shape(*graph_of(x.map_blocks(np.cos)))
