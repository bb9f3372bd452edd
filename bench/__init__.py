"""Benchmarks of gossamer, and the harness they share with the tests (network-namespace hosts, shard pairs, a throwaway PostgreSQL)."""
