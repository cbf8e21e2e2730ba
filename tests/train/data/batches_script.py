"""Run by tests/train/data/test_batches.py as process PROCESS_ID of 2, each with 2 host devices, joined at
COORDINATOR: reads a chunk of training batches of a prepared corpus DIR on a data:4 mesh and prints,
as one JSON object, which windows this process read and the assembled global array.

    python tests/train/data/batches_script.py COORDINATOR PROCESS_ID DIR
"""

import json
import sys

import jax

jax.config.update("jax_num_cpu_devices", 2)
jax.config.update("jax_cpu_collectives_implementation", "gloo")

import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

from jaxattn.config import ModelConfig  # noqa: E402
from train.config import ExperimentConfig, RuntimeConfig, TrainConfig  # noqa: E402
from train.data.batches import RunBatches, ShardStream  # noqa: E402
from train.data.corpus import open_corpus  # noqa: E402
from train.data.shards import open_prepared  # noqa: E402
from train.run import runtime as runtime_lib  # noqa: E402
from train.run.steps import build_programs  # noqa: E402

FIRST, LAST = 3, 6  # the chunk of training steps read


class Recording(ShardStream):
    """A shard stream that remembers the window starts this process asked it for."""

    def windows(self, starts, length):
        self.read_starts = np.asarray(starts).tolist()
        return super().windows(starts, length)


def main(coordinator: str, process_id: int, directory: str) -> None:
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=2, process_id=process_id,
                               initialization_timeout=60)
    corpus = open_corpus(directory)
    tc = TrainConfig(batch_size=8, block_size=16)
    config = ExperimentConfig(name="rows", model=ModelConfig(vocab_size=65, d_model=16, num_layers=1, num_heads=2,
                                                             max_seq_len=16), train=tc,
                              runtime=RuntimeConfig(mesh="data:4", attention="xla", matmul="xla"))
    runtime = runtime_lib.resolve(config.runtime, tc.batch_size, devices=4, model=config.model)
    programs = build_programs(config, runtime)
    train = Recording.of_maps(open_prepared(directory).train)
    batches = RunBatches(train, corpus.val, tc, programs.layout.windows, programs.eval_rows)
    chunk = batches.train_chunk(FIRST, LAST)
    print(json.dumps({"process": jax.process_index(), "read_starts": train.read_starts,
                      "global": np.asarray(multihost_utils.process_allgather(chunk, tiled=True)).tolist()}))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
