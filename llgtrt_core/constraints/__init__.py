"""Structured outputs: request fields -> llguidance grammar -> per-step token masks."""

from llgtrt_core.constraints.errors import GrammarRequestError
from llgtrt_core.constraints.grammar import (
    CompiledGrammar,
    GrammarCompiler,
    GrammarConstraint,
    GrammarText,
    build_ll_tokenizer,
    parser_limits,
)
from llgtrt_core.constraints.request_grammar import RequestGrammar, grammar_for_request, request_grammar

__all__ = [
    "CompiledGrammar",
    "GrammarCompiler",
    "GrammarConstraint",
    "GrammarRequestError",
    "GrammarText",
    "RequestGrammar",
    "build_ll_tokenizer",
    "grammar_for_request",
    "parser_limits",
    "request_grammar",
]
