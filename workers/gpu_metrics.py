"""GPU telemetry for /metrics: torch's own memory accounting and NVML's utilisation counters.

On a machine without NVIDIA GPUs (or without the NVML library) these series are absent, never an
error: the collector yields nothing. With a GPU they answer "is the GPU starved, and why": SM
utilisation and memory-bandwidth utilisation beside the model busy ratio and the worker's CPU time,
PCIe and NVLink throughput for a bus that idles.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector


def _nvml() -> Any | None:
    try:
        import pynvml  # type: ignore[import-not-found,import-untyped,unused-ignore]  # no stubs

        pynvml.nvmlInit()
        return pynvml
    except Exception:  # no library, no driver, no device: no series
        return None


def nvml_handle(nv: Any, device: str) -> Any | None:
    """NVML's handle for the GPU torch calls `device`. Not by index: NVML ignores CUDA_VISIBLE_DEVICES
    and orders by PCI bus, torch counts the visible devices in CUDA's order. By UUID, else PCI bus id."""
    import torch

    index = int(device.split(":", 1)[1]) if ":" in device else torch.cuda.current_device()
    properties = torch.cuda.get_device_properties(index)
    uuid = getattr(properties, "uuid", None)
    if uuid is not None:
        try:
            return nv.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}")
        except Exception:
            pass
    try:
        domain, bus_id, slot = (getattr(properties, f"pci_{part}_id") for part in ("domain", "bus", "device"))
        bus = f"{domain:08X}:{bus_id:02X}:{slot:02X}.0"
        return nv.nvmlDeviceGetHandleByPciBusId(bus)
    except Exception:
        return None


class GpuCollector(Collector):
    def __init__(self, device: str) -> None:
        self.device = device
        self._nvml = _nvml() if device.startswith("cuda") else None
        self._handle = nvml_handle(self._nvml, device) if self._nvml is not None else None

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield from self._torch_memory()
        yield from self._nvml_series()

    def _torch_memory(self) -> Iterator[GaugeMetricFamily]:
        if not self.device.startswith("cuda"):
            return
        import torch

        if not torch.cuda.is_available():
            return
        for name, value, doc in (
            ("allocated", torch.cuda.memory_allocated(self.device), "held by tensors"),
            ("reserved", torch.cuda.memory_reserved(self.device), "reserved by the caching allocator"),
            ("peak", torch.cuda.max_memory_allocated(self.device), "peak allocated since start"),
        ):
            family = GaugeMetricFamily(f"mrc_gpu_memory_{name}_bytes", f"GPU memory {doc} (torch)")
            family.add_metric([], float(value))
            yield family

    def _nvml_series(self) -> Iterator[GaugeMetricFamily]:
        nv, handle = self._nvml, self._handle
        if nv is None or handle is None:
            return
        try:
            rates = nv.nvmlDeviceGetUtilizationRates(handle)
        except Exception:
            return
        for name, value, doc in (
            ("sm_utilization_ratio", rates.gpu / 100, "share of time a kernel ran (NVML)"),
            (
                "memory_bandwidth_utilization_ratio",
                rates.memory / 100,
                "share of time memory was read or written",
            ),
        ):
            family = GaugeMetricFamily(f"mrc_gpu_{name}", doc)
            family.add_metric([], value)
            yield family
        for direction, counter in (("rx", "NVML_PCIE_UTIL_RX_BYTES"), ("tx", "NVML_PCIE_UTIL_TX_BYTES")):
            try:
                kib = nv.nvmlDeviceGetPcieThroughput(handle, getattr(nv, counter))
            except Exception:
                continue
            family = GaugeMetricFamily(
                f"mrc_gpu_pcie_{direction}_bytes_per_second", f"PCIe {direction} (NVML)"
            )
            family.add_metric([], kib * 1024.0)
            yield family
        try:
            links = nv.NVML_NVLINK_MAX_LINKS
            active = sum(1 for link in range(links) if nv.nvmlDeviceGetNvLinkState(handle, link))
        except Exception:
            return
        family = GaugeMetricFamily("mrc_gpu_nvlink_active_links", "Active NVLink links (NVML)")
        family.add_metric([], float(active))
        yield family
