"""Tensor parallelism: one process per rank, each holding a slice of the weights and of
the paged KV cache; the scheduler runs once, on rank 0, and sends every step to the others.

shards.py         which heads, intermediate columns and vocabulary rows each rank owns (pure)
weight_shards.py  slicing HF-named tensors down to one rank's shard (pure)
comm.py           the collectives a sharded model needs (all-reduce, gather of logits)
control.py        the leader's authenticated command connections to its ranks
launcher.py       starting rank processes as this process's children (pods, `baton worker`)
ray_launcher.py   starting them as Ray actors in a placement group (`baton up`, local or joined)
rank_main.py      a non-leader rank: build its shard, then run whatever the leader sends
runner.py         rank 0's runner: drives the group behind ModelRunner's interface
"""
