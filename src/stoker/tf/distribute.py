"""distributed_dataset: a Dataset spread over every replica of a tf.distribute strategy, each record once."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import tensorflow as tf

from ..errors import SpecError
from .dataset import to_tf

if TYPE_CHECKING:
    from ..dataset import Dataset
    from ..loader import Loader

__all__ = ["distributed_dataset"]


def distributed_dataset(
    strategy: tf.distribute.Strategy,
    ds: Dataset,
    global_batch_size: int,
    *,
    map_func: Callable[[dict[str, tf.Tensor]], Any] | None = None,
    **loader_kwargs: Any,
) -> Any:
    """`ds`'s records spread over every replica of `strategy`, each record once per epoch.

    Built on `strategy.distribute_datasets_from_function`: each input pipeline (one per
    worker) iterates `ds.loader(per_replica_batch, shard=(input_pipeline_id,
    num_input_pipelines), **loader_kwargs).to_tf()`, where `per_replica_batch` is
    `global_batch_size` over `strategy.num_replicas_in_sync`; each worker reads only its own
    shard of every epoch's sequence, which one seed (`loader_kwargs`' `seed`) orders the same
    on every worker. Where the workers are several processes, they compare their loaders'
    configurations (one collective) and raise a SpecError naming what differs (a seed drawn
    per worker, say), which would lose records without a word.

    Args:
        strategy: any `tf.distribute.Strategy` (MultiWorkerMirroredStrategy, MirroredStrategy, ...).
        ds: the Dataset.
        global_batch_size: records per step over all replicas; a multiple of the replicas in sync.
        map_func: applied to each batch in the graph (`Dataset.map`), e.g. `lambda b: (b["image"],
            b["label"])` for Keras' `fit`, which wants `(x, y)`.
        **loader_kwargs: passed to `Dataset.loader` (`shuffle`, `seed`, `cast`,
            `drop_remainder`, `epochs`, ...), all but `shard`, which this sets.

    Returns:
        A `tf.distribute.DistributedDataset`, for a custom loop (`strategy.run`) or Keras' `fit`.

    Example:
        >>> strategy = tf.distribute.MultiWorkerMirroredStrategy()  # doctest: +SKIP
        >>> batches = stoker.tf.distributed_dataset(
        ...     strategy, ds, 512, shuffle="global", seed=7, cast={"image": "float32"}, drop_remainder=True
        ... )  # doctest: +SKIP
        >>> for batch in batches:  # doctest: +SKIP
        ...     strategy.run(train_step, args=(batch,))
    """
    if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int | np.integer):
        raise SpecError(f"{global_batch_size=} must be a positive integer")
    replicas = strategy.num_replicas_in_sync
    if global_batch_size < 1 or global_batch_size % replicas:
        raise SpecError(
            f"{global_batch_size=} must be a positive multiple of the strategy's {replicas} replicas in sync, "
            "so every replica takes the same batch"
        )
    if "shard" in loader_kwargs:
        raise SpecError(
            f"distributed_dataset shards by input pipeline itself; drop shard={loader_kwargs['shard']!r}",
        )
    loaders: list[Loader] = []

    def dataset_fn(context: tf.distribute.InputContext) -> tf.data.Dataset:
        shard = (context.input_pipeline_id, context.num_input_pipelines)
        loader = ds.loader(context.get_per_replica_batch_size(int(global_batch_size)), shard=shard, **loader_kwargs)
        loaders.append(loader)
        dataset = to_tf(loader)
        return dataset if map_func is None else dataset.map(map_func)

    distributed = strategy.distribute_datasets_from_function(dataset_fn)
    if loaders and loaders[0].shard[1] > 1:
        _check_agreement(strategy, loaders[0])
    return distributed


def _check_agreement(strategy: tf.distribute.Strategy, loader: Loader) -> None:
    """A SpecError on every worker whose loader orders an epoch otherwise than the others'.

    Each replica contributes a hash of every part of its loader's fingerprint (the dataset's
    files and counts, shuffle, seed, window, interleave: what orders the epoch's sequence, as
    `state_dict` records it); one gather compares them.
    """
    parts = loader.state_dict()["parts"]
    names = sorted(parts)
    mine = tf.constant([[int(parts[n][:15], 16) for n in names]], tf.int64)  # 60 bits of each part's sha256
    values = strategy.experimental_distribute_values_from_function(lambda _: mine)
    everyone = strategy.gather(values, axis=0).numpy()
    differ = [n for j, n in enumerate(names) if (everyone[:, j] != everyone[0, j]).any()]
    if differ:
        raise SpecError(
            f"distributed_dataset: the workers' loaders differ in {', '.join(differ)} (this worker's: "
            f"{', '.join(f'{n}={_fingerprint_value(loader, n)!r}' for n in differ)}); every worker must order the "
            "epoch alike (one seed for all), or their shards would overlap and leave records out"
        )


def _fingerprint_value(loader: Loader, part: str) -> object:
    """What a part of the loader's fingerprint is, for an error message (its value, or "...")."""
    value = getattr(loader, part, "...")
    return value if isinstance(value, int | str | bool) or value is None else "..."
