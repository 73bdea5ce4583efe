"""EngineConfig: every LLM(...) parameter, validated once, with the checkpoint's ModelConfig."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from fastdeploy.distributed.launch import Launch, is_local_address
from fastdeploy.distributed.parallel_state import check_tp_size
from fastdeploy.model_executor.model_config import ModelConfig
from fastdeploy.model_executor.model_resolve import DEFAULT_REVISION, resolve_model
from fastdeploy.model_executor.checkpoint import Checkpoint
from fastdeploy.model_executor.quantization import QuantConfig, parse_quantization
from fastdeploy.speculative import MTP_ARCHITECTURES, MTP_LAYERS, SpeculativeConfig, checkpoint_has_mtp
from fastdeploy.not_implemented_args import refuse_not_implemented
from fastdeploy.reasoning.parsers import known_parsers
from fastdeploy.tool_parsers.parsers import known_tool_parsers
from fastdeploy.tool_parsers.plugins import load_tool_parser_plugin

# dtype spellings (vLLM's and PyTorch's) -> the precision of unquantized weights (layers/packed.py Precision)
DTYPES = {"auto": "auto", "bfloat16": "bfloat16", "bf16": "bfloat16", "float32": "float32", "fp32": "float32",
          "float": "float32"}
MAX_NUM_SEQS_LIMIT = 256
DEFAULT_CHUNKED_BUDGET = 2048  # FastDeploy's token budget when chunked prefill is on
LOAD_CHOICES = ("default", "default_v1")
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")


def _check_int(name: str, value: Any, low: int, high: int | None = None, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < low or (high is not None and value > high):
        allowed = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be in {allowed}, got {value}")


def _check_fraction(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    if not 0.0 < value <= 1.0:
        raise ValueError(f"{name} must be in (0, 1], got {value}")


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, (bool, int)) or value not in (0, 1):
        raise TypeError(f"{name} must be a bool, got {value!r}")


REQUIRED = dataclasses.MISSING


def param(default: Any, doc: str, cli_type: Any = None) -> Any:
    """A config field with its one-line description (the server's --flag help is generated from it) and,
    where the annotation does not say it, the type that parses the flag's text."""
    return field(default=default, metadata={"help": doc, "cli_type": cli_type})


def _port_of(value: Any) -> int:
    """FastDeploy's engine_worker_queue_port forms: an int, "8002", "8002,8003" or a list, one port per
    data-parallel rank (one rank here); None picks a free port from 8002 up."""
    if value is None:
        return 8002
    if isinstance(value, str):
        value = [p.strip() for p in value.split(",")]
    if isinstance(value, (list, tuple)):
        if len(value) != 1:
            raise ValueError(f"engine_worker_queue_port takes one port per data-parallel rank and there is one "
                             f"rank here (data_parallel_size=1), got {value!r}")
        value = value[0]
        if isinstance(value, str):
            if not value.isdigit():
                raise ValueError(f"engine_worker_queue_port must be a port number, got {value!r}")
            value = int(value)
    _check_int("engine_worker_queue_port", value, 1, 65535)
    return value


@dataclass
class EngineConfig:
    """Every LLM(...) parameter (and every server engine flag: the CLI is generated from these fields and
    their `help`), validated once."""

    model: str = param(REQUIRED, "checkpoint directory (config.json, safetensors, tokenizer files), or a repo id: "
                                 "found in FastDeploy's download directory or the Hugging Face cache, else downloaded")
    revision: str | None = param(
        DEFAULT_REVISION, "branch, tag or commit hash of a repo-id model in the hub cache (master: the default)")
    tokenizer: str | None = param(None, "tokenizer directory (default: the model's)")
    max_model_len: int = param(2048, "prompt + output tokens per request")
    tensor_parallel_size: int = param(
        1, "ranks the model is split across: this process and N-1 workers it starts, or under "
           "paddle.distributed.launch the N processes it started, on one or several hosts (docs/distributed.md)")
    block_size: int = param(64, "tokens per KV-cache block")
    max_num_seqs: int = param(8, "requests running at once (1..256); the rest wait")
    gpu_memory_utilization: float = param(0.9, "share of host memory for weights, activations and KV cache")
    num_gpu_blocks_override: int | None = param(None, "exact number of KV blocks (skips the memory estimate)")
    max_num_batched_tokens: int | None = param(
        None, "token budget of one step (default: 2048 with chunked prefill, else max_model_len)")
    kv_cache_ratio: float = param(
        0.75, "share of the KV blocks new prompts may take while other requests run; the rest is kept for "
              "their outputs to grow into (1: no reserve)")
    enable_prefix_caching: bool = param(True, "reuse the KV blocks of shared prompt prefixes")
    enable_chunked_prefill: bool = param(
        True, "compute prompts in chunks within the step budget; while requests decode, a step keeps to about twice "
              "a decode step's time (measured), so new prompts do not stall them")
    use_warmup: int = param(0, "1: run one full-budget forward at start-up")
    engine_worker_queue_port: int | str | list[int] | None = param(
        8002, "localhost port feeding steps to tensor-parallel workers (the next free one if taken); with ips and "
              "no launcher, the port every node reaches the master at (ips[0])", cli_type=str)
    enable_mm: bool = param(False, "multimodal models (accepted; ERNIE-4.5-VL takes media whether set or not)")
    limit_mm_per_prompt: dict[str, int] | None = param(None, 'JSON like {"image": 100, "video": 100}')
    mm_processor_kwargs: dict[str, Any] | None = param(
        None, 'JSON like {"image_max_pixels": 401408, "video_max_frames": 30}')
    reasoning_parser: str | None = param(
        None, "split thinking output into reasoning_content: ernie-x1, ernie-45-vl, qwen3")
    tool_call_parser: str | None = param(
        None, "turn <tool_call> output of chats given tools into tool_calls: ernie-x1, ernie-45-vl-thinking, hermes, "
              "or one a tool_parser_plugin registers")
    tool_parser_plugin: str | None = param(
        None, "a Python file registering ToolParser subclasses (fastdeploy.tool_parsers.register_tool_parser), "
              "loaded at start-up")
    guided_decoding_backend: str = param(
        "auto", "grammar engine for guided_decoding / response_format: auto or llguidance (guidance); off refuses them")
    guided_decoding_disable_any_whitespace: bool = param(
        True, "guided JSON output without optional whitespace between its tokens (FastDeploy's engine default)")
    quantization: str | dict[str, Any] | None = param(
        None, 'weight-only quantization while loading: wint8 or wint4; or JSON like {"quantization": "mix_quant", '
              '"dense_quant_type": "wint8", "moe_quant_type": "wint4", "kv_cache_quant_type": "block_wise_fp8"}',
        cli_type=str)
    dtype: str = param("auto", "unquantized weights: auto (as stored), bfloat16 (bf16 matmul inputs) or float32")
    seed: int = param(0, "engine-wide seed for unseeded requests")
    chat_template: str | None = param(None, "Jinja chat template (string or file path) overriding the tokenizer's")
    max_logprobs: int = param(20, "largest logprobs a request may ask for (-1: whole vocabulary)")
    enable_logprob: bool = param(
        False, "FastDeploy's logprobs switch; logprobs are always available here, so either value is accepted")
    logprobs_mode: str = param(
        "raw_logprobs", "what logprobs report: raw_logprobs, raw_logits (the model's), processed_logprobs or "
                        "processed_logits (what the sampler drew from: after bans, logit bias, penalties, "
                        "temperature and top_k / top_p / min_p)")
    served_model_name: str | None = param(None, "the model's name in the OpenAI API (default: the model "
                                                  "directory's name, or a hub repo id as given)")
    lm_head_fp32: bool = param(False, "hold the embedding / LM head table in float32 and compute the logits in float32")
    load_choices: str = param("default_v1", "FastDeploy's weight loader: default or default_v1 (both load the same here)")
    speculative_config: dict[str, Any] | None = param(
        None, 'speculative decoding, JSON like {"method": "ngram", "num_speculative_tokens": 4, "max_ngram_size": 5, '
              '"min_ngram_size": 2} or {"method": "mtp", "num_speculative_tokens": 1} (docs/speculative_decoding.md)')
    ips: str | list[str] | None = param(
        None, "the nodes' addresses, comma-separated, master first (FastDeploy's multi-node form): run the same "
              "command on each, or check those paddle.distributed.launch --ips placed the ranks on", cli_type=str)
    model_config: ModelConfig = field(init=False, repr=False)
    launch: Launch | None = field(init=False)  # this process's place among the launcher's ranks, if it started it
    quant: QuantConfig = field(init=False)  # `quantization`, parsed
    speculative: SpeculativeConfig | None = field(init=False)  # `speculative_config`, parsed

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> EngineConfig:
        refuse_not_implemented(kwargs)
        known = {f.name for f in dataclasses.fields(cls) if f.init}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"LLM() got unknown parameter(s) {unknown}; supported: {sorted(known - {'model'})}")
        return cls(model=model, **kwargs)

    def __post_init__(self) -> None:
        if not isinstance(self.model, (str, os.PathLike)):
            raise TypeError(f"model must be a path to a checkpoint directory, got {type(self.model).__name__}")
        if self.revision is not None and not isinstance(self.revision, str):
            raise TypeError(f"revision must be a branch, tag or commit hash string, got {type(self.revision).__name__}")
        self.model = resolve_model(os.fspath(self.model), self.revision)
        if not os.path.isdir(self.model):
            raise ValueError(f"model must be a checkpoint directory or a repo id; {self.model!r} is not a "
                             "directory")
        self.tokenizer = os.fspath(self.tokenizer) if self.tokenizer is not None else self.model
        if not os.path.isdir(self.tokenizer):
            raise ValueError(f"tokenizer must be a directory of tokenizer files, got {self.tokenizer!r}")
        self.model_config = ModelConfig.from_pretrained(self.model)

        _check_int("max_model_len", self.max_model_len, 1, self.model_config.max_position_embeddings)
        window = self.model_config.sliding_window
        if window is not None and window < self.max_model_len:  # a window covering every context is exact
            raise ValueError(f"{self.model}: sliding_window ({window}) is shorter than max_model_len "
                             f"({self.max_model_len}); sliding-window attention is not implemented yet: pass "
                             f"max_model_len <= {window}")
        _check_int("tensor_parallel_size", self.tensor_parallel_size, 1)
        check_tp_size(self.tensor_parallel_size, self.model_config)
        self.engine_worker_queue_port = _port_of(self.engine_worker_queue_port)
        self._check_launch()
        _check_int("block_size", self.block_size, 1, 4096)
        _check_int("max_num_seqs", self.max_num_seqs, 1, MAX_NUM_SEQS_LIMIT)
        _check_fraction("gpu_memory_utilization", self.gpu_memory_utilization)
        _check_int("num_gpu_blocks_override", self.num_gpu_blocks_override, 1, allow_none=True)
        _check_fraction("kv_cache_ratio", self.kv_cache_ratio)
        _check_bool("enable_prefix_caching", self.enable_prefix_caching)
        _check_bool("enable_chunked_prefill", self.enable_chunked_prefill)
        _check_int("use_warmup", int(self.use_warmup) if isinstance(self.use_warmup, bool) else self.use_warmup, 0, 1)
        _check_bool("enable_mm", self.enable_mm)
        _check_int("seed", self.seed, 0)
        _check_int("max_logprobs", self.max_logprobs, -1)
        self._check_fastdeploy_switches()
        self._check_batched_tokens()
        self._check_multimodal()
        self.quant = parse_quantization(self.quantization)
        self.speculative = None if self.speculative_config is None else \
            SpeculativeConfig.from_dict(self.speculative_config)
        if self.drafts_with_mtp:
            self._check_mtp()
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {list(DTYPES)}, got {self.dtype!r}")
        self.dtype = DTYPES[self.dtype]
        if self.chat_template is not None and not isinstance(self.chat_template, str):
            raise TypeError("chat_template must be a Jinja template string or a path to a template file")
        if self.reasoning_parser is not None and self.reasoning_parser not in known_parsers():
            raise ValueError(f"reasoning_parser must be one of {list(known_parsers())} or None, "
                             f"got {self.reasoning_parser!r}")
        if self.tool_parser_plugin is not None:
            if not isinstance(self.tool_parser_plugin, (str, os.PathLike)):
                raise TypeError(f"tool_parser_plugin must be a path, got {type(self.tool_parser_plugin).__name__}")
            load_tool_parser_plugin(os.fspath(self.tool_parser_plugin))
        if self.tool_call_parser is not None and self.tool_call_parser not in known_tool_parsers():
            raise ValueError(f"tool_call_parser must be one of {known_tool_parsers()} or None, "
                             f"got {self.tool_call_parser!r}")
        self._check_guided_decoding()
        self._refuse_not_yet_supported()

    def _check_mtp(self) -> None:
        """MTP drafts need an ERNIE-4.5 text checkpoint that carries the layer."""
        arch = self.model_config.architectures[0]
        if arch not in MTP_ARCHITECTURES:
            raise ValueError(f"speculative_config method 'mtp' needs an ERNIE-4.5 text model (dense or MoE); {arch} "
                             "has no MTP layer (use 'ngram')")
        where = self.mtp_weights
        if not os.path.isdir(where):
            raise ValueError(f"speculative_config model must be a directory holding the MTP weights, got {where!r}")
        with Checkpoint(where) as checkpoint:
            if not checkpoint_has_mtp(list(checkpoint.tensors)):
                raise ValueError(f"speculative_config method 'mtp': {where} has no MTP tensors "
                                 "(mtp_linear_proj.0, mtp_block.0, ...; ERNIE-4.5's -Paddle and -PT checkpoints ship "
                                 "them); use 'ngram'")

    def _check_launch(self) -> None:
        """Under paddle.distributed.launch the launched processes are the ranks: as many as tensor_parallel_size."""
        self.launch = Launch.from_environ()
        if self.launch is not None and self.launch.world_size != self.tensor_parallel_size:
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size}, but paddle.distributed.launch started "
                             f"{self.launch.world_size} processes (--nnodes x --nproc_per_node); they are the ranks "
                             "of one model: make the two equal")
        if self.ips is None:
            return
        ips = self.ips.split(",") if isinstance(self.ips, str) else self.ips
        if not isinstance(ips, list) or not ips or not all(isinstance(ip, str) and ip.strip() for ip in ips):
            raise ValueError(f"ips must be comma-separated node addresses, got {self.ips!r}")
        ips = [ip.strip() for ip in ips]
        if self.launch is None:  # FastDeploy's form: the same command on every node, no launcher
            if len(ips) > 1:
                self.launch = Launch.from_ips(ips, self.tensor_parallel_size, self.engine_worker_queue_port)
            elif not is_local_address(ips[0]):
                raise ValueError(f"ips={ips[0]} names one node, and it is not this host")
        elif self.launch.nodes != ips:
            raise ValueError(f"ips={','.join(ips)} but paddle.distributed.launch placed the ranks on "
                             f"{','.join(self.launch.nodes)}; give both the same nodes in the same order")

    def _check_batched_tokens(self) -> None:
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = (max(DEFAULT_CHUNKED_BUDGET, self.max_num_seqs)
                                           if self.enable_chunked_prefill else self.max_model_len)
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, self.max_num_seqs)
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_model_len "
                             f"({self.max_model_len}) unless enable_chunked_prefill=True")

    def _check_fastdeploy_switches(self) -> None:
        _check_bool("enable_logprob", self.enable_logprob)
        _check_bool("lm_head_fp32", self.lm_head_fp32)
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {list(LOGPROBS_MODES)}, got {self.logprobs_mode!r}")
        if self.load_choices not in LOAD_CHOICES:
            raise ValueError(f"load_choices must be one of {list(LOAD_CHOICES)}, got {self.load_choices!r}")
        if self.served_model_name is not None and (not isinstance(self.served_model_name, str)
                                                   or not self.served_model_name):
            raise ValueError(f"served_model_name must be a non-empty string or None, got {self.served_model_name!r}")

    def _check_guided_decoding(self) -> None:
        allowed = ("auto", "llguidance", "guidance", "off")
        if self.guided_decoding_backend in ("xgrammar", "XGrammar"):
            raise ValueError(f"guided_decoding_backend must be one of {list(allowed)}, got "
                             f"{self.guided_decoding_backend!r}: xgrammar needs torch, which this CPU build does "
                             "not use; 'auto' runs llguidance, which accepts the same specs")
        if self.guided_decoding_backend not in allowed:
            raise ValueError(f"guided_decoding_backend must be one of {list(allowed)}, got "
                             f"{self.guided_decoding_backend!r}")
        _check_bool("guided_decoding_disable_any_whitespace", self.guided_decoding_disable_any_whitespace)

    def _check_multimodal(self) -> None:
        if self.limit_mm_per_prompt is None:
            return
        if not isinstance(self.limit_mm_per_prompt, dict) or not all(
                k in ("image", "video", "audio") and isinstance(v, int) and not isinstance(v, bool) and v >= 0
                for k, v in self.limit_mm_per_prompt.items()):
            raise ValueError("limit_mm_per_prompt must be a dict like {'image': 100, 'video': 100} "
                             f"with non-negative int limits, got {self.limit_mm_per_prompt!r}")

    def _refuse_not_yet_supported(self) -> None:
        if self.enable_mm and self.model_config.multimodal is None:
            raise ValueError(f"enable_mm=True needs a multimodal model; {self.model} is text-only")
        if self.mm_processor_kwargs is not None and not isinstance(self.mm_processor_kwargs, dict):
            raise ValueError(f"mm_processor_kwargs must be a dict, got {self.mm_processor_kwargs!r}")

    @property
    def kv_cache_dtype(self) -> str:
        """The KV cache's format (fastdeploy/ops/kv_cache.py): kv_cache_quant_type when given, else the
        model's compute precision (bfloat16 for a bf16 checkpoint or dtype="bfloat16", float32 under
        dtype="float32" or for a float32 / float16 checkpoint), as FastDeploy keeps the cache in the model's dtype."""
        if self.quant.kv_cache is not None:
            return self.quant.kv_cache
        if self.dtype == "bfloat16" or (self.dtype == "auto" and self.model_config.dtype == "bfloat16"):
            return "bfloat16"
        return "float32"

    @property
    def drafts_with_mtp(self) -> bool:
        """speculative_config's method is "mtp": the model is loaded with its MTP layer, which has a cache layer."""
        return self.speculative is not None and self.speculative.method == "mtp"

    @property
    def mtp_weights(self) -> str | None:
        """The directory whose MTP tensors the MTP layer loads (speculative_config model, by default the model's own
        checkpoint); None without MTP."""
        if not self.drafts_with_mtp:
            return None
        return self.speculative.model if self.speculative.model is not None else self.model

    @property
    def num_kv_layers(self) -> int:
        """KV cache layers: the model's, and the MTP layer's when it drafts."""
        return self.model_config.num_hidden_layers + (MTP_LAYERS if self.drafts_with_mtp else 0)

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)
