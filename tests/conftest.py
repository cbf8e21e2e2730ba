"""Every test runs with implicit rank promotion an error, as JAX's own test base does.

The library promises to be rank-promotion clean (no array silently broadcast against one of
lower rank); the environment variable carries the setting into the programs tests start.
"""

import os

import jax

os.environ["JAX_NUMPY_RANK_PROMOTION"] = "raise"
jax.config.update("jax_numpy_rank_promotion", "raise")
