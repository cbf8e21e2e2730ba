"""Training and evaluation batches, read on the host: each process reads only its rows of the global batch.

A batch is a pure function of (seed, split, step). The B window starts of a step are drawn
with `jax.random` from `batch_key(seed, split, step)` on this host's CPU (`draw_starts`):
every process draws the same B starts, reads only the rows its devices hold (`local_rows`), and
the global `[n, B, T + 1]` array of a chunk of n steps is assembled with
`jax.make_array_from_process_local_data`. So the batches do not depend on the mesh or the number
of processes, and a resumed run replays exactly the batches of an uninterrupted one.

A split is a token stream: in memory (`ArrayStream`: a text file tokenized when the run starts)
or a prepared directory's shards (`ShardStream`, `train.data.shards`). Shards are read with positioned
reads (`os.pread`), not through a memory map: the pages of a map that a run touches count toward
the process's resident memory, which on a long run over a large corpus would grow toward the
file's size, while the page cache that `pread` fills is the kernel's to drop. A window may
cross from one shard into the next. Every id read from a shard is checked against the vocabulary
(one max over what was read): a damaged shard is a `DataError` naming it, not a NaN loss.

Whole-split evaluation predicts every token of a split once (`whole_split_windows`, weighted by
`target_weights`).

`Feed` reads the chunks of a run ahead in a thread and measures how long training waited for them.
"""

from __future__ import annotations

import functools
import os
import queue
import threading
import time
from typing import Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from train.data.errors import DataError

TRAIN, VAL = 0, 1  # split ids folded into the batch rng
RANDINT_SPAN = 2**31 - 1  # the largest span jax.random.randint's int32 draws cover
EVAL_SPLITS = {"train": 2, "val": 3}  # split ids of the fixed evaluation batches (0, 1: training batches)
EVAL_CHUNK_TOKENS = 1 << 22  # whole-split evaluation reads about this many tokens at a time


def batch_key(seed: int | jax.Array, split: int, step: int | jax.Array) -> jax.Array:
    """The rng of batch `step` of `split`: a pure function of (seed, split, step)."""
    key = jax.random.fold_in(jax.random.PRNGKey(seed), split)
    return jax.random.fold_in(key, step)


class ArrayStream:
    """A split held in memory: `tokens` `[N]` (any integer dtype)."""

    def __init__(self, tokens: np.ndarray):
        self.tokens = np.asarray(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def windows(self, starts: np.ndarray, length: int) -> np.ndarray:
        """The windows `[..., length]` (int32) beginning at `starts` `[...]`."""
        return self.tokens[np.asarray(starts, np.int64)[..., None] + np.arange(length)].astype(np.int32)


class ShardStream:
    """A split stored as shards, read with `os.pread`: the concatenation of `shards` in order.

    Args:
      shards: `(path, offset of the first token in bytes, token count, dtype)` of each shard.
      vocab_size: the ids lie below it: a read that finds one that does not is a DataError naming the
        shard (None: not checked).
    """

    def __init__(self, shards: Sequence[tuple[str | os.PathLike, int, int, np.dtype]], vocab_size: int | None = None):
        if not shards:
            raise ValueError("a ShardStream needs at least one shard")
        self.vocab_size = vocab_size
        self.paths = [os.fspath(p) for p, *_ in shards]
        self.offsets = [int(o) for _, o, _, _ in shards]
        self.dtypes = [np.dtype(d) for *_, d in shards]
        self.ends = np.cumsum([int(n) for _, _, n, _ in shards])  # stream index where each shard ends
        self._fds: list[int] | None = None

    @classmethod
    def of_maps(cls, maps: Iterable[np.memmap], vocab_size: int | None = None) -> "ShardStream":
        """The stream of memory-mapped shards (`train.data.shards.PreparedCorpus.train`), read without the maps."""
        return cls([(m.filename, m.offset, len(m), m.dtype) for m in maps], vocab_size)

    def __len__(self) -> int:
        return int(self.ends[-1])

    def _open(self) -> list[int]:
        if self._fds is None:
            self._fds = [os.open(p, os.O_RDONLY) for p in self.paths]
        return self._fds

    def read(self, start: int, count: int) -> np.ndarray:
        """Tokens `[start, start + count)` of the stream as int32, across shard boundaries; DataError
        naming the shard for an id past the vocabulary."""
        if not 0 <= start <= start + count <= len(self):
            raise ValueError(f"tokens [{start}, {start + count}) lie outside a stream of {len(self)}")
        fds, out, at = self._open(), np.empty(count, np.int32), 0
        shard = int(np.searchsorted(self.ends, start, side="right"))
        while at < count:
            first = start + at - (int(self.ends[shard - 1]) if shard else 0)  # index within the shard
            take = min(count - at, int(self.ends[shard]) - (start + at))
            size = self.dtypes[shard].itemsize
            raw = os.pread(fds[shard], take * size, self.offsets[shard] + first * size)
            if len(raw) != take * size:
                raise DataError(f"shard {self.paths[shard]} ended early: it was truncated while the run read it")
            ids = np.frombuffer(raw, self.dtypes[shard])  # unsigned: no id lies below 0
            if self.vocab_size is not None and take and int(ids.max()) >= self.vocab_size:
                self._past_the_vocabulary(shard, first, ids)
            out[at:at + take] = ids
            at, shard = at + take, shard + 1
        return out

    def _past_the_vocabulary(self, shard: int, first: int, ids: np.ndarray) -> None:
        where = int(np.argmax(ids >= self.vocab_size))
        raise DataError(f"shard {self.paths[shard]} holds token id {int(ids[where])} (token {first + where} of the "
                        f"shard), past its vocabulary of {self.vocab_size} ids: the shard is damaged (prepare the "
                        "corpus again with python -m train.prepare)")

    def windows(self, starts: np.ndarray, length: int) -> np.ndarray:
        """The windows `[..., length]` (int32) beginning at `starts` `[...]`."""
        starts = np.asarray(starts, np.int64)
        flat = [self.read(int(s), length) for s in starts.reshape(-1)]
        return np.stack(flat).reshape(*starts.shape, length) if flat else np.zeros((*starts.shape, length), np.int32)

    def close(self) -> None:
        for fd in self._fds or ():
            os.close(fd)
        self._fds = None


TokenStream = ArrayStream | ShardStream


def as_stream(split) -> TokenStream:
    """A split as a stream: streams pass through, arrays are held in memory."""
    return split if isinstance(split, (ArrayStream, ShardStream)) else ArrayStream(np.asarray(split))


@functools.lru_cache(maxsize=8)
def _draw_program(seed: int, rows: int, wide: bool) -> Callable:
    """The jitted draw of `rows` starts in [0, span) for each of a vector of steps of a split."""
    def draw(split, steps, span):
        keys = jax.vmap(lambda step: batch_key(seed, split, step))(steps)
        if not wide:  # exactly what jax.random.randint(key, (rows,), 0, span) draws for a Python int span
            return jax.vmap(lambda key: jax.random.randint(key, (rows,), 0, span))(keys)
        return jax.vmap(lambda key: jax.random.bits(key, (2, rows), jnp.uint32))(keys)  # [n, 2, rows]
    return jax.jit(draw)


def draw_starts(seed: int, split: int, steps: Sequence[int] | np.ndarray, rows: int, span: int) -> np.ndarray:
    """Window starts `[len(steps), rows]` (int64) in [0, span) of `split`'s batches `steps`.

    While `span` fits an int32 draw these are `jax.random.randint(batch_key(seed, split, step),
    (rows,), 0, span)`; from 2**31 on, a 64-bit number from two 32-bit draws of the same key,
    reduced modulo `span` (a bias below 2**-32). Drawn on this host's CPU, whatever the accelerator.
    """
    if span < 1:
        raise ValueError(f"span must be at least 1, got {span}")
    wide = span > RANDINT_SPAN
    cpu = jax.local_devices(backend="cpu")[0]
    args = jax.device_put((np.int32(split), np.asarray(steps, np.int32), np.int32(0 if wide else span)), cpu)
    drawn = np.asarray(_draw_program(int(seed), int(rows), wide)(*args))
    if not wide:
        return drawn.astype(np.int64)
    high, low = drawn[:, 0].astype(np.uint64), drawn[:, 1].astype(np.uint64)
    return (((high << np.uint64(32)) | low) % np.uint64(span)).astype(np.int64)


def local_rows(sharding: NamedSharding, global_shape: tuple[int, ...], axis: int) -> slice:
    """The rows along `axis` of a `global_shape` array that this process's devices hold, as one slice.

    ValueError when they are not one contiguous block (a mesh whose devices interleave processes
    along the batch axis), which `jax.make_array_from_process_local_data` could not assemble.
    """
    spans = sorted({(index[axis].start or 0, global_shape[axis] if index[axis].stop is None else index[axis].stop)
                    for index in sharding.addressable_devices_indices_map(global_shape).values()})
    for (_, stop), (start, _) in zip(spans, spans[1:]):
        if start != stop:
            raise ValueError(f"process {jax.process_index()} holds rows {spans} of axis {axis} of {global_shape}: "
                             "not one contiguous block (order the mesh's devices by process)")
    return slice(spans[0][0], spans[-1][1])


def read_rows(stream: TokenStream, starts: np.ndarray, length: int, sharding: NamedSharding) -> jax.Array:
    """The global array `[n, R, length]` of the windows at `starts` `[n, R]`, laid out by `sharding`:
    this process reads only the rows (axis 1) its devices hold."""
    shape = (*starts.shape, length)
    rows = local_rows(sharding, shape, 1)
    local = stream.windows(starts[:, rows], length)  # [n, rows of this process, length]
    return jax.make_array_from_process_local_data(sharding, local, shape)


def place_rows(array: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """A host array `[n, R, ...]` that every process holds whole, laid out by `sharding` from each
    process's rows (axis 1)."""
    rows = local_rows(sharding, array.shape, 1)
    return jax.make_array_from_process_local_data(sharding, array[:, rows], array.shape)


def whole_split_windows(num_tokens: int, block_size: int, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """Windows that predict every token of a split once: starts `[batches, rows]` and, per window, the
    first of its `block_size` targets that counts `[batches, rows]` (`target_weights` makes the weights).

    Windows begin at 0, T, 2T, ... (every target counts); the tokens after the last whole window are
    predicted by one more window ending at the split's end, counting only those. Padding windows (start
    0, no target counts) fill the last row group. The weighted mean of the losses is the split's loss
    over its `num_tokens - 1` targets.
    """
    if num_tokens <= block_size:
        raise ValueError(f"a split of {num_tokens} tokens has no window of block_size={block_size} + 1")
    starts = np.arange(0, num_tokens - block_size, block_size, dtype=np.int64)
    counted_from = np.zeros(len(starts), np.int64)
    left = num_tokens - 1 - (int(starts[-1]) + block_size)  # targets after the last whole window
    if left > 0:
        starts = np.append(starts, num_tokens - 1 - block_size)
        counted_from = np.append(counted_from, block_size - left)
    pad = -len(starts) % rows
    starts = np.append(starts, np.zeros(pad, np.int64))
    counted_from = np.append(counted_from, np.full(pad, block_size, np.int64))
    return starts.reshape(-1, rows), counted_from.reshape(-1, rows)


def target_weights(counted_from: np.ndarray, block_size: int) -> np.ndarray:
    """Weights `[..., block_size]` (float32): 1 for the targets from `counted_from` `[...]` on, else 0."""
    return (np.arange(block_size) >= np.asarray(counted_from)[..., None]).astype(np.float32)


class RunBatches:
    """The batches of one run: the windows of each training chunk and the evaluation inputs.

    Args:
      train, val: the splits (streams, or arrays held in memory).
      tc: the run's `TrainConfig` (seed, batch_size B, block_size T, eval_iters, eval_whole_val).
      windows: `rows -> NamedSharding` of `[n, rows, T + 1]` windows (`train.run.steps.StateLayout.windows`).
      eval_rows: R of whole-split evaluation.

    Training batch `step` is `draw_starts(seed, TRAIN, [step], B, len(train) - T)`; the fixed
    evaluation batches of a split are its steps 0 .. eval_iters - 1 under the split id of
    `EVAL_SPLITS` (read once); whole-split evaluation (`whole_split_windows`) is read
    in chunks of about EVAL_CHUNK_TOKENS tokens at each evaluation.
    """

    packed = False  # its batches are windows `[n, B, T + 1]` (`train.data.packed_batches` is the other kind)

    def __init__(self, train, val, tc, windows: Callable[[int], NamedSharding], eval_rows: int):
        self.streams = {"train": as_stream(train), "val": as_stream(val)}
        self.tc, self.sharding, self.eval_rows = tc, windows, eval_rows
        self._fixed: dict[str, tuple] = {}

    def close(self) -> None:
        """Closes the shard files (a run's end)."""
        for stream in self.streams.values():
            if isinstance(stream, ShardStream):
                stream.close()

    def train_chunk(self, first: int, last: int) -> jax.Array:
        """The windows `[last - first, B, T + 1]` of training steps first .. last - 1."""
        tc, stream = self.tc, self.streams["train"]
        starts = draw_starts(tc.seed, TRAIN, np.arange(first, last), tc.batch_size, len(stream) - tc.block_size)
        return read_rows(stream, starts, tc.block_size + 1, self.sharding(tc.batch_size))

    def eval_shapes(self) -> set[tuple[int, int]]:
        """The (batches, rows) of every evaluation input, for compiling ahead."""
        shapes = {(self.tc.eval_iters, self.tc.batch_size)}
        if self.tc.eval_whole_val:
            starts, _ = whole_split_windows(len(self.streams["val"]), self.tc.block_size, self.eval_rows)
            shapes.add((self._chunk_batches(len(starts)), self.eval_rows))
        return shapes

    def _chunk_batches(self, batches: int) -> int:
        return min(batches, max(1, EVAL_CHUNK_TOKENS // (self.eval_rows * (self.tc.block_size + 1))))

    def evaluate(self, losses: Callable[[jax.Array, jax.Array], jax.Array]) -> dict[str, float]:
        """{'train', 'val'}: the mean loss of each split's evaluation, from `losses(windows, weights)`
        -> the weighted loss sum of each batch."""
        out = {}
        for split in ("train", "val"):
            total, count = 0.0, 0.0
            for windows, weights, n in self._eval_inputs(split):
                total += float(np.sum(np.asarray(losses(windows, weights), np.float64)))
                count += n
            out[split] = total / count
        return out

    def _eval_inputs(self, split: str):
        if split == "val" and self.tc.eval_whole_val:
            yield from self._whole_split(self.streams["val"])
            return
        if split not in self._fixed:
            tc, stream = self.tc, self.streams[split]
            starts = draw_starts(tc.seed, EVAL_SPLITS[split], np.arange(tc.eval_iters), tc.batch_size,
                                 len(stream) - tc.block_size)
            weights = np.ones((*starts.shape, tc.block_size), np.float32)
            sharding = self.sharding(tc.batch_size)
            self._fixed[split] = (read_rows(stream, starts, tc.block_size + 1, sharding),
                                  place_rows(weights, sharding), float(weights.size))
        yield self._fixed[split]

    def _whole_split(self, stream: TokenStream):
        T, sharding = self.tc.block_size, self.sharding(self.eval_rows)
        starts, counted_from = whole_split_windows(len(stream), T, self.eval_rows)
        per = self._chunk_batches(len(starts))
        for a in range(0, len(starts), per):
            s, c = starts[a:a + per], counted_from[a:a + per]
            if len(s) < per:  # one compiled shape: padding batches count nothing
                s = np.concatenate([s, np.zeros((per - len(s), s.shape[1]), s.dtype)])
                c = np.concatenate([c, np.full((per - len(c), c.shape[1]), T, c.dtype)])
            yield (read_rows(stream, s, T + 1, sharding), place_rows(target_weights(c, T), sharding),
                   float(np.sum(T - c)))


class Feed:
    """The inputs of a run's chunks, made in a thread up to `depth` chunks ahead.

    Args:
      make: `(first step, last step) -> input` of one chunk.
      chunks: the `(first, last)` step ranges in the order the run asks for them.

    `next()` returns the next chunk's input, adding the seconds it blocked to `waited`; an error
    in the thread is raised there. `close()` stops the thread (the run may end early).
    """

    def __init__(self, make: Callable[[int, int], object], chunks: Iterable[tuple[int, int]], depth: int = 2):
        self.waited, self._stop = 0.0, threading.Event()
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._thread = threading.Thread(target=self._produce, args=(make, iter(chunks)), daemon=True,
                                        name="jaxattn-feed")
        self._thread.start()

    def _produce(self, make, chunks) -> None:
        for first, last in chunks:
            try:
                item = (True, make(first, last))
            except BaseException as err:  # noqa: BLE001: handed to the training thread
                item = (False, err)
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if self._stop.is_set() or not item[0]:
                return

    def next(self):
        start = time.perf_counter()
        ok, item = self._queue.get()
        self.waited += time.perf_counter() - start
        if not ok:
            raise item
        return item

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
