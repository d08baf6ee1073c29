"""Models that ship inside the package (package data), loaded through the same from_pretrained code
as Fuyu-8B.

- `parcels/`: a tiny Fuyu (Fuyu-8B's architecture, ~4 M parameters) trained by
  scripts/train_parcels.py on the synthetic parcel photos of scripts/parcels.py; `MRC_MODEL=parcels`.
  It answers what colour the parcel is, whether it is damaged and which digit its label shows
  (docs/contract.md lists the questions; docs/benchmarks.md its accuracy).
"""

from __future__ import annotations

from pathlib import Path

PARCELS_ID = "parcels-fuyu-v1"


def parcels_path() -> Path:
    """The folder of the parcels model (config, tokenizer, processor, weights)."""
    return Path(__file__).resolve().parent / "parcels"
