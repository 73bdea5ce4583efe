"""Record transformers' greedy outputs for the tiny checkpoints (the parity tests' references).

    /work/llama/venv/bin/python tools/make_model_reference.py [family ...]   # ernie45 ernie45_moe qwen2 qwen3 qwen3_moe

Needs torch + transformers (the reference venv), never the project's test suite. Loads each family's
HF-layout fixture (tests/fixtures/models/, written by tools/make_tiny_models.py) with transformers'
own class in float32, checking that every checkpoint tensor was used and none was missing. For fixed
prompts (token-id lists; ERNIE's 8 cross KV block sizes 16 and 64) it greedily generates exactly
24 tokens (no EOS stop; each step recomputes the whole sequence, no KV cache), recording per step
the chosen token, its logprob (log_softmax of the float32 logits) and the top-5 (id, logprob). For
two prompts it also records prompt logprobs: entry p (p >= 1) scores prompt token p from position
p - 1 (token, logprob, top-5); entry 0 is null. Variants (same weights, config changed) add cases:
  ernie45      `bias_variant`: use_bias with seeded random biases (recorded by HF name) everywhere.
  ernie45_moe  `norm_min_variant`: moe_norm_min 0.5, so some tokens' top-2 weight sums are clamped;
               `routing`: smallest top-k margin of the routers' choice scores (must be clear of
               rounding), how many choices the score-correction bias changed and how many sums the
               variant clamped; `placement`: which layers transformers makes MoE for several
               moe_layer_start_index / end_index / interval settings.
  qwen3        `bias_variant`: attention_bias with random q/k/v/o biases.
  llama3       `bias_variant`: attention_bias and mlp_bias with random q/k/v/o and gate/up/down biases, tied
               head, plain rope; `rope`: transformers' inverse frequencies (plain and llama3-scaled) of the
               fixture and of Llama-3.1-8B / Llama-3.2-1B.
  qwen3_moe    `routing` as ERNIE MoE's (no correction bias: plain top-k of the probabilities);
               `norm_topk_prob_variant`: norm_topk_prob false, the chosen weights left unnormalised;
               `placement`: which layers transformers makes MoE for several decoder_sparse_step /
               mlp_only_layers / num_experts settings.
Writes tests/fixtures/reference/<fixture>_greedy.json. Rerun after tools/make_tiny_models.py.
"""
from __future__ import annotations

import json
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "tests" / "fixtures" / "models"
REFERENCE = ROOT / "tests" / "fixtures" / "reference"
MAX_NEW_TOKENS = 24
TOP_K = 5
SEED = 0
VARIANT_NEW_TOKENS = 12


@dataclass
class Family:
    fixture: str
    model_class: str
    prompt_lengths: list[int]
    prompt_logprob_lengths: set[int]
    token_range: tuple[int, int]  # prompt ids drawn from [lo, hi): no special tokens
    variant_lengths: list[int] = field(default_factory=list)


FAMILIES = {
    "ernie45": Family("ernie45_tiny", "Ernie4_5ForCausalLM", [1, 3, 8, 17, 31, 64, 65, 130], {17, 65}, (3, 1024),
                      [8, 31]),
    "ernie45_moe": Family("ernie45_moe_tiny", "Ernie4_5_MoeForCausalLM", [1, 4, 17, 33, 64, 100], {17, 64}, (3, 1024),
                          [17, 33]),
    "qwen2": Family("qwen2_tiny", "Qwen2ForCausalLM", [1, 4, 17, 33, 64, 100], {17, 64}, (0, 1019)),
    "qwen3": Family("qwen3_tiny", "Qwen3ForCausalLM", [1, 4, 17, 33, 64, 100], {17, 64}, (0, 1019), [17, 33]),
    "llama3": Family("llama3_tiny", "LlamaForCausalLM", [1, 4, 17, 33, 64, 100], {17, 64}, (0, 1019), [17, 33]),
    "mistral": Family("mistral_tiny", "MistralForCausalLM", [1, 4, 17, 33, 64, 100], {17, 64}, (0, 1019)),
    "qwen3_moe": Family("qwen3_moe_tiny", "Qwen3MoeForCausalLM", [1, 4, 17, 33, 64, 100], {17, 64}, (0, 1019),
                        [17, 33]),
}
MOE_CLASSES = ("Ernie4_5_MoeForCausalLM", "Qwen3MoeForCausalLM")


def model_dir(family: Family) -> Path:
    return MODELS / (family.fixture + "_hf" if family.fixture.startswith("ernie") else family.fixture)


def top(logprobs: torch.Tensor, k: int = TOP_K) -> list[list[float | int]]:
    values, indices = torch.topk(logprobs, k)
    return [[int(i), float(v)] for i, v in zip(indices, values)]


@torch.no_grad()
def log_softmax_all(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def greedy(model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> tuple[list[int], list[dict], float]:
    """Exactly max_new_tokens greedy tokens; returns (tokens, per-step records, smallest top-2 gap)."""
    tokens: list[int] = []
    steps: list[dict[str, object]] = []
    min_gap = float("inf")
    for _ in range(max_new_tokens):
        lp = log_softmax_all(model, prompt + tokens)[-1]
        best = top(lp)
        min_gap = min(min_gap, best[0][1] - best[1][1])
        token = best[0][0]
        steps.append({"token": token, "logprob": float(lp[token]), "top5": best})
        tokens.append(token)
    return tokens, steps, min_gap


def load(family: Family, path: Path | None = None, **config_changes: object) -> torch.nn.Module:
    path = path or model_dir(family)
    config = AutoConfig.from_pretrained(path)
    for key, value in config_changes.items():
        setattr(config, key, value)
    model, info = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=torch.float32,
                                                       output_loading_info=True)
    # Only parameters the variant adds (biases set below) may be absent from the checkpoint.
    missing = [k for k in info["missing_keys"] if not (config_changes and k.endswith(".bias"))]
    if missing or info["unexpected_keys"] or info.get("mismatched_keys"):
        raise SystemExit(f"{path}: transformers did not load the checkpoint cleanly: {info}")
    assert type(model).__name__ == family.model_class, type(model)
    if config.tie_word_embeddings:  # a stored lm_head.weight must not replace the tied embedding
        assert torch.equal(model.lm_head.weight, model.get_input_embeddings().weight), "tied head differs"
    return model.eval()


@torch.no_grad()
def variant(family: Family, prompts: list[list[int]], set_biases: bool, path: Path | None = None,
            **config_changes: object) -> tuple[dict[str, object], float]:
    """Greedy cases with `config_changes` applied: {"config"?, "biases"?, "cases", "routing"?}."""
    model = load(family, path, **config_changes)
    probe = RoutingProbe(model) if family.model_class in MOE_CLASSES else None
    rng = np.random.default_rng(SEED + 1)
    out: dict[str, object] = {"config": config_changes} if family.fixture != "ernie45_tiny" else {}
    if set_biases:
        biases = out["biases"] = {}
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                values = (rng.standard_normal(tuple(param.shape)) * 0.2).astype(np.float32)
                param.copy_(torch.from_numpy(values))
                biases[name] = values.tolist()
    cases, min_gap = [], float("inf")
    for prompt in prompts:
        tokens, steps, gap = greedy(model, prompt, VARIANT_NEW_TOKENS)
        min_gap = min(min_gap, gap)
        cases.append({"prompt_token_ids": prompt, "output_token_ids": tokens, "steps": steps})
        print(f"variant {config_changes}, prompt len {len(prompt)}: {tokens}")
    out["cases"] = cases
    if probe is not None:
        out["routing"] = probe.stats()
    return out, min_gap


class RoutingProbe:
    """Forward hooks on transformers' MoE routers (ERNIE-4.5's, Qwen3-MoE's), recomputing their float32
    choice scores."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.margin, self.bias_changed, self.clamped, self.choices = float("inf"), 0, 0, 0
        routers = [m for m in model.modules()
                   if type(m).__name__ in ("Ernie4_5_MoeTopKRouter", "Qwen3MoeTopKRouter")]
        assert routers, "no MoE router found"
        self.handles = [r.register_forward_hook(self.hook) for r in routers]

    def hook(self, router: torch.nn.Module, args: tuple[torch.Tensor, ...], output: object) -> None:
        x = args[0].reshape(-1, router.weight.shape[1]).float()
        probs = torch.softmax(torch.nn.functional.linear(x, router.weight.float()), dim=-1)
        statics = getattr(router, "moe_statics", None)  # Qwen3-MoE has no correction bias
        choice = probs if statics is None else probs + statics.e_score_correction_bias.squeeze()
        k = router.top_k
        ordered = torch.sort(choice, dim=-1, descending=True).values
        self.margin = min(self.margin, float((ordered[:, k - 1] - ordered[:, k]).min()))
        with_bias = torch.topk(choice, k).indices.sort(-1).values
        without = torch.topk(probs, k).indices.sort(-1).values
        self.bias_changed += int((with_bias != without).any(-1).sum())
        if statics is not None:
            self.clamped += int((torch.gather(probs, -1, with_bias).sum(-1) < router.norm_min).sum())
        self.choices += probs.shape[0]

    def stats(self) -> dict[str, object]:
        for h in self.handles:
            h.remove()
        if self.margin < 1e-5:  # float32 rounding of the scores is ~1e-7
            raise SystemExit(f"a router's top-k choice is within {self.margin:.3g} of a tie: change the seeds")
        return {"min_topk_margin": self.margin, "choices": self.choices, "bias_changed_choices": self.bias_changed,
                "clamped_weight_sums": self.clamped}


def moe_placement() -> list[dict[str, object]]:
    """Which layers transformers' Ernie4_5_MoeDecoderLayer makes sparse, for several settings."""
    from transformers.models.ernie4_5_moe import modeling_ernie4_5_moe as m
    settings = [(4, 1, 2, 1), (6, 1, -1, 1), (6, 0, -1, 2), (7, 2, 5, 3), (5, 1, None, 2), (28, 1, None, 1)]
    cases = []
    for layers, start, end, interval in settings:
        fields = {"num_hidden_layers": layers, "moe_layer_start_index": start, "moe_layer_interval": interval}
        if end is not None:
            fields["moe_layer_end_index"] = end
        config = m.Ernie4_5_MoeConfig(hidden_size=8, intermediate_size=8, moe_intermediate_size=4,
                                      num_attention_heads=2, num_key_value_heads=1, moe_num_experts=2, moe_k=1,
                                      vocab_size=16, **fields)
        sparse = [i for i in range(layers)
                  if isinstance(m.Ernie4_5_MoeDecoderLayer(config, i).mlp, m.Ernie4_5_MoeSparseMoeBlock)]
        cases.append({"config": fields, "moe_layers": sparse})
    return cases


def qwen3_moe_placement() -> list[dict[str, object]]:
    """Which layers transformers' Qwen3MoeDecoderLayer makes sparse, for several settings."""
    from transformers.models.qwen3_moe import modeling_qwen3_moe as m
    settings = [(4, 1, [], 4), (4, 2, [], 4), (6, 2, [3], 4), (5, 1, [0, 4], 4), (7, 3, [2, 5], 4), (3, 1, [], 0)]
    cases = []
    for layers, step, only, experts in settings:
        fields = {"num_hidden_layers": layers, "decoder_sparse_step": step, "mlp_only_layers": only,
                  "num_experts": experts}
        config = m.Qwen3MoeConfig(hidden_size=8, intermediate_size=8, moe_intermediate_size=4, num_attention_heads=2,
                                  num_key_value_heads=1, head_dim=4, num_experts_per_tok=1, vocab_size=16, **fields)
        sparse = [i for i in range(layers)
                  if isinstance(m.Qwen3MoeDecoderLayer(config, i).mlp, m.Qwen3MoeSparseMoeBlock)]
        cases.append({"config": fields, "moe_layers": sparse})
    return cases


def llama3_rope(model: torch.nn.Module) -> list[dict[str, object]]:
    """transformers' inverse frequencies (plain and llama3-scaled) for the fixture, as its model holds them,
    and for the real Llama-3.1-8B / 3.2-1B settings."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    def record(name: str, config: LlamaConfig, inv_freq: torch.Tensor) -> dict[str, object]:
        params = dict(config.rope_parameters)
        plain = LlamaConfig(hidden_size=config.hidden_size, num_attention_heads=config.num_attention_heads,
                            head_dim=config.head_dim, rope_parameters={"rope_type": "default",
                                                                      "rope_theta": params["rope_theta"]})
        default, _ = LlamaRotaryEmbedding.compute_default_rope_parameters(plain)
        return {"name": name, "head_dim": config.head_dim, "rope_parameters": params,
                "default_inv_freq": [float(v) for v in default], "inv_freq": [float(v) for v in inv_freq]}

    cases = [record("llama3_tiny", model.config, model.model.rotary_emb.inv_freq)]
    for name, head_dim, factor in (("Llama-3.1-8B", 128, 8.0), ("Llama-3.2-1B", 64, 32.0)):
        config = LlamaConfig(hidden_size=head_dim * 2, num_attention_heads=2, head_dim=head_dim,
                             max_position_embeddings=131072,
                             rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": factor,
                                              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                              "original_max_position_embeddings": 8192})
        cases.append(record(name, config, ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")[0]))
    return cases


def llama_bias_variant(family: Family, prompts: list[list[int]]) -> tuple[dict[str, object], float]:
    """attention_bias + mlp_bias with random biases, a tied head and plain rope (`rope_scaling` null). A tied
    checkpoint has no lm_head.weight (transformers 5 would keep a stored one untied), so it is dropped."""
    from safetensors.torch import load_file, save_file

    plain = {"rope_type": "default", "rope_theta": 500000.0}
    with tempfile.TemporaryDirectory() as tmp:
        source = model_dir(family)
        shutil.copy(source / "config.json", tmp)
        tensors = load_file(source / "model.safetensors")
        del tensors["lm_head.weight"]
        save_file(tensors, Path(tmp) / "model.safetensors", metadata={"format": "pt"})
        out, gap = variant(family, prompts, set_biases=True, path=Path(tmp), attention_bias=True, mlp_bias=True,
                           tie_word_embeddings=True, rope_parameters=plain)
    out["config"] = {**out["config"], "rope_scaling": None}
    out["dropped"] = ["lm_head.weight"]
    return out, gap


def run(name: str) -> None:
    family = FAMILIES[name]
    torch.manual_seed(SEED)
    model = load(family)
    probe = RoutingProbe(model) if family.model_class in MOE_CLASSES else None

    rng = np.random.default_rng(SEED)
    cases, min_gap = [], float("inf")
    for n in family.prompt_lengths:
        prompt = rng.integers(*family.token_range, n).tolist()
        tokens, steps, gap = greedy(model, prompt, MAX_NEW_TOKENS)
        min_gap = min(min_gap, gap)
        case: dict[str, object] = {"prompt_token_ids": prompt, "output_token_ids": tokens, "steps": steps,
                                   "prompt_logprobs": None}
        if n in family.prompt_logprob_lengths:
            lp = log_softmax_all(model, prompt)
            case["prompt_logprobs"] = [None] + [
                {"token": prompt[p], "logprob": float(lp[p - 1, prompt[p]]), "top5": top(lp[p - 1])}
                for p in range(1, n)]
        cases.append(case)
        print(f"{name} prompt len {n:3d}: {len(set(tokens))} distinct of {len(tokens)}: {tokens}")

    result: dict[str, object] = {
        "generator": "tools/make_model_reference.py",
        "model": str(model_dir(family).relative_to(ROOT)),
        "reference": f"transformers {transformers.__version__} {family.model_class}, torch {torch.__version__}, "
                     "float32, greedy, full recompute per step",
        "max_new_tokens": MAX_NEW_TOKENS,
        "top_k": TOP_K,
        "min_top2_gap": min_gap,
        "cases": cases,
    }
    prompts = [c["prompt_token_ids"] for c in cases if len(c["prompt_token_ids"]) in family.variant_lengths]
    if name == "ernie45":
        result["bias_variant"], gap = variant(family, prompts, set_biases=True, use_bias=True)
    elif name == "qwen3":
        result["bias_variant"], gap = variant(family, prompts, set_biases=True, attention_bias=True)
    elif name == "llama3":
        result["rope"] = llama3_rope(model)
        result["bias_variant"], gap = llama_bias_variant(family, prompts)
    elif name == "ernie45_moe":
        result["routing"] = probe.stats()
        result["norm_min_variant"], gap = variant(family, prompts, set_biases=False, moe_norm_min=0.5)
        result["placement"] = moe_placement()
        print(f"routing: {result['routing']}, variant: {result['norm_min_variant']['routing']}")
    elif name == "qwen3_moe":
        result["routing"] = probe.stats()
        result["norm_topk_prob_variant"], gap = variant(family, prompts, set_biases=False, norm_topk_prob=False)
        result["placement"] = qwen3_moe_placement()
        print(f"routing: {result['routing']}, variant: {result['norm_topk_prob_variant']['routing']}")
    else:
        gap = float("inf")
    result["min_top2_gap"] = min_gap = min(min_gap, gap)
    print(f"{name}: smallest top-1/top-2 logprob gap: {min_gap:.4g}")
    if min_gap < 1e-3:
        raise SystemExit("a near tie would make the argmax comparison fragile: change the prompts' seed")
    out_file = REFERENCE / f"{family.fixture}_greedy.json"
    out_file.parent.mkdir(parents=True, exist_ok=True)
    out_file.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out_file}")


def main(argv: list[str]) -> None:
    unknown = sorted(set(argv) - set(FAMILIES))
    if unknown:
        raise SystemExit(f"unknown families {unknown}; choose from {sorted(FAMILIES)}")
    for name in argv or FAMILIES:
        run(name)


if __name__ == "__main__":
    main(sys.argv[1:])
