"""A tiny locally-built causal LM (few-layer Llama) and a BPE tokenizer trained with `tokenizers`;
a tiny BERT encoder with a WordPiece tokenizer.

Used by tests instead of the real SmolLM2 / all-MiniLM-L6-v2 so they run in seconds; the LM has a
ChatML chat template like SmolLM2 so prompts are rendered through the same code path.
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


def build_tiny_bert(out: Path, extra_words: tuple[str, ...] = ()) -> Path:
    """A tiny randomly initialised BERT encoder (hidden 32, 2 layers) with a WordPiece tokenizer
    trained on the synthetic corpus (plus ``extra_words``), saved as a transformers folder."""
    import torch
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import BertConfig, BertModel, PreTrainedTokenizerFast

    from clarifier.core.prompt import PromptOptions, render_user_message
    from clarifier.core.schema import Passage, Turn

    out = Path(out)
    if (out / "config.json").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tk = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tk.normalizer = normalizers.BertNormalizer(lowercase=True)
    tk.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tk.decoder = decoders.WordPiece()
    rendered = render_user_message([Turn(role="user", text="hi"), Turn(role="assistant", text="hello")], "which one?",
                                   [Passage(id="p1", text="a passage")], PromptOptions(), first_turn=1)
    tk.train_from_iterator(_corpus() + [rendered, "0123456789()[]-:,.?!"] + list(extra_words),
                           trainers.WordPieceTrainer(vocab_size=800, special_tokens=specials))
    tk.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]",
        special_tokens=[("[CLS]", tk.token_to_id("[CLS]")), ("[SEP]", tk.token_to_id("[SEP]"))])
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                                  sep_token="[SEP]", mask_token="[MASK]", model_max_length=512)
    tok.save_pretrained(out)
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=512, pad_token_id=tok.pad_token_id)
    BertModel(cfg).save_pretrained(out, safe_serialization=True)
    return out
