"""The user's tools: the CLI, the client, the demo, the local cluster, watch, plot and export."""
