"""Print the chat template a model is served with, and the tool call format chosen from it;
optionally render a sample conversation.

    python scripts/print_chat_template.py [MODEL] [--render] [--tools]

MODEL is a model directory or a tag in the BentoML model store (default: the default model). The
service config's `tokenizer.chat_template` (LLGTRT_CONFIG files) replaces the model's template
here as it does in the server.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llgtrt_core.chat_template import ChatTemplate  # noqa: E402
from llgtrt_core.config import load_config  # noqa: E402
from llgtrt_core.model_store import DEFAULT_MODEL_NAME  # noqa: E402
from llgtrt_core.tokenizer import Tokenizer  # noqa: E402
from llgtrt_core.tools import detect_tool_format, plan_tools, template_inputs  # noqa: E402

SAMPLE_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
SAMPLE_MESSAGES = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "{\"temperature_c\": 21}"},
]


def model_dir(model: str) -> Path:
    if Path(model).is_dir():
        return Path(model)
    import bentoml

    tag = model if ":" in model else f"{model}:latest"
    return Path(bentoml.models.get(tag).path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", default=DEFAULT_MODEL_NAME, help="model directory or store tag")
    parser.add_argument("--render", action="store_true", help="also render a sample conversation")
    parser.add_argument("--tools", action="store_true", help="with --render: a tool call and its result")
    args = parser.parse_args()
    directory = model_dir(args.model)
    tokenizer = Tokenizer(directory)
    template = tokenizer.chat_template
    config = load_config().tokenizer
    override = config.chat_template
    if override is not None:
        template = ChatTemplate(Path(override).read_text(encoding="utf-8"), tokenizer.special_tokens)
    if template is None:
        sys.exit(f"{directory} has no chat template")
    tool_format = detect_tool_format(template.source, config.tool_format)
    print(template.source)
    print(f"# tool call format: {tool_format.name}")
    if args.render:
        messages = SAMPLE_MESSAGES if args.tools else SAMPLE_MESSAGES[:1]
        plan = plan_tools({"tools": [SAMPLE_TOOL]}, tool_format) if args.tools else None
        messages, tools = template_inputs(messages, plan, tool_format)
        print("# rendered:")
        print(template.render(messages, tools=tools), end="")


if __name__ == "__main__":
    main()
