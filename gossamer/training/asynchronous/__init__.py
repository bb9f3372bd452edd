"""async mode: every worker's change applied on the shards as it arrives, bounded by `staleness`."""
