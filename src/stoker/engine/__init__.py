"""Threads, buffers, prefetch, and decode/cast/transform of records into the batch."""
