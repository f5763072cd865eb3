"""What the API needs to know of the model repository it fronts: the public models, the tokenizer and
limits of their preprocessing, the chat template.

Prompts are counted with the tokenizer and `add_special_tokens` setting that `preprocessing` itself
loads, so `usage.prompt_tokens` is the number of tokens the engines receive.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from disagg.openai.chat_template import ChatTemplate
from disagg.repository import parse_config
from disagg.serve.health import EngineModel, engine_models
from disagg.text import added_special_tokens, encode_prompt
from disagg.triton.load_board import board_key
from disagg.triton.preprocessing import Preprocessor

PUBLIC_MODELS = ("ensemble", "aggregated", "tensorrt_llm_bls")  # disaggregated, the aggregated baseline, the one-model front (orchestrator.bls)


@dataclass(frozen=True)
class Deployment:
    models: tuple[str, ...]
    pre: Preprocessor
    chat_template: ChatTemplate | None
    board_key: str = ""  # names the deployment's load board (disagg.triton.load_board)
    engines: tuple[EngineModel, ...] = ()
    service_classes: tuple[str, ...] = ()  # the orchestrators' (orchestrator.service_classes in the spec)

    @classmethod
    def load(cls, model_repository: str | Path) -> Deployment:
        repo = Path(model_repository)
        models = tuple(m for m in PUBLIC_MODELS if (repo / m / "config.pbtxt").is_file())
        if not models:
            raise FileNotFoundError(f"{repo}: none of the models {', '.join(PUBLIC_MODELS)} is in this repository")
        config = parse_config("preprocessing", (repo / "preprocessing" / "config.pbtxt").read_text())
        param = {key: value.string_value for key, value in config.parameters.items()}
        tokenizer_dir = (repo / param["tokenizer_dir"]).resolve()
        pre = Preprocessor.from_parameters(param.__getitem__, tokenizer_dir)
        return cls(models, pre, ChatTemplate.load(tokenizer_dir), board_key(repo), tuple(engine_models(repo)), _service_classes(repo))

    def prompt_tokens(self, text: str) -> int:
        return len(encode_prompt(self.pre.tokenizer, text, self.pre.add_special_tokens))

    def chat_prompt(self, messages: list[dict], add_generation_prompt: bool) -> str:
        """The conversation as the text to send as `text_input`. Templates write BOS themselves
        (`{{ bos_token }}`) because transformers tokenizes their output without special tokens; here
        preprocessing adds them, so a leading BOS the template wrote is dropped to keep one, and the
        engines get the ids of `apply_chat_template(..., tokenize=True)`."""
        if self.chat_template is None:
            raise LookupError("this model has no chat template (tokenizer_config.json has no chat_template); use /v1/completions")
        text = self.chat_template.render(messages, add_generation_prompt)
        if self.pre.add_special_tokens:
            lead, _ = added_special_tokens(self.pre.tokenizer)
            lead_text = self.pre.tokenizer.decode(list(lead), skip_special_tokens=False)
            if lead_text and text.startswith(lead_text):
                text = text[len(lead_text):]
        return text

    def default_max_tokens(self, prompt_tokens: int) -> int:
        """What a chat request without a limit may generate: the rest of max_seq_len, within max_output_len."""
        limits = self.pre.limits
        return max(1, min(limits.max_output_len, limits.max_seq_len - prompt_tokens))


def _service_classes(repo: Path) -> tuple[str, ...]:
    """The class names the orchestrators accept: every orchestrator of a repository is rendered with the same."""
    for name in ("disagg_orchestrator", "aggregated_orchestrator"):
        path = repo / name / "config.pbtxt"
        if path.is_file():
            param = parse_config(name, path.read_text()).parameters.get("service_classes")
            return tuple(json.loads(param.string_value or "{}")) if param is not None else ()
    return ()
