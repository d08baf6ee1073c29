"""The workloads bench_throughput.py races the system on: the favourable one and those where it may lose."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from scripts import parcels
from tests.support import imagegen

SHORT = "Refund?"
PROMPT = "The parcel arrived crushed and the label is torn. Can I get a refund?"
LONG = (
    "I ordered a ceramic vase three weeks ago. The box in this photo is how it arrived: the corner is "
    "crushed, the tape was cut and re-taped, and the packing slip inside lists a different order number. "
    "Is the damage visible here consistent with rough handling in transit, and should I ask for a refund "
    "or a replacement?"
)
MIXED_SIZES = (
    ("photo", 640, 480),
    ("photo", 1024, 1024),
    ("screenshot", 1920, 1080),
    ("photo", 1600, 1200),
    ("photo", 4032, 3024),
)
PHOTOS_1MP = (("photo", 1024, 768), ("photo", 1024, 1024), ("photo", 768, 1024), ("photo", 1280, 720))
# Four sizes from 0.3 to 2 MP, and what a nightly backlog asks of every photo (the parcels questions).
PHOTOS_03_2MP = (("photo", 640, 480), ("photo", 1024, 768), ("photo", 1280, 960), ("photo", 1600, 1200))
QUESTIONS = (
    "What colour is the parcel?",
    "Is the parcel damaged?",
    "What is written on the label?",
    "Summarise the parcel's state for the claims team.",
)


@dataclass(frozen=True)
class Workload:
    name: str
    images: tuple[tuple[str, int, int], ...]  # (kind, width, height), cycled over the jobs
    prompts: tuple[str, ...]  # cycled, offset from the images so pairs vary
    max_new: tuple[int, ...]  # cycled
    trickle_per_s: float = 0.0  # 0: every job at once; else one job every 1/rate seconds
    distinct_images: int = 8  # images made per workload (making 12 MP JPEGs takes seconds each)
    # > 0: every photo is asked that many of the prompts (each a different one), the jobs shuffled
    # (a seeded order: a hit must not depend on a photo's questions arriving together).
    per_photo: int = 0

    @property
    def image_count(self) -> int:
        return self.distinct_images if self.per_photo else min(self.distinct_images, len(self.images) * 4)

    def job(self, i: int) -> tuple[int, str, int]:
        """(image index, prompt, max_new_tokens) of job i."""
        if self.per_photo:
            pairs = [(n, q) for n in range(self.distinct_images) for q in range(self.per_photo)]
            random.Random(38).shuffle(pairs)
            n, q = pairs[i % len(pairs)]
            return n, self.prompts[(n + q) % len(self.prompts)], self.max_new[0]
        return (
            i % min(self.distinct_images, len(self.images) * 4),
            self.prompts[(i // len(self.images)) % len(self.prompts)],
            self.max_new[(i * 7) % len(self.max_new)],
        )

    def make_images(self, work: Path) -> list[Path]:
        paths = []
        for n in range(self.image_count):
            kind, width, height = self.images[n % len(self.images)]
            ext = "png" if kind == "screenshot" else "jpg"
            if kind == "parcel":  # a photo of the parcel world (scripts/parcels.py), any size of it
                data, truth = parcels.make(n, (width, height))
                ext = truth.fmt.lower().replace("jpeg", "jpg")
            elif kind == "screenshot":
                data = imagegen.screenshot(width, height, seed=n)
            else:
                data = imagegen.camera_photo(width, height, seed=n)
            path = work / f"{self.name}-{n}.{ext}"
            path.write_bytes(data)
            paths.append(path)
        return paths


WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        # Today's favourable row: ~1 MP photos, one prompt, 64 new tokens (decode dominates).
        Workload("decode-heavy", PHOTOS_1MP, (PROMPT,), (64,)),
        # Phone photos (12 MP, 4032x3024), full-HD screenshots and small uploads, prompts of three
        # lengths, 16 new tokens: long inputs of unequal length, prefill dominates.
        Workload(
            "prefill-heavy",
            (("photo", 4000, 3000), ("screenshot", 1920, 1080), ("photo", 4032, 3024), ("photo", 320, 240)),
            (SHORT, PROMPT, LONG),
            (16,),
        ),
        # One stream, max_new_tokens from 16 to 256: a long generation must not make its neighbours wait.
        Workload("mixed-new-tokens", PHOTOS_1MP, (PROMPT,), (16, 32, 64, 128, 256)),
        # Several image sizes from 0.3 to 12 MP interleaved (a small upload, a 1 MP photo, a full-HD
        # screenshot, a 2 MP photo, a 12 MP phone photo), prompts of three lengths: every batch mixes
        # widths, so a row must not pay its longest neighbour's. 16 new tokens (prefill dominates)
        # and 64 (decode dominates).
        *(
            Workload(f"mixed-sizes-{new}", MIXED_SIZES, (SHORT, PROMPT, LONG), (new,), distinct_images=10)
            for new in (16, 64)
        ),
        # Jobs one by one, below capacity: what an interactive ticket waits (p50, p99), not jobs/s.
        Workload("trickle", PHOTOS_1MP, (PROMPT,), (64,), trickle_per_s=2.0),
        # A nightly backlog's several questions per photo: 12 photos of four sizes (0.3-2 MP), four
        # questions each, shuffled, 16 new tokens. Prefill dominates, and most of it is the photo.
        Workload("photo-questions", PHOTOS_03_2MP, QUESTIONS, (16,), distinct_images=12, per_photo=4),
        # The same jobs' shapes with every question about a different photo: what a miss costs.
        Workload("photo-questions-miss", PHOTOS_03_2MP, QUESTIONS, (16,), distinct_images=48, per_photo=1),
    )
}

# For `bench_throughput.py --model parcels`: the parcels model's own questions about its own photos,
# where its answers are confident, so the system's and the naive pipeline's answers must be the same.
PARCELS = Workload(
    "parcels",
    (("parcel", 1024, 768), ("parcel", 640, 480), ("parcel", 400, 800), ("parcel", 320, 240)),
    tuple(q for qs in parcels.QUESTIONS.values() for q in qs),
    (2,),
)
