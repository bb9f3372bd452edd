"""What the modes with parameter-server shards share: the shard client's trainer and the train function's."""
