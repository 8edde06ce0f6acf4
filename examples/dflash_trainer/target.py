"""Frozen target LLM adapter: selected hidden states as drafter features, and greedy logits.

Supports HF causal LMs with the Qwen3/Llama layout (`model.model.embed_tokens`,
`model.model.layers`, `model.lm_head`), loaded from a local directory only.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .errors import InputError, MissingInput
from .run.placement import canonical_device
from .drafter.model import target_layer_ids

logger = logging.getLogger(__name__)


class TargetModel:
    """Wraps a frozen HF causal LM. Pass `mask_token_id` when there is no tokenizer."""

    def __init__(self, model: nn.Module, tokenizer: Any = None, *, num_feature_layers: int,
                 mask_token_id: int | None = None) -> None:
        _check_layout(model)
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.layer_ids = _feature_layer_ids(len(model.model.layers), num_feature_layers)
        if mask_token_id is None and tokenizer is not None:
            mask_token_id = choose_mask_token_id(model, tokenizer)
        if mask_token_id is not None and not 0 <= mask_token_id < self.vocab_size:
            raise ValueError(
                f"mask_token_id={mask_token_id} is not a row of the target's embedding matrix "
                f"(0..{self.vocab_size - 1}); pick an existing unused row"
            )
        self._mask_token_id = mask_token_id

    @classmethod
    def from_pretrained(cls, path: str | Path, *, num_feature_layers: int,
                        dtype: torch.dtype | None = None,
                        device: str | torch.device | None = None) -> TargetModel:
        """Load model and tokenizer from a local HF directory; never touches the network."""
        from transformers import AutoModelForCausalLM

        path = _checked_dir(path)
        config = _load_config(path)
        tokenizer = _load_tokenizer(path)
        _check_weights(path)
        kwargs = {"local_files_only": True, "config": config}
        if dtype is not None:
            kwargs["dtype"] = dtype
        model = AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
        if device is not None:
            model = model.to(device)
        target = cls(model, tokenizer, num_feature_layers=num_feature_layers)
        target.install_output_hooks()
        return target

    def install_output_hooks(self) -> None:
        """One tiny eager forward with hidden states: transformers installs its hidden-state hooks
        in the first such forward, under a lock Dynamo cannot trace, so inside the first compiled
        call that is a graph break and the model compiles as a second frame."""
        self.features(torch.zeros(1, 2, dtype=torch.long, device=self.device))

    @classmethod
    def shape_only(cls, path: str | Path, *, num_feature_layers: int) -> TargetModel:
        """Config, tokenizer, layer choice and mask token without reading the weights: the model
        is built on the meta device, so this costs no memory whatever the target's size. It also
        checks that the weight files exist and that their headers parse, so a bad directory is
        refused here, before any worker starts, rather than when the workers load the weights."""
        from transformers import AutoModelForCausalLM

        path = _checked_dir(path)
        config = _load_config(path)
        try:
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(config)
        except ValueError as err:  # a config class with no causal-LM model (e.g. an encoder's)
            raise InputError(f"{path / CONFIG}: {_first_line(err)}; DFlash needs a HF causal LM with the "
                             f"Qwen3/Llama layout (e.g. Qwen3ForCausalLM, LlamaForCausalLM)") from err
        tokenizer = _load_tokenizer(path)
        _check_weights(path)
        return cls(model, tokenizer, num_feature_layers=num_feature_layers)

    @property
    def config(self) -> Any:
        return self.model.config

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.model.model.embed_tokens

    @property
    def lm_head(self) -> nn.Linear:
        return self.model.lm_head

    @property
    def hidden_size(self) -> int:
        return self.embed_tokens.embedding_dim

    @property
    def feature_width(self) -> int:
        """The last dimension of ``features``: the hidden size times the feature layers."""
        return self.hidden_size * len(self.layer_ids)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the weights, so of the hidden states and the features."""
        return self.embed_tokens.weight.dtype

    @property
    def vocab_size(self) -> int:
        """Rows of the embedding matrix (may exceed the tokenizer's length)."""
        return self.embed_tokens.num_embeddings

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def mask_token_id(self) -> int:
        if self._mask_token_id is None:
            raise ValueError(
                "the target has no tokenizer to choose a mask token from; pass mask_token_id= "
                "(an existing embedding row that the data never uses)"
            )
        return self._mask_token_id

    # no_grad, not inference_mode: inference tensors cannot be saved for the drafter's backward.
    @torch.no_grad()
    def features(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B,S] -> concat of hidden_states[id+1] over layer_ids, [B,S,n*H]."""
        # No attention_mask: batches are unpadded, and building an all-ones mask costs a graph
        # break in transformers' mask code, which a whole-step capture cannot contain.
        out = self.model.model(input_ids=ids, output_hidden_states=True, use_cache=False)
        return self._select(out.hidden_states)

    @torch.no_grad()
    def logits_and_features(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [B,S] -> (logits [B,S,V], features [B,S,n*H]); used by eval."""
        out = self.model(input_ids=ids, attention_mask=torch.ones_like(ids),
                         output_hidden_states=True, use_cache=False)
        return out.logits, self._select(out.hidden_states)

    @torch.no_grad()
    def cached_logits_and_features(self, ids: torch.Tensor, cache: Any = None) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """logits_and_features() of ``ids`` [1,T] that follow the tokens ``cache`` holds (None: none),
        with transformers' KV cache: (logits [1,T,V], features [1,T,n*H], the cache, now holding them too).
        ``cache.crop(-k)`` drops its last k tokens (eval: the rejected draft tokens)."""
        out = self.model(input_ids=ids, past_key_values=cache, output_hidden_states=True, use_cache=True)
        return out.logits, self._select(out.hidden_states), out.past_key_values

    def _select(self, hidden_states: tuple[torch.Tensor, ...]) -> torch.Tensor:
        # Index 0 of hidden_states is the embedding output, so layer i's output is i + 1.
        return torch.cat([hidden_states[i + 1] for i in self.layer_ids], dim=-1)


@dataclasses.dataclass(frozen=True)
class TargetSource:
    """Where the frozen target comes from and how every component loads it: the target stages,
    the drafter replicas (for its embedding and LM head) and the evaluator."""

    path: str
    num_feature_layers: int
    dtype: torch.dtype

    def load(self, device: str | torch.device) -> TargetModel:
        return TargetModel.from_pretrained(self.path, num_feature_layers=self.num_feature_layers,
                                           dtype=self.dtype, device=device)

    def shape(self) -> TargetModel:
        """Config, tokenizer and mask token without the weights (TargetModel.shape_only)."""
        return TargetModel.shape_only(self.path, num_feature_layers=self.num_feature_layers)


class SharedTargets:
    """One frozen target per device, loaded on first use and then shared by every component on
    that device: its target stages, its drafter replicas (embedding and LM head) and the
    evaluator. Threads of one process can read one copy of frozen weights, so five target
    workers and three drafters on one GPU hold one copy of the target, not eight, and the
    process loads it once per device. Nothing updates its weights: they require no grad, the
    target stages and the evaluator run it under no_grad, and the drafters only read its
    embedding and LM head (their backward passes through them). transformers may set attributes
    or install hooks on the model in its first forward (hidden-state capture); that forward is
    one thread's: setups run one at a time, and first_call_in_turn orders first compiled calls.
    One lock serves all devices: setups load one at a time anyway (WorkerGroup's serial setups,
    hazard global-default-dtype)."""

    def __init__(self, source: TargetSource) -> None:
        self.source = source
        self._lock = threading.Lock()
        self._loaded: dict[torch.device, TargetModel] = {}

    def get(self, device: str | torch.device) -> TargetModel:
        device = torch.device(canonical_device(str(device)))
        with self._lock:  # a second caller for the device waits for the first one's load
            if device not in self._loaded:
                logger.info("loading the target %s on %s (shared by the components there)", self.source.path, device)
                self._loaded[device] = self.source.load(device)
            return self._loaded[device]


def choose_mask_token_id(model: nn.Module, tokenizer: Any) -> int:
    """An existing embedding row the data never uses (the paper never resizes embeddings).

    Preference: the first row past the tokenizer's vocabulary (padding rows, e.g. Qwen3's
    151669); else a reserved special token; else another special token that is not
    bos/eos/pad/unk and not used by the chat template.
    """
    rows = model.get_input_embeddings().num_embeddings
    if rows > len(tokenizer):
        return len(tokenizer)
    taken = {getattr(tokenizer, f"{name}_token_id", None) for name in ("bos", "eos", "pad", "unk")}
    template = getattr(tokenizer, "chat_template", None) or ""
    specials = {i: str(t) for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()
                if getattr(t, "special", False)}
    for i in getattr(tokenizer, "all_special_ids", []):
        specials.setdefault(i, tokenizer.convert_ids_to_tokens(i))
    candidates = sorted((i, text) for i, text in specials.items() if i not in taken and i < rows)
    for i, text in candidates:
        if "reserved" in text.lower():
            return i
    for i, text in candidates:
        if text not in template:
            logger.info("using special token %r (id %d) as the DFlash mask token", text, i)
            return i
    raise ValueError(
        f"no unused embedding row for the mask token: the embedding has {rows} rows, the "
        f"tokenizer uses all of them, and it has no spare special token; pass mask_token_id "
        f"explicitly (the paper never adds rows)"
    )


CONFIG = "config.json"
# Files that carry a tokenizer's vocabulary: the fast tokenizer's, then slow tokenizers' (Qwen/GPT-2
# BPE, BERT WordPiece, SentencePiece). Without any of them transformers builds a one-token tokenizer
# from config.json instead of failing; tokenizer_config.json holds no vocabulary.
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "tokenizer.model", "vocab.txt", "spiece.model",
                   "sentencepiece.bpe.model")
# What transformers' from_pretrained loads from a local directory, in its order of preference.
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
_RESAVE = "write the directory again with model.save_pretrained() and tokenizer.save_pretrained()"


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


def _load_config(path: Path) -> Any:
    from transformers import AutoConfig

    file = path / CONFIG
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise InputError(f"{file} is not UTF-8 text; {_RESAVE}") from None
    except json.JSONDecodeError as err:
        raise InputError(f"{file} is not valid JSON ({err.msg} at line {err.lineno} column {err.colno}); "
                         f"{_RESAVE}") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("model_type"), str):
        raise InputError(f"{file} has no model_type, so it is not a HF model config; {_RESAVE}")
    try:
        return AutoConfig.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise InputError(f"{file} is not a config transformers can read ({_first_line(err)}); {_RESAVE}") from err


def _load_tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer

    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise MissingInput(f"target {path} has no tokenizer files (looked for {', '.join(TOKENIZER_FILES)}); save "
                           f"the target's tokenizer next to the model with tokenizer.save_pretrained('{path}')")
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise InputError(f"target {path}: its tokenizer files do not load ({_first_line(err)}); save the target's "
                         f"tokenizer again with tokenizer.save_pretrained('{path}')") from err


def _check_weights(path: Path) -> None:
    """The weight files from_pretrained will read exist, and each safetensors header parses
    (a header read, not a weight read: a truncated or corrupt file is named here)."""
    name = next((n for n in WEIGHT_FILES if (path / n).is_file()), None)
    if name is None:
        raise MissingInput(f"target {path} has no weights (looked for {', '.join(WEIGHT_FILES)}); copy them "
                           f"next to config.json or {_RESAVE}")
    files = _shards(path / name) if name.endswith(".index.json") else [path / name]
    for file in files:
        if not file.is_file():
            raise MissingInput(f"{file} is missing but {path / name} lists it; copy every shard of the target "
                               f"or {_RESAVE}")
        size = file.stat().st_size
        if file.name.endswith(".safetensors"):
            from safetensors import SafetensorError, safe_open

            try:
                with safe_open(str(file), framework="pt"):
                    pass
            except (SafetensorError, OSError) as err:
                raise InputError(f"{file} is not a readable safetensors file ({_first_line(err)}; {size} bytes): "
                                 f"it is truncated or corrupt; copy it again or {_RESAVE}") from None
        elif size == 0:
            raise InputError(f"{file} is empty; copy it again or {_RESAVE}")


def _shards(index: Path) -> list[Path]:
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
    except (UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        weight_map = None
    if not isinstance(weight_map, dict) or not weight_map or not all(isinstance(v, str) for v in weight_map.values()):
        raise InputError(f"{index} is not a shard index (a JSON object whose weight_map names each tensor's "
                         f"file); {_RESAVE}")
    return [index.parent / name for name in sorted(set(weight_map.values()))]


def _feature_layer_ids(num_layers: int, n: int) -> list[int]:
    """target_layer_ids, its refusal naming the flag that sets the count."""
    try:
        return target_layer_ids(num_layers, n)
    except ValueError as err:
        raise InputError(f"--num-target-layers-used {n} (it defaults to --num-draft-layers): {err}") from None


def _checked_dir(path: str | Path) -> Path:
    path = Path(path)
    if path.is_file():
        raise InputError(f"target {path} is a file; pass a local HF model directory (with config.json and weights) "
                         f"or leave target unset for the embedded default")
    if not path.is_dir():
        raise MissingInput(
            f"target directory {path} does not exist; pass a local HF model directory "
            f"(with config.json and weights) or leave target unset for the embedded default"
        )
    if not (path / "config.json").is_file():
        raise MissingInput(
            f"{path / 'config.json'} is missing; the target must be a HF model directory "
            f"as written by save_pretrained()"
        )
    return path


def _check_layout(model: nn.Module) -> None:
    inner = getattr(model, "model", None)
    missing = [name for name, ok in (
        ("model.model", inner is not None),
        ("model.model.embed_tokens", hasattr(inner, "embed_tokens")),
        ("model.model.layers", hasattr(inner, "layers")),
        ("model.lm_head", hasattr(model, "lm_head")),
    ) if not ok]
    if missing:
        raise InputError(
            f"unsupported target {type(model).__name__}: missing {missing}; DFlash needs a HF "
            f"causal LM with the Qwen3/Llama layout (e.g. Qwen3ForCausalLM, LlamaForCausalLM)"
        )
