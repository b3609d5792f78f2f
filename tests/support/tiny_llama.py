"""Build a tiny random Llama and an offline tokenizer into a directory that
`vllm serve DIR` loads: no model can be downloaded here, and the engine's
scheduling, not the model's quality, is what the inference tier measures.

Run with the vLLM venv's Python (it needs torch, transformers, tokenizers):

    python tiny_llama.py DIR [HEADS]

HEADS attention heads of 64 dimensions each (1 by default): tensor parallel
N needs a multiple of N.
"""

from __future__ import annotations

import sys
from pathlib import Path

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "A request waits in the queue, then the engine runs its prefill and decode steps.",
    "Latency-sensitive services miss their targets when their threads wait for a CPU.",
    "Hello, how are you today? Tell me a story about a scheduler and a busy neighbour.",
    "one two three four five six seven eight nine ten eleven twelve",
]
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant: {% endif %}")


def build(out: Path, heads: int = 1) -> None:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(SENTENCES * 20, trainers.BpeTrainer(
        vocab_size=512, special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(fast), hidden_size=64 * heads, intermediate_size=128 * heads,
                         num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=heads,
                         max_position_embeddings=512,
                         bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id,
                         torch_dtype="float32")
    LlamaForCausalLM(config).save_pretrained(out)


if __name__ == "__main__":
    build(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 1)
