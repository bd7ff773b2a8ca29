"""`dsrecipes shard`: writing, verifying and uploading presharded data (manifest, row formats, store upload)."""
