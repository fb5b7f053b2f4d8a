"""A tiny locally-built causal LM (few-layer Llama) and a BPE tokenizer trained with `tokenizers`.

Used by tests instead of the real SmolLM2 so they run in seconds; it has a ChatML chat template
like SmolLM2 so prompts are rendered through the same code path.
"""

from __future__ import annotations

from pathlib import Path

CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _corpus() -> list[str]:
    from clarifier.data.synthetic import generate_conversations
    from clarifier.core.prompt import SYSTEM_PROMPT

    texts = [SYSTEM_PROMPT, "decision: clarify\ngrounding: turns=0,1 passages=none\nquestion: Which one?", "decision: answer"]
    for conv in generate_conversations(200, seed=123):
        for t in conv["turns"]:
            texts.append(t["text"])
            if t.get("label") and t["label"].get("clarifying_question"):
                texts.append(t["label"]["clarifying_question"])
    return texts


def build_tiny_model(out: Path) -> Path:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out = Path(out)
    if (out / "config.json").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(_corpus(), trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk, bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|im_end|>", unk_token="<|endoftext|>"
    )
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(out)
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, tie_word_embeddings=True,
    )
    LlamaForCausalLM(cfg).save_pretrained(out, safe_serialization=True)
    return out
