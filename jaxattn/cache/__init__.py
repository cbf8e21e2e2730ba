"""The KV cache: what each attention layer keeps per token, in a dense cache or in pages.

* `jaxattn.cache.containers`: the pytrees (`CacheField`, `KVCache`, `LatentCache`, `DecodeCache`,
  `PagedBatch`, `RowGroup`) and their writes and page gathers;
* `jaxattn.cache.build`: the model's caches built from each layer's declaration (`init_cache`,
  `init_pools`, `cache_bytes_per_token`);
* `jaxattn.cache.int8`: the int8 storage of a cached vector (`QuantizedTokens`).

The package imports none of them, so the kernels can read the int8 storage without the layers
(`init_cache` and the containers are also `jaxattn.init_cache`, `jaxattn.KVCache`, ...).
"""
