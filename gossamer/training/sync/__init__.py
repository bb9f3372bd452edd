"""sync mode: every current worker's gradient each step, averaged on the shards under a barrier (BSP)."""
