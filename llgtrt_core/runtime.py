"""What the HTTP layer needs of a loaded model: its name, tokenizer, tool-call format, engine and grammars,
its thinking section, and the per-request bounds it serves under."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from llgtrt_core.config import ServerConfig
from llgtrt_core.reasoning import ReasoningSettings

if TYPE_CHECKING:
    from llgtrt_core.constraints.grammar import GrammarCompiler
    from llgtrt_core.engine.interface import Engine
    from llgtrt_core.tokenizer import Tokenizer
    from llgtrt_core.tools import ToolFormat


@dataclass
class ModelRuntime:
    model_name: str  # the id /v1/models reports and requests must name
    tokenizer: "Tokenizer"
    engine: "Engine"
    tool_format: "ToolFormat"  # resolved once per model: config, else the chat template
    grammars: "GrammarCompiler"  # built once per model: every request's constraints, tool grammars, token bytes
    limits: ServerConfig = field(default_factory=ServerConfig)  # per-request bounds (api/field_limits.py)
    reasoning: Optional[ReasoningSettings] = None  # the thinking section; None: the model answers at once
