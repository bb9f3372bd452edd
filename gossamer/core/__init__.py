"""Shared definitions every layer uses, free of torch: the Experiment, modes, protocol, errors, faults, logs."""
