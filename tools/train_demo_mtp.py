"""Train a multi-token-prediction (MTP) head for the demo model models/ernie-4.5-demo and add it to the checkpoint.

Run (from the repository root; needs Debian's python3.11-doc package, the corpus the demo model was trained on):

    apt-get install -y python3.11-doc
    nohup .venv/bin/python tools/train_demo_mtp.py > /tmp/train_demo_mtp.log 2>&1 &
    .venv/bin/python tools/train_demo_mtp.py --steps 20 --no-write   # a quick try that leaves the checkpoint alone

The MTP layer is FastDeploy's ernie4_5_mtp: for position i, with the main model's final-normed hidden state h_i
(the output of model.norm, what the LM head multiplies) and the next token x_{i+1},

    z_i = mtp_linear_proj(concat([mtp_emb_norm(embed(x_{i+1})), mtp_hidden_norm(h_i)]))   # 2H -> H, no bias
    u   = mtp_block(z)                                 # one ERNIE-4.5 decoder layer, causal over the MTP positions
    logits_i = lm_head(model.norm(u_i))                # embedding, final norm and (tied) head are the main model's

and logits_i drafts x_{i+2}. The main model is loaded from the shipped bf16 checkpoint and frozen; only the
mtp_* tensors are trained. What a greedy speculative decoder accepts is the MTP's argmax at i agreeing with the
main model's argmax at i+1, so the loss is self-distillation: cross-entropy against the main model's own
softmax at i+1 (soft labels), plus --hard-weight times cross-entropy against the true token x_{i+2}. The
training stream is train_demo_model.py's (same pages, chat turns, tokenizer from the checkpoint, same held-out
pages), in shuffled 256-token windows. The MTP block starts as a copy of the main model's last layer,
mtp_linear_proj as N(0, 0.02), the norms at 1.

Written into models/ernie-4.5-demo/model.safetensors as model.mtp_emb_norm.0.weight, model.mtp_hidden_norm.0.weight,
model.mtp_linear_proj.0.weight [H, 2H] (embedding half first), model.mtp_block.0.* (HF layer layout), bf16.
Existing tensors are copied byte for byte and the metadata kept; the file is written to a temporary name,
read back and checked (old tensors byte-identical, new ones as trained), then renamed over the checkpoint.
A rerun replaces the mtp_* tensors it finds.

Held-out measures, with the shipped (bf16-rounded) weights:
  (a) teacher-forced: on the held-out pages (non-overlapping 256-token windows), how often the MTP's argmax at
      i equals the main model's argmax at i+1;
  (b) on the model's own greedy text: 20 prompts (the first 32 tokens of seeded held-out paragraphs), 64
      greedy tokens each from the main model, and the same agreement along the continuation (drafts of
      tokens 2..64 of it): the expected acceptance rate of a one-token draft in greedy speculative decoding.

Reproducible: fixed seed, one thread (OMP_NUM_THREADS=1 and MKL_DEBUG_CPU_TYPE=5, set by train_demo_model.py's
import before Paddle loads), fixed step count.

Measured on this machine (2-core AMD EPYC VM, one thread, the other core busy with other work), default arguments:
  corpus 10 s; 450 steps of 16 x 256 positions (1.84 M, 0.62 epoch) at ~1,870 positions/s in 16.4 min; 17.7 min
  in all. 0.92 M MTP parameters (+1.84 MB of bf16 in the checkpoint). Held-out agreement, bf16 weights:
  (a) teacher-forced 0.770 (35,072 positions; 0.031 with the initial weights; fp32 before rounding 0.770); for
      scale, the MTP's top-1 on the true x_{i+2} is 0.287 and the main model's own top-1 on x_{i+1} 0.299;
  (b) on greedy continuations 0.889 (1,260 drafts; per prompt 0.75..0.98). The demo model's greedy text is
      repetitive ("print(1, 1, 1, 1, ..."), easy to draft: likely why (b) is above (a).
  Shorter trials (150 steps, 10 prompts): init from the last layer 0.680 / 0.818 (a / b), random init
  0.655 / 0.813, --hard-weight 0.25 0.680 / 0.819; so the default is the last layer and no hard term.
  Reruns give byte-identical checkpoints (checked over two 4-step runs, one adding to the original file, one
  replacing the mtp_* tensors of a file that had them). `--measure-only` on the shipped checkpoint
  reproduces (a) and (b) exactly.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_demo_model as demo  # noqa: E402  (sets OMP_NUM_THREADS etc. before Paddle loads)

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import random  # noqa: E402
import struct  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import paddle  # noqa: E402
import paddle.nn.functional as F  # noqa: E402
import sentencepiece as spm  # noqa: E402
from paddle import nn  # noqa: E402

MTP_PREFIX = "model.mtp_"
log = demo.log


# ---------------------------------------------------------------- checkpoint

def read_safetensors(path: Path) -> tuple[dict, bytes]:
    """(header as stored, incl. __metadata__, in file order; the data section)."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def tensor_bytes(header: dict, data: bytes, name: str) -> bytes:
    start, end = header[name]["data_offsets"]
    return data[start:end]


def bf16_to_f32(buf: bytes, shape: list[int]) -> np.ndarray:
    u = np.frombuffer(buf, dtype="<u2").astype(np.uint32) << 16
    return u.view(np.float32).reshape(shape)


def load_tensors(header: dict, data: bytes) -> dict[str, np.ndarray]:
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] != "BF16":
            raise ValueError(f"{name}: expected BF16, found {info['dtype']}")
        out[name] = bf16_to_f32(tensor_bytes(header, data, name), info["shape"])
    return out


def set_block(layer: demo.Block, sd: dict[str, np.ndarray], p: str) -> None:
    """Inverse of demo.block_state_dict: HF [out, in] tensors under prefix p into a Paddle layer ([in, out])."""
    layer.input_layernorm.weight.set_value(sd[p + "input_layernorm.weight"])
    layer.post_attention_layernorm.weight.set_value(sd[p + "post_attention_layernorm.weight"])
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        getattr(layer, name).weight.set_value(np.ascontiguousarray(sd[p + f"self_attn.{name}.weight"].T))
    gate_up = np.concatenate([sd[p + "mlp.gate_proj.weight"].T, sd[p + "mlp.up_proj.weight"].T], axis=1)
    layer.gate_up_proj.weight.set_value(np.ascontiguousarray(gate_up))
    layer.down_proj.weight.set_value(np.ascontiguousarray(sd[p + "mlp.down_proj.weight"].T))


def model_args(config: dict) -> demo.ModelArgs:
    return demo.ModelArgs(
        vocab_size=config["vocab_size"], hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"], num_hidden_layers=config["num_hidden_layers"],
        num_attention_heads=config["num_attention_heads"], num_key_value_heads=config["num_key_value_heads"],
        head_dim=config["head_dim"], rms_norm_eps=config["rms_norm_eps"],
        rope_theta=config["rope_parameters"]["rope_theta"])


def load_main_model(args: demo.ModelArgs, sd: dict[str, np.ndarray]) -> demo.DemoErnie:
    """The shipped checkpoint in demo.DemoErnie, every parameter frozen."""
    model = demo.DemoErnie(args)
    model.embed_tokens.weight.set_value(sd["model.embed_tokens.weight"])
    model.norm.weight.set_value(sd["model.norm.weight"])
    for i, layer in enumerate(model.layers):
        set_block(layer, sd, f"model.layers.{i}.")
    for p in model.parameters():
        p.stop_gradient = True
    model.eval()
    return model


def write_checkpoint(path: Path, header: dict, data: bytes, new: dict[str, np.ndarray]) -> None:
    """Old tensors (minus any earlier mtp_*) byte for byte in their order, then the new ones as bf16; verified."""
    old_names = sorted((k for k in header if k != "__metadata__" and not k.startswith(MTP_PREFIX)),
                       key=lambda k: header[k]["data_offsets"][0])
    out_header: dict[str, object] = {}
    if "__metadata__" in header:
        out_header["__metadata__"] = header["__metadata__"]
    chunks, offset = [], 0
    for name in old_names:
        buf = tensor_bytes(header, data, name)
        out_header[name] = {**header[name], "data_offsets": [offset, offset + len(buf)]}
        chunks.append(buf)
        offset += len(buf)
    for name in sorted(new):
        buf = demo._bf16_bytes(new[name])
        out_header[name] = {"dtype": "BF16", "shape": list(new[name].shape),
                            "data_offsets": [offset, offset + len(buf)]}
        chunks.append(buf)
        offset += len(buf)
    raw = json.dumps(out_header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned, as train_demo_model.py writes it
    tmp = path.with_name(path.name + ".mtp-tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for c in chunks:
            f.write(c)

    # Read back before replacing the checkpoint.
    h2, d2 = read_safetensors(tmp)
    if h2.get("__metadata__") != header.get("__metadata__"):
        raise RuntimeError("metadata changed")
    if set(h2) - {"__metadata__"} != set(old_names) | set(new):
        raise RuntimeError("tensor names differ from what was meant to be written")
    for name in old_names:
        if tensor_bytes(h2, d2, name) != tensor_bytes(header, data, name) or h2[name]["shape"] != header[name]["shape"]:
            raise RuntimeError(f"{name} is not byte-identical")
    for name, value in new.items():
        back = bf16_to_f32(tensor_bytes(h2, d2, name), h2[name]["shape"])
        if back.shape != value.shape or not np.array_equal(back, bf16_to_f32(demo._bf16_bytes(value), value.shape)):
            raise RuntimeError(f"{name} reads back differently")
    if max(v["data_offsets"][1] for k, v in h2.items() if k != "__metadata__") != len(d2):
        raise RuntimeError("data section has trailing bytes")
    tmp.replace(path)
    log(f"wrote {path}: {len(old_names)} tensors kept byte-identical, {len(new)} MTP tensors added "
        f"({path.stat().st_size / 1e6:.2f} MB)")


# ---------------------------------------------------------------- model

class MTPHead(nn.Layer):
    """ERNIE-4.5's MTP layer. The main model is passed to forward, so parameters() are only the MTP's own."""

    def __init__(self, args: demo.ModelArgs, rotary: demo.Rotary) -> None:
        super().__init__()
        d = args.hidden_size
        self.mtp_emb_norm = demo.RMSNorm(d, args.rms_norm_eps)
        self.mtp_hidden_norm = demo.RMSNorm(d, args.rms_norm_eps)
        self.mtp_linear_proj = nn.Linear(2 * d, d, bias_attr=False,
                                         weight_attr=nn.initializer.Normal(std=0.02))
        self.mtp_block = demo.Block(args, rotary)

    def forward(self, main: demo.DemoErnie, hidden: paddle.Tensor, next_ids: paddle.Tensor) -> paddle.Tensor:
        """Logits drafting x_{i+2} from the main model's final-normed h_i [B, T, H] and x_{i+1} [B, T]."""
        e = self.mtp_emb_norm(main.embed_tokens(next_ids))
        g = self.mtp_hidden_norm(hidden)
        u = self.mtp_block(self.mtp_linear_proj(paddle.concat([e, g], axis=-1)))
        return paddle.matmul(main.norm(u), main.embed_tokens.weight, transpose_y=True)

    def load_hf(self, sd: dict[str, np.ndarray]) -> None:
        """The mtp_* tensors of a checkpoint (inverse of hf_state_dict)."""
        self.mtp_emb_norm.weight.set_value(sd["model.mtp_emb_norm.0.weight"])
        self.mtp_hidden_norm.weight.set_value(sd["model.mtp_hidden_norm.0.weight"])
        self.mtp_linear_proj.weight.set_value(np.ascontiguousarray(sd["model.mtp_linear_proj.0.weight"].T))
        set_block(self.mtp_block, sd, "model.mtp_block.0.")

    def hf_state_dict(self) -> dict[str, np.ndarray]:
        return {
            "model.mtp_emb_norm.0.weight": self.mtp_emb_norm.weight.numpy(),
            "model.mtp_hidden_norm.0.weight": self.mtp_hidden_norm.weight.numpy(),
            "model.mtp_linear_proj.0.weight": self.mtp_linear_proj.weight.numpy().T,  # Paddle [in, out]
            **demo.block_state_dict(self.mtp_block, "model.mtp_block.0."),
        }


def main_hidden(model: demo.DemoErnie, ids: paddle.Tensor) -> paddle.Tensor:
    """The main model's final-normed hidden states (what DemoErnie.forward multiplies by the head)."""
    x = model.embed_tokens(ids)
    for layer in model.layers:
        x = layer(x)
    return model.norm(x)


def head(model: demo.DemoErnie, h: paddle.Tensor) -> paddle.Tensor:
    return paddle.matmul(h, model.embed_tokens.weight, transpose_y=True)


# ---------------------------------------------------------------- evaluation

@paddle.no_grad()
def teacher_forced_agreement(main: demo.DemoErnie, mtp: MTPHead, stream: np.ndarray, seq_len: int, batch: int,
                             max_windows: int = 0) -> dict[str, float]:
    """Over non-overlapping windows of seq_len + 2 tokens: MTP argmax at i vs the main argmax at i+1 (and vs
    the true x_{i+2}), i = 0..seq_len-1; also the main model's own next-token accuracy for scale."""
    mtp.eval()
    w_len = seq_len + 2
    n = len(stream) // w_len
    if max_windows:
        n = min(n, max_windows)
    agree = true_mtp = true_main = count = 0
    for s in range(0, n, batch):
        w = np.stack([stream[j * w_len:(j + 1) * w_len] for j in range(s, min(n, s + batch))])
        h = main_hidden(main, paddle.to_tensor(w[:, :-1]))  # positions 0..seq_len
        main_arg = paddle.argmax(head(main, h), axis=-1).numpy()
        mtp_arg = paddle.argmax(mtp(main, h[:, :-1], paddle.to_tensor(w[:, 1:-1])), axis=-1).numpy()
        agree += int((mtp_arg == main_arg[:, 1:]).sum())
        true_mtp += int((mtp_arg == w[:, 2:]).sum())
        true_main += int((main_arg[:, 1:] == w[:, 2:]).sum())
        count += mtp_arg.size
    mtp.train()
    return {"agree": agree / count, "mtp_top1": true_mtp / count, "main_top1": true_main / count, "n": count}


def greedy_prompts(held: list[demo.Document], sp: spm.SentencePieceProcessor, n: int, length: int,
                   seed: int) -> list[list[int]]:
    """The first `length` tokens of n seeded held-out prose paragraphs (at least that long)."""
    paras = [t for d in held for kind, t in d.blocks if kind == "p" and len(sp.encode(t)) >= length + 8]
    return [sp.encode(t)[:length] for t in random.Random(seed).sample(paras, n)]


@paddle.no_grad()
def greedy_continuations(main: demo.DemoErnie, prompts: list[list[int]], max_new: int,
                         stop: set[int]) -> list[list[int]]:
    return [demo.greedy(main, p, max_new, stop) for p in prompts]


@paddle.no_grad()
def greedy_agreement(main: demo.DemoErnie, mtp: MTPHead, prompts: list[list[int]],
                     continuations: list[list[int]]) -> dict[str, float]:
    """Along prompt + greedy continuation c_0..c_{G-1}: the MTP at the position before c_k, fed c_k, drafts
    c_{k+1}; agreement = drafts equal to the main model's argmax there (= c_{k+1}), k = 0..G-2."""
    mtp.eval()
    agree = count = mismatched = 0
    per_prompt = []
    for p, c in zip(prompts, continuations):
        seq = p + c
        ids = paddle.to_tensor([seq])
        h = main_hidden(main, ids)
        main_arg = paddle.argmax(head(main, h), axis=-1).numpy()[0]
        mtp_arg = paddle.argmax(mtp(main, h[:, :-1], ids[:, 1:]), axis=-1).numpy()[0]  # mtp_arg[i] drafts i+2
        lo, hi = len(p) - 1, len(seq) - 2  # i such that x_{i+1} = c_0 .. x_{i+2} = c_{G-1}
        a = int((mtp_arg[lo:hi] == main_arg[lo + 1:hi + 1]).sum())
        mismatched += int((main_arg[lo + 1:hi + 1] != np.asarray(seq[lo + 2:hi + 2])).sum())
        agree += a
        count += hi - lo
        per_prompt.append(a / max(1, hi - lo))
    mtp.train()
    return {"agree": agree / count, "n": count, "min": min(per_prompt), "max": max(per_prompt),
            "main_vs_generated_mismatch": mismatched}


# ---------------------------------------------------------------- main

def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpus", default=demo.DEFAULT_CORPUS, help="directory of the Python docs HTML")
    ap.add_argument("--model", default=str(demo.DEFAULT_OUT), help="checkpoint directory to read and extend")
    ap.add_argument("--steps", type=int, default=450)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--hard-weight", type=float, default=0.0,
                    help="weight of the cross-entropy against the true token x_{i+2} (soft target has weight 1)")
    ap.add_argument("--init", choices=("last", "random"), default="last",
                    help="MTP block from the main model's last layer, or random like train_demo_model.py")
    ap.add_argument("--heldout-frac", type=float, default=0.02, help="as the demo model was trained")
    ap.add_argument("--data-seed", type=int, default=demo.SEED, help="the demo model's seed (corpus split)")
    ap.add_argument("--seed", type=int, default=4321)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--gen-len", type=int, default=64)
    ap.add_argument("--no-write", action="store_true", help="train and measure, leave the checkpoint alone")
    ap.add_argument("--measure-only", action="store_true",
                    help="no training: measure the MTP head the checkpoint already holds")
    return ap.parse_args()


def main() -> None:
    a = parse_args()
    t_start = time.time()
    paddle.set_device("cpu")
    if hasattr(paddle.base.core, "set_num_threads"):
        paddle.base.core.set_num_threads(1)
    paddle.seed(a.seed)
    model_dir = Path(a.model)
    ckpt = model_dir / "model.safetensors"

    # Corpus, split and tokenizer exactly as the demo model saw them.
    train, held, chats, train_texts = demo.split_corpus(demo.load_documents(Path(a.corpus)), a.data_seed,
                                                         a.heldout_frac)
    sp = spm.SentencePieceProcessor(model_file=str(model_dir / "tokenizer.model"))
    sep_id = sp.piece_to_id("<|end_of_sentence|>")
    train_ids = demo.encode_stream(sp, train_texts)
    held_ids = demo.encode_stream(sp, [d.text for d in held])
    log(f"corpus: {len(train)} training docs + {len(chats)} chat turns = {len(train_ids) / 1e6:.2f} M tokens; "
        f"{len(held)} held out ({len(held_ids) / 1e3:.0f} k tokens); {time.time() - t_start:.0f} s so far")

    header, data = read_safetensors(ckpt)
    sd = load_tensors(header, data)
    earlier = [k for k in sd if k.startswith(MTP_PREFIX)]
    if earlier and not a.measure_only:
        log(f"checkpoint already has {len(earlier)} mtp_* tensors: ignored, replaced on write")
    args = model_args(json.loads((model_dir / "config.json").read_text()))
    main_model = load_main_model(args, sd)
    nll = demo.heldout_nll(main_model, held_ids, a.seq_len, a.batch_size)
    main_model.eval()  # heldout_nll leaves it in train mode; nothing here depends on the mode
    log(f"main model: held-out perplexity {math.exp(nll):.2f} (the README states 47.99)")

    mtp = MTPHead(args, main_model.layers[0].rotary)
    if a.measure_only:
        mtp.load_hf(sd)
        a.steps, a.no_write = 0, True
    elif a.init == "last":
        set_block(mtp.mtp_block, sd, f"model.layers.{args.num_hidden_layers - 1}.")
    n_params = demo.num_params(mtp)
    decay = {p.name for p in mtp.parameters() if len(p.shape) >= 2}
    opt = paddle.optimizer.AdamW(learning_rate=a.lr, parameters=mtp.parameters(), beta1=0.9, beta2=0.95,
                                 weight_decay=0.1, apply_decay_param_fun=lambda n: n in decay,
                                 grad_clip=nn.ClipGradByGlobalNorm(1.0))
    source = "from the checkpoint" if a.measure_only else f"init {a.init}"
    log(f"MTP head: {n_params / 1e6:.3f} M parameters, {source}; {a.steps} steps x {a.batch_size} x "
        f"{a.seq_len} positions ({a.steps * a.batch_size * a.seq_len / len(train_ids):.2f} epochs), "
        f"hard weight {a.hard_weight}")

    eval_windows = 32
    before = teacher_forced_agreement(main_model, mtp, held_ids, a.seq_len, a.batch_size, eval_windows)
    log(f"at the start: held-out agreement (first {eval_windows} windows) {before['agree']:.3f}")

    # Windows of seq_len + 2 tokens: the main model runs on the first seq_len + 1, the MTP on positions
    # 0..seq_len-1 with x_1..x_seq_len, targets = main softmax at 1..seq_len and tokens x_2..x_{seq_len+1}.
    data_it = demo.batches(train_ids, a.seq_len + 1, a.batch_size, np.random.default_rng(a.seed))
    t_train, smooth, smooth_agree = time.time(), None, None
    v = args.vocab_size
    for step in range(1, a.steps + 1):
        frac = min(1.0, (step - a.warmup) / max(1, a.steps - a.warmup)) if step > a.warmup else 0.0
        opt.set_lr(a.lr * step / a.warmup if step <= a.warmup
                   else a.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * frac))))
        w = next(data_it)
        with paddle.no_grad():
            h = main_hidden(main_model, paddle.to_tensor(w[:, :-1]))
            teacher_logits = head(main_model, h[:, 1:])
            soft = F.softmax(teacher_logits, axis=-1).reshape([-1, v])
            teacher_arg = paddle.argmax(teacher_logits, axis=-1)
            hidden = h[:, :-1]
        logits = mtp(main_model, hidden, paddle.to_tensor(w[:, 1:-1]))
        flat = logits.reshape([-1, v])
        loss = F.cross_entropy(flat, soft, soft_label=True)
        if a.hard_weight:
            loss = loss + a.hard_weight * F.cross_entropy(flat, paddle.to_tensor(w[:, 2:].reshape([-1, 1])))
        loss.backward()
        opt.step()
        opt.clear_grad()
        agree = float((paddle.argmax(logits, axis=-1) == teacher_arg).astype("float32").mean())
        smooth = float(loss) if smooth is None else 0.95 * smooth + 0.05 * float(loss)
        smooth_agree = agree if smooth_agree is None else 0.95 * smooth_agree + 0.05 * agree
        if step % 10 == 0 or step == 1:
            el = time.time() - t_train
            log(f"step {step}/{a.steps} loss {smooth:.3f} train agreement {smooth_agree:.3f} "
                f"lr {opt.get_lr():.2e} {el:.0f} s ({step * a.batch_size * a.seq_len / el:.0f} tok/s, "
                f"eta {el / step * (a.steps - step):.0f} s)")
        if step % a.eval_every == 0 and step < a.steps:
            r = teacher_forced_agreement(main_model, mtp, held_ids, a.seq_len, a.batch_size, eval_windows)
            log(f"step {step}: held-out agreement (first {eval_windows} windows) {r['agree']:.3f}")
    train_s = time.time() - t_train

    tf32 = teacher_forced_agreement(main_model, mtp, held_ids, a.seq_len, a.batch_size)
    demo.round_to_bf16(mtp)  # what the checkpoint holds
    tf = teacher_forced_agreement(main_model, mtp, held_ids, a.seq_len, a.batch_size)
    log(f"held-out teacher-forced ({tf['n']} positions): MTP argmax = main argmax at i+1 {tf['agree']:.4f} "
        f"(fp32 before rounding {tf32['agree']:.4f}); MTP top-1 on the true x_(i+2) {tf['mtp_top1']:.4f}, "
        f"main model top-1 on x_(i+1) {tf['main_top1']:.4f}")

    t_gen = time.time()
    prompts = greedy_prompts(held, sp, a.prompts, a.prompt_len, a.seed)
    conts = greedy_continuations(main_model, prompts, a.gen_len, {sp.eos_id(), sep_id})
    g = greedy_agreement(main_model, mtp, prompts, conts)
    log(f"greedy continuations ({len(prompts)} held-out prompts of {a.prompt_len} tokens, up to {a.gen_len} new, "
        f"{g['n']} drafts): agreement {g['agree']:.4f} (per prompt {g['min']:.2f}..{g['max']:.2f}; "
        f"{g['main_vs_generated_mismatch']} positions where the full-sequence argmax differs from the generated "
        f"token), {time.time() - t_gen:.0f} s")
    for p, c in list(zip(prompts, conts))[:2]:
        log(f"sample {sp.decode(p)!r} -> {sp.decode(c)!r}")

    if not a.no_write:
        write_checkpoint(ckpt, header, data, mtp.hf_state_dict())
    log(f"training {train_s / 60:.1f} min, all {(time.time() - t_start) / 60:.1f} min")


if __name__ == "__main__":
    sys.exit(main())
