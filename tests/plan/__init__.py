"""Tests of stoker.plan."""
