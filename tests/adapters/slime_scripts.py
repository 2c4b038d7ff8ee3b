"""slime's launch scripts (../shared/peers/slime-scripts, unchanged) turned into the argument
list their ``train.py`` would get, with only paths, sizes and counts changed, and a tiny
random Qwen3 (qk-norm, GQA, tied embeddings, a chat template) to run them on a CPU."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

PEERS = Path(__file__).resolve().parents[3] / "shared" / "peers"
SLIME_SCRIPTS = PEERS / "slime-scripts" / "scripts"

#: the argument arrays run-qwen3-*.sh passes to train.py, in its order
ARRAYS = ("MODEL_ARGS", "CKPT_ARGS", "ROLLOUT_ARGS", "OPTIMIZER_ARGS", "GRPO_ARGS",
          "WANDB_ARGS", "PERF_ARGS", "EVAL_ARGS", "SGLANG_ARGS", "MISC_ARGS")  # fmt: skip

TINY = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}  # fmt: skip

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_qwen3(path: Path, moe: bool = False) -> tuple[Path, int]:
    """A random Qwen3 (or Qwen3-MoE) with a character-level tokenizer and a chat template;
    returns (directory, vocabulary size)."""
    import torch
    import transformers as tf
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {t: i for i, t in enumerate(specials + chars)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = tf.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        additional_special_tokens=specials,
    )  # fmt: skip
    fast.chat_template = CHAT_TEMPLATE
    torch.manual_seed(0)
    common = dict(TINY, vocab_size=len(vocab), max_position_embeddings=512,
                  tie_word_embeddings=not moe, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
                  eos_token_id=vocab["<|im_end|>"])  # fmt: skip
    if moe:
        cfg = tf.Qwen3MoeConfig(**common, num_experts=4, num_experts_per_tok=2,
                                moe_intermediate_size=32, norm_topk_prob=True)  # fmt: skip
        model = tf.Qwen3MoeForCausalLM(cfg)
    else:
        model = tf.Qwen3ForCausalLM(tf.Qwen3Config(**common))
    model.save_pretrained(path)
    fast.save_pretrained(path)
    return path, len(vocab)


def math_prompts(path: Path, n: int, start: int = 0) -> Path:
    """Prompts as dapo-math-17k has them: a chat ``messages`` list and a label."""
    rows = []
    for i in range(start, start + n):
        a, b = i % 7 + 1, i % 5 + 2
        rows.append({"prompt": [{"role": "user", "content": f"What is {a}+{b}?"}],
                     "label": str(a + b)})  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def script_argv(script: str, changes: dict[str, str], *, num_gpus: int) -> list[str]:
    """The arguments ``script`` gives ``train.py`` (its arrays, in its order, after the
    cluster flags it passes itself), each ``--flag value`` of ``changes`` replacing the
    script's value for that flag (paths, sizes and counts)."""
    text = (SLIME_SCRIPTS / script).read_text()
    model = re.search(r'source "\$\{SCRIPT_DIR\}/(models/[^"]+)"', text).group(1)
    model_text = (SLIME_SCRIPTS / model).read_text()
    arrays = "\n".join(re.findall(r"^[A-Z_]+_ARGS=\(\n.*?^\)", text, re.S | re.M))
    program = "\n".join([
        model_text, arrays,
        "printf '%s\\n' --actor-num-nodes 1 --actor-num-gpus-per-node " + str(num_gpus)
        + " --colocate " + " ".join(f'"${{{a}[@]}}"' for a in ARRAYS),
    ])  # fmt: skip
    out = subprocess.run(["bash", "-c", program], capture_output=True, text=True, check=True)
    argv = out.stdout.splitlines()
    for flag, value in changes.items():
        if flag not in argv:
            raise KeyError(f"{script} passes no {flag}")
        i = argv.index(flag)
        n = 1
        while i + 1 + n <= len(argv) - 1 and not argv[i + 1 + n].startswith("--"):
            n += 1
        argv[i + 1 : i + 1 + n] = value.split()
    return argv


#: the converter's runs in this session: (model flags, the HF files' digest) -> (--save, output)
_CONVERTED: dict[tuple[tuple[str, ...], str], tuple[Path, str]] = {}


def convert_once(
    model_flags: list[str], hf: Path, save: Path, run: Callable[[list[str]], str]
) -> str:
    """``python -m adapters.slime.convert_hf_to_torch_dist <model_flags> --hf-checkpoint HF
    --save SAVE``, run by ``run`` (given the arguments after the module; returns the
    output). slime's and miles' script tests convert the same tiny model with the same
    flags (their model flags are slime's ``scripts/models/*.sh``): a conversion already run
    in this session with these flags on a model of the same files is not run again, its
    ``--save`` folder is copied to ``save`` (the same files but the recorded source path)."""
    digest = hashlib.sha256()
    for f in sorted(p for p in hf.rglob("*") if p.is_file()):
        digest.update(f.relative_to(hf).as_posix().encode() + b"\0" + f.read_bytes())
    key = (tuple(model_flags), digest.hexdigest())
    if key in _CONVERTED:
        done, out = _CONVERTED[key]
        shutil.copytree(done, save)
        return out
    out = run([*model_flags, "--hf-checkpoint", str(hf), "--save", str(save)])
    _CONVERTED[key] = (save, out)
    return out
