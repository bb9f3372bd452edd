"""The training loops of one rank and the modes' algorithms over them."""
