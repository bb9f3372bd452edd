"""The engine of one rank: layouts, flat parameters, model and loss, batches, loaders, process groups."""
