"""Running one manifest on more than one device: id-hash shards, one worker process per GPU, Ray Data."""
