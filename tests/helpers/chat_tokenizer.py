"""A tiny byte-level BPE tokenizer with a Qwen3-style chat template, built here (no download): the
template renders ``<think>`` reasoning only for the assistant turns after the last user message, as
Qwen3's does, and ``enable_thinking=False`` opens the answer with an empty think block."""

CHAT_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}"
    "{%- set answer = m.content -%}{%- set thought = '' -%}"
    "{%- if m.reasoning_content is string -%}{%- set thought = m.reasoning_content -%}"
    "{%- elif '</think>' in answer -%}"
    "{%- set thought = answer.split('</think>')[0].split('<think>')[-1] -%}"
    "{%- set answer = answer.split('</think>')[-1].lstrip('\\n') -%}"
    "{%- endif -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if loop.index0 > ns.last_user -%}{{- '<think>\\n' + thought.strip('\\n') + '\\n</think>\\n\\n' -}}{%- endif -%}"
    "{{- answer + '<|im_end|>\\n' -}}"
    "{%- else -%}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and not enable_thinking -%}{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}"
    "{%- endif -%}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
CORPUS = ["What is two plus two? Two plus two is four.", "Let me think about the sum step by step.",
          "The capital of France is Paris. Tell me more about rivers and mountains.",
          "def add(a, b): return a + b  # numbers 0123456789", "Hello, how are you today? I am fine, thanks!"]


def qwen3_style_tokenizer(vocab_size: int = 400):
    """A PreTrainedTokenizerFast (byte-level BPE trained on CORPUS) with CHAT_TEMPLATE."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    core.train_from_iterator(CORPUS * 4, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   chat_template=CHAT_TEMPLATE)
