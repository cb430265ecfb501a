"""A real GPU's NVML probe with faults a test can script on top: no test can make a real
GPU sick, so health readings are NVML's own with the fields a test writes laid over them.

Memory, activity and every health reading a test does not script stay the real GPU's:
the guard, its records and the routing around a quarantine run as they would on a sick
GPU. A test writes ``$FAKE_GPU_HEALTH_DIR/gpu-<index>.json`` (``HealthReadings``
fields) for the GPU with that NVML index; from the next check on, it reads as written.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from prefect_gpu_dask.health import HealthReadings, NvmlHealthReader
from prefect_gpu_dask.worker.probe import NvmlProbe
from tests.scripted_probe import HEALTH_DIR_ENV, make_sick, scripted_readings

# The runner's memory_probe for these tests: workers import it by this path.
NVML_WITH_FAULTS = "tests.gpu_faults:nvml_probe_with_scripted_faults"


def fault_file(directory: Path, gpu_index: int) -> Path:
    return directory / f"gpu-{gpu_index}.json"


def make_gpu_sick(directory: Path, gpu_index: int, **readings: object) -> None:
    """Script the GPU with NVML index ``gpu_index`` to read as ``readings`` from its
    next check on."""
    make_sick(directory, fault_file(directory, gpu_index).stem, **readings)


class FaultOverlay:
    """``NvmlHealthReader``'s readings with a test's scripted fields laid over them."""

    def __init__(self, real: NvmlHealthReader, gpu_index: int):
        self.real = real
        self.limits = real.limits
        self.path = fault_file(Path(os.environ.get(HEALTH_DIR_ENV, "/nonexistent")), gpu_index)

    def __call__(self) -> HealthReadings:
        return dataclasses.replace(self.real(), **scripted_readings(self.path))

    def quiet(self) -> bool:
        return not self.path.exists() and self.real.quiet()

    def close(self) -> None:
        self.real.close()


class NvmlProbeWithFaults(NvmlProbe):
    def health_reader(self) -> FaultOverlay:
        return FaultOverlay(super().health_reader(), self.gpu.index)


def nvml_probe_with_scripted_faults() -> NvmlProbeWithFaults:
    return NvmlProbeWithFaults()
