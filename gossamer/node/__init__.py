"""A node: the agent, its role processes, launcher, heartbeats and warm fork server."""
