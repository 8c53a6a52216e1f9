"""Tests of stoker.engine."""
