"""CUDA-only checks of the real loader; skipped where no GPU is present (CI, the dev machines)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shared.settings import Settings
from workers.backends.base import GenerationInput
from workers.backends.fuyu import FuyuBackend

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
HOME = str(Path(__file__).resolve().parents[2] / ".cache" / "mrc")


@pytest.mark.parametrize("quantization", ["nf4", "bf16"])
def test_tiny_fuyu_on_cuda_matches_batch_and_single(quantization: str) -> None:
    backend = FuyuBackend(Settings(model="tiny", home=HOME, quantization=quantization, device="cuda"))
    backend.load()
    assert backend.describe()["device"] == "cuda"
    items = [
        GenerationInput(torch.full((3, 200, 300), 200, dtype=torch.uint8), "what colour?", 6),
        GenerationInput(torch.full((3, 900, 1200), 90, dtype=torch.uint8), "is it broken", 6),
    ]
    assert backend.generate(items) == [backend.generate([i])[0] for i in items]


@pytest.mark.parametrize("orientation", range(1, 9))
def test_cuda_decode_applies_exif_orientation_like_the_cpu(orientation: int) -> None:
    """nvjpeg ignores EXIF orientation; the worker orients after decoding, on every device alike."""
    import io

    from PIL import Image

    from tests.support import imagegen
    from workers import images

    img = Image.open(io.BytesIO(imagegen.camera_photo(640, 480))).convert("RGB")
    exif = Image.Exif()
    exif[0x0112] = orientation
    out = io.BytesIO()
    img.save(out, format="JPEG", quality=92, exif=exif.tobytes())
    encoded = images.inspect(out.getvalue(), 40_000_000)
    on_cpu = images.decode(encoded, "cpu").tensor
    on_gpu = images.decode(encoded, "cuda").tensor
    assert on_gpu.is_cuda
    assert on_gpu.shape == on_cpu.shape == (3, encoded.height, encoded.width)
    # nvjpeg and libjpeg-turbo use different IDCTs: within 2 levels on average, never a rotation off.
    assert (on_gpu.cpu().float() - on_cpu.float()).abs().mean().item() <= 2.0


def test_a_jpeg_cut_short_is_refused_on_cuda_as_on_the_cpu() -> None:
    """The CPU decoder refuses a JPEG whose data stops early, end marker or not (libjpeg's other users
    decode the missing rows grey), and a progressive one cut at a scan's end (no decoder warns of it).
    Whether nvjpeg says so too has never been measured."""
    import io

    from PIL import Image

    from shared.errors import ImageDecodeError
    from tests.support import imagegen
    from workers import images

    whole = imagegen.camera_photo(640, 480)
    progressive = io.BytesIO()
    Image.open(io.BytesIO(whole)).save(progressive, format="JPEG", progressive=True)
    at_a_scans_end = progressive.getvalue()[: progressive.getvalue().rindex(b"\xff\xda")] + b"\xff\xd9"
    for cut in (whole[: len(whole) // 2], whole[: len(whole) // 2] + b"\xff\xd9", at_a_scans_end):
        encoded = images.inspect(cut, 40_000_000)
        for device in ("cpu", "cuda"):
            with pytest.raises(ImageDecodeError):
                images.decode(encoded, device)


def test_gpu_telemetry_series_exist_on_a_gpu() -> None:
    """torch's memory accounting always; NVML's utilisation where the driver's library loads."""
    from workers.gpu_metrics import GpuCollector

    torch.zeros(1024, device="cuda")
    names = {family.name for family in GpuCollector("cuda:0").collect()}
    assert {
        "mrc_gpu_memory_allocated_bytes",
        "mrc_gpu_memory_reserved_bytes",
        "mrc_gpu_memory_peak_bytes",
    } <= names
    assert "mrc_gpu_sm_utilization_ratio" in names, "NVML did not load on a CUDA machine"


def test_nvml_reads_the_gpu_torch_runs_on() -> None:
    """NVML orders GPUs by PCI bus and ignores CUDA_VISIBLE_DEVICES; the collector must not read
    another GPU's counters than the one the model is on."""
    import pynvml

    from workers.gpu_metrics import nvml_handle

    pynvml.nvmlInit()
    for index in range(torch.cuda.device_count()):
        handle = nvml_handle(pynvml, f"cuda:{index}")
        assert handle is not None
        uuid = pynvml.nvmlDeviceGetUUID(handle)
        uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
        assert uuid == f"GPU-{torch.cuda.get_device_properties(index).uuid}"


@pytest.mark.parametrize("orientation", [1, 6])
@pytest.mark.parametrize(("fmt", "size"), [("PNG", (1600, 1200)), ("JPEG", (2500, 1)), ("PNG", (2500, 1))])
def test_patches_on_cuda_do_not_depend_on_the_decoded_layout(
    fmt: str, size: tuple[int, int], orientation: int
) -> None:
    """What a GPU worker decodes on its CPU (PNG) reaches the device pixel by pixel, and what nvjpeg
    decodes (JPEG), turned by its EXIF, has whatever strides the turn gives (a one-row photo's were
    what the CPU's resize once read out of bounds): the patches made on the device from either equal
    those made from a plane-by-plane copy of the same pixels."""
    import io

    from PIL import Image

    from workers import images
    from workers.backends.fuyu_preprocess import pixels_of

    img = Image.new("RGB", size)
    img.putdata([(n % 251, (7 * n) % 253, (13 * n) % 255) for n in range(size[0] * size[1])])
    exif = Image.Exif()
    exif[0x0112] = orientation
    out = io.BytesIO()
    img.save(out, format=fmt, exif=exif.tobytes(), **({"quality": 95} if fmt == "JPEG" else {}))
    decoded = images.decode(images.inspect(out.getvalue(), 40_000_000), "cuda").tensor.to("cuda")
    plain = decoded.contiguous().clone()
    for _ in range(3):  # an out-of-bounds read shows as patches that differ from run to run
        made = pixels_of(decoded, torch.float32, 480)
        assert torch.equal(made.values, pixels_of(plain, torch.float32, 480).values)
