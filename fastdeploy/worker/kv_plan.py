"""How many KV-cache blocks the pool gets: sized after the weights are loaded, from what the host has left.

No GPU: the budget is `gpu_memory_utilization` x host memory, less what every rank holds resident now and an
activation reserve, and never more than the host still has available, so every block promised can be
filled; and never more than `max_num_seqs` full-length requests could use.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence

from fastdeploy.config import EngineConfig
from fastdeploy.distributed.parallel_state import kv_heads_per_rank
from fastdeploy.model_executor.memory_plan import available_memory_bytes, host_memory_bytes, resident_bytes
from fastdeploy.ops.kv_cache import row_bytes

logger = logging.getLogger(__name__)

ACTIVATION_RESERVE = 0.1  # share of the memory budget kept for activations


def kv_block_bytes(config: EngineConfig, tp_size: int, ranks_here: int | None = None) -> int:
    """Bytes of one KV block over the `ranks_here` ranks sharing this host's memory (default: all of them)."""
    mc = config.model_config
    heads = kv_heads_per_rank(mc.num_key_value_heads, tp_size) * (tp_size if ranks_here is None else ranks_here)
    return 2 * config.num_kv_layers * config.block_size * heads * row_bytes(mc.head_dim, config.kv_cache_dtype)


def num_kv_blocks(config: EngineConfig, tp_size: int, ranks_here: int = 1, worker_pids: Sequence[int] = ()) -> int:
    """The pool's block count (num_gpu_blocks_override if set); ValueError naming gpu_memory_utilization when
    not even one max_model_len request fits. `ranks_here`: the ranks sharing this host's memory, this one
    included; `worker_pids` those of them whose memory can be read, the others are taken to hold what this one does."""
    if config.num_gpu_blocks_override is not None:
        logger.info("total_block_num:%d (num_gpu_blocks_override)", config.num_gpu_blocks_override)
        return config.num_gpu_blocks_override
    share = host_memory_bytes() * config.gpu_memory_utilization
    resident = resident_bytes() * (ranks_here - len(worker_pids)) + sum(resident_bytes(pid) for pid in worker_pids)
    reserve = int(share * ACTIVATION_RESERVE)
    budget = min(int(share) - resident, available_memory_bytes()) - reserve
    block = kv_block_bytes(config, tp_size, ranks_here)
    by_memory = max(budget // block, 0)
    # More blocks than max_num_seqs full-length requests can use would only sit idle in RAM.
    num_blocks = int(min(by_memory, config.max_num_seqs * config.max_blocks_per_seq))
    if num_blocks < config.max_blocks_per_seq:
        raise ValueError(f"gpu_memory_utilization={config.gpu_memory_utilization} leaves room for {num_blocks} KV "
                         f"blocks, fewer than one max_model_len={config.max_model_len} request needs "
                         f"({config.max_blocks_per_seq}); raise it or lower max_model_len")
    logger.info("KV cache from host memory: gpu_memory_utilization=%.2f of %.1f GiB allows %d blocks; "
                "total_block_num:%d (block_size %d, %.1f MiB)", config.gpu_memory_utilization,
                host_memory_bytes() / 2**30, by_memory, num_blocks, config.block_size, num_blocks * block / 2**20)
    return num_blocks
