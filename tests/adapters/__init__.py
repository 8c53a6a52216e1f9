"""Tests of the framework adapters: stoker.tf, stoker.torch, stoker.jax, stoker.ray, stoker.keras."""
