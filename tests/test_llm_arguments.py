"""Every keyword FastDeploy's LLM(...) takes: accepted with FastDeploy's default, or refused with
NotImplementedError naming it; EngineArgs; a repo-id model found in the local caches."""
from __future__ import annotations

import dataclasses
import re
import shutil
import socket
from pathlib import Path

import huggingface_hub.constants
import pytest

from fastdeploy import LLM, SamplingParams
from fastdeploy.config import EngineConfig
from fastdeploy.engine.args_utils import EngineArgs
from fastdeploy.model_executor import model_download

ROOT = Path(__file__).resolve().parents[1]

# FastDeploy 2.x's own defaults, read from its fastdeploy/engine/args_utils.py (EngineArgs) and
# fastdeploy/entrypoints/llm.py (LLM.__init__: revision, tokenizer, enable_logprob, chat_template; the rest
# go to EngineArgs). Kept here as the independent reference the code is checked against.
FASTDEPLOY_DEFAULTS = {
    "port": None, "metrics_port": None, "served_model_name": None, "revision": "master",
    "model_config_name": "config.json", "tokenizer": None, "tokenizer_base_url": None, "max_model_len": 2048,
    "tensor_parallel_size": 1, "block_size": 64, "task": "generate", "runner": "auto", "convert": "auto",
    "model_impl": "auto", "override_pooler_config": None, "max_num_seqs": 8, "mm_processor_kwargs": None,
    "limit_mm_per_prompt": None, "max_encoder_cache": -1, "max_processor_cache": -1, "reasoning_parser": None,
    "chat_template": None, "tool_call_parser": None, "tool_parser_plugin": None, "enable_mm": False,
    "speculative_config": None, "dynamic_load_weight": False, "load_strategy": "normal", "rsync_config": None,
    "quantization": None, "guided_decoding_backend": "off", "guided_decoding_disable_any_whitespace": False,
    "gpu_memory_utilization": 0.9, "num_gpu_blocks_override": None, "max_num_batched_tokens": None,
    "kv_cache_ratio": 0.75, "prealloc_dec_block_slot_num_threshold": 12, "ips": None, "swap_space": None,
    "cache_queue_port": None, "kvcache_storage_backend": None, "write_policy": "write_through", "use_warmup": 0,
    "enable_prefix_caching": True, "enable_output_caching": True, "disable_custom_all_reduce": False,
    "enable_flashinfer_allreduce_fusion": False, "use_internode_ll_two_stage": False,
    "disable_sequence_parallel_moe": False, "shutdown_comm_group_if_worker_idle": None,
    "engine_worker_queue_port": None, "splitwise_role": "mixed", "data_parallel_size": 1,
    "local_data_parallel_id": 0, "enable_expert_parallel": False, "enable_chunked_moe": False,
    "chunked_moe_size": 256, "cache_transfer_protocol": "ipc,rdma", "pd_comm_port": None, "rdma_comm_ports": None,
    "enable_chunked_prefill": False, "max_num_partial_prefills": 1, "max_long_partial_prefills": 1,
    "long_prefill_token_threshold": 0, "static_decode_blocks": 2, "disable_chunked_mm_input": False,
    "scheduler_name": "local", "scheduler_max_size": -1, "scheduler_ttl": 900, "scheduler_host": "127.0.0.1",
    "scheduler_port": 6379, "scheduler_db": 0, "scheduler_password": None, "scheduler_topic": "default",
    "scheduler_min_load_score": 3, "scheduler_load_shards_num": 1, "scheduler_sync_period": 5,
    "scheduler_expire_period": 3000, "scheduler_release_load_expire_period": 600, "scheduler_reader_parallel": 4,
    "scheduler_writer_parallel": 4, "scheduler_reader_batch_size": 200, "scheduler_writer_batch_size": 200,
    "enable_overlap_schedule": False, "graph_optimization_config": None, "plas_attention_config": None,
    "enable_logprob": False, "enable_keep_sampling_mask": False, "max_logprobs": 20,
    "logprobs_mode": "raw_logprobs", "seed": 0, "enable_early_stop": False, "early_stop_config": None,
    "load_choices": "default_v1", "lm_head_fp32": False, "logits_processors": None, "router": None,
    "enable_eplb": False, "eplb_config": None, "routing_replay_config": None, "skip_port_check": False,
    "enable_entropy": False,
    # In EngineArgs of FastDeploy's earlier 2.x releases and still in its docs/parameters.md table.
    "use_cudagraph": False, "innode_prefill_ports": None,
}
# Where this engine's default differs on purpose (docs/offline_inference.md, "Differences from FastDeploy").
DIFFERENT_DEFAULTS = {
    "guided_decoding_backend": "auto",  # guided decoding works without opting in (FastDeploy: "off" refuses it)
    "engine_worker_queue_port": 8002,  # FastDeploy 2.0's default; None (newer FastDeploy's) is accepted too
    # FastDeploy's EngineArgs says False but its engine applies ParallelConfig.disable_any_whitespace = True.
    "guided_decoding_disable_any_whitespace": True,
    # FastDeploy's EngineArgs says False but its create_engine_config turns chunked prefill on for a mixed
    # (not disaggregated) deployment on CUDA without MTP, as vLLM V1 always does; on here by default too.
    "enable_chunked_prefill": True,
}
OURS = {f.name: f.default for f in dataclasses.fields(EngineArgs) if f.name != "model"}


def _other_value(default):
    """A value that is not FastDeploy's default, of the same kind."""
    if isinstance(default, bool):
        return not default
    if isinstance(default, (int, float)):
        return default + 1
    if isinstance(default, str):
        return default + "_other"
    return {"x": 1}


@pytest.mark.parametrize("name", sorted(FASTDEPLOY_DEFAULTS))
def test_every_fastdeploy_keyword_is_accepted_at_its_default_or_refused_by_name(name, tiny_hf):
    default = FASTDEPLOY_DEFAULTS[name]
    if name in OURS:
        assert OURS[name] == DIFFERENT_DEFAULTS.get(name, default), name
        config = EngineConfig.from_kwargs(tiny_hf, **{name: default})  # FastDeploy's default is accepted
        assert name in {f.name for f in dataclasses.fields(config)}
        return
    # Not implemented: the default is accepted (it describes this engine), anything else names the parameter.
    EngineConfig.from_kwargs(tiny_hf, **{name: default})
    with pytest.raises(NotImplementedError, match=re.escape(name)):
        EngineConfig.from_kwargs(tiny_hf, **{name: _other_value(default)})


# Parameters FastDeploy's LLM lacks (docs/offline_inference.md, "Differences from FastDeploy").
EXTENSIONS = {"dtype": "auto"}  # vLLM's name: the precision of unquantized weights and their matmuls


def test_every_parameter_here_is_one_fastdeploy_has():
    assert {name: OURS[name] for name in set(OURS) - set(FASTDEPLOY_DEFAULTS)} == EXTENSIONS
    with pytest.raises(TypeError, match="no_such_parameter"):
        EngineConfig.from_kwargs("x", no_such_parameter=1)


def test_engine_args_is_the_llm_parameters_and_builds_the_validated_config(tiny_hf):
    assert [f.name for f in dataclasses.fields(EngineArgs)] == [
        f.name for f in dataclasses.fields(EngineConfig) if f.init]
    args = EngineArgs(model=tiny_hf, max_num_seqs=3, engine_worker_queue_port="9001")
    config = args.create_engine_config()
    assert isinstance(config, EngineConfig)
    assert (config.max_num_seqs, config.engine_worker_queue_port, config.tokenizer) == (3, 9001, tiny_hf)
    with pytest.raises(ValueError, match="max_num_seqs"):
        EngineArgs(model=tiny_hf, max_num_seqs=0).create_engine_config()


@pytest.mark.parametrize("value, port", [("9001", 9001), ([9002], 9002), (9003, 9003), (None, 8002)])
def test_engine_worker_queue_port_takes_fastdeploys_forms(tiny_hf, value, port):
    assert EngineConfig(model=tiny_hf, engine_worker_queue_port=value).engine_worker_queue_port == port


@pytest.mark.parametrize("kwargs, error, match", [
    ({"engine_worker_queue_port": "9001,9002"}, ValueError, "one port per data-parallel rank"),
    ({"engine_worker_queue_port": "abc"}, ValueError, "engine_worker_queue_port"),
    ({"kv_cache_ratio": 1.5}, ValueError, "kv_cache_ratio"),
    ({"kv_cache_ratio": 0}, ValueError, "kv_cache_ratio"),
    ({"dtype": "float16"}, ValueError, "dtype"),
    ({"load_choices": "fast"}, ValueError, "load_choices"),
    ({"enable_logprob": "yes"}, TypeError, "enable_logprob"),
    ({"served_model_name": ""}, ValueError, "served_model_name"),
    ({"revision": 3}, TypeError, "revision"),
])
def test_fastdeploy_arguments_are_validated(tiny_hf, kwargs, error, match):
    with pytest.raises(error, match=match):
        EngineConfig.from_kwargs(tiny_hf, **kwargs)


def test_logprobs_do_not_need_enable_logprob(tiny_hf):
    config = EngineConfig.from_kwargs(tiny_hf, lm_head_fp32=True, load_choices="default", served_model_name="t")
    assert (config.lm_head_fp32, config.load_choices, config.served_model_name) == (True, "default", "t")
    llm = LLM(tiny_hf, enable_logprob=False, max_model_len=64)
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0, logprobs=2), use_tqdm=False)[0]
    assert len(out.outputs.logprobs) == 3


# ------------------------------------------------------------------------------------------- model by name

REPO = "baidu/ERNIE-4.5-0.3B-Paddle"
HASH_MAIN = "a" * 40
HASH_DEV = "b" * 40


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def caches(tmp_path, monkeypatch, tiny_hf):
    """A Hugging Face hub cache with the tiny model under `main` and a `dev` branch, and an empty home."""
    hub, home = tmp_path / "hub", tmp_path / "home"
    repo = hub / "models--baidu--ERNIE-4.5-0.3B-Paddle"
    for ref, commit in (("main", HASH_MAIN), ("dev", HASH_DEV)):
        shutil.copytree(tiny_hf, repo / "snapshots" / commit)
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    home.mkdir()
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("FD_MODEL_CACHE", raising=False)
    # A hub on a port nothing listens on: a model missing from the caches is "offline", never fetched.
    monkeypatch.setattr(model_download, "HUB_ENDPOINT", f"http://127.0.0.1:{closed_port()}")
    return hub, home, repo


def test_repo_id_loads_the_hub_cache_snapshot(caches, tiny_hf):
    _, _, repo = caches
    llm = LLM(REPO, max_model_len=64)
    assert llm.config.model == str(repo / "snapshots" / HASH_MAIN)
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    direct = LLM(tiny_hf, max_model_len=64)
    assert (llm.generate([[3, 4, 5]], greedy, use_tqdm=False)[0].outputs.token_ids
            == direct.generate([[3, 4, 5]], greedy, use_tqdm=False)[0].outputs.token_ids)


@pytest.mark.parametrize("revision, commit", [
    ("master", HASH_MAIN), ("main", HASH_MAIN), (None, HASH_MAIN), ("dev", HASH_DEV), (HASH_DEV, HASH_DEV)])
def test_revision_picks_the_snapshot(caches, revision, commit):
    _, _, repo = caches
    assert EngineConfig.from_kwargs(REPO, revision=revision).model == str(repo / "snapshots" / commit)


def test_fastdeploys_own_download_directory_is_used(caches, tiny_hf):
    _, home, _ = caches
    shutil.copytree(tiny_hf, home / "PaddlePaddle" / "ERNIE-4.5-0.3B-Paddle")  # FastDeploy's AIStudio download
    assert EngineConfig.from_kwargs(REPO).model == str(home / "PaddlePaddle" / "ERNIE-4.5-0.3B-Paddle")


def test_missing_model_says_where_it_looked_and_how_to_download(caches):
    hub, home, _ = caches
    with pytest.raises(ValueError) as e:
        EngineConfig.from_kwargs("baidu/ERNIE-4.5-21B-A3B-Paddle")
    message = str(e.value)
    assert str(hub / "models--baidu--ERNIE-4.5-21B-A3B-Paddle") in message
    assert str(home / "baidu" / "ERNIE-4.5-21B-A3B-Paddle") in message
    assert "hf download baidu/ERNIE-4.5-21B-A3B-Paddle" in message
    with pytest.raises(ValueError, match="--revision v9"):
        EngineConfig.from_kwargs(REPO, revision="v9")


def test_llm_takes_fastdeploys_positional_arguments(tiny_hf):
    llm = LLM(tiny_hf, "master", tiny_hf, True, "{{ messages[0]['content'] }}", max_model_len=64)
    assert (llm.config.revision, llm.config.tokenizer, llm.config.enable_logprob) == ("master", tiny_hf, True)
    assert llm.config.chat_template == "{{ messages[0]['content'] }}"
