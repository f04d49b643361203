"""Model profiles (occupancy, load and inference time per GPU type) and the paper's Table I."""

from __future__ import annotations

import csv
from dataclasses import dataclass
from importlib import resources

from gpufaas.types import ModelSpec


@dataclass(frozen=True, slots=True)
class ModelProfile:
    """What one model costs on one GPU type: measured once, refined online by the estimator."""

    model: str
    gpu_type: str
    memory_mb: int
    load_time_s: float
    inference_time_s: float
    batch_size: int

    def spec(self) -> ModelSpec:
        return ModelSpec(name=self.model, memory_mb=self.memory_mb)


def paper_table1() -> list[ModelProfile]:
    """The 22 torchvision models of the LALB paper's Table I (RTX 2080, batch size 32), smallest first."""
    text = resources.files("gpufaas.data").joinpath("paper_table1.csv").read_text(encoding="utf-8")
    rows = csv.DictReader(line for line in text.splitlines() if not line.startswith("#"))
    profiles = [
        ModelProfile(
            model=row["model"],
            gpu_type=row["gpu_type"],
            memory_mb=int(row["memory_mb"]),
            load_time_s=float(row["load_time_s"]),
            inference_time_s=float(row["inference_time_s"]),
            batch_size=int(row["batch_size"]),
        )
        for row in rows
    ]
    return sorted(profiles, key=lambda p: (p.memory_mb, p.model))
