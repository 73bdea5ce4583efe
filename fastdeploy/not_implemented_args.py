"""FastDeploy's LLM / EngineArgs parameters this engine does not implement, with FastDeploy's defaults.

FastDeploy code may pass any of them: its default value describes what this engine is (one node, one
data-parallel rank, no prefill/decode split, no GPU-specific kernels, no remote
scheduler), so it is accepted; any other value raises NotImplementedError naming the parameter.
Names taken from FastDeploy 2.x `fastdeploy/engine/args_utils.py` and `LLM.__init__` (use_cudagraph and
innode_prefill_ports from its earlier 2.x releases, still in its docs/parameters.md). The server takes each as a
--flag too (fastdeploy/entrypoints/openai/cli_args.py)."""
from __future__ import annotations

from typing import Any

NOT_IMPLEMENTED: dict[str, Any] = {
    # model / runner selection
    "port": None, "metrics_port": None, "model_config_name": "config.json", "tokenizer_base_url": None,
    "task": "generate", "runner": "auto", "convert": "auto", "model_impl": "auto", "override_pooler_config": None,
    "logits_processors": None, "dynamic_load_weight": False, "load_strategy": "normal",
    "rsync_config": None, "graph_optimization_config": None,
    "plas_attention_config": None, "enable_early_stop": False, "early_stop_config": None,
    "enable_keep_sampling_mask": False, "enable_entropy": False,
    "use_cudagraph": False,
    # multimodal caches
    "max_encoder_cache": -1, "max_processor_cache": -1, "disable_chunked_mm_input": False,
    # KV cache: swapping, storage, block pre-allocation
    "swap_space": None, "cache_queue_port": None, "kvcache_storage_backend": None, "write_policy": "write_through",
    "enable_output_caching": True, "prealloc_dec_block_slot_num_threshold": 12, "static_decode_blocks": 2,
    # parallelism and communication kernels
    "data_parallel_size": 1, "local_data_parallel_id": 0, "enable_expert_parallel": False,
    "enable_chunked_moe": False, "chunked_moe_size": 256, "disable_custom_all_reduce": False,
    "enable_flashinfer_allreduce_fusion": False, "use_internode_ll_two_stage": False,
    "disable_sequence_parallel_moe": False, "shutdown_comm_group_if_worker_idle": None, "enable_eplb": False,
    "eplb_config": None, "routing_replay_config": None, "skip_port_check": False,
    # prefill/decode disaggregation
    "splitwise_role": "mixed", "cache_transfer_protocol": "ipc,rdma", "pd_comm_port": None, "rdma_comm_ports": None,
    "router": None, "innode_prefill_ports": None,
    # chunked prefill tuning of FastDeploy's scheduler
    "max_num_partial_prefills": 1, "max_long_partial_prefills": 1, "long_prefill_token_threshold": 0,
    "enable_overlap_schedule": False,
    # FastDeploy's local / Redis / global scheduler
    "scheduler_name": "local", "scheduler_max_size": -1, "scheduler_ttl": 900, "scheduler_host": "127.0.0.1",
    "scheduler_port": 6379, "scheduler_db": 0, "scheduler_password": None, "scheduler_topic": "default",
    "scheduler_min_load_score": 3, "scheduler_load_shards_num": 1, "scheduler_sync_period": 5,
    "scheduler_expire_period": 3000, "scheduler_release_load_expire_period": 600, "scheduler_reader_parallel": 4,
    "scheduler_writer_parallel": 4, "scheduler_reader_batch_size": 200, "scheduler_writer_batch_size": 200,
}


def _same(value: Any, default: Any) -> bool:
    # True == 1 in Python; a bool default must be met by a bool (or 0/1), a None default only by None.
    if default is None:
        return value is None
    return type(value) in (type(default), bool, int, float) and value == default


def refuse_not_implemented(kwargs: dict[str, Any]) -> None:
    """Drop the FastDeploy-only parameters from kwargs; NotImplementedError for one not at its default."""
    for name in [k for k in kwargs if k in NOT_IMPLEMENTED]:
        value = kwargs.pop(name)
        if not _same(value, NOT_IMPLEMENTED[name]):
            raise NotImplementedError(
                f"{name}={value!r} is not implemented by this CPU engine (FastDeploy's default "
                f"{NOT_IMPLEMENTED[name]!r} is accepted); see docs/offline_inference.md")
