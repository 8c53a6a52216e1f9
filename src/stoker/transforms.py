"""The public path of the transforms (:mod:`stoker.engine.transforms`, where the engine fuses and runs them)."""

from .engine.transforms import (
    DEFAULT_SEED,
    Cast,
    Normalize,
    RandomCrop,
    RandomFlip,
    Stage,
    Transform,
    Transformed,
    batch_rng,
    describe_records,
    note_records,
    resolve_dtype,
)

__all__ = [
    "DEFAULT_SEED",
    "Cast",
    "Normalize",
    "RandomCrop",
    "RandomFlip",
    "Stage",
    "Transform",
    "Transformed",
    "batch_rng",
    "describe_records",
    "note_records",
    "resolve_dtype",
]
