"""Tests of stoker.io."""
