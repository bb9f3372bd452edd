"""DiLoCo: `inner_steps` local steps, then an outer step on the round's change (on the shards, or by gossip)."""
