"""One process of tests/test_balance_parquet.py's two-process BBS check, started by
gemjax.parallel.launch: the Feeder's host batches of a data.bbs=true train stream on a
mesh of every process's devices."""

import jax
import numpy as np
from jax.sharding import Mesh

from gemjax.config import config_from_dict
from gemjax.data import balance
from gemjax.data.feeding import Feeder


def feed_rows(config: dict, steps: int) -> dict:
    """{"process", "shards": this process's batch shards, "rows": per step, per local
    shard, the file rows it holds, "built": the source shards this process read}."""
    src = balance.train_source(config_from_dict(config))    # balanced per process
    built = set()
    read = src.inner.shard_batch

    def counted(step, shard, num_shards):
        built.add(shard)
        return read(step, shard, num_shards)

    src.inner.shard_batch = counted
    feeder = Feeder(src.shard_batch, Mesh(np.array(jax.devices()), ("batch",)))
    rows = [[info.rows.tolist() for info in feeder.host_batch(step)[1]] for step in range(steps)]
    return {"process": jax.process_index(), "shards": feeder.local_shards, "rows": rows,
            "built": sorted(built)}
