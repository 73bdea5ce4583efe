"""Record transformers' greedy outputs for the tiny checkpoints (the parity tests' references).

    /work/refvenv/bin/python tools/make_model_reference.py [family ...]   # ernie45 ernie45_moe qwen2 qwen3

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
Writes tests/fixtures/reference/<fixture>_greedy.json. Rerun after tools/make_tiny_models.py.
"""
from __future__ import annotations

import json
import sys
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
}


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


def load(family: Family, **config_changes: object) -> torch.nn.Module:
    path = model_dir(family)
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
    return model.eval()


@torch.no_grad()
def variant(family: Family, prompts: list[list[int]], set_biases: bool, **config_changes: object
            ) -> tuple[dict[str, object], float]:
    """Greedy cases with `config_changes` applied: {"config"?, "biases"?, "cases", "routing"?}."""
    model = load(family, **config_changes)
    probe = RoutingProbe(model) if family.model_class == "Ernie4_5_MoeForCausalLM" else None
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
    """Forward hooks on transformers' MoE routers, recomputing their float32 choice scores."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.margin, self.bias_changed, self.clamped, self.choices = float("inf"), 0, 0, 0
        routers = [m for m in model.modules() if type(m).__name__ == "Ernie4_5_MoeTopKRouter"]
        assert routers, "no MoE router found"
        self.handles = [r.register_forward_hook(self.hook) for r in routers]

    def hook(self, router: torch.nn.Module, args: tuple[torch.Tensor, ...], output: object) -> None:
        probs = torch.softmax(torch.nn.functional.linear(args[0].float(), router.weight.float()), dim=-1)
        choice = probs + router.moe_statics.e_score_correction_bias.squeeze()
        k = router.top_k
        ordered = torch.sort(choice, dim=-1, descending=True).values
        self.margin = min(self.margin, float((ordered[:, k - 1] - ordered[:, k]).min()))
        with_bias = torch.topk(choice, k).indices.sort(-1).values
        without = torch.topk(probs, k).indices.sort(-1).values
        self.bias_changed += int((with_bias != without).any(-1).sum())
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


def run(name: str) -> None:
    family = FAMILIES[name]
    torch.manual_seed(SEED)
    model = load(family)
    probe = RoutingProbe(model) if name == "ernie45_moe" else None

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
    elif name == "ernie45_moe":
        result["routing"] = probe.stats()
        result["norm_min_variant"], gap = variant(family, prompts, set_biases=False, moe_norm_min=0.5)
        result["placement"] = moe_placement()
        print(f"routing: {result['routing']}, variant: {result['norm_min_variant']['routing']}")
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
