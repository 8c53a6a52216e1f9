"""Tests of the public API objects: stoker.Dataset (dataset.py) and stoker.Loader (loader.py)."""
