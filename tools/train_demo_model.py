"""Train the small bundled demo model models/ernie-4.5-demo (ERNIE-4.5 dense architecture, Paddle, CPU).

Run (from the repository root; needs Debian's python3.11-doc package for the corpus):

    apt-get install -y python3.11-doc
    nohup .venv/bin/python tools/train_demo_model.py > /tmp/train_demo.log 2>&1 &
    .venv/bin/python tools/train_demo_model.py --corpus DIR --out DIR --steps N   # other corpus / length

Corpus: the Python 3.11 documentation as Debian ships it (HTML under /usr/share/doc/python3.11/html,
PSF licence), turned into plain text with the stdlib html.parser. Index/search pages are skipped; 2% of
the HTML files (seeded choice) are held out for perplexity. A small share of the training stream is the
same documentation reshaped into ERNIE chat turns (a section heading asked as a question, the section's
first paragraphs as the answer) so that LLM.chat gets answers that end with the end-of-turn token.

Tokenizer: sentencepiece BPE trained here on the training documents, laid out like
tests/fixtures/tokenizers/ernie_sp (see tools/make_tiny_tokenizers.py): <unk>=0, <s>=1, </s>=2,
<mask:0..7>, <|begin_of_sentence|>, <|end_of_sentence|>, <think>, </think>, byte fallback, identity
normalisation; image/audio/location tokens beyond the sentencepiece model in added_tokens.json.

Model: ERNIE-4.5 dense as transformers' Ernie4_5ForCausalLM computes it (RMSNorm, interleaved rotary,
GQA, SiLU-gated MLP, no bias, tied embeddings), written here with plain causal attention for training.
Saved in the Hugging Face layout (model.* keys, linear weights [out, in], bf16 safetensors).

Reproducible: fixed seed, one thread (OMP_NUM_THREADS=1, set below before Paddle loads), fixed step count.
MKL_DEBUG_CPU_TYPE=5 is also set before Paddle loads: the MKL bundled with the Paddle CPU wheel otherwise
takes a slow generic path on AMD CPUs (measured here: 35 -> 85 GFLOP/s single-thread fp32 GEMM).

Measured on this machine (2-core AMD EPYC VM, shared with other work), default arguments:
  corpus + tokenizer 20 s; 720 steps of 16 x 256 tokens (2.9 M tokens, 1.0 epoch) at ~1,330 tokens/s in
  36.7 min; 37.4 min in all. 5.77 M parameters, 11.5 MB checkpoint. Held-out perplexity 47.99 per token
  (1.750 bits/char; same with the shipped bf16 weights). Reruns give byte-identical files (checked:
  tokenizer over two full runs, checkpoint over two 4-step runs).
  Greedy 'The list type' -> ' is a tuple of the type of the type.\n\nThe type of the type object is ...'
"""
from __future__ import annotations

import os

# Before Paddle (and its MKL/OpenMP) is imported; setdefault so a caller may still choose otherwise.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("MKL_DEBUG_CPU_TYPE", "5")

import argparse  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import random  # noqa: E402
import re  # noqa: E402
import struct  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from dataclasses import asdict, dataclass  # noqa: E402
from html.parser import HTMLParser  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import paddle  # noqa: E402
import paddle.nn.functional as F  # noqa: E402
import sentencepiece as spm  # noqa: E402
from paddle import nn  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CORPUS = "/usr/share/doc/python3.11/html"
DEFAULT_OUT = ROOT / "models" / "ernie-4.5-demo"
SEED = 1234

# ---------------------------------------------------------------- corpus

SKIP_FILES = re.compile(r"^(genindex.*|py-modindex|search|contents|download|bugs|copyright)\.html$")
BLOCK_TAGS = {"p", "div", "section", "h1", "h2", "h3", "h4", "h5", "h6", "li", "dt", "dd", "pre", "tr",
              "table", "blockquote", "ul", "ol", "dl", "br", "caption", "figure"}
HEADINGS = {"h1", "h2", "h3", "h4", "h5", "h6"}


class _DocText(HTMLParser):
    """Collects the main body of a Sphinx page as blocks (tag, text): headings, paragraphs, code."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.blocks: list[tuple[str, str]] = []
        self._main_depth = 0  # div nesting inside <div role="main">; 0 = outside
        self._skip_depth = 0  # inside a permalink anchor or script/style
        self._pre = 0
        self._kind = "p"
        self._buf: list[str] = []

    def _flush(self) -> None:
        text = "".join(self._buf)
        self._buf = []
        text = text.strip("\n") if self._pre else " ".join(text.split())
        if text.strip():
            self.blocks.append(("pre" if self._pre else self._kind, text))

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if not self._main_depth:
            if tag == "div" and a.get("role") == "main":
                self._main_depth = 1
            return
        if tag == "div":
            self._main_depth += 1
        if self._skip_depth or tag in ("script", "style") or (tag == "a" and "headerlink" in (a.get("class") or "")):
            self._skip_depth += 1
            return
        if tag in BLOCK_TAGS:
            self._flush()
            if tag == "pre":
                self._pre += 1
            self._kind = tag if tag in HEADINGS or tag in ("dt", "li") else "p"

    def handle_endtag(self, tag: str) -> None:
        if not self._main_depth:
            return
        if self._skip_depth:
            if tag in ("a", "script", "style"):
                self._skip_depth -= 1
            return
        if tag in BLOCK_TAGS:
            self._flush()
            if tag == "pre":
                self._pre = max(0, self._pre - 1)
            self._kind = "p"
        if tag == "div":
            self._main_depth -= 1

    def handle_data(self, data: str) -> None:
        if self._main_depth and not self._skip_depth:
            self._buf.append(data)


@dataclass(slots=True)
class Document:
    name: str
    blocks: list[tuple[str, str]]

    @property
    def text(self) -> str:
        return "\n\n".join(t for _, t in self.blocks)


def load_documents(corpus_dir: Path) -> list[Document]:
    docs = []
    for path in sorted(corpus_dir.rglob("*.html")):
        rel = path.relative_to(corpus_dir).as_posix()
        if SKIP_FILES.match(path.name) and "/" not in rel:
            continue
        parser = _DocText()
        parser.feed(path.read_text(encoding="utf-8", errors="replace"))
        parser.close()
        if sum(len(t) for _, t in parser.blocks) > 200:
            docs.append(Document(rel, parser.blocks))
    if not docs:
        raise ValueError(f"corpus: no Sphinx HTML pages with text under {corpus_dir}")
    return docs


QUESTIONS = ["Tell me about {t}.", "Can you explain {t}?", "Please describe {t}.",
             "I have a question about {t}.", "What should I know about {t}?"]
PROPER = {"Python", "Unix", "Windows", "Linux", "Mac", "Unicode", "Tk", "Tkinter", "Sphinx", "C", "I", "Internet"}
SYSTEMS = ["You are a helpful Python tutor.", "You are a helpful assistant.",
           "Answer questions about Python."]


def _clean_heading(text: str) -> str:
    """"7.2. Reading and Writing Files" -> "reading and writing files"; names and acronyms stay."""
    text = re.sub(r"^[\d.]+\s+", "", text).split(" — ")[0].strip()
    return " ".join(w.lower() if re.fullmatch(r"[A-Z][a-z]+", w) and w not in PROPER else w
                    for w in text.split())


def chat_examples(docs: list[Document], rng: random.Random) -> list[str]:
    """ERNIE chat turns from (heading, first prose paragraphs) pairs of the training documents."""
    out = []
    for doc in docs:
        if doc.name.startswith("whatsnew/"):  # "What should I know about removed?" teaches nothing
            continue
        for i, (kind, text) in enumerate(doc.blocks):
            if kind not in HEADINGS:
                continue
            answer: list[str] = []
            # The prose right under the heading, up to code, a definition list or the next heading.
            for kind2, text2 in doc.blocks[i + 1:]:
                if kind2 in HEADINGS or kind2 in ("pre", "dt") or len(" ".join(answer)) > 400:
                    break
                if kind2 == "p" and len(text2) > 40:
                    answer.append(text2)
            while answer and answer[-1].endswith(":"):  # "... the following methods:" leads nowhere
                answer.pop()
            topic = _clean_heading(text)
            if not answer or not 2 < len(topic) < 60 or topic.startswith("about "):
                continue
            question = rng.choice(QUESTIONS).format(t=topic)
            system = rng.choice(SYSTEMS) + "\n" if rng.random() < 0.3 else ""
            out.append(f"<|begin_of_sentence|>{system}User: {question}\nAssistant: "
                       f"{' '.join(answer)}<|end_of_sentence|>")
    return out


def split_corpus(docs: list[Document], seed: int,
                 heldout_frac: float) -> tuple[list[Document], list[Document], list[str], list[str]]:
    """(training docs, held-out docs, chat turns, shuffled training texts = docs + chats), drawn from seed."""
    rng = random.Random(seed)
    order = list(range(len(docs)))
    rng.shuffle(order)
    n_held = max(1, round(len(docs) * heldout_frac))
    held = [docs[i] for i in sorted(order[:n_held])]
    train = [docs[i] for i in sorted(order[n_held:])]
    chats = chat_examples(train, rng)
    train_texts = [d.text for d in train] + chats
    rng.shuffle(train_texts)
    return train, held, chats, train_texts


# ---------------------------------------------------------------- tokenizer

IN_MODEL_SPECIALS = ["<mask:%d>" % i for i in range(8)] + [
    "<|begin_of_sentence|>", "<|end_of_sentence|>", "<think>", "</think>"]
BEYOND_MODEL = ["<|IMAGE_PLACEHOLDER|>", "<|AUDIO_PLACEHOLDER|>"] + ["<|LOC_%d|>" % i for i in range(4)]
NAMED_SPECIALS = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<unk>",
                  "cls_token": "<|begin_of_sentence|>", "sep_token": "<|end_of_sentence|>",
                  "mask_token": "<mask:1>"}


def train_tokenizer(texts: list[str], vocab_size: int) -> bytes:
    """Sentencepiece model with vocab_size - len(BEYOND_MODEL) pieces; the rest are added tokens."""
    lines = [line for text in texts for line in text.split("\n") if line.strip()]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model, model_type="bpe",
        vocab_size=vocab_size - len(BEYOND_MODEL), character_coverage=0.9995, byte_fallback=True,
        split_digits=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, unk_piece="<unk>", bos_piece="<s>",
        eos_piece="</s>", user_defined_symbols=IN_MODEL_SPECIALS, add_dummy_prefix=False,
        remove_extra_whitespaces=False, normalization_rule_name="identity", allow_whitespace_only_pieces=True,
        input_sentence_size=0, shuffle_input_sentence=False, num_threads=1, max_sentence_length=1 << 16,
        minloglevel=2,
    )
    return model.getvalue()


def write_tokenizer_files(out: Path, sp_model: bytes, chat_template: str) -> None:
    (out / "tokenizer.model").write_bytes(sp_model)
    sp = spm.SentencePieceProcessor(model_proto=sp_model)
    n = sp.get_piece_size()
    _write_json(out / "added_tokens.json", {tok: n + i for i, tok in enumerate(BEYOND_MODEL)})
    _write_json(out / "special_tokens_map.json", {**NAMED_SPECIALS, "additional_special_tokens": BEYOND_MODEL})
    _write_json(out / "tokenizer_config.json", {
        **NAMED_SPECIALS,
        "sys_start_token": "<mask:4>", "sys_end_token": "<mask:5>",
        "header_start_token": "<mask:6>", "header_end_token": "<mask:7>",
        "additional_special_tokens": None,
        "tokenizer_class": "Ernie4_5_Tokenizer",
        "chat_template": chat_template,
    })


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")


# ---------------------------------------------------------------- model

@dataclass(slots=True)
class ModelArgs:
    vocab_size: int = 4096
    hidden_size: int = 256
    intermediate_size: int = 768
    num_hidden_layers: int = 6
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    rms_norm_eps: float = 1e-5
    rope_theta: float = 500000.0


class RMSNorm(nn.Layer):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = self.create_parameter([dim], default_initializer=nn.initializer.Constant(1.0))
        self.eps = eps

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        # x * x, not x.pow(2): Paddle's CPU pow kernel is several times slower.
        return x * paddle.rsqrt((x * x).mean(-1, keepdim=True) + self.eps) * self.weight


class Rotary:
    """ERNIE's rotary embedding: pair (2i, 2i+1) of each head turns by position * theta^(-2i/head_dim).

    out = x * cos + swap(x) * sin with swap(x)[2i] = -x[2i+1], swap(x)[2i+1] = x[2i]. The swap is a
    [head_dim, head_dim] matmul and cos/sin are cached at the full [B, T, heads, head_dim] shape, because
    Paddle's CPU kernels for strided slices and broadcasting elementwise ops are far slower than these.
    """

    def __init__(self, args: ModelArgs) -> None:
        d = args.head_dim
        self.inv_freq = 1.0 / (args.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
        swap = np.zeros((d, d), dtype=np.float32)
        swap[np.arange(1, d, 2), np.arange(0, d, 2)] = -1.0
        swap[np.arange(0, d, 2), np.arange(1, d, 2)] = 1.0
        self.swap = paddle.to_tensor(swap)
        self._tables: dict[tuple[int, ...], tuple[paddle.Tensor, paddle.Tensor]] = {}

    def __call__(self, x: paddle.Tensor) -> paddle.Tensor:
        shape = tuple(x.shape)
        if shape not in self._tables:
            b, t, h, d = shape
            angles = np.repeat(np.arange(t, dtype=np.float64)[:, None] * self.inv_freq[None, :], 2, axis=1)
            full = lambda a: paddle.to_tensor(np.ascontiguousarray(  # noqa: E731
                np.broadcast_to(a[None, :, None, :], shape).astype(np.float32)))
            if len(self._tables) > 8:
                self._tables.clear()
            self._tables[shape] = (full(np.cos(angles)), full(np.sin(angles)))
        cos, sin = self._tables[shape]
        return x * cos + paddle.matmul(x, self.swap) * sin


class Block(nn.Layer):
    def __init__(self, args: ModelArgs, rotary: Rotary) -> None:
        super().__init__()
        d, hd = args.hidden_size, args.head_dim
        self.args, self.rotary = args, rotary
        self.input_layernorm = RMSNorm(d, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(d, args.rms_norm_eps)
        self.q_proj = nn.Linear(d, args.num_attention_heads * hd, bias_attr=False)
        self.k_proj = nn.Linear(d, args.num_key_value_heads * hd, bias_attr=False)
        self.v_proj = nn.Linear(d, args.num_key_value_heads * hd, bias_attr=False)
        self.o_proj = nn.Linear(args.num_attention_heads * hd, d, bias_attr=False)
        # [gate | up] in one matmul: F.swiglu splits it without the slow slice backward.
        self.gate_up_proj = nn.Linear(d, 2 * args.intermediate_size, bias_attr=False)
        self.down_proj = nn.Linear(args.intermediate_size, d, bias_attr=False)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        a, (b, t, _) = self.args, x.shape
        h = self.input_layernorm(x)
        q = self.rotary(self.q_proj(h).reshape([b, t, a.num_attention_heads, a.head_dim]))
        k = self.rotary(self.k_proj(h).reshape([b, t, a.num_key_value_heads, a.head_dim]))
        v = self.v_proj(h).reshape([b, t, a.num_key_value_heads, a.head_dim])
        # Grouped-query attention: query head i reads key/value head i // groups, as transformers' repeat_kv.
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o_proj(attn.reshape([b, t, a.num_attention_heads * a.head_dim]))
        return x + self.down_proj(F.swiglu(self.gate_up_proj(self.post_attention_layernorm(x))))


class DemoErnie(nn.Layer):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        init = nn.initializer.Normal(std=0.02)
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size, weight_attr=init)
        rotary = Rotary(args)
        self.layers = nn.LayerList([Block(args, rotary) for _ in range(args.num_hidden_layers)])
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        # GPT-2 style: residual-branch outputs start smaller the deeper the model.
        out_std = 0.02 / math.sqrt(2 * args.num_hidden_layers)
        for layer in self.layers:
            for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj"):
                w = getattr(layer, name).weight
                w.set_value(paddle.normal(0.0, out_std if name in ("o_proj", "down_proj") else 0.02, w.shape))

    def forward(self, ids: paddle.Tensor) -> paddle.Tensor:
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x)
        return paddle.matmul(self.norm(x), self.embed_tokens.weight, transpose_y=True)  # tied lm_head


def num_params(model: nn.Layer) -> int:
    return sum(int(np.prod(p.shape)) for p in model.parameters())


# ---------------------------------------------------------------- checkpoint (HF layout)

def _bf16_bytes(a: np.ndarray) -> bytes:
    """float32 -> bfloat16 with round-to-nearest-even, as torch's .to(torch.bfloat16)."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return rounded.astype("<u2").tobytes()


def hf_state_dict(model: DemoErnie) -> dict[str, np.ndarray]:
    sd = {"model.embed_tokens.weight": model.embed_tokens.weight.numpy(),
          "model.norm.weight": model.norm.weight.numpy()}
    for i, layer in enumerate(model.layers):
        sd.update(block_state_dict(layer, f"model.layers.{i}."))
    return sd


def block_state_dict(layer: Block, p: str) -> dict[str, np.ndarray]:
    """One decoder layer's tensors under prefix p in the HF layout (linear weights [out, in])."""
    sd = {p + "input_layernorm.weight": layer.input_layernorm.weight.numpy(),
          p + "post_attention_layernorm.weight": layer.post_attention_layernorm.weight.numpy()}
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        sd[p + f"self_attn.{name}.weight"] = getattr(layer, name).weight.numpy().T  # Paddle [in, out]
    gate, up = np.split(layer.gate_up_proj.weight.numpy(), 2, axis=1)
    sd[p + "mlp.gate_proj.weight"] = gate.T
    sd[p + "mlp.up_proj.weight"] = up.T
    sd[p + "mlp.down_proj.weight"] = layer.down_proj.weight.numpy().T
    return sd


def save_safetensors_bf16(sd: dict[str, np.ndarray], path: Path) -> None:
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    chunks, offset = [], 0
    for name in sorted(sd):
        data = _bf16_bytes(sd[name])
        header[name] = {"dtype": "BF16", "shape": list(sd[name].shape), "data_offsets": [offset, offset + len(data)]}
        chunks.append(data)
        offset += len(data)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for c in chunks:
            f.write(c)
    tmp.replace(path)  # a reader never sees a half-written checkpoint


def write_configs(out: Path, args: ModelArgs, sep_id: int) -> None:
    _write_json(out / "config.json", {
        "architectures": ["Ernie4_5ForCausalLM"],
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
        "hidden_act": "silu",
        "hidden_size": args.hidden_size,
        "intermediate_size": args.intermediate_size,
        "max_position_embeddings": 2048,
        "model_type": "ernie4_5",
        "num_attention_heads": args.num_attention_heads,
        "num_key_value_heads": args.num_key_value_heads,
        "head_dim": args.head_dim,
        "num_hidden_layers": args.num_hidden_layers,
        "rms_norm_eps": args.rms_norm_eps,
        "use_cache": False,
        "vocab_size": args.vocab_size,
        "use_bias": False,
        "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": args.rope_theta},
        "torch_dtype": "bfloat16",
    })
    # Chat turns end with <|end_of_sentence|>, documents with </s>: generation stops at either.
    _write_json(out / "generation_config.json", {
        "do_sample": True, "top_p": 0.8, "temperature": 0.8, "repetition_penalty": 1.0,
        "frequency_penalty": 0.0, "presence_penalty": 0.0,
        "bos_token_id": 1, "eos_token_id": [2, sep_id], "pad_token_id": 0,
    })


# ---------------------------------------------------------------- data

def encode_stream(sp: spm.SentencePieceProcessor, texts: list[str]) -> np.ndarray:
    """One token stream; plain documents end with </s>, chat turns already end with the sep token."""
    ids: list[int] = []
    for text, pieces in zip(texts, sp.encode(texts)):
        if text.endswith("<|end_of_sentence|>"):
            # Tokenized as the engine sees it: the prompt up to "Assistant: " alone, then the answer.
            # Whole, " These" would be one piece after ":" while a prompt ends in a lone space piece.
            head, cue, answer = text.rpartition("Assistant: ")
            ids.extend(sp.encode(head + cue) + sp.encode(answer))
        else:
            ids.extend(pieces)
            ids.append(sp.eos_id())
    return np.asarray(ids, dtype=np.int64)


def batches(stream: np.ndarray, seq_len: int, batch: int, rng: np.random.Generator):
    """Endless shuffled non-overlapping windows of seq_len + 1 tokens; each epoch shifts the grid."""
    while True:
        starts = np.arange(int(rng.integers(seq_len)), len(stream) - seq_len - 1, seq_len)
        rng.shuffle(starts)
        for i in range(0, len(starts) - batch + 1, batch):
            yield np.stack([stream[s:s + seq_len + 1] for s in starts[i:i + batch]])


@paddle.no_grad()
def heldout_nll(model: DemoErnie, stream: np.ndarray, seq_len: int, batch: int, max_windows: int = 0) -> float:
    """Mean next-token NLL over non-overlapping seq_len windows (each window starts without context)."""
    model.eval()
    n = (len(stream) - 1) // seq_len
    if max_windows:
        n = min(n, max_windows)
    total, count = 0.0, 0
    for i in range(0, n, batch):
        idx = range(i, min(n, i + batch))
        w = np.stack([stream[j * seq_len:j * seq_len + seq_len + 1] for j in idx])
        logits = model(paddle.to_tensor(w[:, :-1]))
        loss = F.cross_entropy(logits.reshape([-1, logits.shape[-1]]), paddle.to_tensor(w[:, 1:].reshape([-1, 1])),
                               reduction="sum")
        total += float(loss)
        count += w[:, 1:].size
    model.train()
    return total / count


@paddle.no_grad()
def greedy(model: DemoErnie, ids: list[int], max_new: int, stop: set[int]) -> list[int]:
    model.eval()
    out: list[int] = []
    for _ in range(max_new):
        logits = model(paddle.to_tensor([ids + out]))
        nxt = int(paddle.argmax(logits[0, -1]))
        out.append(nxt)
        if nxt in stop:
            break
    model.train()
    return out


def round_to_bf16(model: nn.Layer) -> None:
    """What the shipped checkpoint holds: every weight rounded to bfloat16 (kept as float32 values)."""
    for p in model.parameters():
        u = np.frombuffer(_bf16_bytes(p.numpy()), dtype="<u2").astype(np.uint32) << 16
        p.set_value(u.view(np.float32).reshape(p.shape))


# ---------------------------------------------------------------- main

SAMPLE_PROMPTS = ["The list type", "To open a file", "A dictionary maps", "Exceptions are raised when"]
SAMPLE_CHATS = [[{"role": "user", "content": "How do I read a file line by line?"}],
                [{"role": "system", "content": "You are a helpful Python tutor."},
                 {"role": "user", "content": "What is a generator?"}]]


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpus", default=DEFAULT_CORPUS, help="directory of the Python docs HTML")
    ap.add_argument("--out", default=str(DEFAULT_OUT), help="checkpoint directory to write")
    ap.add_argument("--steps", type=int, default=720)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=60)
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--hidden-size", type=int, default=256)
    ap.add_argument("--intermediate-size", type=int, default=768)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--heldout-frac", type=float, default=0.02)
    ap.add_argument("--eval-every", type=int, default=160)
    ap.add_argument("--save-every", type=int, default=80)
    ap.add_argument("--seed", type=int, default=SEED)
    return ap.parse_args()


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def main() -> None:
    a = parse_args()
    t_start = time.time()
    paddle.set_device("cpu")
    if hasattr(paddle.base.core, "set_num_threads"):  # Paddle's own BLAS thread setting, besides OMP
        paddle.base.core.set_num_threads(1)
    paddle.seed(a.seed)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)

    train, held, chats, train_texts = split_corpus(load_documents(Path(a.corpus)), a.seed, a.heldout_frac)
    log(f"corpus: {len(train)} training docs ({sum(len(d.text) for d in train) / 1e6:.1f} M chars) + "
        f"{len(chats)} chat turns, {len(held)} held out: {', '.join(d.name for d in held)}")

    fixture = json.loads((ROOT / "tests/fixtures/tokenizers/ernie_sp/tokenizer_config.json").read_text())
    sp_model = train_tokenizer([d.text for d in train] + chats, a.vocab_size)
    write_tokenizer_files(out, sp_model, fixture["chat_template"])
    sp = spm.SentencePieceProcessor(model_proto=sp_model)
    sep_id = sp.piece_to_id("<|end_of_sentence|>")
    train_ids = encode_stream(sp, train_texts)
    held_ids = encode_stream(sp, [d.text for d in held])
    held_chars = sum(len(d.text) + 1 for d in held)
    log(f"tokenizer: {sp.get_piece_size()} pieces + {len(BEYOND_MODEL)} added; train {len(train_ids) / 1e6:.2f} M "
        f"tokens, held-out {len(held_ids) / 1e3:.0f} k tokens; {time.time() - t_start:.0f} s so far")

    args = ModelArgs(vocab_size=a.vocab_size, hidden_size=a.hidden_size, intermediate_size=a.intermediate_size,
                     num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
                     head_dim=a.hidden_size // a.heads)
    write_configs(out, args, sep_id)
    model = DemoErnie(args)
    decay = {p.name for p in model.parameters() if len(p.shape) >= 2}
    opt = paddle.optimizer.AdamW(learning_rate=a.lr, parameters=model.parameters(), beta1=0.9, beta2=0.95,
                                 weight_decay=0.1, apply_decay_param_fun=lambda n: n in decay,
                                 grad_clip=nn.ClipGradByGlobalNorm(1.0))
    log(f"model: {num_params(model) / 1e6:.2f} M parameters {asdict(args)}; {a.steps} steps x "
        f"{a.batch_size} x {a.seq_len} tokens = {a.steps * a.batch_size * a.seq_len / 1e6:.1f} M tokens "
        f"({a.steps * a.batch_size * a.seq_len / len(train_ids):.2f} epochs)")

    data = batches(train_ids, a.seq_len, a.batch_size, np.random.default_rng(a.seed))
    t_train, smooth = time.time(), None
    for step in range(1, a.steps + 1):
        # Linear warm-up, then cosine decay to a tenth of the peak rate.
        frac = min(1.0, (step - a.warmup) / max(1, a.steps - a.warmup)) if step > a.warmup else 0.0
        opt.set_lr(a.lr * step / a.warmup if step <= a.warmup else a.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * frac))))
        w = paddle.to_tensor(next(data))
        logits = model(w[:, :-1])
        loss = F.cross_entropy(logits.reshape([-1, args.vocab_size]), w[:, 1:].reshape([-1, 1]))
        loss.backward()
        opt.step()
        opt.clear_grad()
        smooth = float(loss) if smooth is None else 0.95 * smooth + 0.05 * float(loss)
        if step % 20 == 0 or step == 1:
            el = time.time() - t_train
            log(f"step {step}/{a.steps} loss {smooth:.3f} lr {opt.get_lr():.2e} {el:.0f} s "
                f"({step * a.batch_size * a.seq_len / el:.0f} tok/s, eta {el / step * (a.steps - step):.0f} s)")
        if step % a.eval_every == 0 and step < a.steps:
            nll = heldout_nll(model, held_ids, a.seq_len, a.batch_size, max_windows=64)
            log(f"step {step}: held-out ppl (first 64 windows) {math.exp(nll):.2f}")
        if step % a.save_every == 0 or step == a.steps:
            save_safetensors_bf16(hf_state_dict(model), out / "model.safetensors")
    train_s = time.time() - t_train

    nll32 = heldout_nll(model, held_ids, a.seq_len, a.batch_size)
    round_to_bf16(model)
    nll = heldout_nll(model, held_ids, a.seq_len, a.batch_size)
    bpc = nll * (len(held_ids) - 1) / held_chars / math.log(2)
    log(f"held-out perplexity {math.exp(nll):.2f} (bf16 weights; fp32 {math.exp(nll32):.2f}), "
        f"{bpc:.3f} bits/char, training {train_s / 60:.1f} min")
    save_safetensors_bf16(hf_state_dict(model), out / "model.safetensors")

    stop = {sp.eos_id(), sep_id}
    samples = []
    for prompt in SAMPLE_PROMPTS:
        ids = sp.encode(prompt)
        samples.append((prompt, sp.decode(greedy(model, ids, 40, stop))))
    from jinja2 import Environment  # the chat template as the engine renders it
    tmpl = Environment().from_string(fixture["chat_template"])
    for conv in SAMPLE_CHATS:
        prompt = tmpl.render(messages=conv, add_generation_prompt=True, **NAMED_SPECIALS)
        gen = greedy(model, sp.encode(prompt), 60, stop)
        samples.append((prompt, sp.decode([t for t in gen if t not in stop])))
    for p, s in samples:
        log(f"sample {p!r} -> {s!r}")
    write_readme(out, a, args, num_params(model), len(train), len(held), len(chats), len(train_ids),
                 len(held_ids), math.exp(nll), math.exp(nll32), bpc, train_s, time.time() - t_start, samples)
    log(f"wrote {out} in {(time.time() - t_start) / 60:.1f} min")


def psf_licence(corpus_dir: Path) -> str:
    """The PSF License Agreement as license.html of the corpus states it."""
    parser = _DocText()
    parser.feed((corpus_dir / "license.html").read_text(encoding="utf-8"))
    blocks = parser.blocks
    for i, (kind, text) in enumerate(blocks[:-1]):
        if kind in HEADINGS and text.startswith("PSF LICENSE AGREEMENT") and blocks[i + 1][0] == "pre":
            return f"{text}\n\n{blocks[i + 1][1]}"
    raise ValueError(f"corpus: no PSF License Agreement in {corpus_dir / 'license.html'}")


def write_readme(out: Path, a: argparse.Namespace, args: ModelArgs, n_params: int, n_train: int, n_held: int,
                 n_chats: int, train_tokens: int, held_tokens: int, ppl: float, ppl32: float, bpc: float,
                 train_s: float, total_s: float, samples: list[tuple[str, str]]) -> None:
    lines = [
        "# ernie-4.5-demo: a tiny ERNIE-4.5 trained on the Python documentation",
        "",
        "The model `make demo` runs offline. It has the architecture of ERNIE-4.5's dense models",
        "(`Ernie4_5ForCausalLM`: RMSNorm, interleaved rotary embedding, grouped-query attention, SiLU-gated",
        "MLP, no biases, tied input/output embeddings), only much smaller, and was trained from scratch on",
        "CPU by `tools/train_demo_model.py`. It writes English in the style of the Python documentation; it",
        "knows little and is often wrong. It is for trying the engine, not for answers.",
        "",
        "Files are in the Hugging Face layout transformers' `save_pretrained` writes (keys `model.*`, linear",
        "weights [out, in], bfloat16 safetensors, no `lm_head.weight` since it is tied), so both this project",
        "and transformers load it. The sentencepiece tokenizer has ERNIE's special tokens at the ids layout of",
        "`tests/fixtures/tokenizers/ernie_sp` and an ERNIE-style chat template.",
        "",
        "## Parameters",
        "",
        f"- {n_params / 1e6:.2f} M parameters: {args.num_hidden_layers} layers, hidden {args.hidden_size}, "
        f"MLP {args.intermediate_size}, {args.num_attention_heads} query heads / {args.num_key_value_heads} "
        f"key-value heads of {args.head_dim}, vocabulary {args.vocab_size}, rope theta {args.rope_theta:g}",
        f"- trained context {a.seq_len} tokens (config allows 2048 positions; text beyond {a.seq_len} tokens "
        "degrades)",
        f"- training: {a.steps} AdamW steps (betas 0.9/0.95, weight decay 0.1, clip 1.0) of {a.batch_size} x "
        f"{a.seq_len} tokens, peak lr {a.lr:g}, {a.warmup} warm-up steps then cosine to a tenth, seed {a.seed}, "
        f"{a.steps * a.batch_size * a.seq_len / train_tokens:.2f} epochs",
        f"- training time: {train_s / 60:.1f} min for the steps, {total_s / 60:.1f} min in all (corpus, "
        "tokenizer, evaluation), one thread of a 2-core AMD EPYC VM",
        "",
        "## Corpus and licence",
        "",
        "The Python 3.11 documentation as Debian's `python3.11-doc` package ships it (HTML under",
        "/usr/share/doc/python3.11/html), converted to text with Python's html.parser; index and search",
        f"pages skipped. {n_train} pages ({train_tokens / 1e6:.2f} M tokens) for training, plus {n_chats} chat turns",
        "made from the same pages (a section heading asked as a question, its first paragraphs as the",
        f"answer); {n_held} pages held out.",
        "",
        "Python's documentation is licensed under the PSF License Agreement (code examples in it also under",
        "the Zero-Clause BSD licence); see license.html in the package. These weights and this tokenizer are",
        "derived from it and are distributed under the same agreement, which asks that it and PSF's copyright",
        "notice be retained: Copyright (c) 2001-2023 Python Software Foundation; All Rights Reserved.",
        "",
        "```",
        psf_licence(Path(a.corpus)),
        "```",
        "",
        "## Held-out perplexity",
        "",
        f"{ppl:.2f} per token ({bpc:.3f} bits per character) on the {n_held} held-out pages "
        f"({held_tokens / 1e3:.0f} k tokens, non-overlapping {a.seq_len}-token windows), with the shipped bfloat16 "
        f"weights ({ppl32:.2f} with the float32 weights before rounding).",
        "",
        "## Sample outputs (greedy)",
        "",
    ]
    for prompt, text in samples:
        lines += ["```", f"{prompt}{text}".rstrip(), "```", ""]
    (out / "README.md").write_text("\n".join(lines), encoding="utf-8")


if __name__ == "__main__":
    sys.exit(main())
