"""Fine-tune the demo model (models/ernie-4.5-demo) into one that copies text seen earlier in its context.

benchmarks/speculative.py's "copy" workload (a passage of prose, then its first words again) only exercises
n-gram speculation if the model really continues by copying the passage; the demo model writes its own prose
instead. This makes a benchmark-only variant: same ERNIE-4.5 dense architecture and tokenizer, weights
fine-tuned from the demo's on the Python 3.11 docs (the demo's corpus) shaped as "passage\\n\\npassage\\n\\n..."
(so an induction mechanism pays off), mixed with plain documentation windows so it stays a language model.
Written in the demo's Hugging Face layout (bf16 safetensors, its config and tokenizer files) to
benchmarks/.cache/ernie-4.5-demo-copy. The model code, corpus reader and checkpoint writer are
tools/train_demo_model.py's (importing it sets one OMP/MKL thread and MKL_DEBUG_CPU_TYPE before Paddle loads).

    nice -n 19 .venv/bin/python tools/train_copy_model.py     # --steps N1 N2 N3 --out DIR --lr X ...

and for llama.cpp, its converter (sentencepiece tokenizer: no pre-tokenizer check to answer):

    python convert_hf_to_gguf.py benchmarks/.cache/ernie-4.5-demo-copy --outtype f16 --outfile demo-copy-f16.gguf

Measured (2-core AMD EPYC Zen 4 VM, one thread, nice 19), default arguments: 800 steps in 20.0 min, 20.6 min in
all; teacher-forced copy accuracy on the benchmark's 87 copy prompts 11.4 % -> 87.3 %; held-out perplexity
51.0 -> 97.7 (it gives up some prose for copying). Greedy, it copies runs of the passage, with skips and the odd
loop: n-gram speculation kept 92 of 101 drafts over 128 tokens at one stream (benchmarks/speculative.py).
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import random
import shutil
import struct
import sys
import time
from pathlib import Path

import train_demo_model as tdm  # noqa: I001  (sets the thread environment before Paddle loads)
import numpy as np
import paddle
import paddle.nn.functional as F
import sentencepiece as spm
from tqdm import tqdm

DEMO = tdm.ROOT / "models" / "ernie-4.5-demo"
DEFAULT_OUT = tdm.ROOT / "benchmarks" / ".cache" / "ernie-4.5-demo-copy"
# (batch, sequence length, share of plain text windows): copying forms fastest on short sequences; the last phase
# covers the benchmark's longest prompts + 128 tokens (545 positions).
PHASES = ((16, 128, 0.0), (8, 256, 0.25), (4, 576, 0.25))
COPIED_FILES = ("config.json", "generation_config.json", "tokenizer.model", "tokenizer_config.json",
                "special_tokens_map.json", "added_tokens.json")
log = logging.getLogger("train_copy_model")


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """A bf16 (or f32) safetensors file as float32 arrays."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header, base, out = json.loads(raw[8:8 + n]), 8 + n, {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        lo, hi = t["data_offsets"]
        buf = raw[base + lo:base + hi]
        if t["dtype"] == "BF16":
            a = (np.frombuffer(buf, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
        elif t["dtype"] == "F32":
            a = np.frombuffer(buf, dtype="<f4").copy()
        else:
            raise ValueError(f"{path}: {name} has dtype {t['dtype']}")
        out[name] = a.reshape(t["shape"])
    return out


def load_demo(model_dir: Path) -> tdm.DemoErnie:
    """DemoErnie with the checkpoint's main-model weights: HF [out, in] -> Paddle [in, out], gate/up fused [gate | up]."""
    cfg = json.loads((model_dir / "config.json").read_text())
    args = tdm.ModelArgs(**{k: cfg[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                                "num_attention_heads", "num_key_value_heads", "head_dim",
                                                "rms_norm_eps")}, rope_theta=cfg["rope_parameters"]["rope_theta"])
    model = tdm.DemoErnie(args)
    # The demo's MTP head (model.mtp_*, tools/train_demo_mtp.py) is left out: it was fit to the demo's hidden states.
    sd = {k: v for k, v in read_safetensors(model_dir / "model.safetensors").items() if ".mtp_" not in k}
    model.embed_tokens.weight.set_value(sd.pop("model.embed_tokens.weight"))
    model.norm.weight.set_value(sd.pop("model.norm.weight"))
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        for norm in ("input_layernorm", "post_attention_layernorm"):
            getattr(layer, norm).weight.set_value(sd.pop(p + norm + ".weight"))
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            getattr(layer, name).weight.set_value(sd.pop(p + f"self_attn.{name}.weight").T.copy())
        gate, up = sd.pop(p + "mlp.gate_proj.weight"), sd.pop(p + "mlp.up_proj.weight")
        layer.gate_up_proj.weight.set_value(np.concatenate([gate.T, up.T], axis=1))
        layer.down_proj.weight.set_value(sd.pop(p + "mlp.down_proj.weight").T.copy())
    if sd:
        raise ValueError(f"unused tensors in {model_dir}: {sorted(sd)[:5]}")
    return model


def copy_example(texts: list[str], sp: spm.SentencePieceProcessor, rng: random.Random, pieces: list[int],
                 n_tokens: int, random_share: float = 0.4) -> tuple[list[int], int]:
    """(n_tokens ids, where the first repeat starts): a passage repeated after a separator until n_tokens, maybe
    after unrelated text. The passage is a span of a document (cut anywhere, up to half of n_tokens) or random
    pieces, which only copying predicts (what makes the copying circuit form quickly)."""
    def span(lo: int, hi: int) -> str:
        doc = rng.choice(texts)
        start = rng.randrange(max(1, len(doc) - lo))
        text = doc[start:start + rng.randint(lo, hi)]
        return " ".join(text.split()) if rng.random() < 0.5 else text  # the benchmark's passages are one line
    prefix = sp.encode(span(20, 2 * n_tokens) + "\n\n")[:n_tokens // 4] if rng.random() < 0.25 else []
    sep = rng.choice(["\n\n", "\n\n", "\n\n", "\n", " "])
    if rng.random() < random_share:
        # from a vocabulary of 4 to all pieces (log-uniform): the smaller, the longer the context a copy must match
        vocab = rng.sample(pieces, int(math.exp(rng.uniform(math.log(4), math.log(len(pieces))))))
        passage = [rng.choice(vocab) for _ in range(rng.randint(8, n_tokens // 2))]
        ids, again = prefix + passage, sp.encode(sep) + passage
    else:
        passage = sp.encode(span(50, min(1400, 2 * n_tokens)))[:n_tokens // 2]
        text = sp.decode(passage)
        ids, again = prefix + sp.encode(text + sep + text), sp.encode(sep + text)  # each repeat as one string
    first = len(prefix) + len(passage)
    while len(ids) < n_tokens:
        ids += again
    return ids[:n_tokens], first


def batch(stream: np.ndarray, texts: list[str], sp: spm.SentencePieceProcessor, rng: random.Random,
          pieces: list[int], size: int, seq_len: int, plain_share: float) -> tuple[np.ndarray, np.ndarray]:
    """(ids [size, seq_len + 1], loss mask over the targets [size, seq_len]): plain windows count every token,
    copy examples only those after the first copy of the passage."""
    rows, masks = [], np.ones((size, seq_len), dtype=np.float32)
    for i in range(size):
        if rng.random() < plain_share:
            s = rng.randrange(len(stream) - seq_len - 1)
            rows.append(stream[s:s + seq_len + 1])
        else:
            ids, first = copy_example(texts, sp, rng, pieces, seq_len + 1)
            rows.append(np.asarray(ids))
            masks[i, :first] = 0.0
    return np.stack(rows).astype(np.int64), masks


@paddle.no_grad()
def copy_accuracy(model: tdm.DemoErnie, sp: spm.SentencePieceProcessor, prompts: list[str], n: int = 128) -> float:
    """Teacher-forced share of the n tokens after each benchmark copy prompt that greedy decoding would copy."""
    model.eval()
    hits = total = 0
    for prompt in prompts:
        passage = prompt.split("\n\n")[0]
        ids = sp.encode(prompt + passage[len(prompt.split("\n\n")[1]):] + "\n\n" + passage)
        start = len(sp.encode(prompt)) - 1
        ids = ids[:start + n + 1]
        pred = model(paddle.to_tensor([ids[:-1]])).argmax(-1).numpy()[0]
        hits += int((pred[start:] == np.asarray(ids[start + 1:])).sum())
        total += len(ids) - 1 - start
    model.train()
    return hits / total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpus", default=tdm.DEFAULT_CORPUS)
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    ap.add_argument("--steps", type=int, nargs=3, default=[350, 350, 100], metavar=("N1", "N2", "N3"),
                    help="steps of each phase: " + ", ".join(f"{b} x {t}" for b, t, _ in PHASES) + " tokens")
    ap.add_argument("--lr", type=float, default=2e-3, help="peak; constant in phase 1, then cosine to 1/10")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--seed", type=int, default=tdm.SEED)
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(message)s", datefmt="%H:%M:%S")
    t0 = time.time()
    paddle.set_device("cpu")
    if hasattr(paddle.base.core, "set_num_threads"):
        paddle.base.core.set_num_threads(1)
    paddle.seed(a.seed)
    rng = random.Random(a.seed)

    sys.path.insert(0, str(tdm.ROOT / "benchmarks"))
    from speculative import passages, prompts  # the benchmark's copy prompts, for the accuracy figure only
    bench = prompts("copy", len(passages()), 0, 0)
    sp = spm.SentencePieceProcessor(model_file=str(DEMO / "tokenizer.model"))
    train, held, _, train_texts = tdm.split_corpus(tdm.load_documents(Path(a.corpus)), a.seed, 0.02)
    texts = [d.text for d in train]
    pieces = [i for i in range(sp.get_piece_size()) if not (sp.is_control(i) or sp.is_unknown(i) or sp.is_byte(i)
                                                            or sp.id_to_piece(i).startswith("<"))]
    stream, held_ids = tdm.encode_stream(sp, train_texts), tdm.encode_stream(sp, [d.text for d in held])
    model = load_demo(DEMO)
    before = (math.exp(tdm.heldout_nll(model, held_ids, 256, 16, max_windows=64)), copy_accuracy(model, sp, bench))
    log.info("demo model: held-out ppl %.2f, copy accuracy %.1f%%; %.0f s so far", before[0], 100 * before[1],
             time.time() - t0)

    decay = {p.name for p in model.parameters() if len(p.shape) >= 2}
    opt = paddle.optimizer.AdamW(learning_rate=a.lr, parameters=model.parameters(), beta1=0.9, beta2=0.95,
                                 weight_decay=0.1, apply_decay_param_fun=lambda n: n in decay,
                                 grad_clip=paddle.nn.ClipGradByGlobalNorm(1.0))
    t_train, smooth, steps = time.time(), None, sum(a.steps)
    phase_of = [i for i, n in enumerate(a.steps) for _ in range(n)]
    with tqdm(range(1, steps + 1), desc="fine-tuning", mininterval=10) as bar:
        for step in bar:
            frac = max(0.0, (step - a.steps[0]) / (steps - a.steps[0]))
            opt.set_lr(a.lr * min(1.0, step / a.warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * frac))))
            ids, mask = batch(stream, texts, sp, rng, pieces, *PHASES[phase_of[step - 1]])
            w, mask = paddle.to_tensor(ids), paddle.to_tensor(mask.reshape([-1]))
            logits = model(w[:, :-1])
            nll = F.cross_entropy(logits.reshape([-1, logits.shape[-1]]), w[:, 1:].reshape([-1, 1]), reduction="none")
            loss = (nll.reshape([-1]) * mask).sum() / mask.sum().clip(min=1.0)
            loss.backward()
            opt.step()
            opt.clear_grad()
            smooth = float(loss) if smooth is None else 0.95 * smooth + 0.05 * float(loss)
            bar.set_postfix(loss=f"{smooth:.3f}", refresh=False)
            if step % 50 == 0 and step < steps:
                log.info("step %d: loss %.3f, copy accuracy %.1f%% (first 8 prompts)", step, smooth,
                         100 * copy_accuracy(model, sp, bench[:8]))
    train_s = time.time() - t_train

    tdm.round_to_bf16(model)  # evaluate what is shipped
    ppl, acc = math.exp(tdm.heldout_nll(model, held_ids, 256, 16, max_windows=64)), copy_accuracy(model, sp, bench)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in COPIED_FILES:
        shutil.copy2(DEMO / name, out / name)
    tdm.save_safetensors_bf16(tdm.hf_state_dict(model), out / "model.safetensors")
    print(f"wrote {out}: {' + '.join(map(str, a.steps))} steps in {train_s / 60:.1f} min "
          f"({(time.time() - t0) / 60:.1f} min in all); teacher-forced copy accuracy on the benchmark's "
          f"{len(bench)} copy prompts {100 * before[1]:.1f}% -> {100 * acc:.1f}%, held-out perplexity "
          f"(first 64 windows of 256) {before[0]:.2f} -> {ppl:.2f}")


if __name__ == "__main__":
    main()
