"""A target sharded over several processes or Macs with `mlx.launch`: the names a program uses
(the code is macspec/core/sharded.py).

    group = distributed.init_group()
    pair = macspec.load(target, draft, group=group)
    if not distributed.is_leader(pair):
        distributed.serve(pair)
"""

from ..core.sharded import (
    DistributedError,
    init_group,
    is_leader,
    rank,
    serve,
    serve_if_follower,
    time_communication,
)

__all__ = [
    "DistributedError",
    "init_group",
    "is_leader",
    "rank",
    "serve",
    "serve_if_follower",
    "time_communication",
]
