"""LoaderConfig is the one declaration of the loader's options: Dataset.loader offers the same
keywords with the same defaults and documents each, and the Loader takes the config whole."""

from __future__ import annotations

import dataclasses
import inspect
import re

import stoker
from stoker.config import LoaderConfig
from stoker.loader import Loader

# Options for adapters (stoker.torch splits a rank's shard among workers; tests bring their own
# engine), not for users: set on a LoaderConfig, not offered by Dataset.loader.
ADAPTER_ONLY = {"even_over", "executor"}


def test_dataset_loader_offers_every_user_option_of_the_config_with_its_default() -> None:
    fields = {f.name: f for f in dataclasses.fields(LoaderConfig)}
    params = dict(inspect.signature(stoker.Dataset.loader).parameters)
    params.pop("self")
    assert params.pop("state").default is None  # where to resume: not an option of the config
    assert set(params) == set(fields) - ADAPTER_ONLY
    for name, param in params.items():
        want = fields[name].default
        if want is dataclasses.MISSING:  # required in both
            assert param.default is inspect.Parameter.empty, name
            continue
        assert param.default == want and type(param.default) is type(want), name
        if name != "batch_size":
            assert param.kind is inspect.Parameter.KEYWORD_ONLY, name


def test_every_option_has_a_docstring_in_the_config_and_a_line_in_dataset_loader() -> None:
    source = inspect.getsource(LoaderConfig)
    doc = inspect.getdoc(stoker.Dataset.loader) or ""
    for field in dataclasses.fields(LoaderConfig):
        declared = source.index(f"    {field.name}: ")
        assert source[declared:].split("\n", 2)[1].lstrip().startswith('"""'), f"{field.name} has no docstring"
        if field.name not in ADAPTER_ONLY:
            assert f"    {field.name}: " in doc, f"Dataset.loader does not document {field.name}"


def test_the_loader_takes_the_config_whole_and_copies_none_of_it() -> None:
    params = list(inspect.signature(Loader.__init__).parameters)
    assert params == ["self", "dataset", "config", "state"]
    source = inspect.getsource(Loader)
    copies = re.findall(r"self\.(\w+) = config\.(\w+)$", source, re.MULTILINE)
    assert copies == []  # `cycle_length = config.cycle_length or default...` resolves, it does not copy


def test_dataset_loader_builds_the_config_its_keywords_say(pair_ds: stoker.Dataset) -> None:
    with pair_ds.loader(4, window=3, threads=1, shuffle="files", seed=2) as loader:
        assert loader.config == LoaderConfig(batch_size=4, window=3, threads=1, shuffle="files", seed=2)
        assert loader.window == 3 and loader.batch_size == 4  # read from the config, not copied
