"""Which files, paired how, read how: file tables, remote storage, inflate, seek points, the index, readahead."""
