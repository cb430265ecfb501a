"""What a worker calls plain, small host data when it tells a result's size
(``worker.recycling.plain_nbytes``): only what the flow may fetch unasked."""

from __future__ import annotations

import dataclasses

import numpy as np

from prefect_gpu_dask.worker.recycling import plain_nbytes


@dataclasses.dataclass
class Holder:
    data: bytes


def test_builtins_numbers_strings_and_their_containers_are_sized_whole():
    assert plain_nbytes(7) > 0
    assert plain_nbytes({"name": ["a", "b"], "n": (1, 2.0)}) > plain_nbytes({})
    assert plain_nbytes(b"x" * 100_000) >= 100_000
    assert plain_nbytes([b"x" * 1000] * 50) >= 50_000  # every item counted, none sampled


def test_numpy_numbers_count_their_bytes_and_object_arrays_are_not_plain():
    assert plain_nbytes(np.zeros(1000)) == 8000
    assert plain_nbytes(np.float32(1)) == 4
    assert plain_nbytes(np.array([None, 1])) is None


def test_an_exception_is_plain_as_far_as_its_arguments_are():
    assert plain_nbytes(ValueError("boom")) > 0
    assert plain_nbytes(ValueError(Holder(b""))) is None


def test_an_object_dask_would_size_as_its_shell_is_not_plain_even_deep_in_a_list():
    assert plain_nbytes(Holder(b"x" * 10_000_000)) is None
    assert plain_nbytes([1] * 99 + [Holder(b"")]) is None


def test_a_value_of_more_objects_than_the_walk_allows_is_not_sized():
    assert plain_nbytes(list(range(100)), nodes=50) is None
    assert plain_nbytes(list(range(100)), nodes=200) is not None
