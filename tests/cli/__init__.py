"""Tests of stoker.cli."""
