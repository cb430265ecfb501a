import pickle

import pytest

from prefect_gpu_dask.flow.routing import Route, TagRouter, WorkerOffers, parse_gpu_tag
from prefect_gpu_dask.resources import satisfiable
from prefect_gpu_dask.settings import RunnerSettings, validate_tag_resources


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


@pytest.mark.parametrize(
    "tags, resources",
    [
        ({"gpu:h200"}, {"GPU": 1.0, "GPU-H200": 1.0}),
        ({"gpu:0.5", "gpu:h100"}, {"GPU": 0.5, "GPU-H100": 0.5}),
        ({"gpu-mem:40GiB"}, {"GPU": 1.0, "GPU-MEM": 40.0 * 2**30}),
        (
            {"gpu:0.25", "gpu-mem:20GiB", "gpu-model:rtx-4090"},
            {"GPU": 0.25, "GPU-MEM": 20.0 * 2**30, "GPU-RTX-4090": 0.25},
        ),
    ],
)
def test_model_and_memory_tags(tags, resources):
    assert TagRouter().resources_for_tags(tags) == resources


@pytest.mark.parametrize(
    "tags, named",
    [
        ({"gpu:h2000"}, "gpu:h2000"),  # not a known model, not a number: a typo
        ({"gpu-mem:lots"}, "gpu-mem:lots"),
        ({"gpu-mem:0"}, "gpu-mem:0"),
        ({"gpu-model:"}, "gpu-model:"),
        ({"gpu-model:h 100"}, "gpu-model:h 100"),
        ({"gpu:h100", "gpu:h200"}, "['h100', 'h200']"),
    ],
)
def test_bad_model_and_memory_tags_name_the_tag(tags, named):
    with pytest.raises(ValueError) as err:
        TagRouter().resources_for_tags(tags)
    assert named in str(err.value)


def test_model_and_memory_tags_are_reserved():
    for tag in ("gpu-mem:1GiB", "gpu-model:h100"):
        with pytest.raises(ValueError, match="reserved"):
            TagRouter({tag: {"X": 1}})


@pytest.mark.parametrize(
    "name, slug",
    [
        ("NVIDIA H200", "h200"),
        ("NVIDIA H100 80GB HBM3", "h100"),
        ("NVIDIA A100-SXM4-80GB", "a100"),
        ("NVIDIA GeForce RTX 4090", "rtx-4090"),
        ("Tesla K80", "k80"),
        ("NVIDIA H100 80GB HBM3 MIG 1g.10gb", "h100"),
    ],
)
def test_model_slugs_from_nvml_names(name, slug):
    from prefect_gpu_dask.resources import model_slug

    assert model_slug(name) == slug


def test_labels_a_worker_adds_what_it_lacks():
    from prefect_gpu_dask.worker.labels import labels_for
    from prefect_gpu_dask.worker.probe import GPUIdentity

    h200 = GPUIdentity(0, "GPU-1", "NVIDIA H200", 141 * 2**30)
    assert labels_for({}, h200) == {"GPU": 1.0, "GPU-H200": 1.0, "GPU-MEM": 141.0 * 2**30}
    assert labels_for({"GPU": 2.0}, h200) == {"GPU-H200": 2.0, "GPU-MEM": 141.0 * 2**30}
    # A MIG instance is a GPU of its own size.
    mig = GPUIdentity(0, "MIG-1", "NVIDIA H100 80GB HBM3 MIG 1g.10gb", 10 * 2**30)
    assert labels_for({"GPU": 1.0}, mig) == {"GPU-H100": 1.0, "GPU-MEM": 10.0 * 2**30}
    assert labels_for({"GPU": 1.0, "GPU-H100": 1.0, "GPU-MEM": 1.0}, mig) == {}


def _offers(*workers: dict[str, float]) -> WorkerOffers:
    answer = {"workers": {str(i): {"resources": w} for i, w in enumerate(workers)}}
    return WorkerOffers(identity=lambda: answer)


def test_route_waits_for_a_cluster_that_can_grow_and_falls_back_at_once_otherwise():
    router = TagRouter()
    cpu_only = _offers({})
    at_once = router.route("t", {"gpu:0.25"}, None, cpu_only, "error")
    assert at_once.resources == {} and at_once.fallback == "error" and at_once.wait_s == 0
    assert "no worker offers them (workers offer [{}])" in at_once.message

    waits = router.route("t", {"gpu:0.25"}, None, cpu_only, "cpu", wait_s=45)
    # The share is kept while it waits: a gpu:0.25 task never takes more than its quarter.
    assert waits.resources == {"GPU": 0.25} and waits.gpu and waits.wait_s == 45
    assert waits.fallback == "cpu"
    assert "no worker offering them joined within 45 s: running on CPU instead" in waits.message

    served = router.route("t", {"gpu:0.25"}, None, _offers({}, {"GPU": 1}), "error", wait_s=45)
    assert served == Route({"GPU": 0.25}, True)


@pytest.mark.parametrize("bad", [-1, float("inf"), float("nan"), "60", True, None])
def test_gpu_wait_must_be_seconds(bad):
    with pytest.raises(ValueError, match=r"gpu_wait_s .* must be a number of seconds"):
        RunnerSettings(gpu_wait_s=bad)


@pytest.mark.parametrize("bad", [0, -1, float("inf"), float("nan"), "30", True])
def test_health_check_interval_must_be_positive_seconds_or_none(bad):
    with pytest.raises(ValueError, match=r"health_check_s .* must be a number of seconds > 0, or None"):
        RunnerSettings(health_check_s=bad)
    assert RunnerSettings(health_check_s=None).health_check_s is None
