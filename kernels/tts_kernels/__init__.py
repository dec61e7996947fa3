"""GPU kernels for the fast engine. None yet: they come with the engine issues."""
