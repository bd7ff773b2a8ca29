"""Reading and checking rows: which files (or objects) a source names, bounded row readers, formats and role aliases, bad-row policy, the dataset registry, validation splits."""
