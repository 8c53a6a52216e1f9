"""Tests of stoker: tests/<room>/ mirrors src/stoker/<room>/; tests/helpers holds what they share."""
