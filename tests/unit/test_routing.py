import pickle

import pytest

from prefect_gpu_dask.routing import TagRouter, parse_gpu_tag, satisfiable, validate_tag_resources


@pytest.mark.parametrize(
    "tag, amount",
    [("gpu", 1.0), ("gpu:0.5", 0.5), ("gpu:2", 2.0), ("gpu:0.25", 0.25), ("etl", None)],
)
def test_gpu_tags(tag, amount):
    assert parse_gpu_tag(tag) == amount


@pytest.mark.parametrize("tag", ["gpu:abc", "gpu:-1", "gpu:0", "gpu:", "gpu:nan", "gpu:inf"])
def test_malformed_gpu_tags_name_the_tag(tag):
    with pytest.raises(ValueError, match=tag.replace(":", ":").split(":")[0]) as err:
        parse_gpu_tag(tag)
    assert repr(tag) in str(err.value)


def test_router_combines_tags_and_custom_map():
    router = TagRouter({"nvme": {"NVME": 1}, "a100": {"GPU": 1, "A100": 1}})
    assert router.resources_for_tags({"gpu"}) == {"GPU": 1.0}
    assert router.resources_for_tags({"gpu:0.5", "nvme"}) == {"GPU": 0.5, "NVME": 1.0}
    assert router.resources_for_tags({"a100", "gpu:0.5"}) == {"GPU": 1.0, "A100": 1.0}
    assert router.resources_for_tags({"nightly"}) == {}
    with pytest.raises(ValueError, match="gpu:x"):
        router.resources_for_tags({"gpu:x"})


@pytest.mark.parametrize(
    "mapping, bad",
    [
        ({"nvme": {"NVME": -1}}, "-1"),
        ({"nvme": {"NVME": "one"}}, "'one'"),
        ({"nvme": {"NVME": 0}}, "0"),
        ({"nvme": {}}, "nvme"),
        ({"nvme": 3}, "3"),
        ({"gpu": {"GPU": 1}}, "gpu"),
        ({"": {"X": 1}}, "''"),
        (["nvme"], "nvme"),
        ({"nvme": {"NVME": True}}, "True"),
    ],
)
def test_bad_tag_maps_name_the_value(mapping, bad):
    with pytest.raises(ValueError) as err:
        validate_tag_resources(mapping)
    assert bad in str(err.value)


def test_router_pickles():
    router = TagRouter({"nvme": {"NVME": 1}})
    clone = pickle.loads(pickle.dumps(router))
    assert clone.resources_for_tags({"nvme", "gpu"}) == {"NVME": 1.0, "GPU": 1.0}


def test_satisfiable():
    workers = [{"GPU": 1}, {}]
    assert satisfiable({"GPU": 1}, workers)
    assert satisfiable({"GPU": 0.5}, workers)
    assert not satisfiable({"GPU": 2}, workers)
    assert not satisfiable({"NVME": 1}, workers)
    assert satisfiable({}, [{}])
