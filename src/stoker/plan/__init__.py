"""Which records, in what order: pure index arithmetic over the dataset's geometry (no I/O)."""
