"""stoker.toml as a format: every key known, checked and documented; the documented examples read."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from stoker.cli import main
from stoker.cli.config import FIELD_KEYS, build_fields, fields_from_config
from tests.helpers import REPO

PAGE = REPO / "docs" / "reference" / "stoker-toml.md"


def _config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "stoker.toml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ('[fields.image]\nfiles = "img_*.bin"\ndtype = "int8"\nheader_byte = 16\n',
         "unknown key 'header_byte' in [fields.image]; did you mean header_bytes?"),
        ('[fields.image]\nfiles = "img_*.bin"\ndtype = "int8"\ncolour = 1\n',
         "unknown key 'colour' in [fields.image]; valid keys: files, dtype, shape, header_bytes, footer_bytes, "
         "compression, byte_order"),
        ('[field.image]\nfiles = "img_*.bin"\ndtype = "int8"\n', "unknown key 'field'; did you mean fields?"),
        ('[fields.image]\nfiles = "img_*.bin"\ndtype = "int8"\nshape = "128x128"\n',
         "[fields.image] shape = '128x128' must be a list of integers"),
        ('[fields.image]\nfiles = "img_*.bin"\ndtype = "int8"\nheader_bytes = true\n',
         "[fields.image] header_bytes = True must be an integer"),
    ],
    ids=["misspelt", "unknown", "top-level", "shape-not-a-list", "bool-not-int"],
)  # fmt: skip
def test_a_key_not_of_the_format_is_an_error_naming_it_the_file_and_the_nearest_key(
    tmp_path: Path, text: str, said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _config(tmp_path, text)
    assert main(["inspect", "--config", str(path)]) == 2
    assert capsys.readouterr().err == f"SpecError: config {str(path)!r}: {said}\n"
    assert main(["inspect", str(tmp_path)]) == 2  # the directory's own stoker.toml alike
    assert said in capsys.readouterr().err


def _examples() -> list[str]:
    return re.findall(r"```toml\n(.*?)```", PAGE.read_text(), flags=re.DOTALL)


def test_the_page_documents_every_key_with_its_type() -> None:
    text = PAGE.read_text()
    for key, (_, said) in FIELD_KEYS.items():
        assert re.search(rf"^\| `{key}` \| {re.escape(said)} \|", text, flags=re.MULTILINE), key


@pytest.mark.parametrize("n", range(3))
def test_each_example_of_the_page_is_read(tmp_path: Path, n: int) -> None:
    examples = _examples()
    assert len(examples) >= 3
    specs = fields_from_config(str(_config(tmp_path, examples[n])))
    fields = build_fields(specs)
    assert fields and all(str(tmp_path) in str(f.files) for f in fields.values())
