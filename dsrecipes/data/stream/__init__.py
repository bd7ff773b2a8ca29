"""data=iterable's stream: per-file block index, the epoch order, who reads which stretch, the reader that opens the files, conversion of arrays/gzip to seekable JSONL, the launching side's scan."""
