"""Offline tokenizers for the tiny test/demo models (no hub access, no sentencepiece).

Each builder returns a real ``transformers`` tokenizer of the kind the family's pipeline
expects; ``save_pretrained`` + ``AutoTokenizer.from_pretrained`` round-trips it offline.
Vocabularies are the byte alphabet (so any prompt tokenises) plus a few whole-word merges.
"""

from __future__ import annotations

# Words of the Qwen-Image prompt template: with whole-word merges the template's system
# prefix tokenises to exactly 34 tokens, the count QwenImagePipeline drops
# (prompt_template_encode_start_idx), so the tiny model conditions on the user prompt only.
_QWEN_WORDS = ["system", "user", "assistant", "Describe"] + [
    "Ġ" + w
    for w in (
        "the image by detailing color shape size texture quantity text spatial relationships of objects "
        "and background a cat dog photo"
    ).split()
]
_QWEN_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_PLAIN_WORDS = ("a", "cat", "dog", "photo", "of", "the", "red", "blue")


def _prefix_merges(words: list[str], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Left-to-right merges that build each word; adds the merged symbols to ``vocab``."""
    merges: list[tuple[str, str]] = []
    for word in words:
        for i in range(1, len(word)):
            pair = (word[:i], word[i])
            if pair not in merges:
                merges.append(pair)
            vocab.setdefault(word[: i + 1], len(vocab))
    return merges


def qwen2_tokenizer():
    """Byte-level BPE ``Qwen2Tokenizer`` with the chat special tokens Qwen-Image's template uses."""
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import Qwen2Tokenizer

    vocab = {c: i for i, c in enumerate(sorted(ByteLevel.alphabet()))}
    merges = _prefix_merges(_QWEN_WORDS, vocab)  # merges must be tuples, not "a b" strings
    tok = Qwen2Tokenizer(vocab=vocab, merges=merges)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = _QWEN_CHAT_TEMPLATE
    return tok


# The system text of the Qwen-Image-Edit templates (diffusers' pipeline_qwenimage_edit(_plus).py): with
# its words merged whole the template's prefix is exactly the 64 tokens the edit pipelines drop.
_QWEN_EDIT_SYSTEM = (
    "Describe the key features of the input image (color, shape, size, texture, objects, background), then "
    "explain how the user's text instruction should alter or modify the image. Generate a new image that meets "
    "the user's requirements while maintaining consistency with the original input where appropriate."
)
# Qwen2.5-VL's vision prompt tokens, in the order its processor and config name them.
QWEN_VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


def qwen2_vl_tokenizer():
    """``qwen2_tokenizer`` plus the vision tokens and the edit template's words: what the edit
    pipelines' Qwen2VLProcessor wraps (Qwen-Image's 34-token prefix is unchanged)."""
    return _vl_tokenizer(_QWEN_EDIT_SYSTEM, _QWEN_CHAT_TEMPLATE)


def _vl_tokenizer(system: str, chat_template: str):
    """Byte-level BPE with the chat and vision special tokens, Qwen-Image's words and ``system``'s merged whole."""
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import Qwen2Tokenizer

    words = [w for w, _ in qwen2_tokenizer().backend_tokenizer.pre_tokenizer.pre_tokenize_str(system)]
    vocab = {c: i for i, c in enumerate(sorted(ByteLevel.alphabet()))}
    merges = _prefix_merges(_QWEN_WORDS + [w for w in words if w not in _QWEN_WORDS], vocab)
    # " user" would stop at "Ġ" + "user" ("user" merges first, from the chat roles): join them last.
    merges += [("Ġ", w[1:]) for w in words if w.startswith("Ġ") and w[1:] in vocab and ("Ġ", w[1:]) not in merges]
    tok = Qwen2Tokenizer(vocab=vocab, merges=merges)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", *QWEN_VISION_TOKENS]})
    tok.chat_template = chat_template
    return tok


# Qwen-Image-2.1's system prompt (diffusers' pipeline_qwenimage21.py): merged whole, its prefix stays short.
_QWEN21_SYSTEM = "Comprehend and analyze the provided prompt."
# Qwen3-VL's chat template in brief: a message's content is a string or a list of text/image parts
# (QwenImage21Pipeline counts the tokens it drops from the system message it renders).
_QWEN3_VL_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for c in m['content'] %}{% if c['type'] == 'text' %}{{ c['text'] }}"
    "{% else %}<|vision_start|><|image_pad|><|vision_end|>{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def qwen3_vl_tokenizer():
    """``qwen2_vl_tokenizer``'s kind for Qwen3-VL (Qwen-Image-2.1's processor): the vision tokens, the 2.1
    system prompt's words merged, a chat template that renders list contents."""
    return _vl_tokenizer(_QWEN21_SYSTEM, _QWEN3_VL_CHAT_TEMPLATE)


def clip_tokenizer():
    """``CLIPTokenizer`` over the byte alphabet (with and without ``</w>``); max length 77 like CLIP-L."""
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import CLIPTokenizer

    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for c in sorted(ByteLevel.alphabet()):
        vocab.setdefault(c, len(vocab))
        vocab.setdefault(c + "</w>", len(vocab))
    merges: list[tuple[str, str]] = []
    for word in _PLAIN_WORDS:  # build "cat</w>" from "c","a","t</w>"
        symbols = list(word[:-1]) + [word[-1] + "</w>"]
        acc = symbols[0]
        for sym in symbols[1:]:
            pair = (acc, sym)
            acc = acc + sym
            if pair not in merges:
                merges.append(pair)
            vocab.setdefault(acc, len(vocab))
    # FluxPipeline pads CLIP input to tokenizer.model_max_length: keep the real 77.
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=77)


def t5_tokenizer(model_max_length: int = 32):
    """Unigram ``T5Tokenizer`` (FLUX's tokenizer_2, Wan's UMT5 tokenizer) without ``<extra_id_*>`` tokens.

    ``model_max_length`` is what the families use as the default text length for a tiny model
    (the real FLUX/Wan tokenizers say 512).
    """
    from transformers import T5Tokenizer

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    pieces += [("▁" + w, -1.0) for w in _PLAIN_WORDS]
    pieces += [(chr(c), -5.0) for c in range(33, 127)]
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=model_max_length)


# Mistral-Small's chat template in outline (FLUX.2-dev's tokenizer/chat_template.jinja): BOS, the system message
# in [SYSTEM_PROMPT] tags, each user turn in [INST] tags; message content is a list of text parts.
_MISTRAL_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% set text = m['content'] if m['content'] is string else m['content'] | map(attribute='text') | join('') %}"
    "{% if m['role'] == 'system' %}[SYSTEM_PROMPT]{{ text }}[/SYSTEM_PROMPT]"
    "{% elif m['role'] == 'user' %}[INST]{{ text }}[/INST]{% else %}{{ text }}</s>{% endif %}{% endfor %}"
)


def mistral_tokenizer():
    """``qwen2_tokenizer``'s byte-level BPE with Mistral's BOS/EOS and chat tags: what FLUX.2-dev's pipeline
    calls (``apply_chat_template`` with the system message, padded to the max length)."""
    tok = qwen2_tokenizer()
    tok.add_special_tokens({"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "additional_special_tokens":
                            ["[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[INST]", "[/INST]"]})
    tok.chat_template = _MISTRAL_CHAT_TEMPLATE
    return tok
