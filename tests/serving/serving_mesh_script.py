"""Run by tests/serving/test_serving.py in a fresh process with 4 host devices (the count is fixed when JAX
starts): the engine on meshes with tensor parallelism over heads (its pools split over kv heads)
and on one device, the same greedy requests; prints each run's tokens, the pools' layout and a
check of how the pools are split as one JSON object."""

import json
import sys

import jax

jax.config.update("jax_num_cpu_devices", 4)

import numpy as np  # noqa: E402

from jaxattn import Kernels  # noqa: E402
from jaxattn.axes import MeshShape, make_mesh  # noqa: E402
from jaxattn.serving import Engine, EngineConfig, SamplingParams  # noqa: E402
from tiny_models import drawn_params, tiny_config  # noqa: E402

MESHES = ("tensor:2", "data:2,tensor:2")


def run(config, params, mesh):
    engine = Engine(params, config, EngineConfig(max_seqs=4, page_size=4, chunk=8, prefill_rows=2, num_pages=24),
                    kernels=Kernels(paged=sys.argv[1] if len(sys.argv) > 1 else "gather"), mesh=mesh)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, config.vocab_size, n).tolist() for n in (5, 19, 2, 11, 27, 8)]
    outputs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8))
    engine.allocator.check_all_free()
    split = [str(engine.pools[0].k.sharding.spec)] if mesh is not None else []
    return outputs, split


def main():
    config = tiny_config("gqa", positions="rope", vocab_size=32, max_seq_len=48)
    params = drawn_params(config, seed=3, std=0.4)
    result = {"one_device": run(config, params, None)[0]}
    for name in MESHES:
        shape = MeshShape.parse(name)
        outputs, split = run(config, params, make_mesh(shape, jax.devices()[:shape.size]))
        result[name] = {"tokens": outputs, "pool_spec": split}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
