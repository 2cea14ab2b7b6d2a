"""Checkpoints: the files, directories and objects a run saves and loads (one-file, sharded, DCP, S3, asynchronous), the
random state they carry, and the weights a run starts from."""
